//! Errors of the snapshot crate: one enum, each variant naming what was wrong.

use std::path::PathBuf;

/// Why a state image could not be encoded, decoded, read or written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A set of shards does not make one whole state.
    #[error("{0}")]
    Shards(String),
    /// The bytes are not a well-formed safetensors file.
    #[error("not a valid safetensors file: {0}")]
    Format(String),
    /// The safetensors header has no limpet metadata entry.
    #[error("safetensors header has no '{key}' metadata entry: not a limpet checkpoint")]
    MissingMeta {
        /// The metadata key that was looked for.
        key: &'static str,
    },
    /// The metadata JSON does not parse or lacks a field.
    #[error("checkpoint metadata is invalid: {0}")]
    Meta(String),
    /// The file was written by an incompatible format version.
    #[error("checkpoint format version {found} is not supported (this build reads version {supported})")]
    Version {
        /// Version found in the file.
        found: u32,
        /// Version this build reads and writes.
        supported: u32,
    },
    /// A tensor's bytes do not match the checksum recorded for it.
    #[error("tensor '{name}' is corrupted: checksum {found} does not match recorded {expected}")]
    Checksum {
        /// Tensor name.
        name: String,
        /// Checksum recorded in the metadata.
        expected: String,
        /// Checksum of the bytes found.
        found: String,
    },
    /// The metadata lists a tensor the file lacks, or the file holds one the metadata omits.
    #[error("tensor '{name}' {problem}")]
    TensorSet {
        /// Tensor name.
        name: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A tensor has a dtype limpet does not store.
    #[error("tensor '{name}' has unsupported dtype {dtype}")]
    Dtype {
        /// Tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A tensor's byte length does not fit its shape and dtype.
    #[error("tensor '{name}' has {bytes} bytes, but shape {shape:?} of {dtype} needs {needed}")]
    Size {
        /// Tensor name.
        name: String,
        /// Byte length given.
        bytes: usize,
        /// Shape given.
        shape: Vec<usize>,
        /// Dtype name.
        dtype: &'static str,
        /// Byte length the shape needs.
        needed: usize,
    },
    /// The recomputed content hash differs from the recorded one.
    #[error("content hash {found} does not match recorded {expected}: metadata was altered")]
    ContentHash {
        /// Hash recorded in the metadata.
        expected: String,
        /// Hash recomputed from the contents.
        found: String,
    },
    /// Reading or writing a file failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

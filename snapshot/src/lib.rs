//! The portable form of a training state, and its checkpoint files.
//!
//! A [`StateImage`] is what one rank knows about training at a step boundary: named raw tensors
//! (parameters and optimizer slots) plus [`StateMeta`] (step, data cursor, RNG position, the job
//! it belongs to). It carries no libtorch types, so the same bytes serve three uses: a local
//! checkpoint file, a state handoff to a newcomer, and a cross-rank equality check through
//! [`StateImage::content_hash`].
//!
//! Data flow: the trainer builds an image from its tensors ([`StateImage::new`] computes a
//! per-tensor checksum and the content hash), [`StateImage::encode`] turns it into safetensors
//! bytes with the metadata as JSON in the header, and [`write_atomic`] puts those bytes on disk
//! so that a crash leaves either the old file or the new one. [`StateImage::decode`] is the
//! reverse and trusts nothing: every failure names the tensor or field that was wrong.

#![forbid(unsafe_code)]

mod error;
mod file;
pub mod handoff;
mod image;
pub mod shards;
mod stream;

pub use error::SnapshotError;
pub use file::{
    job_fingerprint, read_file, read_header, read_meta, rename_durable, verify_file, write_atomic,
    write_image_atomic,
};
pub use image::{Dtype, RawTensor, RngState, StateImage, StateMeta, FORMAT_VERSION, LAYOUT_KEYS, META_KEY};
pub use stream::{meta_of_source, write_source_atomic, Position, TensorSource};

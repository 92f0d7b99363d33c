//! Checkpoint files written from a state's tensors as they are read, one tensor at a time,
//! with no [`crate::StateImage`] of the state: what a trainer's final checkpoint is written from,
//! where an image would be a second copy of the whole state in memory.
//!
//! The header comes first in the file and names every tensor's checksum and the content hash,
//! so the tensors are read twice: once to checksum them, once to write them (each checked
//! against its checksum, so a tensor that changed between the two reads fails the write and
//! leaves the old file in place). The file is byte for byte the one
//! [`crate::write_image_atomic`] writes from an image of the same state.

use crate::image::{checksum, content_hash_of, needed_bytes, Dtype};
use crate::{RngState, SnapshotError, StateMeta, FORMAT_VERSION, META_KEY};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A training state read a tensor at a time.
pub trait TensorSource {
    /// Each tensor's name, dtype and shape (names unique).
    fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)>;
    /// Tensor `name`'s bytes: little-endian elements in row-major order, read now.
    fn read(&self, name: &str) -> Result<Cow<'_, [u8]>, SnapshotError>;
}

/// The metadata of a state besides its tensors.
#[derive(Clone, Debug)]
pub struct Position {
    /// Optimizer steps taken.
    pub step: u64,
    /// Data cursor.
    pub cursor: u64,
    /// Training RNG position.
    pub rng: RngState,
    /// The job the state belongs to.
    pub job: serde_json::Value,
}

/// Writes the state of `position` and `source`'s tensors to `path` atomically (as
/// [`crate::write_atomic`]), holding one tensor's bytes at a time; returns the metadata
/// written, whose content hash is the one an image of the same state has.
pub fn write_source_atomic(
    path: &Path,
    position: Position,
    source: &dyn TensorSource,
) -> Result<StateMeta, SnapshotError> {
    // First read: each tensor's checksum, for the header.
    let (entries, meta) = checked_meta(position, source)?;
    // Second read, into the file as safetensors asks for each tensor.
    let fault = RefCell::new(None);
    let views = entries
        .iter()
        .map(|(name, (dtype, shape))| {
            let want = meta.checksums[name].as_str();
            (name.as_str(), Lazy { source, name, dtype: *dtype, shape, want, fault: &fault })
        })
        .collect::<Vec<_>>();
    let header = serde_json::to_string(&meta).map_err(|e| SnapshotError::Meta(e.to_string()))?;
    let header = HashMap::from([(META_KEY.to_string(), header)]);
    crate::file::atomically(path, |tmp| {
        safetensors::serialize_to_file(views, Some(header), tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => {
                SnapshotError::Io { op: "write", path: tmp.to_path_buf(), source }
            }
            e => SnapshotError::Format(e.to_string()),
        })?;
        // A tensor that failed to read or changed was written as zeros: the file is refused.
        fault.borrow_mut().take().map_or(Ok(()), Err)
    })?;
    Ok(meta)
}

/// The metadata (checksums and content hash) of the state of `position` and `source`'s
/// tensors, read one at a time: what an image of the state names, without the image.
pub fn meta_of_source(position: Position, source: &dyn TensorSource) -> Result<StateMeta, SnapshotError> {
    Ok(checked_meta(position, source)?.1)
}

/// Each tensor's dtype and shape by name (checked unique), and the state's metadata.
#[allow(clippy::type_complexity)]
fn checked_meta(
    position: Position,
    source: &dyn TensorSource,
) -> Result<(BTreeMap<String, (Dtype, Vec<usize>)>, StateMeta), SnapshotError> {
    let mut entries = BTreeMap::new();
    for (name, dtype, shape) in source.entries() {
        if entries.insert(name.clone(), (dtype, shape)).is_some() {
            return Err(SnapshotError::Format(format!("tensor '{name}' is named twice")));
        }
    }
    let mut checksums = BTreeMap::new();
    for (name, (dtype, shape)) in &entries {
        let data = read_checked(source, name, *dtype, shape)?;
        checksums.insert(name.clone(), checksum(&data));
    }
    let Position { step, cursor, rng, job } = position;
    let tensors = entries.iter().map(|(n, (d, s))| (n.as_str(), *d, s.as_slice(), checksums[n].as_str()));
    let content_hash = content_hash_of(step, cursor, rng, &job, tensors);
    let meta = StateMeta { format: FORMAT_VERSION, step, cursor, rng, job, checksums, content_hash };
    Ok((entries, meta))
}

/// Reads tensor `name` and checks it holds exactly its shape's bytes.
fn read_checked<'s>(
    source: &'s dyn TensorSource,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
) -> Result<Cow<'s, [u8]>, SnapshotError> {
    let data = source.read(name)?;
    let needed = needed_bytes(dtype, shape);
    if data.len() != needed {
        return Err(SnapshotError::Size {
            name: name.to_string(),
            bytes: data.len(),
            shape: shape.to_vec(),
            dtype: dtype.name(),
            needed,
        });
    }
    Ok(data)
}

/// One tensor as safetensors' writer sees it: read when the writer asks for its bytes.
struct Lazy<'a> {
    source: &'a dyn TensorSource,
    name: &'a str,
    dtype: Dtype,
    shape: &'a [usize],
    want: &'a str,
    fault: &'a RefCell<Option<SnapshotError>>,
}

impl Lazy<'_> {
    fn len(&self) -> usize {
        needed_bytes(self.dtype, self.shape)
    }
}

impl safetensors::View for Lazy<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype.to_safetensors()
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // The writer has no way to fail here: a fault is kept, nothing is written for this
        // tensor or any after it (the file is short, and refused once the writer returns).
        if self.fault.borrow().is_some() {
            return Cow::Borrowed(&[]);
        }
        let fault = match read_checked(self.source, self.name, self.dtype, self.shape) {
            Ok(data) if checksum(&data) == self.want => return data,
            Ok(_) => SnapshotError::Format(format!(
                "tensor '{}' changed between its checksum and its write",
                self.name
            )),
            Err(e) => e,
        };
        *self.fault.borrow_mut() = Some(fault);
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StateImage;

    /// `image`'s position and tensors as a source: what a source of the same state must write.
    fn image_source(image: &StateImage) -> (Position, impl TensorSource + '_) {
        let m = image.meta();
        let position = Position { step: m.step, cursor: m.cursor, rng: m.rng, job: m.job.clone() };
        (position, ImageSource(image))
    }

    struct ImageSource<'a>(&'a StateImage);

    impl TensorSource for ImageSource<'_> {
        fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
            self.0.tensors().iter().map(|(n, t)| (n.clone(), t.dtype(), t.shape().to_vec())).collect()
        }
        fn read(&self, name: &str) -> Result<Cow<'_, [u8]>, SnapshotError> {
            let t = self
                .0
                .tensors()
                .get(name)
                .ok_or_else(|| SnapshotError::Format(format!("no tensor '{name}'")))?;
            Ok(Cow::Borrowed(t.data()))
        }
    }
    use crate::RawTensor;
    use std::cell::Cell;

    fn image() -> StateImage {
        let f = |name: &str, shape: Vec<usize>, k: f32| {
            let n = shape.iter().product::<usize>();
            let v: Vec<f32> = (0..n).map(|i| i as f32 * k - 3.0).collect();
            (name.to_string(), RawTensor::from_f32(name, shape, &v).unwrap())
        };
        let mut tensors: BTreeMap<_, _> =
            [f("param/w", vec![3, 5], 0.5), f("optim/m/w", vec![3, 5], 0.25), f("param/b", vec![5], 2.0)]
                .into();
        let e =
            RawTensor::try_new("exact", Dtype::I32, vec![2], vec![1, 0, 0, 0, 255, 255, 255, 255]).unwrap();
        tensors.insert("exact".into(), e);
        StateImage::new(9, 144, RngState { seed: 5, draws: 11 }, serde_json::json!({"model": "t"}), tensors)
    }

    /// The streamed file is the image's file byte for byte, and names its content hash.
    #[test]
    fn a_source_writes_the_file_its_image_writes() {
        let dir = tempfile::tempdir().unwrap();
        let img = image();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        crate::write_image_atomic(&a, &img).unwrap();
        let (position, source) = image_source(&img);
        let meta = write_source_atomic(&b, position, &source).unwrap();
        assert_eq!(meta.content_hash, img.content_hash());
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert_eq!(crate::read_file(&b).unwrap(), img);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "temporary left behind: {names:?}");
    }

    /// A source whose `k`th read of `name` gives other bytes, or fails, or a wrong length.
    struct Flaky<'a> {
        inner: &'a StateImage,
        name: &'a str,
        at: usize,
        how: u8,
        reads: Cell<usize>,
    }

    impl TensorSource for Flaky<'_> {
        fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
            image_source(self.inner).1.entries()
        }
        fn read(&self, name: &str) -> Result<Cow<'_, [u8]>, SnapshotError> {
            let data = self.inner.tensors()[name].data();
            if name != self.name {
                return Ok(Cow::Borrowed(data));
            }
            self.reads.set(self.reads.get() + 1);
            if self.reads.get() != self.at {
                return Ok(Cow::Borrowed(data));
            }
            match self.how {
                0 => {
                    let mut d = data.to_vec();
                    d[0] ^= 1;
                    Ok(Cow::Owned(d))
                }
                1 => Err(SnapshotError::Format("the device is gone".into())),
                _ => Ok(Cow::Owned(data[..4].to_vec())),
            }
        }
    }

    /// A tensor that changes between the checksum and the write, or fails to read, or reads
    /// short, fails the write naming it and leaves the old file and no temporary.
    #[test]
    fn a_tensor_that_changes_or_fails_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.safetensors");
        let img = image();
        crate::write_image_atomic(&path, &img).unwrap();
        let before = std::fs::read(&path).unwrap();
        for (at, how, says) in [
            (2, 0, "'param/w' changed"),
            (1, 1, "device is gone"),
            (2, 1, "device is gone"),
            (1, 2, "param/w"),
            (2, 2, "param/w"),
        ] {
            let source = Flaky { inner: &img, name: "param/w", at, how, reads: Cell::new(0) };
            let (position, _) = image_source(&img);
            let e = write_source_atomic(&path, position, &source).unwrap_err().to_string();
            assert!(e.contains(says), "read {at}, fault {how}: {e}");
            assert_eq!(std::fs::read(&path).unwrap(), before);
            let names: Vec<_> =
                std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(names.len(), 1, "temporary left behind: {names:?}");
        }
    }

    #[test]
    fn a_name_given_twice_is_refused() {
        struct Twice;
        impl TensorSource for Twice {
            fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
                vec![("w".into(), Dtype::U8, vec![1]), ("w".into(), Dtype::U8, vec![1])]
            }
            fn read(&self, _: &str) -> Result<Cow<'_, [u8]>, SnapshotError> {
                Ok(Cow::Owned(vec![0]))
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let position = Position { step: 0, cursor: 0, rng: RngState::new(1), job: serde_json::json!({}) };
        let e = write_source_atomic(&dir.path().join("x"), position, &Twice).unwrap_err();
        assert!(e.to_string().contains("'w' is named twice"), "{e}");
    }
}

//! A trainer's state written into a checkpoint file straight from its tensors, a tensor at a
//! time ([`Trainer::write_state_file`]), and its content hash read the same way
//! ([`Trainer::content_hash`]): no image of the state (a second copy of every parameter and
//! optimizer slot) is held beside it, as a checkpoint written while training goes on needs.

use super::{host_bytes, Trainer};
use crate::TrainerError;
use limpet_snapshot::{Dtype, Position, RawTensor, SnapshotError, TensorSource};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use tch::Tensor;

impl Trainer {
    /// Writes this trainer's whole state to `path` atomically, the file an image of it
    /// ([`Trainer::image`]) writes, byte for byte; returns its content hash. Each tensor is
    /// copied to the host twice (once for its checksum, once into the file), one at a time.
    pub fn write_state_file(&self, path: &Path) -> Result<String, TrainerError> {
        let (position, source) = self.source()?;
        Ok(limpet_snapshot::write_source_atomic(path, position, &source)?.content_hash)
    }

    /// Content hash of the current state (equal on ranks that hold the same state): its
    /// image's, read a tensor at a time without the image.
    pub fn content_hash(&self) -> Result<String, TrainerError> {
        let (position, source) = self.source()?;
        Ok(limpet_snapshot::meta_of_source(position, &source)?.content_hash)
    }

    /// The whole state's position and its tensors by their names in an image (refused while
    /// the optimizer state is sharded).
    fn source(&self) -> Result<(Position, Source<'_>), TrainerError> {
        self.refuse_sharded("the whole state")?;
        let params = self.model.params();
        let mut tensors: BTreeMap<String, &Tensor> =
            params.iter().map(|(name, p)| (format!("param/{name}"), p)).collect();
        tensors.extend(self.optim.named_state(params));
        let source = Source { tensors, exponents: self.exponents_tensor()? };
        let job = serde_json::to_value(&self.job).expect("JobSpec serializes");
        Ok((Position { step: self.step, cursor: self.cursor, rng: self.rng, job }, source))
    }
}

/// The trainer's tensors by their names in an image.
struct Source<'a> {
    tensors: BTreeMap<String, &'a Tensor>,
    exponents: Option<RawTensor>,
}

impl TensorSource for Source<'_> {
    fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        let shape = |t: &Tensor| t.size().iter().map(|&d| d as usize).collect();
        let mut all: Vec<_> = self.tensors.iter().map(|(n, t)| (n.clone(), Dtype::F32, shape(t))).collect();
        if let Some(e) = &self.exponents {
            all.push((crate::train::exact::EXPONENTS.to_string(), e.dtype(), e.shape().to_vec()));
        }
        all
    }

    fn read(&self, name: &str) -> Result<Cow<'_, [u8]>, SnapshotError> {
        match (self.tensors.get(name), &self.exponents) {
            (Some(t), _) => host_bytes(t)
                .map(Cow::Owned)
                .map_err(|e| SnapshotError::Format(format!("tensor '{name}': {e}"))),
            (None, Some(e)) if name == crate::train::exact::EXPONENTS => Ok(Cow::Borrowed(e.data())),
            (None, _) => Err(SnapshotError::Format(format!("no tensor '{name}'"))),
        }
    }
}

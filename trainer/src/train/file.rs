//! A trainer's state written into a checkpoint file straight from its tensors, a tensor at a
//! time ([`Trainer::write_state_file`]), and its content hash read the same way
//! ([`Trainer::content_hash`]): no image of the state (a second copy of every parameter and
//! optimizer slot) is held beside it, as a checkpoint written while training goes on needs.
//! A sharded trainer's whole state is written the same way, each optimizer tensor gathered
//! from the ranks' blocks when the file reaches it ([`Trainer::write_gathered_file`]).

use super::shard::OptimTensor;
use super::{host_bytes, Reduce, Trainer};
use crate::TrainerError;
use limpet_snapshot::{Dtype, Position, RawTensor, SnapshotError, TensorSource};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
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
        let mut source = self.params_source()?;
        source.tensors.extend(self.optim.named_state(self.model.params()));
        Ok((self.position(), source))
    }

    /// A source of the parameters (and a reproducible job's exponents), without the
    /// optimizer state.
    fn params_source(&self) -> Result<Source<'_>, TrainerError> {
        let tensors = self.model.params().iter().map(|(name, p)| (format!("param/{name}"), p)).collect();
        Ok(Source { tensors, exponents: self.exponents_tensor()?, gathered: None })
    }

    fn position(&self) -> Position {
        let job = serde_json::to_value(&self.job).expect("JobSpec serializes");
        Position { step: self.step, cursor: self.cursor, rng: self.rng, job }
    }

    /// Writes the whole state of a sharded trainer to `path` atomically (for the rank
    /// given one; the others of the group give `None`): a collective under `reduce`, every
    /// rank of the group calling it. The file is the one [`Trainer::gathered_image`] would
    /// write, byte for byte, while each rank holds one tensor of the optimizer state at a
    /// time: the file's two reads of the state (the header's checksums, then the tensors)
    /// each gather every optimizer tensor once, when the read reaches it, in the order of
    /// the tensors' names, which is the order both reads go in. Every rank gathers the same
    /// tensors in that order, a writer whose write failed the rest of them, so the group
    /// stays in step: `Err` is a gather's failure (the group is out of step), `Ok(Some(Err))`
    /// the file's alone (every gather was taken), and `Ok(Some(Ok(hash)))` the file written,
    /// with its content hash. The trainer keeps its blocks. An unsharded trainer writes its
    /// own state (no collective).
    pub fn write_gathered_file(
        &self,
        reduce: &mut dyn Reduce,
        path: Option<&Path>,
    ) -> Result<Option<Result<String, TrainerError>>, TrainerError> {
        if self.shard.is_none() {
            return Ok(path.map(|p| self.write_state_file(p)));
        }
        // Every rank gathers each optimizer tensor once for each of the file's two reads, in
        // the order of their names: the order both reads go in.
        let tensors = self.optim_tensors();
        let gather_all = |reduce: &mut dyn Reduce, done: usize| {
            gathers(&tensors)
                .skip(done)
                .try_for_each(|(_, t)| self.gathered_values(t.slot, t.values.clone(), reduce).map(drop))
        };
        let Some(path) = path else {
            gather_all(reduce, 0)?;
            return Ok(None);
        };
        let mut source = match self.params_source() {
            Ok(s) => s,
            Err(e) => {
                gather_all(reduce, 0)?;
                return Ok(Some(Err(e)));
            }
        };
        source.gathered = Some(Gather {
            trainer: self,
            reduce: RefCell::new(reduce),
            tensors: &tensors,
            done: Cell::new(0),
            failed: RefCell::new(None),
        });
        let written = limpet_snapshot::write_source_atomic(path, self.position(), &source);
        let gather = source.gathered.take().expect("set above");
        if let Some(e) = gather.failed.into_inner() {
            return Err(e);
        }
        gather_all(gather.reduce.into_inner(), gather.done.get())?;
        Ok(Some(written.map(|meta| meta.content_hash).map_err(TrainerError::from)))
    }
}

/// The gathers of [`Trainer::write_gathered_file`], in order: each optimizer tensor once for
/// each of the file's two reads.
fn gathers(tensors: &BTreeMap<String, OptimTensor>) -> impl Iterator<Item = (&String, &OptimTensor)> {
    tensors.iter().chain(tensors)
}

/// The trainer's tensors by their names in an image.
struct Source<'a> {
    tensors: BTreeMap<String, &'a Tensor>,
    exponents: Option<RawTensor>,
    /// A sharded trainer's optimizer state, gathered as it is read.
    gathered: Option<Gather<'a>>,
}

/// The optimizer state of a sharded trainer, each tensor gathered from the ranks' blocks (a
/// collective) when a read reaches it.
struct Gather<'a> {
    trainer: &'a Trainer,
    reduce: RefCell<&'a mut dyn Reduce>,
    tensors: &'a BTreeMap<String, OptimTensor>,
    /// How many of the [`gathers`] were taken.
    done: Cell<usize>,
    /// The gather that failed, after which nothing more is gathered.
    failed: RefCell<Option<TrainerError>>,
}

impl Gather<'_> {
    /// Optimizer tensor `name`'s bytes, gathered now: it must be the next of the
    /// [`gathers`] (the reads' order is the names', so it always is).
    fn read(&self, name: &str) -> Result<Vec<u8>, SnapshotError> {
        let done = self.done.get();
        let next = gathers(self.tensors).nth(done).filter(|(n, _)| *n == name);
        let Some((_, t)) = next.filter(|_| self.failed.borrow().is_none()) else {
            return Err(SnapshotError::Format(format!("tensor '{name}' was read out of the gathers' order")));
        };
        self.done.set(done + 1);
        match self.trainer.gathered_values(t.slot, t.values.clone(), &mut **self.reduce.borrow_mut()) {
            Ok(all) => Ok(all.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Err(e) => {
                let why = format!("tensor '{name}': {e}");
                *self.failed.borrow_mut() = Some(e);
                Err(SnapshotError::Format(why))
            }
        }
    }
}

impl TensorSource for Source<'_> {
    fn entries(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        let shape = |t: &Tensor| t.size().iter().map(|&d| d as usize).collect();
        let mut all: Vec<_> = self.tensors.iter().map(|(n, t)| (n.clone(), Dtype::F32, shape(t))).collect();
        if let Some(g) = &self.gathered {
            all.extend(g.tensors.iter().map(|(n, t)| (n.clone(), Dtype::F32, t.shape.clone())));
        }
        if let Some(e) = &self.exponents {
            all.push((crate::train::exact::EXPONENTS.to_string(), e.dtype(), e.shape().to_vec()));
        }
        all
    }

    fn read(&self, name: &str) -> Result<Cow<'_, [u8]>, SnapshotError> {
        let gathered = self.gathered.as_ref().filter(|g| g.tensors.contains_key(name));
        match (self.tensors.get(name), gathered, &self.exponents) {
            (Some(t), _, _) => host_bytes(t)
                .map(Cow::Owned)
                .map_err(|e| SnapshotError::Format(format!("tensor '{name}': {e}"))),
            (None, Some(g), _) => g.read(name).map(Cow::Owned),
            (None, None, Some(e)) if name == crate::train::exact::EXPONENTS => Ok(Cow::Borrowed(e.data())),
            (None, _, _) => Err(SnapshotError::Format(format!("no tensor '{name}'"))),
        }
    }
}

//! One step as one call: the way a data-parallel step runs ([`StepMode`]) is chosen once for
//! an epoch, from the job, the model, the state's sharding and the group's size (every rank
//! of a group chooses alike), and a step returns what it came to ([`StepOutcome`]): applied,
//! or broken between ranks (with the peer to blame), any other error being this rank's own.

use super::{StepStats, Trainer};
use crate::{Reduce, TrainerError};

/// How a data-parallel step runs (see [`Trainer::step_mode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// This rank's share, one sum of the whole buffer, the update.
    Plain,
    /// Buckets summed (or, with sharded state, reduce-scattered) as backward ends them.
    Overlapped,
    /// Sharded state: a reduce-scatter, the held blocks updated, the parameters gathered.
    Sharded,
    /// A reproducible job: canonical shards summed in fixed point.
    Exact,
}

/// What a step came to, when it did not fail on this rank.
#[derive(Debug)]
pub enum StepOutcome {
    /// Applied: the state is at the next step.
    Applied(StepStats),
    /// A collective between ranks broke: the group cannot go on, this rank can (the next
    /// epoch). A sharded step may have been applied first ([`Trainer::take_unlogged`]).
    Peer {
        /// The peer the transport blames, when it knows one.
        peer: Option<u64>,
        /// What happened.
        detail: String,
        /// A peer's bytes broke the protocol (a bug or a hostile peer), not the network.
        violation: bool,
    },
}

impl StepOutcome {
    /// A step's result as its outcome: a failed collective is the group's, any other
    /// error stays this rank's (`Err`).
    pub fn of(done: Result<StepStats, TrainerError>) -> Result<StepOutcome, TrainerError> {
        match done {
            Ok(stats) => Ok(StepOutcome::Applied(stats)),
            Err(TrainerError::Reduce { peer, detail, violation }) => {
                Ok(StepOutcome::Peer { peer, detail, violation })
            }
            Err(e) => Err(e),
        }
    }
}

impl Trainer {
    /// How this trainer's steps run in a group of `world` ranks: overlapped where the job
    /// and model allow (whole or sharded state), else sharded, reproducible or plain. A
    /// function of the job, the model and the state's sharding, which change only at an
    /// epoch's entry: chosen there, once.
    pub fn step_mode(&self, world: usize) -> StepMode {
        if self.overlaps(world) {
            StepMode::Overlapped
        } else if self.job.reproducible {
            StepMode::Exact
        } else if self.shard.is_some() {
            StepMode::Sharded
        } else {
            StepMode::Plain
        }
    }

    /// One whole step as `mode` says (what [`Trainer::step_mode`] chose for the epoch):
    /// compute this rank's share, reduce through `reduce`, apply.
    pub fn step_as(
        &mut self,
        mode: StepMode,
        rank: usize,
        world: usize,
        reduce: &mut (dyn Reduce + Send),
    ) -> Result<StepStats, TrainerError> {
        match mode {
            StepMode::Overlapped => self.overlapped_step(rank, world, reduce),
            StepMode::Sharded => self.sharded_step(rank, world, reduce),
            StepMode::Exact => self.exact_step(rank, world, reduce),
            StepMode::Plain => self.plain_step(rank, world, reduce),
        }
    }

    /// One whole step, its mode chosen now (see [`Trainer::step_mode`]).
    pub fn train_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut (dyn Reduce + Send),
    ) -> Result<StepStats, TrainerError> {
        self.step_as(self.step_mode(world), rank, world, reduce)
    }

    /// [`Trainer::step_as`], as its outcome (see [`StepOutcome::of`]).
    pub fn step_outcome(
        &mut self,
        mode: StepMode,
        rank: usize,
        world: usize,
        reduce: &mut (dyn Reduce + Send),
    ) -> Result<StepOutcome, TrainerError> {
        StepOutcome::of(self.step_as(mode, rank, world, reduce))
    }

    /// This rank's share, one sum of the whole buffer, the update.
    fn plain_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut (dyn Reduce + Send),
    ) -> Result<StepStats, TrainerError> {
        if self.shard.is_some() {
            // Chosen before the state was sharded: every rank of the group chose alike, so
            // none goes on reducing a buffer its peers no longer send.
            return Err(TrainerError::Config(
                "a plain step of sharded state (its mode was chosen before)".into(),
            ));
        }
        let (step, lossy) = (self.step, self.lossy_values());
        if self.grads.is_staged() && reduce.sums_on_device() {
            // Staged gradients summed where they lie: only the lanes' chunks cross the host.
            self.compute_share(rank, world, false)?;
            let on_device = self.grads.staged().expect("staged").shallow_clone();
            reduce.allreduce_sum_on_device(&on_device, self.grads.as_mut_slice(), lossy, step)?;
            return summed(self.apply_sums(true));
        }
        let buf = self.compute_grads(rank, world)?;
        reduce.allreduce_sum_bf16(buf, lossy, step)?;
        summed(self.apply_reduced())
    }
}

/// An update from sums the group made: a count that is not the global batch is a rank that
/// broke the protocol (a share missing or doubled), not a network fault to retry.
pub(super) fn summed(applied: Result<StepStats, TrainerError>) -> Result<StepStats, TrainerError> {
    applied.map_err(|e| match e {
        TrainerError::Reduce { peer, detail, .. } => TrainerError::Reduce { peer, detail, violation: true },
        other => other,
    })
}

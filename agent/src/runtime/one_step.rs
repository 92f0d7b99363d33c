//! One step of the trainer loop as one call: how this host steps ([`HostStep`]) is chosen
//! once, at the epoch's entry, and a step returns its outcome (applied, or broken between
//! ranks with the peer to blame) with the work it timed; any other error is this rank's.

use super::drill::Slowdown;
use super::entry::Conn;
use super::local_ranks::{self, RankThreads};
use crate::Group;
use limpet_consensus::state::Epoch;
use limpet_trainer::{LocalSums, StepMode, StepOutcome, Trainer, TrainerError};
use std::time::Duration;

/// How this host steps in an epoch: its ranks and connections, and the trainer's
/// [`StepMode`] (every rank of the epoch chooses alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HostStep {
    /// One rank per device of the host, the host's sum going between hosts.
    LocalRanks(StepMode),
    /// One rank on the ring.
    Ring(StepMode),
    /// A pipeline stage whose replicas are the host's devices.
    LocalStages,
    /// A pipeline stage.
    Stages,
}

impl HostStep {
    /// The way `trainer` steps in `epoch` over `conn` (its entry's connections).
    pub fn choose(trainer: &Trainer, epoch: &Epoch, conn: &Conn) -> HostStep {
        match conn {
            Conn::Ring(_) if !epoch.local_ranks.is_empty() => {
                HostStep::LocalRanks(trainer.step_mode(epoch.total_ranks()))
            }
            Conn::Ring(g) => HostStep::Ring(trainer.step_mode(g.world())),
            Conn::Stages(c) if c.local_ranks() > 1 => HostStep::LocalStages,
            Conn::Stages(_) => HostStep::Stages,
        }
    }
}

/// A step's own work on this host, which its speed estimate follows.
pub(super) struct Work {
    /// Samples this host computed.
    pub samples: usize,
    /// Milliseconds its own work took (a straggler drill's time included).
    pub ms: f64,
}

/// What a step needs of the trainer loop.
pub(super) struct Host<'a> {
    pub trainer: &'a mut Trainer,
    pub followers: &'a mut [Trainer],
    pub sums: &'a LocalSums,
    pub threads: &'a mut RankThreads,
    pub slowdown: &'a Slowdown,
}

/// Trains one step as `how` says, as node `me` (its index in `epoch`) over `conn` and the
/// ring's other `lanes`: its outcome, and its work where it is timed (not a reproducible
/// job's canonical shards, nor a pipeline's stages, whose plan times them otherwise).
pub(super) fn run(
    how: HostStep,
    host: Host<'_>,
    epoch: &Epoch,
    me: usize,
    (conn, lanes): (&mut Conn, &mut [Group]),
) -> Result<(StepOutcome, Option<Work>), TrainerError> {
    let Host { trainer, followers, sums, threads, slowdown } = host;
    match (how, conn) {
        (HostStep::LocalRanks(mode), Conn::Ring(g)) => {
            let done = local_ranks::step(mode, trainer, followers, epoch, me, (g, lanes), sums, threads);
            let (stats, local) = match done {
                Ok(done) => done,
                Err(e) => return Ok((StepOutcome::of(Err(e))?, None)),
            };
            let own = Duration::from_secs_f64(local.compute_ms / 1e3) + slowdown.per_samples(local.samples);
            let ms = slowdown.stretch(own).as_secs_f64() * 1e3;
            Ok((StepOutcome::Applied(stats), Some(Work { samples: local.samples, ms })))
        }
        (HostStep::Ring(StepMode::Exact), Conn::Ring(g)) => {
            // Whole canonical shards per rank (the speed-weighted shares do not apply).
            let (rank, world) = (g.rank(), g.world());
            Ok((trainer.step_outcome(StepMode::Exact, rank, world, g)?, None))
        }
        (HostStep::Ring(mode), Conn::Ring(g)) => {
            let (rank, world) = (g.rank(), g.world());
            let samples = trainer.plan().share_in(rank, world, &epoch.shares).len();
            // A straggler drill: its time before the step's collectives, so peers wait.
            let drill = slowdown.per_samples(samples);
            let outcome = trainer.step_outcome(mode, rank, world, g)?;
            let own = Duration::from_secs_f64(trainer.compute_ms() / 1e3) + drill;
            let work = matches!(outcome, StepOutcome::Applied(_))
                .then(|| Work { samples, ms: slowdown.stretch(own).as_secs_f64() * 1e3 });
            Ok((outcome, work))
        }
        (HostStep::LocalStages, Conn::Stages(c)) => {
            let local = c.local_ranks();
            let stepped =
                threads.fit(local - 1).and_then(|pool| c.step_local(trainer, followers, sums, pool));
            let outcome = StepOutcome::of(stepped)?;
            if let StepOutcome::Applied(_) = outcome {
                let own = crate::stage::slowest_compute_ms(trainer, followers, local);
                slowdown.stretch(Duration::from_secs_f64(own / 1e3));
            }
            Ok((outcome, None))
        }
        (HostStep::Stages, Conn::Stages(c)) => {
            let outcome = StepOutcome::of(c.step(trainer))?;
            if let StepOutcome::Applied(_) = outcome {
                slowdown.stretch(Duration::from_secs_f64(trainer.compute_ms() / 1e3));
            }
            Ok((outcome, None))
        }
        (how, _) => Err(TrainerError::Config(format!(
            "a step chosen as {how:?} over connections of another kind (chosen at the entry, which made both)"
        ))),
    }
}

//! A job's sharded optimizer state (`[job].shard_state = "optimizer"`) across epochs. At an
//! entry the new group re-cuts it directly: each rank takes the blocks the new layout gives
//! it from a live holder (so a `kill -9` of one holder loses nothing), the parameters and the
//! step's position come along, and no rank ever holds the whole state. In a new job's first
//! epoch every rank holds the same state: each cuts its own shard once the ranks agree on
//! its digest. Otherwise, where no rank holds a shard (a rank with whole state further on, a
//! checkpoint loaded) the entry copies whole states as for any job and the state is cut
//! once the entry agreed. Checkpoints the ranks
//! know are due are gathered whole. A block with no live holder sends every rank back to
//! the newest checkpoint.

use super::checkpointer;
use super::error::AgentError;
use crate::Group;
use limpet_consensus::state::{ClusterState, Epoch};
use limpet_trainer::{JobSpec, ShardLayout, Trainer, TrainerError};
use std::time::Instant;

/// How the state of a job that shards it entered an epoch.
pub(super) enum Sharded {
    /// Re-cut for the new group: the entry is done but for its barrier. The bytes this rank
    /// took from others (not those it passed on for them), and the time it took.
    Recut { bytes: u64, ms: u64 },
    /// The entry copies whole states as for any job, after `redone` steps were given up
    /// (a block lost with every holder sent the ranks back to a checkpoint).
    Whole { redone: u64 },
}

/// The first part of an entry into `n` for a job that shards its state (every rank of the
/// group calls it; `step_tag` marks the collectives). `Some`: the state is re-cut for the
/// new group, every rank at the same step with the same parameters: the entry is done but
/// for its barrier. `None`: the entry copies whole states: no rank held a shard, a rank held
/// whole state further on, the shards were gathered whole for the job's end, or a lost
/// block sent every rank back to a checkpoint. A rank left with state of another step than
/// the one rebuilt (or a shard) then starts afresh, so the entry copies the state to it as
/// to a newcomer.
pub(super) fn enter(
    trainer: &mut Trainer,
    group: &mut Group,
    job: &JobSpec,
    st: &ClusterState,
    n: &Epoch,
    step_tag: u64,
) -> Result<Sharded, AgentError> {
    if job.shard_state.is_none() {
        return Ok(Sharded::Whole { redone: 0 });
    }
    let (rank, world) = (group.rank(), group.world());
    let target = layout_of(trainer, job, n, rank);
    let recut = target.is_some();
    let started = Instant::now();
    match trainer.regroup(rank, world, target.clone(), step_tag, group) {
        Ok(Some(step)) if recut => {
            if step >= job.steps {
                // The job's final checkpoint is whole.
                trainer.unshard(group)?;
                tracing::info!(
                    epoch = n.id,
                    step,
                    "optimizer state gathered from its shards for the job's end"
                );
                return Ok(Sharded::Whole { redone: 0 });
            }
            // What this rank took from others (a relay passes some values on through ranks
            // between a giver and a taker, which these do not count).
            let bytes = trainer.regroup_values() * 4;
            let held = trainer.shard_layout().map(ShardLayout::held).unwrap_or_default();
            tracing::info!(epoch = n.id, step, ?held, bytes, "optimizer state re-cut for the new group");
            Ok(Sharded::Recut { bytes, ms: started.elapsed().as_millis() as u64 })
        }
        // Every rank takes this guard's collective (the facts, hence `None`, are the
        // group's); the step is checked after it, when it is known to be every rank's.
        Ok(None)
            if recut && all_hold_one_state(trainer, group, n, step_tag)? && trainer.step() < job.steps =>
        {
            let layout = target.expect("a re-cut has a layout");
            let held = layout.held();
            trainer.shard_state(layout)?;
            limpet_trainer::device::return_freed_host_memory();
            tracing::info!(
                epoch = n.id,
                rank,
                ?held,
                "every rank holds the same state: each keeps its own shard"
            );
            Ok(Sharded::Recut { bytes: 0, ms: started.elapsed().as_millis() as u64 })
        }
        Ok(rebuilt) => {
            if let Some(step) = rebuilt {
                tracing::info!(epoch = n.id, step, "optimizer state gathered from its shards for the entry");
            }
            if trainer.shard_layout().is_some() || rebuilt.is_some_and(|s| s != trainer.step()) {
                *trainer = fresh(trainer, job)?;
            }
            Ok(Sharded::Whole { redone: 0 })
        }
        Err(TrainerError::ShardLost(why)) => {
            let redone = back_to_checkpoint(trainer, group, job, st, n, &why, step_tag)?;
            Ok(Sharded::Whole { redone })
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether every rank of the group holds the same whole state, at a step the epoch may
/// start at (a new job's first epoch: each rank built it from the job's seed): then each
/// cuts its own shard and nothing moves. The entry protocol would find the same (every
/// rank keeps its state) after copying each state into an image, which would hold the whole
/// optimizer state twice more.
fn all_hold_one_state(
    trainer: &Trainer,
    group: &mut Group,
    n: &Epoch,
    step_tag: u64,
) -> Result<bool, AgentError> {
    const F: usize = 6;
    let (rank, world) = (group.rank(), group.world());
    let mut facts = vec![0i64; F * world];
    if let Ok(digest) = trainer.state_digest() {
        facts[F * rank] = 1;
        facts[F * rank + 1] = trainer.step() as i64;
        for (k, w) in digest.chunks(8).enumerate() {
            facts[F * rank + 2 + k] = i64::from_le_bytes(w.try_into().expect("8 bytes"));
        }
    }
    group.allreduce_sum_i64(&mut facts, step_tag)?;
    let first = &facts[..F];
    Ok(first[0] == 1 && first[1] >= n.start_step as i64 && facts.chunks(F).all(|f| f == first))
}

/// Every rank saw the same facts, so every rank comes here: each loads the newest
/// checkpoint it can read; one that cannot starts afresh and is copied the state in the
/// entry; if none can, every rank fails the entry alike. The steps this rank gives up.
fn back_to_checkpoint(
    trainer: &mut Trainer,
    group: &mut Group,
    job: &JobSpec,
    st: &ClusterState,
    n: &Epoch,
    why: &str,
    step_tag: u64,
) -> Result<u64, AgentError> {
    let loaded = checkpointer::newest(trainer, job, st);
    let mut read = vec![0i64; group.world()];
    read[group.rank()] = loaded.as_ref().map_or(0, |t| t.step() as i64 + 1);
    group.allreduce_sum_i64(&mut read, step_tag)?;
    if read.iter().all(|&r| r == 0) {
        return Err(AgentError::Entry(format!(
            "epoch {}: {why}, and no rank can read a checkpoint the log records",
            n.id
        )));
    }
    let to = read.iter().max().map_or(0, |&r| r.saturating_sub(1).max(0) as u64);
    tracing::error!(
        epoch = n.id,
        from = trainer.step(),
        to,
        %why,
        "a shard of the optimizer state is lost with every holder: back to the newest checkpoint"
    );
    metrics::counter!("limpet_shard_losses_total").increment(1);
    let redone = trainer.step().saturating_sub(to);
    *trainer = match loaded {
        Some(t) => t,
        None => fresh(trainer, job)?,
    };
    Ok(redone)
}

/// A trainer at step 0 of the job, on the same data and device: what a newcomer enters with.
fn fresh(trainer: &Trainer, job: &JobSpec) -> Result<Trainer, AgentError> {
    let blocks = 0..job.model.num_blocks();
    Ok(Trainer::on_device(job.clone(), trainer.data().shallow_clone(), blocks, trainer.model().device())?)
}

/// The layout of epoch `n`'s state for this rank (`None`: the job keeps it whole, the epoch
/// is pipelined, or the job's steps are done: its final checkpoint is whole).
pub(super) fn layout_for(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
    if trainer.step() >= job.steps {
        return None;
    }
    layout_of(trainer, job, n, rank)
}

/// The layout of epoch `n`'s state for this rank whatever the step (`None`: whole state).
fn layout_of(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
    let sharding = job.shard_state?;
    if n.layout.pipeline > 1 {
        return None;
    }
    let world = n.ranks.len();
    let replicas = sharding.replicas.min(world.saturating_sub(1));
    let len = trainer.buffer_len() - 3;
    ShardLayout::new(len, world, rank, replicas).ok().map(|l| l.tagged(n.id))
}

/// Cuts the whole state of an entered epoch into this rank's shard.
pub(super) fn shard_after_entry(
    trainer: &mut Trainer,
    job: &JobSpec,
    n: &Epoch,
    rank: usize,
) -> Result<(), AgentError> {
    if let Some(layout) = layout_for(trainer, job, n, rank) {
        let held = layout.held();
        trainer.shard_state(layout)?;
        tracing::info!(epoch = n.id, rank, ?held, "optimizer state sharded over the epoch's ranks");
    }
    Ok(())
}

//! A job's sharded optimizer state (`[job].shard_state = "optimizer"`) across epochs: made
//! whole in the new group as an entry begins (each block from a live holder, so a `kill -9`
//! of one holder loses nothing), so that the entry copies and checks whole states as for any
//! job; cut again for the new group once the entry agreed; gathered for the checkpoints
//! every rank knows are due. A block with no live holder sends every rank back to the newest
//! checkpoint.

use super::checkpointer;
use super::error::AgentError;
use crate::Group;
use limpet_consensus::state::{ClusterState, Epoch};
use limpet_trainer::{JobSpec, ShardLayout, Trainer, TrainerError};

/// Makes the state whole at the start of an entry into `n` (every rank of its group calls
/// it, sharded or not, when the job shards its state). `step_tag` marks the collectives. A
/// rank left with state of another step than the rebuilt one (or none) starts afresh, so
/// the entry copies the whole state to it as to a newcomer.
pub(super) fn gather_at_entry(
    trainer: &mut Trainer,
    group: &mut Group,
    job: &JobSpec,
    st: &ClusterState,
    n: &Epoch,
    step_tag: u64,
) -> Result<(), AgentError> {
    if job.shard_state.is_none() {
        return Ok(());
    }
    let (rank, world) = (group.rank(), group.world());
    match trainer.regroup(rank, world, None, step_tag, group) {
        Ok(rebuilt) => {
            if let Some(step) = rebuilt {
                tracing::info!(epoch = n.id, step, "optimizer state gathered from its shards for the entry");
            }
            if trainer.shard_layout().is_some() || rebuilt.is_some_and(|s| s != trainer.step()) {
                *trainer = fresh(trainer, job)?;
            }
            Ok(())
        }
        Err(TrainerError::ShardLost(why)) => back_to_checkpoint(trainer, group, job, st, n, &why, step_tag),
        Err(e) => Err(e.into()),
    }
}

/// Every rank saw the same facts, so every rank comes here: each loads the newest
/// checkpoint it can read; one that cannot starts afresh and is copied the state in the
/// entry; if none can, every rank fails the entry alike.
fn back_to_checkpoint(
    trainer: &mut Trainer,
    group: &mut Group,
    job: &JobSpec,
    st: &ClusterState,
    n: &Epoch,
    why: &str,
    step_tag: u64,
) -> Result<(), AgentError> {
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
    let to = read.iter().max().map_or(0, |&r| r - 1);
    tracing::error!(
        epoch = n.id,
        from = trainer.step(),
        to,
        %why,
        "a shard of the optimizer state is lost with every holder: back to the newest checkpoint"
    );
    metrics::counter!("limpet_shard_losses_total").increment(1);
    *trainer = match loaded {
        Some(t) => t,
        None => fresh(trainer, job)?,
    };
    Ok(())
}

/// A trainer at step 0 of the job, on the same data and device: what a newcomer enters with.
fn fresh(trainer: &Trainer, job: &JobSpec) -> Result<Trainer, AgentError> {
    let blocks = 0..job.model.num_blocks();
    Ok(Trainer::on_device(job.clone(), trainer.data().shallow_clone(), blocks, trainer.model().device())?)
}

/// The layout of epoch `n`'s state for this rank (`None`: the job keeps it whole, the epoch
/// is pipelined, or the job's steps are done: its final checkpoint is whole).
pub(super) fn layout_for(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
    let sharding = job.shard_state?;
    if n.layout.pipeline > 1 || trainer.step() >= job.steps {
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

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
/// it, sharded or not, when the job shards its state). `step_tag` marks the collectives.
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
        Ok(Some(step)) => {
            tracing::info!(epoch = n.id, step, "optimizer state gathered from its shards for the entry");
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(TrainerError::ShardLost(why)) => {
            // Every rank saw the same facts, so every rank comes here: all go back together.
            let Some(t) = checkpointer::newest(trainer, job, st) else {
                return Err(AgentError::Entry(format!(
                    "epoch {}: {why}, and no checkpoint the log records can be read here",
                    n.id
                )));
            };
            tracing::error!(
                epoch = n.id,
                from = trainer.step(),
                to = t.step(),
                %why,
                "a shard of the optimizer state is lost with every holder: back to the newest checkpoint"
            );
            metrics::counter!("limpet_shard_losses_total").increment(1);
            *trainer = t;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The layout of epoch `n`'s state for this rank (`None`: the job keeps it whole, or the
/// epoch is pipelined).
pub(super) fn layout_for(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
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

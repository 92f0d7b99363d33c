//! A rank's place and connections in a data x pipeline layout: which stage and replica it
//! is, a ring group among the replicas of its stage (gradients), a ring group among the
//! stages of its replica (the step's norm, loss and statistics), and the pipe links to its
//! neighbouring stages (activations and their gradients).
//!
//! Ranks are numbered data-major: rank `r * pipeline + s` is replica `r` of stage `s`.

use crate::dataplane::{DataPlaneError, Endpoint, Group, PipeLink};
use limpet_trainer::pipeline::{StagePosition, StageReducers};
use std::time::Instant;

/// Everything a stage rank trains over.
pub struct StageConnections {
    /// Where this rank sits.
    pub pos: StagePosition,
    /// The replicas of this rank's stage, in replica order.
    pub replicas: Group,
    /// The stages of this rank's replica, in stage order.
    pub stages: Group,
    /// Links to the previous and next stage of this replica.
    pub link: PipeLink,
}

impl StageConnections {
    /// Connects this node's rank of `epoch`, whose `ranks` (node ids, data-major) form
    /// `data` replicas of a `pipeline`-stage pipeline; `addrs` are their data addresses.
    pub fn connect(
        ep: &Endpoint,
        epoch: u64,
        (data, pipeline): (usize, usize),
        ranks: &[u64],
        addrs: &[String],
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<StageConnections, DataPlaneError> {
        if data == 0 || pipeline == 0 || data * pipeline != ranks.len() || addrs.len() != ranks.len() {
            return Err(DataPlaneError::Config(format!(
                "a {data}x{pipeline} layout over {} ranks and {} addresses",
                ranks.len(),
                addrs.len()
            )));
        }
        let me = ep.config().node;
        let i = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| DataPlaneError::Config(format!("node {me} is not in the rank order {ranks:?}")))?;
        let (replica, stage) = (i / pipeline, i % pipeline);
        let at = |r: usize, s: usize| r * pipeline + s;
        let pick = |idx: Vec<usize>| -> (Vec<u64>, Vec<String>) {
            (idx.iter().map(|&k| ranks[k]).collect(), idx.iter().map(|&k| addrs[k].clone()).collect())
        };
        let (rep_ranks, rep_addrs) = pick((0..data).map(|r| at(r, stage)).collect());
        let (st_ranks, st_addrs) = pick((0..pipeline).map(|s| at(replica, s)).collect());
        let replicas = ep.group_until(epoch, &rep_ranks, &rep_addrs, deadline, abort)?;
        let stages = ep.group_until(epoch, &st_ranks, &st_addrs, deadline, abort)?;
        let prev = (stage > 0).then(|| ranks[at(replica, stage - 1)]);
        let next = (stage + 1 < pipeline)
            .then(|| (ranks[at(replica, stage + 1)], addrs[at(replica, stage + 1)].as_str()));
        let link = PipeLink::connect(ep, epoch, prev, next, deadline, abort)?;
        let pos = StagePosition { stage, stages: pipeline, replica, replicas: data };
        Ok(StageConnections { pos, replicas, stages, link })
    }

    /// One pipelined step of `trainer` over these connections.
    pub fn step(
        &mut self,
        trainer: &mut limpet_trainer::Trainer,
    ) -> Result<limpet_trainer::StepStats, limpet_trainer::TrainerError> {
        trainer.pipeline_step(
            self.pos,
            &mut self.link,
            StageReducers { replicas: &mut self.replicas, stages: &mut self.stages },
        )
    }
}

/// Profiles `job`'s model on this host for the planner: every block's costs at the job's
/// micro-batch, and the step's time outside the blocks.
pub fn profile_model(
    job: &limpet_trainer::JobSpec,
    data: &limpet_trainer::data::Dataset,
    reps: usize,
) -> Result<crate::planner::ModelProfile, limpet_trainer::TrainerError> {
    let blocks = limpet_trainer::profile::profile_blocks(job, data, reps)?;
    let overhead_ms = limpet_trainer::profile::profile_step_overhead(job, data, &blocks, reps)?;
    let model = serde_json::to_value(&job.model)
        .ok()
        .and_then(|v| v["kind"].as_str().map(str::to_string))
        .unwrap_or_else(|| "model".into());
    Ok(crate::planner::ModelProfile { model, micro_batch: job.micro_batch, blocks, overhead_ms })
}

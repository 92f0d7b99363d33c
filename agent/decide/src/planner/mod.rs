//! The pipeline planner: which data x pipeline layout a set of hosts should train a model in.
//! Pure: it takes a profile of the model's blocks, the hosts (speed and memory) and the link,
//! and returns the layout with the lowest predicted step time, with its runners-up. Nothing
//! here measures or talks to anyone; the profiler lives in the trainer and the controller
//! calls [`plan`] when the hosts change.
//!
//! # Cost model
//!
//! A layout has `D` data-parallel replicas of a `P`-stage pipeline. Every replica uses the
//! same block cuts, so the `D` copies of a stage can sum their gradients with one allreduce.
//! Each replica trains its share of the global batch in `m` micro-batches on a 1F1B schedule.
//! For stage `s` on a host of relative speed `v`:
//!
//! - `c_s` = (forward + backward time of its blocks) / `v` + sending its output activation
//!   forward and its input gradient back, each `bytes / bandwidth + latency`;
//! - `tail_s` = ring allreduce of its gradients among the `D` replicas
//!   (`2 (D-1)/D x bytes / bandwidth + 2 (D-1) x latency`) + its optimizer step / `v`;
//! - memory = parameters + gradients + optimizer slots + the activations it keeps for
//!   backward, `min(m, P - s)` micro-batches of them under 1F1B.
//!
//! The step time is `sum_s c_s + (m - 1) max_s c_s + max_s tail_s`: filling and draining the
//! pipeline costs one pass through every stage, and the steady state runs at the pace of the
//! slowest stage (PipeDream, GPipe, Hydrozoa use the same form). Synchronous replicas of a
//! stage run at the pace of the slowest, so hosts are grouped by speed: sorted fastest
//! first, every run of `D` consecutive hosts is one *group*, and a stage is held by one group
//! (its replica `r` on the group's `r`-th host). Hosts left over after `floor(H / D)` groups
//! are spares.
//!
//! Hosts of several devices (`local_ranks`, the same on every host of a pipeline) hold their
//! stage on each device, and the devices split the host's share of the batch: the
//! micro-batches, the memory and the times above are one device's; the devices' activations
//! share the host's link (each sends at once on its own lane), and the stage's sum between
//! hosts carries one buffer a host, as before.
//!
//! # Search
//!
//! For every `(D, P)`, a dynamic program over (blocks placed, groups used) extends a partial
//! pipeline by one stage at a time: the next contiguous block range on an unused group.
//! Groups alike in speed and memory are interchangeable, so a state counts how many of each
//! such class it used (one count for a fleet of one instance type, not 2^groups masks). The
//! step time is not a sum over stages (it has two maxima), so each DP cell keeps the Pareto
//! front of (sum of `c`, max `c`, max `tail`); the front is exact, and [`exhaustive`] (every
//! cut, every ordered choice of groups) confirms it in the tests.

mod layout;
mod search;
pub use layout::{HostLayout, StageLayout};
pub use search::{exhaustive, plan, MAX_GROUPS};
use serde::{Deserialize, Serialize};

/// What one block of the model costs, measured on a host of speed 1 for one micro-batch (by
/// the trainer's profiler, `limpet_trainer::profile`, whose times are medians of repetitions).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockCost {
    /// Forward time, ms.
    pub fwd_ms: f64,
    /// Backward time, ms.
    pub bwd_ms: f64,
    /// The part of `fwd_ms` that does not shrink with the micro-batch (per-call overhead).
    #[serde(default)]
    pub fixed_fwd_ms: f64,
    /// The part of `bwd_ms` that does not shrink with the micro-batch.
    #[serde(default)]
    pub fixed_bwd_ms: f64,
    /// Optimizer step over the block's parameters, ms (once per step, not per micro-batch).
    pub apply_ms: f64,
    /// Bytes of the block's output for one micro-batch (what a stage boundary sends).
    pub out_bytes: u64,
    /// Bytes the block keeps for its backward pass, per micro-batch.
    pub saved_bytes: u64,
    /// Bytes of its parameters.
    pub param_bytes: u64,
    /// Bytes of its optimizer state.
    pub optim_bytes: u64,
}

/// A model's per-block costs at one micro-batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// What was profiled (for people reading a plan).
    pub model: String,
    /// Samples per micro-batch the costs are for.
    pub micro_batch: usize,
    /// The blocks, in model order.
    pub blocks: Vec<BlockCost>,
    /// Per micro-batch, what a step spends outside the blocks (reading samples, the loss,
    /// gathering gradients), ms; charged to the last stage.
    #[serde(default)]
    pub overhead_ms: f64,
}

/// One host the planner may use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Its name (a node name in a cluster).
    pub name: String,
    /// Compute speed relative to the profiled host (2.0 = twice as fast).
    pub speed: f64,
    /// Memory training may use, bytes.
    pub mem_bytes: u64,
}

/// The network between hosts (one figure for every pair).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes per second between two hosts.
    pub bytes_per_s: f64,
    /// One-way latency, ms.
    pub latency_ms: f64,
}

/// Everything a plan depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanInput {
    /// The model's block costs.
    pub profile: ModelProfile,
    /// Available hosts.
    pub hosts: Vec<HostSpec>,
    /// The network.
    pub link: Link,
    /// Samples per optimizer step over all replicas.
    pub global_batch: usize,
    /// Deepest pipeline to consider (None: as many stages as blocks).
    pub max_depth: Option<usize>,
    /// Devices (local ranks) on every host, each a replica of its host's stage with a pipe
    /// lane of its own: a host's share of the batch is split over them, so the micro-batch,
    /// the memory and the step time planned are one device's. 1 when absent.
    #[serde(default = "one_device")]
    pub local_ranks: usize,
    /// Samples each data-parallel replica trains a step when the batch grows with the
    /// replicas (the `linear`, `sqrt` and `adascale` batch policies): its share is then this
    /// whatever the layout, and `global_batch` is not used for it. None: `global_batch` is
    /// shared out over the replicas (`fixed-global`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_batch: Option<usize>,
}

/// What a step trains, as the leader plans an epoch: the job's global batch, or, under a
/// policy whose batch grows with the replicas, each replica's; and the devices of every host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepBatch {
    /// Samples a step over all replicas (a `fixed-global` job's).
    pub global: usize,
    /// Samples a replica trains a step, when that is what the policy keeps.
    pub per_replica: Option<usize>,
    /// Devices (local ranks) on every host.
    pub local: usize,
}

fn one_device() -> usize {
    1
}

/// The most local ranks a plan counts per host: as many as a pipelined epoch gives one.
pub const MAX_PLAN_LOCAL_RANKS: usize = limpet_consensus::state::MAX_PIPELINE_LOCAL_RANKS as usize;

/// Predicted cost of one stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePrediction {
    /// Forward + backward + boundary traffic per micro-batch, ms.
    pub micro_ms: f64,
    /// Gradient allreduce among replicas plus the optimizer step, ms.
    pub tail_ms: f64,
    /// Peak memory on each of its hosts, bytes.
    pub mem_bytes: u64,
}

/// A layout with its predicted step time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The layout.
    pub layout: HostLayout,
    /// Micro-batches per replica per step (per device, with local ranks).
    pub micro_batches: usize,
    /// Predicted time of one optimizer step, ms.
    pub step_ms: f64,
    /// Per stage.
    pub stages: Vec<StagePrediction>,
}

/// The planner's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanReport {
    /// The chosen layout.
    pub best: Plan,
    /// The best layout of every other (data, pipeline) shape that fits, fastest first.
    pub runners_up: Vec<Plan>,
    /// Why the best one won.
    pub reason: String,
}

/// Why no plan (or no prediction) could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The input itself is unusable.
    #[error("plan input: {0}")]
    Input(String),
    /// A forced layout does not fit the model or the hosts.
    #[error("layout: {0}")]
    Layout(String),
    /// No layout fits the hosts' memory.
    #[error("no layout fits: {0}")]
    NoFit(String),
}

/// A cluster job's pipeline settings, recorded with the job in the log so that every
/// leader plans from the same profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineJob {
    /// The model's block costs, measured by the node that set the job.
    pub profile: ModelProfile,
    /// The network between hosts.
    pub link: Link,
    /// Stages per replica, or `None` for the planner's choice.
    pub depth: Option<usize>,
    /// Forced block cuts (where each stage after the first starts): the layout is then
    /// these stages in as many replicas as the hosts allow, not the planner's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuts: Option<Vec<usize>>,
    /// Memory training may use on each device of a host, bytes.
    pub mem_bytes: u64,
}

/// The planner's layout for an epoch whose candidate ranks are `candidates` (node ids):
/// the ranks that train, in the epoch's data-major order (candidates the layout does not
/// use stay out as spares), the stage cuts, the micro-batch, and the prediction. `speeds`
/// are the hosts' measured speeds relative to the profiled host (1 where absent); `batch`
/// what a step trains and the devices each host trains with (the micro-batch is a device's).
pub fn arrange(
    job: &PipelineJob,
    candidates: &[u64],
    batch: StepBatch,
    speeds: &std::collections::BTreeMap<u64, f64>,
) -> Result<(Vec<u64>, Plan), PlanError> {
    let input = job_input(job, candidates, batch, speeds);
    if let Some(cuts) = &job.cuts {
        // The user's layout: its stages, as many replicas as there are hosts for.
        let p = cuts.len() + 1;
        let d = candidates.len() / p;
        if d == 0 {
            return Err(PlanError::NoFit(format!(
                "the forced {p}-stage layout needs {p} hosts, {} are healthy",
                candidates.len()
            )));
        }
        let stages = stages_at(cuts, job.profile.blocks.len(), d, candidates);
        let forced = predict(&input, &HostLayout { data: d, micro_batch: 0, stages })?;
        return Ok((candidates[..d * p].to_vec(), forced));
    }
    let report = plan(&input)?;
    let chosen = match job.depth {
        None => report.best,
        Some(d) => std::iter::once(report.best)
            .chain(report.runners_up)
            .find(|p| p.layout.pipeline() == d)
            .ok_or_else(|| {
            PlanError::NoFit(format!("no {d}-stage layout fits {} hosts", candidates.len()))
        })?,
    };
    let mut ranks = Vec::new();
    for r in 0..chosen.layout.data {
        for st in &chosen.layout.stages {
            ranks.push(st.hosts[r].parse::<u64>().expect("hosts are named by node id"));
        }
    }
    Ok((ranks, chosen))
}

/// The planner's input for `candidates` (named by node id) of measured `speeds`, training
/// `batch`.
fn job_input(
    job: &PipelineJob,
    candidates: &[u64],
    batch: StepBatch,
    speeds: &std::collections::BTreeMap<u64, f64>,
) -> PlanInput {
    PlanInput {
        profile: job.profile.clone(),
        hosts: candidates
            .iter()
            .map(|id| HostSpec {
                name: id.to_string(),
                speed: speeds.get(id).copied().filter(|v| v.is_finite() && *v > 0.0).unwrap_or(1.0),
                mem_bytes: job.mem_bytes,
            })
            .collect(),
        link: job.link,
        global_batch: batch.global,
        max_depth: job.depth,
        local_ranks: batch.local.clamp(1, MAX_PLAN_LOCAL_RANKS),
        replica_batch: batch.per_replica,
    }
}

/// The prediction for an epoch's own layout: `ranks` in data-major order, `data` replicas,
/// stages starting at `cuts`, micro-batches of `micro_batch`, on hosts of `speeds`, training
/// `batch`. What a re-plan must beat by a margin to be worth moving blocks.
pub fn predict_epoch(
    job: &PipelineJob,
    ranks: &[u64],
    (data, cuts): (usize, &[usize]),
    micro_batch: usize,
    batch: StepBatch,
    speeds: &std::collections::BTreeMap<u64, f64>,
) -> Result<Plan, PlanError> {
    let input = job_input(job, ranks, batch, speeds);
    let p = cuts.len() + 1;
    if data == 0 || data * p != ranks.len() {
        return Err(PlanError::Layout(format!("{data}x{p} does not cover {} ranks", ranks.len())));
    }
    let stages = stages_at(cuts, job.profile.blocks.len(), data, ranks);
    predict(&input, &HostLayout { data, micro_batch, stages })
}

/// The micro-batch for an epoch's own layout (`ranks` in data-major order, `data` replicas,
/// stages starting at `cuts`) on hosts of measured `speeds`, training `batch`: the fastest
/// of the choices the planner weighs that fits memory, with its prediction. For hosts placed
/// with more devices than the layout was planned for, whose devices split the share further.
pub fn refit_micro_batch(
    job: &PipelineJob,
    ranks: &[u64],
    (data, cuts): (usize, &[usize]),
    batch: StepBatch,
    speeds: &std::collections::BTreeMap<u64, f64>,
) -> Result<Plan, PlanError> {
    let input = job_input(job, ranks, batch, speeds);
    input.validate()?;
    let mut best: Option<Plan> = None;
    let mut last = None;
    for (n, _) in input.micro_choices(data.max(1)) {
        match predict_epoch(job, ranks, (data, cuts), n, batch, speeds) {
            Ok(p) if best.as_ref().is_none_or(|b| p.step_ms < b.step_ms) => best = Some(p),
            Ok(_) => {}
            Err(e) => last = Some(e),
        }
    }
    best.ok_or_else(|| last.unwrap_or_else(|| PlanError::NoFit("no micro-batch fits".into())))
}

/// The stages that `cuts` make of `blocks` blocks, replica `r` of stage `s` on `ranks[r * P +
/// s]` (data-major), for `data` replicas.
fn stages_at(cuts: &[usize], blocks: usize, data: usize, ranks: &[u64]) -> Vec<StageLayout> {
    let p = cuts.len() + 1;
    let bounds: Vec<usize> =
        std::iter::once(0).chain(cuts.iter().copied()).chain(std::iter::once(blocks)).collect();
    bounds
        .windows(2)
        .enumerate()
        .map(|(s, w)| StageLayout {
            start: w[0],
            end: w[1],
            hosts: (0..data).map(|r| ranks[r * p + s].to_string()).collect(),
        })
        .collect()
}

impl PlanInput {
    fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Input(m));
        if self.profile.blocks.is_empty() {
            return bad("the profile has no blocks".into());
        }
        if self.profile.micro_batch == 0 {
            return bad("the profile's micro_batch is 0".into());
        }
        if !(self.profile.overhead_ms.is_finite() && self.profile.overhead_ms >= 0.0) {
            return bad(format!("the profile's overhead_ms is {}", self.profile.overhead_ms));
        }
        if self.global_batch == 0 {
            return bad("global_batch is 0".into());
        }
        if self.hosts.is_empty() {
            return bad("no hosts".into());
        }
        if self.replica_batch == Some(0) {
            return bad("replica_batch is 0".into());
        }
        if !(1..=MAX_PLAN_LOCAL_RANKS).contains(&self.local_ranks) {
            return bad(format!(
                "local_ranks is {}; a host has 1 to {MAX_PLAN_LOCAL_RANKS}",
                self.local_ranks
            ));
        }
        for (i, b) in self.profile.blocks.iter().enumerate() {
            for (what, v) in [("fwd_ms", b.fwd_ms), ("bwd_ms", b.bwd_ms), ("apply_ms", b.apply_ms)] {
                if !(v.is_finite() && v >= 0.0) {
                    return bad(format!("block {i}: {what} is {v}"));
                }
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for h in &self.hosts {
            if !(h.speed.is_finite() && h.speed > 0.0) {
                return bad(format!("host '{}': speed {} is not a positive number", h.name, h.speed));
            }
            if !names.insert(h.name.as_str()) {
                return bad(format!("host '{}' is listed twice", h.name));
            }
        }
        if !(self.link.bytes_per_s.is_finite() && self.link.bytes_per_s > 0.0) {
            return bad(format!("link bandwidth {} is not a positive number", self.link.bytes_per_s));
        }
        if !(self.link.latency_ms.is_finite() && self.link.latency_ms >= 0.0) {
            return bad(format!("link latency {} is not a non-negative number", self.link.latency_ms));
        }
        Ok(())
    }

    /// Samples of the busiest device among `d` replicas of `local_ranks` devices each (a
    /// host's devices split its share, as the agents do).
    fn share(&self, d: usize) -> usize {
        match self.replica_batch {
            Some(b) => b.div_ceil(self.local_ranks),
            None => self.global_batch.div_ceil(d * self.local_ranks),
        }
    }

    /// The (micro-batch size, micro-batches per step) choices for `d` replicas: the profile's
    /// micro-batch (the largest a host may compute at once), halvings of it down to an eighth
    /// (which fill a pipeline better at the price of more per-call overhead), and single
    /// samples (the least activation memory).
    fn micro_choices(&self, d: usize) -> Vec<(usize, usize)> {
        let share = self.share(d);
        let mut out: Vec<(usize, usize)> = Vec::new();
        for div in [1, 2, 4, 8, usize::MAX] {
            let mb = (self.profile.micro_batch / div).clamp(1, share);
            let m = share.div_ceil(mb);
            if !out.iter().any(|&(_, k)| k == m) {
                out.push((share.div_ceil(m), m));
            }
        }
        out
    }

    /// One device's transfer of `bytes` to the next or previous stage's host. A host's devices
    /// send their micro-batches at once, each on its own pipe lane, over the host's one link:
    /// each gets its share of the bandwidth.
    fn transfer_ms(&self, bytes: u64) -> f64 {
        bytes as f64 * self.local_ranks as f64 / self.link.bytes_per_s * 1e3 + self.link.latency_ms
    }

    /// Cost of blocks `a..b` as stage `s` of `p`, on hosts of speed `speed`, with `d` replicas
    /// and `m` micro-batches of `n` samples. Times are affine in `n` (the fixed part is per
    /// call), bytes linear.
    #[allow(clippy::too_many_arguments)]
    fn stage_cost(
        &self,
        (a, b): (usize, usize),
        s: usize,
        p: usize,
        d: usize,
        (n, m): (usize, usize),
        speed: f64,
    ) -> StagePrediction {
        let blocks = &self.profile.blocks[a..b];
        let frac = n as f64 / self.profile.micro_batch as f64;
        let scaled = |full: f64, fixed: f64| fixed.min(full) + (full - fixed.min(full)) * frac;
        let bytes = |v: u64| (v as f64 * frac).ceil() as u64;
        let compute: f64 = blocks
            .iter()
            .map(|c| scaled(c.fwd_ms, c.fixed_fwd_ms) + scaled(c.bwd_ms, c.fixed_bwd_ms))
            .sum::<f64>()
            / speed;
        let mut micro_ms = compute;
        if s + 1 == p {
            micro_ms += self.profile.overhead_ms / speed;
        }
        if s > 0 {
            // This stage sends the gradient of its input back.
            micro_ms += self.transfer_ms(bytes(self.profile.blocks[a - 1].out_bytes));
        }
        if s + 1 < p {
            micro_ms += self.transfer_ms(bytes(blocks[blocks.len() - 1].out_bytes));
        }
        let params: u64 = blocks.iter().map(|c| c.param_bytes).sum();
        let optim: u64 = blocks.iter().map(|c| c.optim_bytes).sum();
        let saved: u64 = blocks.iter().map(|c| bytes(c.saved_bytes)).sum();
        // One buffer a host, whatever its devices (they add in its memory first): its lanes
        // share the host's link.
        let allreduce = if d > 1 {
            2.0 * (d - 1) as f64 / d as f64 * params as f64 / self.link.bytes_per_s * 1e3
                + 2.0 * (d - 1) as f64 * self.link.latency_ms
        } else {
            0.0
        };
        let apply: f64 = blocks.iter().map(|c| c.apply_ms).sum::<f64>() / speed;
        let in_flight = m.min(p - s) as u64;
        StagePrediction {
            micro_ms,
            tail_ms: allreduce + apply,
            mem_bytes: 2 * params + optim + saved * in_flight,
        }
    }
}

fn step_ms(stages: &[StagePrediction], m: usize) -> f64 {
    let sum: f64 = stages.iter().map(|s| s.micro_ms).sum();
    let max = stages.iter().map(|s| s.micro_ms).fold(0.0, f64::max);
    let tail = stages.iter().map(|s| s.tail_ms).fold(0.0, f64::max);
    sum + (m as f64 - 1.0) * max + tail
}

/// Predicts the step time of a given layout (a forced one, or one to compare against).
pub fn predict(input: &PlanInput, layout: &HostLayout) -> Result<Plan, PlanError> {
    input.validate()?;
    let bad = |m: String| Err(PlanError::Layout(m));
    let nb = input.profile.blocks.len();
    let (d, p) = (layout.data, layout.pipeline());
    if d == 0 || p == 0 {
        return bad(format!("{d}x{p} has no ranks"));
    }
    let mut next = 0;
    let mut used = std::collections::BTreeSet::new();
    let share = input.share(d);
    let n = match layout.micro_batch {
        0 => share.div_ceil(share.div_ceil(input.profile.micro_batch)),
        n => n.min(share),
    };
    let m = share.div_ceil(n);
    let mut stages = Vec::new();
    for (s, st) in layout.stages.iter().enumerate() {
        if st.start != next || st.end <= st.start {
            return bad(format!(
                "stage {s} holds blocks {}..{}; it must start at block {next} and hold at least one",
                st.start, st.end
            ));
        }
        if st.end > nb {
            return bad(format!("stage {s} holds blocks {}..{} but the model has {nb}", st.start, st.end));
        }
        if st.hosts.len() != d {
            return bad(format!("stage {s} names {} hosts for {d} replicas", st.hosts.len()));
        }
        let mut speed = f64::INFINITY;
        let mut mem = u64::MAX;
        for h in &st.hosts {
            let Some(spec) = input.hosts.iter().find(|x| &x.name == h) else {
                return bad(format!("stage {s}: host '{h}' is not among the hosts"));
            };
            if !used.insert(h.clone()) {
                return bad(format!("host '{h}' holds two stage replicas"));
            }
            speed = speed.min(spec.speed);
            mem = mem.min(spec.mem_bytes);
        }
        let cost = input.stage_cost((st.start, st.end), s, p, d, (n, m), speed);
        if cost.mem_bytes > mem {
            return bad(format!(
                "stage {s} (blocks {}..{}) needs {} bytes, its smallest host has {mem}",
                st.start, st.end, cost.mem_bytes
            ));
        }
        stages.push(cost);
        next = st.end;
    }
    if next != nb {
        return bad(format!("the stages cover blocks 0..{next} of {nb}"));
    }
    let layout = HostLayout { micro_batch: n, ..layout.clone() };
    Ok(Plan { layout, micro_batches: m, step_ms: step_ms(&stages, m), stages })
}

#[cfg(test)]
mod tests;

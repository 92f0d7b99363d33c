//! A synthetic agent: the agent's control part (`start_control`: its consensus node, data
//! plane, heartbeats, revocation watchers and leader loop, as `limpetd` runs them) with a
//! training loop that needs no libtorch, so hundreds run on one machine where a real agent
//! holds about 200 MB of libtorch's. Its job's state is a function of (seed, step) of a
//! configured size; a step sleeps its compute time and sums a buffer of the gradients' size
//! over the epoch's group. It follows the log as the trainer loop does (`next_action`),
//! enters epochs by the same protocol (states published and allgathered, the same entry
//! plan, a newcomer copying the state from a holder through the handoff server and checking
//! its hash, a barrier), reports, logs its steps and records its transitions the same way: so
//! the lab measures the control plane, the entries and the collectives at fleet sizes.

use super::entry::{self, abandon, Pending, ENTRY_STEP, ENTRY_WAIT};
use super::error::{AgentError, Fatal};
use super::lead::LeadJob;
use super::{
    host_hardware, spawn_training, start_control, wait_for, BrokenAt, Control, ControlConfig, Exit, StepLine,
    Tasks,
};
use crate::report::{AgentReport, Phase, Transition, MAX_TRANSITIONS};
use crate::{Endpoint, Group};
use limpet_consensus::state::Epoch;
use limpet_consensus::{LocalState, NodeHandle};
use limpet_decide::entry::plan::{entry_plan, Entry, RankState, Src};
use limpet_decide::entry::{hash_bytes, hex_of, Desc};
use limpet_decide::next::{next_action, Action, Position};
use limpet_decide::speed::smooth;
use limpet_decide::DecideError;
use limpet_snapshot::handoff::{label_of, Offer, Server};
use limpet_snapshot::{Dtype, RawTensor, RngState, StateImage};
use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// What a synthetic agent trains.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticJob {
    /// Steps the job trains.
    pub steps: u64,
    /// A step's compute, milliseconds (slept).
    pub step_ms: u64,
    /// The state's size in bytes: what a newcomer copies.
    pub state_bytes: usize,
    /// The gradients' size in bytes: what the group sums each step.
    pub grad_bytes: usize,
    /// Seeds the state.
    pub seed: u64,
    /// Samples a step (what the batch policy scales).
    pub global_batch: u64,
}

impl SyntheticJob {
    /// The job as the log records it.
    fn logged(&self) -> Result<serde_json::Value, AgentError> {
        let job = serde_json::to_value(self)
            .map_err(|source| AgentError::from(Fatal::Encode { what: "the synthetic job", source }))?;
        Ok(serde_json::json!({ "synthetic": job }))
    }

    /// The state after `step` steps: one tensor of `state_bytes` (whole f32 words, at least
    /// one) whose bytes are a keyed hash's stream of (seed, step).
    pub fn state(&self, step: u64) -> Result<StateImage, AgentError> {
        let words = (self.state_bytes / 4).max(1);
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&step.to_le_bytes());
        let mut data = vec![0u8; words * 4];
        blake3::Hasher::new_keyed(&key).finalize_xof().fill(&mut data);
        let tensor = RawTensor::try_new(STATE_TENSOR, Dtype::F32, vec![words], data)?;
        let tensors = BTreeMap::from([(STATE_TENSOR.to_string(), tensor)]);
        let cursor = step.saturating_mul(self.global_batch);
        Ok(StateImage::new(step, cursor, RngState::new(self.seed), self.logged()?, tensors))
    }
}

/// The synthetic state's one tensor (a block of its own, as the entry plan counts blocks).
const STATE_TENSOR: &str = "param/b00.w";

impl LeadJob for SyntheticJob {
    fn spec(&self) -> Result<serde_json::Value, AgentError> {
        self.logged()
    }

    fn blocks(&self) -> usize {
        1
    }

    fn batch(&self) -> (u64, u64) {
        (self.global_batch, self.global_batch)
    }

    fn document(&self) -> Pin<Box<dyn Future<Output = Result<serde_json::Value, AgentError>> + Send + '_>> {
        Box::pin(async move { self.logged() })
    }
}

/// A running synthetic agent.
pub struct SyntheticAgent {
    handle: NodeHandle,
    tasks: Tasks,
    looper: std::thread::JoinHandle<Result<Exit, AgentError>>,
    progress: Arc<Mutex<AgentReport>>,
    control_addr: SocketAddr,
    data_addr: SocketAddr,
}

impl SyntheticAgent {
    /// Starts the control part and the synthetic loop as tasks of `tasks` (whose root token
    /// stops them), logging each step to `step_log` when given. Needs a multi-threaded tokio
    /// runtime.
    pub async fn start(
        cfg: ControlConfig,
        job: SyntheticJob,
        step_log: Option<PathBuf>,
        tasks: Tasks,
    ) -> Result<SyntheticAgent, AgentError> {
        let log = match &step_log {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| AgentError::io(format!("step log {}", path.display()), source))?,
            ),
            None => None,
        };
        let hardware = host_hardware(&cfg);
        let cfg = Arc::new(cfg);
        let lead_job: Arc<dyn LeadJob> = Arc::new(job.clone());
        let Control { handle, endpoint, server, progress, beat_now, stop_serving, control_addr, data_addr } =
            start_control(Arc::clone(&cfg), hardware, lead_job, &tasks).await?;
        let looper = Loop {
            watch: handle.watch(),
            rt: tokio::runtime::Handle::current(),
            stop: tasks.token(),
            cfg,
            job,
            endpoint,
            server,
            progress: Arc::clone(&progress),
            beat_now,
            log,
            step: 0,
            group: None,
            pending: None,
            broken: None,
            in_flight: None,
            was_member: false,
            job_checked: false,
            last_step_done: None,
            step_time_ms: 0.0,
            ms_per_sample: 0.0,
            entry_failed: None,
        };
        let looper = spawn_training("limpet-synthetic", move || looper.run(), stop_serving)?;
        Ok(SyntheticAgent { handle, tasks, looper, progress, control_addr, data_addr })
    }

    /// The consensus node's bound address.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The data plane's bound address.
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    /// The node handle (proposals, reads, reports).
    pub fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    /// This agent's report as its heartbeats send it now.
    pub fn report(&self) -> AgentReport {
        self.progress.lock().expect("progress lock").clone()
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.tasks.token()
    }

    /// Waits until the synthetic loop ends (removed, stopped, or stopped by a fatal failure
    /// elsewhere), then stops every task, as `Agent::wait` does.
    pub async fn wait(self) -> Result<Exit, AgentError> {
        wait_for(self.looper, self.tasks).await
    }
}

/// A state offered to peers at an entry, withdrawn when the entry ends.
struct Offered(Server, [u8; 32]);

impl Drop for Offered {
    fn drop(&mut self) {
        self.0.withdraw(&self.1);
    }
}

/// The synthetic training thread's state.
struct Loop {
    cfg: Arc<ControlConfig>,
    job: SyntheticJob,
    endpoint: Arc<Endpoint>,
    server: Server,
    watch: watch::Receiver<LocalState>,
    progress: Arc<Mutex<AgentReport>>,
    beat_now: Arc<Notify>,
    stop: CancellationToken,
    rt: tokio::runtime::Handle,
    log: Option<std::fs::File>,
    /// Steps applied: the state is the job's state at this step.
    step: u64,
    group: Option<(Epoch, Group)>,
    pending: Option<Pending>,
    broken: Option<BrokenAt>,
    /// The step in flight when a collective broke: lost unless a peer finished it.
    in_flight: Option<u64>,
    was_member: bool,
    job_checked: bool,
    last_step_done: Option<Instant>,
    step_time_ms: f64,
    ms_per_sample: f64,
    entry_failed: Option<(u64, String)>,
}

impl Loop {
    fn set_phase(&self, phase: Phase) {
        let mut p = self.progress.lock().expect("progress lock");
        p.phase = phase;
        p.epoch = self.group.as_ref().map_or(0, |(e, _)| e.id);
        p.applied_step = self.step;
        p.step_time_ms = self.step_time_ms;
        p.ms_per_sample = self.ms_per_sample;
        p.broken = self.broken.as_ref().map(|b| b.report(p.epoch));
    }

    /// Waits up to `d` for the log to change since this loop last waited.
    fn wait_change(&mut self, d: Duration) {
        let w = &mut self.watch;
        let _ = self.rt.block_on(async { tokio::time::timeout(d, w.changed()).await });
    }

    fn run(mut self) -> Result<Exit, AgentError> {
        let me = self.cfg.id;
        loop {
            if self.stop.is_cancelled() {
                return Ok(Exit::Stopped);
            }
            let st = Arc::clone(&self.watch.borrow().state);
            if !self.job_checked {
                if let Some(logged) = &st.job {
                    let ours = self.job.logged()?;
                    if *logged != ours {
                        return Err(AgentError::from(Fatal::Job(format!("{ours} vs {logged}"))));
                    }
                    self.job_checked = true;
                }
            }
            if let Some(m) = st.members.get(&me) {
                self.was_member |= m.status.is_staying();
            }
            let at = Position {
                epoch: self.group.as_ref().map(|(e, _)| e.id),
                step: self.step,
                broken: self.broken.is_some(),
                was_member: self.was_member,
                job_steps: self.job.steps,
            };
            match next_action(&st, me, at) {
                Action::Removed(why) => {
                    self.set_phase(Phase::Left);
                    return Ok(Exit::Removed(why));
                }
                Action::Enter(n) => {
                    if let Err(e) = self.enter(&n) {
                        let said = (n.id, e.to_string());
                        if self.entry_failed.as_ref() != Some(&said) {
                            tracing::warn!(epoch = n.id, %e, "could not enter the epoch");
                            self.entry_failed = Some(said);
                        }
                        self.group = None;
                        self.set_phase(Phase::Waiting);
                        self.wait_change(Duration::from_millis(100));
                    }
                }
                Action::SitOut(id) => {
                    tracing::info!(epoch = id, step = self.step, "left training: not in the next epoch");
                    self.group = None;
                    self.broken = None;
                    self.last_step_done = None;
                    self.set_phase(Phase::Left);
                }
                Action::Wait { phase, ms } => {
                    self.set_phase(phase);
                    self.wait_change(Duration::from_millis(ms));
                }
                Action::Finish { connect_ahead } => {
                    self.connect_ahead(connect_ahead.as_ref());
                    self.set_phase(Phase::Finished);
                    self.wait_change(Duration::from_millis(200));
                }
                Action::Train { connect_ahead } => {
                    self.connect_ahead(connect_ahead.as_ref());
                    self.train_step()?;
                }
            }
        }
    }

    fn connect_ahead(&mut self, n: Option<&Epoch>) {
        if let Some(n) = n {
            let st = Arc::clone(&self.watch.borrow().state);
            if let Ok(addrs) = entry::addrs_of(&st, n) {
                entry::connect_ahead(&mut self.pending, &self.endpoint, n, &addrs);
            }
        }
    }

    /// One step: the compute slept, then the gradients summed over the group. A collective
    /// that fails breaks the group, and the loop waits for the next epoch.
    fn train_step(&mut self) -> Result<(), AgentError> {
        let started = Instant::now();
        let step = self.step;
        let me = self.cfg.id;
        let (epoch, group) = self.group.as_mut().expect("training is in a group");
        let (world, rank) = (group.world(), group.rank());
        std::thread::sleep(Duration::from_millis(self.job.step_ms));
        // Each rank's gradients differ (the sum must be a sum); their values do not matter.
        let mut grads = vec![(rank + 1) as f32; (self.job.grad_bytes / 4).max(1)];
        if let Err(e) = group.allreduce_sum(&mut grads, step) {
            let (suspect, violation) = (e.suspect(), e.is_violation());
            tracing::warn!(epoch = epoch.id, step, %e, "collective failed; waiting for the next epoch");
            self.in_flight = Some(step);
            self.broken = Some(BrokenAt { at: Instant::now(), suspect, error: e.to_string(), violation });
            self.set_phase(Phase::Waiting);
            self.beat_now.notify_one();
            return Ok(());
        }
        let (epoch_id, world_ranks) = (epoch.id, epoch.ranks.len());
        self.step += 1;
        let took = started.elapsed().as_secs_f64() * 1e3;
        self.step_time_ms = smooth(self.step_time_ms, took);
        let share = (self.job.global_batch as f64 / world as f64).max(1.0);
        self.ms_per_sample = smooth(self.ms_per_sample, self.job.step_ms as f64 / share);
        self.last_step_done = Some(Instant::now());
        if let Some(f) = self.log.as_mut() {
            let line = StepLine {
                wall_ms: super::now_ms(),
                step,
                epoch: epoch_id,
                world: world_ranks,
                rank,
                devices: 0,
                node: me,
                name: self.cfg.name.clone(),
                loss: 0.0,
                agreed: false,
                eval_loss: None,
                overlap: None,
                went_back: None,
            };
            let mut s = serde_json::to_string(&line).expect("step lines serialize");
            s.push('\n');
            f.write_all(s.as_bytes()).map_err(|source| AgentError::io("writing the step log", source))?;
        }
        metrics::counter!("limpet_steps_total").increment(1);
        metrics::histogram!("limpet_step_seconds").record(took / 1e3);
        metrics::gauge!("limpet_applied_step").set(self.step as f64);
        metrics::gauge!("limpet_samples_per_second")
            .set(self.job.global_batch as f64 / (took / 1e3).max(1e-9));
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.samples_per_s = self.job.global_batch as f64 / (self.step_time_ms / 1e3).max(1e-9);
        }
        self.set_phase(Phase::Training);
        Ok(())
    }

    /// Enters epoch `n` by the entry protocol, and records the transition.
    fn enter(&mut self, n: &Epoch) -> Result<(), AgentError> {
        self.set_phase(Phase::Entering);
        self.group = None;
        self.endpoint.set_min_epoch(n.id);
        let st = Arc::clone(&self.watch.borrow().state);
        let addrs = entry::addrs_of(&st, n)?;
        let by = Instant::now() + ENTRY_WAIT;
        let give_up = abandon::give_up(&self.watch, &self.stop, n.id);
        let tree = limpet_decide::entry::butterfly(&st, n);
        let mut group =
            entry::form_group(&self.endpoint, self.pending.take(), n, &addrs, (by, &give_up), tree)?;
        let abandon = abandon::Abandon::watch(&group, abandon::replaced(&self.watch, &self.stop, n.id));

        let image = self.job.state(self.step)?;
        let label = label_of(image.content_hash());
        let mine = RankState {
            live: Desc { step: self.step, hash: hash_bytes(image.content_hash()), blocks: (0, 1) },
            snaps: [None; 2],
            shadows: [None; 2],
        };
        let ranks = entry::exchange_states(&mut group, &mine, n, 1)?;
        let me = group.rank();
        let survivors = entry::survivors_of(&st, n);
        let plan = match entry_plan(&ranks, me, 0..1, 1, &survivors) {
            // Two survivors a step apart, and nobody else to tell which is right: the one
            // behind finishes the step alone, which for this state is computing it (the
            // trainer loop does the same from its own share of the step). The next attempt
            // finds the two alike.
            Err(DecideError::TornStep { behind, ahead, step }) => {
                if behind == me {
                    // The peer's word is checked first: its published state must be this job's
                    // state a step on (which determines it), within the job.
                    let next = self.job.state(step + 1)?;
                    if step + 1 > self.job.steps || ranks[ahead].live.hash != hash_bytes(next.content_hash())
                    {
                        return Err(AgentError::entry(format!(
                            "epoch {}: node {} claims step {} with a state that is not this job's there",
                            n.id,
                            n.ranks[ahead],
                            step + 1
                        )));
                    }
                    self.step = step + 1;
                }
                return Err(AgentError::entry(format!("epoch {}: a torn step {step}, finished alone", n.id)));
            }
            plan => plan?,
        };
        // Who copies whose live state: every rank computes every rank's plan (pure, from the
        // same published states), so the holders offer theirs and all wait for the offers.
        let copied: Vec<Vec<usize>> = (0..ranks.len())
            .map(|j| match entry_plan(&ranks, j, 0..1, 1, &survivors) {
                Ok(p) if p.action != Entry::Keep => {
                    p.sources.iter().filter(|(_, kind, _)| *kind == Src::Live).map(|(s, _, _)| *s).collect()
                }
                _ => Vec::new(),
            })
            .collect();
        // Withdrawn however the entry ends (a failed one is tried again, and offers again).
        let _offered = Offered(self.server.clone(), label);
        if copied.iter().enumerate().any(|(j, srcs)| j != me && srcs.contains(&me)) {
            self.server.offer(Offer::new(image.encode()?, 1 << 20, label));
        }
        if copied.iter().enumerate().any(|(j, srcs)| srcs.iter().any(|&s| s != j)) {
            group.barrier(ENTRY_STEP)?;
        }
        let redone = self.step.saturating_sub(plan.step);
        let (mut fetched_bytes, mut fetch_ms) = (0, 0);
        if plan.action != Entry::Keep {
            let started = Instant::now();
            let Some(&(src, _, _)) = plan.sources.iter().find(|(s, _, _)| *s != me) else {
                return Err(AgentError::entry(format!(
                    "epoch {}: the plan names no holder to copy from",
                    n.id
                )));
            };
            let want = ranks[src].live;
            let source = format!("{}@{}", n.ranks[src], addrs[src]);
            let most = self.job.state_bytes as u64 + (1 << 20);
            let (theirs, bytes) = entry::fetch_state(&self.endpoint, n.id, &source, want.hash, most)?;
            // The holder's word is checked: the state it sent is the one it published, and
            // the job's own state at that step.
            if hash_bytes(theirs.content_hash()) != want.hash
                || theirs.meta().step != plan.step
                || self.job.state(plan.step)?.content_hash() != theirs.content_hash()
            {
                return Err(AgentError::entry(format!(
                    "node {} sent a state that is not the one it published ({} at step {})",
                    n.ranks[src],
                    hex_of(&want.hash),
                    plan.step
                )));
            }
            fetched_bytes = bytes;
            fetch_ms = started.elapsed().as_millis() as u64;
            tracing::info!(
                epoch = n.id,
                step = plan.step,
                bytes,
                from = n.ranks[src],
                "state copied from a peer"
            );
        }
        self.step = plan.step;
        group.barrier(ENTRY_STEP)?;
        drop(abandon);
        if let Some(zones) = limpet_decide::entry::zone_levels(&st, n) {
            let by = Instant::now() + ENTRY_WAIT;
            group.connect_levels(&self.endpoint, &addrs, &zones, (by, &give_up))?;
        }
        let idle_ms = self.last_step_done.map_or(0, |t| t.elapsed().as_millis() as u64);
        let t = Transition {
            epoch: n.id,
            step: self.step,
            cause: limpet_decide::report::clip_cause(&n.cause),
            idle_ms,
            lost_steps: self.in_flight.take().map_or(0, |s| u64::from(self.step <= s)),
            fetched_bytes,
            fetch_ms,
            repaired: plan.action == Entry::Repair,
            redone_steps: redone,
        };
        tracing::info!(node = self.cfg.id, name = %self.cfg.name, epoch = n.id, step = t.step, world = n.ranks.len(), idle_ms, cause = %n.cause, "entered epoch");
        metrics::histogram!("limpet_transition_idle_seconds").record(idle_ms as f64 / 1e3);
        metrics::counter!("limpet_lost_steps_total").increment(t.lost_steps);
        metrics::counter!("limpet_redone_steps_total").increment(t.redone_steps);
        metrics::gauge!("limpet_epoch").set(n.id as f64);
        metrics::gauge!("limpet_world_size").set(n.ranks.len() as f64);
        self.group = Some((n.clone(), group));
        self.broken = None;
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.transitions.push(t);
            if p.transitions.len() > MAX_TRANSITIONS {
                p.transitions.remove(0);
            }
        }
        self.set_phase(Phase::Training);
        self.beat_now.notify_one();
        Ok(())
    }
}

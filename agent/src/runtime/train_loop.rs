//! The trainer loop, on its own thread: it follows the committed log. Before every step it
//! asks [`next_action`] (pure) what to do given the newest epoch: a survivor of a planned
//! change trains the old epoch up to the new epoch's start step and switches there (while
//! connecting the new ring early); a rank whose collective failed switches as soon as the
//! new epoch is committed; a newcomer enters at once and waits for its peers at the boundary;
//! a rank left out stops training; a removed node's work is done. Then it does that: a step
//! (with its step log line, metrics, checkpoint and shadow), an entry (`entry`), or a wait.

use super::checkpointer::{Checkpointer, Sink};
use super::config::AgentConfig;
use super::entry::{self, Conn, Entering, Pending};
use super::error::{AgentError, Fatal};
use super::one_step::{self, Host, HostStep};
use super::shadows::{Links, Shadows};
use super::sharding::{self, Final};
use super::tasks::Tasks;
use super::{BrokenAt, Exit, StepLine};
use crate::report::{AgentReport, Phase, Transition, MAX_TRANSITIONS};
use crate::Endpoint;
use limpet_consensus::state::{ClusterState, Epoch, NodeId};
use limpet_consensus::{LocalState, NodeHandle};
use limpet_decide::speed::{blend, smooth};
use limpet_snapshot::handoff::Server;
use limpet_trainer::{StepOutcome, Trainer, TrainerError};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

pub use limpet_decide::next::{next_action, Action, Position};

/// The trainer thread's state.
pub(super) struct TrainLoop {
    pub cfg: Arc<AgentConfig>,
    /// Proposals (checkpoint records) from the trainer thread.
    pub handle: NodeHandle,
    pub endpoint: Arc<Endpoint>,
    pub server: Server,
    pub watch: watch::Receiver<LocalState>,
    pub progress: Arc<Mutex<AgentReport>>,
    pub beat_now: Arc<Notify>,
    pub tasks: Tasks,
    pub rt: tokio::runtime::Handle,
    pub trainer: Trainer,
    /// The trainers of this host's other devices (`[node].devices`), which follow `trainer`.
    followers: Vec<Trainer>,
    /// The host sums of the local ranks' collectives, kept from step to step.
    local_sums: limpet_trainer::LocalSums,
    /// The threads the followers step on, kept from step to step.
    rank_threads: super::local_ranks::RankThreads,
    pub checkpointer: Checkpointer,
    pub shadows: Shadows,
    /// The epoch entered, its connections, and how this host steps in it (chosen there).
    group: Option<(Epoch, Conn, HostStep)>,
    /// The ring's other lanes in the current group (hosts of several local ranks).
    lanes: Vec<crate::Group>,
    broken: Option<BrokenAt>,
    was_member: bool,
    /// Whether this node's `[job]` was found to be the one the log holds.
    job_checked: bool,
    last_step_done: Option<Instant>,
    /// The step in flight when a collective broke (since the last entry): lost unless a peer
    /// finished it and the next epoch starts after it.
    in_flight: Option<u64>,
    /// The step this rank's state had reached since its last entry: an entry that leaves it
    /// lower took the state back, whichever path did (a failed entry's included).
    reached: u64,
    /// Steps this rank went back, `[from, to)`, not yet said: on its next step line
    /// (`StepLine::went_back`), so the step log itself shows the redone steps.
    went_back: Option<[u64; 2]>,
    step_time_ms: f64,
    log: Option<std::fs::File>,
    finished: bool,
    /// A sharded job past its last step: its final checkpoint, gathered or written pending
    /// (the trainers keep their blocks); `None` until then, or when the gather broke.
    final_state: Option<sharding::Final>,
    /// The content hash of the final checkpoint this process wrote, once it did.
    final_written: Option<String>,
    /// The next epoch's ring connections, made ahead of its boundary.
    pending: Option<Pending>,
    /// What this rank did about a torn step at an entry (`entry::Torn`).
    torn: entry::Torn,
    /// The last entry failure logged: (epoch, error).
    entry_failed: Option<(u64, String)>,
    /// The last epoch this rank trained in (kept through failed entries), for a sharded step
    /// finished at an entry.
    last_epoch: Option<Epoch>,
    /// Smoothed (σ², μ²) of the current epoch.
    grad_stats: Option<(f64, f64)>,
    /// Smoothed milliseconds to compute one sample of this rank's share.
    ms_per_sample: f64,
}

impl TrainLoop {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<AgentConfig>,
        handle: NodeHandle,
        endpoint: Arc<Endpoint>,
        server: Server,
        progress: Arc<Mutex<AgentReport>>,
        beat_now: Arc<Notify>,
        tasks: Tasks,
        trainer: Trainer,
        followers: Vec<Trainer>,
    ) -> TrainLoop {
        TrainLoop {
            checkpointer: Checkpointer::new(cfg.checkpoint.clone()),
            watch: handle.watch(),
            rt: tokio::runtime::Handle::current(),
            cfg,
            handle,
            endpoint,
            server,
            progress,
            beat_now,
            tasks,
            trainer,
            followers,
            local_sums: Default::default(),
            rank_threads: Default::default(),
            shadows: Shadows::default(),
            group: None,
            lanes: Vec::new(),
            broken: None,
            was_member: false,
            job_checked: false,
            last_step_done: None,
            in_flight: None,
            reached: 0,
            went_back: None,
            step_time_ms: 0.0,
            log: None,
            finished: false,
            final_state: None,
            final_written: None,
            pending: None,
            torn: entry::Torn::default(),
            entry_failed: None,
            last_epoch: None,
            grad_stats: None,
            ms_per_sample: 0.0,
        }
    }

    fn set_phase(&self, phase: Phase) {
        let mut p = self.progress.lock().expect("progress lock");
        p.phase = phase;
        p.epoch = self.group.as_ref().map_or(0, |(e, ..)| e.id);
        p.applied_step = self.trainer.step();
        p.step_time_ms = self.step_time_ms;
        p.broken = self.broken.as_ref().map(|b| b.report(p.epoch));
    }

    /// Waits up to `d` for the log to change since this loop last waited. (A clone of the
    /// receiver would count every change since the loop began as new, and return at once.)
    fn wait_change(&mut self, d: Duration) {
        let w = &mut self.watch;
        let _ = self.rt.block_on(async { tokio::time::timeout(d, w.changed()).await });
    }

    fn position(&self) -> Position {
        Position {
            epoch: self.group.as_ref().map(|(e, ..)| e.id),
            step: self.trainer.step(),
            broken: self.broken.is_some(),
            was_member: self.was_member,
            job_steps: self.cfg.job.steps,
        }
    }

    pub fn run(mut self) -> Result<Exit, AgentError> {
        if let Some(path) = &self.cfg.step_log {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| AgentError::io(format!("step log {}", path.display()), source))?;
            self.log = Some(f);
        }
        let me = self.cfg.id;
        let stop = self.tasks.token();
        loop {
            if stop.is_cancelled() {
                return Ok(Exit::Stopped);
            }
            let st = Arc::clone(&self.watch.borrow().state);
            if !self.job_checked {
                // Set once, by the first leader from its own config: a node whose config
                // says otherwise would train another job beside the others (or stall their
                // collectives) if it entered.
                if let Some(logged) = &st.job {
                    if let Some(diff) = self.cfg.job.diff_document(logged) {
                        return Err(AgentError::from(Fatal::Job(diff)));
                    }
                    let mine = limpet_trainer::device::device_class(self.cfg.training_device());
                    if let Some(why) = super::lead::device_class_refusal(logged, &mine) {
                        return Err(AgentError::from(Fatal::DeviceClass(why)));
                    }
                    self.job_checked = true;
                }
            }
            if let Some(m) = st.members.get(&me) {
                self.was_member |= m.status.is_staying();
            }
            match next_action(&st, me, self.position()) {
                Action::Removed(why) => {
                    self.set_phase(Phase::Left);
                    return Ok(Exit::Removed(why));
                }
                Action::Enter(n) => {
                    // Every entry error is transient here, even the trainer's: its input is what
                    // peers published, and the next epoch (without a faulty peer) may succeed.
                    if let Err(e) = self.enter(&n) {
                        // Said once per epoch and cause: a rank that waits for a peer's data
                        // address retries at every change of the log.
                        let said = (n.id, e.to_string());
                        if self.entry_failed.as_ref() != Some(&said) {
                            let st = Arc::clone(&self.watch.borrow().state);
                            let mut live = [st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten();
                            if live.any(|e| e.id == n.id) {
                                tracing::warn!(epoch = n.id, %e, fatal_elsewhere = e.is_fatal(), "could not enter the epoch");
                            } else {
                                // Nothing failed: the epoch will never train (its group was
                                // closed, or its peers left it, for the newer one).
                                tracing::info!(epoch = n.id, %e, "gave up entering the epoch: a newer one replaced it");
                            }
                            self.entry_failed = Some(said);
                        }
                        self.group = None;
                        self.lanes.clear();
                        self.set_phase(Phase::Waiting);
                        self.wait_change(Duration::from_millis(100));
                    }
                }
                Action::SitOut(id) => {
                    tracing::info!(
                        epoch = id,
                        step = self.trainer.step(),
                        "left training: not in the next epoch"
                    );
                    self.group = None;
                    self.lanes.clear();
                    self.broken = None;
                    // Its final checkpoint is written where it trains to the end, if it does.
                    self.drop_final();
                    // A rank that sits out (a spare) is not idle for the ones that train.
                    self.last_step_done = None;
                    self.set_phase(Phase::Left);
                }
                Action::Wait { phase, ms } => {
                    self.set_phase(phase);
                    self.wait_change(Duration::from_millis(ms));
                }
                Action::Finish { connect_ahead } => {
                    self.connect_ahead(&st, connect_ahead.as_ref());
                    if !self.finished && self.trainer.shard_layout().is_some() && self.final_state.is_none() {
                        // The final gather broke: the next entry gathers the state again.
                        self.wait_change(Duration::from_millis(200));
                        continue;
                    }
                    if !self.finished {
                        // The job's result, where `limpet-lab demo` and operators find it.
                        // A whole-state trainer writes it from its tensors, with no image; a
                        // sharded job's was written at its last step, pending until now.
                        let dir = &self.cfg.state_dir;
                        let (path, hash) = match self.final_state.take() {
                            Some(Final::Image(image)) => limpet_trainer::save_image(&image, dir)
                                .map(|path| (path, image.content_hash().to_string())),
                            Some(Final::Pending { path, hash }) => {
                                limpet_trainer::place_checkpoint(&path, dir).map(|path| (path, hash))
                            }
                            Some(Final::Failed(e)) => Err(e),
                            None => limpet_trainer::save_checkpoint(&self.trainer, dir),
                        }
                        .map_err(|e| AgentError::from(Fatal::FinalCheckpoint(e)))?;
                        self.final_written = Some(hash);
                        limpet_trainer::device::return_freed_host_memory();
                        // The process's peak resident memory, for `bench dp` and operators.
                        let peak_rss_bytes = limpet_trainer::peak_rss_bytes();
                        tracing::info!(step = self.trainer.step(), path = %path.display(), peak_rss_bytes, "job finished; final checkpoint written");
                        self.finished = true;
                    }
                    self.set_phase(Phase::Finished);
                    self.wait_change(Duration::from_millis(200));
                }
                Action::Train { connect_ahead } => {
                    self.connect_ahead(&st, connect_ahead.as_ref());
                    let epoch = self.group.as_ref().expect("training is in a group").0.clone();
                    self.step(&epoch, &st)?;
                }
            }
        }
    }

    /// Drops the final checkpoint made of a state this rank may no longer end the job with;
    /// a file written pending goes too (it is not the job's end, and it is model-sized).
    fn drop_final(&mut self) {
        if let Some(Final::Pending { path, .. }) = self.final_state.take() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %e, "could not remove a pending final checkpoint");
            }
        }
    }

    fn connect_ahead(&mut self, st: &ClusterState, n: Option<&Epoch>) {
        if let Some(n) = n {
            if let Ok(addrs) = entry::addrs_of(st, n) {
                entry::connect_ahead(&mut self.pending, &self.endpoint, n, &addrs);
            }
        }
    }

    /// Trains one step in the current group; a collective error breaks the group.
    fn step(&mut self, epoch: &Epoch, st: &ClusterState) -> Result<(), AgentError> {
        let started = Instant::now();
        let step = self.trainer.step();
        let group_rank = epoch.ranks.iter().position(|&r| r == self.cfg.id).unwrap_or(0);
        let (_, conn, how) = self.group.as_mut().expect("in a group");
        let host = Host {
            trainer: &mut self.trainer,
            followers: &mut self.followers,
            sums: &self.local_sums,
            threads: &mut self.rank_threads,
            slowdown: &self.cfg.slowdown,
        };
        // This rank's own failure is fatal (`?`); a broken collective or stage link ends the
        // group, and the agent goes on.
        let (outcome, work) = one_step::run(*how, host, epoch, group_rank, (conn, &mut self.lanes))?;
        if let Some(w) = work.filter(|w| w.samples > 0) {
            self.ms_per_sample = smooth(self.ms_per_sample, w.ms / w.samples as f64);
        }
        let stats = match outcome {
            StepOutcome::Applied(stats) => stats,
            StepOutcome::Peer { peer, detail, violation } => {
                let error = TrainerError::Reduce { peer, detail, violation }.to_string();
                // A sharded step applied before its parameters' allgather broke: logged, as
                // the state moved on.
                if let Some(done) = self.trainer.take_unlogged() {
                    let took = started.elapsed().as_secs_f64() * 1e3;
                    self.record_step(&done, epoch, group_rank, took, None)?;
                }
                if violation {
                    // Not a fault of the network: a peer (or this rank) does not follow the
                    // protocol. The leader rebuilds once, then stops at this step.
                    tracing::error!(epoch = epoch.id, step, %error, "protocol violation between ranks; waiting for the next epoch");
                } else {
                    tracing::warn!(epoch = epoch.id, step, %error, "collective failed; waiting for the next epoch");
                }
                self.in_flight = Some(step);
                self.broken = Some(BrokenAt { at: Instant::now(), suspect: peer, error, violation });
                self.set_phase(Phase::Waiting);
                self.beat_now.notify_one();
                return Ok(());
            }
        };
        let took = started.elapsed().as_secs_f64() * 1e3;
        self.step_time_ms = smooth(self.step_time_ms, took);
        self.last_step_done = Some(Instant::now());
        // The held-out loss, when the job evaluates after this step: each rank its share, one
        // allreduce sums them (so it is evaluated once per step, not once per rank). Not part
        // of the step's time, which the leader plans with; the step is applied either way.
        let (eval, eval_failed) = match self.evaluate_if_due(epoch) {
            Ok(e) => (e, None),
            Err(f) => (None, Some(f)),
        };
        self.record_step(&stats, epoch, group_rank, took, eval)?;
        // AdaScale's statistics are over data-parallel replicas (devices), not pipeline stages.
        let replicas = epoch.total_ranks() / (epoch.layout.pipeline.max(1) as usize);
        self.grad_stats = observe_gradients(self.grad_stats, &stats, replicas);
        let sink = Sink { me: self.cfg.id, handle: &self.handle, rt: &self.rt, tasks: &self.tasks };
        let mut gathered = None;
        if let (Some(_), Some((_, Conn::Ring(g), _))) = (self.trainer.shard_layout(), self.group.as_mut()) {
            let nb = self.cfg.job.model.num_blocks();
            let host = (&mut self.trainer, self.followers.as_mut_slice());
            let writer = (&mut self.checkpointer, &sink);
            match sharding::after_step(host, g, epoch, writer, nb, &self.cfg.state_dir) {
                Ok(made) => {
                    gathered = made.image;
                    if let Some(f) = made.final_state {
                        // Moved or written into place when the job finishes (the next action).
                        let step = self.trainer.step();
                        match &f {
                            Final::Image(_) => tracing::info!(step, "the whole state gathered for the job's final checkpoint; every rank keeps its blocks"),
                            Final::Pending { path, .. } => tracing::info!(step, path = %path.display(), "the job's final checkpoint written from the gathered state, a tensor at a time; every rank keeps its blocks"),
                            Final::Failed(e) => tracing::error!(step, %e, "the job's final checkpoint could not be written here; every rank keeps its blocks"),
                        }
                        self.final_state = Some(f);
                    }
                }
                Err(e) => {
                    // Peers may be past it or still in it: the group is done, as after any
                    // failed collective (the step itself is applied and logged).
                    tracing::warn!(epoch = epoch.id, step = self.trainer.step(), %e, "could not gather the sharded state for a checkpoint; waiting for the next epoch");
                    let error = e.to_string();
                    let (suspect, violation) = match AgentError::from(e) {
                        AgentError::Retry(broke) => broke.blame(),
                        AgentError::Fatal(_) => (None, false),
                    };
                    self.broken = Some(BrokenAt { at: Instant::now(), suspect, error, violation });
                    self.set_phase(Phase::Waiting);
                    self.beat_now.notify_one();
                    return Ok(());
                }
            }
        }
        self.checkpointer.maybe_write(
            (&self.trainer, gathered),
            epoch,
            group_rank,
            self.cfg.job.model.num_blocks(),
            &sink,
        );
        let every = self.cfg.pipeline.as_ref().map_or(0, |p| p.shadow_every);
        if epoch.layout.pipeline > 1 && every > 0 && self.trainer.step() % every == 0 {
            let addrs = entry::addrs_of(st, epoch)?;
            let links =
                Links { me: self.cfg.id, endpoint: &self.endpoint, server: &self.server, tasks: &self.tasks };
            self.shadows.take(&self.trainer, epoch, &addrs, &links)?;
        }
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.grad_stats = self.grad_stats;
            p.ms_per_sample = self.ms_per_sample;
            p.loss = Some(stats.loss);
            p.samples_per_s = stats.samples as f64 / (self.step_time_ms / 1e3).max(1e-9);
            p.checkpoint_error = self.checkpointer.failure();
            if let Some(loss) = eval {
                p.eval = Some(crate::report::EvalPoint { step: self.trainer.step(), loss });
            }
        }
        if let Some((suspect, error, _)) = eval_failed {
            // The step is applied and recorded; the group is broken all the same.
            tracing::warn!(epoch = epoch.id, step, %error, "held-out evaluation's collective failed; waiting for the next epoch");
            self.in_flight = Some(self.trainer.step());
            self.broken = Some(BrokenAt { at: Instant::now(), suspect, error, violation: false });
            self.set_phase(Phase::Waiting);
            self.beat_now.notify_one();
            return Ok(());
        }
        self.set_phase(Phase::Training);
        Ok(())
    }

    /// The epoch's held-out loss if the job evaluates after the step just applied
    /// (`eval_every`; data-parallel epochs): this rank's share of the held-out split, summed
    /// over the ranks by one allreduce. A failed collective breaks the group as a step's does.
    fn evaluate_if_due(&mut self, epoch: &Epoch) -> Result<Option<f64>, (Option<NodeId>, String, bool)> {
        let step = self.trainer.step();
        let due = self.trainer.job().eval_every.is_some_and(|e| step % e == 0);
        let Some((_, Conn::Ring(g), _)) = self.group.as_mut().filter(|_| due) else { return Ok(None) };
        // Parts in proportion to the step's shares (a slower rank, a smaller part), so no rank
        // waits on another's evaluation past the collective's timeout.
        let share = self.trainer.plan().share_in(g.rank(), g.world(), &epoch.shares);
        let sums = self.trainer.evaluate_part(share, self.trainer.plan().global_batch).unwrap_or_else(|e| {
            // Joined all the same (with nothing counted), so the others do not wait for it.
            tracing::warn!(step, error = %e, "held-out evaluation failed on this rank");
            limpet_trainer::EvalSums { loss: f64::NAN, correct: f64::NAN, count: 0.0 }
        });
        let mut buf = sums.to_buf();
        g.allreduce_sum(&mut buf, step).map_err(|e| (e.suspect(), e.to_string(), e.is_violation()))?;
        let all = limpet_trainer::EvalSums::from_buf(buf);
        // A peer's sums are its word: only a mean over the whole split is taken.
        let whole = all.count.round() as usize == self.trainer.data().test.len();
        Ok(all.mean().filter(|m| whole && m.loss.is_finite()).map(|m| m.loss))
    }

    /// Writes the step's line to the step log and its metrics.
    fn record_step(
        &mut self,
        stats: &limpet_trainer::StepStats,
        epoch: &Epoch,
        group_rank: usize,
        took: f64,
        eval: Option<f64>,
    ) -> Result<(), AgentError> {
        let world = epoch.ranks.len();
        self.reached = self.reached.max(stats.step + 1);
        let line = StepLine {
            wall_ms: super::now_ms(),
            step: stats.step,
            epoch: epoch.id,
            world,
            rank: group_rank,
            devices: if epoch.local_ranks.is_empty() { 0 } else { epoch.total_ranks() },
            node: self.cfg.id,
            name: self.cfg.name.clone(),
            loss: stats.loss,
            agreed: stats.agreed,
            eval_loss: eval,
            went_back: self.went_back.take(),
            // A model of one bucket sums it with the scalars once backward has ended: nothing
            // to say.
            overlap: self
                .trainer
                .overlap_probe()
                .of_step(stats.step)
                .filter(|&(_, handed)| handed > 0)
                .map(|(during, handed)| [during, handed]),
        };
        if let Some(f) = self.log.as_mut() {
            let mut s = serde_json::to_string(&line).expect("step lines serialize");
            s.push('\n');
            f.write_all(s.as_bytes()).map_err(|source| AgentError::io("writing the step log", source))?;
        }
        if stats.step + 1 == self.trainer.job().steps {
            // Memory in the steady state (before a sharded job gathers its state for the
            // end), for `bench dp` and operators; the optimizer state is the first rank's.
            let (optim_state_bytes, whole_optim_state_bytes) = self.trainer.optim_state_bytes();
            tracing::info!(
                step = stats.step,
                rss_bytes = limpet_trainer::rss_bytes(),
                training_peak_rss_bytes = limpet_trainer::peak_rss_bytes(),
                optim_state_bytes,
                whole_optim_state_bytes,
                "resident memory at the last step"
            );
        }
        metrics::counter!("limpet_steps_total").increment(1);
        metrics::histogram!("limpet_step_seconds").record(took / 1e3);
        metrics::gauge!("limpet_applied_step").set(self.trainer.step() as f64);
        metrics::gauge!("limpet_loss").set(stats.loss);
        if let Some(l) = eval {
            metrics::gauge!("limpet_eval_loss").set(l);
            metrics::gauge!("limpet_eval_perplexity").set(l.exp());
            tracing::info!(step = self.trainer.step(), loss = l, perplexity = l.exp(), "held-out evaluation");
        }
        if stats.agreed {
            metrics::counter!("limpet_reproducible_agreed_steps_total").increment(1);
        }
        metrics::gauge!("limpet_samples_per_second").set(stats.samples as f64 / (took / 1e3).max(1e-9));
        Ok(())
    }

    /// Enters epoch `n` (see `entry`) and records the transition.
    fn enter(&mut self, n: &Epoch) -> Result<(), AgentError> {
        self.set_phase(Phase::Entering);
        if let Some((e, ..)) = &self.group {
            self.last_epoch = Some(e.clone());
        }
        // The old group is done; peers of older epochs are refused from now on.
        self.group = None;
        self.lanes.clear();
        // Made of the state this entry may change.
        self.drop_final();
        // A step applied but not logged (its collectives broke after the update) counts too.
        self.reached = self.reached.max(self.trainer.step());
        let x = Entering {
            cfg: &self.cfg,
            endpoint: &self.endpoint,
            server: &self.server,
            watch: &self.watch,
            stop: &self.tasks.token(),
            trainer: &mut self.trainer,
            followers: &mut self.followers,
            shadows: &mut self.shadows,
            pending: self.pending.take(),
            torn: &mut self.torn,
            trained_world: self.last_epoch.as_ref().map(Epoch::total_ranks),
            final_written: self.final_written.as_deref(),
            finished: self.finished,
        };
        let mut done = entry::enter(x, n)?;
        if done.redone_steps > 0 {
            self.checkpointer.went_back(self.trainer.step());
            // Steps given up are trained again, and the job's end written again.
            self.finished = false;
        }
        if done.repaired {
            // This rank's state was replaced by a peer's: the final checkpoint it wrote (if it
            // finished) is not the job's state, so the end is written again.
            self.finished = false;
        }
        // A rank that wrote the job's end already kept nothing of a gather for a newcomer's.
        self.final_state = done.final_state.take().filter(|_| !self.finished);
        // A sharded step finished at the entry with a peer's norm belongs to the last epoch.
        if let Some(p) = self.last_epoch.clone().filter(|_| self.trainer.has_unlogged()) {
            let step = self.trainer.take_unlogged().expect("checked");
            let rank = p.ranks.iter().position(|&r| r == self.cfg.id).unwrap_or(0);
            tracing::info!(
                epoch = p.id,
                step = step.step,
                "a sharded step whose collectives broke was finished at the entry"
            );
            self.record_step(&step, &p, rank, 0.0, None)?;
        }
        // After the last epoch's step above, which this entry did not redo. Steps gone back
        // over and not said yet (a rank that broke before its next step) join them.
        let at = self.trainer.step();
        if at < self.reached {
            self.went_back = Some(match self.went_back {
                Some([from, to]) => [from.min(at), to.max(self.reached)],
                None => [at, self.reached],
            });
        }
        self.reached = at;
        let idle_ms = self.last_step_done.map_or(0, |t| t.elapsed().as_millis() as u64);
        let t = Transition {
            epoch: n.id,
            step: self.trainer.step(),
            cause: limpet_decide::report::clip_cause(&n.cause),
            idle_ms,
            // The step in flight is lost only if the new epoch computes it again: when a peer
            // finished it, this rank copied the result at entry and nothing was lost.
            lost_steps: self.in_flight.take().map_or(0, |s| u64::from(self.trainer.step() <= s)),
            fetched_bytes: done.fetched_bytes,
            fetch_ms: done.fetch_ms,
            repaired: done.repaired,
            redone_steps: done.redone_steps,
        };
        tracing::info!(node = self.cfg.id, name = %self.cfg.name, epoch = n.id, step = t.step, world = n.ranks.len(), idle_ms, cause = %n.cause, "entered epoch");
        for kind in cause_kinds(n) {
            metrics::counter!("limpet_transitions_total", "cause" => kind).increment(1);
        }
        metrics::histogram!("limpet_transition_idle_seconds").record(idle_ms as f64 / 1e3);
        metrics::counter!("limpet_lost_steps_total").increment(t.lost_steps);
        metrics::counter!("limpet_redone_steps_total").increment(t.redone_steps);
        metrics::gauge!("limpet_epoch").set(n.id as f64);
        metrics::gauge!("limpet_world_size").set(n.ranks.len() as f64);
        // How this host steps in the epoch, chosen once from what the entry made.
        let how = HostStep::choose(&self.trainer, n, &done.conn);
        // Sums kept on the devices are the last epoch's cut (and maybe its devices): made
        // again at the first step that needs them.
        self.local_sums.drop_device_sums();
        self.group = Some((n.clone(), done.conn, how));
        self.lanes = done.lanes;
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

/// The kinds of change an epoch answers, as metric labels (from a small fixed set; node ids
/// stay out). An epoch logged before causes were data counts as "other".
fn cause_kinds(n: &Epoch) -> Vec<&'static str> {
    if n.causes.is_empty() {
        return vec!["other"];
    }
    n.causes.iter().map(limpet_consensus::state::Cause::kind).collect()
}

/// The gradient statistics AdaScale needs, updated from a step's reduced values. Each
/// rank's mean gradient over b samples has E|m_i|² = μ² + σ²/b, the global mean over
/// N = W b samples has E|g|² = μ² + σ²/N; the two give unbiased estimates of σ² and μ²
/// (as AdaScale's and KungFu's implementations do). Every rank computes the same values
/// from the same reduced buffer.
fn observe_gradients(
    prev: Option<(f64, f64)>,
    stats: &limpet_trainer::StepStats,
    world: usize,
) -> Option<(f64, f64)> {
    if world < 2 || stats.samples < world {
        return None;
    }
    let (n, w) = (stats.samples as f64, world as f64);
    let b = n / w;
    let global = stats.grad_norm * stats.grad_norm;
    let per_rank = stats.rank_mean_sq_sum / w;
    let variance = ((per_rank - global) / (1.0 / b - 1.0 / n)).max(0.0);
    let mean_sq = (global - variance / n).max(0.0);
    if !(variance.is_finite() && mean_sq.is_finite()) {
        return prev;
    }
    Some(match prev {
        Some((v, m)) => (blend(v, variance), blend(m, mean_sq)),
        None => (variance, mean_sq),
    })
}

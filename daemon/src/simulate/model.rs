//! The simulation: one job over a preemption trace, trained three ways, in fixed time ticks.
//! Pauses (a transition's idle, a restart, a checkpoint write) are owed as seconds and paid
//! from the next ticks' training time, so a 10 ms pause costs 10 ms whatever the tick.
//!
//! - **limpet**: trains on every live host; a revocation with notice costs the notice's idle,
//!   one without a notice the failure timeout, the recovery and the step in flight; a new host
//!   costs the survivors the join (its state copied at the link's bandwidth).
//! - **checkpoint-restart** (torchrun's elastic agent): a change of the fleet restarts the job
//!   from its last checkpoint: the work since is lost and the restart takes its time. Changes
//!   at one instant, or while a restart is under way, make one restart (one rendezvous).
//!   Checkpoints are written every so often, each a pause; an asynchronous one pauses only to
//!   copy the state and counts once its write is done.
//! - **on-demand**: a fixed fleet that is never taken away, at the on-demand price.
//!
//! Goodput has one definition for every policy: samples trained over what the hosts paid for
//! (booting ones included) would have trained in the same time with no transition, restart,
//! lost work or checkpoint pause.

use super::trace::Trace;
use serde::Serialize;

/// What the job and the fleet cost: measured defaults are in `SimulateArgs`.
#[derive(Clone, Debug, Serialize)]
pub struct Params {
    /// Samples per second of one host.
    pub host_rate: f64,
    /// Fraction of linear speed-up kept per doubling of the fleet.
    pub scaling: f64,
    /// Seconds of one training step (the work a kill without notice loses).
    pub step_s: f64,
    /// Idle of a transition on a revocation notice.
    pub notice_idle_s: f64,
    /// Failure timeout plus recovery after a kill without notice.
    pub kill_recovery_s: f64,
    /// Fraction of revocations that come without a notice.
    pub no_notice: f64,
    /// Fixed idle of a join, and the bytes and link speed of its state copy.
    pub join_idle_s: f64,
    /// Training state in bytes (copied to a newcomer).
    pub state_bytes: f64,
    /// Link speed in bytes per second.
    pub link_bytes_per_s: f64,
    /// Seconds from a host's arrival in the trace until it can train (boot, install).
    pub boot_s: f64,
    /// Checkpoint-restart: restart time, checkpoint interval (training seconds) and write time.
    pub restart_s: f64,
    /// Seconds of training between checkpoints.
    pub checkpoint_every_s: f64,
    /// Seconds one checkpoint takes to write (a synchronous one pauses training as long).
    pub checkpoint_write_s: f64,
    /// Asynchronous checkpoints (as `torch.distributed.checkpoint.async_save`): each pauses
    /// training this long (the copy of the state) and counts once written, `checkpoint_write_s`
    /// later; `None`: synchronous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_pause_s: Option<f64>,
    /// Whether a new host restarts the job too (torchrun's agent does: a new rendezvous).
    pub restart_on_add: bool,
    /// Checkpoint-restart saves before a planned restart (a revocation with notice, a host
    /// added): only a kill without notice loses work.
    #[serde(default)]
    pub checkpoint_on_notice: bool,
    /// Prices per host-hour.
    pub spot_price: f64,
    /// On-demand price per host-hour.
    pub on_demand_price: f64,
    /// On-demand fleet size.
    pub on_demand_hosts: usize,
    /// Samples the job needs.
    pub samples: f64,
    /// Simulation tick in seconds.
    pub tick_s: f64,
    /// Measured samples per second by number of hosts (index 0 unused); where it has a
    /// positive entry it replaces the power law of `host_rate` and `scaling`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rates: Vec<f64>,
    /// The job must be done by then (seconds): the spot policies add on-demand hosts (at the
    /// on-demand price, never taken away) when their fleet would miss it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
    /// Run exactly this many seconds instead of until `samples` are trained (a window every
    /// policy runs alike, or a replay's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
    /// Hosts added at the trace's first instant are up already, without `boot_s`: a replay's
    /// clock starts at its first step, its founders booted (a fleet's first hosts boot too).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub founders_booted: bool,
}

impl Params {
    /// Samples per second of `n` hosts.
    pub fn rate(&self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        if let Some(&r) = self.rates.get(n).filter(|r| **r > 0.0) {
            return r;
        }
        let n = n as f64;
        self.host_rate * n * self.scaling.powf(n.log2())
    }
}

/// How the job is trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// limpet: elastic, in-memory state, no restarts.
    Limpet,
    /// Restart from the last checkpoint on every change (torchrun).
    CheckpointRestart,
    /// A fixed on-demand fleet.
    OnDemand,
}

impl Policy {
    /// Its name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Limpet => "limpet",
            Policy::CheckpointRestart => "checkpoint-restart",
            Policy::OnDemand => "on-demand",
        }
    }
}

/// One policy's run.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// The policy.
    pub policy: Policy,
    /// Hours run: until the job's samples were trained, or the window's end.
    pub hours: f64,
    /// Trained samples over what the hosts paid for would have trained without any
    /// transition, restart or checkpoint in the same time.
    pub goodput: f64,
    /// Dollars paid for hosts while they were live.
    pub cost: f64,
    /// Dollars per million trained samples.
    pub usd_per_million: f64,
    /// Restarts (checkpoint-restart) or transitions (limpet).
    pub transitions: u64,
    /// Seconds of training thrown away (work since the last checkpoint, steps in flight).
    pub lost_s: f64,
    /// Seconds the fleet stood idle (transitions, restarts, checkpoint writes).
    pub paused_s: f64,
    /// Samples trained.
    pub trained: f64,
    /// Samples the hosts paid for (booting ones included) would have trained without any
    /// transition, restart or checkpoint in the same time (goodput's denominator).
    pub possible: f64,
    /// Samples the hosts that could train (booted) would have trained so.
    pub possible_ready: f64,
    /// Host-hours paid for.
    pub billed_host_hours: f64,
    /// Host-hours of hosts that could train.
    pub ready_host_hours: f64,
    /// Host-hours of on-demand hosts a spot policy added to meet its deadline.
    pub fallback_host_hours: f64,
    /// (hours, live hosts, fraction of the job done) once a minute of simulated time.
    #[serde(skip)]
    pub timeline: Vec<(f64, usize, f64)>,
}

/// The fleet over time: hosts that can train, and the changes a policy reacts to.
struct Fleet<'a> {
    trace: &'a Trace,
    next: usize,
    /// Live hosts by name: when each can train, and whether it does yet.
    hosts: std::collections::BTreeMap<String, (f64, bool)>,
    /// On-demand hosts added to meet a deadline: when each can train, and whether it does.
    fallback: Vec<(f64, bool)>,
    /// Hosts still booting (most ticks have none: no walk over the hosts).
    booting: usize,
    /// Hosts that train, counted when the fleet changes (not at every tick).
    ready_n: usize,
    removed: u64,
}

/// A change the policy sees during one tick.
#[derive(Debug, PartialEq)]
enum Change {
    Joined,
    Revoked { notice: bool },
}

impl<'a> Fleet<'a> {
    fn new(trace: &'a Trace) -> Fleet<'a> {
        Fleet {
            trace,
            next: 0,
            hosts: Default::default(),
            fallback: Vec::new(),
            booting: 0,
            ready_n: 0,
            removed: 0,
        }
    }

    /// Hosts that train, on-demand ones added for a deadline included.
    fn ready(&self) -> usize {
        self.ready_n
    }

    /// Spot hosts paid for (live in the trace, booting included).
    fn billed(&self) -> usize {
        self.hosts.len()
    }

    /// Adds `k` on-demand hosts at `t`; they train once booted.
    fn add_fallback(&mut self, t: f64, k: usize, p: &Params) {
        self.fallback.extend(std::iter::repeat_n((t + p.boot_s, false), k));
        self.booting += k;
    }

    /// Applies the trace up to time `t`; the changes, in order. A host removed while still
    /// booting was never part of the job. Revocations come without a notice in the share
    /// `no_notice`, spread evenly (deterministically) over them.
    fn advance(&mut self, t: f64, p: &Params) -> Vec<Change> {
        let mut changes = Vec::new();
        let mut moved = false;
        while let Some(e) = self.trace.events.get(self.next).filter(|e| e.at_ms as f64 / 1e3 <= t) {
            self.next += 1;
            moved = true;
            if e.add {
                let boot = if p.founders_booted && e.at_ms == 0 { 0.0 } else { p.boot_s };
                self.hosts.insert(e.node.clone(), (e.at_ms as f64 / 1e3 + boot, false));
                self.booting += 1;
            } else {
                match self.hosts.remove(&e.node) {
                    Some((_, true)) => {
                        let before = (self.removed as f64 * p.no_notice).floor();
                        self.removed += 1;
                        let notice = (self.removed as f64 * p.no_notice).floor() == before;
                        changes.push(Change::Revoked { notice });
                    }
                    Some((_, false)) => self.booting -= 1,
                    None => {}
                }
            }
        }
        if self.booting > 0 {
            for h in self.hosts.values_mut().chain(self.fallback.iter_mut()).filter(|h| !h.1 && h.0 <= t) {
                h.1 = true;
                self.booting -= 1;
                moved = true;
                changes.push(Change::Joined);
            }
        }
        if moved {
            self.ready_n = self.hosts.values().chain(self.fallback.iter()).filter(|h| h.1).count();
        }
        changes
    }
}

/// What a run has done so far.
#[derive(Default)]
struct Run {
    done: f64,
    /// Samples in the last checkpoint.
    saved: f64,
    /// An asynchronous checkpoint being written: when it counts, and its samples.
    pending: Option<(f64, f64)>,
    /// Hosts the job took in at its last (re)start: without restarts on additions, a host
    /// added since waits, paid for and idle, for the next restart.
    members: usize,
    /// Seconds of pause owed.
    debt: f64,
    since_ckpt: f64,
    transitions: u64,
    lost_s: f64,
}

impl Run {
    /// Back to the last checkpoint, then a restart: what checkpoint-restart does on a change,
    /// and what limpet does when its whole fleet was lost. A restart under way starts over
    /// (a new rendezvous) rather than adding a second one.
    fn restart(&mut self, rate: f64, p: &Params) {
        self.lost_s += (self.done - self.saved) / rate.max(f64::MIN_POSITIVE);
        self.done = self.saved;
        self.since_ckpt = 0.0;
        self.pending = None;
        self.debt = self.debt.max(p.restart_s);
    }

    /// Reacts to the changes of one tick; `before` hosts trained until now, `rate` is the
    /// fleet's speed before them. Whether the job (re)started, taking in every live host.
    fn react(&mut self, policy: Policy, changes: &[Change], before: usize, rate: f64, p: &Params) -> bool {
        if before == 0 {
            // The job (re)starts: from its last checkpoint, if it ever ran.
            let starts = changes.contains(&Change::Joined);
            if starts && self.done > 0.0 {
                self.restart(rate, p);
                self.transitions += 1;
            }
            return starts;
        }
        let mut restart = false;
        // Planned: no host went without a notice, so the job can save before it restarts.
        let planned = saves_first(policy, changes, p);
        let mut joined = false;
        for c in changes {
            match (policy, c) {
                (Policy::Limpet, Change::Revoked { notice: true }) => self.debt += p.notice_idle_s,
                (Policy::Limpet, Change::Revoked { notice: false }) => {
                    self.debt += p.kill_recovery_s + p.step_s;
                    self.lost_s += p.step_s;
                }
                // Hosts joining at one instant enter one epoch, copying their state at once.
                (Policy::Limpet, Change::Joined) if joined => continue,
                (Policy::Limpet, Change::Joined) => {
                    joined = true;
                    self.debt += p.join_idle_s + p.state_bytes / p.link_bytes_per_s
                }
                (_, Change::Joined) if !p.restart_on_add => continue,
                _ => {
                    restart = true;
                    continue;
                }
            }
            self.transitions += 1;
        }
        // The changes of one instant are one restart.
        if restart {
            if planned {
                // Saved first (within the notice): nothing is lost, the write is paid.
                self.saved = self.done;
                self.pending = None;
                self.restart(rate, p);
                self.debt += p.checkpoint_write_s;
            } else {
                self.restart(rate, p);
            }
            self.transitions += 1;
        }
        restart
    }
}

/// AWS's notice of a spot interruption: what a save before it must fit in.
pub const NOTICE_S: f64 = 120.0;

/// Whether checkpoint-restart saves before restarting for `changes`: it saves on notice, no
/// host went without one, and a removal's save fits in the notice (an added host waits).
fn saves_first(policy: Policy, changes: &[Change], p: &Params) -> bool {
    let removed = changes.iter().any(|c| matches!(c, Change::Revoked { .. }));
    policy == Policy::CheckpointRestart
        && p.checkpoint_on_notice
        && !changes.contains(&Change::Revoked { notice: false })
        && (!removed || p.checkpoint_write_s <= NOTICE_S)
}

/// Runs `policy` over `trace` for the window `until_s`, or else until the job's samples are
/// trained (the trace's last fleet stays as it is past its end). `None` if that never
/// happens (the fleet is empty for good).
pub fn simulate(trace: &Trace, p: &Params, policy: Policy) -> Option<Outcome> {
    let mut fleet = Fleet::new(trace);
    let mut run = Run::default();
    let (mut t, mut possible, mut cost, mut paused_s) = (0.0f64, 0.0, 0.0, 0.0);
    let (mut possible_ready, mut billed_s, mut ready_s, mut fallback_s) = (0.0, 0.0, 0.0, 0.0);
    let mut next_check = 0.0;
    let mut ticks = 0u64;
    // About 2000 points over the run (at most one each half second: a replay's is short).
    let every_h = (p.until_s.unwrap_or_else(|| trace.duration_s()) / 3600.0 / 2000.0).max(0.5 / 3600.0);
    // Checkpoint-restart without restarts on additions: added hosts wait for the next restart.
    let waits = policy == Policy::CheckpointRestart && !p.restart_on_add;
    // Most on-demand hosts a deadline may add: a bound, not a plan.
    let most_fallback = 4 * trace.max_live().max(p.on_demand_hosts).max(1);
    let mut timeline: Vec<(f64, usize, f64)> = Vec::new();
    let limit = trace.duration_s() + 1000.0 * 3600.0;
    // A window runs its whole length, the job done or not (every policy the same hours).
    while p.until_s.map_or(run.done < p.samples, |u| t < u) {
        if t > limit {
            return None;
        }
        let (hosts, billed) = if policy == Policy::OnDemand {
            (p.on_demand_hosts, p.on_demand_hosts)
        } else {
            let before = fleet.ready();
            let training = if waits { run.members.min(before) } else { before };
            let mut changes = fleet.advance(t, p);
            if waits {
                // The hosts lost are taken to be the idle ones first (the kinder reading for
                // checkpoint-restart): losing one of those is no restart.
                let mut idle = before - training;
                changes.retain(|c| match c {
                    Change::Revoked { .. } if idle > 0 => {
                        idle -= 1;
                        false
                    }
                    _ => true,
                });
            }
            if fleet.ready() == 0 && before > 0 {
                // Every host is gone: what was not checkpointed is lost with them, unless
                // checkpoint-restart saved within the notice. The restart comes when hosts
                // do (once).
                if saves_first(policy, &changes, p) {
                    run.saved = run.done;
                    run.debt += p.checkpoint_write_s;
                }
                run.lost_s += (run.done - run.saved) / p.rate(training.max(1));
                run.done = run.saved;
                // A write in flight dies with its hosts.
                run.pending = None;
            } else if run.react(policy, &changes, training, p.rate(training.max(1)), p) {
                run.members = fleet.ready();
            }
            if let Some(deadline) = p.deadline_s.filter(|_| t >= next_check) {
                // Once a minute: at the pace this policy has kept so far (taken as full for its
                // first hour, before one restart can weigh for hours), would the fleet (the
                // on-demand hosts booting included) miss the deadline? Then add on-demand hosts
                // towards the fewest that make it, a quarter of the fleet at most each minute
                // (no jump to a fleet sized by one bad minute), while a new one can still boot
                // in time.
                next_check = t + 60.0;
                let left = deadline - t - p.boot_s;
                let remaining = p.samples - run.done;
                if left > 0.0 && remaining > 0.0 {
                    let pace = if t >= 3600.0 && possible_ready > 0.0 {
                        (run.done / possible_ready).clamp(0.2, 1.0)
                    } else {
                        1.0
                    };
                    // Booting spot hosts count: `left` leaves them their boot.
                    let (spot, had) = (fleet.billed(), fleet.fallback.len());
                    let step = ((spot + had) / 4).max(1);
                    let mut k = had;
                    while k < most_fallback && k < had + step && p.rate(spot + k) * pace * left < remaining {
                        k += 1;
                    }
                    fleet.add_fallback(t, k - had, p);
                }
            }
            let ready = fleet.ready();
            (if waits { run.members.min(ready) } else { ready }, fleet.billed() + fleet.fallback.len())
        };
        let rate = p.rate(hosts);
        let (pay, train) = if hosts > 0 {
            let pay = run.debt.min(p.tick_s);
            run.debt -= pay;
            (pay, p.tick_s - pay)
        } else {
            (0.0, 0.0)
        };
        paused_s += pay;
        run.done += rate * train;
        possible += p.rate(billed) * p.tick_s;
        possible_ready += rate * p.tick_s;
        billed_s += billed as f64 * p.tick_s;
        ready_s += hosts as f64 * p.tick_s;
        // Both write checkpoints; limpet's are copied at a step boundary and written while
        // training goes on, checkpoint-restart's pause the job (an asynchronous one only to
        // copy the state, and it counts once written).
        // A checkpoint counts once written (a restart or the loss of every host before that
        // drops it); one is not started while the last is still being written.
        if hosts > 0 && policy != Policy::OnDemand {
            run.since_ckpt += train;
            if run.since_ckpt >= p.checkpoint_every_s && run.pending.is_none() {
                run.since_ckpt = 0.0;
                let written_in = match (policy, p.async_pause_s) {
                    (Policy::CheckpointRestart, Some(pause)) => {
                        run.debt += pause;
                        run.debt + p.checkpoint_write_s
                    }
                    (Policy::CheckpointRestart, None) => {
                        run.debt += p.checkpoint_write_s;
                        run.debt
                    }
                    _ => p.checkpoint_write_s,
                };
                // Its pause starts with the next tick.
                run.pending = Some((t + p.tick_s + written_in, run.done));
            }
        }
        if let Some((_, samples)) = run.pending.filter(|&(at, _)| at <= t + p.tick_s) {
            run.saved = samples;
            run.pending = None;
        }
        let (price, fallback) = match policy {
            Policy::OnDemand => (p.on_demand_price, 0),
            _ => (p.spot_price, fleet.fallback.len()),
        };
        fallback_s += fallback as f64 * p.tick_s;
        cost +=
            ((billed - fallback) as f64 * price + fallback as f64 * p.on_demand_price) * p.tick_s / 3600.0;
        ticks += 1;
        t = ticks as f64 * p.tick_s;
        if timeline.last().is_none_or(|&(h, _, _)| t / 3600.0 - h >= every_h) {
            timeline.push((t / 3600.0, hosts, (run.done / p.samples).min(1.0)));
        }
    }
    Some(Outcome {
        policy,
        hours: t / 3600.0,
        goodput: if possible > 0.0 { run.done / possible } else { 0.0 },
        cost,
        usd_per_million: cost / run.done.max(f64::MIN_POSITIVE) * 1e6,
        transitions: run.transitions,
        lost_s: run.lost_s,
        paused_s,
        trained: run.done,
        possible,
        possible_ready,
        billed_host_hours: billed_s / 3600.0,
        ready_host_hours: ready_s / 3600.0,
        fallback_host_hours: fallback_s / 3600.0,
        timeline,
    })
}

/// The parameters the simulator's tests start from (each changes what it tests): hosts of 10
/// samples/s scaling linearly, $1 spot and $3 on-demand, a 60 s restart, 10 s checkpoint
/// writes every 10 minutes, 100 ms ticks, no boot, no window.
#[cfg(test)]
pub(crate) fn test_params(samples: f64) -> Params {
    Params {
        host_rate: 10.0,
        scaling: 1.0,
        step_s: 1.0,
        notice_idle_s: 0.01,
        kill_recovery_s: 1.3,
        no_notice: 0.0,
        join_idle_s: 0.02,
        state_bytes: 0.0,
        link_bytes_per_s: 1e9,
        boot_s: 0.0,
        restart_s: 60.0,
        checkpoint_every_s: 600.0,
        checkpoint_write_s: 10.0,
        async_pause_s: None,
        restart_on_add: true,
        checkpoint_on_notice: false,
        spot_price: 1.0,
        on_demand_price: 3.0,
        on_demand_hosts: 2,
        samples,
        tick_s: 0.1,
        rates: Vec::new(),
        deadline_s: None,
        until_s: None,
        founders_booted: false,
    }
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;

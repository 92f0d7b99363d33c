//! The simulation: one job over a preemption trace, trained three ways, in fixed time ticks.
//! Pauses (a transition's idle, a restart, a checkpoint write) are owed as seconds and paid
//! from the next ticks' training time, so a 10 ms pause costs 10 ms whatever the tick.
//!
//! - **limpet**: trains on every live host; a revocation with notice costs the notice's idle,
//!   one without a notice the failure timeout, the recovery and the step in flight; a new host
//!   costs the survivors the join (its state copied at the link's bandwidth).
//! - **checkpoint-restart** (torchrun's elastic agent): every change of the fleet restarts the
//!   job from its last checkpoint: the work since is lost and the restart takes its time;
//!   checkpoints are written every so often, each a pause.
//! - **on-demand**: a fixed fleet that is never taken away, at the on-demand price.

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
    /// Seconds one checkpoint pauses training.
    pub checkpoint_write_s: f64,
    /// Whether a new host restarts the job too (torchrun's agent does: a new rendezvous).
    pub restart_on_add: bool,
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
    /// Stop at this many seconds instead of at `samples` (a replay's window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
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
    /// Hours until the job's samples were trained.
    pub hours: f64,
    /// Trained samples over what the same hosts would have trained without any transition,
    /// restart or checkpoint in the same time.
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
    /// Samples the same hosts would have trained without any transition, restart or
    /// checkpoint in the same time (goodput's denominator).
    pub possible: f64,
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
        Fleet { trace, next: 0, hosts: Default::default(), removed: 0 }
    }

    /// Hosts that train.
    fn ready(&self) -> usize {
        self.hosts.values().filter(|h| h.1).count()
    }

    /// Hosts paid for (live in the trace, booting included).
    fn billed(&self) -> usize {
        self.hosts.len()
    }

    /// Applies the trace up to time `t`; the changes, in order. A host removed while still
    /// booting was never part of the job. Revocations come without a notice in the share
    /// `no_notice`, spread evenly (deterministically) over them.
    fn advance(&mut self, t: f64, p: &Params) -> Vec<Change> {
        let mut changes = Vec::new();
        while let Some(e) = self.trace.events.get(self.next).filter(|e| e.at_ms as f64 / 1e3 <= t) {
            self.next += 1;
            if e.add {
                self.hosts.insert(e.node.clone(), (e.at_ms as f64 / 1e3 + p.boot_s, false));
            } else if let Some((_, true)) = self.hosts.remove(&e.node) {
                let before = (self.removed as f64 * p.no_notice).floor();
                self.removed += 1;
                let notice = (self.removed as f64 * p.no_notice).floor() == before;
                changes.push(Change::Revoked { notice });
            }
        }
        for h in self.hosts.values_mut().filter(|h| !h.1 && h.0 <= t) {
            h.1 = true;
            changes.push(Change::Joined);
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
    /// Seconds of pause owed.
    debt: f64,
    since_ckpt: f64,
    transitions: u64,
    lost_s: f64,
}

impl Run {
    /// Back to the last checkpoint, then a restart: what checkpoint-restart does on every
    /// change, and what limpet does when its whole fleet was lost.
    fn restart(&mut self, rate: f64, p: &Params) {
        self.lost_s += (self.done - self.saved) / rate.max(f64::MIN_POSITIVE);
        self.done = self.saved;
        self.since_ckpt = 0.0;
        self.debt += p.restart_s;
    }

    /// Reacts to the changes of one tick; `before` hosts trained until now, `rate` is the
    /// fleet's speed before them.
    fn react(&mut self, policy: Policy, changes: &[Change], before: usize, rate: f64, p: &Params) {
        if before == 0 {
            // The job (re)starts: from its last checkpoint, if it ever ran.
            if changes.contains(&Change::Joined) && self.done > 0.0 {
                self.restart(rate, p);
                self.transitions += 1;
            }
            return;
        }
        for c in changes {
            self.transitions += 1;
            match (policy, c) {
                (Policy::Limpet, Change::Revoked { notice: true }) => self.debt += p.notice_idle_s,
                (Policy::Limpet, Change::Revoked { notice: false }) => {
                    self.debt += p.kill_recovery_s + p.step_s;
                    self.lost_s += p.step_s;
                }
                (Policy::Limpet, Change::Joined) => {
                    self.debt += p.join_idle_s + p.state_bytes / p.link_bytes_per_s
                }
                (_, Change::Joined) if !p.restart_on_add => self.transitions -= 1,
                _ => self.restart(rate, p),
            }
        }
    }
}

/// Runs `policy` over `trace` until the job's samples are trained (the trace's last fleet
/// stays as it is past its end). `None` if that never happens (the fleet is empty for good).
pub fn simulate(trace: &Trace, p: &Params, policy: Policy) -> Option<Outcome> {
    let mut fleet = Fleet::new(trace);
    let mut run = Run::default();
    let (mut t, mut possible, mut cost, mut paused_s) = (0.0f64, 0.0, 0.0, 0.0);
    let mut timeline: Vec<(f64, usize, f64)> = Vec::new();
    let limit = trace.duration_s() + 1000.0 * 3600.0;
    while run.done < p.samples && p.until_s.is_none_or(|u| t < u) {
        if t > limit {
            return None;
        }
        let (hosts, billed) = if policy == Policy::OnDemand {
            (p.on_demand_hosts, p.on_demand_hosts)
        } else {
            let before = fleet.ready();
            let changes = fleet.advance(t, p);
            if fleet.ready() == 0 && before > 0 {
                // Every host is gone: what was not checkpointed is lost with them.
                run.lost_s += (run.done - run.saved) / p.rate(before);
                run.done = run.saved;
            }
            run.react(policy, &changes, before, p.rate(before.max(1)), p);
            (fleet.ready(), fleet.billed())
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
        possible += rate * p.tick_s;
        // Both write checkpoints; limpet's are copied at a step boundary and written while
        // training goes on, checkpoint-restart's pause the job.
        if hosts > 0 && policy != Policy::OnDemand {
            run.since_ckpt += train;
            if run.since_ckpt >= p.checkpoint_every_s {
                run.since_ckpt = 0.0;
                run.saved = run.done;
                if policy == Policy::CheckpointRestart {
                    run.debt += p.checkpoint_write_s;
                }
            }
        }
        let price = if policy == Policy::OnDemand { p.on_demand_price } else { p.spot_price };
        cost += billed as f64 * price * p.tick_s / 3600.0;
        t += p.tick_s;
        // A point a minute; half a second in a short window (a replay's).
        let every_h = if p.until_s.is_some() { 0.5 / 3600.0 } else { 1.0 / 60.0 };
        if timeline.last().is_none_or(|&(h, _, _)| t / 3600.0 - h >= every_h) {
            timeline.push((t / 3600.0, hosts, (run.done / p.samples).min(1.0)));
        }
    }
    Some(Outcome {
        policy,
        hours: t / 3600.0,
        goodput: if possible > 0.0 { run.done / possible } else { 0.0 },
        cost,
        usd_per_million: cost / p.samples * 1e6,
        transitions: run.transitions,
        lost_s: run.lost_s,
        paused_s,
        trained: run.done,
        possible,
        timeline,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(samples: f64) -> Params {
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
            restart_on_add: true,
            spot_price: 1.0,
            on_demand_price: 3.0,
            on_demand_hosts: 2,
            samples,
            tick_s: 0.1,
            rates: Vec::new(),
            until_s: None,
        }
    }

    fn trace(text: &str) -> Trace {
        Trace::parse(text, "t").unwrap()
    }

    #[test]
    fn a_steady_fleet_trains_at_its_rate_and_pays_for_its_hours() {
        let t = trace("0,add,a\n0,add,b\n");
        let p = params(20.0 * 3600.0);
        for policy in [Policy::Limpet, Policy::OnDemand] {
            let o = simulate(&t, &p, policy).unwrap();
            assert!((o.hours - 1.0).abs() < 1e-3, "{policy:?}: {}", o.hours);
            assert!((o.goodput - 1.0).abs() < 1e-3);
        }
        let spot = simulate(&t, &p, Policy::Limpet).unwrap();
        let od = simulate(&t, &p, Policy::OnDemand).unwrap();
        assert!((spot.cost - 2.0).abs() < 1e-2 && (od.cost - 6.0).abs() < 1e-2, "{} {}", spot.cost, od.cost);
        // Checkpoints cost their writes: an hour of training holds five 10 s pauses (the
        // sixth checkpoint would come as the job ends).
        let ckpt = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
        assert!((ckpt.goodput - 3600.0 / 3650.0).abs() < 1e-3, "{}", ckpt.goodput);
    }

    #[test]
    fn a_revocation_costs_limpet_its_idle_and_checkpoint_restart_its_lost_work() {
        // Two hosts; one leaves at 30 min (5 min after a checkpoint at ~25 min of training).
        let t = trace("0,add,a\n0,add,b\n1800000,remove,b\n");
        let p = params(20.0 * 3600.0);
        let limpet = simulate(&t, &p, Policy::Limpet).unwrap();
        assert!((limpet.paused_s - 0.01).abs() < 1e-6, "{}", limpet.paused_s);
        assert_eq!(limpet.transitions, 1);
        // Half the job is left at 30 min on one host: 1 h more, plus the idle.
        assert!((limpet.hours - 1.5).abs() < 1e-3, "{}", limpet.hours);
        let ckpt = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
        assert!(ckpt.lost_s > 100.0 && ckpt.hours > limpet.hours + 0.05, "{ckpt:?}");
        // Without a notice, limpet loses the step in flight and the recovery.
        let kill = simulate(&t, &Params { no_notice: 1.0, ..p }, Policy::Limpet).unwrap();
        assert!((kill.paused_s - 2.3).abs() < 1e-6 && (kill.lost_s - 1.0).abs() < 1e-9, "{kill:?}");
    }

    #[test]
    fn booting_hosts_are_paid_for_but_do_not_train() {
        let t = trace("0,add,a\n");
        let p = Params { boot_s: 1800.0, ..params(10.0 * 3600.0) };
        let o = simulate(&t, &p, Policy::Limpet).unwrap();
        assert!((o.hours - 1.5).abs() < 1e-3, "{}", o.hours);
        assert!((o.cost - 1.5).abs() < 1e-2, "{}", o.cost);
        // A host removed while booting was never a transition.
        let t = trace("0,add,a\n0,add,b\n60000,remove,b\n");
        assert_eq!(simulate(&t, &p, Policy::Limpet).unwrap().transitions, 0, "a's join starts the job");
    }

    #[test]
    fn an_empty_fleet_for_good_never_finishes() {
        let t = trace("0,add,a\n10,remove,a\n");
        assert!(simulate(&t, &Params { tick_s: 3600.0, ..params(1e9) }, Policy::Limpet).is_none());
    }
}

//! The comparison a skeptical reviewer would ask for: checkpoint-restart at its best (Young's
//! interval from the trace's own rate of change, and the best of a sweep of intervals, with
//! and without restarts on additions), on-demand sized at the spot fleet's time-average and at
//! its cheapest per sample, every policy over the same window, and limpet's figure against
//! on-demand broken into its factors (price, boot, scaling, transitions).

use super::model::{simulate, Outcome, Params, Policy};
use super::trace::Trace;
use serde::Serialize;

/// How checkpoint-restart is run: its checkpoint interval, whether a new host restarts the
/// job, whether it saves before a planned restart, and whether its checkpoints are
/// asynchronous (the pause of one).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Setting {
    /// Seconds of training between checkpoints.
    pub every_s: f64,
    /// Whether an added host restarts the job (torchrun's agent: a new rendezvous).
    pub restart_on_add: bool,
    /// Whether it checkpoints before a planned restart (a notice, an added host).
    pub on_notice: bool,
    /// The pause of an asynchronous checkpoint; `None`: synchronous.
    pub async_pause_s: Option<f64>,
}

impl Setting {
    /// A synchronous setting every `every_s`, restarting on additions or not.
    pub fn every(every_s: f64, restart_on_add: bool) -> Setting {
        Setting { every_s, restart_on_add, on_notice: false, async_pause_s: None }
    }

    /// `params` run with this setting.
    pub fn apply(&self, p: &Params) -> Params {
        Params {
            checkpoint_every_s: self.every_s,
            restart_on_add: self.restart_on_add,
            checkpoint_on_notice: self.on_notice,
            async_pause_s: self.async_pause_s,
            ..p.clone()
        }
    }

    /// How tables name it: `every 1m 12s` and, without restarts on additions, so.
    pub fn describe(&self) -> String {
        let s = self.every_s.round() as u64;
        let every = match (s / 60, s % 60) {
            (0, s) => format!("{s}s"),
            (m, 0) => format!("{m}m"),
            (m, s) => format!("{m}m {s}s"),
        };
        let mut s = format!("every {every}");
        if self.async_pause_s.is_some() {
            s += " async";
        }
        if self.on_notice {
            s += ", saves on notice";
        }
        if !self.restart_on_add {
            s += ", no restart on add";
        }
        s
    }
}

/// Mean seconds between the instants checkpoint-restart restarts at over the window: the
/// time some host is live, over the instants at which a live fleet changes (by its removals
/// only, without restarts on additions). Several events at one instant are one restart; the
/// fleet's first hosts are a start, not a restart.
pub fn mean_time_between_changes(trace: &Trace, until_s: f64, restart_on_add: bool) -> f64 {
    let until_ms = (until_s * 1e3) as u64;
    let (mut live, mut live_since, mut live_ms, mut instants) = (0usize, 0u64, 0u64, 0usize);
    let mut i = 0;
    let events = &trace.events;
    while i < events.len() && events[i].at_ms <= until_ms {
        let at = events[i].at_ms;
        let before = live;
        let mut counts = false;
        while i < events.len() && events[i].at_ms == at {
            let e = &events[i];
            counts |= before > 0 && (restart_on_add || !e.add);
            live = if e.add { live + 1 } else { live.saturating_sub(1) };
            i += 1;
        }
        instants += usize::from(counts);
        match (before > 0, live > 0) {
            (false, true) => live_since = at,
            (true, false) => live_ms += at - live_since,
            _ => {}
        }
    }
    if live > 0 {
        live_ms += until_ms.saturating_sub(live_since);
    }
    live_ms as f64 / 1e3 / instants.max(1) as f64
}

/// Young's checkpoint interval, `sqrt(2 δ M)`: `δ` what one (synchronous) checkpoint costs
/// the job, `M` the mean time between restarts. Floored at one second.
pub fn young_interval(trace: &Trace, p: &Params) -> f64 {
    let until = p.until_s.unwrap_or_else(|| trace.duration_s());
    let pause = p.checkpoint_write_s;
    (2.0 * pause * mean_time_between_changes(trace, until, p.restart_on_add)).sqrt().max(1.0)
}

/// The intervals the search tries: 15 s to 4 h, each 1.5 times the last, and Young's.
fn intervals(young: f64) -> Vec<f64> {
    let mut v: Vec<f64> =
        std::iter::successors(Some(15.0f64), |x| Some(x * 1.5)).take_while(|x| *x <= 4.0 * 3600.0).collect();
    v.push(young);
    v.sort_by(f64::total_cmp);
    v
}

/// Checkpoint-restart at its best over a trace, and at Young's interval.
#[derive(Clone, Debug, Serialize)]
pub struct Search {
    /// The setting of the lowest cost per trained sample, and its run.
    pub best: (Setting, Outcome),
    /// Young's interval (with the caller's restarts on additions), and its run.
    pub young: (Setting, Outcome),
    /// Every setting tried, with its dollars per million trained samples.
    pub tried: Vec<(Setting, f64)>,
}

/// Runs checkpoint-restart with every interval of the search, with and without restarts on
/// additions, with and without saving before planned restarts, synchronous and asynchronous
/// (pausing `async_pause_s`), and keeps the one of the lowest cost per trained sample (within
/// a window every spot policy pays the same, so the one that trains the most). `None`: the
/// fleet never trains. `progress` is called after each run.
pub fn best_checkpoint_restart(
    trace: &Trace,
    p: &Params,
    async_pause_s: f64,
    progress: &dyn Fn(),
) -> Option<Search> {
    let young = Setting {
        every_s: young_interval(trace, p),
        on_notice: p.checkpoint_on_notice,
        ..Setting::every(0.0, p.restart_on_add)
    };
    let young_run = simulate(trace, &young.apply(p), Policy::CheckpointRestart)?;
    progress();
    let mut best = (young, young_run.clone());
    let mut tried = vec![(young, young_run.usd_per_million)];
    for s in settings(young.every_s, async_pause_s) {
        if s == young {
            continue;
        }
        let o = simulate(trace, &s.apply(p), Policy::CheckpointRestart)?;
        progress();
        tried.push((s, o.usd_per_million));
        if o.usd_per_million < best.1.usd_per_million {
            best = (s, o);
        }
    }
    Some(Search { best, young: (young, young_run), tried })
}

/// Every setting the search tries (Young's among them).
fn settings(young: f64, async_pause_s: f64) -> Vec<Setting> {
    let mut v = Vec::new();
    for every_s in intervals(young) {
        for restart_on_add in [true, false] {
            for on_notice in [false, true] {
                for async_pause_s in [None, Some(async_pause_s)] {
                    v.push(Setting { every_s, restart_on_add, on_notice, async_pause_s });
                }
            }
        }
    }
    v
}

/// How many runs [`best_checkpoint_restart`] makes (for a progress bar).
pub fn search_runs(trace: &Trace, p: &Params) -> u64 {
    settings(young_interval(trace, p), 1.0).len() as u64
}

/// The spot fleet's time-average size over the first `until_s` seconds: hosts live in the
/// trace (paid for), rounded, at least one.
pub fn average_fleet(trace: &Trace, until_s: f64) -> usize {
    let (mut area, mut last, mut live) = (0.0, 0.0, 0usize);
    for (t, n) in trace.live() {
        let t = t.min(until_s);
        area += live as f64 * (t - last);
        (last, live) = (t, n);
    }
    area += live as f64 * (until_s - last).max(0.0);
    ((area / until_s.max(f64::MIN_POSITIVE)).round() as usize).max(1)
}

/// The on-demand fleet of the lowest cost per sample, of 1 to `most` hosts: the fewest hosts
/// when scaling loses anything, unless measured rates say otherwise.
pub fn cheapest_size(p: &Params, most: usize) -> usize {
    (1..=most.max(1)).min_by(|&a, &b| (a as f64 / p.rate(a)).total_cmp(&(b as f64 / p.rate(b)))).unwrap_or(1)
}

/// limpet's cost per sample against on-demand's, as the product of its factors.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Breakdown {
    /// The spot price over the on-demand price.
    pub price: f64,
    /// Host-hours paid over host-hours that could train (booting hosts are paid for).
    pub boot: f64,
    /// Host-hours per sample of limpet's fleet without transitions over on-demand's fleet's:
    /// a smaller fleet loses less to scaling.
    pub scaling: f64,
    /// What limpet's booted hosts could have trained over what it trained (transitions).
    pub transitions: f64,
    /// Their product: limpet's dollars per sample over on-demand's.
    pub total: f64,
}

/// limpet's run `l` against on-demand's run `od` over the same window, broken down.
pub fn breakdown(l: &Outcome, od: &Outcome, p: &Params) -> Breakdown {
    let tiny = f64::MIN_POSITIVE;
    let price = p.spot_price / p.on_demand_price;
    let boot = l.billed_host_hours / l.ready_host_hours.max(tiny);
    let scaling =
        (l.ready_host_hours / l.possible_ready.max(tiny)) / (od.billed_host_hours / od.trained.max(tiny));
    let transitions = l.possible_ready / l.trained.max(tiny);
    Breakdown { price, boot, scaling, transitions, total: price * boot * scaling * transitions }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::test_params;

    fn params() -> Params {
        Params { scaling: 0.9, boot_s: 60.0, tick_s: 0.5, until_s: Some(4.0 * 3600.0), ..test_params(1e6) }
    }

    /// Four hours of a fleet of three whose third host comes and goes every `period_s`.
    fn churn(period_s: u64) -> Trace {
        let mut text = String::from("0,add,a\n0,add,b\n0,add,c\n");
        let mut t = period_s;
        let mut live = true;
        while t < 4 * 3600 {
            text += &format!("{},{},c\n", t * 1000, if live { "remove" } else { "add" });
            live = !live;
            t += period_s;
        }
        Trace::parse(&text, "churn").unwrap()
    }

    #[test]
    fn youngs_interval_follows_the_traces_rate_of_change() {
        let p = params();
        // The fleet is live the whole 4 h and changes at 47 instants (every 5 minutes, the
        // first hosts being a start): M = 14400 / 47, a 10 s write: sqrt(2 * 10 * M).
        let young = young_interval(&churn(300), &p);
        assert!((young - (2.0 * 10.0 * 14400.0 / 47.0f64).sqrt()).abs() < 1e-9, "{young}");
        // Without restarts on additions only the 24 removals count.
        let no_add = Params { restart_on_add: false, ..p.clone() };
        assert!((young_interval(&churn(300), &no_add) - (2.0 * 10.0 * 600.0f64).sqrt()).abs() < 1e-9);
        // Events at one instant are one change.
        let t = Trace::parse("0,add,a\n0,add,b\n3600000,remove,a\n3600000,remove,b\n", "t").unwrap();
        assert_eq!(mean_time_between_changes(&t, 7200.0, true), 3600.0);
    }

    #[test]
    fn the_search_finds_a_setting_no_worse_than_youngs_and_far_better_than_a_long_interval() {
        let trace = churn(300);
        let p = params();
        let search = best_checkpoint_restart(&trace, &p, 1.0, &|| {}).unwrap();
        assert_eq!(search.tried.len() as u64, search_runs(&trace, &p));
        let (best, young) = (&search.best.1, &search.young.1);
        assert!(best.usd_per_million <= young.usd_per_million);
        // Ten minutes between checkpoints on a trace that changes every five loses nearly all.
        let long =
            simulate(&trace, &Setting::every(600.0, true).apply(&p), Policy::CheckpointRestart).unwrap();
        assert!(best.trained > 2.0 * long.trained, "{} {}", best.trained, long.trained);
        // Here a new host costs a restart and brings a third of the speed for five minutes:
        // not restarting for it is better.
        assert!(!search.best.0.restart_on_add, "{:?}", search.best.0);
    }

    #[test]
    fn on_demand_sizes_and_the_breakdown_multiply_to_the_ratio() {
        let trace = churn(300);
        let p = params();
        // Three hosts, the third live half the time: 2.5 on average, rounded to 3 (2.5 rounds up).
        assert_eq!(average_fleet(&trace, 4.0 * 3600.0), 3);
        assert_eq!(
            average_fleet(&Trace::parse("0,add,a\n0,add,b\n1800000,remove,b\n", "t").unwrap(), 7200.0),
            1
        );
        assert_eq!(cheapest_size(&p, 8), 1);
        assert_eq!(cheapest_size(&Params { rates: vec![0.0, 1.0, 3.0, 3.1], ..p.clone() }, 3), 2);
        let od_p = Params { on_demand_hosts: 3, ..p.clone() };
        let l = simulate(&trace, &od_p, Policy::Limpet).unwrap();
        let od = simulate(&trace, &od_p, Policy::OnDemand).unwrap();
        let b = breakdown(&l, &od, &od_p);
        assert!((b.total - l.usd_per_million / od.usd_per_million).abs() < 1e-9 * b.total, "{b:?}");
        assert!((b.price - 1.0 / 3.0).abs() < 1e-12);
        // Boots are paid for; the smaller fleet scales better; transitions cost something.
        assert!(b.boot > 1.0 && b.scaling < 1.0 && b.transitions > 1.0, "{b:?}");
        // Each factor on its own: two steady hosts booting half an hour of a two-hour window,
        // on-demand two hosts, linear scaling: boot 4 / 3 host-hours, scaling 1, no transitions.
        let steady = Trace::parse("0,add,a\n0,add,b\n", "t").unwrap();
        let q = Params { scaling: 1.0, boot_s: 1800.0, until_s: Some(7200.0), ..p.clone() };
        let l = simulate(&steady, &q, Policy::Limpet).unwrap();
        let od = simulate(&steady, &q, Policy::OnDemand).unwrap();
        let b = breakdown(&l, &od, &q);
        assert!((b.boot - 4.0 / 3.0).abs() < 1e-3 && (b.scaling - 1.0).abs() < 1e-9, "{b:?}");
        assert!((b.transitions - 1.0).abs() < 1e-9 && (b.total - 4.0 / 9.0).abs() < 1e-3, "{b:?}");
    }
}

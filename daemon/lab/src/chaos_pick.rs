//! The segments `limpet-lab chaos --runs N` replays, picked from a trace by rule so any
//! trace gives its own: one with many change instants (`--transitions`, a dozen by default,
//! every third removal a `kill -9` without notice), one of spot notices only, one of kills
//! without notice only, one of joins only, then mixed segments spread over the trace. Each
//! keeps hosts live throughout it, so that no instant takes a majority of the log's voters.

use clap::Args;
use limpet_daemon::simulate::trace::Trace;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// The options of `limpet-lab chaos` for several runs.
#[derive(Clone, Debug, Args)]
pub struct RunsArgs {
    /// Replay this many segments picked from the trace (many transitions, notices only, kills
    /// only, joins only, then mixed ones) and report the replay-vs-simulation difference of
    /// each, the worst and the median.
    #[arg(long, conflicts_with_all = ["from_s", "until_s", "hosts", "kill_every", "reproducible", "ec2"])]
    pub runs: Option<usize>,
    /// With --runs: the change instants the first segment has at least.
    #[arg(long, default_value_t = 12, requires = "runs")]
    pub transitions: usize,
    /// With --runs: the most hosts a segment has (founders and those joining).
    #[arg(long, default_value_t = 10, requires = "runs")]
    pub max_hosts: usize,
    /// With --runs: the longest segment, in the trace's seconds.
    #[arg(long, default_value_t = 3600.0, requires = "runs")]
    pub max_window_s: f64,
}

impl Default for RunsArgs {
    fn default() -> RunsArgs {
        RunsArgs { runs: None, transitions: 12, max_hosts: 10, max_window_s: 3600.0 }
    }
}

/// What a segment is picked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// At least `--transitions` change instants, every third removal without notice.
    Many,
    /// Removals only, each with its spot notice.
    Notices,
    /// Removals only, each a `kill -9` without notice.
    Kills,
    /// Additions only.
    Joins,
    /// Whatever happens there, every second removal without notice.
    Mixed,
}

impl Kind {
    /// How the kind is named in tables, JSON and run directories.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Many => "many",
            Kind::Notices => "notices",
            Kind::Kills => "kills",
            Kind::Joins => "joins",
            Kind::Mixed => "mixed",
        }
    }

    /// Every k-th removal is a kill without notice (0: none).
    pub fn kill_every(self) -> u32 {
        match self {
            Kind::Many => 3,
            Kind::Notices | Kind::Joins => 0,
            Kind::Kills => 1,
            Kind::Mixed => 2,
        }
    }
}

/// A segment picked for a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Picked {
    /// Why it was picked.
    pub kind: Kind,
    /// Its start, in the trace's seconds.
    pub from_s: f64,
    /// Its end.
    pub until_s: f64,
    /// The hosts replayed: those live throughout first, then those with events.
    pub hosts: Vec<String>,
    /// Distinct instants at which a selected host comes or goes.
    pub instants: usize,
}

/// Hosts live throughout a segment: enough that no instant takes a majority of the log's
/// voters, whatever goes.
const ANCHORS: usize = 3;
/// The trace's seconds of training before a segment's first event.
const LEAD_S: f64 = 60.0;

/// One host's life in the trace, in milliseconds: added at, removed at (if ever).
#[derive(Clone, Debug)]
struct Life {
    name: String,
    added: u64,
    removed: Option<u64>,
}

/// Every host's lives, in the order of names then time (a name may come back after its
/// removal); one added and removed at the same instant never lived.
fn lives(trace: &Trace) -> Vec<Life> {
    let mut open: BTreeMap<&str, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for e in &trace.events {
        if e.add {
            open.entry(&e.node).or_insert(e.at_ms);
        } else if let Some(added) = open.remove(e.node.as_str()) {
            if added < e.at_ms {
                out.push(Life { name: e.node.clone(), added, removed: Some(e.at_ms) });
            }
        }
    }
    out.extend(open.into_iter().map(|(n, added)| Life { name: n.to_string(), added, removed: None }));
    out.sort_by(|a, b| (&a.name, a.added).cmp(&(&b.name, b.added)));
    out
}

/// The best segment of `kind` in the window starting `from` (ms), at most `len` ms long.
fn candidate(lives: &[Life], kind: Kind, from: u64, len: u64, max_hosts: usize) -> Option<Picked> {
    let until = from + len;
    // Nothing in the lead: the cluster trains before the segment's first event.
    let inside = |t: u64| t >= from + (LEAD_S * 1e3) as u64 && t < until;
    // A name with two lives in the window is replayed as both: no kind would describe it.
    let mut overlapping: BTreeMap<&str, usize> = BTreeMap::new();
    for l in lives.iter().filter(|l| l.added < until && l.removed.is_none_or(|r| r > from)) {
        *overlapping.entry(&l.name).or_default() += 1;
    }
    let lives: Vec<&Life> =
        lives.iter().filter(|l| overlapping.get(l.name.as_str()).is_none_or(|&n| n == 1)).collect();
    let anchors: Vec<&Life> = lives
        .iter()
        .copied()
        .filter(|l| l.added <= from && l.removed.is_none_or(|r| r >= until))
        .take(ANCHORS)
        .collect();
    if anchors.len() < ANCHORS {
        return None;
    }
    let mut moving: Vec<(&Life, Vec<u64>)> = lives
        .iter()
        .copied()
        .filter_map(|l| {
            let add = inside(l.added).then_some(l.added);
            let remove = l.removed.filter(|&r| inside(r));
            let live_at_start = l.added <= from && l.removed.is_none_or(|r| r > from);
            let events: Vec<u64> = match kind {
                Kind::Notices | Kind::Kills if live_at_start => remove.into_iter().collect(),
                Kind::Joins if l.removed.is_none_or(|r| r >= until) => add.into_iter().collect(),
                Kind::Many | Kind::Mixed if live_at_start || add.is_some() => {
                    add.into_iter().chain(remove).collect()
                }
                _ => Vec::new(),
            };
            (!events.is_empty()).then_some((l, events))
        })
        .collect();
    // Greedily, the host that adds the most instants not yet covered (then the earliest):
    // a segment is as eventful as its hosts allow.
    moving.sort_by_key(|(l, e)| (e[0], l.name.clone()));
    let mut covered: BTreeSet<u64> = BTreeSet::new();
    let mut chosen: Vec<(&Life, Vec<u64>)> = Vec::new();
    while chosen.len() + ANCHORS < max_hosts {
        let gain = |e: &[u64]| e.iter().filter(|t| !covered.contains(t)).count();
        let Some(k) = (0..moving.len())
            .filter(|&k| gain(&moving[k].1) > 0)
            .max_by_key(|&k| (gain(&moving[k].1), std::cmp::Reverse(k)))
        else {
            break;
        };
        let m = moving.remove(k);
        covered.extend(m.1.iter().copied());
        chosen.push(m);
    }
    chosen.sort_by_key(|(l, e)| (e[0], l.name.clone()));
    let moving = chosen;
    // A kill without notice must never take half of the hosts live before it.
    let mut live = anchors.len() + moving.iter().filter(|(l, _)| l.added <= from).count();
    let mut at: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for (l, events) in &moving {
        for &t in events {
            let e = at.entry(t).or_default();
            if t == l.added {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
    }
    if at.is_empty() {
        return None;
    }
    for (adds, removes) in at.values() {
        if kind.kill_every() > 0 && 2 * removes >= live {
            return None;
        }
        live = live + adds - removes;
    }
    let mut hosts: Vec<String> = anchors.iter().map(|l| l.name.clone()).collect();
    hosts.extend(moving.iter().map(|(l, _)| l.name.clone()));
    Some(Picked { kind, from_s: from as f64 / 1e3, until_s: until as f64 / 1e3, hosts, instants: at.len() })
}

/// Picks `runs` segments of `trace` (see the module's text); a kind the trace has no segment
/// of is left out, and said so.
pub fn pick(trace: &Trace, a: &RunsArgs) -> Result<(Vec<Picked>, Vec<String>), String> {
    let runs = a.runs.unwrap_or(0);
    if runs == 0 || runs > 20 {
        return Err(format!("--runs {runs}: from 1 to 20"));
    }
    if !(ANCHORS + 1..=12).contains(&a.max_hosts) {
        return Err(format!("--max-hosts {}: from {} to 12", a.max_hosts, ANCHORS + 1));
    }
    if !(a.max_window_s.is_finite() && a.max_window_s >= 2.0 * LEAD_S) {
        return Err(format!("--max-window-s {}: at least {}", a.max_window_s, 2.0 * LEAD_S));
    }
    let lives = lives(trace);
    // No window is longer than the trace.
    let max_len = ((a.max_window_s * 1e3) as u64).min(trace.end_ms);
    // Windows open a lead before an event and grow by half each time, up to the longest.
    let starts: BTreeSet<u64> = trace
        .events
        .iter()
        // Not an event within the lead of the trace's start: its hosts would join a cluster
        // still starting, and boot against its founders on the same cores.
        .filter(|e| e.at_ms >= (LEAD_S * 1e3) as u64)
        .map(|e| e.at_ms - (LEAD_S * 1e3) as u64)
        .collect();
    let mut lens = vec![((4.0 * LEAD_S * 1e3) as u64).min(max_len)];
    while *lens.last().expect("one") < max_len {
        lens.push((lens.last().expect("one").saturating_mul(3) / 2).min(max_len));
    }
    let windows: Vec<(u64, u64)> = starts
        .iter()
        .flat_map(|&s| lens.iter().map(move |&l| (s, l)))
        .filter(|&(s, l)| s + l <= trace.end_ms)
        .collect();
    let all = |kind: Kind| -> Vec<Picked> {
        windows.iter().filter_map(|&(s, l)| candidate(&lives, kind, s, l, a.max_hosts)).collect()
    };
    let mut picked: Vec<Picked> = Vec::new();
    let mut missing = Vec::new();
    // Many transitions: the shortest window that has them (then the earliest).
    let many = all(Kind::Many).into_iter().filter(|p| p.instants >= a.transitions).min_by(|x, y| {
        (x.until_s - x.from_s).total_cmp(&(y.until_s - y.from_s)).then(x.from_s.total_cmp(&y.from_s))
    });
    match many {
        Some(p) => picked.push(p),
        None => missing.push(format!(
            "no segment of at most {} hosts and {} s has {} change instants",
            a.max_hosts, a.max_window_s, a.transitions
        )),
    }
    // One kind each: the most instants (then the shortest, then the earliest).
    for kind in [Kind::Notices, Kind::Kills, Kind::Joins] {
        let best = all(kind).into_iter().max_by(|x, y| {
            x.instants
                .cmp(&y.instants)
                .then((y.until_s - y.from_s).total_cmp(&(x.until_s - x.from_s)))
                .then(y.from_s.total_cmp(&x.from_s))
        });
        match best {
            Some(p) => picked.push(p),
            None => missing.push(format!("no segment of {} only", kind.name())),
        }
    }
    // Mixed ones, spread over the trace: the longest window from the first start at or after
    // each fraction of it.
    let mixed = runs.saturating_sub(picked.len());
    for k in 0..mixed {
        let at = trace.end_ms * (k as u64 + 1) / (mixed as u64 + 1);
        let found = starts.range(at..).find_map(|&s| {
            lens.iter().rev().find_map(|&l| {
                (s + l <= trace.end_ms).then(|| candidate(&lives, Kind::Mixed, s, l, a.max_hosts)).flatten()
            })
        });
        match found.filter(|p| !picked.contains(p)) {
            Some(p) => picked.push(p),
            None => missing.push(format!("no mixed segment from {:.0} s of the trace on", at as f64 / 1e3)),
        }
    }
    picked.truncate(runs);
    if picked.is_empty() {
        return Err(format!("no segment of the trace could be picked: {}", missing.join("; ")));
    }
    Ok((picked, missing))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(n: usize, transitions: usize) -> RunsArgs {
        RunsArgs { runs: Some(n), transitions, ..RunsArgs::default() }
    }

    #[test]
    fn the_shipped_trace_gives_a_segment_of_each_kind() {
        let (trace, _) = limpet_daemon::simulate::trace::load(None).unwrap();
        let (picked, missing) = pick(&trace, &runs(6, 12)).unwrap();
        assert!(missing.is_empty(), "{missing:?}");
        let kinds: Vec<Kind> = picked.iter().map(|p| p.kind).collect();
        assert_eq!(kinds[..4], [Kind::Many, Kind::Notices, Kind::Kills, Kind::Joins]);
        assert!(kinds[4..].iter().all(|&k| k == Kind::Mixed) && kinds.len() == 6, "{kinds:?}");
        assert!(picked[0].instants >= 12, "{:?}", picked[0]);
        for p in &picked {
            assert!(p.hosts.len() <= 10 && p.until_s - p.from_s <= 3600.0, "{p:?}");
            let set: BTreeSet<&String> = p.hosts.iter().collect();
            assert_eq!(set.len(), p.hosts.len(), "{p:?}");
        }
        // The same trace gives the same segments.
        assert_eq!(pick(&trace, &runs(6, 12)).unwrap().0, picked);
    }

    #[test]
    fn a_segment_of_one_kind_holds_only_that_kind() {
        // a-c live throughout; d leaves at 100 s; e joins at 200 s; f joins at 300 s and
        // leaves at 400 s.
        let t = Trace::parse(
            "0,add,a\n0,add,b\n0,add,c\n0,add,d\n100000,remove,d\n200000,add,e\n300000,add,f\n400000,remove,f\n900000,remove,a\n",
            "t",
        )
        .unwrap();
        let l = lives(&t);
        let notices = candidate(&l, Kind::Notices, 0, 500_000, 10).unwrap();
        assert_eq!((notices.hosts.len(), notices.instants), (4, 1), "{notices:?}");
        assert!(notices.hosts.contains(&"d".to_string()));
        let joins = candidate(&l, Kind::Joins, 0, 500_000, 10).unwrap();
        assert_eq!(joins.hosts, ["a", "b", "c", "e"]);
        let mixed = candidate(&l, Kind::Mixed, 0, 500_000, 10).unwrap();
        assert_eq!(mixed.instants, 4, "{mixed:?}");
        // Hosts that go at one instant add one transition: one of them is taken.
        let t = Trace::parse(
            "0,add,a\n0,add,b\n0,add,c\n0,add,d\n0,add,e\n100000,remove,d\n100000,remove,e\n900000,remove,a\n",
            "t",
        )
        .unwrap();
        let kills = candidate(&lives(&t), Kind::Kills, 0, 500_000, 10).unwrap();
        assert_eq!((kills.hosts, kills.instants), (vec!["a".into(), "b".into(), "c".into(), "d".into()], 1));
        // A name back after its removal within the window would be replayed as both lives:
        // it is left out of every kind.
        let t = Trace::parse(
            "0,add,a\n0,add,b\n0,add,c\n0,add,d\n100000,remove,d\n200000,add,d\n300000,add,e\n900000,remove,a\n",
            "t",
        )
        .unwrap();
        let joins = candidate(&lives(&t), Kind::Joins, 0, 500_000, 10).unwrap();
        assert_eq!(joins.hosts, ["a", "b", "c", "e"]);
        assert!(candidate(&lives(&t), Kind::Notices, 0, 500_000, 10).is_none());
        // Windows never exceed the longest asked for, however short.
        let (trace, _) = limpet_daemon::simulate::trace::load(None).unwrap();
        let short = RunsArgs { max_window_s: 150.0, transitions: 2, ..runs(5, 12) };
        let (picked, _) = pick(&trace, &short).unwrap();
        assert!(!picked.is_empty() && picked.iter().all(|p| p.until_s - p.from_s <= 150.0), "{picked:?}");
        // Bad options are named.
        let (trace, _) = limpet_daemon::simulate::trace::load(None).unwrap();
        assert!(pick(&trace, &runs(0, 12)).unwrap_err().contains("--runs 0"));
        let few = RunsArgs { max_hosts: 3, ..runs(2, 12) };
        assert!(pick(&trace, &few).unwrap_err().contains("--max-hosts 3"));
    }
}

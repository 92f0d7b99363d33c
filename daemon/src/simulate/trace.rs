//! Spot preemption traces: `ms_since_start,add|remove,NODE` per line, read strictly: every
//! error names the line and what is wrong, and a trace that adds a live node or removes one
//! that is not live is refused, not guessed at. The AWS p3 trace limpet measures itself on
//! ships inside the binaries (`daemon/traces/`, with its source and licence): `--trace` is
//! needed only for another one.
//!
//! Traces of live counts are read too, and turned into events deterministically: Bamboo's
//! CSVs (`time,live_instances` per line, in hours or seconds) and SkyPilot's `spot-traces`
//! JSON (`{"metadata": {"gap_seconds": N}, "data": [count, ...]}`). A rise adds hosts under
//! the lowest free names (`h0`, `h1`, ...); a fall removes the newest live ones first.

use std::collections::BTreeSet;

/// One change of the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Milliseconds since the trace's start.
    pub at_ms: u64,
    /// A host was added (true) or taken away (false).
    pub add: bool,
    /// The host's name.
    pub node: String,
}

/// A whole trace, in time order.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The events.
    pub events: Vec<Event>,
    /// Where the trace ends, in milliseconds: its last event, or a later point of a trace of
    /// counts that ends quiet.
    pub end_ms: u64,
}

/// The shipped trace: real AWS p3 spot additions and removals over 11.4 hours, recorded by
/// the Bamboo project (NSDI'23; MIT licence; `daemon/traces/README.md`).
pub const AWS_P3: &str = include_str!("../../traces/aws-p3-preemptions.csv");
/// How the shipped trace is named in output and errors.
pub const AWS_P3_NAME: &str = "aws-p3-preemptions.csv (shipped with limpet)";

/// How a trace file is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `ms_since_start,add|remove,NODE` per line.
    #[default]
    Events,
    /// Bamboo's `time_hours,live_instances` per line.
    CountsHours,
    /// `time_seconds,live_instances` per line (Bamboo's unscaled CSVs).
    CountsSeconds,
    /// SkyPilot's spot-traces JSON: live counts every `metadata.gap_seconds`.
    Skypilot,
}

/// The trace at `path`, or the shipped AWS p3 trace without one; with the name it goes by.
pub fn load(path: Option<&std::path::Path>) -> Result<(Trace, String), String> {
    load_as(path, Format::Events)
}

/// The trace at `path` written as `format`, or the shipped AWS p3 trace without one.
pub fn load_as(path: Option<&std::path::Path>, format: Format) -> Result<(Trace, String), String> {
    match path {
        Some(p) => {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|e| format!("--trace {name}: {e}"))?;
            let trace = match format {
                Format::Events => Trace::parse(&text, &name).map_err(|e| match written_as(&text) {
                    Some(other) => format!("{e} (the file reads as {other}: add --trace-format {other})"),
                    None => e,
                })?,
                Format::CountsHours => Trace::from_counts(&counts_csv(&text, &name, 3600.0)?, &name)?,
                Format::CountsSeconds => Trace::from_counts(&counts_csv(&text, &name, 1.0)?, &name)?,
                Format::Skypilot => Trace::from_counts(&skypilot_json(&text, &name)?, &name)?,
            };
            Ok((trace, name))
        }
        None => Ok((Trace::parse(AWS_P3, AWS_P3_NAME)?, AWS_P3_NAME.to_string())),
    }
}

/// The `--trace-format` a file that is not a trace of events seems to be written in: a JSON
/// document is SkyPilot's, and lines of two numbers are counts (in hours when the times have
/// fractions, as Bamboo's do).
fn written_as(text: &str) -> Option<&'static str> {
    if text.trim_start().starts_with('{') {
        return Some("skypilot");
    }
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .take(8)
        .map(|l| l.split(',').map(str::trim).collect())
        .collect();
    let numbers = |r: &Vec<&str>| r.len() == 2 && r.iter().all(|f| f.parse::<f64>().is_ok());
    let data: Vec<&Vec<&str>> = rows.iter().skip_while(|r| !numbers(r)).collect();
    if data.is_empty() || !data.iter().all(|r| numbers(r)) {
        return None;
    }
    Some(if data.iter().any(|r| r[0].contains('.')) { "counts-hours" } else { "counts-seconds" })
}

/// Most hosts a count may name (a trace is input, not a place to ask for memory).
const MAX_COUNT: u64 = 100_000;
/// Most events a trace of counts may become.
const MAX_EVENTS: usize = 1_000_000;
/// Latest time a trace of counts may name (ten years).
const MAX_SECONDS: f64 = 10.0 * 365.0 * 86400.0;

/// `(seconds, live count)` points from `time,count` lines, `unit_s` seconds a time unit.
fn counts_csv(text: &str, file: &str, unit_s: f64) -> Result<Vec<(f64, usize)>, String> {
    let mut points = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |what: String| format!("{file}:{}: {what}", i + 1);
        let [time, count] = line.split(',').map(str::trim).collect::<Vec<_>>()[..] else {
            return Err(at(format!("{line:?} is not time,live_instances")));
        };
        let t: f64 = time
            .parse()
            .ok()
            .filter(|t: &f64| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| at(format!("{time:?} is not a time (a number, zero or more)")))?;
        let n: u64 = count
            .parse()
            .ok()
            .filter(|n| *n <= MAX_COUNT)
            .ok_or_else(|| at(format!("{count:?} is not a count of hosts (0 to {MAX_COUNT})")))?;
        let seconds = t * unit_s;
        if !seconds.is_finite() || seconds > MAX_SECONDS {
            return Err(at(format!("time {time}: past ten years")));
        }
        if let Some(&(prev, _)) = points.last().filter(|(prev, _)| *prev > seconds) {
            return Err(at(format!("time {time} is before the previous line's ({} s)", prev)));
        }
        points.push((seconds, n as usize));
    }
    Ok(points)
}

/// `(seconds, live count)` points from SkyPilot's spot-traces JSON.
fn skypilot_json(text: &str, file: &str) -> Result<Vec<(f64, usize)>, String> {
    let doc: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{file}: not a spot-traces JSON document: {e}"))?;
    let gap = doc["metadata"]["gap_seconds"]
        .as_f64()
        .filter(|g| g.is_finite() && *g > 0.0)
        .ok_or_else(|| format!("{file}: metadata.gap_seconds: a positive number of seconds is needed"))?;
    let data = doc["data"].as_array().ok_or_else(|| format!("{file}: data: an array of counts is needed"))?;
    if data.len() as f64 * gap > MAX_SECONDS {
        return Err(format!("{file}: {} counts {gap} s apart: past ten years", data.len()));
    }
    let mut points = data
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let n = v.as_u64().filter(|n| *n <= MAX_COUNT).ok_or_else(|| {
                format!("{file}: data[{i}]: {v} is not a count of hosts (0 to {MAX_COUNT})")
            })?;
            Ok((i as f64 * gap, n as usize))
        })
        .collect::<Result<Vec<_>, String>>()?;
    // Each count holds for its gap: the trace ends a gap after the last.
    if let Some(&(t, n)) = points.last() {
        points.push((t + gap, n));
    }
    Ok(points)
}

/// Longest node name accepted (a trace is input, not a place to store data).
const MAX_NAME: usize = 128;

impl Trace {
    /// Parses a trace; `file` names it in errors. Blank lines and `#` comments are skipped.
    pub fn parse(text: &str, file: &str) -> Result<Trace, String> {
        let mut events: Vec<Event> = Vec::new();
        let mut live = BTreeSet::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |what: String| format!("{file}:{}: {what}", i + 1);
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [ms, kind, node] = fields[..] else {
                return Err(at(format!("{line:?} is not ms_since_start,add|remove,NODE")));
            };
            let at_ms: u64 =
                ms.parse().map_err(|_| at(format!("{ms:?} is not a whole number of milliseconds")))?;
            let add = match kind {
                "add" => true,
                "remove" => false,
                _ => return Err(at(format!("{kind:?} is neither add nor remove"))),
            };
            if node.is_empty() || node.len() > MAX_NAME || node.chars().any(char::is_control) {
                return Err(at(format!("node name {node:?}: 1 to {MAX_NAME} printable characters")));
            }
            if let Some(prev) = events.last().filter(|e| e.at_ms > at_ms) {
                return Err(at(format!("time {at_ms} ms is before the previous event's {} ms", prev.at_ms)));
            }
            if add && !live.insert(node.to_string()) {
                return Err(at(format!("{node} is added while it is live")));
            }
            if !add && !live.remove(node) {
                return Err(at(format!("{node} is removed while it is not live")));
            }
            events.push(Event { at_ms, add, node: node.to_string() });
        }
        if events.is_empty() {
            return Err(format!("{file}: no events"));
        }
        Ok(Trace { end_ms: events.last().map_or(0, |e| e.at_ms), events })
    }

    /// The events that take a fleet through `points` of (seconds, live hosts): a rise adds
    /// hosts under the lowest free names, a fall removes the newest live ones first.
    pub fn from_counts(points: &[(f64, usize)], file: &str) -> Result<Trace, String> {
        let mut live: Vec<usize> = Vec::new();
        let mut free: BTreeSet<usize> = BTreeSet::new();
        let mut events = Vec::new();
        for &(t, n) in points {
            let at_ms = (t * 1e3).round() as u64;
            while live.len() > n {
                let h = live.pop().expect("a live host");
                free.insert(h);
                events.push(Event { at_ms, add: false, node: format!("h{h}") });
            }
            if events.len() + live.len().abs_diff(n) > MAX_EVENTS {
                return Err(format!("{file}: more than {MAX_EVENTS} additions and removals"));
            }
            while live.len() < n {
                let h = free.pop_first().unwrap_or(live.len() + free.len());
                live.push(h);
                events.push(Event { at_ms, add: true, node: format!("h{h}") });
            }
        }
        if events.is_empty() {
            return Err(format!("{file}: no host is ever live"));
        }
        // Past the last change the fleet stays as it is until the trace's last point.
        let end_ms = points.last().map_or(0, |&(t, _)| (t * 1e3).round() as u64);
        Ok(Trace { end_ms: end_ms.max(events.last().map_or(0, |e| e.at_ms)), events })
    }

    /// Where the trace ends (its last event, or its last point of counts), in seconds.
    pub fn duration_s(&self) -> f64 {
        self.end_ms.max(self.events.last().map_or(0, |e| e.at_ms)) as f64 / 1e3
    }

    /// Live hosts after each event: (seconds, count).
    pub fn live(&self) -> Vec<(f64, usize)> {
        let mut n = 0usize;
        self.events
            .iter()
            .map(|e| {
                n = if e.add { n + 1 } else { n - 1 };
                (e.at_ms as f64 / 1e3, n)
            })
            .collect()
    }

    /// The most hosts live at once.
    pub fn max_live(&self) -> usize {
        self.live().iter().map(|&(_, n)| n).max().unwrap_or(0)
    }

    /// Hosts taken away (each one a revocation).
    pub fn removals(&self) -> usize {
        self.events.iter().filter(|e| !e.add).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace in another format than the events `--trace` expects by default is named, with
    /// the flag that reads it, instead of only "is not ms_since_start,add|remove,NODE".
    #[test]
    fn a_trace_in_another_format_names_the_flag_that_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            (r#"{"metadata": {"gap_seconds": 600}, "data": [3, 2]}"#, "--trace-format skypilot"),
            ("0.0,4\n0.5,3\n", "--trace-format counts-hours"),
            ("0,4\n600,3\n", "--trace-format counts-seconds"),
        ] {
            let p = dir.path().join("t");
            std::fs::write(&p, text).unwrap();
            let e = load(Some(&p)).unwrap_err();
            assert!(e.contains("t:1:") && e.contains(want), "{e}");
            let format = match want.rsplit(' ').next().unwrap() {
                "skypilot" => Format::Skypilot,
                "counts-hours" => Format::CountsHours,
                _ => Format::CountsSeconds,
            };
            assert!(load_as(Some(&p), format).is_ok(), "{want}");
        }
        // A broken trace of events gets no such hint.
        std::fs::write(dir.path().join("e"), "0,add,a\n5,oops\n").unwrap();
        assert!(!load(Some(&dir.path().join("e"))).unwrap_err().contains("--trace-format"));
    }

    #[test]
    fn traces_parse_and_errors_name_the_line() {
        let t = Trace::parse("# a comment\n0,add,a\n0,add,b\n\n1500,remove,a\n", "t.csv").unwrap();
        assert_eq!(t.events.len(), 3);
        assert_eq!(t.live(), vec![(0.0, 1), (0.0, 2), (1.5, 1)]);
        assert_eq!((t.max_live(), t.removals(), t.duration_s()), (2, 1, 1.5));
        for (text, want) in [
            ("0,add,a\n5,remove,b\n", "t.csv:2: b is removed while it is not live"),
            ("0,add,a\n0,add,a\n", "t.csv:2: a is added while it is live"),
            ("10,add,a\n5,add,b\n", "t.csv:2: time 5 ms is before"),
            ("0,join,a\n", "t.csv:1: \"join\" is neither"),
            ("x,add,a\n", "t.csv:1: \"x\" is not a whole number"),
            ("0,add\n", "t.csv:1: \"0,add\" is not"),
            ("0,add,\n", "t.csv:1: node name"),
            ("", "t.csv: no events"),
        ] {
            let e = Trace::parse(text, "t.csv").unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn traces_of_counts_become_events_and_errors_name_the_line() {
        // Bamboo's layout: each change as the old count, then the new, at one time.
        let text = "0.000,0\n0.5,0\n0.5,3\n1.0,3\n1.0,1\n1.5,1\n1.5,2\n2.0,2\n";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.csv");
        std::fs::write(&path, text).unwrap();
        let (t, _) = load_as(Some(&path), Format::CountsHours).unwrap();
        let names: Vec<String> = t
            .events
            .iter()
            .map(|e| format!("{}{}@{}", if e.add { "+" } else { "-" }, e.node, e.at_ms / 1000))
            .collect();
        // The newest go first; a new host takes the lowest free name.
        assert_eq!(names, ["+h0@1800", "+h1@1800", "+h2@1800", "-h2@3600", "-h1@3600", "+h1@5400"]);
        assert_eq!((t.duration_s(), t.max_live(), t.removals()), (7200.0, 3, 2));
        let (s, _) = load_as(Some(&path), Format::CountsSeconds).unwrap();
        assert_eq!(s.duration_s(), 2.0);
        for (text, want) in [
            ("0,1\n5,x\n", "b.csv:2: \"x\" is not a count"),
            ("0,1\n-1,2\n", "b.csv:2: \"-1\" is not a time"),
            ("5,1\n4,2\n", "b.csv:2: time 4 is before"),
            ("0,1,2\n", "b.csv:1: \"0,1,2\" is not time,live_instances"),
            ("0,0\n1,0\n", "no host is ever live"),
            ("0,1\n1,100001\n", "b.csv:2: \"100001\" is not a count of hosts"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = load_as(Some(&path), Format::CountsHours).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        // SkyPilot's spot-traces JSON: a count every gap_seconds.
        let path = dir.path().join("s.json");
        std::fs::write(&path, r#"{"metadata": {"gap_seconds": 300}, "data": [0, 2, 2, 1, 1]}"#).unwrap();
        let (t, _) = load_as(Some(&path), Format::Skypilot).unwrap();
        // Five counts 300 s apart: the last holds until 1500 s.
        assert_eq!((t.events.len(), t.duration_s(), t.max_live()), (3, 1500.0, 2));
        for (text, want) in [
            (r#"{"metadata": {"gap_seconds": 0}, "data": [1]}"#, "metadata.gap_seconds"),
            (r#"{"metadata": {"gap_seconds": 60}}"#, "data: an array"),
            (r#"{"metadata": {"gap_seconds": 60}, "data": [1, -2]}"#, "data[1]: -2 is not a count"),
            ("[1, 2", "not a spot-traces JSON document"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = load_as(Some(&path), Format::Skypilot).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_shipped_bamboo_counts_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
        // (file prefix, hours, most hosts, revocations): the held-out table's.
        for (name, hours, most, revocations) in [
            ("bamboo-g4dn-xlarge-us-east-1c", 24.5, 12, 85),
            ("bamboo-g4dn-xlarge-us-east-1d", 12.7, 12, 51),
            ("bamboo-p2-xlarge-us-east-1e", 19.0, 10, 3),
        ] {
            let file = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with(name))
                .unwrap();
            let (t, _) = load_as(Some(&file), Format::CountsHours).unwrap();
            assert!((t.duration_s() / 3600.0 - hours).abs() < 0.05, "{name}: {}", t.duration_s());
            assert_eq!((t.max_live(), t.removals()), (most, revocations), "{name}");
        }
    }

    #[test]
    fn the_shipped_p3_trace_parses() {
        let (t, name) = load(None).unwrap();
        assert_eq!(name, AWS_P3_NAME);
        assert_eq!(t.events.len(), 344);
        assert!(t.duration_s() > 10.0 * 3600.0 && t.max_live() >= 18, "{} {}", t.duration_s(), t.max_live());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "[0-9a-z,\n# ]{0,200}") {
            let _ = Trace::parse(&text, "t.csv");
        }

        #[test]
        fn arbitrary_counts_never_panic_and_replay_to_their_counts(
            counts in proptest::collection::vec(0usize..20, 1..40),
            text in "[0-9.,\n# -]{0,200}",
        ) {
            let _ = counts_csv(&text, "c.csv", 1.0);
            let _ = skypilot_json(&text, "s.json");
            let points: Vec<(f64, usize)> = counts.iter().enumerate().map(|(i, &n)| (i as f64, n)).collect();
            match Trace::from_counts(&points, "c") {
                Ok(t) => {
                    // The events parse back (every add of a host not live, every removal of
                    // one live) and leave the fleet at the last count.
                    let text: String = t.events.iter().map(|e| format!("{},{},{}\n", e.at_ms, if e.add { "add" } else { "remove" }, e.node)).collect();
                    let back = Trace::parse(&text, "back").unwrap();
                    proptest::prop_assert_eq!(back.live().last().map(|l| l.1), counts.last().copied());
                }
                Err(e) => proptest::prop_assert!(counts.iter().all(|&n| n == 0), "{e}"),
            }
        }
    }
}

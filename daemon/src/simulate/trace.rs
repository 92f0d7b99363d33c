//! Spot preemption traces: `ms_since_start,add|remove,NODE` per line, read strictly: every
//! error names the line and what is wrong, and a trace that adds a live node or removes one
//! that is not live is refused, not guessed at. The AWS p3 trace limpet measures itself on
//! ships inside the binaries (`daemon/traces/`, with its source and licence): `--trace` is
//! needed only for another one.

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
}

/// The shipped trace: real AWS p3 spot additions and removals over 11.4 hours, recorded by
/// the Bamboo project (NSDI'23; MIT licence; `daemon/traces/README.md`).
pub const AWS_P3: &str = include_str!("../../traces/aws-p3-preemptions.csv");
/// How the shipped trace is named in output and errors.
pub const AWS_P3_NAME: &str = "aws-p3-preemptions.csv (shipped with limpet)";

/// The trace at `path`, or the shipped AWS p3 trace without one; with the name it goes by.
pub fn load(path: Option<&std::path::Path>) -> Result<(Trace, String), String> {
    match path {
        Some(p) => {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|e| format!("--trace {name}: {e}"))?;
            Ok((Trace::parse(&text, &name)?, name))
        }
        None => Ok((Trace::parse(AWS_P3, AWS_P3_NAME)?, AWS_P3_NAME.to_string())),
    }
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
        Ok(Trace { events })
    }

    /// When the last event happens, in seconds.
    pub fn duration_s(&self) -> f64 {
        self.events.last().map_or(0.0, |e| e.at_ms as f64 / 1e3)
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
    }
}

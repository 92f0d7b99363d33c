//! What an agent tells the cluster about itself every heartbeat: its training progress,
//! health and recent transitions. Sent as JSON to the leader and the voters (consensus keeps it opaque,
//! stamped with its arrival time); the leader's controller reads progress and failures from
//! it, and `limpet status` shows it. Decoding is strict and bounded: a report comes from the
//! network.

use crate::DecideError;
use limpet_consensus::state::NodeId;
use serde::{Deserialize, Serialize};

/// Version of the report document.
pub const REPORT_VERSION: u32 = 1;

/// How many transitions a report carries (the newest).
pub const MAX_TRANSITIONS: usize = 16;

/// The longest cause a report's transition carries: an epoch's cause is summarised past
/// [`limpet_consensus::state::MAX_CAUSE_TEXT`], and one logged before that was is clipped,
/// so sixteen transitions stay far below the report's size limit whatever the fleet.
pub const MAX_TRANSITION_CAUSE: usize = 2 * limpet_consensus::state::MAX_CAUSE_TEXT;

/// `cause` clipped to [`MAX_TRANSITION_CAUSE`] bytes (at a character boundary).
pub fn clip_cause(cause: &str) -> String {
    if cause.len() <= MAX_TRANSITION_CAUSE {
        return cause.to_string();
    }
    let mut end = MAX_TRANSITION_CAUSE - 4;
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} ...", &cause[..end])
}

/// What the agent's trainer is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Started; not in any epoch yet.
    Starting,
    /// Waiting to be included in an epoch (joining) or for the next epoch after a failure.
    Waiting,
    /// Forming an epoch's group, checking state hashes, copying state.
    Entering,
    /// Training in its epoch.
    Training,
    /// Reached the job's last step.
    Finished,
    /// Left training (notice, drain); waiting to be removed.
    Left,
}

/// One epoch change as this agent lived it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    /// The epoch entered.
    pub epoch: u64,
    /// The step it was entered at.
    pub step: u64,
    /// Why the epoch exists (from the log).
    pub cause: String,
    /// Milliseconds from this agent's last completed step to the epoch's entry (0 for the
    /// first epoch).
    pub idle_ms: u64,
    /// Lost steps (docs/status.md): 1 when a collective broke mid-step and the new epoch
    /// computes that step again because no peer finished it, else 0.
    pub lost_steps: u64,
    /// Whether this agent copied its state from a peer on entry, and how many bytes.
    pub fetched_bytes: u64,
    /// How long that copy took, milliseconds (0 without a copy).
    #[serde(default)]
    pub fetch_ms: u64,
    /// Whether the hashes at entry disagreed at equal steps (divergence repaired).
    pub repaired: bool,
    /// Steps this agent had applied that the epoch trains again: a pipeline whose stage had
    /// no live replica went back to the last shadowed snapshot.
    #[serde(default)]
    pub redone_steps: u64,
}

/// The agents' latest reports by node: (milliseconds since it arrived, the report).
pub type Reports = std::collections::BTreeMap<NodeId, (u64, AgentReport)>;

/// An agent's heartbeat document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentReport {
    /// `REPORT_VERSION`.
    pub v: u32,
    /// The node.
    pub node: NodeId,
    /// Its process id (for local clusters' `limpet revoke --hard`).
    pub pid: u32,
    /// What it is doing.
    pub phase: Phase,
    /// The epoch whose group it trains in (0: none).
    pub epoch: u64,
    /// Steps applied: the next step it trains.
    pub applied_step: u64,
    /// Loss of its last step.
    pub loss: Option<f64>,
    /// Smoothed wall time of a step, milliseconds (0 until measured).
    pub step_time_ms: f64,
    /// Samples per second over the whole world (global batch / step time).
    pub samples_per_s: f64,
    /// The epoch whose collective failed under it, and since when (ms), if waiting on one.
    pub broken: Option<Broken>,
    /// Newest transitions, oldest first.
    pub transitions: Vec<Transition>,
    /// Smoothed gradient statistics of its epoch (per-sample variance σ², squared norm of
    /// the mean μ²), for AdaScale; absent with one rank.
    #[serde(default)]
    pub grad_stats: Option<(f64, f64)>,
    /// Smoothed milliseconds this rank takes to compute one sample of its share (forward and
    /// backward, no collectives): what the leader shares samples out by (0 until measured).
    #[serde(default)]
    pub ms_per_sample: f64,
    /// Milliseconds one forward and backward of every block of a pipelined job's model took
    /// on this host at the profile's micro-batch, measured when it started (0: not measured):
    /// against the job's profile, this host's speed for the pipeline planner.
    #[serde(default)]
    pub profile_ms: f64,
    /// Why its last checkpoint failed (a full disk, an S3 outage), until one succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
    /// A revocation notice this node saw, from the moment it saw it (its `Notice` command may
    /// still be on its way to a leader): the leader plans the node's leave at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notice: Option<PendingNotice>,
    /// The newest held-out evaluation of its epoch (`[job].eval_every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalPoint>,
    /// Peers whose data port refused this node's connection lately (nothing listened there:
    /// a dead process's kernel refuses for it), while it connected a group: the leader
    /// probes them itself. Its word alone fails nobody.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<NodeId>,
}

/// A held-out evaluation: summed over the ranks of an epoch, once per evaluated step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalPoint {
    /// The steps applied when it was made.
    pub step: u64,
    /// Mean held-out loss per sample (finite).
    pub loss: f64,
}

impl EvalPoint {
    /// `exp(loss)`: the perplexity of a language model's mean token loss.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// A revocation notice as the node that got it reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingNotice {
    /// When the node will be taken, unix ms.
    pub deadline_ms: u64,
    /// Which source said so (`aws`, `gcp`, `azure`, `aws-rebalance`, ...).
    pub source: String,
}

/// Longest notice source a report may name (a report is a peer's words).
const MAX_SOURCE: usize = 64;

/// A collective failure the agent is waiting to be resolved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Broken {
    /// The epoch whose group broke.
    pub epoch: u64,
    /// Milliseconds since it broke.
    pub since_ms: u64,
    /// The peer the error names, if it names one.
    pub suspect: Option<NodeId>,
    /// The error.
    pub error: String,
    /// Whether the error is a protocol violation (a peer's bytes broke the protocol: a bug
    /// or a hostile peer), not a transient failure.
    #[serde(default)]
    pub violation: bool,
}

impl AgentReport {
    /// A report of a node that has trained nothing yet, in `phase`.
    pub fn new(node: NodeId, pid: u32, phase: Phase) -> AgentReport {
        AgentReport {
            v: REPORT_VERSION,
            node,
            pid,
            phase,
            epoch: 0,
            applied_step: 0,
            loss: None,
            step_time_ms: 0.0,
            samples_per_s: 0.0,
            broken: None,
            transitions: Vec::new(),
            grad_stats: None,
            ms_per_sample: 0.0,
            profile_ms: 0.0,
            checkpoint_error: None,
            notice: None,
            eval: None,
            refused: Vec::new(),
        }
    }

    /// Encodes as sent.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("reports serialize")
    }

    /// Decodes a report received from `from`, refusing other versions and reports that
    /// claim to be someone else's.
    pub fn decode(bytes: &[u8], from: NodeId) -> Result<AgentReport, DecideError> {
        let bad = |detail: String| DecideError::Report { from, detail };
        let mut r: AgentReport = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if r.v != REPORT_VERSION {
            return Err(bad(format!("version {} (this build reads {REPORT_VERSION})", r.v)));
        }
        if r.node != from {
            return Err(bad(format!("claims to be node {}", r.node)));
        }
        if r.transitions.len() > MAX_TRANSITIONS {
            return Err(bad(format!("{} transitions", r.transitions.len())));
        }
        // An agent of an earlier build sends its epochs' causes whole: clipped here, not
        // refused (a refused report would make the node look silent).
        for t in r.transitions.iter_mut().filter(|t| t.cause.len() > MAX_TRANSITION_CAUSE) {
            t.cause = clip_cause(&t.cause);
        }
        if !(r.ms_per_sample.is_finite() && r.ms_per_sample >= 0.0) {
            return Err(bad(format!("{} ms per sample", r.ms_per_sample)));
        }
        if !(r.profile_ms.is_finite() && r.profile_ms >= 0.0) {
            return Err(bad(format!("a profile of {} ms", r.profile_ms)));
        }
        if let Some(e) = r.eval.filter(|e| !e.loss.is_finite()) {
            return Err(bad(format!("a held-out loss of {}", e.loss)));
        }
        if let Some(n) = r.notice.as_ref().filter(|n| n.source.len() > MAX_SOURCE) {
            return Err(bad(format!("a notice source of {} bytes", n.source.len())));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn report(node: NodeId) -> AgentReport {
        AgentReport {
            v: REPORT_VERSION,
            node,
            pid: 42,
            phase: Phase::Training,
            epoch: 3,
            applied_step: 120,
            loss: Some(0.5),
            step_time_ms: 4.5,
            samples_per_s: 1000.0,
            broken: Some(Broken {
                epoch: 3,
                since_ms: 10,
                suspect: Some(2),
                error: "closed".into(),
                violation: false,
            }),
            grad_stats: Some((2.0, 0.5)),
            ms_per_sample: 0.25,
            profile_ms: 12.5,
            checkpoint_error: Some("No space left on device".into()),
            notice: Some(PendingNotice { deadline_ms: 1_700_000_120_000, source: "aws".into() }),
            eval: Some(EvalPoint { step: 100, loss: 2.25 }),
            refused: vec![4],
            transitions: vec![Transition {
                epoch: 3,
                step: 100,
                cause: "join of node 4".into(),
                idle_ms: 12,
                lost_steps: 0,
                fetched_bytes: 1 << 20,
                fetch_ms: 3,
                repaired: false,
                redone_steps: 0,
            }],
        }
    }

    #[test]
    fn reports_round_trip_and_bad_ones_are_named() {
        let r = report(7);
        assert_eq!(AgentReport::decode(&r.encode(), 7).unwrap(), r);
        let mut long = report(7);
        long.notice = Some(PendingNotice { deadline_ms: 1, source: "x".repeat(MAX_SOURCE + 1) });
        let e = AgentReport::decode(&long.encode(), 7).unwrap_err().to_string();
        assert!(e.contains("a notice source of 65 bytes"), "{e}");
        let e = AgentReport::decode(&r.encode(), 8).unwrap_err().to_string();
        assert!(e.contains("report of node 8: claims to be node 7"), "{e}");
        // A whole cause of an earlier build's epoch is clipped, not a reason to refuse.
        let mut whole = r.clone();
        whole.transitions[0].cause = "é".repeat(MAX_TRANSITION_CAUSE);
        let read = AgentReport::decode(&whole.encode(), 7).unwrap();
        assert!(
            read.transitions[0].cause.len() <= MAX_TRANSITION_CAUSE
                && read.transitions[0].cause.ends_with(" ...")
        );
        let old = String::from_utf8(r.encode()).unwrap().replace("\"v\":1", "\"v\":9");
        assert!(AgentReport::decode(old.as_bytes(), 7).unwrap_err().to_string().contains("version 9"));
        let extra = String::from_utf8(r.encode()).unwrap().replacen('{', "{\"evil\":1,", 1);
        assert!(AgentReport::decode(extra.as_bytes(), 7).unwrap_err().to_string().contains("unknown field"));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), from in 1u64..10) {
            if let Ok(r) = AgentReport::decode(&bytes, from) {
                prop_assert_eq!(AgentReport::decode(&r.encode(), from).unwrap(), r);
            }
        }

        #[test]
        fn damaged_reports_never_panic(pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = report(3).encode();
            let i = pos.index(bytes.len());
            bytes[i] = byte;
            if let Ok(r) = AgentReport::decode(&bytes, 3) {
                prop_assert_eq!(AgentReport::decode(&r.encode(), 3).unwrap(), r);
            }
        }
    }
}

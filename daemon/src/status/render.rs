//! The status document: what a node answered (its replicated state and the agents'
//! reports) shaped into `StatusDoc`, and that document rendered for people as text and tables.

use crate::text::{lines, table};
use limpet_agent::report::AgentReport;
use limpet_consensus::state::{ClusterState, Epoch, MemberStatus, NodeId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Version of the status document.
pub const STATUS_VERSION: u32 = 1;

/// An epoch as shown.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EpochDoc {
    /// Id.
    pub id: u64,
    /// First step.
    pub start_step: u64,
    /// Rank names in order.
    pub ranks: Vec<String>,
    /// Global batch.
    pub global_batch: u64,
    /// Micro-batch.
    pub micro_batch: u64,
    /// Learning-rate multiplier.
    pub lr_scale: f64,
    /// Why it exists.
    pub cause: String,
}

/// A node as shown.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeDoc {
    /// Raft id.
    pub id: u64,
    /// Name.
    pub name: String,
    /// Membership status (Joining, Active, Draining, Leaving, Failed, Gone).
    pub status: String,
    /// Why it has that status.
    pub reason: String,
    /// leader, voter, learner or none.
    pub role: String,
    /// Trainer phase from its last report (none if never heard from).
    pub phase: Option<String>,
    /// Epoch it trains in.
    pub epoch: Option<u64>,
    /// Steps applied.
    pub step: Option<u64>,
    /// Loss of its last step.
    pub loss: Option<f64>,
    /// Samples per second.
    pub samples_per_s: Option<f64>,
    /// Milliseconds since its last heartbeat reached the answering node.
    pub heartbeat_age_ms: Option<u64>,
    /// Revocation deadline (unix ms), if leaving.
    pub deadline_ms: Option<u64>,
    /// What the host has, as its agent reported when it joined: CPUs, memory, GPUs.
    #[serde(default)]
    pub host: String,
    /// Why its last checkpoint failed, until one succeeds (a full disk, an S3 outage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
}

/// A transition as shown: an epoch and how its ranks lived the change.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TransitionDoc {
    /// The epoch entered.
    pub epoch: u64,
    /// Its start step.
    pub step: u64,
    /// World size.
    pub world: usize,
    /// Its ranks counted per device (each host's local ranks; in a pipeline each a replica of
    /// its host's stage); 0 in documents of builds before it was shown.
    #[serde(default)]
    pub devices: usize,
    /// Cause.
    pub cause: String,
    /// Largest idle time any reporting rank saw, ms.
    pub idle_ms: Option<u64>,
    /// Lost steps (docs/status.md): steps in flight at the transition that nobody finished,
    /// so the new epoch computes them again (largest over ranks).
    pub lost_steps: Option<u64>,
    /// Redone steps (docs/status.md): steps already applied that are trained again after a
    /// stage went back to a shadowed snapshot, sharded state to a checkpoint, or a rank that
    /// alone applied the step in flight to the step the others agree on (largest over ranks).
    #[serde(default)]
    pub redone_steps: u64,
    /// The first of the redone steps: the step the ranks that went back entered at (the
    /// epoch's `step` is where the furthest survivor stood by its last report, which a rank
    /// that alone applied the step in flight had passed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redone_from: Option<u64>,
    /// `DATAxPIPELINE`.
    #[serde(default)]
    pub layout: String,
    /// Bytes of state copied from peers (sum over ranks).
    pub fetched_bytes: u64,
    /// Longest state copy of a rank, ms.
    #[serde(default)]
    pub fetch_ms: u64,
    /// The epoch's global batch (the batch policy's decision).
    #[serde(default)]
    pub global_batch: u64,
    /// The epoch's learning-rate multiplier.
    #[serde(default)]
    pub lr_scale: f64,
    /// Samples per step each rank computes when a slower host gets fewer (empty: equal).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<u64>,
    /// The ranks, by name, in the epoch's data-major order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<String>,
    /// Block cuts between stages (empty: one stage).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<u32>,
}

/// `limpet status --json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StatusDoc {
    /// `STATUS_VERSION`.
    pub v: u32,
    /// Cluster name.
    pub cluster: String,
    /// The node that answered.
    pub answered_by: String,
    /// Leader name (none during an election).
    pub leader: Option<String>,
    /// Raft term.
    pub term: u64,
    /// The current epoch.
    pub epoch: Option<EpochDoc>,
    /// The next epoch, committed but not started.
    pub scheduled: Option<EpochDoc>,
    /// Highest step any rank of the current epoch applied.
    pub step: u64,
    /// The job's total steps.
    pub total_steps: Option<u64>,
    /// Every member.
    pub nodes: Vec<NodeDoc>,
    /// Newest transitions, oldest first.
    pub transitions: Vec<TransitionDoc>,
    /// Durable checkpoints recorded in the log, oldest first (a pipelined job records one
    /// part per stage; epoch 0 marks the checkpoint a new cluster resumed from).
    #[serde(default)]
    pub checkpoints: Vec<CheckpointDoc>,
    /// The fleet reconciler's newest records, oldest first (`[capacity]`).
    #[serde(default)]
    pub capacity: Vec<crate::reconciler::CapacityDoc>,
    /// Throughput measured at each world size, smallest first (what scaling by value fits).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throughput: Vec<limpet_consensus::state::Throughput>,
    /// The number of hosts scaling by value chose last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling_target: Option<u32>,
    /// The job cannot get past a step: rebuilt again and again with every rank alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stuck: Option<limpet_agent::stuck::Stuck>,
    /// The newest held-out evaluation any rank reported (`[job].eval_every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<limpet_agent::report::EvalPoint>,
}

/// A checkpoint as the log records it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointDoc {
    /// The step it holds.
    pub step: u64,
    /// The epoch it was written in (0: before this cluster).
    pub epoch: u64,
    /// Where.
    pub location: String,
    /// Who wrote it.
    pub node: String,
}

fn name_of(st: &ClusterState, id: NodeId) -> String {
    st.members.get(&id).map_or_else(|| format!("node {id}"), |m| m.spec.name.clone())
}

fn epoch_doc(st: &ClusterState, e: &Epoch) -> EpochDoc {
    EpochDoc {
        id: e.id,
        start_step: e.start_step,
        ranks: e.ranks.iter().map(|&r| name_of(st, r)).collect(),
        global_batch: e.batch.global_batch,
        micro_batch: e.batch.micro_batch,
        lr_scale: e.lr_scale,
        cause: e.cause.clone(),
    }
}

/// Agent reports by node: the report's age in ms and the report itself (undecodable ones
/// are left out: status shows what the log says about such a node, not a guess).
type Reports = BTreeMap<NodeId, (u64, AgentReport)>;

/// Reports older than this do not say why a job is stuck (the node may be gone): status
/// does not know the cluster's heartbeat timeout, and this is above any sensible one.
const REPORT_FRESH_MS: u64 = 15_000;

pub(super) fn build(
    cluster: &str,
    st: &ClusterState,
    leader: NodeId,
    term: u64,
    reports: &[limpet_consensus::NodeReport],
    at: &str,
) -> StatusDoc {
    let parsed: Reports = reports
        .iter()
        .filter_map(|r| {
            Some((r.node, (r.age.as_millis() as u64, AgentReport::decode(&r.report, r.node).ok()?)))
        })
        .collect();
    let nodes = st.members.values().map(|m| node_doc(st, m, leader, &parsed)).collect();
    let skip = st.history.len().saturating_sub(16);
    let transitions = st.history.iter().skip(skip).map(|e| transition_doc(st, e, &parsed)).collect();
    let step = st
        .current
        .as_ref()
        .map(|e| {
            e.ranks
                .iter()
                .filter_map(|r| parsed.get(r).map(|(_, p)| p.applied_step))
                .max()
                .unwrap_or(e.start_step)
        })
        .unwrap_or(0);
    let total_steps = st.job.as_ref().and_then(|j| j.get("steps")).and_then(|v| v.as_u64());
    StatusDoc {
        v: STATUS_VERSION,
        cluster: cluster.to_string(),
        answered_by: at.to_string(),
        leader: (leader != 0).then(|| name_of(st, leader)),
        term,
        epoch: st.current.as_ref().map(|e| epoch_doc(st, e)),
        scheduled: st.scheduled.as_ref().map(|e| epoch_doc(st, e)),
        step,
        total_steps,
        nodes,
        transitions,
        checkpoints: st
            .checkpoints
            .iter()
            .map(|c| CheckpointDoc {
                step: c.step,
                epoch: c.epoch,
                location: c.location.clone(),
                node: name_of(st, c.node),
            })
            .collect(),
        capacity: crate::reconciler::docs(st, usize::MAX, |id| name_of(st, id)),
        throughput: st.throughput.by_world.clone(),
        scaling_target: st.capacity.target,
        stuck: limpet_agent::stuck::assess(st, &parsed, REPORT_FRESH_MS)
            .map(|s| limpet_agent::stuck::Stuck { error: one_line(&s.error), ..s }),
        eval: parsed.values().filter_map(|(_, r)| r.eval).max_by_key(|e| e.step),
    }
}

/// One member as the log records it, with what its last report says. A gone member keeps
/// its last step and loss but shows no phase, epoch or speed: those would be stale.
fn node_doc(
    st: &ClusterState,
    m: &limpet_consensus::state::Member,
    leader: NodeId,
    parsed: &Reports,
) -> NodeDoc {
    let id = m.spec.id;
    let r = parsed.get(&id);
    let role = if id == leader {
        "leader"
    } else if st.voters.contains(&id) {
        "voter"
    } else if st.learners.contains(&id) {
        "learner"
    } else {
        "none"
    };
    let live = r.filter(|_| m.status != MemberStatus::Gone).map(|(_, r)| r);
    NodeDoc {
        id,
        name: m.spec.name.clone(),
        status: format!("{:?}", m.status),
        reason: m.reason.clone(),
        role: role.into(),
        phase: live.map(|r| {
            serde_json::to_value(r.phase).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
        }),
        epoch: live.map(|r| r.epoch),
        step: r.map(|(_, r)| r.applied_step),
        loss: r.and_then(|(_, r)| r.loss),
        samples_per_s: live.map(|r| r.samples_per_s),
        heartbeat_age_ms: r.map(|(age, _)| *age),
        deadline_ms: m.deadline_ms,
        host: host_line(&m.spec.hardware),
        checkpoint_error: live.and_then(|r| r.checkpoint_error.as_deref().map(one_line)),
    }
}

/// One epoch change, with what the agents that lived through it report: the worst idle time
/// and loss among them, and the bytes they fetched in all.
fn transition_doc(st: &ClusterState, e: &limpet_consensus::state::Epoch, parsed: &Reports) -> TransitionDoc {
    let lived: Vec<_> =
        parsed.values().flat_map(|(_, r)| r.transitions.iter().filter(|t| t.epoch == e.id)).collect();
    TransitionDoc {
        epoch: e.id,
        step: e.start_step,
        world: e.ranks.len(),
        devices: e.total_ranks(),
        cause: e.cause.clone(),
        idle_ms: lived.iter().map(|t| t.idle_ms).max(),
        lost_steps: lived.iter().map(|t| t.lost_steps).max(),
        redone_steps: lived.iter().map(|t| t.redone_steps).max().unwrap_or(0),
        redone_from: lived.iter().filter(|t| t.redone_steps > 0).map(|t| t.step).min(),
        layout: format!("{}x{}", e.layout.data, e.layout.pipeline),
        fetched_bytes: lived.iter().map(|t| t.fetched_bytes).sum(),
        fetch_ms: lived.iter().map(|t| t.fetch_ms).max().unwrap_or(0),
        global_batch: e.batch.global_batch,
        lr_scale: e.lr_scale,
        shares: e.shares.clone(),
        ranks: e.ranks.iter().map(|&r| name_of(st, r)).collect(),
        cuts: e.layout.cuts.clone(),
    }
}

/// A host's hardware in a few words: `2 cpu 23.5G, 1x NVIDIA A100-SXM4-40GB` (no GPU part on
/// CPU hosts, no memory where it is unknown).
fn host_line(h: &limpet_consensus::state::Hardware) -> String {
    let mut s = format!("{} cpu", h.cpus);
    if h.memory_mib > 0 {
        s += &format!(" {:.1}G", h.memory_mib as f64 / 1024.0);
    }
    if h.gpus > 0 {
        let model = if h.gpu_model.is_empty() { "GPU" } else { h.gpu_model.as_str() };
        s += &format!(", {}x {model}", h.gpus);
    } else if !h.gpu_model.is_empty() {
        // The driver lists GPUs libtorch cannot use (an old driver, a CPU-only build).
        s += &format!(", {} unusable (libtorch sees no GPU)", h.gpu_model);
    }
    if h.device == "cpu" && (h.gpus > 0 || !h.gpu_model.is_empty()) {
        s += ", training on the CPU";
    }
    if h.local_ranks() > 1 {
        // `[node].devices`: the host trains as this many ranks.
        s += &format!(", {} ranks", h.local_ranks());
    }
    if h.speed_milli != 0 && h.speed_milli != 1000 {
        // Measured faster or slower than the others (what the pipeline planner places by).
        s += &format!(", speed x{:.2}", h.speed_milli as f64 / 1000.0);
    }
    s
}

/// Renders the status document for people.
pub fn render(d: &StatusDoc) -> String {
    let mut s = String::new();
    let total = d.total_steps.map_or(String::new(), |t| format!("/{t}"));
    s += &format!(
        "cluster {}  leader {}  term {}  step {}{}\n",
        d.cluster,
        d.leader.as_deref().unwrap_or("(election)"),
        d.term,
        d.step,
        total
    );
    if let Some(e) = &d.epoch {
        s += &format!(
            "epoch {} from step {}: {} rank(s) [{}], global batch {}, lr x{:.3}\n",
            e.id,
            e.start_step,
            e.ranks.len(),
            e.ranks.join(" "),
            e.global_batch,
            e.lr_scale
        );
    }
    if let Some(x) = &d.stuck {
        s += &format!("JOB STUCK: {x}\n");
    }
    if let Some(e) = &d.eval {
        s += &format!(
            "held-out loss {:.4} (perplexity {:.2}) after step {}\n",
            e.loss,
            e.perplexity(),
            e.step
        );
    }
    if let Some(e) = &d.scheduled {
        s +=
            &format!("next epoch {} at step {}: [{}] ({})\n", e.id, e.start_step, e.ranks.join(" "), e.cause);
    }
    let mut nodes = table(
        &[
            "NODE",
            "ROLE",
            "STATUS",
            "PHASE",
            "EPOCH",
            "STEP",
            "LOSS",
            "SAMPLES/S",
            "HB(ms)",
            "HOST",
            "REASON",
        ],
        4..9,
    );
    for n in &d.nodes {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        nodes.add_row(vec![
            n.name.clone(),
            n.role.clone(),
            n.status.clone(),
            opt(n.phase.clone()),
            opt(n.epoch.map(|e| e.to_string())),
            opt(n.step.map(|e| e.to_string())),
            opt(n.loss.map(|l| format!("{l:.4}"))),
            opt(n.samples_per_s.map(|v| format!("{v:.0}"))),
            opt(n.heartbeat_age_ms.map(|v| v.to_string())),
            n.host.clone(),
            n.reason.clone(),
        ]);
    }
    s += &format!("\n{}\n", lines(&nodes));
    if !d.transitions.is_empty() {
        s += "\n";
        s += &transitions_table(&d.transitions);
    }
    if let Some(c) = d.checkpoints.last() {
        s += &format!("\nlast checkpoint: step {} by {} at {}\n", c.step, c.node, c.location);
    }
    if !d.throughput.is_empty() {
        s += "\n";
        s += &crate::reconciler::render_throughput(&d.throughput, d.scaling_target);
    }
    if !d.capacity.is_empty() {
        s += "\n";
        s += &crate::reconciler::render(&d.capacity);
    }
    for n in d.nodes.iter().filter(|n| n.checkpoint_error.is_some()) {
        s += &format!(
            "checkpoints failing on {}: {}\n",
            n.name,
            n.checkpoint_error.as_deref().unwrap_or_default()
        );
    }
    terminal_safe(&s)
}

/// `text` with every control character but the line breaks shown escaped (`\u{1b}`). What
/// the status shows is mostly members' words (names, reasons, GPU models, checkpoint
/// locations and errors); one holding an escape sequence would otherwise act on the
/// operator's terminal (clear it, retitle it, hide lines).
/// Bidirectional overrides, embeddings, isolates and marks escaped too: one would reorder
/// what follows it on the line (a node's name shown backwards, a reason hiding another).
pub fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' {
            out.extend(c.escape_default());
        } else if is_bidi(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

fn is_bidi(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// A peer's report text (an error, a checkpoint failure) on one line: a line break in it
/// would show as lines of the status of the peer's making.
fn one_line(text: &str) -> String {
    text.replace('\n', "\\n")
}

/// The transitions as a table: epoch, step, world, batch, idle time, lost steps, state
/// copied, cause.
pub fn transitions_table(transitions: &[TransitionDoc]) -> String {
    let mut t =
        table(&["EPOCH", "STEP", "WORLD", "LAYOUT", "BATCH", "IDLE(ms)", "LOST", "COPIED", "CAUSE"], 1..8);
    for x in transitions {
        t.add_row(vec![
            x.epoch.to_string(),
            x.step.to_string(),
            x.world.to_string(),
            if x.devices > x.world {
                format!("{} ({} ranks)", x.layout, x.devices)
            } else {
                x.layout.clone()
            },
            x.global_batch.to_string(),
            x.idle_ms.map_or("-".into(), |v| v.to_string()),
            match (x.lost_steps, x.redone_steps) {
                (None, _) => "-".into(),
                (Some(l), r) => (l + r).to_string(),
            },
            if x.fetched_bytes > 0 { format!("{:.1} MB", x.fetched_bytes as f64 / 1e6) } else { "-".into() },
            x.cause.clone(),
        ]);
    }
    format!("{}\n", lines(&t))
}

#[cfg(test)]
mod tests {
    use super::{build, host_line, render, terminal_safe, transitions_table, TransitionDoc};
    use limpet_agent::report::{AgentReport, Broken, Phase};
    use limpet_consensus::state::{ClusterState, Command, Hardware, MemberSpec};

    /// A job whose rebuild broke again on a protocol violation: `limpet status` says it is
    /// stuck, where, and what the rank reported; without the violation's report, it does not.
    #[test]
    fn status_says_when_the_job_is_stuck_at_a_step() {
        let spec = |id| MemberSpec {
            id,
            name: format!("n{id}"),
            control_addr: String::new(),
            data_addr: String::new(),
            hardware: Hardware::default(),
        };
        let mut st = ClusterState::bootstrap("c", &[spec(1), spec(2)]);
        st.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
        // The first epoch as the leader plans it, then a rebuild of it at step 79.
        let settings = limpet_agent::leader::LeaderSettings {
            heartbeat_ms: 100,
            heartbeat_timeout_ms: 1000,
            lead_ms: 400,
            notice_margin_ms: 1000,
            min_nodes: 2,
            policy: limpet_agent::policy::BatchPolicy::FixedGlobal,
            base: limpet_agent::policy::BaseBatch { global_batch: 64, micro_batch: 64, world: 2 },
            straggler_ratio: 0.0,
            straggler_steps: 100,
        };
        let fresh = (1..=2).map(|id| (id, (0, AgentReport::new(id, 0, Phase::Waiting)))).collect();
        for c in limpet_agent::leader::plan_round(&settings, &st, &fresh, 1_000_000).commands {
            st.apply(&c).unwrap();
        }
        let first = st.scheduled.clone().expect("a first epoch");
        st.apply(&Command::ActivateEpoch { id: first.id }).unwrap();
        let rebuild = limpet_consensus::state::Epoch {
            id: first.id + 1,
            start_step: 79,
            cause: "collective failure with every rank alive".into(),
            causes: vec![limpet_consensus::state::Cause::Rebuild],
            ..first
        };
        st.apply(&Command::ScheduleEpoch { epoch: rebuild.clone() }).unwrap();
        st.apply(&Command::ActivateEpoch { id: rebuild.id }).unwrap();
        let id = st.current.as_ref().unwrap().id;
        let mut r = AgentReport::new(2, 0, Phase::Waiting);
        r.epoch = id;
        r.broken = Some(Broken {
            epoch: id,
            since_ms: 10,
            suspect: Some(1),
            error: "protocol violation: node 1 sent 28 bytes where 52296 were due\nJOB DONE \u{202e}enod"
                .into(),
            violation: true,
        });
        r.checkpoint_error = Some("disk full\nn9 Active".into());
        let report = |r: &AgentReport| limpet_consensus::NodeReport {
            node: r.node,
            age: std::time::Duration::from_millis(5),
            report: r.encode(),
        };
        let doc = build("c", &st, 1, 1, &[report(&r)], "n1");
        let text = render(&doc);
        assert!(text.contains("JOB STUCK: stuck at step 79") && text.contains("52296"), "{text}");
        // A report's text cannot make lines of its own, nor turn the line around.
        assert!(text.contains("were due\\nJOB DONE \\u{202e}enod"), "{text}");
        assert!(text.contains("disk full\\nn9 Active"), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("JOB DONE") || l.starts_with("n9 Active")), "{text}");
        r.broken.as_mut().unwrap().violation = false;
        assert!(
            build("c", &st, 1, 1, &[report(&r)], "n1").stuck.is_none(),
            "one rebuild of a transient fault"
        );
    }

    #[test]
    fn tables_align_numbers_right_and_end_lines_without_padding() {
        let t = TransitionDoc {
            epoch: 12,
            step: 3025,
            world: 2,
            devices: 4,
            cause: "drain of node 4".into(),
            idle_ms: Some(4),
            lost_steps: Some(0),
            redone_steps: 0,
            redone_from: None,
            layout: "2x1".into(),
            fetched_bytes: 1_400_000,
            fetch_ms: 3,
            global_batch: 32,
            lr_scale: 1.0,
            shares: Vec::new(),
            ranks: Vec::new(),
            cuts: Vec::new(),
        };
        let text = transitions_table(&[t]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines.iter().all(|l| !l.ends_with(' ')), "{text:?}");
        // Right-aligned: the header and the value of STEP end in the same column.
        let end = |l: &str, w: &str| l.find(w).map(|i| i + w.len());
        assert_eq!(end(lines[0], "STEP"), end(lines[1], "3025"), "{text}");
        assert!(lines[1].contains("1.4 MB") && lines[1].ends_with("drain of node 4"), "{text}");
        // Hosts of two devices: the layout says how many ranks it trains.
        assert!(lines[1].contains("2x1 (4 ranks)"), "{text}");
    }

    /// A member's name, a reason and a checkpoint location holding escape sequences reach
    /// the operator's terminal escaped: no control character but the line breaks.
    #[test]
    fn members_words_cannot_drive_the_operators_terminal() {
        let spec = |id, name: &str| MemberSpec {
            id,
            name: name.into(),
            control_addr: String::new(),
            data_addr: String::new(),
            hardware: Hardware { gpu_model: "A10G\u{1b}[8m".into(), gpus: 1, ..Hardware::default() },
        };
        let mut st = ClusterState::bootstrap("c", &[spec(1, "n1"), spec(2, "n2\u{1b}]0;pwned\u{7}")]);
        st.apply(&Command::Drain { id: 2, reason: "bye\u{1b}[2J\rgone".into() }).unwrap();
        st.checkpoints.push(limpet_consensus::state::CheckpointRecord {
            step: 5,
            epoch: 0,
            content_hash: String::new(),
            location: "/ckpt\u{1b}[2J".into(),
            node: 2,
        });
        let text = render(&build("c", &st, 1, 1, &[], "n1"));
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        for shown in ["n2\\u{1b}]0;pwned\\u{7}", "A10G\\u{1b}[8m", "/ckpt\\u{1b}[2J", "bye\\u{1b}[2J\\rgone"]
        {
            assert!(text.contains(shown), "{shown} not in {text}");
        }
        assert_eq!(terminal_safe("a\tb\nc"), "a\\tb\nc");
    }

    #[test]
    fn a_host_is_described_by_what_it_reported() {
        let cpu = Hardware { cpus: 2, memory_mib: 24_064, ..Hardware::default() };
        assert_eq!(host_line(&cpu), "2 cpu 23.5G");
        let gpu = Hardware { cpus: 8, gpus: 2, gpu_model: "NVIDIA A10G".into(), ..Hardware::default() };
        assert_eq!(host_line(&gpu), "8 cpu, 2x NVIDIA A10G");
        let old = Hardware { cpus: 4, gpus: 1, ..Hardware::default() };
        assert_eq!(host_line(&old), "4 cpu, 1x GPU");
        let four = Hardware { ranks: 4, gpus: 4, ..gpu.clone() };
        assert_eq!(host_line(&four), "8 cpu, 4x NVIDIA A10G, 4 ranks");
        // A GPU host training on its CPU, and one whose GPUs libtorch cannot use, say so.
        let cpu_on_gpu_host = Hardware { device: "cpu".into(), ..gpu.clone() };
        assert_eq!(host_line(&cpu_on_gpu_host), "8 cpu, 2x NVIDIA A10G, training on the CPU");
        let unusable = Hardware { gpus: 0, device: "cpu".into(), ..gpu.clone() };
        assert_eq!(
            host_line(&unusable),
            "8 cpu, NVIDIA A10G unusable (libtorch sees no GPU), training on the CPU"
        );
        assert_eq!(host_line(&Hardware { device: "cuda".into(), ..gpu.clone() }), "8 cpu, 2x NVIDIA A10G");
        assert_eq!(host_line(&Hardware { device: "cpu".into(), ..cpu.clone() }), "2 cpu 23.5G");
        let slow = Hardware { speed_milli: 350, ..cpu.clone() };
        assert_eq!(host_line(&slow), "2 cpu 23.5G, speed x0.35");
    }
}

//! One node's consensus core: the raft-rs `RawNode`, its storage and the `ClusterState` it
//! applies, driven by ticks and messages and doing no network I/O.
//!
//! The gRPC node (`node.rs`) and the in-memory harness (`harness.rs`) drive the same `Core`:
//! they hand it ticks, incoming messages, proposals and read requests, call `process` (the
//! Ready loop, in raft-rs order) and deliver the `Output` — outgoing messages, applied
//! entries, finished reads. Storage errors come back as fatal errors; nothing here retries
//! or hides them. What a peer's message must pass before raft-rs sees it is in `checks.rs`.

use crate::error::{ConsensusError, Result};
use crate::membership::{self, VoterDecision, VoterPolicy, VoterView};
use crate::state::{
    cluster_id, ClusterState, Command, NodeId, Proposal, ProposalId, Refused, SnapshotData, FORMAT_VERSION,
};
use crate::storage::{AppliedState, LogStore};
use raft::prelude::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState, Entry,
    EntryType, Message, Snapshot, SnapshotMetadata,
};
use raft::{RawNode, StateRole};
use std::collections::BTreeMap;
use std::sync::Arc;

mod checks;

pub use checks::{MAX_INDEX, MAX_TERM_LEAD};

/// Why a peer's message was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// The message could panic raft-rs, speaks for someone else, or would change the cluster
    /// behind the state machine: the sender is buggy or hostile.
    #[error("refused: {0}")]
    Refused(String),
    /// raft-rs declined it in the normal course (a proposal with no leader to take it).
    #[error("{0}")]
    Raft(String),
}

/// How a core is set up.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// This node's Raft id (non-zero).
    pub id: NodeId,
    /// The cluster's name (its hash is the wire cluster id).
    pub cluster: String,
    /// Ticks without a leader before a follower campaigns (raft-rs randomizes within
    /// `[election_tick, 2 * election_tick)`).
    pub election_tick: usize,
    /// Ticks between leader heartbeats.
    pub heartbeat_tick: usize,
    /// Applied entries between snapshots (log compaction).
    pub snapshot_interval: u64,
    /// Applied entries between writes of the applied state: the state is encoded and
    /// written whole, so not for every batch. A restart replays the entries after the last
    /// write from the log (compaction never passes it); a configuration change, a
    /// compaction, `save_ticks` and a clean stop write it at once. 1 writes every batch.
    pub save_every: u64,
    /// The most ticks the applied state goes unwritten while entries are applied.
    pub save_ticks: u64,
    /// Who votes.
    pub voters: VoterPolicy,
}

impl CoreConfig {
    /// Defaults for a node: with 100 ms ticks, elections after 1-2 s, heartbeats every 200 ms.
    pub fn new(id: NodeId, cluster: &str) -> CoreConfig {
        CoreConfig {
            id,
            cluster: cluster.to_string(),
            election_tick: 10,
            heartbeat_tick: 2,
            snapshot_interval: 1000,
            save_every: 32,
            // 1 s at limpetd's 100 ms ticks.
            save_ticks: 10,
            voters: VoterPolicy::default(),
        }
    }

    /// Checks the knobs.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ConsensusError::Config(m));
        if self.id == 0 {
            return bad("node id 0 is reserved by raft".into());
        }
        if self.cluster.is_empty() {
            return bad("cluster name is empty".into());
        }
        if self.heartbeat_tick == 0 || self.election_tick <= self.heartbeat_tick {
            return bad(format!(
                "election_tick ({}) must exceed heartbeat_tick ({}), which must be positive",
                self.election_tick, self.heartbeat_tick
            ));
        }
        if self.snapshot_interval == 0 {
            return bad("snapshot_interval must be positive".into());
        }
        if self.save_every == 0 {
            return bad("save_every must be positive".into());
        }
        self.voters.validate().map_err(ConsensusError::Config)
    }
}

/// An entry this node applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// Its log index.
    pub index: u64,
    /// Who proposed it (None for entries that did not decode).
    pub origin: Option<ProposalId>,
    /// What the state machine said.
    pub outcome: crate::state::Outcome,
}

/// What one `process` call produced.
#[derive(Debug, Default)]
pub struct Output {
    /// Messages to send, in order.
    pub messages: Vec<Message>,
    /// Normal entries applied, in log order.
    pub applied: Vec<Applied>,
    /// Read requests (by id) whose read index is now applied: serve them from `state()`.
    pub reads: Vec<u64>,
}

/// This node's view, for `limpet status` and tests.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeStatus {
    /// This node.
    pub id: NodeId,
    /// leader, follower, candidate, pre-candidate, or learner.
    pub role: String,
    /// The leader it knows (0: none).
    pub leader: NodeId,
    /// Current term.
    pub term: u64,
    /// Commit index.
    pub commit: u64,
    /// Applied index.
    pub applied: u64,
    /// Last log index.
    pub last_index: u64,
    /// Index of the latest snapshot.
    pub snapshot_index: u64,
    /// Voters (incoming, if joint).
    pub voters: Vec<NodeId>,
    /// Outgoing voters while a joint change runs.
    pub voters_outgoing: Vec<NodeId>,
    /// Learners.
    pub learners: Vec<NodeId>,
    /// The voter controller's last decision and its reason (leader only).
    pub last_decision: String,
}

/// The consensus core of one node.
pub struct Core<S: LogStore> {
    raw: RawNode<S>,
    cfg: CoreConfig,
    cluster_id: u64,
    /// Shared with readers ([`Core::shared_state`]): applying clones it only while one
    /// still holds the previous state.
    state: Arc<ClusterState>,
    applied: u64,
    /// The applied index last written to the store, when, and whether a configuration
    /// change since must be written at once (a snapshot for a new learner is made from it).
    saved: u64,
    saved_tick: u64,
    save_now: bool,
    conf: ConfState,
    ticks: u64,
    heard: BTreeMap<NodeId, u64>,
    /// The term this node leads and the tick it started leading it: silence is only judged
    /// from then on.
    led_since: Option<(u64, u64)>,
    reads_waiting: Vec<(u64, u64)>,
    next_read: u64,
    last_decision: String,
    out: Output,
}

fn logger(id: NodeId) -> slog::Logger {
    slog::Logger::root(tracing_slog::TracingSlogDrain, slog::o!("raft_id" => id))
}

impl<S: LogStore> Core<S> {
    /// Opens a core over `store`. A store that has never held a cluster is initialized from
    /// `bootstrap` (the same state on every founding voter) or, when `None`, waits to be
    /// sent the log by a leader after it joins.
    pub fn open(cfg: CoreConfig, mut store: S, bootstrap: Option<&ClusterState>) -> Result<Core<S>> {
        cfg.validate()?;
        let cid = cluster_id(&cfg.cluster);
        if store.applied_state().is_none() {
            if let Some(initial) = bootstrap {
                store.install_snapshot(&bootstrap_snapshot(cid, initial))?;
                store.flush()?;
            }
        }
        let (state, applied, conf) = match store.applied_state() {
            Some(a) => {
                let data = SnapshotData::decode(&a.data, cid).map_err(|e| ConsensusError::Corrupt {
                    path: "applied state".into(),
                    what: e.what.into(),
                    detail: e.detail,
                })?;
                (data.state, a.index, a.conf)
            }
            None => (ClusterState::bootstrap(&cfg.cluster, &[]), 0, ConfState::default()),
        };
        let raft_cfg = raft::Config {
            id: cfg.id,
            election_tick: cfg.election_tick,
            heartbeat_tick: cfg.heartbeat_tick,
            applied,
            check_quorum: true,
            pre_vote: true,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            ..Default::default()
        };
        let raw = RawNode::new(&raft_cfg, store, &logger(cfg.id))?;
        Ok(Core {
            raw,
            cluster_id: cid,
            state: Arc::new(state),
            applied,
            saved: applied,
            saved_tick: 0,
            save_now: false,
            conf,
            ticks: 0,
            heard: BTreeMap::new(),
            led_since: None,
            reads_waiting: Vec::new(),
            next_read: 1,
            last_decision: String::new(),
            out: Output::default(),
            cfg,
        })
    }

    /// The wire id of this node's cluster.
    pub fn cluster_id(&self) -> u64 {
        self.cluster_id
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.cfg.id
    }

    /// The replicated state as applied here.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The replicated state as applied here, shared: what a node publishes to its readers
    /// without copying it.
    pub fn shared_state(&self) -> Arc<ClusterState> {
        Arc::clone(&self.state)
    }

    /// The last applied index.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The leader this node knows (0: none).
    pub fn leader(&self) -> NodeId {
        self.raw.raft.leader_id
    }

    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// Whether this node leads and has applied an entry of its own term (raft appends an
    /// empty one on election), so every entry committed before it is applied here.
    pub fn leader_caught_up(&self) -> bool {
        self.is_leader() && self.raw.raft.raft_log.term(self.applied).is_ok_and(|t| t == self.term())
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.raw.raft.term
    }

    /// The storage (for tests and shutdown).
    pub fn store(&self) -> &S {
        self.raw.store()
    }

    /// This node's view of the group.
    pub fn status(&self) -> NodeStatus {
        let role = match self.raw.raft.state {
            StateRole::Leader => "leader",
            StateRole::Candidate => "candidate",
            StateRole::PreCandidate => "pre-candidate",
            StateRole::Follower if self.conf.learners.contains(&self.cfg.id) => "learner",
            StateRole::Follower => "follower",
        };
        let mut conf = self.raw.raft.prs().conf().to_conf_state();
        conf.voters.sort_unstable();
        conf.voters_outgoing.sort_unstable();
        conf.learners.sort_unstable();
        NodeStatus {
            id: self.cfg.id,
            role: role.into(),
            leader: self.leader(),
            term: self.term(),
            commit: self.raw.raft.raft_log.committed,
            applied: self.applied,
            last_index: self.raw.raft.raft_log.last_index(),
            snapshot_index: self.raw.store().first_index().unwrap_or(1) - 1,
            voters: conf.voters,
            voters_outgoing: conf.voters_outgoing,
            learners: conf.learners,
            last_decision: self.last_decision.clone(),
        }
    }

    /// Advances logical time by one tick; the leader also runs its voter controller.
    pub fn tick(&mut self) {
        self.ticks += 1;
        self.raw.tick();
        if self.is_leader() {
            let term = self.term();
            if self.led_since.is_none_or(|(t, _)| t != term) {
                self.led_since = Some((term, self.ticks));
            }
            self.run_voter_controller();
        }
    }

    /// Takes a message from a peer. Refuses (with the reason) messages that are not for this
    /// node or carry a snapshot of another cluster or that does not decode.
    pub fn step(&mut self, msg: Message) -> std::result::Result<(), StepError> {
        if msg.to != self.cfg.id {
            return Err(StepError::Refused(format!(
                "message for node {} delivered to node {}",
                msg.to, self.cfg.id
            )));
        }
        // raft-rs's accessors panic on an enum number that names no variant: checked first.
        crate::codec::check_message(&msg)
            .map_err(|e| StepError::Refused(format!("from node {}: {e}", msg.from)))?;
        if msg.from == 0 || raft::raw_node::is_local_msg(msg.get_msg_type()) {
            return Err(StepError::Refused(format!(
                "{:?} from {} is not a peer message",
                msg.get_msg_type(),
                msg.from
            )));
        }
        self.check_peer(&msg)?;
        if msg.term != 0 && msg.term < self.term() {
            tracing::debug!(
                from = msg.from,
                term = msg.term,
                ours = self.term(),
                "message with a stale term"
            );
        }
        self.heard.insert(msg.from, self.ticks);
        self.raw.step(msg).map_err(|e| StepError::Raft(e.to_string()))
    }

    /// Proposes a command; it is forwarded to the leader if this node does not lead.
    pub fn propose(&mut self, origin: ProposalId, command: Command) -> Result<()> {
        if self.leader() == 0 {
            return Err(ConsensusError::NoLeader);
        }
        let proposal = Proposal { v: FORMAT_VERSION, origin, command };
        self.raw.propose(vec![], proposal.encode())?;
        Ok(())
    }

    /// Starts a linearizable read; its id appears in `Output::reads` once this node has
    /// applied everything committed when the read began (raft's read index).
    pub fn read_index(&mut self) -> u64 {
        let id = self.next_read;
        self.next_read += 1;
        self.raw.read_index(id.to_be_bytes().to_vec());
        id
    }

    /// Tells raft a peer could not be reached (it slows down replication to it).
    pub fn report_unreachable(&mut self, to: NodeId) {
        self.raw.report_unreachable(to);
    }

    /// Tells raft whether a snapshot reached `to`.
    pub fn report_snapshot(&mut self, to: NodeId, delivered: bool) {
        let status = if delivered { raft::SnapshotStatus::Finish } else { raft::SnapshotStatus::Failure };
        self.raw.report_snapshot(to, status);
    }

    /// The Ready loop, in raft-rs order: send, apply snapshot, apply committed, append,
    /// persist hard state, flush, send persisted messages, advance, apply, advance_apply.
    pub fn process(&mut self) -> Result<Output> {
        if self.raw.has_ready() {
            let mut ready = self.raw.ready();
            self.out.messages.extend(ready.take_messages());
            if *ready.snapshot() != Snapshot::default() {
                self.apply_snapshot(ready.snapshot().clone())?;
            }
            for rs in ready.take_read_states() {
                let id = u64::from_be_bytes(rs.request_ctx.as_slice().try_into().unwrap_or([0; 8]));
                self.reads_waiting.push((id, rs.index));
            }
            self.apply_entries(ready.take_committed_entries())?;
            self.raw.mut_store().append(ready.entries())?;
            if let Some(hs) = ready.hs() {
                self.raw.mut_store().set_hard_state(hs)?;
            }
            self.raw.mut_store().flush()?;
            self.out.messages.extend(ready.take_persisted_messages());
            let mut light = self.raw.advance(ready);
            if light.commit_index().is_some() {
                let hs = self.raw.raft.hard_state();
                self.raw.mut_store().set_hard_state(&hs)?;
            }
            self.out.messages.extend(light.take_messages());
            self.apply_entries(light.take_committed_entries())?;
            self.raw.advance_apply();
            self.maybe_compact()?;
        }
        self.save_applied(false)?;
        let applied = self.applied;
        let (done, waiting): (Vec<_>, Vec<_>) =
            self.reads_waiting.drain(..).partition(|&(_, i)| i <= applied);
        self.reads_waiting = waiting;
        self.out.reads.extend(done.into_iter().map(|(id, _)| id));
        Ok(std::mem::take(&mut self.out))
    }

    fn apply_snapshot(&mut self, snap: Snapshot) -> Result<()> {
        // Checked in `step`, so a failure here means our own storage handed it back wrong.
        let data = SnapshotData::decode(&snap.data, self.cluster_id).map_err(|e| {
            ConsensusError::Corrupt { path: "snapshot".into(), what: e.what.into(), detail: e.detail }
        })?;
        self.raw.mut_store().install_snapshot(&snap)?;
        let meta = snap.get_metadata();
        tracing::info!(node = self.cfg.id, index = meta.index, term = meta.term, "installed snapshot");
        self.state = Arc::new(data.state);
        self.applied = meta.index;
        self.saved = meta.index;
        self.conf = meta.get_conf_state().clone();
        Ok(())
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) -> Result<()> {
        let Some(last) = entries.last().map(|e| e.index) else { return Ok(()) };
        for e in entries {
            match e.get_entry_type() {
                EntryType::EntryNormal if e.data.is_empty() => {}
                EntryType::EntryNormal => self.apply_normal(&e),
                EntryType::EntryConfChange => match crate::codec::decode::<ConfChange>(&e.data) {
                    Ok(cc) => {
                        let mut v2 = ConfChangeV2::default();
                        v2.set_changes(vec![single(cc.node_id, cc.get_change_type())]);
                        self.apply_conf_change(e.index, &v2)
                    }
                    Err(err) => tracing::warn!(index = e.index, %err, "configuration entry does not decode"),
                },
                EntryType::EntryConfChangeV2 => match crate::codec::decode::<ConfChangeV2>(&e.data) {
                    Ok(cc) => self.apply_conf_change(e.index, &cc),
                    Err(err) => tracing::warn!(index = e.index, %err, "configuration entry does not decode"),
                },
            }
        }
        self.applied = last;
        let due = self.save_now || self.applied >= self.saved + self.cfg.save_every;
        self.save_applied(due)
    }

    /// Writes the applied state to the store if `due` or `save_ticks` have passed, and
    /// anything was applied since the last write.
    fn save_applied(&mut self, due: bool) -> Result<()> {
        if self.applied == self.saved
            || !(due || self.ticks >= self.saved_tick.saturating_add(self.cfg.save_ticks))
        {
            return Ok(());
        }
        let data = SnapshotData::encode_state(self.cluster_id, &self.state);
        let saved = AppliedState { index: self.applied, conf: self.conf.clone(), data };
        self.raw.mut_store().save_applied(&saved)?;
        (self.saved, self.saved_tick, self.save_now) = (self.applied, self.ticks, false);
        Ok(())
    }

    /// Writes what was applied since the last write (a clean stop: a restart then replays
    /// nothing).
    pub fn save(&mut self) -> Result<()> {
        self.save_applied(true)?;
        self.raw.mut_store().flush()
    }

    fn apply_normal(&mut self, e: &Entry) {
        let applied = match Proposal::decode(&e.data) {
            Ok(p) => {
                let outcome = Arc::make_mut(&mut self.state).apply(&p.command);
                if let Err(why) = &outcome {
                    tracing::debug!(index = e.index, %why, "command rejected");
                }
                Applied { index: e.index, origin: Some(p.origin), outcome }
            }
            Err(err) => {
                // Every node holds the same bytes, so every node refuses them alike.
                tracing::warn!(index = e.index, %err, "log entry does not decode; skipped");
                Applied {
                    index: e.index,
                    origin: None,
                    outcome: Err(Refused(format!("undecodable entry: {err}"))),
                }
            }
        };
        self.out.applied.push(applied);
    }

    fn apply_conf_change(&mut self, index: u64, cc: &ConfChangeV2) {
        match self.raw.apply_conf_change(cc) {
            Ok(conf) => {
                let mut learners = conf.learners.clone();
                learners.extend(conf.learners_next.iter().copied());
                Arc::make_mut(&mut self.state).set_configuration(&conf.voters, &learners);
                self.save_now = true;
                tracing::info!(
                    node = self.cfg.id, index, voters = ?conf.voters, outgoing = ?conf.voters_outgoing,
                    learners = ?learners, "configuration applied"
                );
                self.conf = conf;
            }
            Err(err) => tracing::warn!(index, %err, "configuration change refused"),
        }
    }

    fn maybe_compact(&mut self) -> Result<()> {
        let snap_index = self.raw.store().first_index()? - 1;
        if self.applied >= snap_index + self.cfg.snapshot_interval {
            // Compaction snapshots the written state: everything applied first.
            self.save_applied(true)?;
            self.raw.mut_store().compact_to_applied()?;
            tracing::debug!(node = self.cfg.id, index = self.applied, "log compacted into a snapshot");
        }
        Ok(())
    }

    fn run_voter_controller(&mut self) {
        let conf = self.raw.raft.prs().conf().to_conf_state();
        let since = self.led_since.map_or(self.ticks, |(_, tick)| tick);
        let heard_ago = membership::silence(
            &self.heard,
            conf.voters.iter().chain(&conf.learners).copied(),
            self.ticks,
            since,
        );
        let matched: BTreeMap<NodeId, u64> =
            self.raw.raft.prs().iter().map(|(&id, p)| (id, p.matched)).collect();
        let view = VoterView {
            me: self.cfg.id,
            voters: &conf.voters,
            learners: &conf.learners,
            change_pending: self.raw.raft.pending_conf_index > self.applied
                || !conf.voters_outgoing.is_empty(),
            transferring: self.raw.raft.lead_transferee.is_some(),
            members: &self.state.members,
            heard_ago: &heard_ago,
            matched: &matched,
            last_index: self.raw.raft.raft_log.last_index(),
        };
        let Some((decision, why)) = membership::plan(&view, &self.cfg.voters) else { return };
        if why != self.last_decision {
            tracing::info!(node = self.cfg.id, reason = %why, "voter controller");
            self.last_decision = why;
        }
        match decision {
            VoterDecision::TransferLeader { to } => self.raw.transfer_leader(to),
            VoterDecision::Reconfigure { promote, demote, add_learners, remove } => {
                let changes: Vec<ConfChangeSingle> = promote
                    .iter()
                    .map(|&id| single(id, ConfChangeType::AddNode))
                    .chain(
                        demote
                            .iter()
                            .chain(&add_learners)
                            .map(|&id| single(id, ConfChangeType::AddLearnerNode)),
                    )
                    .chain(remove.iter().map(|&id| single(id, ConfChangeType::RemoveNode)))
                    .collect();
                let mut cc = ConfChangeV2::default();
                cc.set_transition(ConfChangeTransition::Auto);
                cc.set_changes(changes);
                if let Err(err) = self.raw.propose_conf_change(vec![], cc) {
                    tracing::warn!(node = self.cfg.id, %err, "configuration change not proposed");
                }
            }
        }
    }
}

fn single(id: NodeId, ty: ConfChangeType) -> ConfChangeSingle {
    let mut s = ConfChangeSingle { node_id: id, ..Default::default() };
    s.set_change_type(ty);
    s
}

/// The snapshot every founding voter starts from: index 1, term 1, the founding voters.
fn bootstrap_snapshot(cluster_id: u64, initial: &ClusterState) -> Snapshot {
    let conf = ConfState {
        voters: initial.voters.clone(),
        learners: initial.learners.clone(),
        ..Default::default()
    };
    let mut meta = SnapshotMetadata { index: 1, term: 1, ..Default::default() };
    meta.set_conf_state(conf);
    let mut snap = Snapshot::default();
    snap.set_metadata(meta);
    snap.data = SnapshotData { v: FORMAT_VERSION, cluster_id, state: initial.clone() }.encode();
    snap
}

//! An in-memory network of `Core`s for protocol tests and simulation: real raft-rs and the
//! real state machine over `MemLog`, with a message router that can drop messages at random,
//! cut links, isolate nodes, crash them (keeping what they persisted) and restart them.
//!
//! Everything is deterministic given the seed: time is ticks, delivery is in queue order, and
//! drops come from a seeded generator. The checker methods state the Raft invariants the
//! tests assert: committed prefixes agree, one leader per term, epoch ids only grow, and the
//! states match once the network heals.

use crate::core::{Applied, Core, CoreConfig};
use crate::state::{ClusterState, Command, Hardware, MemberSpec, NodeId, ProposalId};
use crate::storage::MemLog;
use raft::prelude::{Entry, EntryType, Message, MessageType};
use raft::{GetEntriesContext, Storage};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The cluster name every harness node uses.
pub const HARNESS_CLUSTER: &str = "harness";

/// A member spec for harness node `id`.
pub fn spec(id: NodeId) -> MemberSpec {
    MemberSpec {
        id,
        name: format!("node-{id}"),
        control_addr: format!("mem:{id}"),
        data_addr: format!("mem:{id}"),
        hardware: Hardware::default(),
    }
}

/// A raft message of `kind` from `from` to `to` at `term`, as a peer would put it on the
/// wire (for tests that play a buggy or hostile peer).
pub fn message(kind: MessageType, from: NodeId, to: NodeId, term: u64) -> Message {
    let mut m = Message::default();
    m.set_msg_type(kind);
    (m.from, m.to, m.term) = (from, to, term);
    m
}

/// A log entry of `kind` at `index` and `term` holding `data`.
pub fn entry(kind: EntryType, index: u64, term: u64, data: Vec<u8>) -> Entry {
    let mut e = Entry::default();
    e.set_entry_type(kind);
    (e.index, e.term, e.data) = (index, term, data);
    e
}

/// The in-memory cluster.
pub struct Network {
    cfg: CoreConfig,
    live: BTreeMap<NodeId, Core<MemLog>>,
    crashed: BTreeMap<NodeId, MemLog>,
    queue: VecDeque<Message>,
    cut: BTreeSet<(NodeId, NodeId)>,
    isolated: BTreeSet<NodeId>,
    drop_rate: f64,
    rng: ChaCha8Rng,
    next_seq: u64,
    outcomes: BTreeMap<ProposalId, Applied>,
    leaders_by_term: BTreeMap<u64, BTreeSet<NodeId>>,
    epoch_seen: BTreeMap<NodeId, u64>,
    violations: Vec<String>,
}

impl Network {
    /// `voters` founders with ids 1..=voters, founded as a node founds them (the first
    /// `FOUNDING_VOTERS` vote); `cfg` is the template (its id ignored).
    pub fn new(voters: u64, mut cfg: CoreConfig, seed: u64) -> Network {
        cfg.cluster = HARNESS_CLUSTER.into();
        let members: Vec<MemberSpec> = (1..=voters).map(spec).collect();
        let initial = ClusterState::founded(HARNESS_CLUSTER, &members, crate::state::FOUNDING_VOTERS);
        let mut net = Network {
            cfg,
            live: BTreeMap::new(),
            crashed: BTreeMap::new(),
            queue: VecDeque::new(),
            cut: BTreeSet::new(),
            isolated: BTreeSet::new(),
            drop_rate: 0.0,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_seq: 1,
            outcomes: BTreeMap::new(),
            leaders_by_term: BTreeMap::new(),
            epoch_seen: BTreeMap::new(),
            violations: Vec::new(),
        };
        for id in 1..=voters {
            let core = Core::open(net.node_cfg(id), MemLog::new(), Some(&initial)).expect("bootstrap");
            net.live.insert(id, core);
        }
        net
    }

    fn node_cfg(&self, id: NodeId) -> CoreConfig {
        CoreConfig { id, ..self.cfg.clone() }
    }

    /// Starts a node with an empty log (it must join through `propose(.., Join)`).
    pub fn add_empty_node(&mut self, id: NodeId) {
        let core = Core::open(self.node_cfg(id), MemLog::new(), None).expect("empty node opens");
        self.live.insert(id, core);
    }

    /// Live nodes.
    pub fn live(&self) -> Vec<NodeId> {
        self.live.keys().copied().collect()
    }

    /// A live node's core.
    pub fn node(&self, id: NodeId) -> &Core<MemLog> {
        &self.live[&id]
    }

    /// A live node's core, mutably.
    pub fn node_mut(&mut self, id: NodeId) -> &mut Core<MemLog> {
        self.live.get_mut(&id).expect("live node")
    }

    /// Drops this fraction of messages at random.
    pub fn set_drop_rate(&mut self, rate: f64) {
        self.drop_rate = rate;
    }

    /// Cuts the links between `a` and `b` both ways.
    pub fn cut(&mut self, a: NodeId, b: NodeId) {
        self.cut.insert((a, b));
        self.cut.insert((b, a));
    }

    /// Cuts every link of `id`.
    pub fn isolate(&mut self, id: NodeId) {
        self.isolated.insert(id);
    }

    /// Splits the network into `side` and everyone else.
    pub fn partition(&mut self, side: &[NodeId]) {
        let all: Vec<NodeId> = self.live.keys().chain(self.crashed.keys()).copied().collect();
        for &a in side {
            for &b in all.iter().filter(|b| !side.contains(b)) {
                self.cut(a, b);
            }
        }
    }

    /// Restores every link and stops random drops.
    pub fn heal(&mut self) {
        self.cut.clear();
        self.isolated.clear();
        self.drop_rate = 0.0;
    }

    /// Stops a node as `kill -9` would: what it persisted stays, everything else is lost.
    pub fn crash(&mut self, id: NodeId) {
        if let Some(core) = self.live.remove(&id) {
            self.crashed.insert(id, core.store().clone());
        }
    }

    /// Restarts a crashed node from what it persisted.
    pub fn restart(&mut self, id: NodeId) {
        if let Some(store) = self.crashed.remove(&id) {
            let core = Core::open(self.node_cfg(id), store, None).expect("restart from persisted log");
            self.live.insert(id, core);
        }
    }

    /// Crashed nodes.
    pub fn crashed(&self) -> Vec<NodeId> {
        self.crashed.keys().copied().collect()
    }

    /// Proposes `command` through node `via`; returns its id, or None if `via` knows no leader.
    pub fn propose(&mut self, via: NodeId, command: Command) -> Option<ProposalId> {
        let origin = ProposalId { node: via, seq: self.next_seq };
        self.next_seq += 1;
        let core = self.live.get_mut(&via)?;
        core.propose(origin, command).ok().map(|()| origin)
    }

    /// The applied outcome of a proposal, once its proposer applied it.
    pub fn outcome(&self, id: ProposalId) -> Option<&Applied> {
        self.outcomes.get(&id)
    }

    /// One tick on every live node, then delivery until the network is quiet.
    pub fn tick(&mut self) {
        let ids = self.live();
        for id in ids {
            self.live.get_mut(&id).expect("live").tick();
        }
        self.settle();
    }

    /// Ticks `n` times.
    pub fn run(&mut self, n: u64) {
        for _ in 0..n {
            self.tick();
        }
    }

    /// Ticks until `done` holds, at most `max` ticks; says whether it held.
    pub fn run_until(&mut self, max: u64, mut done: impl FnMut(&Network) -> bool) -> bool {
        for _ in 0..max {
            if done(self) {
                return true;
            }
            self.tick();
        }
        done(self)
    }

    /// Processes every node and delivers messages until nothing moves.
    pub fn settle(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            let ids = self.live();
            for id in ids {
                let out =
                    self.live.get_mut(&id).expect("live").process().expect("in-memory storage never fails");
                moved |= !out.messages.is_empty();
                self.queue.extend(out.messages);
                for a in out.applied {
                    if a.origin.is_some_and(|o| o.node == id) {
                        self.outcomes.insert(a.origin.expect("checked"), a);
                    }
                }
                self.observe(id);
            }
            while let Some(msg) = self.queue.pop_front() {
                moved = true;
                self.deliver(msg);
            }
            if !moved {
                return;
            }
        }
        panic!("the network did not settle");
    }

    fn deliver(&mut self, msg: Message) {
        let (from, to) = (msg.from, msg.to);
        let is_snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
        let blocked = self.isolated.contains(&from)
            || self.isolated.contains(&to)
            || self.cut.contains(&(from, to))
            || (self.drop_rate > 0.0 && self.rng.random_bool(self.drop_rate));
        let delivered = !blocked && self.live.contains_key(&to);
        if delivered {
            // Refusals are part of the protocol (e.g. a message for a removed node).
            let _ = self.live.get_mut(&to).expect("live").step(msg);
        }
        if is_snapshot {
            if let Some(sender) = self.live.get_mut(&from) {
                sender.report_snapshot(to, delivered);
            }
        }
    }

    fn observe(&mut self, id: NodeId) {
        let core = &self.live[&id];
        if core.is_leader() {
            let leaders = self.leaders_by_term.entry(core.term()).or_default();
            leaders.insert(id);
            if leaders.len() > 1 {
                self.violations.push(format!("term {} has leaders {leaders:?}", core.term()));
            }
        }
        let st = core.state();
        let epoch = st.scheduled.as_ref().or(st.current.as_ref()).map_or(0, |e| e.id);
        let seen = self.epoch_seen.entry(id).or_insert(0);
        if epoch < *seen {
            self.violations.push(format!("node {id}: epoch id went from {seen} to {epoch}"));
        }
        *seen = epoch;
    }

    /// The leader with the highest term among live nodes.
    pub fn leader(&self) -> Option<NodeId> {
        self.live.values().filter(|c| c.is_leader()).max_by_key(|c| c.term()).map(|c| c.id())
    }

    /// Invariant violations seen so far (one leader per term, growing epoch ids).
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Checks that every pair of live nodes agrees on the committed entries both still hold.
    pub fn check_committed_prefixes(&self) -> Result<(), String> {
        let logs: Vec<(NodeId, CommittedLog)> =
            self.live.iter().map(|(&id, core)| (id, committed_entries(core))).collect();
        for (i, (a, la)) in logs.iter().enumerate() {
            for (b, lb) in &logs[i + 1..] {
                for (index, ea) in la {
                    if let Some(eb) = lb.get(index) {
                        if ea != eb {
                            return Err(format!("nodes {a} and {b} disagree on committed entry {index}"));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that every live node applied the same state.
    pub fn check_states_match(&self) -> Result<(), String> {
        let mut it = self.live.values();
        let Some(first) = it.next() else { return Ok(()) };
        for other in it {
            if other.state() != first.state() {
                return Err(format!(
                    "node {} (applied {}) and node {} (applied {}) hold different states",
                    first.id(),
                    first.applied(),
                    other.id(),
                    other.applied()
                ));
            }
        }
        Ok(())
    }

    /// Whether every live node applied up to the leader's commit index.
    pub fn converged(&self) -> bool {
        let Some(l) = self.leader() else { return false };
        let commit = self.live[&l].status().commit;
        self.live.values().all(|c| c.applied() == commit && c.leader() == l)
    }
}

/// Committed entries by index: (term, data).
type CommittedLog = BTreeMap<u64, (u64, Vec<u8>)>;

fn committed_entries(core: &Core<MemLog>) -> CommittedLog {
    let store = core.store();
    let first = store.first_index().expect("mem");
    let commit = core.status().commit.min(store.last_index().expect("mem"));
    if commit < first {
        return BTreeMap::new();
    }
    store
        .entries(first, commit + 1, None, GetEntriesContext::empty(false))
        .expect("mem entries")
        .into_iter()
        .map(|e| (e.index, (e.term, e.data.to_vec())))
        .collect()
}

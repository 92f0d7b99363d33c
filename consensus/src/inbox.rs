//! What flows into a node's task: requests from the gRPC service and the in-process handle,
//! the agents' heartbeat reports, and the applied state the task publishes back.

use crate::core::NodeStatus;
use crate::error::Result;
use crate::state::{ClusterState, Command, NodeId};
use crate::transport::{NodeReport, ReadResult};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Where a proposal's outcome goes: (log index, what the state machine said).
pub(crate) type ProposeReply = oneshot::Sender<Result<(u64, String)>>;

pub(crate) enum Request {
    Raft {
        from: NodeId,
        from_addr: String,
        msgs: Vec<raft::prelude::Message>,
    },
    /// A command to propose; with `term`, only while this node still leads in that term (a
    /// leader's own decisions must not outlive its leadership, see `NodeHandle::propose_leading`);
    /// with `at_leader`, only here and only if this node leads (a caller's request, checked
    /// against the caller's certificate here: raft forwards only a node's own proposals), else
    /// answered with where the leader is.
    Propose {
        // Boxed: an epoch's lists make a command far larger than the other requests.
        command: Box<Command>,
        deadline: Instant,
        reply: ProposeReply,
        term: Option<u64>,
        at_leader: bool,
        /// The member that asked through the control service, when one did: its report of
        /// a checkpoint is checked here as a forwarded one is at a leader.
        reporter: Option<NodeId>,
    },
    Read {
        linearizable: bool,
        deadline: Instant,
        reply: oneshot::Sender<Result<ReadResult>>,
    },
    Status {
        reply: oneshot::Sender<NodeStatus>,
    },
}

/// The largest heartbeat report a node keeps.
pub const MAX_REPORT_BYTES: usize = 64 << 10;

/// Agents' latest heartbeat reports, keyed by sender, stamped with their arrival time here,
/// and a wake-up for a report that should not wait for the leader's next round.
#[derive(Clone, Default)]
pub struct Reports {
    table: Arc<Mutex<ReportTable>>,
    urgent: Arc<tokio::sync::Notify>,
    /// When each sender last woke the leader.
    urgent_at: Arc<Mutex<HashMap<NodeId, std::time::Instant>>>,
}

/// A sender's urgent reports wake the leader once in this long at most: a member that sends
/// nothing else makes the leader's round run no more than twice as often.
pub const URGENT_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// Latest report per node, with its arrival time.
type ReportTable = HashMap<NodeId, (std::time::Instant, Arc<Vec<u8>>)>;

impl Reports {
    /// Keeps `report` as `node`'s latest.
    pub fn put(&self, node: NodeId, report: Vec<u8>) {
        let mut t = self.table.lock().expect("reports lock");
        t.insert(node, (std::time::Instant::now(), Arc::new(report)));
    }

    /// Says `node`'s report just kept is urgent (sent at once: its collective broke): one
    /// waiter in [`Reports::urgent`], or the next to wait, wakes, unless `node` woke it less
    /// than [`URGENT_EVERY`] ago.
    pub fn mark_urgent(&self, node: NodeId) {
        let now = std::time::Instant::now();
        let mut at = self.urgent_at.lock().expect("urgent lock");
        if at.get(&node).is_some_and(|&t| now.duration_since(t) < URGENT_EVERY) {
            return;
        }
        at.insert(node, now);
        self.urgent.notify_one();
    }

    /// Waits until a report is marked urgent.
    pub async fn urgent(&self) {
        self.urgent.notified().await
    }

    /// Every report held, by node id.
    pub fn all(&self) -> Vec<NodeReport> {
        let t = self.table.lock().expect("reports lock");
        let mut v: Vec<NodeReport> = t
            .iter()
            .map(|(&node, (at, r))| NodeReport { node, age: at.elapsed(), report: r.to_vec() })
            .collect();
        v.sort_by_key(|r| r.node);
        v
    }
}

/// What this node has applied, published after every change so agents can follow the log
/// without asking.
#[derive(Clone, Debug)]
pub struct LocalState {
    /// The state machine at `applied_index`.
    pub state: Arc<ClusterState>,
    /// Applied index.
    pub applied_index: u64,
    /// The leader this node knows (0: none).
    pub leader: NodeId,
    /// Whether this node is the leader.
    pub is_leader: bool,
    /// Whether this leader has applied an entry of its own term, and so everything an
    /// earlier leader committed: only then do its decisions see the whole log.
    pub leader_caught_up: bool,
    /// Current term.
    pub term: u64,
}

//! A consensus node in a process: one tokio task owns the `Core` (over `SledLog`), a tonic
//! server feeds it peers' messages and clients' requests through a channel, and one sender
//! task per peer carries its outgoing messages.
//!
//! Requests wait in the task until raft answers them: a proposal until this node applies it,
//! a linearizable read until the read index is applied. Requests that cannot be served yet
//! (no leader known) are retried each tick until their deadline. A storage error stops the
//! node: `Node::wait` returns it.

use crate::core::{Core, CoreConfig, NodeStatus};
use crate::error::{ConsensusError, Result};
pub use crate::inbox::{LocalState, Reports, MAX_REPORT_BYTES};
use crate::inbox::{ProposeReply, Request};
use crate::service::{serve, Service};
use crate::state::{cluster_id, ClusterState, Command, Hardware, MemberSpec, NodeId, ProposalId};
use crate::storage::{Identity, SledLog, SLED_FORMAT};
use crate::tls::Tls;
pub use crate::transport::NodeReport;
use crate::transport::{Client, PeerReport, PeerSender, ReadResult};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How a node runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Raft knobs, id and cluster name.
    pub core: CoreConfig,
    /// Human name (unique in the cluster).
    pub name: String,
    /// Where the gRPC server listens (port 0 picks one).
    pub listen: SocketAddr,
    /// The address peers use to reach this node; empty means the bound listen address.
    pub advertise: String,
    /// The data-plane address this node announces.
    pub data_addr: String,
    /// Its hardware.
    pub hardware: Hardware,
    /// The state directory (the sled log lives in `<dir>/consensus`).
    pub state_dir: PathBuf,
    /// Wall-clock length of one raft tick.
    pub tick: Duration,
    /// Founding members, identical on every founder; `None` for a node that joins.
    pub bootstrap: Option<Vec<MemberSpec>>,
    /// Addresses of existing nodes to join through (for non-founders).
    pub seeds: Vec<String>,
    /// Default wait for a proposal or read to complete.
    pub request_timeout: Duration,
    /// Mutual TLS for the gRPC server and every connection to peers; `None` is plain text.
    pub tls: Option<Arc<Tls>>,
    /// Snapshot data past this many bytes travels in chunks of this size (at most
    /// [`crate::chunks::SNAPSHOT_CHUNK_BYTES`], the default; smaller in tests).
    pub snapshot_chunk_bytes: usize,
    /// The lab's: this many gone members' records in the founding state (identical on
    /// every founder), so that a benchmark commits against a state of a large fleet's size.
    #[cfg(feature = "lab")]
    pub ballast: usize,
}

impl NodeConfig {
    /// A node with defaults: 100 ms ticks, 5 s request timeout.
    pub fn new(id: NodeId, cluster: &str, name: &str, listen: SocketAddr, state_dir: PathBuf) -> NodeConfig {
        NodeConfig {
            core: CoreConfig::new(id, cluster),
            name: name.to_string(),
            listen,
            advertise: String::new(),
            data_addr: String::new(),
            hardware: Hardware::default(),
            state_dir,
            tick: Duration::from_millis(100),
            bootstrap: None,
            seeds: Vec::new(),
            request_timeout: Duration::from_secs(5),
            tls: None,
            snapshot_chunk_bytes: crate::chunks::SNAPSHOT_CHUNK_BYTES,
            #[cfg(feature = "lab")]
            ballast: 0,
        }
    }
}

/// A handle to talk to a running node from the same process.
#[derive(Clone)]
pub struct NodeHandle {
    tx: mpsc::Sender<Request>,
    timeout: Duration,
    reports: Reports,
    watch: watch::Receiver<LocalState>,
}

impl NodeHandle {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Request) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| ConsensusError::Shutdown)?;
        rx.await.map_err(|_| ConsensusError::Shutdown)
    }

    /// Proposes a command and waits until this node applied it.
    pub async fn propose(&self, command: Command, timeout: Option<Duration>) -> Result<(u64, String)> {
        let deadline = Instant::now() + timeout.unwrap_or(self.timeout);
        self.ask(|reply| Request::Propose {
            command: Box::new(command),
            deadline,
            reply,
            term: None,
            at_leader: false,
            reporter: None,
        })
        .await?
    }

    /// Proposes a leader's decision made in `term`: refused with [`ConsensusError::Deposed`]
    /// unless this node still leads in that term when the proposal reaches raft (never
    /// forwarded, never retried under another leader). Two leaders' controllers, the old one
    /// finishing a round and the new one starting, cannot then both propose the same epoch.
    pub async fn propose_leading(
        &self,
        command: Command,
        term: u64,
        timeout: Option<Duration>,
    ) -> Result<(u64, String)> {
        let deadline = Instant::now() + timeout.unwrap_or(self.timeout);
        self.ask(|reply| Request::Propose {
            command: Box::new(command),
            deadline,
            reply,
            term: Some(term),
            at_leader: false,
            reporter: None,
        })
        .await?
    }

    /// Reads the state: linearizable through raft's read index, or this node's copy.
    pub async fn read(&self, linearizable: bool, timeout: Option<Duration>) -> Result<ReadResult> {
        let deadline = Instant::now() + timeout.unwrap_or(self.timeout);
        self.ask(|reply| Request::Read { linearizable, deadline, reply }).await?
    }

    /// This node's view.
    pub async fn status(&self) -> Result<NodeStatus> {
        self.ask(|reply| Request::Status { reply }).await
    }

    /// The heartbeat reports this node received (its own agent's included once recorded).
    pub fn reports(&self) -> &Reports {
        &self.reports
    }

    /// Follows what this node applies.
    pub fn watch(&self) -> watch::Receiver<LocalState> {
        self.watch.clone()
    }
}

/// Whether this node must ask the cluster to admit it: it is not in the log and not a
/// founder, or the log says it has left (drained, then restarted: an upgrade), in which case
/// a founder asks through the other founders.
fn needs_admission(cfg: &NodeConfig, core: &Core<SledLog>) -> bool {
    let known = core.state().members.get(&cfg.core.id).map(|m| m.status);
    (known.is_none() && cfg.bootstrap.is_none()) || known == Some(crate::state::MemberStatus::Gone)
}

/// A running node.
pub struct Node {
    handle: NodeHandle,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<()>>,
    shutdown: CancellationToken,
}

impl Node {
    /// Opens the state directory, binds the server and starts the node. A founder with an
    /// empty directory bootstraps; a non-founder asks its seeds to admit it. Needs a
    /// multi-threaded tokio runtime (the sled flush runs in `block_in_place`).
    /// Its tasks run under `tasks` (the server, the join, a sender per peer), whose root token
    /// stops the node; the event loop is [`Node::wait`]'s.
    pub async fn start(cfg: NodeConfig, tasks: &crate::tasks::Tasks) -> Result<Node> {
        if !(1..=crate::chunks::SNAPSHOT_CHUNK_BYTES).contains(&cfg.snapshot_chunk_bytes) {
            return Err(ConsensusError::Config(format!(
                "snapshot_chunk_bytes {} is not within 1..={}",
                cfg.snapshot_chunk_bytes,
                crate::chunks::SNAPSHOT_CHUNK_BYTES
            )));
        }
        let shutdown = tasks.token();
        let cid = cluster_id(&cfg.core.cluster);
        let identity = Identity { format: SLED_FORMAT, cluster_id: cid, node_id: cfg.core.id };
        let store = SledLog::open(&cfg.state_dir.join("consensus"), identity)?;
        #[allow(unused_mut)]
        let mut initial = cfg
            .bootstrap
            .as_ref()
            .map(|m| ClusterState::founded(&cfg.core.cluster, m, crate::state::FOUNDING_VOTERS));
        #[cfg(feature = "lab")]
        if let Some(state) = initial.as_mut() {
            add_ballast(state, cfg.ballast);
        }
        let core = Core::open(cfg.core.clone(), store, initial.as_ref())?;
        let listener = tokio::net::TcpListener::bind(cfg.listen).await.map_err(|e| {
            let why = format!("cannot listen on {}: {e}", cfg.listen);
            // A port another process still holds (the node's previous run ending) is worth a
            // restart; an address this host does not have is the configuration's.
            if e.kind() == std::io::ErrorKind::AddrInUse {
                ConsensusError::Transport(why)
            } else {
                ConsensusError::Config(why)
            }
        })?;
        let addr = listener.local_addr().map_err(|e| ConsensusError::Config(e.to_string()))?;
        let advertise = if cfg.advertise.is_empty() { addr.to_string() } else { cfg.advertise.clone() };
        let (tx, rx) = mpsc::channel(1024);
        // Peers' raft traffic has a queue of its own: a flood of status reads or proposals
        // from clients must not crowd out what keeps the log alive.
        let (raft_tx, raft_rx) = mpsc::channel(1024);
        let reports = Reports::default();
        let (watch_tx, watch_rx) = watch::channel(local_state(&core));
        let handle = NodeHandle {
            tx: tx.clone(),
            timeout: cfg.request_timeout,
            reports: reports.clone(),
            watch: watch_rx,
        };

        let service = Service {
            tx,
            raft_tx,
            cluster_id: cid,
            cluster: cfg.core.cluster.clone(),
            me: cfg.core.id,
            timeout: cfg.request_timeout,
            reports,
            tls: cfg.tls.as_ref().map(|t| t.anonymous_reads),
            members: handle.watch.clone(),
            chunks: Default::default(),
        };
        serve(listener, service, cfg.tls.as_ref(), tasks)?;
        let me = MemberSpec {
            id: cfg.core.id,
            name: cfg.name.clone(),
            control_addr: advertise,
            data_addr: cfg.data_addr.clone(),
            hardware: cfg.hardware.clone(),
        };
        if needs_admission(&cfg, &core) {
            let mut through = cfg.seeds.clone();
            for f in cfg.bootstrap.iter().flatten().filter(|f| f.id != cfg.core.id) {
                through.push(f.control_addr.clone());
            }
            let (cluster, tls) = (cfg.core.cluster.clone(), cfg.tls.clone());
            tasks.spawn("join", join_through_seeds(through, cluster, me.clone(), tls, shutdown.clone()));
        }
        let looper = Loop {
            core,
            cfg,
            peers: HashMap::new(),
            proposals: BTreeMap::new(),
            reads: BTreeMap::new(),
            retry: Vec::new(),
            next_seq: 1,
            me,
            learned: HashMap::new(),
            watch: watch_tx,
            tasks: tasks.clone(),
        };
        // The event loop's result (and panic) is `wait`'s: whoever waits names it.
        let task = tokio::spawn(looper.run(raft_rx, rx, shutdown.clone()));
        Ok(Node { handle, addr, task, shutdown })
    }

    /// The bound gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle for requests from this process.
    pub fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    /// Stops the node and waits for its event loop. It cancels the root token of the `Tasks`
    /// it was started with, so everything else under it stops too; `Tasks::shutdown` waits
    /// for the server, the join and the senders.
    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the node stops (shutdown, or a fatal error which is returned).
    pub async fn wait(self) -> Result<()> {
        self.task
            .await
            .map_err(|e| ConsensusError::Storage { path: "node task".into(), detail: e.to_string() })?
    }
}

async fn join_through_seeds(
    seeds: Vec<String>,
    cluster: String,
    me: MemberSpec,
    tls: Option<Arc<Tls>>,
    shutdown: CancellationToken,
) {
    use backon::{ExponentialBuilder, Retryable};
    let command = Command::Join { member: me.clone() };
    // One round asks every seed in turn; rounds back off from 200 ms to 5 s, for as long as
    // the node runs (a new host may boot before any member is reachable).
    let round = || async {
        let mut last = None;
        for seed in &seeds {
            let attempt = async {
                let mut c = Client::connect_with(seed, &cluster, tls.as_deref()).await?;
                c.propose(&command, Duration::from_secs(5)).await
            };
            match attempt.await {
                Ok((index, detail)) => return Ok((seed.clone(), index, detail)),
                Err(e) => {
                    tracing::warn!(node = me.id, seed, %e, "join attempt failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| ConsensusError::Config("no seeds to join through".into())))
    };
    let policy = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times();
    tokio::select! {
        _ = shutdown.cancelled() => {}
        joined = round.retry(policy) => {
            if let Ok((seed, index, detail)) = joined {
                tracing::info!(node = me.id, seed, index, detail, "admitted to the cluster");
            }
        }
    }
}

struct Loop {
    core: Core<SledLog>,
    cfg: NodeConfig,
    peers: HashMap<NodeId, PeerSender>,
    /// Where the peers' senders run.
    tasks: crate::tasks::Tasks,
    proposals: BTreeMap<ProposalId, (Instant, ProposeReply)>,
    reads: BTreeMap<u64, (Instant, oneshot::Sender<Result<ReadResult>>)>,
    retry: Vec<Request>,
    next_seq: u64,
    me: MemberSpec,
    learned: HashMap<NodeId, String>,
    watch: watch::Sender<LocalState>,
}

/// `n` gone members with ids past any a lab cluster uses.
#[cfg(feature = "lab")]
fn add_ballast(state: &mut ClusterState, n: usize) {
    for i in 0..n as u64 {
        let id = 1_000_000 + i;
        let spec = MemberSpec {
            id,
            name: format!("gone-{id}"),
            control_addr: format!("10.{}.{}.{}:7000", (i >> 16) & 255, (i >> 8) & 255, i & 255),
            data_addr: format!("10.{}.{}.{}:7001", (i >> 16) & 255, (i >> 8) & 255, i & 255),
            hardware: Hardware {
                instance_type: "g5.48xlarge".into(),
                gpus: 8,
                zone: format!("zone-{}", i % 3),
                ..Hardware::default()
            },
        };
        let reason = "revoked by the cloud (a spot notice), then removed".to_string();
        let status = crate::state::MemberStatus::Gone;
        state.members.insert(id, Arc::new(crate::state::Member { spec, status, reason, deadline_ms: None }));
    }
}

fn local_state(core: &Core<SledLog>) -> LocalState {
    LocalState {
        state: core.shared_state(),
        applied_index: core.applied(),
        leader: core.leader(),
        is_leader: core.is_leader(),
        leader_caught_up: core.leader_caught_up(),
        term: core.term(),
    }
}

impl Loop {
    /// Handles `first` and whatever else `queue` holds (up to 256), so one Ready covers
    /// many requests.
    fn handle_queued(&mut self, first: Request, queue: &mut mpsc::Receiver<Request>) {
        self.handle(first);
        for _ in 0..256 {
            match queue.try_recv() {
                Ok(req) => self.handle(req),
                Err(_) => break,
            }
        }
    }

    async fn run(
        mut self,
        mut raft: mpsc::Receiver<Request>,
        mut rx: mpsc::Receiver<Request>,
        shutdown: CancellationToken,
    ) -> Result<()> {
        let (report_tx, mut reports) = mpsc::unbounded_channel();
        let mut ticker = tokio::time::interval(self.cfg.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(node = self.cfg.core.id, name = %self.me.name, addr = %self.me.control_addr, "consensus node started");
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.tick() => {
                    self.core.tick();
                    self.retry_waiting();
                    self.expire();
                }
                Some(req) = raft.recv() => self.handle_queued(req, &mut raft),
                Some(req) = rx.recv() => self.handle_queued(req, &mut rx),
                Some(report) = reports.recv() => match report {
                    PeerReport::Unreachable(id) => self.core.report_unreachable(id),
                    PeerReport::Snapshot(id, ok) => self.core.report_snapshot(id, ok),
                },
            }
            let out = match tokio::task::block_in_place(|| self.core.process()) {
                Ok(out) => out,
                Err(e) => {
                    tracing::error!(node = self.cfg.core.id, %e, "consensus storage failed; stopping");
                    self.fail_all(|| ConsensusError::Shutdown);
                    shutdown.cancel();
                    return Err(e);
                }
            };
            for msg in out.messages {
                self.send(msg, &report_tx);
            }
            for a in out.applied {
                if let Some((_, reply)) = a.origin.and_then(|o| self.proposals.remove(&o)) {
                    let _ = reply
                        .send(a.outcome.map(|d| (a.index, d)).map_err(|r| ConsensusError::Rejected(r.0)));
                }
            }
            for id in out.reads {
                if let Some((_, reply)) = self.reads.remove(&id) {
                    let _ = reply.send(Ok(self.read_result(true)));
                }
            }
            let seen = self.watch.borrow().clone();
            if seen.applied_index != self.core.applied()
                || seen.leader != self.core.leader()
                || seen.term != self.core.term()
                || seen.is_leader != self.core.is_leader()
                || seen.leader_caught_up != self.core.leader_caught_up()
            {
                self.watch.send_replace(local_state(&self.core));
            }
        }
        self.fail_all(|| ConsensusError::Shutdown);
        // What was applied since the last write, so that a restart replays nothing.
        if let Err(e) = self.core.save() {
            tracing::warn!(node = self.cfg.core.id, %e, "the applied state was not written at the stop");
        }
        tracing::info!(node = self.cfg.core.id, "consensus node stopped");
        Ok(())
    }

    fn handle(&mut self, req: Request) {
        match req {
            Request::Raft { from, from_addr, msgs } => {
                if !from_addr.is_empty() && self.learned.get(&from) != Some(&from_addr) {
                    self.learned.insert(from, from_addr);
                }
                for m in msgs {
                    let (from, kind) = (m.from, m.get_msg_type());
                    match self.core.step(m) {
                        Ok(()) => {}
                        Err(why @ crate::core::StepError::Refused(_)) => {
                            tracing::warn!(node = self.cfg.core.id, from, ?kind, %why, "raft message refused")
                        }
                        Err(why) => {
                            tracing::debug!(node = self.cfg.core.id, from, ?kind, %why, "raft message dropped")
                        }
                    }
                }
            }
            Request::Propose { command, deadline, reply, term, at_leader, reporter } => {
                // The same request, for another try once a leader is known or raft takes it.
                let again = move |command: Box<Command>, reply: ProposeReply| Request::Propose {
                    command,
                    deadline,
                    reply,
                    term,
                    at_leader,
                    reporter,
                };
                if let Some(t) = term.filter(|&t| !(self.core.is_leader() && self.core.term() == t)) {
                    let _ = reply.send(Err(ConsensusError::Deposed { term: t }));
                    return;
                }
                if at_leader && !self.core.is_leader() {
                    let leader = self.core.leader();
                    if leader == 0 {
                        self.retry.push(again(command, reply));
                    } else {
                        let addr = self.address_of(leader).unwrap_or_default();
                        let me = self.cfg.core.id;
                        let _ = reply.send(Err(ConsensusError::NotLeader { me, leader, addr }));
                    }
                    return;
                }
                if let (Some(from), Command::RecordCheckpoint { record }) = (reporter, command.as_ref()) {
                    if let Err(why) = self.core.check_checkpoint_report(from, record) {
                        tracing::warn!(node = self.cfg.core.id, from, %why, "checkpoint report refused");
                        let _ = reply.send(Err(ConsensusError::Rejected(why.to_string())));
                        return;
                    }
                }
                let origin = ProposalId { node: self.cfg.core.id, seq: self.next_seq };
                match self.core.propose(origin, command.as_ref().clone()) {
                    Ok(()) => {
                        self.next_seq += 1;
                        self.proposals.insert(origin, (deadline, reply));
                    }
                    Err(e) if e.is_retryable() => self.retry.push(again(command, reply)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Request::Read { linearizable: false, reply, .. } => {
                let _ = reply.send(Ok(self.read_result(false)));
            }
            Request::Read { linearizable: true, deadline, reply } => {
                if self.core.leader() == 0 {
                    self.retry.push(Request::Read { linearizable: true, deadline, reply });
                } else {
                    let id = self.core.read_index();
                    self.reads.insert(id, (deadline, reply));
                }
            }
            Request::Status { reply } => {
                let _ = reply.send(self.core.status());
            }
        }
    }

    fn read_result(&self, linearizable: bool) -> ReadResult {
        ReadResult {
            state: self.core.state().clone(),
            applied_index: self.core.applied(),
            linearizable,
            leader: self.core.leader(),
            term: self.core.term(),
        }
    }

    fn retry_waiting(&mut self) {
        if self.core.leader() == 0 {
            return;
        }
        for req in std::mem::take(&mut self.retry) {
            self.handle(req);
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let timeout = |what| ConsensusError::Timeout { waited: self.cfg.request_timeout, what };
        let late: Vec<ProposalId> =
            self.proposals.iter().filter(|(_, (d, _))| *d <= now).map(|(k, _)| *k).collect();
        for k in late {
            if let Some((_, reply)) = self.proposals.remove(&k) {
                let _ = reply.send(Err(timeout("the proposal to be applied (it may still apply)")));
            }
        }
        let late: Vec<u64> = self.reads.iter().filter(|(_, (d, _))| *d <= now).map(|(k, _)| *k).collect();
        for k in late {
            if let Some((_, reply)) = self.reads.remove(&k) {
                let _ = reply.send(Err(timeout("a linearizable read")));
            }
        }
        let (late, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.retry).into_iter().partition(|r| match r {
                Request::Propose { deadline, .. } | Request::Read { deadline, .. } => *deadline <= now,
                _ => false,
            });
        self.retry = keep;
        for r in late {
            match r {
                Request::Propose { reply, .. } => {
                    let _ = reply.send(Err(ConsensusError::NoLeader));
                }
                Request::Read { reply, .. } => {
                    let _ = reply.send(Err(ConsensusError::NoLeader));
                }
                _ => {}
            }
        }
    }

    fn fail_all(&mut self, err: impl Fn() -> ConsensusError) {
        for (_, (_, reply)) in std::mem::take(&mut self.proposals) {
            let _ = reply.send(Err(err()));
        }
        for (_, (_, reply)) in std::mem::take(&mut self.reads) {
            let _ = reply.send(Err(err()));
        }
        self.retry.clear();
    }

    /// The address of a peer: from the replicated members, else the founding members, else
    /// what the peer said when it wrote to us (a new node knows no members until its first
    /// snapshot arrives, but must answer the leader that sends it).
    fn address_of(&self, id: NodeId) -> Option<String> {
        if let Some(m) = self.core.state().members.get(&id) {
            return Some(m.spec.control_addr.clone());
        }
        let founder = self.cfg.bootstrap.as_ref().and_then(|b| b.iter().find(|m| m.id == id));
        founder.map(|m| m.control_addr.clone()).or_else(|| self.learned.get(&id).cloned())
    }

    fn send(&mut self, msg: raft::prelude::Message, reports: &mpsc::UnboundedSender<PeerReport>) {
        let to = msg.to;
        let Some(addr) = self.address_of(to) else {
            tracing::debug!(node = self.cfg.core.id, to, "no address for peer; message dropped");
            self.core.report_unreachable(to);
            return;
        };
        let stale = self.peers.get(&to).is_none_or(|p| p.addr != addr);
        if stale {
            let me = (self.cfg.core.id, self.me.control_addr.clone());
            let sender = PeerSender::spawn(
                (self.core.cluster_id(), self.cfg.snapshot_chunk_bytes),
                me,
                to,
                addr,
                self.cfg.tls.clone(),
                reports.clone(),
                &self.tasks,
            );
            self.peers.insert(to, sender);
        }
        if !self.peers[&to].send(msg) {
            self.core.report_unreachable(to);
        }
    }
}

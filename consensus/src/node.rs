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
use crate::state::{cluster_id, ClusterState, Command, Hardware, MemberSpec, NodeId, ProposalId};
use crate::storage::{Identity, SledLog, SLED_FORMAT};
use crate::tls::{Role, Tls};
use crate::transport::{decode_batch, pb, Client, PeerReport, PeerSender, ReadResult};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
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
        }
    }
}

enum Request {
    Raft { from: NodeId, from_addr: String, msgs: Vec<raft::prelude::Message> },
    Propose { command: Command, deadline: Instant, reply: ProposeReply },
    Read { linearizable: bool, deadline: Instant, reply: oneshot::Sender<Result<ReadResult>> },
    Status { reply: oneshot::Sender<NodeStatus> },
}

/// The largest heartbeat report a node keeps.
pub const MAX_REPORT_BYTES: usize = 64 << 10;

pub use crate::transport::NodeReport;

/// Agents' latest heartbeat reports, keyed by sender, stamped with their arrival time here.
#[derive(Clone, Default)]
pub struct Reports(Arc<Mutex<ReportTable>>);

/// Latest report per node, with its arrival time.
type ReportTable = HashMap<NodeId, (std::time::Instant, Arc<Vec<u8>>)>;

impl Reports {
    /// Keeps `report` as `node`'s latest.
    pub fn put(&self, node: NodeId, report: Vec<u8>) {
        let mut t = self.0.lock().expect("reports lock");
        t.insert(node, (std::time::Instant::now(), Arc::new(report)));
    }

    /// Every report held, by node id.
    pub fn all(&self) -> Vec<NodeReport> {
        let t = self.0.lock().expect("reports lock");
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
    /// Current term.
    pub term: u64,
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
        self.ask(|reply| Request::Propose { command, deadline, reply }).await?
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

/// Serves the consensus gRPC service on `listener` until `shutdown`.
fn serve(
    listener: tokio::net::TcpListener,
    service: Service,
    tls: Option<&Arc<Tls>>,
    shutdown: CancellationToken,
) -> Result<()> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls.grpc_server())
            .map_err(|e| ConsensusError::Config(format!("TLS for the control plane: {e}")))?;
    }
    tokio::spawn(async move {
        let result = builder
            .tcp_nodelay(true)
            .add_service(pb::consensus_server::ConsensusServer::new(service))
            .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
            .await;
        if let Err(e) = result {
            tracing::error!(%e, "consensus server stopped");
        }
    });
    Ok(())
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
    pub async fn start(cfg: NodeConfig, shutdown: CancellationToken) -> Result<Node> {
        let cid = cluster_id(&cfg.core.cluster);
        let identity = Identity { format: SLED_FORMAT, cluster_id: cid, node_id: cfg.core.id };
        let store = SledLog::open(&cfg.state_dir.join("consensus"), identity)?;
        let initial = cfg.bootstrap.as_ref().map(|m| ClusterState::bootstrap(&cfg.core.cluster, m));
        let core = Core::open(cfg.core.clone(), store, initial.as_ref())?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| ConsensusError::Config(format!("cannot listen on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr().map_err(|e| ConsensusError::Config(e.to_string()))?;
        let advertise = if cfg.advertise.is_empty() { addr.to_string() } else { cfg.advertise.clone() };
        let (tx, rx) = mpsc::channel(1024);
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
            cluster_id: cid,
            me: cfg.core.id,
            timeout: cfg.request_timeout,
            reports,
            tls: cfg.tls.as_ref().map(|t| t.anonymous_reads),
        };
        serve(listener, service, cfg.tls.as_ref(), shutdown.clone())?;
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
            tokio::spawn(join_through_seeds(through, cluster, me.clone(), tls, shutdown.clone()));
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
        };
        let task = tokio::spawn(looper.run(rx, shutdown.clone()));
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

    /// Stops the node and waits for its task.
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

/// Where a proposal's outcome goes: (log index, what the state machine said).
type ProposeReply = oneshot::Sender<Result<(u64, String)>>;

struct Loop {
    core: Core<SledLog>,
    cfg: NodeConfig,
    peers: HashMap<NodeId, PeerSender>,
    proposals: BTreeMap<ProposalId, (Instant, ProposeReply)>,
    reads: BTreeMap<u64, (Instant, oneshot::Sender<Result<ReadResult>>)>,
    retry: Vec<Request>,
    next_seq: u64,
    me: MemberSpec,
    learned: HashMap<NodeId, String>,
    watch: watch::Sender<LocalState>,
}

fn local_state(core: &Core<SledLog>) -> LocalState {
    LocalState {
        state: Arc::new(core.state().clone()),
        applied_index: core.applied(),
        leader: core.leader(),
        is_leader: core.is_leader(),
        term: core.term(),
    }
}

impl Loop {
    async fn run(mut self, mut rx: mpsc::Receiver<Request>, shutdown: CancellationToken) -> Result<()> {
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
                Some(req) = rx.recv() => {
                    self.handle(req);
                    // Take whatever else is queued so one Ready covers many requests.
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(req) => self.handle(req),
                            Err(_) => break,
                        }
                    }
                }
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
                    let _ = reply.send(a.outcome.map(|d| (a.index, d)).map_err(ConsensusError::Rejected));
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
            {
                self.watch.send_replace(local_state(&self.core));
            }
        }
        self.fail_all(|| ConsensusError::Shutdown);
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
                    if let Err(why) = self.core.step(m) {
                        tracing::debug!(node = self.cfg.core.id, from, ?kind, why, "message refused");
                    }
                }
            }
            Request::Propose { command, deadline, reply } => {
                let origin = ProposalId { node: self.cfg.core.id, seq: self.next_seq };
                match self.core.propose(origin, command.clone()) {
                    Ok(()) => {
                        self.next_seq += 1;
                        self.proposals.insert(origin, (deadline, reply));
                    }
                    Err(e) if e.is_retryable() => {
                        self.retry.push(Request::Propose { command, deadline, reply })
                    }
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
                self.core.cluster_id(),
                me,
                to,
                addr,
                self.cfg.tls.clone(),
                reports.clone(),
            );
            self.peers.insert(to, sender);
        }
        if !self.peers[&to].send(msg) {
            self.core.report_unreachable(to);
        }
    }
}

/// The gRPC service: checks and decodes requests, then hands them to the node's task.
struct Service {
    tx: mpsc::Sender<Request>,
    cluster_id: u64,
    me: NodeId,
    timeout: Duration,
    reports: Reports,
    /// With mutual TLS: whether reads need no certificate.
    tls: Option<bool>,
}

/// What a call needs of the caller's certificate.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Need {
    /// Raft traffic and heartbeats: a node.
    Node,
    /// A proposal: a node, or an operator for the operator's commands.
    Propose,
    /// A read: any certificate, or none when anonymous reads are allowed.
    Read,
}

/// The role of the caller's certificate, if it presented one.
fn caller<T>(req: &tonic::Request<T>) -> Option<Role> {
    req.peer_certs().and_then(|c| c.first().and_then(|c| crate::tls::role_of(c)))
}

/// The commands an operator's certificate may propose (drain, revoke, remove).
fn operator_may_propose(c: &Command) -> bool {
    matches!(c, Command::Drain { .. } | Command::Notice { .. } | Command::Remove { .. })
}

impl Service {
    /// Checks the caller's certificate (when the node runs with TLS) against what the call
    /// needs; the rustls handshake already verified it against the cluster CA.
    fn authorize<T>(&self, req: &tonic::Request<T>, need: Need) -> std::result::Result<(), tonic::Status> {
        self.authorize_role(caller(req), need, None)
    }

    fn authorize_role(
        &self,
        role: Option<Role>,
        need: Need,
        command: Option<&Command>,
    ) -> std::result::Result<(), tonic::Status> {
        let Some(anonymous_reads) = self.tls else { return Ok(()) };
        let verdict = match (need, role) {
            (_, Some(Role::Node)) => Ok(()),
            (Need::Read, None) if anonymous_reads => Ok(()),
            (Need::Read, Some(Role::Operator)) => Ok(()),
            (Need::Propose, Some(Role::Operator)) if command.is_some_and(operator_may_propose) => Ok(()),
            (Need::Propose, Some(Role::Operator)) => {
                Err("an operator certificate may only drain, revoke or remove nodes".to_string())
            }
            (Need::Node, Some(Role::Operator)) => {
                Err("only a node certificate may speak for a node".to_string())
            }
            (_, None) => Err(format!(
                "this call needs a client certificate of the cluster CA ({})",
                match need {
                    Need::Read => "status needs one unless the node allows anonymous reads",
                    Need::Propose => "drain and revoke need one: limpet certs issue NAME --client",
                    Need::Node => "raft traffic needs a node certificate",
                }
            )),
        };
        verdict.map_err(|why| {
            tracing::warn!(node = self.me, ?need, %why, "call refused");
            tonic::Status::permission_denied(why)
        })
    }

    fn check_cluster(&self, got: u64, what: &str) -> std::result::Result<(), tonic::Status> {
        if got != self.cluster_id {
            let e = ConsensusError::WrongCluster { expected: self.cluster_id, got };
            tracing::warn!(node = self.me, %e, "{what} refused");
            return Err(e.into());
        }
        Ok(())
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> std::result::Result<T, tonic::Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| tonic::Status::from(ConsensusError::Shutdown))?;
        rx.await.map_err(|_| ConsensusError::Shutdown.into())
    }

    fn deadline(&self, timeout_ms: u64) -> Instant {
        let wait = if timeout_ms == 0 { self.timeout } else { Duration::from_millis(timeout_ms.min(60_000)) };
        Instant::now() + wait
    }
}

#[tonic::async_trait]
impl pb::consensus_server::Consensus for Service {
    async fn send(
        &self,
        req: tonic::Request<pb::RaftBatch>,
    ) -> std::result::Result<tonic::Response<pb::SendAck>, tonic::Status> {
        self.authorize(&req, Need::Node)?;
        let batch = req.into_inner();
        let msgs = decode_batch(&batch, self.cluster_id, self.me).map_err(|e| {
            tracing::warn!(node = self.me, from = batch.from, %e, "raft batch refused");
            tonic::Status::from(e)
        })?;
        // A full queue means the node is behind; dropping is safe, raft retransmits.
        let _ = self.tx.try_send(Request::Raft { from: batch.from, from_addr: batch.from_addr, msgs });
        Ok(tonic::Response::new(pb::SendAck {}))
    }

    async fn propose(
        &self,
        req: tonic::Request<pb::ProposeRequest>,
    ) -> std::result::Result<tonic::Response<pb::ProposeReply>, tonic::Status> {
        let (role, req) = (caller(&req), req.into_inner());
        self.check_cluster(req.cluster_id, "proposal")?;
        let command = Command::decode(&req.command)
            .map_err(|e| tonic::Status::from(ConsensusError::Decode { what: "command", detail: e.detail }))?;
        self.authorize_role(role, Need::Propose, Some(&command))?;
        let deadline = self.deadline(req.timeout_ms);
        let reply = match self.ask(|reply| Request::Propose { command, deadline, reply }).await? {
            Ok((index, detail)) => pb::ProposeReply { index, accepted: true, detail },
            Err(ConsensusError::Rejected(detail)) => pb::ProposeReply { index: 0, accepted: false, detail },
            Err(e) => return Err(e.into()),
        };
        Ok(tonic::Response::new(reply))
    }

    async fn read(
        &self,
        req: tonic::Request<pb::ReadRequest>,
    ) -> std::result::Result<tonic::Response<pb::ReadReply>, tonic::Status> {
        self.authorize(&req, Need::Read)?;
        let req = req.into_inner();
        self.check_cluster(req.cluster_id, "read")?;
        let deadline = self.deadline(0);
        let r = self.ask(|reply| Request::Read { linearizable: req.linearizable, deadline, reply }).await??;
        Ok(tonic::Response::new(pb::ReadReply {
            state: serde_json::to_vec(&r.state).expect("states serialize"),
            applied_index: r.applied_index,
            linearizable: r.linearizable,
            leader: r.leader,
            term: r.term,
        }))
    }

    async fn status(
        &self,
        req: tonic::Request<pb::StatusRequest>,
    ) -> std::result::Result<tonic::Response<pb::StatusReply>, tonic::Status> {
        self.authorize(&req, Need::Read)?;
        self.check_cluster(req.into_inner().cluster_id, "status")?;
        let status = self.ask(|reply| Request::Status { reply }).await?;
        Ok(tonic::Response::new(pb::StatusReply {
            status: serde_json::to_vec(&status).expect("status serializes"),
        }))
    }

    async fn heartbeat(
        &self,
        req: tonic::Request<pb::HeartbeatRequest>,
    ) -> std::result::Result<tonic::Response<pb::HeartbeatReply>, tonic::Status> {
        self.authorize(&req, Need::Node)?;
        let req = req.into_inner();
        self.check_cluster(req.cluster_id, "heartbeat")?;
        if req.from == 0 || req.report.len() > MAX_REPORT_BYTES {
            return Err(ConsensusError::Decode {
                what: "heartbeat",
                detail: format!("from node {} with {} report bytes", req.from, req.report.len()),
            }
            .into());
        }
        self.reports.put(req.from, req.report);
        Ok(tonic::Response::new(pb::HeartbeatReply {}))
    }

    async fn reports(
        &self,
        req: tonic::Request<pb::ReportsRequest>,
    ) -> std::result::Result<tonic::Response<pb::ReportsReply>, tonic::Status> {
        self.authorize(&req, Need::Read)?;
        self.check_cluster(req.into_inner().cluster_id, "reports")?;
        let reports = self
            .reports
            .all()
            .into_iter()
            .map(|r| pb::NodeReport { node: r.node, age_ms: r.age.as_millis() as u64, report: r.report })
            .collect();
        Ok(tonic::Response::new(pb::ReportsReply { reports }))
    }
}

//! The consensus gRPC service a node serves: who may call what (certificates checked per
//! call, each node speaking only as itself), requests checked and decoded, then handed to
//! the node's task (`node.rs`) through its channel.

use crate::error::{ConsensusError, Result};
use crate::inbox::{LocalState, Reports, Request, MAX_REPORT_BYTES};
use crate::state::{Command, NodeId, Proposer};
use crate::tls::{Peer, Role, Tls};
use crate::transport::{decode_batch, pb};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// Serves the consensus gRPC service on `listener` until `shutdown`.
pub(crate) fn serve(
    listener: tokio::net::TcpListener,
    service: Service,
    tls: Option<&Arc<Tls>>,
    tasks: &crate::tasks::Tasks,
) -> Result<()> {
    use tokio_stream::StreamExt as _;
    // Connections are admitted by `Admission` (below): strangers share MAX_CONNECTIONS slots,
    // MAX_CONNECTIONS_PER_ADDRESS from any one address, so a stranger opening connections,
    // TLS or not, cannot exhaust the node's file descriptors or memory, nor take every slot
    // from one host; members' addresses have slots of their own that grow with the members
    // there, so the fleet's own channels never meet a stranger's cap. A slot is held at most
    // the TLS handshake's timeout by a client that never finishes it, and keepalive pings
    // close connections whose peer has gone. Rejections are warned about at most once a minute.
    let admission = Arc::new(Admission::new(service.members.clone()));
    let mut warned: Option<std::time::Instant> = None;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |conn| {
        let io = match conn {
            Ok(io) => io,
            Err(e) => return Some(Err(e)),
        };
        // IPv4 peers of a dual-stack listener arrive as ::ffff:a.b.c.d: counted as a.b.c.d.
        let ip = io.peer_addr().map(|a| a.ip().to_canonical()).ok();
        match admission.admit(ip) {
            Ok(held) => {
                let _ = io.set_nodelay(true);
                Some(Ok(Capped { io, _held: held }))
            }
            Err(refusal) => {
                if warned.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    warned = Some(std::time::Instant::now());
                    let peer = io.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(
                        peer,
                        limit = refusal.limit,
                        per_address = refusal.per_address,
                        member = refusal.member,
                        "control-plane connections at the cap; closing new ones"
                    );
                }
                None
            }
        }
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls.grpc_server())
            .map_err(|e| ConsensusError::Config(format!("TLS for the control plane: {e}")))?;
    }
    let mut builder = builder
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        // One connection's calls at once are bounded: a client flooding reads on a channel
        // holds at most this many of the node's requests.
        .concurrency_limit_per_connection(MAX_CALLS_PER_CONNECTION);
    let shutdown = tasks.token();
    tasks.spawn("control-server", async move {
        let served = builder
            .add_service(
                pb::consensus_server::ConsensusServer::new(service)
                    .max_decoding_message_size(crate::transport::MAX_REQUEST_BYTES)
                    .max_encoding_message_size(crate::transport::MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
        tokio::pin!(served);
        // A graceful shutdown waits for every connection to close, and a client may hold one
        // open for good: after a second's grace the rest are dropped.
        let grace = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        let result = tokio::select! {
            r = &mut served => r,
            () = grace => Ok(()),
        };
        if let Err(e) = result {
            tracing::error!(%e, "consensus server stopped");
        }
    });
    Ok(())
}

/// The most calls one control-plane connection has in flight at once.
pub const MAX_CALLS_PER_CONNECTION: usize = 32;

/// How long connections may finish their calls once the node stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// The most control-plane connections a node holds at once from strangers (addresses no
/// member has): operators' tools, and anyone who reaches the port.
pub const MAX_CONNECTIONS: usize = 512;

/// The most control-plane connections from one stranger's address.
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 64;

/// Connection slots each member adds to its address and to the members' pool: its raft
/// channel and heartbeat channel to this node, its operator's and its agent's calls.
pub const CONNECTIONS_PER_MEMBER: usize = 8;

/// The most control-plane connections from an address where `members` members live (a real
/// fleet has one a host; a lab machine runs many on one address).
pub fn address_cap(members: usize) -> usize {
    MAX_CONNECTIONS_PER_ADDRESS + members * CONNECTIONS_PER_MEMBER
}

/// Which pool a connection counts against.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Pool {
    Strangers,
    Members,
}

/// Why a connection was closed as it arrived.
struct Refusal {
    limit: usize,
    per_address: usize,
    member: bool,
}

/// The connections open, per pool and per address, and the members' addresses as of the
/// applied state (recomputed only when the state changes).
struct Admission {
    members: watch::Receiver<LocalState>,
    inner: std::sync::Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    open: std::collections::HashMap<Pool, usize>,
    per_address: std::collections::HashMap<std::net::IpAddr, usize>,
    /// Members (not gone) per address, and in all, for the state at `of`.
    member_ips: std::collections::HashMap<std::net::IpAddr, usize>,
    live_members: usize,
    of: Option<Arc<crate::state::ClusterState>>,
}

/// The IP address in a member's advertised `host:port` (a name that is not an address
/// counts as none: the node does not resolve names as connections arrive).
fn ip_of(addr: &str) -> Option<std::net::IpAddr> {
    let hostport = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
        .map(|ip: std::net::IpAddr| ip.to_canonical())
}

impl Admission {
    fn new(members: watch::Receiver<LocalState>) -> Admission {
        Admission { members, inner: std::sync::Mutex::default() }
    }

    /// Counts a connection from `ip` against its pool and its address, unless either is
    /// full. A peer whose address is unknown counts as a stranger without an address.
    fn admit(self: &Arc<Self>, ip: Option<std::net::IpAddr>) -> std::result::Result<Held, Refusal> {
        let state = Arc::clone(&self.members.borrow().state);
        let mut c = self.inner.lock().expect("admission lock");
        if !c.of.as_ref().is_some_and(|s| Arc::ptr_eq(s, &state)) {
            c.member_ips.clear();
            c.live_members = 0;
            for m in state.members.values().filter(|m| m.status != crate::state::MemberStatus::Gone) {
                c.live_members += 1;
                let mut ips: Vec<_> =
                    [&m.spec.control_addr, &m.spec.data_addr].into_iter().filter_map(|a| ip_of(a)).collect();
                ips.dedup();
                for ip in ips {
                    *c.member_ips.entry(ip).or_insert(0) += 1;
                }
            }
            c.of = Some(state);
        }
        let here = ip.and_then(|ip| c.member_ips.get(&ip).copied()).unwrap_or(0);
        let (pool, limit, per_address) = if here > 0 {
            (Pool::Members, MAX_CONNECTIONS + c.live_members * CONNECTIONS_PER_MEMBER, address_cap(here))
        } else {
            (Pool::Strangers, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS)
        };
        let open = c.open.get(&pool).copied().unwrap_or(0);
        let at_address = ip.and_then(|ip| c.per_address.get(&ip).copied()).unwrap_or(0);
        if open >= limit || at_address >= per_address {
            return Err(Refusal { limit, per_address, member: here > 0 });
        }
        *c.open.entry(pool).or_insert(0) += 1;
        if let Some(ip) = ip {
            *c.per_address.entry(ip).or_insert(0) += 1;
        }
        Ok(Held { admission: Arc::clone(self), pool, ip })
    }
}

/// One connection counted against its pool and address, until dropped.
struct Held {
    admission: Arc<Admission>,
    pool: Pool,
    ip: Option<std::net::IpAddr>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut c = self.admission.inner.lock().expect("admission lock");
        if let Some(n) = c.open.get_mut(&self.pool) {
            *n = n.saturating_sub(1);
        }
        if let Some(ip) = self.ip {
            if let Some(n) = c.per_address.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    c.per_address.remove(&ip);
                }
            }
        }
    }
}

/// An accepted connection holding one of the server's connection slots (and one of its
/// address's) until it closes.
struct Capped {
    io: tokio::net::TcpStream,
    _held: Held,
}

impl tonic::transport::server::Connected for Capped {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::Connected::connect_info(&self.io)
    }
}

impl tokio::io::AsyncRead for Capped {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Capped {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The gRPC service: checks and decodes requests, then hands them to the node's task.
pub(crate) struct Service {
    pub(crate) tx: mpsc::Sender<Request>,
    /// Peers' raft batches, on a queue clients cannot fill.
    pub(crate) raft_tx: mpsc::Sender<Request>,
    pub(crate) cluster_id: u64,
    /// The cluster's name, for refusals that name it.
    pub(crate) cluster: String,
    pub(crate) me: NodeId,
    pub(crate) timeout: Duration,
    pub(crate) reports: Reports,
    /// With mutual TLS: whether reads need no certificate.
    pub(crate) tls: Option<bool>,
    /// This node's applied state, for who is a member.
    pub(crate) members: watch::Receiver<LocalState>,
    /// Snapshots arriving in chunks.
    pub(crate) chunks: Arc<crate::chunks::Assemblies>,
}

/// The cluster a request asked for, in words: the name it gives when that name is really
/// the one its id was made from (a caller cannot put words in the refusal), else the id.
fn requested(id: u64, named: &str) -> String {
    if !named.is_empty() && named.len() <= 128 && crate::state::cluster_id(named) == id {
        format!("{named:?}")
    } else {
        format!("{id:#018x}")
    }
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

/// Who the caller's certificate says it is, if it presented one.
fn caller<T>(req: &tonic::Request<T>) -> Option<Peer> {
    req.peer_certs().and_then(|c| c.first().and_then(|c| crate::tls::peer_of(c)))
}

impl Service {
    /// Checks the caller's certificate (when the node runs with TLS) against what the call
    /// needs; the rustls handshake already verified it against the cluster CA.
    fn authorize<T>(&self, req: &tonic::Request<T>, need: Need) -> std::result::Result<(), tonic::Status> {
        let peer = self.caller(req)?;
        self.authorize_role(peer, need)
    }

    /// Who the caller's certificate says it is, refusing one the cluster revoked.
    fn caller<T>(&self, req: &tonic::Request<T>) -> std::result::Result<Option<Peer>, tonic::Status> {
        // Most clusters revoke nothing: no fingerprint is computed per call for them.
        let state = self.members.borrow().state.clone();
        let cert = req.peer_certs().filter(|_| !state.revoked.is_empty()).and_then(|c| c.first().cloned());
        if let Some(cert) = cert {
            let fp = crate::tls::fingerprint(cert.as_ref());
            if let Some(name) = state.revoked.0.get(&fp) {
                let why = format!("certificate {fp} ({name}) is revoked");
                tracing::warn!(node = self.me, %why, "call refused");
                return Err(tonic::Status::permission_denied(why));
            }
        }
        Ok(caller(req))
    }

    /// Checks that a node speaking as `claimed` holds that node's certificate (only when the
    /// node runs with TLS: without it, nothing binds a caller to an id).
    fn authorize_node(
        &self,
        peer: Option<Peer>,
        claimed: NodeId,
        what: &str,
    ) -> std::result::Result<(), tonic::Status> {
        if self.tls.is_none() {
            return Ok(());
        }
        match peer.and_then(|p| p.node) {
            Some(id) if id == claimed => Ok(()),
            bound => {
                let why = format!(
                    "{what} speaks for node {claimed}, but the caller's certificate is {}",
                    bound.map_or("no node's".into(), |id| format!("node {id}'s"))
                );
                tracing::warn!(node = self.me, %why, "call refused");
                Err(tonic::Status::permission_denied(why))
            }
        }
    }

    fn authorize_role(&self, peer: Option<Peer>, need: Need) -> std::result::Result<(), tonic::Status> {
        let Some(anonymous_reads) = self.tls else { return Ok(()) };
        let role = peer.map(|p| p.role);
        let verdict = match (need, role) {
            (_, Some(Role::Node)) => Ok(()),
            (Need::Read, None) if anonymous_reads => Ok(()),
            (Need::Read, Some(Role::Operator | Role::OnCall)) => Ok(()),
            // Which commands: `Command::authorize`.
            (Need::Propose, Some(Role::Operator | Role::OnCall)) => Ok(()),
            (Need::Node, Some(Role::Operator | Role::OnCall)) => {
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

    /// Puts the data that came in chunks back into the one snapshot message of a batch
    /// marked so (a marked batch with no such message, or one with data, is refused).
    fn join_chunks(&self, from: NodeId, msgs: &mut [raft::eraftpb::Message]) -> Result<()> {
        let snapshot = raft::eraftpb::MessageType::MsgSnapshot;
        let mut snaps = msgs.iter_mut().filter(|m| m.get_msg_type() == snapshot);
        let (Some(m), None) = (snaps.next(), snaps.next()) else {
            return Err(ConsensusError::Decode {
                what: "raft batch",
                detail: "marked as a chunked snapshot without exactly one snapshot message".into(),
            });
        };
        if !m.get_snapshot().data.is_empty() {
            return Err(ConsensusError::Decode {
                what: "raft batch",
                detail: "a chunked snapshot's message carries data of its own".into(),
            });
        }
        let data = self.chunks.take(from, crate::chunks::snapshot_id(m))?;
        tracing::info!(node = self.me, from, bytes = data.len(), "a snapshot received in chunks");
        m.mut_snapshot().data = data;
        Ok(())
    }

    fn check_cluster(&self, got: u64, named: &str, what: &str) -> std::result::Result<(), tonic::Status> {
        if got != self.cluster_id {
            let e = ConsensusError::WrongCluster {
                serves: format!("{:?}", self.cluster),
                got: requested(got, named),
            };
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
        let peer = self.caller(&req)?;
        self.authorize_role(peer, Need::Node)?;
        let batch = req.into_inner();
        crate::transport::count_control_bytes(false, "raft", prost::Message::encoded_len(&batch));
        self.authorize_node(peer, batch.from, "a raft batch")?;
        let refused = |e: ConsensusError| {
            let e = match e {
                ConsensusError::WrongCluster { got, .. } => {
                    ConsensusError::WrongCluster { serves: format!("{:?}", self.cluster), got }
                }
                e => e,
            };
            tracing::warn!(node = self.me, from = batch.from, %e, "raft batch refused");
            tonic::Status::from(e)
        };
        let mut msgs = decode_batch(&batch, self.cluster_id, self.me).map_err(refused)?;
        if batch.snapshot_chunked {
            self.join_chunks(batch.from, &mut msgs).map_err(refused)?;
        }
        // A full queue means the node is behind; dropping is safe, raft retransmits.
        let _ = self.raft_tx.try_send(Request::Raft { from: batch.from, from_addr: batch.from_addr, msgs });
        Ok(tonic::Response::new(pb::SendAck {}))
    }

    async fn send_snapshot_chunk(
        &self,
        req: tonic::Request<pb::SnapshotChunk>,
    ) -> std::result::Result<tonic::Response<pb::SendAck>, tonic::Status> {
        let peer = self.caller(&req)?;
        self.authorize_role(peer, Need::Node)?;
        let c = req.into_inner();
        crate::transport::count_control_bytes(false, "snapshot", prost::Message::encoded_len(&c));
        self.check_cluster(c.cluster_id, "", "snapshot chunk")?;
        self.authorize_node(peer, c.from, "a snapshot chunk")?;
        // Snapshots come from a leader: a member, or the leader this node follows (one that
        // joined while this node was behind is not in its state yet); a node with no state
        // yet (joining) takes them from whoever its first leader is.
        let member = {
            let local = self.members.borrow();
            let members = &local.state.members;
            members.is_empty()
                || c.from == local.leader
                || members.get(&c.from).is_some_and(|m| m.status != crate::state::MemberStatus::Gone)
        };
        if !member {
            return Err(tonic::Status::permission_denied(format!(
                "node {} is not a member: no snapshot from it",
                c.from
            )));
        }
        self.chunks.add(c.from, (c.index, c.term), c.offset, c.total, &c.data).map_err(|e| {
            tracing::warn!(node = self.me, from = c.from, %e, "snapshot chunk refused");
            tonic::Status::from(e)
        })?;
        Ok(tonic::Response::new(pb::SendAck {}))
    }

    async fn propose(
        &self,
        req: tonic::Request<pb::ProposeRequest>,
    ) -> std::result::Result<tonic::Response<pb::ProposeReply>, tonic::Status> {
        let (role, req) = (self.caller(&req)?, req.into_inner());
        self.check_cluster(req.cluster_id, &req.cluster, "proposal")?;
        let command = Command::decode(&req.command)
            .map_err(|e| tonic::Status::from(ConsensusError::Decode { what: "command", detail: e.detail }))?;
        self.authorize_role(role, Need::Propose)?;
        // What the caller may ask for (a node only about itself: another's Join would take
        // over its rank and its traffic; an operator drains, revokes and removes; the rest is
        // the leader's controllers'). Without TLS nothing proves who calls, and the cluster
        // trusts its network.
        let who = match role {
            Some(Peer { role: Role::Node, node: Some(id) }) => Some(Proposer::Node(id)),
            Some(Peer { role: Role::Operator, .. }) => Some(Proposer::Operator),
            Some(Peer { role: Role::OnCall, .. }) => Some(Proposer::OnCall),
            _ => None,
        };
        if self.tls.is_some() {
            // authorize_role let no caller without a certificate this far: fail closed anyway.
            let Some(who) = who else {
                return Err(tonic::Status::permission_denied("a proposal needs a client certificate"));
            };
            if let Err(why) = command.authorize(who) {
                tracing::warn!(node = self.me, ?who, %why, "proposal refused");
                return Err(tonic::Status::permission_denied(why.to_string()));
            }
        } else if let Err(why) = command.check_words() {
            // Whoever calls, what they write stays in every snapshot and reaches operators'
            // terminals.
            tracing::warn!(node = self.me, %why, "proposal refused");
            return Err(tonic::Status::invalid_argument(why.to_string()));
        }
        let deadline = self.deadline(req.timeout_ms);
        let reply = match self
            .ask(|reply| Request::Propose {
                command: Box::new(command),
                deadline,
                reply,
                term: None,
                at_leader: true,
                reporter: match who {
                    Some(Proposer::Node(id)) => Some(id),
                    _ => None,
                },
            })
            .await?
        {
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
        self.check_cluster(req.cluster_id, &req.cluster, "read")?;
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
        let req = req.into_inner();
        // Id 0 asks whichever cluster this node serves: the reply names it.
        if req.cluster_id != 0 {
            self.check_cluster(req.cluster_id, &req.cluster, "status")?;
        }
        let status = self.ask(|reply| Request::Status { reply }).await?;
        Ok(tonic::Response::new(pb::StatusReply {
            status: serde_json::to_vec(&status).expect("status serializes"),
            cluster: self.cluster.clone(),
        }))
    }

    async fn heartbeat(
        &self,
        req: tonic::Request<pb::HeartbeatRequest>,
    ) -> std::result::Result<tonic::Response<pb::HeartbeatReply>, tonic::Status> {
        let peer = self.caller(&req)?;
        self.authorize_role(peer, Need::Node)?;
        let req = req.into_inner();
        crate::transport::count_control_bytes(false, "report", prost::Message::encoded_len(&req));
        self.check_cluster(req.cluster_id, &req.cluster, "heartbeat")?;
        self.authorize_node(peer, req.from, "a heartbeat")?;
        // Only members report: a stranger's reports would only be noise, and a report for a
        // removed node (gone from the cluster, its record kept) must not keep it looking alive.
        let status = self.members.borrow().state.members.get(&req.from).map(|m| m.status);
        match status {
            None => {
                return Err(tonic::Status::permission_denied(format!("node {} is not a member", req.from)))
            }
            Some(crate::state::MemberStatus::Gone) => {
                return Err(tonic::Status::permission_denied(format!(
                    "node {} has left the cluster",
                    req.from
                )))
            }
            Some(_) => {}
        }
        if req.from == 0 || req.report.len() > MAX_REPORT_BYTES {
            return Err(ConsensusError::Decode {
                what: "heartbeat",
                detail: format!("from node {} with {} report bytes", req.from, req.report.len()),
            }
            .into());
        }
        self.reports.put(req.from, req.report);
        if req.urgent {
            self.reports.mark_urgent(req.from);
        }
        Ok(tonic::Response::new(pb::HeartbeatReply {}))
    }

    async fn reports(
        &self,
        req: tonic::Request<pb::ReportsRequest>,
    ) -> std::result::Result<tonic::Response<pb::ReportsReply>, tonic::Status> {
        self.authorize(&req, Need::Read)?;
        let req = req.into_inner();
        self.check_cluster(req.cluster_id, &req.cluster, "reports")?;
        let reports = self
            .reports
            .all()
            .into_iter()
            .map(|r| pb::NodeReport { node: r.node, age_ms: r.age.as_millis() as u64, report: r.report })
            .collect();
        Ok(tonic::Response::new(pb::ReportsReply { reports }))
    }
}

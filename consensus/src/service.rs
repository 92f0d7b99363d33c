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
    // At most MAX_CONNECTIONS at once, and MAX_CONNECTIONS_PER_ADDRESS from any one address
    // (the rest are closed as they arrive, with a warning at most once a minute): a stranger
    // opening connections, TLS or not, cannot exhaust the node's file descriptors or memory,
    // nor take every slot from one host; a slot is held at most the TLS handshake's timeout
    // by a client that never finishes it, and keepalive pings close connections whose peer
    // has gone.
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let per_address: PerAddress = Arc::default();
    let mut warned: Option<std::time::Instant> = None;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |conn| {
        let io = match conn {
            Ok(io) => io,
            Err(e) => return Some(Err(e)),
        };
        let ip = io.peer_addr().map(|a| a.ip()).ok();
        let held = ip.and_then(|ip| Held::take(&per_address, ip));
        let slot = Arc::clone(&slots).try_acquire_owned().ok();
        match (ip.is_none() || held.is_some(), slot) {
            (true, Some(slot)) => {
                let _ = io.set_nodelay(true);
                Some(Ok(Capped { io, _slot: slot, _held: held }))
            }
            _ => {
                if warned.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    warned = Some(std::time::Instant::now());
                    let peer = io.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(
                        peer,
                        limit = MAX_CONNECTIONS,
                        per_address = MAX_CONNECTIONS_PER_ADDRESS,
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
            .add_service(pb::consensus_server::ConsensusServer::new(service))
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

/// The most control-plane connections a node holds at once: every member's channel to it, the
/// operators' and the agents', with room to spare.
pub const MAX_CONNECTIONS: usize = 512;

/// The most control-plane connections from one address.
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 64;

/// Open connections by peer address.
type PerAddress = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// One connection counted against its address, until dropped.
struct Held(PerAddress, std::net::IpAddr);

impl Held {
    /// Counts a connection from `ip`, unless that address is at its cap.
    fn take(map: &PerAddress, ip: std::net::IpAddr) -> Option<Held> {
        let mut m = map.lock().expect("per-address lock");
        let n = m.entry(ip).or_insert(0);
        if *n >= MAX_CONNECTIONS_PER_ADDRESS {
            return None;
        }
        *n += 1;
        Some(Held(Arc::clone(map), ip))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.0.lock().expect("per-address lock");
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// An accepted connection holding one of the server's connection slots (and one of its
/// address's) until it closes.
struct Capped {
    io: tokio::net::TcpStream,
    _slot: tokio::sync::OwnedSemaphorePermit,
    _held: Option<Held>,
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
        self.authorize_node(peer, batch.from, "a raft batch")?;
        let msgs = decode_batch(&batch, self.cluster_id, self.me).map_err(|e| {
            let e = match e {
                ConsensusError::WrongCluster { got, .. } => {
                    ConsensusError::WrongCluster { serves: format!("{:?}", self.cluster), got }
                }
                e => e,
            };
            tracing::warn!(node = self.me, from = batch.from, %e, "raft batch refused");
            tonic::Status::from(e)
        })?;
        // A full queue means the node is behind; dropping is safe, raft retransmits.
        let _ = self.raft_tx.try_send(Request::Raft { from: batch.from, from_addr: batch.from_addr, msgs });
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

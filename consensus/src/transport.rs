//! The gRPC side of a node: the generated protocol, the decoders of bytes that arrive from
//! peers (pure, fuzzed and property-tested), the outgoing per-peer senders, and the `Client`
//! that the CLI, benchmarks and joining nodes use.

use crate::core::NodeStatus;
use crate::error::{ConsensusError, Result};
use crate::state::{ClusterState, Command, NodeId};
use crate::tls::Tls;
use prost::Message as _;
use raft::prelude::{Message, MessageType};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The generated protocol (`proto/consensus.proto`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("limpet.consensus.v1");
}

/// Most raft messages one batch carries.
pub const MAX_BATCH: usize = 256;

/// Decodes the raft messages of a batch received from a peer, refusing batches of another
/// cluster, messages that do not decode, and messages whose sender is not the batch's sender.
pub fn decode_batch(batch: &pb::RaftBatch, cluster_id: u64, me: NodeId) -> Result<Vec<Message>> {
    if batch.cluster_id != cluster_id {
        return Err(ConsensusError::WrongCluster {
            serves: format!("{cluster_id:#018x}"),
            got: format!("{:#018x}", batch.cluster_id),
        });
    }
    if batch.messages.len() > MAX_BATCH {
        return Err(ConsensusError::Decode {
            what: "raft batch",
            detail: format!("{} messages (at most {MAX_BATCH})", batch.messages.len()),
        });
    }
    let mut out = Vec::with_capacity(batch.messages.len());
    for (i, raw) in batch.messages.iter().enumerate() {
        let msg = crate::codec::decode_message(raw).map_err(|e| ConsensusError::Decode {
            what: "raft message",
            detail: format!("message {i}: {e}"),
        })?;
        if msg.from != batch.from || msg.to != me {
            return Err(ConsensusError::Decode {
                what: "raft message",
                detail: format!(
                    "message {i} is from {} to {}, but the batch is from {} to node {me}",
                    msg.from, msg.to, batch.from
                ),
            });
        }
        out.push(msg);
    }
    Ok(out)
}

/// Decodes a whole `RaftBatch` from its protobuf bytes (what the fuzzer feeds).
pub fn decode_batch_bytes(bytes: &[u8], cluster_id: u64, me: NodeId) -> Result<Vec<Message>> {
    let batch = pb::RaftBatch::decode(bytes)
        .map_err(|e| ConsensusError::Decode { what: "raft batch", detail: e.to_string() })?;
    decode_batch(&batch, cluster_id, me)
}

/// Encodes messages into a batch.
pub fn encode_batch(cluster_id: u64, from: NodeId, msgs: &[Message]) -> pb::RaftBatch {
    pb::RaftBatch {
        cluster_id,
        from,
        from_addr: String::new(),
        messages: msgs.iter().map(crate::codec::encode).collect(),
        snapshot_chunked: false,
    }
}

/// What a sender tells its node after a delivery attempt.
#[derive(Debug)]
pub enum PeerReport {
    /// The peer could not be reached.
    Unreachable(NodeId),
    /// A snapshot did (true) or did not (false) reach the peer.
    Snapshot(NodeId, bool),
}

/// A queue to one peer, drained by its own task so a slow peer never blocks the Ready loop.
pub struct PeerSender {
    /// The address the task sends to.
    pub addr: String,
    tx: mpsc::Sender<Message>,
}

impl PeerSender {
    /// Starts the sender task for `to` at `addr` (snapshot data past `chunk` bytes goes in
    /// chunks of that size).
    pub fn spawn(
        (cluster_id, chunk): (u64, usize),
        (from, from_addr): (NodeId, String),
        to: NodeId,
        addr: String,
        tls: Option<Arc<Tls>>,
        reports: mpsc::UnboundedSender<PeerReport>,
        tasks: &crate::tasks::Tasks,
    ) -> PeerSender {
        let (tx, mut rx) = mpsc::channel::<Message>(4096);
        let target = addr.clone();
        // Ends when the node's loop drops this sender (at shutdown too), after what is queued:
        // a departing leader's last messages still go out.
        tasks.spawn("peer-sender", async move {
            let mut client: Option<pb::consensus_client::ConsensusClient<tonic::transport::Channel>> = None;
            while let Some(first) = rx.recv().await {
                let mut msgs = vec![first];
                while msgs.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(m) => msgs.push(m),
                        Err(_) => break,
                    }
                }
                let has_snapshot = msgs.iter().any(|m| m.get_msg_type() == MessageType::MsgSnapshot);
                let c = client.get_or_insert_with(|| match tls.as_deref() {
                    Some(t) => connect_pinned(&target, t, to),
                    None => connect_lazy(&target, None),
                });
                // A large snapshot's data goes first, in chunks; the message follows without it.
                let (mut ok, mut chunked) = (true, false);
                if let Some(i) = crate::chunks::chunked_snapshot(&msgs, chunk) {
                    let id = crate::chunks::snapshot_id(&msgs[i]);
                    let data = msgs[i].mut_snapshot().take_data();
                    match send_chunks(c, (cluster_id, from), id, &data, chunk).await {
                        Chunks::Sent => chunked = true,
                        Chunks::Failed => ok = false,
                        // An older receiver has no chunk call: the whole snapshot, as it took
                        // before, if it fits its request limit (else nothing it could take).
                        Chunks::Unsupported if data.len() + (64 << 10) <= MAX_REQUEST_BYTES => {
                            msgs[i].mut_snapshot().data = data
                        }
                        Chunks::Unsupported => {
                            tracing::warn!(
                                to,
                                bytes = data.len(),
                                "a snapshot too large for a peer too old to take it in chunks"
                            );
                            ok = false;
                        }
                    }
                }
                if ok {
                    let mut batch = encode_batch(cluster_id, from, &msgs);
                    batch.from_addr.clone_from(&from_addr);
                    batch.snapshot_chunked = chunked;
                    count_control_bytes(true, "raft", prost::Message::encoded_len(&batch));
                    let sent = tokio::time::timeout(Duration::from_secs(2), c.send(batch)).await;
                    ok = matches!(sent, Ok(Ok(_)));
                }
                if !ok {
                    client = None;
                    let _ = reports.send(PeerReport::Unreachable(to));
                    // Back off a little so a dead peer costs little; raft resends.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                if has_snapshot {
                    let _ = reports.send(PeerReport::Snapshot(to, ok));
                }
            }
        });
        PeerSender { addr, tx }
    }

    /// Queues a message; drops it when the queue is full (raft retransmits).
    pub fn send(&self, msg: Message) -> bool {
        self.tx.try_send(msg).is_ok()
    }
}

/// How a snapshot's chunks went.
enum Chunks {
    /// Every one arrived.
    Sent,
    /// One did not: raft sends the snapshot again.
    Failed,
    /// The receiver has no chunk call (an older build).
    Unsupported,
}

/// Sends snapshot `id`'s `data` in chunks of `chunk` bytes, in order, each within 2 s.
async fn send_chunks(
    c: &mut pb::consensus_client::ConsensusClient<tonic::transport::Channel>,
    (cluster_id, from): (u64, NodeId),
    id: crate::chunks::SnapshotId,
    data: &[u8],
    chunk: usize,
) -> Chunks {
    let total = data.len() as u64;
    for (n, piece) in data.chunks(chunk.max(1)).enumerate() {
        let req = pb::SnapshotChunk {
            cluster_id,
            from,
            index: id.0,
            term: id.1,
            offset: (n * chunk.max(1)) as u64,
            total,
            data: piece.to_vec(),
        };
        count_control_bytes(true, "snapshot", prost::Message::encoded_len(&req));
        match tokio::time::timeout(Duration::from_secs(2), c.send_snapshot_chunk(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) if n == 0 && s.code() == tonic::Code::Unimplemented => return Chunks::Unsupported,
            _ => {
                tracing::debug!(from, offset = n * chunk, "a snapshot chunk was not delivered");
                return Chunks::Failed;
            }
        }
    }
    Chunks::Sent
}

fn endpoint(addr: &str, tls: Option<&Tls>) -> Result<tonic::transport::Endpoint> {
    endpoint_tls(addr, tls.map(Tls::grpc_client))
}

fn endpoint_tls(
    addr: &str,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<tonic::transport::Endpoint> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let e = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map(|e| e.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true))
        .map_err(|e| ConsensusError::Config(format!("address {addr:?}: {e}")))?;
    match tls {
        Some(t) => e.tls_config(t).map_err(|e| ConsensusError::Config(format!("TLS for {addr}: {e}"))),
        None => Ok(e),
    }
}

/// A lazy channel to node `node` at `addr` over TLS that this module runs itself (tonic
/// speaks HTTP/2 over it), so that the server's certificate must be *that* node's, not any
/// node's of the CA: every node certificate holds the same DNS name, which is all tonic's own
/// TLS checks. A stale address in the log, or a member answering for another, is refused.
fn connect_pinned(
    addr: &str,
    tls: &Tls,
    node: NodeId,
) -> pb::consensus_client::ConsensusClient<tonic::transport::Channel> {
    match pinned_config(tls) {
        Some(cfg) => connect_pinned_with(addr, cfg, node),
        // No identity: as if unreachable (the node cannot speak raft without one anyway).
        None => connect_lazy("0.0.0.0:1", None),
    }
}

/// The client side of [`connect_pinned`]'s TLS (HTTP/2 by ALPN), for a holder of an identity.
fn pinned_config(tls: &Tls) -> Option<Arc<rustls::ClientConfig>> {
    let mut c = (*tls.data_client().ok()?).clone();
    c.alpn_protocols = vec![b"h2".to_vec()];
    Some(Arc::new(c))
}

fn connect_pinned_with(
    addr: &str,
    cfg: Arc<rustls::ClientConfig>,
    node: NodeId,
) -> pb::consensus_client::ConsensusClient<tonic::transport::Channel> {
    let target = addr.to_string();
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let (cfg, target) = (Arc::clone(&cfg), target.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&target).await?;
            tcp.set_nodelay(true)?;
            let name = rustls::pki_types::ServerName::try_from(crate::tls::NODE_NAME).expect("a DNS name");
            let stream = tokio_rustls::TlsConnector::from(cfg).connect(name, tcp).await?;
            let peer =
                stream.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(crate::tls::peer_of);
            match peer.and_then(|p| p.node) {
                Some(id) if id == node => Ok(hyper_util::rt::TokioIo::new(stream)),
                other => Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{target} was to be node {node}, but its certificate is {}",
                        other.map_or("no node's".into(), |id| format!("node {id}'s"))
                    ),
                )),
            }
        }
    });
    let channel = match tonic::transport::Endpoint::from_shared(format!("http://{addr}")) {
        Ok(e) => e.connect_timeout(Duration::from_secs(1)).connect_with_connector_lazy(connector),
        Err(_) => tonic::transport::Endpoint::from_static("http://0.0.0.0:1").connect_lazy(),
    };
    client(channel)
}

fn connect_lazy(
    addr: &str,
    tls: Option<&Tls>,
) -> pb::consensus_client::ConsensusClient<tonic::transport::Channel> {
    let channel = match endpoint(addr, tls) {
        Ok(e) => e.connect_lazy(),
        // An address that does not parse came from the replicated state; sending to it fails
        // and is reported like any unreachable peer.
        Err(_) => tonic::transport::Endpoint::from_static("http://0.0.0.0:1").connect_lazy(),
    };
    client(channel)
}

/// The largest reply a client decodes (every member's report, a read of the whole state):
/// far above what a thousand hosts make (about 2 KB of state and at most 64 KiB of report
/// each), and said, not left to tonic's 4 MiB default, which `limpet status` of a large
/// cluster would pass. A client decodes replies only from nodes it chose.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// The largest request a node decodes, from anyone who reaches its port (anonymous reads,
/// a cluster without certificates): a raft batch with a snapshot of the state of several
/// thousand members fits, and 64 connections of an address, 32 calls each, cannot make the
/// node hold more than this each. Snapshots travel in chunks well below it, and a node
/// assembles at most two at once from members (`crate::chunks`).
pub const MAX_REQUEST_BYTES: usize = 16 << 20;

/// A client on `channel` taking and sending messages up to [`MAX_MESSAGE_BYTES`].
fn client(
    channel: tonic::transport::Channel,
) -> pb::consensus_client::ConsensusClient<tonic::transport::Channel> {
    pb::consensus_client::ConsensusClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Counts a control-plane message this node sends or receives and its bytes, by kind
/// (`raft`, `report`): what `limpet-lab bench scale` divides by the time to get each node's
/// control traffic, and by each other to get a message's mean size.
pub(crate) fn count_control_bytes(sent: bool, kind: &'static str, bytes: usize) {
    let direction = if sent { "sent" } else { "received" };
    metrics::counter!("limpet_control_bytes_total", "direction" => direction, "kind" => kind)
        .increment(bytes as u64);
    metrics::counter!("limpet_control_messages_total", "direction" => direction, "kind" => kind).increment(1);
}

/// The answer to a read.
#[derive(Clone, Debug)]
pub struct ReadResult {
    /// The cluster state.
    pub state: ClusterState,
    /// The index it reflects.
    pub applied_index: u64,
    /// Whether it is linearizable (read index) or this node's possibly stale copy.
    pub linearizable: bool,
    /// The leader the node knew.
    pub leader: NodeId,
    /// Its term.
    pub term: u64,
}

/// A client of any node's `Consensus` service.
#[derive(Clone)]
pub struct Client {
    cluster_id: u64,
    /// The cluster's name (empty for a client that asks whichever cluster the node serves).
    cluster: String,
    inner: pb::consensus_client::ConsensusClient<tonic::transport::Channel>,
    /// The TLS settings it connected with, to follow a node's answer that the leader is
    /// elsewhere.
    tls: Option<tonic::transport::ClientTlsConfig>,
    /// With an identity, the TLS that pins a redirect to the leader the answer names.
    pinned: Option<Arc<rustls::ClientConfig>>,
}

/// How many times a proposal follows "ask the leader there" before giving up (a leader
/// changing while the client moves, or a node that points in circles).
const MAX_REDIRECTS: usize = 3;
/// The longest leader address a node's answer may name.
const MAX_ADDR_LEN: usize = 256;

/// `first`, then each of `e`'s sources: tonic's own words end at "transport error", and a
/// server that refuses our certificate (or speaks TLS to our plain text) shows only there.
fn with_sources(first: String, e: &dyn std::error::Error) -> String {
    let mut detail = first;
    let mut src = e.source();
    while let Some(s) = src {
        detail = format!("{detail}: {s}");
        src = s.source();
    }
    detail
}

fn status_error(e: tonic::Status) -> ConsensusError {
    let detail = with_sources(e.message().to_string(), &e);
    let meta = |key: &str| e.metadata().get(key).and_then(|v| v.to_str().ok()).map(str::to_string);
    match e.code() {
        tonic::Code::Aborted => {
            let leader = meta(crate::error::LEADER_ID).and_then(|v| v.parse().ok());
            let addr = meta(crate::error::LEADER_ADDR).filter(|a| !a.is_empty() && a.len() <= MAX_ADDR_LEN);
            match (leader, addr) {
                (Some(leader), Some(addr)) => ConsensusError::NotLeader { me: 0, leader, addr },
                // The node's own words, when it names no leader to go to.
                _ => ConsensusError::Transport(format!("Aborted: {detail}")),
            }
        }
        tonic::Code::FailedPrecondition => ConsensusError::Rejected(detail),
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => ConsensusError::Denied(detail),
        // The node's own words say what timed out and for how long.
        tonic::Code::DeadlineExceeded | tonic::Code::Unavailable => ConsensusError::Transport(detail),
        code => ConsensusError::Transport(format!("{code:?}: {detail}")),
    }
}

async fn connect_channel(
    addr: &str,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<tonic::transport::Channel> {
    endpoint_tls(addr, tls)?.connect().await.map_err(|e| {
        ConsensusError::Transport(format!("cannot reach {addr}: {}", with_sources(e.to_string(), &e)))
    })
}

impl Client {
    /// Connects to a node at `addr` (`host:port`) of cluster `cluster` in plain text.
    pub async fn connect(addr: &str, cluster: &str) -> Result<Client> {
        Client::connect_with(addr, cluster, None).await
    }

    /// Connects with mutual TLS when `tls` is given (the cluster runs with certificates).
    pub async fn connect_with(addr: &str, cluster: &str, tls: Option<&Tls>) -> Result<Client> {
        let pinned = tls.and_then(pinned_config);
        let tls = tls.map(Tls::grpc_client);
        let channel = connect_channel(addr, tls.clone()).await?;
        Ok(Client {
            cluster_id: crate::state::cluster_id(cluster),
            cluster: cluster.to_string(),
            inner: client(channel),
            tls,
            pinned,
        })
    }

    /// Asks the node at `addr` which cluster it serves (a status read that names no
    /// cluster), and returns a client for that cluster with its name.
    pub async fn learn_cluster(addr: &str, tls: Option<&Tls>) -> Result<(Client, String)> {
        let mut c = Client::connect_with(addr, "", tls).await?;
        c.cluster_id = 0;
        let r = c
            .inner
            .status(pb::StatusRequest { cluster_id: 0, cluster: String::new() })
            .await
            .map_err(status_error)?;
        let name = r.into_inner().cluster;
        if name.is_empty() {
            return Err(ConsensusError::Decode {
                what: "status reply",
                detail: "it names no cluster".into(),
            });
        }
        c.cluster_id = crate::state::cluster_id(&name);
        c.cluster = name.clone();
        Ok((c, name))
    }

    /// Proposes a command and waits until the node applied it; returns its log index and
    /// what the state machine said.
    pub async fn propose(&mut self, command: &Command, timeout: Duration) -> Result<(u64, String)> {
        let req = pb::ProposeRequest {
            cluster_id: self.cluster_id,
            cluster: self.cluster.clone(),
            command: serde_json::to_vec(command).expect("commands serialize"),
            timeout_ms: timeout.as_millis() as u64,
        };
        // The node answers within `timeout`; a node that never answers (wedged, or a peer
        // that drops packets) must not hold the caller longer than that and a margin.
        let waited = timeout + Duration::from_secs(2);
        // Proposals are made at the leader (where the caller's certificate is checked): a
        // node that does not lead says where the leader is, and the client goes there.
        // The redirect's channel serves this proposal only: the client stays with the node it
        // was made for (a leader it was sent to may be gone by the next call). The answer
        // names the leader, so the redirect must reach that node's certificate: an address
        // that is another node's (stale, or planted) is refused. A hostile first hop can
        // still name itself or an accomplice as the leader; a client without a certificate
        // of its own follows redirects unpinned.
        let mut redirects = 0;
        let mut at = self.inner.clone();
        let reply = loop {
            let answer = tokio::time::timeout(waited, at.propose(req.clone()))
                .await
                .map_err(|_| ConsensusError::Timeout { waited, what: "the node to answer a proposal" })?
                .map_err(status_error);
            match answer {
                Err(ConsensusError::NotLeader { addr, leader, .. })
                    if !addr.is_empty() && redirects < MAX_REDIRECTS =>
                {
                    redirects += 1;
                    at = match &self.pinned {
                        Some(cfg) => connect_pinned_with(&addr, Arc::clone(cfg), leader),
                        None => client(connect_channel(&addr, self.tls.clone()).await?),
                    };
                }
                answer => break answer?.into_inner(),
            }
        };
        if reply.accepted {
            Ok((reply.index, reply.detail))
        } else {
            Err(ConsensusError::Rejected(reply.detail))
        }
    }

    /// Reads the cluster state, linearizable or from the node's own copy.
    pub async fn read(&mut self, linearizable: bool) -> Result<ReadResult> {
        let req =
            pb::ReadRequest { cluster_id: self.cluster_id, linearizable, cluster: self.cluster.clone() };
        let r = self.inner.read(req).await.map_err(status_error)?.into_inner();
        let state = serde_json::from_slice(&r.state)
            .map_err(|e| ConsensusError::Decode { what: "cluster state", detail: e.to_string() })?;
        Ok(ReadResult {
            state,
            applied_index: r.applied_index,
            linearizable: r.linearizable,
            leader: r.leader,
            term: r.term,
        })
    }

    /// The node's own view.
    pub async fn status(&mut self) -> Result<NodeStatus> {
        let r = self
            .inner
            .status(pb::StatusRequest { cluster_id: self.cluster_id, cluster: self.cluster.clone() })
            .await
            .map_err(status_error)?;
        serde_json::from_slice(&r.into_inner().status)
            .map_err(|e| ConsensusError::Decode { what: "node status", detail: e.to_string() })
    }

    /// Sends this agent's heartbeat report (`urgent`: at once, after a collective failure).
    pub async fn heartbeat(&mut self, from: NodeId, report: Vec<u8>, urgent: bool) -> Result<()> {
        let req = pb::HeartbeatRequest {
            cluster_id: self.cluster_id,
            from,
            report,
            cluster: self.cluster.clone(),
            urgent,
        };
        count_control_bytes(true, "report", prost::Message::encoded_len(&req));
        self.inner.heartbeat(req).await.map_err(status_error)?;
        Ok(())
    }

    /// Every heartbeat report the node holds.
    pub async fn reports(&mut self) -> Result<Vec<NodeReport>> {
        let r = self
            .inner
            .reports(pb::ReportsRequest { cluster_id: self.cluster_id, cluster: self.cluster.clone() })
            .await
            .map_err(status_error)?
            .into_inner();
        Ok(r.reports
            .into_iter()
            .map(|r| NodeReport { node: r.node, age: Duration::from_millis(r.age_ms), report: r.report })
            .collect())
    }
}

/// One agent's latest report as it arrived at this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeReport {
    /// Who sent it.
    pub node: NodeId,
    /// How long ago it arrived (this node's clock only).
    pub age: std::time::Duration,
    /// The report, opaque to consensus.
    pub report: Vec<u8>,
}

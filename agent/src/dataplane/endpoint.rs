//! One agent's data-plane listener and the handshake every connection passes.
//!
//! Handshake (all records fixed-size):
//! 1. the connector sends `Hello {cluster, node, epoch, channel, nonce_c}`;
//! 2. the acceptor checks cluster and epoch and answers `[0, nonce_s]`, or `[code]` and
//!    closes (1: other cluster, 2: stale epoch);
//! 3. the connector sends `HMAC(secret, "client" || hello || nonce_s)`;
//! 4. the acceptor verifies it and answers `[0, HMAC(secret, "server" || hello || nonce_s ||
//!    acceptor id)]`, or `[3]` and closes; the connector verifies the acceptor's proof in turn
//!    against the id of the node it meant to reach, so a member that knows the secret cannot
//!    answer for another.
//!
//! When the cluster runs with certificates, a TLS 1.3 handshake (both sides presenting node
//! certificates of the cluster CA) comes first and everything above runs inside it, so every
//! frame is encrypted and authenticated as well; each side's certificate must be bound to the
//! node id it speaks as (the hello's id, and the id the connector dialled), else `[4]`.
//!
//! Handshakes are bounded: at most `MAX_HANDSHAKES` run at once (more are closed at once),
//! each within one deadline for all its reads and writes, and at most `MAX_INBOX` accepted
//! connections wait to be taken (`MAX_INBOX_PER_PEER` from any one peer).
//!
//! Only then does the connection carry frames. Accepted connections wait in an inbox keyed by
//! (epoch, peer, channel) until a `Group` (or the handoff) takes them.

use crate::dataplane::conn::{Conn, DataTls};
use crate::dataplane::frame::{Channel, Hello, HELLO_LEN};
use crate::dataplane::DataPlaneError;
use hmac::{KeyInit, Mac};
use rand::RngCore;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// How an agent's data plane is set up.
#[derive(Clone)]
pub struct DataPlaneConfig {
    /// The cluster's id (the hash of its name).
    pub cluster_id: u64,
    /// This node.
    pub node: u64,
    /// The shared cluster secret (at least 16 bytes).
    pub secret: Vec<u8>,
    /// A collective or handshake that makes no progress for this long fails.
    pub timeout: Duration,
    /// Bytes per frame of a collective (the pipelining grain).
    pub chunk_bytes: usize,
    /// TLS for every connection, when the cluster runs with certificates.
    pub tls: Option<DataTls>,
    /// TCP congestion control of every data-plane socket (`None`: the host's default).
    pub congestion: Option<String>,
    /// Groups of at least this many ranks connect a butterfly, over which small collectives
    /// take log2(W) rounds instead of the ring's 2(W-1) hops (`ring/tree.rs`); smaller ones
    /// use the ring for everything. `usize::MAX` keeps every group on the ring.
    pub tree_min_world: usize,
}

/// Groups from this many ranks take small collectives over a butterfly: below it the ring's
/// 2(W-1) hops are few (14 at 8) and its connections the only ones a group makes.
pub const DEFAULT_TREE_MIN_WORLD: usize = 8;

/// The congestion control data-plane sockets use unless configured otherwise. Pacing
/// algorithms (bbr, the default on many hosts) pace every socket with kernel timers when the
/// interface has no fq qdisc; on a bulk, synchronous, in-datacenter transfer that costs CPU
/// the same cores need for summing gradients: on loopback, reno's ring allreduce took 0.68x
/// to 0.73x of bbr's time at 64 MB (see docs/dataplane.md). reno is always allowed to
/// unprivileged processes, unlike cubic.
pub const DEFAULT_CONGESTION: &str = "reno";

/// Checks a congestion-control name the way the kernel will take it (`TCP_CA_NAME_MAX` is 16
/// bytes with the NUL).
pub fn check_congestion(name: &str) -> Result<(), BadCongestion> {
    let bad = |why: &str| Err(BadCongestion { name: name.to_string(), why: why.to_string() });
    if name.is_empty() || name.len() > 15 {
        return bad("must have 1 to 15 characters");
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return bad("may hold only a-z, 0-9 and _");
    }
    Ok(())
}

/// A congestion-control name the kernel would not take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("congestion control {name:?} {why}")]
pub struct BadCongestion {
    /// The name given.
    pub name: String,
    /// What is wrong with it.
    pub why: String,
}

/// A configured congestion control as the data plane takes it: `system` keeps the host's
/// default (`None`), anything else must be a valid name.
pub fn parse_congestion(name: &str) -> Result<Option<String>, BadCongestion> {
    if name == "system" {
        return Ok(None);
    }
    check_congestion(name).map_err(|e| BadCongestion {
        why: format!("{} (or \"system\" for the host's default)", e.why),
        ..e
    })?;
    Ok(Some(name.to_string()))
}

/// The host's default TCP congestion control, as the kernel reports it.
pub fn host_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_string())
}

impl DataPlaneConfig {
    /// Defaults: 5 s timeout, 2 MiB chunks (measured best of 0.5, 2 and 8 MiB on loopback).
    pub fn new(cluster_id: u64, node: u64, secret: Vec<u8>) -> DataPlaneConfig {
        DataPlaneConfig {
            cluster_id,
            node,
            secret,
            timeout: Duration::from_secs(5),
            chunk_bytes: 2 << 20,
            tls: None,
            congestion: Some(DEFAULT_CONGESTION.to_string()),
            tree_min_world: DEFAULT_TREE_MIN_WORLD,
        }
    }

    fn validate(&self) -> Result<(), DataPlaneError> {
        if self.secret.len() < 16 {
            return Err(DataPlaneError::Config(format!(
                "the cluster secret has {} bytes; at least 16 are needed",
                self.secret.len()
            )));
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes > crate::dataplane::frame::MAX_PAYLOAD as usize {
            return Err(DataPlaneError::Config(format!("chunk size {} out of range", self.chunk_bytes)));
        }
        if self.timeout.is_zero() {
            return Err(DataPlaneError::Config("timeout must be positive".into()));
        }
        if let Some(cc) = &self.congestion {
            check_congestion(cc).map_err(|e| DataPlaneError::Config(e.to_string()))?;
        }
        Ok(())
    }
}

type InboxKey = (u64, u64, Channel);

/// Handshakes running at once; a connection past this is closed unanswered. Each holds a
/// thread for at most the handshake deadline, so a flood costs bounded threads and time.
pub const MAX_HANDSHAKES: usize = 64;
/// Accepted connections waiting for a group or the handoff to take them.
pub const MAX_INBOX: usize = 256;
/// Of those, from any one peer (a ring and its lanes, or a ring and a pipe with its lanes: a
/// peer neighbours this host in a stage's replicas or in a replica's stages, not both; and
/// a few handoff streams per epoch, for an epoch or two ahead).
pub const MAX_INBOX_PER_PEER: usize = 16 + crate::dataplane::frame::MAX_LANES - 1;
/// The longest a handshake may take, whatever the collective timeout.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

struct Shared {
    cfg: DataPlaneConfig,
    /// Handshakes in progress.
    handshakes: std::sync::atomic::AtomicUsize,
    /// When (ms since the endpoint started) a refusal at the cap was last logged.
    cap_warned: AtomicU64,
    started: Instant,
    min_epoch: AtomicU64,
    inbox: Mutex<HashMap<InboxKey, Conn>>,
    arrived: Condvar,
    stop: AtomicBool,
    /// Whether setting the congestion control has failed (warned about once).
    congestion_failed: AtomicBool,
    /// Fingerprints of the certificates the cluster revoked (refused at every TLS handshake).
    revoked: std::sync::RwLock<std::collections::HashSet<String>>,
    /// Peers whose data port refused a connection, and when (cleared by one that succeeds).
    refused: Mutex<HashMap<u64, Instant>>,
    /// Where handshake threads run.
    threads: Arc<dyn Threads>,
}

/// Where an endpoint's threads run: plain threads when it is used alone (benchmarks,
/// tests), the agent's shutdown path in limpetd (`Tasks`), where a panic in one is fatal
/// and named like anywhere else.
pub trait Threads: Send + Sync {
    /// A thread its owner joins: the accept loop, which ends when the endpoint drops.
    fn joinable(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<JoinHandle<()>>;
    /// A thread nobody waits for: one handshake, bounded by its own time limit.
    fn detached(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()>;
}

/// Plain named threads.
pub struct PlainThreads;

impl Threads for PlainThreads {
    fn joinable(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new().name(format!("limpet-{name}")).spawn(f)
    }

    fn detached(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
        self.joinable(name, f).map(drop)
    }
}

impl Threads for limpet_consensus::tasks::Tasks {
    fn joinable(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<JoinHandle<()>> {
        self.spawn_joinable_thread(name, f)
    }

    fn detached(&self, name: &'static str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
        self.spawn_detached_thread(name, f)
    }
}

impl Shared {
    /// Whether the TLS peer's certificate is one the cluster revoked.
    fn is_revoked(&self, conn: &Conn) -> bool {
        let revoked = self.revoked.read().expect("revoked lock");
        !revoked.is_empty() && conn.peer_fingerprint().is_some_and(|f| revoked.contains(&f))
    }
}

impl Shared {
    /// What every data-plane socket gets before its first byte: no Nagle delay (frames are
    /// written whole) and the configured congestion control. A host that refuses the latter
    /// (not in `net.ipv4.tcp_allowed_congestion_control`) keeps its default, with one warning.
    fn tune(&self, stream: &TcpStream) -> Result<(), DataPlaneError> {
        stream.set_nodelay(true).map_err(DataPlaneError::io("setting TCP_NODELAY"))?;
        if let Some(cc) = &self.cfg.congestion {
            let name = std::ffi::OsString::from(cc);
            if let Err(e) =
                nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::TcpCongestion, &name)
            {
                if !self.congestion_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        node = self.cfg.node,
                        congestion = %cc,
                        %e,
                        "the host refused the data plane's TCP congestion control; its default is kept \
                         (see net.ipv4.tcp_allowed_congestion_control)"
                    );
                }
            }
        }
        Ok(())
    }
}

/// The congestion control a socket uses.
pub fn congestion_of(fd: &impl std::os::fd::AsFd) -> std::io::Result<String> {
    let name = nix::sys::socket::getsockopt(fd, nix::sys::socket::sockopt::TcpCongestion)?;
    Ok(name.to_string_lossy().trim_end_matches('\0').to_string())
}

/// An agent's data-plane endpoint: a listener thread and the connections it accepted.
pub struct Endpoint {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The accept thread, joined on drop so the port is free once the endpoint is gone.
    acceptor: Mutex<Option<std::thread::JoinHandle<()>>>,
}

const REFUSED_CLUSTER: u8 = 1;
const REFUSED_EPOCH: u8 = 2;
const REFUSED_PROOF: u8 = 3;
const REFUSED_IDENTITY: u8 = 4;

fn proof(secret: &[u8], role: &[u8], hello: &[u8], nonce: &[u8], server: u64) -> HmacSha256 {
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"limpet data plane v2 ");
    mac.update(role);
    mac.update(hello);
    mac.update(nonce);
    mac.update(&server.to_le_bytes());
    mac
}

impl Endpoint {
    /// Binds `addr` (port 0 picks one) and starts accepting, on plain threads.
    pub fn bind(addr: SocketAddr, cfg: DataPlaneConfig) -> Result<Endpoint, DataPlaneError> {
        Endpoint::bind_with(addr, cfg, Arc::new(PlainThreads))
    }

    /// Binds `addr` and starts accepting, its threads started by `threads`.
    pub fn bind_with(
        addr: SocketAddr,
        cfg: DataPlaneConfig,
        threads: Arc<dyn Threads>,
    ) -> Result<Endpoint, DataPlaneError> {
        cfg.validate()?;
        let listener = TcpListener::bind(addr).map_err(DataPlaneError::io(format!("binding {addr}")))?;
        let addr = listener.local_addr().map_err(DataPlaneError::io("reading the bound address"))?;
        let shared = Arc::new(Shared {
            cfg,
            handshakes: std::sync::atomic::AtomicUsize::new(0),
            cap_warned: AtomicU64::new(0),
            started: Instant::now(),
            min_epoch: AtomicU64::new(0),
            inbox: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            stop: AtomicBool::new(false),
            congestion_failed: AtomicBool::new(false),
            revoked: Default::default(),
            refused: Default::default(),
            threads: Arc::clone(&threads),
        });
        let accept = Arc::clone(&shared);
        let acceptor = threads
            .joinable("dp-accept", Box::new(move || accept_loop(listener, accept)))
            .map_err(DataPlaneError::io("starting the accept thread"))?;
        Ok(Endpoint { shared, addr, acceptor: Mutex::new(Some(acceptor)) })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This endpoint's configuration.
    pub fn config(&self) -> &DataPlaneConfig {
        &self.shared.cfg
    }

    /// The fingerprints of the certificates the cluster revoked: refused at every TLS
    /// handshake from now on, in both directions.
    pub fn set_revoked(&self, fingerprints: std::collections::HashSet<String>) {
        *self.shared.revoked.write().expect("revoked lock") = fingerprints;
    }

    /// Peers whose data port refused this endpoint's connection within `within`, none
    /// accepted since: nothing listened there, as where a process died (a peer still starting
    /// refuses too: what it is, the leader's own probe tells).
    pub fn refused_lately(&self, within: Duration) -> Vec<u64> {
        let mut refused = self.shared.refused.lock().expect("refused lock");
        refused.retain(|_, at| at.elapsed() <= within);
        let mut out: Vec<u64> = refused.keys().copied().collect();
        out.sort_unstable();
        out
    }

    /// Refuses connections for epochs before `epoch` from now on and drops queued ones.
    pub fn set_min_epoch(&self, epoch: u64) {
        self.shared.min_epoch.fetch_max(epoch, Ordering::SeqCst);
        let mut inbox = self.shared.inbox.lock().expect("inbox lock");
        inbox.retain(|(e, _, _), _| *e >= epoch);
    }

    /// Connects to `peer` at `addr` for `epoch`, retrying refused connections until the
    /// timeout (the peer may still be starting), and runs the handshake.
    pub fn connect(
        &self,
        addr: &str,
        peer: u64,
        epoch: u64,
        channel: Channel,
    ) -> Result<Conn, DataPlaneError> {
        self.connect_until(addr, peer, epoch, channel, Instant::now() + self.shared.cfg.timeout, &|| false)
    }

    /// Like `connect`, retrying a refused connection until `deadline` unless `abort` says
    /// to stop (a peer that is gone for good never starts listening again).
    pub fn connect_until(
        &self,
        addr: &str,
        peer: u64,
        epoch: u64,
        channel: Channel,
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<Conn, DataPlaneError> {
        let cfg = &self.shared.cfg;
        let stream = loop {
            // A vanished spot host's address drops SYNs: without a limit, connect blocks for
            // the kernel's ~2 minutes of retries.
            let limit = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(50), cfg.timeout);
            let attempt = std::net::ToSocketAddrs::to_socket_addrs(addr)
                .and_then(|mut a| {
                    a.next().ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))
                })
                .and_then(|a| TcpStream::connect_timeout(&a, limit));
            if let Err(e) = &attempt {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    self.shared.refused.lock().expect("refused lock").insert(peer, Instant::now());
                }
            }
            match attempt {
                Ok(s) => {
                    self.shared.refused.lock().expect("refused lock").remove(&peer);
                    break s;
                }
                Err(e) if Instant::now() < deadline && !abort() => {
                    tracing::trace!(peer, addr, %e, "connect retry");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(DataPlaneError::Io {
                        what: format!("connecting to node {peer} at {addr}"),
                        source: e,
                    })
                }
            }
        };
        self.shared.tune(&stream)?;
        let conn = match &cfg.tls {
            Some(tls) => {
                let c = Conn::tls_client(stream, tls.client.clone(), cfg.timeout.min(HANDSHAKE_LIMIT))
                    .map_err(|e| {
                        DataPlaneError::Refused(format!("TLS handshake with node {peer} at {addr}: {e}"))
                    })?;
                if self.shared.is_revoked(&c) {
                    return Err(DataPlaneError::Refused(format!(
                        "{addr} (node {peer}) holds a revoked certificate"
                    )));
                }
                match c.peer_node() {
                    Some(id) if id == peer => c,
                    other => {
                        return Err(DataPlaneError::Refused(format!(
                            "{addr} was to be node {peer}, but its certificate is {}",
                            other.map_or("no node's".into(), |id| format!("node {id}'s"))
                        )))
                    }
                }
            }
            None => Conn::plain(stream),
        };
        client_handshake(&conn, cfg, epoch, channel, peer)?;
        Ok(conn)
    }

    /// Waits for the authenticated connection from `peer` for `epoch` on `channel`.
    pub fn accept_from(&self, peer: u64, epoch: u64, channel: Channel) -> Result<Conn, DataPlaneError> {
        self.accept_until(peer, epoch, channel, Instant::now() + self.shared.cfg.timeout, &|| false)
    }

    /// Like `accept_from`, waiting until `deadline` and giving up early when `abort` says so
    /// (checked every 50 ms): a rank that enters an epoch early waits for its peers to reach
    /// the boundary, but not for an epoch that was withdrawn or replaced meanwhile.
    pub fn accept_until(
        &self,
        peer: u64,
        epoch: u64,
        channel: Channel,
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<Conn, DataPlaneError> {
        let started = Instant::now();
        let mut inbox = self.shared.inbox.lock().expect("inbox lock");
        loop {
            if let Some(s) = inbox.remove(&(epoch, peer, channel)) {
                return Ok(s);
            }
            let now = Instant::now();
            if now >= deadline || abort() {
                return Err(DataPlaneError::Timeout {
                    peer,
                    waited: now - started,
                    during: format!("waiting for node {peer} to connect for epoch {epoch}"),
                });
            }
            let slice = (deadline - now).min(Duration::from_millis(50));
            inbox = self.shared.arrived.wait_timeout(inbox, slice).expect("inbox lock").0;
        }
    }

    /// Waits for any authenticated connection on `channel` (of any epoch still accepted) and
    /// returns the peer it came from; `None` after `wait` without one.
    pub fn accept_channel(&self, channel: Channel, wait: Duration) -> Option<(u64, Conn)> {
        let deadline = Instant::now() + wait;
        let mut inbox = self.shared.inbox.lock().expect("inbox lock");
        loop {
            let key = inbox.keys().find(|(_, _, c)| *c == channel).copied();
            if let Some(key) = key {
                return inbox.remove(&key).map(|s| (key.1, s));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            inbox = self.shared.arrived.wait_timeout(inbox, deadline - now).expect("inbox lock").0;
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag, and wait for it to close the listener
        // (only if the wake-up got through: otherwise the loop may not return soon).
        let woke = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100)).is_ok();
        let acceptor = self.acceptor.get_mut().map(Option::take).unwrap_or(None);
        if let (true, Some(t)) = (woke, acceptor) {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        if shared.handshakes.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
            shared.handshakes.fetch_sub(1, Ordering::SeqCst);
            shared.warn_at_cap(&stream);
            continue;
        }
        let shared = Arc::clone(&shared);
        let counted = Arc::clone(&shared);
        // Each handshake on its own thread: a slow or hostile peer cannot stall the others.
        let threads = Arc::clone(&shared.threads);
        let node = shared.cfg.node;
        let spawned = threads.detached("dp-hs", Box::new(move || {
            // A handshake reads an unauthenticated peer's bytes: a panic there (a bug) ends
            // that connection, logged, and never the node a hostile peer could stop with it.
            let handshake = move || {
                let _done = Finished(&shared.handshakes);
                let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                if let Err(e) = shared.tune(&stream) {
                    tracing::warn!(node = shared.cfg.node, peer, %e, "data-plane connection dropped");
                    return;
                }
                let deadline = Instant::now() + shared.cfg.timeout.min(HANDSHAKE_LIMIT);
                let conn = match &shared.cfg.tls {
                    Some(tls) => match Conn::tls_server(
                        stream,
                        tls.server.clone(),
                        shared.cfg.timeout.min(HANDSHAKE_LIMIT),
                    ) {
                        Ok(c) if shared.is_revoked(&c) => {
                            tracing::warn!(
                                node = shared.cfg.node,
                                peer,
                                "data-plane connection refused: a revoked certificate"
                            );
                            return;
                        }
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!(node = shared.cfg.node, peer, %e, "data-plane TLS handshake refused");
                            return;
                        }
                    },
                    None => Conn::plain(stream),
                };
                match server_handshake(&conn, &shared, deadline) {
                    Ok(hello) => {
                        let mut inbox = shared.inbox.lock().expect("inbox lock");
                        let key = (hello.epoch, hello.node, hello.channel);
                        // Each peer has its own share, so one member (its id bound to its
                        // certificate) cannot crowd out the others' connections.
                        let theirs = inbox.keys().filter(|k| k.1 == hello.node).count();
                        if !inbox.contains_key(&key) && (inbox.len() >= MAX_INBOX || theirs >= MAX_INBOX_PER_PEER)
                        {
                            tracing::warn!(
                                node = shared.cfg.node,
                                peer,
                                from = hello.node,
                                "data-plane inbox full; connection dropped"
                            );
                            return;
                        }
                        inbox.insert(key, conn);
                        shared.arrived.notify_all();
                    }
                    Err(e) => tracing::warn!(node = shared.cfg.node, peer, %e, "data-plane connection refused"),
                }
            };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(handshake)).is_err() {
                tracing::error!(node, "a data-plane handshake panicked (a bug); its connection is dropped");
            }
        }));
        if spawned.is_err() {
            counted.handshakes.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Counts a handshake thread out however it ends.
struct Finished<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    /// Logs a connection closed at the handshake cap, at most once every 5 s.
    fn warn_at_cap(&self, stream: &TcpStream) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.cap_warned.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= 5000)
            && self
                .cap_warned
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            tracing::warn!(
                node = self.cfg.node,
                peer,
                limit = MAX_HANDSHAKES,
                "data-plane handshakes at their limit; connections closed unanswered"
            );
        }
    }
}

fn read_exact(s: &Conn, buf: &mut [u8], what: &str) -> Result<(), DataPlaneError> {
    (&*s).read_exact(buf).map_err(DataPlaneError::io(what))
}

/// `read_exact` that gives up at `deadline` however the bytes trickle in.
fn read_by(s: &Conn, buf: &mut [u8], deadline: Instant, what: &str) -> Result<(), DataPlaneError> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DataPlaneError::Refused(format!("{what}: the handshake took too long")));
        }
        s.set_read_timeout(Some(left)).map_err(DataPlaneError::io("setting a read timeout"))?;
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => {
                return Err(DataPlaneError::io(what)(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(DataPlaneError::io(what)(e)),
        }
    }
    Ok(())
}

fn write_all(s: &Conn, buf: &[u8], what: &str) -> Result<(), DataPlaneError> {
    (&*s).write_all(buf).map_err(DataPlaneError::io(what))
}

fn server_handshake(s: &Conn, shared: &Shared, deadline: Instant) -> Result<Hello, DataPlaneError> {
    let cfg = &shared.cfg;
    s.set_write_timeout(Some(cfg.timeout)).map_err(DataPlaneError::io("setting a write timeout"))?;
    let mut raw = [0u8; HELLO_LEN];
    read_by(s, &mut raw, deadline, "reading the hello")?;
    let hello = Hello::decode(&raw)?;
    if s.is_tls() && s.peer_node() != Some(hello.node) {
        let _ = write_all(s, &[REFUSED_IDENTITY], "refusing");
        return Err(DataPlaneError::Refused(format!(
            "a hello as node {} over node {}'s certificate",
            hello.node,
            s.peer_node().unwrap_or(0)
        )));
    }
    if hello.cluster_id != cfg.cluster_id {
        let _ = write_all(s, &[REFUSED_CLUSTER], "refusing");
        return Err(DataPlaneError::Refused(format!(
            "node {} belongs to cluster {:#018x}, not {:#018x}",
            hello.node, hello.cluster_id, cfg.cluster_id
        )));
    }
    let min = shared.min_epoch.load(Ordering::SeqCst);
    if hello.epoch < min {
        let _ = write_all(s, &[REFUSED_EPOCH], "refusing");
        return Err(DataPlaneError::Refused(format!(
            "node {} speaks epoch {}, older than epoch {min}",
            hello.node, hello.epoch
        )));
    }
    let mut nonce = [0u8; 16];
    rand::rng().fill_bytes(&mut nonce);
    let mut challenge = [0u8; 17];
    challenge[1..].copy_from_slice(&nonce);
    write_all(s, &challenge, "sending the challenge")?;
    let mut client_mac = [0u8; 32];
    read_by(s, &mut client_mac, deadline, "reading the client's proof")?;
    if proof(&cfg.secret, b"client", &raw, &nonce, cfg.node).verify_slice(&client_mac).is_err() {
        let _ = write_all(s, &[REFUSED_PROOF], "refusing");
        return Err(DataPlaneError::Refused(format!("node {} does not know the cluster secret", hello.node)));
    }
    let mut reply = [0u8; 33];
    reply[1..]
        .copy_from_slice(&proof(&cfg.secret, b"server", &raw, &nonce, cfg.node).finalize().into_bytes());
    write_all(s, &reply, "sending the server's proof")?;
    s.set_read_timeout(None).map_err(DataPlaneError::io("clearing the read timeout"))?;
    s.set_write_timeout(None).map_err(DataPlaneError::io("clearing the write timeout"))?;
    Ok(hello)
}

fn refusal(code: u8, peer: u64) -> DataPlaneError {
    DataPlaneError::Refused(match code {
        REFUSED_CLUSTER => format!("node {peer} serves another cluster"),
        REFUSED_EPOCH => format!("node {peer} is past this epoch"),
        REFUSED_PROOF => {
            format!("node {peer} rejected our proof (different cluster secret, or not node {peer}?)")
        }
        REFUSED_IDENTITY => format!("node {peer} refused us: our certificate is not the node we speak as"),
        c => format!("node {peer} answered with unknown code {c}"),
    })
}

fn client_handshake(
    s: &Conn,
    cfg: &DataPlaneConfig,
    epoch: u64,
    channel: Channel,
    peer: u64,
) -> Result<(), DataPlaneError> {
    s.set_read_timeout(Some(cfg.timeout)).map_err(DataPlaneError::io("setting a read timeout"))?;
    let mut nonce = [0u8; 16];
    rand::rng().fill_bytes(&mut nonce);
    let hello = Hello { cluster_id: cfg.cluster_id, node: cfg.node, epoch, channel, nonce }.encode();
    write_all(s, &hello, "sending the hello")?;
    let mut code = [0u8; 1];
    read_exact(s, &mut code, "reading the challenge").map_err(|e| match e {
        // In TLS 1.3 the server checks our certificate after we think the handshake is
        // done: its refusal arrives here, as an alert.
        DataPlaneError::Io { source, .. } if source.kind() == std::io::ErrorKind::InvalidData => {
            DataPlaneError::Refused(format!("node {peer} refused the TLS session: {source}"))
        }
        _ => refusal(255, peer),
    })?;
    if code[0] != 0 {
        return Err(refusal(code[0], peer));
    }
    let mut server_nonce = [0u8; 16];
    read_exact(s, &mut server_nonce, "reading the challenge")?;
    let mac = proof(&cfg.secret, b"client", &hello, &server_nonce, peer).finalize().into_bytes();
    write_all(s, &mac, "sending our proof")?;
    read_exact(s, &mut code, "reading the verdict").map_err(|_| refusal(REFUSED_PROOF, peer))?;
    if code[0] != 0 {
        return Err(refusal(code[0], peer));
    }
    let mut server_mac = [0u8; 32];
    read_exact(s, &mut server_mac, "reading the server's proof")?;
    if proof(&cfg.secret, b"server", &hello, &server_nonce, peer).verify_slice(&server_mac).is_err() {
        return Err(DataPlaneError::Refused(format!(
            "the node at node {peer}'s address does not know the cluster secret, or is not node {peer}"
        )));
    }
    s.set_read_timeout(None).map_err(DataPlaneError::io("clearing the read timeout"))?;
    Ok(())
}

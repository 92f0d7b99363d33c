//! State handoff over the data plane: the snapshot crate's handoff protocol on connections
//! that passed the cluster-secret handshake (channel `Handoff`), so a newcomer only takes
//! state from a member and a member only serves state to one.

use crate::dataplane::conn::Conn;
use crate::dataplane::endpoint::Endpoint;
use crate::dataplane::frame::Channel;
use limpet_snapshot::handoff::{Dialer, Server};
use std::sync::Arc;
use std::time::Duration;

/// Dials handoff sources as `NODE@HOST:PORT` through the endpoint's handshake.
pub struct HandoffDialer<'a> {
    /// This node's endpoint.
    pub endpoint: &'a Endpoint,
    /// The epoch the transfer belongs to.
    pub epoch: u64,
}

impl Dialer for HandoffDialer<'_> {
    type Stream = Conn;

    fn dial(&self, source: &str) -> std::io::Result<Conn> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        let (node, addr) =
            source.split_once('@').ok_or_else(|| bad(format!("source {source:?} is not NODE@ADDR")))?;
        let node: u64 = node.parse().map_err(|_| bad(format!("source {source:?}: bad node id")))?;
        let s = self
            .endpoint
            .connect(addr, node, self.epoch, Channel::Handoff)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::ConnectionRefused, e.to_string()))?;
        s.set_read_timeout(Some(self.endpoint.config().timeout))?;
        Ok(s)
    }
}

/// Who may fetch state: a node id's verdict (the agent answers from the replicated state).
pub type MayFetch = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// The most handoff requests served at once; more wait their turn in a queue (first come,
/// first served) rather than fail the fetch. Several newcomers at an epoch change, each
/// fetching in a few streams, and shadows.
pub const MAX_HANDOFF_SERVES: usize = 32;
/// Of those, from any one peer (its fetch's streams and a shadow's).
pub const MAX_HANDOFF_SERVES_PER_PEER: usize = 8;
/// Requests waiting for a slot; past this, new ones are closed unanswered (the fetching side
/// tries its next source). A wave of a hundred joiners fits.
pub const MAX_HANDOFF_QUEUED: usize = 512;

/// Serves `server`'s offers on every authenticated handoff connection the endpoint accepts
/// from a peer `may_fetch` admits, one thread per connection (at most
/// [`MAX_HANDOFF_SERVES`]), until `stop` is set, on threads of its own (tests and the lab; the
/// agent runs [`handoff_loop`] under its `Tasks`).
#[cfg(feature = "lab")]
pub fn serve_handoff(
    endpoint: Arc<Endpoint>,
    server: Server,
    stop: Arc<std::sync::atomic::AtomicBool>,
    may_fetch: MayFetch,
) -> std::thread::JoinHandle<()> {
    let spawn = |name: &'static str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new().name(format!("limpet-{name}")).spawn(f).map(drop)
    };
    std::thread::spawn(move || {
        handoff_loop(
            &endpoint,
            &server,
            &|| stop.load(std::sync::atomic::Ordering::SeqCst),
            &may_fetch,
            &spawn,
        )
    })
}

/// Starts a named thread (the agent's `Tasks::spawn_detached_thread`: a panic fatal).
pub type Spawn<'a> = dyn Fn(&'static str, Box<dyn FnOnce() + Send>) -> std::io::Result<()> + 'a;

/// Serves handoff requests on the calling thread until `stop` says so (each request on a
/// thread of its own, at most [`MAX_HANDOFF_SERVES`] at once and the rest queued, each read and write bounded by
/// the endpoint's timeout), to peers `may_fetch` admits (current members: a removed node's
/// certificate, or the secret alone, must not read the weights). `spawn` starts each
/// request's thread.
pub fn handoff_loop(
    endpoint: &Endpoint,
    server: &Server,
    stop: &dyn Fn() -> bool,
    may_fetch: &MayFetch,
    spawn: &Spawn,
) {
    let serving: Serving = Arc::default();
    let timeout = endpoint.config().timeout;
    // Requests past the caps, oldest first, with when they arrived: one whose fetcher has
    // given up (its read timeout passed) is dropped instead of served.
    let mut waiting: std::collections::VecDeque<(u64, Conn, std::time::Instant)> = Default::default();
    while !stop() {
        // Past half the fetcher's timeout it would give up before the state is through.
        waiting.retain(|(_, _, at)| at.elapsed() < timeout / 2);
        let mut i = 0;
        while i < waiting.len() {
            match Slot::take(&serving, waiting[i].0) {
                Some(slot) => {
                    let (peer, conn, at) = waiting.remove(i).expect("index within the queue");
                    // Removed from the cluster while it waited: no weights for it.
                    if !may_fetch(peer) {
                        tracing::warn!(peer, "queued state handoff refused: no longer a member");
                        continue;
                    }
                    tracing::debug!(
                        peer,
                        queued_ms = at.elapsed().as_millis() as u64,
                        "queued state handoff served"
                    );
                    serve_one(server, peer, conn, slot, timeout, spawn);
                }
                None => i += 1,
            }
        }
        // While requests wait, slots are looked for often: they come back as serves end.
        let wait = if waiting.is_empty() { Duration::from_millis(200) } else { Duration::from_millis(10) };
        let Some((peer, conn)) = endpoint.accept_channel(Channel::Handoff, wait) else {
            continue;
        };
        if !may_fetch(peer) {
            tracing::warn!(peer, "state handoff refused: not a current member");
            continue;
        }
        // Taken before the thread, so it comes back even if no thread can be made.
        match Slot::take(&serving, peer) {
            Some(slot) => serve_one(server, peer, conn, slot, timeout, spawn),
            // One peer's requests wait at most twice its share of the slots: a member
            // opening handoffs in a loop cannot fill the queue for everyone else.
            None if waiting.len() < MAX_HANDOFF_QUEUED
                && waiting.iter().filter(|(p, _, _)| *p == peer).count()
                    < 2 * MAX_HANDOFF_SERVES_PER_PEER =>
            {
                waiting.push_back((peer, conn, std::time::Instant::now()))
            }
            None => tracing::warn!(
                peer,
                limit = MAX_HANDOFF_SERVES,
                per_peer = MAX_HANDOFF_SERVES_PER_PEER,
                queued = MAX_HANDOFF_QUEUED,
                "state handoff refused: serving and queue at the cap"
            ),
        }
    }
}

/// Serves one request on a thread of its own, holding `slot` until it ends.
fn serve_one(server: &Server, peer: u64, conn: Conn, slot: Slot, timeout: Duration, spawn: &Spawn) {
    if let Err(e) = conn.set_read_timeout(Some(timeout)).and_then(|()| conn.set_write_timeout(Some(timeout)))
    {
        tracing::warn!(peer, %e, "state handoff dropped");
        return;
    }
    let server = server.clone();
    let spawned = spawn(
        "handoff-serve",
        Box::new(move || {
            let _slot = slot;
            let mut conn = SentCounter(conn);
            if let Err(e) = server.serve(&mut conn, None) {
                tracing::warn!(peer, %e, "state handoff to a peer failed");
            }
        }),
    );
    if let Err(e) = spawned {
        // The closure, and the slot it held, went with the error.
        tracing::warn!(peer, %e, "state handoff dropped: no thread");
    }
}

/// Requests being served, by peer.
type Serving = Arc<std::sync::Mutex<std::collections::HashMap<u64, usize>>>;

/// One request being served; given back when its thread ends, however it ends.
struct Slot(Serving, u64);

impl Slot {
    /// A slot for `peer`, unless the endpoint or that peer is at its cap.
    fn take(serving: &Serving, peer: u64) -> Option<Slot> {
        let mut m = serving.lock().expect("serving lock");
        let total: usize = m.values().sum();
        let n = m.entry(peer).or_insert(0);
        if total >= MAX_HANDOFF_SERVES || *n >= MAX_HANDOFF_SERVES_PER_PEER {
            return None;
        }
        *n += 1;
        Some(Slot(Arc::clone(serving), peer))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.0.lock().expect("serving lock");
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// A connection that counts what it writes as handoff bytes sent.
struct SentCounter<S>(S);

impl<S: std::io::Read> std::io::Read for SentCounter<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl<S: std::io::Write> std::io::Write for SentCounter<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        super::count_bytes(true, "handoff", n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

//! State handoff over the data plane: the snapshot crate's handoff protocol on connections
//! that passed the cluster-secret handshake (channel `Handoff`), so a newcomer only takes
//! state from a member and a member only serves state to one.

use crate::dataplane::conn::Conn;
use crate::dataplane::endpoint::Endpoint;
use crate::dataplane::frame::Channel;
use limpet_snapshot::handoff::{Dialer, Server};
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Serves `server`'s offers on every authenticated handoff connection the endpoint accepts,
/// one thread per connection, until `stop` is set.
pub fn serve_handoff(
    endpoint: Arc<Endpoint>,
    server: Server,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || handoff_loop(&endpoint, &server, &|| stop.load(Ordering::SeqCst)))
}

/// Serves handoff requests on the calling thread until `stop` says so (each request on a
/// thread of its own).
pub fn handoff_loop(endpoint: &Endpoint, server: &Server, stop: &dyn Fn() -> bool) {
    while !stop() {
        let Some((peer, conn)) = endpoint.accept_channel(Channel::Handoff, Duration::from_millis(200)) else {
            continue;
        };
        let server = server.clone();
        std::thread::spawn(move || {
            let mut conn = SentCounter(conn);
            if let Err(e) = server.serve(&mut conn, None) {
                tracing::warn!(peer, %e, "state handoff to a peer failed");
            }
        });
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

//! State handoff over the data plane: the snapshot crate's handoff protocol on connections
//! that passed the cluster-secret handshake (channel `Handoff`), so a newcomer only takes
//! state from a member and a member only serves state to one.

use crate::dataplane::endpoint::Endpoint;
use crate::dataplane::frame::Channel;
use limpet_snapshot::handoff::{Dialer, Server};
use std::net::TcpStream;
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
    type Stream = TcpStream;

    fn dial(&self, source: &str) -> std::io::Result<TcpStream> {
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
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let Some((peer, mut conn)) =
                endpoint.accept_channel(Channel::Handoff, Duration::from_millis(200))
            else {
                continue;
            };
            let server = server.clone();
            std::thread::spawn(move || {
                if let Err(e) = server.serve(&mut conn, None) {
                    tracing::warn!(peer, %e, "state handoff to a peer failed");
                }
            });
        }
    })
}

//! A data-plane connection: plain TCP, or TCP carrying TLS 1.3 (rustls) when the cluster
//! runs with certificates.
//!
//! With TLS every byte after the handshake is encrypted and authenticated per record, with
//! the record's sequence number in its nonce: a replayed, reordered, altered or spliced-in
//! record fails to decrypt and the connection reports an `InvalidData` error.
//!
//! The rustls state sits behind a mutex and socket I/O happens outside it, so a clone can
//! write from one thread while the original reads in another (pipeline links), and the
//! ring can drive it over a non-blocking socket with poll(2): `has_pending` says when
//! encrypted bytes still wait for the socket, and reads never leave decrypted bytes behind
//! a poll.

use crate::dataplane::DataPlaneError;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest plaintext one `write` takes (the rest is the caller's next write).
const MAX_PLAIN: usize = 256 << 10;
/// Bytes read from the socket at a time.
const READ_BUF: usize = 256 << 10;

/// The rustls configurations of a data plane that runs with certificates.
#[derive(Clone)]
pub struct DataTls {
    /// For connections this agent accepts (peers must present a node certificate).
    pub server: Arc<rustls::ServerConfig>,
    /// For connections this agent makes.
    pub client: Arc<rustls::ClientConfig>,
}

impl DataTls {
    /// Both configurations from a node's loaded certificates.
    pub fn from_tls(tls: &limpet_consensus::tls::Tls) -> Result<DataTls, DataPlaneError> {
        let e = |e: rustls::Error| DataPlaneError::Config(format!("TLS for the data plane: {e}"));
        Ok(DataTls { server: tls.data_server().map_err(e)?, client: tls.data_client().map_err(e)? })
    }
}

#[derive(Default)]
struct Buffers {
    /// Encrypted bytes not yet taken by the socket.
    out: Vec<u8>,
    out_pos: usize,
    /// Bytes read from the socket (`buf[in_pos..in_len]` not yet given to rustls).
    buf: Vec<u8>,
    in_pos: usize,
    in_len: usize,
}

struct TlsSide {
    state: Arc<Mutex<rustls::Connection>>,
    bufs: Mutex<Buffers>,
}

/// One data-plane connection.
pub struct Conn {
    sock: TcpStream,
    tls: Option<Box<TlsSide>>,
}

fn tls_error(e: rustls::Error) -> std::io::Error {
    std::io::Error::new(ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Conn {
    /// A plain TCP connection.
    pub fn plain(sock: TcpStream) -> Conn {
        Conn { sock, tls: None }
    }

    /// Runs the TLS handshake as the connecting side (blocking, bounded by `timeout`): the
    /// server must hold a node certificate of the cluster CA.
    pub fn tls_client(
        sock: TcpStream,
        cfg: Arc<rustls::ClientConfig>,
        timeout: Duration,
    ) -> std::io::Result<Conn> {
        let name =
            rustls::pki_types::ServerName::try_from(limpet_consensus::tls::NODE_NAME).expect("a DNS name");
        let conn = rustls::ClientConnection::new(cfg, name).map_err(tls_error)?;
        Conn::handshake(sock, conn.into(), timeout)
    }

    /// Runs the TLS handshake as the accepting side: the peer must present a node
    /// certificate of the cluster CA (an operator's certificate is refused).
    pub fn tls_server(
        sock: TcpStream,
        cfg: Arc<rustls::ServerConfig>,
        timeout: Duration,
    ) -> std::io::Result<Conn> {
        let conn = rustls::ServerConnection::new(cfg).map_err(tls_error)?;
        let c = Conn::handshake(sock, conn.into(), timeout)?;
        if c.peer_node().is_none() {
            return Err(std::io::Error::new(
                ErrorKind::PermissionDenied,
                "the peer's certificate is not a node certificate bound to a node id",
            ));
        }
        Ok(c)
    }

    /// The fingerprint of the peer's certificate (`None`: plain TCP).
    pub fn peer_fingerprint(&self) -> Option<String> {
        let st = self.tls.as_ref()?.state.lock().expect("TLS lock");
        st.peer_certificates()?.first().map(|c| limpet_consensus::tls::fingerprint(c.as_ref()))
    }

    /// The node id the peer's certificate is bound to (`None`: plain TCP, or not a node's).
    pub fn peer_node(&self) -> Option<u64> {
        let st = self.tls.as_ref()?.state.lock().expect("TLS lock");
        let peer = st.peer_certificates()?.first().and_then(limpet_consensus::tls::peer_of)?;
        (peer.role == limpet_consensus::tls::Role::Node).then_some(peer.node).flatten()
    }

    fn handshake(
        mut sock: TcpStream,
        mut conn: rustls::Connection,
        timeout: Duration,
    ) -> std::io::Result<Conn> {
        // One deadline for the whole handshake, not per read: a peer sending a byte now and
        // then must not hold this thread (and a handshake slot) for longer. So the handshake
        // is driven one socket call at a time, each bounded by what is left; rustls's
        // `complete_io` would loop over reads inside one call, each given the whole timeout.
        let deadline = std::time::Instant::now() + timeout;
        let too_long = || std::io::Error::new(ErrorKind::TimedOut, "the TLS handshake took too long");
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(too_long());
            }
            sock.set_read_timeout(Some(left))?;
            sock.set_write_timeout(Some(left))?;
            if conn.wants_write() {
                conn.write_tls(&mut sock).map_err(|e| {
                    if matches!(e.kind(), ErrorKind::WouldBlock) {
                        too_long()
                    } else {
                        e
                    }
                })?;
                continue;
            }
            if !conn.is_handshaking() {
                break;
            }
            match conn.read_tls(&mut sock) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "the peer closed the connection during the TLS handshake",
                    ))
                }
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(too_long())
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if let Err(e) = conn.process_new_packets() {
                // Tell the peer why (its alert is queued), as far as the socket takes it.
                let _ = conn.write_tls(&mut sock);
                return Err(tls_error(e));
            }
        }
        // The writer drains everything itself; no limit on what one write may queue.
        conn.set_buffer_limit(None);
        Ok(Conn {
            sock,
            tls: Some(Box::new(TlsSide {
                state: Arc::new(Mutex::new(conn)),
                bufs: Mutex::new(Buffers::default()),
            })),
        })
    }

    /// Whether the connection is encrypted.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The TCP socket underneath.
    pub fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// A second handle on the same connection (one thread may read while another writes).
    pub fn try_clone(&self) -> std::io::Result<Conn> {
        Ok(Conn {
            sock: self.sock.try_clone()?,
            tls: self.tls.as_ref().map(|t| {
                Box::new(TlsSide { state: Arc::clone(&t.state), bufs: Mutex::new(Buffers::default()) })
            }),
        })
    }

    /// Makes the socket (non-)blocking.
    pub fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        self.sock.set_nonblocking(on)
    }

    /// Sets the socket's read timeout.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.sock.set_read_timeout(t)
    }

    /// Sets the socket's write timeout.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.sock.set_write_timeout(t)
    }

    /// Shuts the socket down.
    pub fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        self.sock.shutdown(how)
    }

    /// Whether encrypted bytes still wait for the socket (a non-blocking writer must call
    /// `flush_pending` until this is false before it is done).
    pub fn has_pending(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| {
            let b = t.bufs.lock().expect("buffer lock");
            b.out_pos < b.out.len()
        })
    }

    /// Writes what waits for the socket; `WouldBlock` when a non-blocking socket is full.
    pub fn flush_pending(&self) -> std::io::Result<()> {
        let Some(t) = &self.tls else { return Ok(()) };
        let mut b = t.bufs.lock().expect("buffer lock");
        flush_out(&self.sock, &mut b)
    }

    fn tls_read(&self, t: &TlsSide, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut b = t.bufs.lock().expect("buffer lock");
        loop {
            {
                let mut st = t.state.lock().expect("TLS lock");
                match st.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if b.in_pos < b.in_len {
                    let mut rest = &b.buf[b.in_pos..b.in_len];
                    let n = st.read_tls(&mut rest)?;
                    b.in_pos += n;
                    st.process_new_packets().map_err(tls_error)?;
                    continue;
                }
            }
            // Nothing decrypted and nothing buffered: read the socket, without the lock, into
            // the buffer allocated once (zeroing it per read would cost a pass over 256 KiB).
            let b = &mut *b;
            if b.buf.is_empty() {
                b.buf = vec![0; READ_BUF];
            }
            b.in_pos = 0;
            b.in_len = 0;
            let n = (&self.sock).read(&mut b.buf)?;
            b.in_len = n;
            if n == 0 {
                // The peer closed: tell rustls, which says whether it was a clean close.
                let mut st = t.state.lock().expect("TLS lock");
                st.read_tls(&mut &[][..])?;
                st.process_new_packets().map_err(tls_error)?;
                return match st.reader().read(buf) {
                    Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
                    other => other,
                };
            }
        }
    }

    fn tls_write(&self, t: &TlsSide, buf: &[u8]) -> std::io::Result<usize> {
        let mut b = t.bufs.lock().expect("buffer lock");
        // Earlier bytes first: a non-blocking writer sees WouldBlock until they are out.
        flush_out(&self.sock, &mut b)?;
        let n = {
            let mut st = t.state.lock().expect("TLS lock");
            let n = st.writer().write(&buf[..buf.len().min(MAX_PLAIN)])?;
            b.out.clear();
            b.out_pos = 0;
            while st.wants_write() {
                st.write_tls(&mut b.out)?;
            }
            n
        };
        match flush_out(&self.sock, &mut b) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(n),
            Err(e) => Err(e),
            Ok(()) => Ok(n),
        }
    }
}

fn flush_out(sock: &TcpStream, b: &mut Buffers) -> std::io::Result<()> {
    while b.out_pos < b.out.len() {
        match (&*sock).write(&b.out[b.out_pos..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => b.out_pos += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Read for &Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &self.tls {
            Some(t) => self.tls_read(t, buf),
            None => (&self.sock).read(buf),
        }
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &self.tls {
            Some(t) => self.tls_write(t, buf),
            None => (&self.sock).write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.flush_pending()
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        (&*self).flush()
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.sock.peer_addr().ok())
            .field("tls", &self.is_tls())
            .finish()
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

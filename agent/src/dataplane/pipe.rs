//! Point-to-point links between neighbouring pipeline stages of one replica: activations go
//! forward, their gradients come back, each tagged with (epoch, step, micro-batch) and
//! refused when the tag is not the one expected.
//!
//! A stage connects to the next stage (channel `Pipe`) and accepts the previous stage's
//! connection; both directions of each connection are used. Sends are queued to a writer
//! thread per connection, so the 1F1B schedule never blocks on a send while its neighbour
//! sends the other way (two large blocking sends facing each other would deadlock once the
//! socket buffers fill). Receives wait at most the data-plane timeout. Any error closes both
//! connections, so the neighbours fail within milliseconds instead of waiting out theirs.
//!
//! A tensor travels as a shape frame (`frame::encode_shape`) followed by its f32 values in
//! frames of at most `MAX_PAYLOAD` bytes; every frame's `seq` is `2 * micro` for an
//! activation and `2 * micro + 1` for a gradient.

use crate::dataplane::conn::Conn;
use crate::dataplane::frame::{
    decode_shape, encode_shape, Channel, Header, Kind, HEADER_LEN, MAX_LANES, MAX_PAYLOAD,
};

/// The most values one activation or gradient may hold (1 GiB of f32): far above any
/// micro-batch's, far below what a bad shape could ask for.
pub const MAX_VALUES: usize = 1 << 28;
use crate::dataplane::{DataPlaneError, Endpoint};
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One neighbour: the socket (read here, written by the writer thread) and the queue.
struct Peer {
    node: u64,
    stream: Conn,
    queue: Option<mpsc::Sender<Vec<u8>>>,
    writer: Option<std::thread::JoinHandle<()>>,
    write_error: Arc<Mutex<Option<String>>>,
}

impl Peer {
    fn new(node: u64, stream: Conn, timeout: Duration) -> Result<Peer, DataPlaneError> {
        stream.set_nonblocking(false).map_err(DataPlaneError::io("making a pipe socket blocking"))?;
        stream.set_read_timeout(Some(timeout)).map_err(DataPlaneError::io("setting a read timeout"))?;
        stream.set_write_timeout(Some(timeout)).map_err(DataPlaneError::io("setting a write timeout"))?;
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let write_error = Arc::new(Mutex::new(None));
        let (mut w, err) =
            (stream.try_clone().map_err(DataPlaneError::io("cloning a pipe socket"))?, write_error.clone());
        let writer = std::thread::Builder::new()
            .name(format!("pipe-to-{node}"))
            .spawn(move || {
                for frame in rx {
                    if let Err(e) = w.write_all(&frame) {
                        *err.lock().expect("pipe error lock") = Some(e.to_string());
                        let _ = w.shutdown(Shutdown::Both);
                        return;
                    }
                }
            })
            .map_err(DataPlaneError::io("starting a pipe writer"))?;
        Ok(Peer { node, stream, queue: Some(tx), writer: Some(writer), write_error })
    }

    fn close(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Let queued frames go out, then stop the writer.
        self.queue.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// A pipeline stage's links to its previous and next stage.
pub struct PipeLink {
    epoch: u64,
    timeout: Duration,
    prev: Option<Peer>,
    next: Option<Peer>,
    broken: Option<String>,
}

/// Which neighbour.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Prev,
    Next,
}

impl PipeLink {
    /// Connects this stage for `epoch`: to `next` (node id and data address) if there is a
    /// next stage, and from `prev` if there is a previous one, waiting until `deadline`
    /// unless `abort` says to give up.
    pub fn connect(
        ep: &Endpoint,
        epoch: u64,
        prev: Option<u64>,
        next: Option<(u64, &str)>,
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<PipeLink, DataPlaneError> {
        Self::connect_lane(ep, epoch, (prev, next), 0, deadline, abort)
    }

    /// The same for pipe lane `lane` between the same hosts ([`Channel::pipe`]): the link of
    /// their local ranks `lane`, each a replica of its own.
    pub fn connect_lane(
        ep: &Endpoint,
        epoch: u64,
        (prev, next): (Option<u64>, Option<(u64, &str)>),
        lane: usize,
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<PipeLink, DataPlaneError> {
        let channel = Channel::pipe(lane)
            .ok_or_else(|| DataPlaneError::Config(format!("pipe lane {lane} (at most {})", MAX_LANES - 1)))?;
        let timeout = ep.config().timeout;
        let next = match next {
            Some((node, addr)) => {
                let s = ep.connect_until(addr, node, epoch, channel, deadline, abort)?;
                Some(Peer::new(node, s, timeout)?)
            }
            None => None,
        };
        let prev = match prev {
            Some(node) => {
                Some(Peer::new(node, ep.accept_until(node, epoch, channel, deadline, abort)?, timeout)?)
            }
            None => None,
        };
        Ok(PipeLink { epoch, timeout, prev, next, broken: None })
    }

    /// The epoch this link belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn peer(&mut self, side: Side) -> Result<&mut Peer, DataPlaneError> {
        if let Some(b) = &self.broken {
            return Err(DataPlaneError::Broken(b.clone()));
        }
        let p = match side {
            Side::Prev => self.prev.as_mut(),
            Side::Next => self.next.as_mut(),
        };
        p.ok_or_else(|| DataPlaneError::Config(format!("this stage has no {side:?} stage").to_lowercase()))
    }

    fn fail(&mut self, e: DataPlaneError) -> DataPlaneError {
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        for p in self.prev.iter_mut().chain(self.next.iter_mut()) {
            p.close();
        }
        e
    }

    /// Queues a tensor for the neighbour on `side`.
    fn send(
        &mut self,
        side: Side,
        step: u64,
        seq: u32,
        shape: &[i64],
        values: &[f32],
    ) -> Result<(), DataPlaneError> {
        let epoch = self.epoch;
        let res = (|| {
            let peer = self.peer(side)?;
            if let Some(e) = peer.write_error.lock().expect("pipe error lock").clone() {
                return Err(DataPlaneError::PeerClosed {
                    peer: peer.node,
                    during: format!("sending to it: {e}"),
                });
            }
            let frame = |payload: &[u8]| {
                let h = Header { kind: Kind::Data, epoch, step, seq, len: payload.len() as u32 };
                let mut f = Vec::with_capacity(HEADER_LEN + payload.len());
                f.extend_from_slice(&h.encode());
                f.extend_from_slice(payload);
                f
            };
            let queue = peer.queue.as_ref().expect("queue lives until drop");
            let closed =
                |node| DataPlaneError::PeerClosed { peer: node, during: "queueing a pipe frame".into() };
            let first = frame(&encode_shape(shape));
            super::count_bytes(true, "pipe", first.len() as u64);
            queue.send(first).map_err(|_| closed(peer.node))?;
            for chunk in bytemuck::cast_slice::<f32, u8>(values).chunks(MAX_PAYLOAD as usize) {
                super::count_bytes(true, "pipe", (HEADER_LEN + chunk.len()) as u64);
                queue.send(frame(chunk)).map_err(|_| closed(peer.node))?;
            }
            Ok(())
        })();
        res.map_err(|e| self.fail(e))
    }

    /// Receives the tensor tagged `(step, seq)` from the neighbour on `side`.
    fn recv(
        &mut self,
        side: Side,
        step: u64,
        seq: u32,
        what: &str,
    ) -> Result<(Vec<i64>, Vec<f32>), DataPlaneError> {
        let (epoch, timeout) = (self.epoch, self.timeout);
        let res = (|| {
            let peer = self.peer(side)?;
            let during = format!("receiving {what} of step {step} micro-batch {}", seq / 2);
            let shape_bytes = read_frame(peer, epoch, step, seq, timeout, &during)?;
            let shape = decode_shape(&shape_bytes)?;
            // The shape is the peer's word: its size is checked, and memory grows only as
            // bytes actually arrive, never reserved from the shape up front.
            let n = shape
                .iter()
                .try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
                .filter(|&n| n <= MAX_VALUES)
                .ok_or_else(|| {
                    DataPlaneError::Protocol(format!(
                        "{during}: a tensor of shape {shape:?} (at most {MAX_VALUES} values)"
                    ))
                })?;
            let mut bytes = Vec::with_capacity((n * 4).min(MAX_PAYLOAD as usize));
            while bytes.len() < n as usize * 4 {
                let part = read_frame(peer, epoch, step, seq, timeout, &during)?;
                if part.is_empty() || bytes.len() + part.len() > n as usize * 4 {
                    return Err(DataPlaneError::Protocol(format!(
                        "{during}: a frame of {} bytes where {} remained",
                        part.len(),
                        n as usize * 4 - bytes.len()
                    )));
                }
                bytes.extend_from_slice(&part);
            }
            let frames = 1 + bytes.len().div_ceil(MAX_PAYLOAD as usize);
            super::count_bytes(false, "pipe", (frames * HEADER_LEN + shape_bytes.len() + bytes.len()) as u64);
            let values =
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
            Ok((shape, values))
        })();
        res.map_err(|e| self.fail(e))
    }

    /// Sends micro-batch `micro`'s activation to the next stage.
    pub fn send_activation(
        &mut self,
        step: u64,
        micro: usize,
        shape: &[i64],
        values: &[f32],
    ) -> Result<(), DataPlaneError> {
        self.send(Side::Next, step, seq(micro, false), shape, values)
    }

    /// Receives micro-batch `micro`'s activation from the previous stage.
    pub fn recv_activation(
        &mut self,
        step: u64,
        micro: usize,
    ) -> Result<(Vec<i64>, Vec<f32>), DataPlaneError> {
        self.recv(Side::Prev, step, seq(micro, false), "an activation")
    }

    /// Sends the gradient of micro-batch `micro`'s input to the previous stage.
    pub fn send_gradient(
        &mut self,
        step: u64,
        micro: usize,
        shape: &[i64],
        values: &[f32],
    ) -> Result<(), DataPlaneError> {
        self.send(Side::Prev, step, seq(micro, true), shape, values)
    }

    /// Receives the gradient of micro-batch `micro`'s output from the next stage.
    pub fn recv_gradient(&mut self, step: u64, micro: usize) -> Result<(Vec<i64>, Vec<f32>), DataPlaneError> {
        self.recv(Side::Next, step, seq(micro, true), "a gradient")
    }
}

fn seq(micro: usize, gradient: bool) -> u32 {
    (micro as u32) * 2 + u32::from(gradient)
}

fn read_frame(
    peer: &mut Peer,
    epoch: u64,
    step: u64,
    seq: u32,
    timeout: Duration,
    during: &str,
) -> Result<Vec<u8>, DataPlaneError> {
    let node = peer.node;
    let map = |e: std::io::Error| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            DataPlaneError::Timeout { peer: node, waited: timeout, during: during.to_string() }
        }
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::BrokenPipe
        | ErrorKind::ConnectionAborted => {
            DataPlaneError::PeerClosed { peer: node, during: during.to_string() }
        }
        _ => DataPlaneError::Io { what: during.to_string(), source: e },
    };
    let mut raw = [0u8; HEADER_LEN];
    peer.stream.read_exact(&mut raw).map_err(map)?;
    let h = Header::decode(&raw)?;
    if h.kind == Kind::Abort {
        return Err(DataPlaneError::PeerAborted { peer: node, during: during.to_string() });
    }
    if (h.epoch, h.step, h.seq) != (epoch, step, seq) {
        return Err(DataPlaneError::Stale(format!(
            "{during}: node {node} sent epoch {} step {} seq {}, expected epoch {epoch} step {step} seq {seq}",
            h.epoch, h.step, h.seq
        )));
    }
    let mut payload = vec![0u8; h.len as usize];
    peer.stream.read_exact(&mut payload).map_err(map)?;
    Ok(payload)
}

#[cfg(feature = "trainer")]
impl limpet_trainer::pipeline::StageLink for PipeLink {
    fn send_activation(
        &mut self,
        step: u64,
        micro: usize,
        a: &limpet_trainer::pipeline::Activation,
    ) -> Result<(), limpet_trainer::TrainerError> {
        PipeLink::send_activation(self, step, micro, &a.shape, &a.values)
            .map_err(DataPlaneError::into_trainer)
    }
    fn recv_activation(
        &mut self,
        step: u64,
        micro: usize,
    ) -> Result<limpet_trainer::pipeline::Activation, limpet_trainer::TrainerError> {
        let (shape, values) =
            PipeLink::recv_activation(self, step, micro).map_err(DataPlaneError::into_trainer)?;
        Ok(limpet_trainer::pipeline::Activation { shape, values })
    }
    fn send_gradient(
        &mut self,
        step: u64,
        micro: usize,
        g: &limpet_trainer::pipeline::Activation,
    ) -> Result<(), limpet_trainer::TrainerError> {
        PipeLink::send_gradient(self, step, micro, &g.shape, &g.values).map_err(DataPlaneError::into_trainer)
    }
    fn recv_gradient(
        &mut self,
        step: u64,
        micro: usize,
    ) -> Result<limpet_trainer::pipeline::Activation, limpet_trainer::TrainerError> {
        let (shape, values) =
            PipeLink::recv_gradient(self, step, micro).map_err(DataPlaneError::into_trainer)?;
        Ok(limpet_trainer::pipeline::Activation { shape, values })
    }
}

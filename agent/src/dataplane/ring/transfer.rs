//! Driving one collective's plan over the ring's two non-blocking sockets: one thread polls
//! both, writes whatever is ready, reads whatever has arrived and sums it in place, and fails
//! the collective on a timeout, a vanished or aborting peer, or a frame of another collective.
//! A chunk of the plan's bfloat16 part goes out rounded from the f32 buffer (staged, as the
//! socket takes it) and comes in added or copied into the f32 buffer as its values arrive.

use super::{Group, Op, Plan};
use crate::dataplane::conn::Conn;
use crate::dataplane::frame::{Header, Kind, HEADER_LEN};
use crate::dataplane::DataPlaneError;
use half::bf16;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// The two sockets a plan runs over, and whose they are: the ring's right and left
/// neighbours, or one butterfly partner both ways (`tree.rs`).
pub(super) struct Ends<'a> {
    pub right: &'a Conn,
    pub right_peer: u64,
    pub left: &'a Conn,
    pub left_peer: u64,
}

/// Which collective a plan's frames belong to, and how long it may make no progress.
pub(super) struct Frames<'a> {
    pub epoch: u64,
    pub step: u64,
    pub seq: u32,
    pub timeout: Duration,
    pub during: &'a str,
}

impl Group {
    pub(super) fn drive(
        &mut self,
        plan: &Plan,
        buf: &mut [f32],
        step: u64,
        seq: u32,
        during: &str,
    ) -> Result<(), DataPlaneError> {
        let w = self.world();
        let (Some(right), Some(left)) = (self.right.as_ref(), self.left.as_ref()) else {
            return Ok(());
        };
        let ends = Ends {
            right,
            right_peer: self.ranks[(self.rank + 1) % w],
            left,
            left_peer: self.ranks[(self.rank + w - 1) % w],
        };
        let frames = Frames { epoch: self.epoch, step, seq, timeout: self.timeout, during };
        drive_plan(&ends, &frames, plan, buf, bytemuck::cast_slice_mut(&mut self.scratch))
    }
}

/// Runs `plan` over `ends` until every send is out and every receive is in, or fails.
/// `scratch` holds a chunk's received values before they are added (a plan of copies only
/// needs none).
pub(super) fn drive_plan(
    ends: &Ends,
    frames: &Frames,
    plan: &Plan,
    buf: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), DataPlaneError> {
    let (right, left) = (ends.right, ends.left);
    let during = frames.during;
    let mut t = Transfer {
        plan,
        during,
        epoch: frames.epoch,
        step: frames.step,
        seq: frames.seq,
        right_peer: ends.right_peer,
        left_peer: ends.left_peer,
        si: 0,
        sent: 0,
        send_hdr: [0; HEADER_LEN],
        stage: Vec::new(),
        staged: None,
        ri: 0,
        hdr_got: 0,
        got: 0,
        added: 0,
        recv_hdr: [0; HEADER_LEN],
    };
    if let Some(first) = plan.sends.first() {
        t.send_hdr = t.header(&first.range);
    }
    let mut last_progress = Instant::now();
    // With TLS, encrypted bytes may still wait for the socket after the last send.
    while !t.done(right) {
        let mut progressed = t.send(right, buf)?;
        progressed |= t.flush(right)?;
        progressed |= t.receive(left, buf, scratch)?;
        if t.done(right) {
            break;
        }
        let now = Instant::now();
        if progressed {
            last_progress = now;
            continue;
        }
        let idle = now - last_progress;
        let (want_send, want_recv) = (t.can_send() || right.has_pending(), t.ri < plan.recvs.len());
        if idle >= frames.timeout {
            let peer = if want_recv { t.left_peer } else { t.right_peer };
            return Err(DataPlaneError::Timeout { peer, waited: frames.timeout, during: during.to_string() });
        }
        let mut fds = Vec::with_capacity(2);
        if want_send {
            fds.push(PollFd::new(right.as_fd(), PollFlags::POLLOUT));
        }
        if want_recv {
            fds.push(PollFd::new(left.as_fd(), PollFlags::POLLIN));
        }
        let wait = (frames.timeout - idle).min(Duration::from_millis(500));
        let ms = PollTimeout::try_from(wait.as_millis().max(1) as i32).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, ms) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                return Err(DataPlaneError::Io { what: "poll".into(), source: std::io::Error::from(e) });
            }
        }
    }
    Ok(())
}

/// One collective in flight: the plan's send and receive cursors and what every frame of it
/// carries. Each method moves one direction as far as the socket allows without blocking and
/// says whether it moved.
struct Transfer<'a> {
    plan: &'a Plan,
    during: &'a str,
    epoch: u64,
    step: u64,
    seq: u32,
    right_peer: u64,
    left_peer: u64,
    /// The send item under way, how many of its bytes (header first) are out, its header.
    si: usize,
    sent: usize,
    send_hdr: [u8; HEADER_LEN],
    /// A bfloat16 send's values, rounded when it starts (its chunk is final by then), and
    /// which send they are.
    stage: Vec<bf16>,
    staged: Option<usize>,
    /// The receive item under way: header bytes in, payload bytes in, elements summed so far.
    ri: usize,
    hdr_got: usize,
    got: usize,
    added: usize,
    recv_hdr: [u8; HEADER_LEN],
}

impl Transfer<'_> {
    fn header(&self, range: &std::ops::Range<usize>) -> [u8; HEADER_LEN] {
        let len = (range.len() * self.plan.width(range)) as u32;
        Header { kind: Kind::Data, epoch: self.epoch, step: self.step, seq: self.seq, len }.encode()
    }

    /// The next send is ready: its chunk does not wait for a receive still to come.
    fn can_send(&self) -> bool {
        self.plan.sends.get(self.si).is_some_and(|s| s.after.is_none_or(|a| a < self.ri))
    }

    fn done(&self, right: &Conn) -> bool {
        self.si >= self.plan.sends.len() && self.ri >= self.plan.recvs.len() && !right.has_pending()
    }

    /// A socket error as the collective's failure: a vanished peer is `PeerClosed`.
    fn failed(&self, e: std::io::Error, peer: u64, what: &str) -> DataPlaneError {
        if is_disconnect(&e) {
            DataPlaneError::PeerClosed { peer, during: self.during.to_string() }
        } else {
            DataPlaneError::Io { what: format!("{what} node {peer}"), source: e }
        }
    }

    /// Sends whatever is ready.
    fn send(&mut self, right: &Conn, buf: &[f32]) -> Result<bool, DataPlaneError> {
        let mut progressed = false;
        while self.can_send() {
            let item = &self.plan.sends[self.si];
            let payload: &[u8] = if self.plan.width(&item.range) == 2 {
                if self.staged != Some(self.si) {
                    self.stage.clear();
                    self.stage.extend(buf[item.range.clone()].iter().map(|v| bf16::from_f32(*v)));
                    self.staged = Some(self.si);
                }
                bytemuck::cast_slice(&self.stage)
            } else {
                bytemuck::cast_slice(&buf[item.range.clone()])
            };
            let res = if self.sent < HEADER_LEN {
                (&*right).write(&self.send_hdr[self.sent..])
            } else {
                (&*right).write(&payload[self.sent - HEADER_LEN..])
            };
            match res {
                Ok(0) => {
                    return Err(DataPlaneError::PeerClosed {
                        peer: self.right_peer,
                        during: self.during.into(),
                    })
                }
                Ok(n) => {
                    self.sent += n;
                    progressed = true;
                    if self.sent == HEADER_LEN + payload.len() {
                        self.si += 1;
                        self.sent = 0;
                        if let Some(next) = self.plan.sends.get(self.si) {
                            self.send_hdr = self.header(&next.range);
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(e, self.right_peer, "sending to")),
            }
        }
        Ok(progressed)
    }

    /// Encrypted bytes of a send already counted as done must reach the socket even while
    /// the next send waits for a receive: the peer may need them to send it.
    fn flush(&self, right: &Conn) -> Result<bool, DataPlaneError> {
        if !right.has_pending() {
            return Ok(false);
        }
        match right.flush_pending() {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(self.failed(e, self.right_peer, "sending to")),
        }
    }

    /// Receives whatever has arrived, adding or copying it into `buf`.
    fn receive(&mut self, left: &Conn, buf: &mut [f32], scratch: &mut [f32]) -> Result<bool, DataPlaneError> {
        let mut progressed = false;
        while self.ri < self.plan.recvs.len() {
            let item = &self.plan.recvs[self.ri];
            let width = self.plan.width(&item.range);
            let bytes = item.range.len() * width;
            let res = if self.hdr_got < HEADER_LEN {
                (&*left).read(&mut self.recv_hdr[self.hdr_got..])
            } else if width == 2 {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..item.range.len().div_ceil(2)]);
                (&*left).read(&mut dst[self.got..bytes])
            } else if item.op == Op::Copy {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut buf[item.range.clone()]);
                (&*left).read(&mut dst[self.got..])
            } else {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..item.range.len()]);
                (&*left).read(&mut dst[self.got..])
            };
            let n = match res {
                Ok(0) => {
                    return Err(DataPlaneError::PeerClosed {
                        peer: self.left_peer,
                        during: self.during.into(),
                    })
                }
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.failed(e, self.left_peer, "receiving from")),
            };
            progressed = true;
            if self.hdr_got < HEADER_LEN {
                self.hdr_got += n;
                if self.hdr_got == HEADER_LEN {
                    self.check_header(bytes)?;
                }
            } else {
                self.got += n;
                if width == 2 {
                    // Whole bfloat16 values only, into the f32 buffer as they arrive.
                    let upto = self.got / 2;
                    let src: &[bf16] =
                        &bytemuck::cast_slice(&scratch[..item.range.len().div_ceil(2)])[self.added..upto];
                    let dst = &mut buf[item.range.start + self.added..item.range.start + upto];
                    match item.op {
                        Op::Copy => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
                        _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d += s.to_f32()),
                    }
                    self.added = upto;
                } else if item.op == Op::AddI64 {
                    // Whole i64s only (two f32 words each). Both sides are 8-aligned: `buf` is
                    // an i64 buffer seen as words and chunks start at even words; the scratch
                    // is u64s.
                    let upto = self.got / 8 * 2;
                    let dst: &mut [i64] = bytemuck::cast_slice_mut(
                        &mut buf[item.range.start + self.added..item.range.start + upto],
                    );
                    let src: &[i64] = bytemuck::cast_slice(&scratch[self.added..upto]);
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = d.wrapping_add(*s);
                    }
                    self.added = upto;
                } else if item.op == Op::Add {
                    // Sum what just arrived while it is still in cache, rather than the whole
                    // chunk once it is complete.
                    let upto = self.got / 4;
                    let dst = &mut buf[item.range.start + self.added..item.range.start + upto];
                    for (d, s) in dst.iter_mut().zip(&scratch[self.added..upto]) {
                        *d += *s;
                    }
                    self.added = upto;
                }
            }
            if self.hdr_got == HEADER_LEN && self.got == bytes {
                if item.round {
                    // The owner's summed segment, as the others will receive it.
                    for v in &mut buf[item.range.clone()] {
                        *v = bf16::from_f32(*v).to_f32();
                    }
                }
                self.ri += 1;
                (self.hdr_got, self.got, self.added) = (0, 0, 0);
            }
        }
        Ok(progressed)
    }

    fn check_header(&self, bytes: usize) -> Result<(), DataPlaneError> {
        let (peer, during) = (self.left_peer, self.during);
        let h = Header::decode(&self.recv_hdr)?;
        if h.kind == Kind::Abort {
            return Err(DataPlaneError::PeerAborted { peer, during: during.to_string() });
        }
        if h.epoch != self.epoch {
            return Err(DataPlaneError::Stale(format!(
                "node {peer} sent a frame of epoch {} during {during}",
                h.epoch
            )));
        }
        if h.step != self.step || h.seq != self.seq {
            return Err(DataPlaneError::Stale(format!(
                "node {peer} sent a frame of step {} collective #{} during {during}",
                h.step, h.seq
            )));
        }
        if h.len as usize != bytes {
            return Err(DataPlaneError::Protocol(format!(
                "node {peer} sent {} bytes where {bytes} were due during {during} (buffer sizes differ?)",
                h.len
            )));
        }
        Ok(())
    }
}

fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::BrokenPipe
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::UnexpectedEof
    )
}

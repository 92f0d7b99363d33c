//! Small collectives in log2(W) rounds: recursive doubling over a butterfly of direct links.
//!
//! The ring costs 2(W-1) hops whatever the buffer: at a thousand ranks a barrier or a
//! step's scalars wait on two thousand latencies in a row. Here rank `r` of the largest power
//! of two `P <= W` exchanges its whole buffer with rank `r ^ 2^k` in round `k` and combines
//! the two; after log2(P) rounds every rank holds the combination of all. The `W - P` ranks
//! past `P` fold in first (each sends its buffer to rank `r - P`, which combines it) and take
//! the result back at the end: log2(P) + 2 rounds in all.
//!
//! Every combination is commutative in the bits (an f32 or a wrapping i64 addition, a bitwise
//! or), so the two partners of a round compute the same bits from the same two values in
//! either order, and every rank ends bit-identical, as the ring's results are. Gathers and
//! broadcasts take the same path as an or over zeroed blocks, exact for any bit pattern.
//!
//! A round moves the whole buffer (the ring moves 2(W-1)/W of it over 2(W-1) hops for a
//! reduction, 1/W a hop over W-1 hops for a gather or a broadcast), so the tree takes a
//! buffer only while the hops it saves cost more than the bytes it adds: with a hop's latency
//! worth [`HOP_BYTES`] of transfer, while `rounds * bytes <= passes * ((W - 1) * HOP_BYTES +
//! bytes)`, the ring making 2 passes for a reduction and 1 for the others.
//!
//! Every message starts with a tag of the collective's shape (its kind, length, root or
//! blocks): a partner whose tag differs ran another collective, and the round fails with a
//! protocol error, where an or of mismatched blocks would otherwise pass unnoticed.

use super::transfer::{drive_plan, Ends, Frames};
use super::{Group, Plan, RecvItem, SendItem};
use crate::dataplane::conn::Conn;
use crate::dataplane::frame::{Channel, Header, Kind, HEADER_LEN};
use crate::dataplane::{DataPlaneError, Endpoint};
use std::io::Write;
use std::net::Shutdown;
use std::ops::Range;
use std::time::Instant;

/// Bytes a link moves in the time one hop's latency takes (about 40 us at about 1 GB/s, as
/// loopback and a datacenter network both measure).
pub const HOP_BYTES: usize = 32 << 10;

/// A rank's links of the butterfly.
pub(crate) struct Tree {
    /// The rank this one folds into (past `P`) or takes a fold from (below `W - P`).
    fold: Option<(usize, Conn)>,
    /// Round `k`'s partner, `rank ^ 2^k`, and the link to it (none past `P`).
    rounds: Vec<(usize, Conn)>,
    /// Whether this rank is past `P`: it sends its buffer and waits for the result.
    folded: bool,
    /// Rounds a collective takes, for the choice between the tree and the ring.
    depth: usize,
}

/// How a round combines the partner's buffer into this rank's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Combine {
    /// f32 addition.
    Add,
    /// Wrapping addition of little-endian i64s, two f32 words each.
    AddI64,
    /// Bitwise or of the words: a gather or a broadcast over zeroed blocks.
    Or,
}

/// Rank `rank`'s partners in a world of `world`: the fold partner and each round's.
fn partners(rank: usize, world: usize) -> (Option<usize>, Vec<usize>, usize) {
    let p = 1usize << world.ilog2();
    let levels = p.trailing_zeros() as usize;
    let depth = levels + if world > p { 2 } else { 0 };
    if rank >= p {
        return (Some(rank - p), Vec::new(), depth);
    }
    let fold = (rank + p < world).then_some(rank + p);
    (fold, (0..levels).map(|k| rank ^ (1 << k)).collect(), depth)
}

impl Group {
    /// Connects this rank's butterfly links when the group has at least the endpoint's
    /// `tree_min_world` ranks (smaller groups keep the ring for every collective). Every rank
    /// calls it after the ring formed; the lower rank of each pair connects, the higher
    /// accepts, every connection out first so that no rank waits on another's accept.
    pub fn connect_tree(
        &mut self,
        ep: &Endpoint,
        addrs: &[String],
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<(), DataPlaneError> {
        let w = self.world();
        if w < ep.config().tree_min_world.max(2) || self.tree.is_some() {
            return Ok(());
        }
        if addrs.len() != w {
            return Err(DataPlaneError::Config(format!("{w} ranks but {} addresses", addrs.len())));
        }
        let (fold, rounds, depth) = partners(self.rank, w);
        let links: Vec<usize> = fold.iter().chain(&rounds).copied().collect();
        let connect_by = deadline.min(Instant::now() + ep.config().timeout);
        let mut conns: Vec<Option<Conn>> = Vec::with_capacity(links.len());
        for &p in &links {
            conns.push(if self.rank < p {
                Some(ep.connect_until(
                    &addrs[p],
                    self.ranks[p],
                    self.epoch,
                    Channel::Tree,
                    connect_by,
                    abort,
                )?)
            } else {
                None
            });
        }
        for (slot, &p) in conns.iter_mut().zip(&links) {
            if slot.is_none() {
                *slot = Some(ep.accept_until(self.ranks[p], self.epoch, Channel::Tree, deadline, abort)?);
            }
        }
        let mut conns = conns.into_iter().map(|c| c.expect("connected or accepted"));
        let mut link = |p: usize| -> Result<(usize, Conn), DataPlaneError> {
            let c = conns.next().expect("one link per partner");
            c.set_nonblocking(true).map_err(DataPlaneError::io("making a socket non-blocking"))?;
            Ok((p, c))
        };
        let fold = fold.map(&mut link).transpose()?;
        let rounds = rounds.into_iter().map(link).collect::<Result<Vec<_>, _>>()?;
        self.tree = Some(Box::new(Tree { fold, rounds, folded: self.rank >= 1 << w.ilog2(), depth }));
        Ok(())
    }

    /// The group, with its butterfly links connected if `tree` ([`Group::connect_tree`]).
    pub fn with_tree(
        mut self,
        ep: &Endpoint,
        addrs: &[String],
        (deadline, abort): (Instant, &dyn Fn() -> bool),
        tree: bool,
    ) -> Result<Group, DataPlaneError> {
        if tree {
            self.connect_tree(ep, addrs, deadline, abort)?;
        }
        Ok(self)
    }

    /// Whether a reduction of `bytes` goes over the butterfly, where the group has one,
    /// rather than the ring.
    pub fn picks_tree(&self, bytes: usize) -> bool {
        self.picks_tree_for(bytes, 2)
    }

    /// As [`Group::picks_tree`], for a collective whose rounds carry `bytes` (a gather's
    /// whole output) and that the ring runs in `passes` passes (2 for a reduction, 1 for a
    /// gather or a broadcast).
    pub(super) fn picks_tree_for(&self, bytes: usize, passes: usize) -> bool {
        let w = self.world();
        self.tree.as_ref().is_some_and(|t| {
            t.depth.saturating_mul(bytes) <= passes.saturating_mul((w - 1) * HOP_BYTES + bytes)
        })
    }

    /// Whether this group has butterfly links (a group of at least the endpoint's
    /// `tree_min_world` ranks), so small collectives take log2(W) rounds.
    pub fn has_tree(&self) -> bool {
        self.tree.is_some()
    }

    /// Combines every rank's `buf` with `how`, over the butterfly; every rank ends with the
    /// same bits. `shape` describes the collective beyond its kind and length (a root, a
    /// gather's blocks): every rank must give the same.
    pub(super) fn tree_reduce(
        &mut self,
        buf: &mut [f32],
        how: Combine,
        shape: &[u64],
        step: u64,
        what: &str,
    ) -> Result<(), DataPlaneError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let during = format!("{what} #{seq} of step {step}, epoch {} (tree)", self.epoch);
        let frames = Frames { epoch: self.epoch, step, seq, timeout: self.timeout, during: &during };
        let tag = shape_tag(how, buf.len(), shape);
        match self.tree_rounds(buf, how, tag, &frames) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.break_group(&e, step, seq);
                Err(e)
            }
        }
    }

    fn tree_rounds(
        &self,
        buf: &mut [f32],
        how: Combine,
        tag: u64,
        frames: &Frames,
    ) -> Result<(), DataPlaneError> {
        let tree = self.tree.as_ref().expect("a group with a butterfly");
        let n = buf.len();
        // This rank's message, then the partner's: each the tag (two words) and the values,
        // an even number of words; u64s, so that i64s read in place.
        let half = 2 + n.div_ceil(2) * 2;
        let mut held = vec![0u64; half];
        let work: &mut [f32] = bytemuck::cast_slice_mut(&mut held);
        work[..2].copy_from_slice(bytemuck::cast_slice(&[tag]));
        work[2..2 + n].copy_from_slice(buf);
        let mine = 0..2 + n;
        let theirs = half..half + 2 + n;
        let node = |p: usize| self.ranks[p];
        let check = |work: &[f32], at: usize, p: usize| -> Result<(), DataPlaneError> {
            if work[at..at + 2].iter().zip(&work[..2]).all(|(a, b)| a.to_bits() == b.to_bits()) {
                return Ok(());
            }
            Err(DataPlaneError::Protocol(format!(
                "node {} ran a collective of another shape (kind, root or blocks) during {}",
                node(p),
                frames.during
            )))
        };
        if tree.folded {
            let (p, c) = tree.fold.as_ref().expect("a rank past P folds");
            self.exchange(c, node(*p), frames, work, Some(&mine), None)?;
            self.exchange(c, node(*p), frames, work, None, Some(&theirs))?;
            check(work, half, *p)?;
            work.copy_within(half + 2..half + 2 + n, 2);
        } else {
            if let Some((p, c)) = &tree.fold {
                self.exchange(c, node(*p), frames, work, None, Some(&theirs))?;
                check(work, half, *p)?;
                combine(work, half, n, how);
            }
            for (p, c) in &tree.rounds {
                self.exchange(c, node(*p), frames, work, Some(&mine), Some(&theirs))?;
                check(work, half, *p)?;
                combine(work, half, n, how);
            }
            if let Some((p, c)) = &tree.fold {
                self.exchange(c, node(*p), frames, work, Some(&mine), None)?;
            }
        }
        buf.copy_from_slice(&work[2..2 + n]);
        Ok(())
    }

    /// Sends `work[send]` and receives `work[recv]` over one link, both at once.
    fn exchange(
        &self,
        conn: &Conn,
        peer: u64,
        frames: &Frames,
        work: &mut [f32],
        send: Option<&Range<usize>>,
        recv: Option<&Range<usize>>,
    ) -> Result<(), DataPlaneError> {
        let mut plan = Plan::default();
        if let Some(r) = send {
            plan.sends =
                self.chunks(r.clone(), 0).into_iter().map(|range| SendItem { range, after: None }).collect();
        }
        if let Some(r) = recv {
            plan.recvs = self
                .chunks(r.clone(), 0)
                .into_iter()
                .map(|range| RecvItem { range, op: super::Op::Copy, round: false })
                .collect();
        }
        let ends = Ends { right: conn, right_peer: peer, left: conn, left_peer: peer };
        drive_plan(&ends, frames, &plan, work, &mut [])?;
        let bytes = |rs: &[Range<usize>]| rs.iter().map(|r| (HEADER_LEN + 4 * r.len()) as u64).sum::<u64>();
        let sent: Vec<Range<usize>> = plan.sends.iter().map(|s| s.range.clone()).collect();
        let got: Vec<Range<usize>> = plan.recvs.iter().map(|r| r.range.clone()).collect();
        crate::dataplane::count_bytes(true, "ring", bytes(&sent));
        crate::dataplane::count_bytes(false, "ring", bytes(&got));
        Ok(())
    }

    /// Clones of the butterfly links' sockets (see `Group::sockets`).
    pub(super) fn tree_sockets(&self) -> Vec<std::net::TcpStream> {
        let Some(tree) = &self.tree else { return Vec::new() };
        tree.fold.iter().chain(&tree.rounds).filter_map(|(_, c)| c.socket().try_clone().ok()).collect()
    }

    /// Tells each butterfly partner the collective is given up and closes the links.
    pub(super) fn break_tree(&self, step: u64, seq: u32) {
        let Some(tree) = &self.tree else { return };
        let abort = Header { kind: Kind::Abort, epoch: self.epoch, step, seq, len: 0 }.encode();
        for (_, c) in tree.fold.iter().chain(&tree.rounds) {
            let _ = (&*c).write(&abort);
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// A collective's shape as every rank must see it: FNV-1a over its kind, length and `shape`.
fn shape_tag(how: Combine, n: usize, shape: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for word in [how as u64, n as u64].into_iter().chain(shape.iter().copied()) {
        for b in word.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// This rank's values (`work[2..2 + n]`) combined with the partner's (`work[half + 2..]`),
/// in place.
fn combine(work: &mut [f32], half: usize, n: usize, how: Combine) {
    let (mine, rest) = work.split_at_mut(half);
    let (mine, theirs) = (&mut mine[2..2 + n], &rest[2..2 + n]);
    match how {
        Combine::Add => mine.iter_mut().zip(theirs).for_each(|(a, b)| *a += *b),
        Combine::Or => {
            mine.iter_mut().zip(theirs).for_each(|(a, b)| *a = f32::from_bits(a.to_bits() | b.to_bits()))
        }
        Combine::AddI64 => {
            // Both start 8-aligned: `work` is u64s, and `half` and 2 are even.
            let a: &mut [i64] = bytemuck::cast_slice_mut(mine);
            let b: &[i64] = bytemuck::cast_slice(theirs);
            a.iter_mut().zip(b).for_each(|(a, b)| *a = a.wrapping_add(*b));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::partners;

    /// Every rank's partners are mutual, each round pairs every rank below P once, and the
    /// ranks past P fold into distinct ranks below W - P.
    #[test]
    fn the_butterfly_pairs_every_rank_once_a_round() {
        for w in 1usize..=70 {
            let p = 1usize << w.ilog2();
            let all: Vec<_> = (0..w).map(|r| partners(r, w)).collect();
            for (r, (fold, rounds, depth)) in all.iter().enumerate() {
                assert_eq!(*depth, p.trailing_zeros() as usize + if w > p { 2 } else { 0 });
                if let Some(f) = fold {
                    assert_eq!(all[*f].0, Some(r), "w {w}: fold of {r} is mutual");
                    assert!(r >= p || *f >= p);
                }
                for (k, &q) in rounds.iter().enumerate() {
                    assert!(q < p);
                    assert_eq!(all[q].1[k], r, "w {w}: round {k} of {r} is mutual");
                }
                assert_eq!(rounds.len(), if r < p { p.trailing_zeros() as usize } else { 0 });
            }
        }
    }
}

//! A collective group: the ranks of one epoch on a ring, each with a connection to its right
//! neighbour (sending) and one from its left (receiving).
//!
//! Every collective is compiled into a *plan*: the chunks to send in order, each possibly
//! waiting for a received chunk, and the chunks to receive in order, each added into or
//! copied over the buffer. One thread drives the plan over non-blocking sockets with
//! poll(2) (`ring/transfer.rs`): it writes whatever is ready, reads whatever has arrived,
//! sums a chunk as soon as it is whole and sends it on, so sending, receiving and summing
//! overlap. A collective that makes no progress for the timeout fails; any failure closes
//! both sockets, so neighbours fail at once instead of waiting out their own timeouts, and
//! the error travels the ring.
//!
//! Ring allreduce is reduce-scatter then allgather (each rank sends 2(W-1)/W of the buffer).
//! Each segment is summed in one order around the ring and then copied, so every rank ends
//! with bit-identical results. Payloads are the host's little-endian f32 bytes, or i64 for
//! [`Group::allreduce_sum_i64`], whose integer sum is exact and the same in any order (what
//! a reproducible job's fixed-point gradients need), or bfloat16 for the part of a buffer
//! [`Group::allreduce_sum_bf16`] is given (each rank summing in f32, the finished segment
//! rounded by its owner before it goes round).
//!
//! A group of many ranks also connects a butterfly (`ring/tree.rs`): its small collectives
//! (a barrier, a step's scalars, an entry's gather) take log2(W) rounds of recursive doubling
//! there instead of 2(W-1) hops around the ring, with results as bit-identical.
//!
//! A group whose hosts span several zones also connects two levels (`ring/levels.rs`): the
//! reductions the butterfly does not take run on a ring inside each zone and one across
//! zones, so the slow links between zones are crossed 2(Z-1) times a reduction instead of
//! 2(W-1).

use crate::dataplane::conn::Conn;
use crate::dataplane::endpoint::Endpoint;
use crate::dataplane::frame::{Channel, Header, Kind, HEADER_LEN};
use crate::dataplane::DataPlaneError;
use std::io::Write;
use std::net::Shutdown;
use std::ops::Range;
use std::time::{Duration, Instant};

#[cfg(feature = "trainer")]
mod as_reduce;
mod levels;
mod relay;
mod transfer;
mod tree;

pub use levels::{spans_zones, zone_members};
use tree::Combine;
pub use tree::HOP_BYTES;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Add,
    /// Add as little-endian i64 pairs of f32 words (wrapping; callers keep sums in range).
    AddI64,
    Copy,
}

#[derive(Debug)]
struct SendItem {
    range: Range<usize>,
    /// Index of the received chunk this one must wait for.
    after: Option<usize>,
}

#[derive(Debug)]
struct RecvItem {
    range: Range<usize>,
    op: Op,
    /// Once whole, the chunk is rounded to bfloat16 in place: an owner's summed segment
    /// before it goes out in bfloat16, so that every rank ends with the same bits.
    round: bool,
}

#[derive(Debug, Default)]
struct Plan {
    sends: Vec<SendItem>,
    recvs: Vec<RecvItem>,
    /// Elements below this index travel as bfloat16, the rest as f32 (chunks never straddle
    /// it): 0 for an exact collective.
    bf16_below: usize,
}

impl Plan {
    /// Bytes one element of `range` takes on the wire.
    fn width(&self, range: &Range<usize>) -> usize {
        if range.end <= self.bf16_below {
            2
        } else {
            4
        }
    }
}

/// A collective's name in errors: its kind and, for other sums than plain f32, how it adds.
fn named(kind: &str, add: Op, lossy: usize) -> String {
    match (add, lossy > 0) {
        (Op::AddI64, _) => format!("{kind} (i64)"),
        (_, true) => format!("{kind} (bf16)"),
        _ => kind.to_string(),
    }
}

/// The ranks of one epoch, connected in a ring.
pub struct Group {
    epoch: u64,
    rank: usize,
    ranks: Vec<u64>,
    timeout: Duration,
    chunk_elems: usize,
    right: Option<Conn>,
    left: Option<Conn>,
    seq: u32,
    broken: Option<String>,
    /// Received bytes before they are added; held as u64s so that, seen as f32 words, any
    /// even offset is 8-aligned and i64 sums can read it in place.
    scratch: Vec<u64>,
    /// The butterfly links small collectives take at large W (`tree.rs`).
    tree: Option<Box<tree::Tree>>,
    /// The rings inside and across zones that the reductions the butterfly does not take
    /// run on, when the ranks span several (`levels.rs`).
    levels: Option<Box<levels::Levels>>,
    /// Which ring this is in error messages: empty for a group's own, `zone ` or
    /// `across-zone ` for its levels'.
    label: &'static str,
}

impl Group {
    pub(crate) fn connect(
        ep: &Endpoint,
        epoch: u64,
        ranks: &[u64],
        addrs: &[String],
        (deadline, abort): (std::time::Instant, &dyn Fn() -> bool),
        tree: bool,
    ) -> Result<Group, DataPlaneError> {
        Group::connect_on(ep, epoch, ranks, addrs, (deadline, abort), Channel::Ring)?.with_tree(
            ep,
            addrs,
            (deadline, abort),
            tree,
        )
    }

    /// A ring of `ranks` on `channel` (the group's own, or one of its levels'), without a
    /// butterfly.
    fn connect_on(
        ep: &Endpoint,
        epoch: u64,
        ranks: &[u64],
        addrs: &[String],
        (deadline, abort): (std::time::Instant, &dyn Fn() -> bool),
        channel: Channel,
    ) -> Result<Group, DataPlaneError> {
        let (right, left) = Group::neighbours(ep, ranks, addrs)?;
        let (mut out, mut inc) = (None, None);
        if let (Some(right), Some(left)) = (right, left) {
            let connect_by = deadline.min(std::time::Instant::now() + ep.config().timeout);
            out = Some(ep.connect_until(&addrs[right], ranks[right], epoch, channel, connect_by, abort)?);
            inc = Some(ep.accept_until(ranks[left], epoch, channel, deadline, abort)?);
        }
        Group::assemble(ep, epoch, ranks, out, inc)
    }

    /// Checks a rank order and returns this node's right and left neighbours' positions
    /// (`None` for a world of one).
    pub fn neighbours(
        ep: &Endpoint,
        ranks: &[u64],
        addrs: &[String],
    ) -> Result<(Option<usize>, Option<usize>), DataPlaneError> {
        let me = ep.config().node;
        let world = ranks.len();
        if world == 0 || addrs.len() != world {
            return Err(DataPlaneError::Config(format!("{world} ranks but {} addresses", addrs.len())));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != world {
            return Err(DataPlaneError::Config(format!("rank order {ranks:?} lists a node twice")));
        }
        let rank = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| DataPlaneError::Config(format!("node {me} is not in the rank order {ranks:?}")))?;
        if world == 1 {
            return Ok((None, None));
        }
        Ok((Some((rank + 1) % world), Some((rank + world - 1) % world)))
    }

    /// Builds a group from its two ring connections, made by the caller (the agent connects
    /// the next epoch's ring while the current one still trains); its butterfly links, if it
    /// takes any, are [`Group::connect_tree`]'s.
    pub fn assemble(
        ep: &Endpoint,
        epoch: u64,
        ranks: &[u64],
        right: Option<Conn>,
        left: Option<Conn>,
    ) -> Result<Group, DataPlaneError> {
        let me = ep.config().node;
        let rank = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| DataPlaneError::Config(format!("node {me} is not in the rank order {ranks:?}")))?;
        if (ranks.len() > 1) != (right.is_some() && left.is_some()) {
            return Err(DataPlaneError::Config(format!(
                "a world of {} needs both ring connections",
                ranks.len()
            )));
        }
        for s in right.iter().chain(left.iter()) {
            s.set_nonblocking(true).map_err(DataPlaneError::io("making a socket non-blocking"))?;
        }
        Ok(Group {
            epoch,
            rank,
            ranks: ranks.to_vec(),
            timeout: ep.config().timeout,
            // Even, so an i64 never straddles two chunks.
            chunk_elems: (ep.config().chunk_bytes / 8).max(1) * 2,
            right,
            left,
            seq: 0,
            broken: None,
            scratch: vec![0; ep.config().chunk_bytes / 8 + 1],
            tree: None,
            levels: None,
            label: "",
        })
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How long a collective may make no progress before it fails (the endpoint's `timeout`
    /// unless set).
    pub fn patience(&self) -> Duration {
        self.timeout
    }

    /// Sets [`Group::patience`]: longer for collectives between which a rank does slow work
    /// of its own, which its peers wait out inside the next one.
    pub fn set_patience(&mut self, timeout: Duration) {
        self.timeout = timeout;
        if let Some(l) = &mut self.levels {
            l.set_patience(timeout);
        }
    }

    /// The epoch the group serves.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// `r` in chunks of at most `chunk_elems`, cut at `split` too (where a bfloat16 part of
    /// the buffer ends) so that no chunk holds elements of both widths.
    fn chunks(&self, r: Range<usize>, split: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut s = r.start;
        while s < r.end {
            let mut e = (s + self.chunk_elems).min(r.end);
            if s < split && split < e {
                e = split;
            }
            out.push(s..e);
            s = e;
        }
        out
    }

    /// Plans a ring pass: at step `g`, send block `send_block(g)` and receive block
    /// `recv_block(g)` with `op(g)`; a send at step g > 0 waits for the same chunk received
    /// at step g - 1 (the ring forwards what it just received).
    /// `bf16_below` as in [`Plan`]; `round(g)` marks step g's receives to be rounded to
    /// bfloat16 once whole (their bfloat16 part).
    #[allow(clippy::too_many_arguments)]
    fn ring_plan(
        &self,
        blocks: &[Range<usize>],
        steps: usize,
        send_block: impl Fn(usize) -> usize,
        recv_block: impl Fn(usize) -> usize,
        op: impl Fn(usize) -> Op,
        bf16_below: usize,
        round: impl Fn(usize) -> bool,
    ) -> Plan {
        let mut plan = Plan { bf16_below, ..Plan::default() };
        let mut prev_recv_start = 0;
        for g in 0..steps {
            let send_chunks = self.chunks(blocks[send_block(g)].clone(), bf16_below);
            for (c, range) in send_chunks.into_iter().enumerate() {
                let after = (g > 0).then_some(prev_recv_start + c);
                plan.sends.push(SendItem { range, after });
            }
            prev_recv_start = plan.recvs.len();
            for range in self.chunks(blocks[recv_block(g)].clone(), bf16_below) {
                let round = round(g) && range.end <= bf16_below;
                plan.recvs.push(RecvItem { range, op: op(g), round });
            }
        }
        plan
    }

    fn check(&self) -> Result<(), DataPlaneError> {
        match &self.broken {
            Some(why) => Err(DataPlaneError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Replaces `buf` with the elementwise sum of every rank's `buf`.
    pub fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), DataPlaneError> {
        self.allreduce_sum_bf16(buf, 0, step)
    }

    /// As [`Group::allreduce_sum`], with `buf[..lossy]` sent in bfloat16, half the bytes:
    /// each rank adds what it receives into its f32 values and sends the sum rounded, and each
    /// segment's last sum is rounded before it goes round, so every rank still ends with the
    /// same bits (each value within a few bfloat16 roundings of the exact sum). The rest of
    /// `buf` (a step's loss and sample count) is summed in f32 as ever.
    pub fn allreduce_sum_bf16(
        &mut self,
        buf: &mut [f32],
        lossy: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.check()?;
        let w = self.world();
        if lossy > buf.len() {
            return Err(DataPlaneError::Config(format!("{lossy} values in bfloat16 of {}", buf.len())));
        }
        if w == 1 {
            return Ok(());
        }
        if lossy == 0 && self.picks_tree(4 * buf.len()) {
            return self.tree_reduce(buf, Combine::Add, &[], step, "allreduce");
        }
        if self.levels.is_some() {
            return self.levels_reduce(buf, (1, Op::Add), lossy, step);
        }
        self.allreduce_op(buf, 1, Op::Add, lossy, step)
    }

    /// The ring's allreduce of `buf` as elements of `unit` words (segments of whole
    /// elements), added with `add`, `buf[..lossy]` in bfloat16.
    fn allreduce_op(
        &mut self,
        buf: &mut [f32],
        unit: usize,
        add: Op,
        lossy: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        let (w, n) = (self.world(), buf.len() / unit);
        if w == 1 {
            return Ok(());
        }
        let blocks: Vec<Range<usize>> =
            (0..w).map(|i| unit * (i * n / w)..unit * ((i + 1) * n / w)).collect();
        let plan = self.allreduce_plan(&blocks, add, lossy);
        self.run(&plan, buf, step, &named("allreduce", add, lossy))
    }

    /// Reduce-scatter with `add` over `blocks` (one per rank), then allgather; values below
    /// `bf16_below` travel in bfloat16, each rank's own segment rounded once summed.
    fn allreduce_plan(&self, blocks: &[Range<usize>], add: Op, bf16_below: usize) -> Plan {
        let (w, r) = (self.world(), self.rank);
        let rs = w - 1;
        self.ring_plan(
            blocks,
            2 * (w - 1),
            |g| if g < rs { (r + w - g) % w } else { (r + 1 + w - (g - rs)) % w },
            |g| if g < rs { (r + 2 * w - g - 1) % w } else { (r + w - (g - rs)) % w },
            |g| if g < rs { add } else { Op::Copy },
            bf16_below,
            |g| g + 1 == rs,
        )
    }

    /// Replaces `buf` with the elementwise sum of every rank's `buf`, as exact integers: the
    /// result does not depend on the ring order or the world size.
    pub fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), DataPlaneError> {
        self.check()?;
        let w = self.world();
        if w == 1 {
            return Ok(());
        }
        let n = buf.len();
        let words: &mut [f32] = bytemuck::cast_slice_mut(buf);
        if self.picks_tree(8 * n) {
            return self.tree_reduce(words, Combine::AddI64, &[], step, "allreduce (i64)");
        }
        if self.levels.is_some() {
            return self.levels_reduce(words, (2, Op::AddI64), 0, step);
        }
        // Segments of whole i64s, counted in the f32 words the ring moves.
        self.allreduce_op(words, 2, Op::AddI64, 0, step)
    }

    /// Replaces `vals` with the elementwise maximum over ranks (through an allgather: small
    /// integers are exact as f32).
    pub fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), DataPlaneError> {
        if vals.iter().any(|v| v.unsigned_abs() > 1 << 24) {
            return Err(DataPlaneError::Config("allreduce_max_i32 takes values within ±2^24".into()));
        }
        let mine: Vec<f32> = vals.iter().map(|&v| v as f32).collect();
        let mut all = vec![0.0f32; mine.len() * self.world()];
        self.allgather(&mine, &mut all, step)?;
        for row in all.chunks(mine.len().max(1)) {
            for (v, &x) in vals.iter_mut().zip(row) {
                *v = (*v).max(x as i32);
            }
        }
        Ok(())
    }

    /// Copies `root`'s `buf` (rank index) to every rank, pipelined along the ring.
    pub fn broadcast(&mut self, buf: &mut [f32], root: usize, step: u64) -> Result<(), DataPlaneError> {
        self.check()?;
        let w = self.world();
        if root >= w {
            return Err(DataPlaneError::Config(format!("broadcast root {root} in a world of {w}")));
        }
        if w == 1 {
            return Ok(());
        }
        if self.picks_tree_for(4 * buf.len(), 1) {
            if self.rank != root {
                buf.fill(0.0);
            }
            return self.tree_reduce(buf, Combine::Or, &[1, root as u64], step, "broadcast");
        }
        let chunks = self.chunks(0..buf.len(), 0);
        let mut plan = Plan::default();
        let last = (root + w - 1) % w;
        if self.rank != root {
            plan.recvs =
                chunks.iter().map(|c| RecvItem { range: c.clone(), op: Op::Copy, round: false }).collect();
        }
        if self.rank != last {
            let relay = self.rank != root;
            plan.sends = chunks
                .into_iter()
                .enumerate()
                .map(|(i, range)| SendItem { range, after: relay.then_some(i) })
                .collect();
        }
        self.run(&plan, buf, step, "broadcast")
    }

    /// Gathers every rank's `mine` into `out`, rank by rank (`out` holds world x mine).
    pub fn allgather(&mut self, mine: &[f32], out: &mut [f32], step: u64) -> Result<(), DataPlaneError> {
        self.check()?;
        let (w, m, r) = (self.world(), mine.len(), self.rank);
        if out.len() != w * m {
            return Err(DataPlaneError::Config(format!(
                "allgather output holds {}, not {w} x {m}",
                out.len()
            )));
        }
        if w > 1 && self.picks_tree_for(4 * out.len(), 1) {
            out.fill(0.0);
            out[r * m..(r + 1) * m].copy_from_slice(mine);
            return self.tree_reduce(out, Combine::Or, &[2, m as u64], step, "allgather");
        }
        out[r * m..(r + 1) * m].copy_from_slice(mine);
        if w == 1 {
            return Ok(());
        }
        let blocks: Vec<Range<usize>> = (0..w).map(|i| i * m..(i + 1) * m).collect();
        let plan = self.ring_plan(
            &blocks,
            w - 1,
            |g| (r + w - g) % w,
            |g| (r + 2 * w - g - 1) % w,
            |_| Op::Copy,
            0,
            |_| false,
        );
        self.run(&plan, out, step, "allgather")
    }

    /// Checks that `blocks` (one per rank, in rank order) tile `0..len` in order.
    fn check_blocks(&self, blocks: &[Range<usize>], len: usize) -> Result<(), DataPlaneError> {
        let tiles = blocks.len() == self.world()
            && blocks.first().is_none_or(|b| b.start == 0)
            && blocks.windows(2).all(|w| w[0].end == w[1].start)
            && blocks.iter().all(|b| b.start <= b.end)
            && blocks.last().is_some_and(|b| b.end == len);
        if tiles {
            Ok(())
        } else {
            Err(DataPlaneError::Config(format!(
                "{} blocks {blocks:?} do not tile a buffer of {len} for a world of {}",
                blocks.len(),
                self.world()
            )))
        }
    }

    /// Reduce-scatter: rank `i` ends with `buf[blocks[i]]` summed over every rank, and with
    /// the sums of the `replicas` blocks before its own (ranks `i - 1`, ..., `i - replicas`
    /// around the ring), forwarded from their owners so that both hold the same bits. What
    /// sharded optimizer state needs: every block's owner and its replica holders update it
    /// from one gradient. The rest of `buf` is left partly summed. Sends (W-1)/W of the buffer
    /// plus the replicas' blocks; each block is summed in one order around the ring, as in
    /// [`Group::allreduce_sum`].
    pub fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.reduce_scatter_sum_bf16(buf, blocks, replicas, 0, step)
    }

    /// As [`Group::reduce_scatter_sum`], with `buf[..lossy]` sent in bfloat16 as
    /// [`Group::allreduce_sum_bf16`] sends it: each block's owner rounds its sum before it
    /// goes to the replicas, so they hold the same bits.
    pub fn reduce_scatter_sum_bf16(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        lossy: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.reduce_scatter_with(buf, blocks, replicas, (Op::Add, lossy), step)
    }

    fn reduce_scatter_with(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        (add, lossy): (Op, usize),
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.check()?;
        if lossy > buf.len() {
            return Err(DataPlaneError::Config(format!("{lossy} values in bfloat16 of {}", buf.len())));
        }
        self.check_blocks(blocks, buf.len())?;
        let (w, r) = (self.world(), self.rank);
        if replicas >= w.max(2) {
            return Err(DataPlaneError::Config(format!("{replicas} replicas in a world of {w}")));
        }
        if w == 1 {
            return Ok(());
        }
        // Step g sends block r-g-1 and receives block r-g-2: after W-1 steps of adding, the
        // last block received is r's own, whole; each step after that forwards the block just
        // received, whole, to the right.
        let plan = self.ring_plan(
            blocks,
            w - 1 + replicas,
            |g| (r + 3 * w - g - 1) % w,
            |g| (r + 3 * w - g - 2) % w,
            |g| if g < w - 1 { add } else { Op::Copy },
            lossy,
            |g| g + 2 == w,
        );
        self.run(&plan, buf, step, &named("reduce-scatter", add, lossy))
    }

    /// Allgather in place: rank `i` contributes `buf[blocks[i]]`, and every rank ends with
    /// every block (the blocks may differ in size, even be empty).
    pub fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.check()?;
        self.check_blocks(blocks, buf.len())?;
        let (w, r) = (self.world(), self.rank);
        if w == 1 {
            return Ok(());
        }
        if self.picks_tree_for(4 * buf.len(), 1) {
            let own = blocks[r].clone();
            buf[..own.start].fill(0.0);
            buf[own.end..].fill(0.0);
            let shape: Vec<u64> = std::iter::once(3).chain(blocks.iter().map(|b| b.end as u64)).collect();
            return self.tree_reduce(buf, Combine::Or, &shape, step, "allgather");
        }
        self.allgather_op(buf, blocks, 0, step)
    }

    /// The ring's allgather of `blocks`, `buf[..bf16_below]` in bfloat16 (values already
    /// rounded to it, which it carries exactly).
    fn allgather_op(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        bf16_below: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.check()?;
        self.check_blocks(blocks, buf.len())?;
        let (w, r) = (self.world(), self.rank);
        if w == 1 {
            return Ok(());
        }
        let plan = self.ring_plan(
            blocks,
            w - 1,
            |g| (r + w - g) % w,
            |g| (r + 2 * w - g - 1) % w,
            |_| Op::Copy,
            bf16_below,
            |_| false,
        );
        self.run(&plan, buf, step, "allgather")
    }

    /// Returns once every rank has called it (or fails like any collective).
    pub fn barrier(&mut self, step: u64) -> Result<(), DataPlaneError> {
        let mut one = [1.0f32];
        self.allreduce_sum(&mut one, step)?;
        if one[0] != self.world() as f32 {
            return Err(DataPlaneError::Protocol(format!(
                "barrier counted {} of {} ranks",
                one[0],
                self.world()
            )));
        }
        Ok(())
    }

    fn run(&mut self, plan: &Plan, buf: &mut [f32], step: u64, what: &str) -> Result<(), DataPlaneError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let during = format!("{}{what} #{seq} of step {step}, epoch {}", self.label, self.epoch);
        match self.drive(plan, buf, step, seq, &during) {
            Ok(()) => {
                let frames = |items: &mut dyn Iterator<Item = &Range<usize>>| {
                    items.map(|r| (HEADER_LEN + plan.width(r) * r.len()) as u64).sum::<u64>()
                };
                super::count_bytes(true, "ring", frames(&mut plan.sends.iter().map(|s| &s.range)));
                super::count_bytes(false, "ring", frames(&mut plan.recvs.iter().map(|r| &r.range)));
                Ok(())
            }
            Err(e) => {
                self.break_group(&e, step, seq);
                Err(e)
            }
        }
    }

    /// Clones of every socket of the group: shutting them down from another thread breaks
    /// a collective blocked on them at once, and its peers see the group closed.
    pub fn sockets(&self) -> Vec<std::net::TcpStream> {
        let ring =
            [&self.right, &self.left].into_iter().flatten().filter_map(|c| c.socket().try_clone().ok());
        ring.chain(self.tree_sockets()).chain(self.levels_sockets()).collect()
    }

    /// Tells the right neighbour we gave up, then closes both sockets so both neighbours
    /// see the failure at once.
    fn break_group(&mut self, e: &DataPlaneError, step: u64, seq: u32) {
        self.broken = Some(e.to_string());
        if let Some(right) = &self.right {
            let abort = Header { kind: Kind::Abort, epoch: self.epoch, step, seq, len: 0 }.encode();
            let _ = (&*right).write(&abort);
        }
        for s in [&self.right, &self.left].into_iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.break_tree(step, seq);
        self.break_levels(e, step);
    }
}

// Forming a group is the endpoint's to offer, but the ring's to do: the methods live here so
// the endpoint (which only connects and accepts) does not depend on the ring.
impl Endpoint {
    /// Builds the collective group of `epoch`: `ranks` in rank order (node ids) and their
    /// data addresses; this node must be among them.
    pub fn group(&self, epoch: u64, ranks: &[u64], addrs: &[String]) -> Result<Group, DataPlaneError> {
        Group::connect(self, epoch, ranks, addrs, (Instant::now() + self.config().timeout, &|| false), true)
    }

    /// Forms a group whose members may arrive at different times: waits for the left
    /// neighbour until `deadline`, giving up early when `abort` returns true.
    pub fn group_until(
        &self,
        epoch: u64,
        ranks: &[u64],
        addrs: &[String],
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<Group, DataPlaneError> {
        Group::connect(self, epoch, ranks, addrs, (deadline, abort), true)
    }

    /// As [`Endpoint::group_until`], with butterfly links only if `tree` (and the group is
    /// large enough): every rank must pass the same, as every host of the epoch advertises
    /// the butterfly or not.
    pub fn group_until_with(
        &self,
        epoch: u64,
        ranks: &[u64],
        addrs: &[String],
        (deadline, abort): (Instant, &dyn Fn() -> bool),
        tree: bool,
    ) -> Result<Group, DataPlaneError> {
        Group::connect(self, epoch, ranks, addrs, (deadline, abort), tree)
    }
}

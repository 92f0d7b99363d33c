//! Local ranks: one host's devices, each trained by a [`Trainer`] on a thread of its own,
//! reducing as one member of the hosts' ring.
//!
//! Each collective is hierarchical. The buffer is cut into chunks (the same cut on every
//! host: it depends only on the length and the epoch's lane count, see [`cut`]), each summed
//! in host memory of its own: every local rank adds its part of each chunk, starting at a
//! chunk of its own so that the ranks add in parallel (no socket between them, no copy but
//! those adds). The hosts' sums then go around the ring between them on several lanes at
//! once, as NCCL runs several channels: local rank `i` drives lane `i` (its own ring of TCP
//! connections, `inter`; a single process's [`crate::NoReduce`] in tests) with the chunks
//! `c` where `c % lanes == i`, in order, so every host puts each chunk on the same lane in
//! the same order. Every local rank then copies the result back, again in parallel. The
//! ring carries one buffer per host whatever its devices, and a job's ranks are its devices:
//! rank `first + i` of `world` is local rank `i` of the host whose ranks start at `first`.
//!
//! Integer sums (a reproducible job's fixed point) do not depend on the order of the adds,
//! so two hosts of two devices and four hosts of one train the same bits. An f32 sum of three
//! or more local ranks adds in the order the ranks reach a chunk, so its last bits may differ
//! from run to run (as the ordinary path's do with the micro-batches); within a run every
//! local rank copies the one sum, and the ring gives every host the same bytes.
//!
//! Sharded state goes the same way. A reduce-scatter sums the host's buffers as above, and
//! the hosts reduce-scatter between them by host: host `h`'s block is the blocks of its
//! ranks, and the `replicas` hosts before it send it theirs, which hold the blocks of the
//! same local ranks there ([`crate::ShardLayout::over_host_counts`]; on hosts of unequal
//! device counts a host's ranks past the fewest any host has own empty blocks); every local
//! rank then copies the host's sums back. An allgather puts each local rank's own block into the host's
//! buffer and the hosts allgather their blocks. Either moves between hosts what one rank per
//! host would move with the same blocks.
//!
//! A local rank that leaves the step early (an error, a panic) marks the group aborted as
//! it is dropped, and every local rank waiting for it returns an error instead of waiting
//! for ever.

use super::buckets::within;
use super::Trainer;
use crate::train::reduce::relay_by_sums;
use crate::{Piece, Reduce, TrainerError};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use tch::Tensor;

/// A failure of the collective between hosts, as every local rank reports it.
#[derive(Clone, Debug)]
struct Failed {
    peer: Option<u64>,
    detail: String,
    violation: bool,
}

impl Failed {
    fn of(e: &TrainerError) -> Failed {
        match e {
            TrainerError::Reduce { peer, detail, violation } => {
                Failed { peer: *peer, detail: detail.clone(), violation: *violation }
            }
            other => Failed { peer: None, detail: other.to_string(), violation: false },
        }
    }

    fn error(&self) -> TrainerError {
        TrainerError::Reduce { peer: self.peer, detail: self.detail.clone(), violation: self.violation }
    }
}

/// Most values per chunk of a hierarchical collective: large enough that the ring's cost per
/// collective is nothing beside a chunk's bytes, small enough that local ranks add in
/// parallel on a large model. A constant, so every host cuts a buffer alike.
pub const CHUNK: usize = 1 << 22;

/// Fewest values a lane takes of a buffer: a smaller collective (a step's scalars, an
/// entry's facts) goes on fewer lanes, where one more ring round would cost more than its
/// bytes.
pub const MIN_LANE_VALUES: usize = 1 << 13;

/// The chunks a buffer of `len` values is cut into over `lanes` lanes (one chunk, empty, for
/// an empty buffer: every host still calls the ring). On one lane, pieces of [`CHUNK`]
/// values and the rest, as agents before lanes cut. Over several, near-equal chunks of at
/// most [`CHUNK`] values, as many on each lane the buffer fills. Chunk `c` goes on lane
/// `c % lanes`. A function of the length and the lane count alone, so every host cuts alike.
pub fn cut(len: usize, lanes: usize) -> Vec<std::ops::Range<usize>> {
    let filled = lanes.min(len / MIN_LANE_VALUES).max(1);
    if filled == 1 {
        let m = len.div_ceil(CHUNK).max(1);
        return (0..m).map(|c| (c * CHUNK).min(len)..((c + 1) * CHUNK).min(len)).collect();
    }
    let m = len.div_ceil(CHUNK).div_ceil(filled).max(1) * filled;
    (0..m).map(|c| c * len / m..(c + 1) * len / m).collect()
}

/// One chunk's host sum, in the element type of the collective running.
#[derive(Default)]
struct Chunk {
    /// Local ranks whose part is in the sum.
    added: usize,
    f32s: Vec<f32>,
    i64s: Vec<i64>,
    i32s: Vec<i32>,
    /// Sums of the chunk's gradient values on a device (see `local/on_device.rs`), one per
    /// size and device the chunk has had (an overlapped step's buckets cut it differently):
    /// kept from step to step, dropped with [`LocalSums::drop_device_sums`].
    dev: Vec<Tensor>,
    /// The chunk in host memory as its lane driver crosses it between hosts, when its sum is
    /// on a device: page-locked on a GPU, reused while the chunk keeps its size.
    staging: Option<Tensor>,
}

#[derive(Default)]
struct State {
    /// Local ranks at the current barrier, and barriers completed.
    arrived: usize,
    generation: u64,
    /// Why the group can no longer complete a collective (a local rank left).
    aborted: Option<String>,
    /// The host sums of the chunks, kept from step to step (see [`LocalSums`]).
    sums: LocalSums,
    /// The current collective's length, element type and values on the devices, as its
    /// first local rank gave them: every other rank must give the same.
    shape: Option<(usize, &'static str, usize)>,
    /// Each local rank's device, as the current collective on the devices gave them.
    devices: Vec<Option<tch::Device>>,
    /// The collective between hosts failed (every local rank returns it).
    failed: Option<Failed>,
}

/// The memory of a host's sums (model-sized), kept by the agent from one step's
/// [`LocalGroup`] to the next so that a step allocates none.
#[derive(Clone, Default)]
pub struct LocalSums(Arc<Mutex<Vec<Arc<Mutex<Chunk>>>>>);

impl LocalSums {
    /// The first `m` chunks, made where missing.
    fn first(&self, m: usize) -> Vec<Arc<Mutex<Chunk>>> {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        while all.len() < m {
            all.push(Arc::default());
        }
        all[..m].to_vec()
    }

    /// Frees the chunks' sums on the devices (an epoch that sums in host memory, or on
    /// other devices, has no use for them).
    pub fn drop_device_sums(&self) {
        for c in self.0.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let mut chunk = lock_chunk(c);
            chunk.dev.clear();
            chunk.staging = None;
        }
    }

    /// Every chunk counts no rank's part yet (a group left aborted mid-sum leaves counts).
    fn reset(&self) {
        for c in self.0.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            lock_chunk(c).added = 0;
        }
    }
}

/// Locks a chunk (one whose holder panicked is still whole: every update under it is a
/// plain add or copy, and the group is aborted anyway).
fn lock_chunk(c: &Mutex<Chunk>) -> MutexGuard<'_, Chunk> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

struct Shared {
    n: usize,
    /// The job's rank of local rank 0 (local rank `i` is rank `first + i`).
    first: usize,
    /// Ranks on each host of the job, in host order, when known (this host's count is
    /// `n`): blocks of sharded state group by host from them, and a relay goes between hosts
    /// only where a piece's takers are. Unknown: hosts of `n` each for blocks, and a relay
    /// sums every piece's bits on every host.
    counts: Option<Vec<usize>>,
    /// Lanes between hosts: local ranks `0..lanes` each drive one.
    lanes: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A local rank that panicked while holding the lock aborted the group by dropping;
        // the state is still whole (no update is left half done under the lock).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until all `n` local ranks reach this barrier; the last one runs `last` first.
    fn barrier<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        last: impl FnOnce(&mut State),
    ) -> Result<MutexGuard<'a, State>, TrainerError> {
        if let Some(why) = &st.aborted {
            return Err(TrainerError::reduce(why.clone()));
        }
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.generation += 1;
            last(&mut st);
            self.changed.notify_all();
            return Ok(st);
        }
        let at = st.generation;
        while st.generation == at {
            if let Some(why) = &st.aborted {
                return Err(TrainerError::reduce(why.clone()));
            }
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        Ok(st)
    }
}

/// The local ranks of one host for one step: [`LocalGroup::rank`] hands each its [`Reduce`].
/// (A rank dropped at the end of the step marks the group aborted: a step makes a new one.)
pub struct LocalGroup {
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// A group of `n` local ranks (at least one) on one lane, with sums of its own, its
    /// local rank 0 the job's rank 0.
    pub fn new(n: usize) -> LocalGroup {
        LocalGroup::with_sums(n, 0, 1, &LocalSums::default())
    }

    /// A group of `n` local ranks, the job's ranks `first..first + n`, driving `lanes`
    /// lanes between hosts (at least one, at most `n`: every host of the epoch must use the
    /// same count), summing into `sums` (no other group may be using them).
    pub fn with_sums(n: usize, first: usize, lanes: usize, sums: &LocalSums) -> LocalGroup {
        LocalGroup::of_hosts(n, first, lanes, sums, None)
    }

    /// The same, told (with `Some(hosts)`) that the job's ranks are `hosts` hosts of `n`
    /// local ranks each: a relay then goes between hosts by host, where otherwise each host
    /// sums every piece's bits. Every host of the epoch must be told alike.
    pub fn of_hosts(
        n: usize,
        first: usize,
        lanes: usize,
        sums: &LocalSums,
        hosts: Option<usize>,
    ) -> LocalGroup {
        LocalGroup::with_counts(n, first, lanes, sums, hosts.map(|h| vec![n.max(1); h]))
    }

    /// The same, told the job's ranks on each host, in host order (`counts`, this host's
    /// `n` among them): sharded state's blocks group by host from them, and a relay goes
    /// between hosts by host. Every host of the epoch must be told alike.
    pub fn of_host_counts(
        n: usize,
        first: usize,
        lanes: usize,
        sums: &LocalSums,
        counts: Vec<usize>,
    ) -> LocalGroup {
        LocalGroup::with_counts(n, first, lanes, sums, Some(counts))
    }

    fn with_counts(
        n: usize,
        first: usize,
        lanes: usize,
        sums: &LocalSums,
        counts: Option<Vec<usize>>,
    ) -> LocalGroup {
        sums.reset();
        let n = n.max(1);
        let state = State { sums: sums.clone(), ..State::default() };
        let lanes = lanes.clamp(1, n);
        let shared = Shared { n, first, counts, lanes, state: Mutex::new(state), changed: Condvar::new() };
        LocalGroup { shared: Arc::new(shared) }
    }

    /// Local rank `index` (below the group's size, each taken once)'s reduce; the first
    /// `lanes` local ranks each carry `inter`, their lane between hosts (the others `None`,
    /// as do the lanes' ranks of a host alone: its sums are the job's).
    pub fn rank<'a>(&self, index: usize, inter: Option<&'a mut (dyn Reduce + Send)>) -> LocalRank<'a> {
        debug_assert!(index < self.shared.n, "local rank {index} of {}", self.shared.n);
        LocalRank { index, shared: Arc::clone(&self.shared), inter }
    }
}

/// One local rank's side of a [`LocalGroup`].
pub struct LocalRank<'a> {
    index: usize,
    shared: Arc<Shared>,
    inter: Option<&'a mut (dyn Reduce + Send)>,
}

impl Drop for LocalRank<'_> {
    fn drop(&mut self) {
        // Whoever still waits for this rank would wait for ever: they fail instead. (After
        // a complete step nobody waits, and the mark is never read.)
        let mut st = self.shared.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!("local rank {} left the step", self.index));
        }
        self.shared.changed.notify_all();
    }
}

/// How a local rank's buffer goes into the host's.
enum Local<T> {
    /// Combined with every other local rank's, elementwise.
    Combine(fn(&mut T, T)),
    /// Only these values of it, which no other local rank gives (an allgather's block, a
    /// relay's pieces).
    Place(Vec<Range<usize>>),
}

/// What a lane does with one chunk of the host's buffer between hosts: the chunk, which
/// values of the whole buffer it holds, the step.
type Between<'b, T> = &'b dyn Fn(&mut dyn Reduce, &mut [T], Range<usize>, u64) -> Result<(), TrainerError>;

impl LocalRank<'_> {
    /// The job's ranks on each host, in host order: the counts told, else hosts of `n`
    /// each for `world` ranks.
    fn counts(&self, world: usize) -> Vec<usize> {
        let n = self.shared.n;
        self.shared.counts.clone().unwrap_or_else(|| vec![n; world / n])
    }

    /// Each host's block of `blocks` (one per rank of the job, in rank order, host after
    /// host as [`LocalRank::counts`] gives them), this local rank's own, and the host
    /// counts, checked to hold this host's ranks where the group says.
    #[allow(clippy::type_complexity)]
    fn host_blocks(
        &self,
        blocks: &[Range<usize>],
    ) -> Result<(Vec<Range<usize>>, Range<usize>, Vec<usize>), TrainerError> {
        let (n, first, me) = (self.shared.n, self.shared.first, self.shared.first + self.index);
        let counts = self.counts(blocks.len());
        let firsts: Vec<usize> = firsts(&counts);
        let here = firsts.iter().position(|&f| f == first).filter(|&h| counts[h] == n);
        if counts.iter().sum::<usize>() != blocks.len() || counts.contains(&0) || here.is_none() {
            return Err(TrainerError::Config(format!(
                "{} blocks for hosts of {counts:?} local ranks, this one rank {me} of a host of {n} from rank {first}",
                blocks.len()
            )));
        }
        let hosts =
            firsts.iter().zip(&counts).map(|(&f, &c)| blocks[f].start..blocks[f + c - 1].end).collect();
        Ok((hosts, blocks[me].clone(), counts))
    }

    /// The start of a collective of `len` values of type `ty` over `m` chunks: checked to
    /// be what every other local rank gives (local ranks run the same code on the same job,
    /// so a mismatch is a bug, not a peer), and the chunks' sums.
    fn begin(
        &self,
        (len, ty, on_device): (usize, &'static str, usize),
        m: usize,
    ) -> Result<Vec<Arc<Mutex<Chunk>>>, TrainerError> {
        let shared = &self.shared;
        let mut st = shared.lock();
        if let Some(why) = &st.aborted {
            return Err(TrainerError::reduce(why.clone()));
        }
        let shape = (len, ty, on_device);
        if *st.shape.get_or_insert(shape) != shape {
            let detail = format!(
                "local rank {} reduces {len} values of {ty} ({on_device} on its device), another {:?}",
                self.index, st.shape
            );
            st.aborted = Some(detail.clone());
            shared.changed.notify_all();
            return Err(TrainerError::Reduce { peer: None, detail, violation: true });
        }
        Ok(st.sums.first(m))
    }

    /// The chunks of `m` in the order this rank visits them: from a chunk of its own, so
    /// that ranks seldom wait for one another.
    fn order(&self, m: usize) -> impl Iterator<Item = usize> + Clone {
        let start = if m == 0 { 0 } else { self.index * m / self.shared.n };
        (0..m).map(move |j| (start + j) % m)
    }

    /// Once this rank's part is in every chunk's sum: waits for the others', then each lane
    /// crosses its chunks (`each`, driven by the lane's local rank, in order: every host
    /// cuts alike), then waits for the lanes. The outer error is the group's abort (return
    /// at once); the inner one a lane's failure, which every local rank returns after the
    /// collective's end.
    #[allow(clippy::type_complexity)]
    fn cross(
        &mut self,
        chunks: &[Arc<Mutex<Chunk>>],
        ranges: &[Range<usize>],
        each: &mut dyn FnMut(&mut dyn Reduce, &mut Chunk, Range<usize>) -> Result<(), TrainerError>,
    ) -> Result<Result<(), TrainerError>, TrainerError> {
        let shared = Arc::clone(&self.shared);
        drop(shared.barrier(shared.lock(), |_| {})?);
        if let Some(inter) = self.inter.as_mut() {
            // The lanes run at once, the other local ranks wait on the condition variable
            // meanwhile, and one that leaves can still say so. A lane that fails stops; the
            // others finish theirs (their peers are still sending).
            for (c, range) in chunks.iter().zip(ranges).skip(self.index).step_by(shared.lanes) {
                let mut chunk = lock_chunk(c);
                let crossed = each(&mut **inter, &mut chunk, range.clone());
                // Never the state's lock under a chunk's (barrier 3 takes them the other way).
                drop(chunk);
                if let Err(e) = crossed {
                    shared.lock().failed = Some(Failed::of(&e));
                    break;
                }
            }
        }
        let st = shared.barrier(shared.lock(), |_| {})?;
        Ok(match st.failed.clone() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        })
    }

    /// The collective's end: nobody starts the next collective's sums before every rank
    /// has copied this one's.
    fn end(&self, chunks: &[Arc<Mutex<Chunk>>]) -> Result<(), TrainerError> {
        let shared = &self.shared;
        drop(shared.barrier(shared.lock(), |s| {
            s.failed = None;
            s.shape = None;
            for c in chunks {
                lock_chunk(c).added = 0;
            }
        })?);
        Ok(())
    }

    /// The hierarchical collective: every local rank's `buf` combined into the host's sums
    /// (chunk by chunk, the ranks in parallel), each sum through its lane between hosts
    /// (driven by the local rank of that lane), and the result copied to every local rank.
    fn all<T: Copy + Default>(
        &mut self,
        buf: &mut [T],
        step: u64,
        slot: fn(&mut Chunk) -> &mut Vec<T>,
        local: Local<T>,
        between: Between<'_, T>,
        back: Option<&[Range<usize>]>,
    ) -> Result<(), TrainerError> {
        let ranges = cut(buf.len(), self.shared.lanes);
        let chunks = self.begin((buf.len(), std::any::type_name::<T>(), 0), ranges.len())?;
        for c in self.order(ranges.len()) {
            let mut chunk = lock_chunk(&chunks[c]);
            let first = chunk.added == 0;
            chunk.added += 1;
            let range = ranges[c].clone();
            let (part, sum) = (&buf[range.clone()], slot(&mut chunk));
            match &local {
                Local::Combine(_) if first => {
                    sum.clear();
                    sum.extend_from_slice(part);
                }
                Local::Combine(combine) => sum.iter_mut().zip(part).for_each(|(a, &b)| combine(a, b)),
                Local::Place(own) => {
                    if first {
                        sum.clear();
                        sum.resize(range.len(), T::default());
                    }
                    for own in own {
                        let (lo, hi) =
                            (own.start.clamp(range.start, range.end), own.end.clamp(range.start, range.end));
                        sum[lo - range.start..hi - range.start].copy_from_slice(&buf[lo..hi]);
                    }
                }
            }
        }
        let outcome = self
            .cross(&chunks, &ranges, &mut |inter, chunk, range| between(inter, slot(chunk), range, step))?;
        if outcome.is_ok() {
            for c in self.order(ranges.len()) {
                let mut chunk = lock_chunk(&chunks[c]);
                let (range, sum) = (ranges[c].clone(), slot(&mut chunk));
                match back {
                    None => buf[range].copy_from_slice(sum),
                    Some(back) => {
                        for b in back {
                            let (lo, hi) =
                                (b.start.clamp(range.start, range.end), b.end.clamp(range.start, range.end));
                            buf[lo..hi].copy_from_slice(&sum[lo - range.start..hi - range.start]);
                        }
                    }
                }
            }
        }
        self.end(&chunks)?;
        outcome
    }
}

impl Reduce for LocalRank<'_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        self.allreduce_sum_bf16(buf, 0, step)
    }

    fn allreduce_sum_bf16(&mut self, buf: &mut [f32], lossy: usize, step: u64) -> Result<(), TrainerError> {
        // Summed on the host in f32, then between hosts with each chunk's part below `lossy`
        // in bfloat16.
        let add = Local::Combine(|a: &mut f32, b| *a += b);
        let between = |r: &mut dyn Reduce, b: &mut [f32], range: Range<usize>, s: u64| {
            r.allreduce_sum_bf16(b, lossy.saturating_sub(range.start).min(range.len()), s)
        };
        self.all(buf, step, |c| &mut c.f32s, add, &between, None)
    }

    fn sums_on_device(&self) -> bool {
        true
    }

    fn allreduce_sum_on_device(
        &mut self,
        on_device: &Tensor,
        buf: &mut [f32],
        lossy: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        self.all_on_device(on_device, buf, lossy, step)
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        let add = Local::Combine(|a: &mut i64, b| *a = a.wrapping_add(b));
        self.all(buf, step, |s| &mut s.i64s, add, &|r, b, _, s| r.allreduce_sum_i64(b, s), None)
    }

    fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), TrainerError> {
        let max = Local::Combine(|a: &mut i32, b| *a = (*a).max(b));
        self.all(vals, step, |c| &mut c.i32s, max, &|r, b, _, s| r.allreduce_max_i32(b, s), None)
    }

    fn host_counts(&self, world: usize) -> Vec<usize> {
        self.counts(world)
    }

    fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        self.reduce_scatter_sum_bf16(buf, blocks, replicas, 0, step)
    }

    fn reduce_scatter_sum_bf16(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        lossy: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        // The host's sum of every value, then the hosts' reduce-scatter by host: this host
        // ends with its block and its replicas' hosts' blocks, which hold every block its
        // local ranks hold.
        let (hosts, _, counts) = self.host_blocks(blocks)?;
        let add = Local::Combine(|a: &mut f32, b| *a += b);
        let between = |r: &mut dyn Reduce, b: &mut [f32], range: Range<usize>, s: u64| {
            let lossy = lossy.saturating_sub(range.start).min(range.len());
            r.reduce_scatter_sum_bf16(b, &within(&hosts, range), replicas, lossy, s)
        };
        // Each device copies back only the blocks it holds (its own, and the same local
        // rank's on the hosts before: a layout over these hosts says which): the rest is
        // undefined anyway.
        let me = self.shared.first + self.index;
        let replicas = replicas.min(counts.len() - 1);
        let held: Vec<Range<usize>> = crate::ShardLayout::over_host_counts(buf.len(), &counts, me, replicas)?
            .held()
            .into_iter()
            .map(|b| blocks[b].clone())
            .collect();
        self.all(buf, step, |c| &mut c.f32s, add, &between, Some(&held))
    }

    fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[Piece],
        rank: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        let (n, first) = (self.shared.n, self.shared.first);
        let Some(counts) = self.shared.counts.as_ref() else {
            // Hosts of unknown device counts: every host sums the pieces' bits alike.
            return relay_by_sums(self, buf, pieces, rank, step);
        };
        let firsts: Vec<usize> = firsts(counts);
        let world: usize = counts.iter().sum();
        let bad = |p: &Piece| {
            p.range.start > p.range.end
                || p.range.end > buf.len()
                || p.giver >= world
                || p.to.iter().any(|&t| t >= world)
        };
        let here = firsts.iter().position(|&f| f == first).filter(|&h| counts[h] == n);
        let (Some(host), true, false) = (here, rank == first + self.index, pieces.iter().any(bad)) else {
            return Err(TrainerError::Config(format!(
                "a relay as rank {rank} (local rank {} of the host from rank {first}) for hosts of {counts:?}, over {} values, of {} pieces: one out of range",
                self.index,
                buf.len(),
                pieces.len()
            )));
        };
        // The host of a rank below `world` (checked above for every piece).
        let host_of = |r: usize| firsts.partition_point(|&f| f <= r) - 1;
        // What this device gives goes into the host's buffer; between hosts each piece goes
        // from its giver's host to its takers' hosts (nowhere when they are all on the
        // giver's); every device then copies the host's buffer, which holds what it takes.
        let gives: Vec<Range<usize>> =
            pieces.iter().filter(|p| p.giver == rank).map(|p| p.range.clone()).collect();
        let by_host: Vec<Piece> = pieces
            .iter()
            .filter_map(|p| {
                let giver = host_of(p.giver);
                let mut to: Vec<usize> = p.to.iter().map(|&t| host_of(t)).filter(|&h| h != giver).collect();
                to.sort_unstable();
                to.dedup();
                (!to.is_empty() && !p.range.is_empty()).then(|| Piece { giver, range: p.range.clone(), to })
            })
            .collect();
        let between = |r: &mut dyn Reduce, b: &mut [f32], range: Range<usize>, s: u64| {
            let within: Vec<Piece> = by_host
                .iter()
                .filter_map(|p| {
                    let (lo, hi) = (p.range.start.max(range.start), p.range.end.min(range.end));
                    (lo < hi).then(|| Piece {
                        giver: p.giver,
                        range: lo - range.start..hi - range.start,
                        to: p.to.clone(),
                    })
                })
                .collect();
            r.relay(b, &within, host, s)
        };
        // Each device copies back only what it takes: the rest is undefined anyway.
        let takes: Vec<Range<usize>> =
            pieces.iter().filter(|p| p.to.contains(&rank)).map(|p| p.range.clone()).collect();
        self.all(buf, step, |c| &mut c.f32s, Local::Place(gives), &between, Some(&takes))
    }

    fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        step: u64,
    ) -> Result<(), TrainerError> {
        let (hosts, own, _) = self.host_blocks(blocks)?;
        let between = |r: &mut dyn Reduce, b: &mut [f32], range: Range<usize>, s: u64| {
            r.allgather_blocks(b, &within(&hosts, range), s)
        };
        self.all(buf, step, |c| &mut c.f32s, Local::Place(vec![own]), &between, None)
    }
}

/// The first rank of each host, for hosts of `counts` ranks in host order.
fn firsts(counts: &[usize]) -> Vec<usize> {
    counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect()
}

/// Stamps that tell one state of a trainer from another: a fresh trainer and every state
/// loaded into one take a new stamp, so a follower knows when its leader's state was
/// replaced rather than stepped.
static STAMPS: AtomicU64 = AtomicU64::new(1);

pub(super) fn next_stamp() -> u64 {
    STAMPS.fetch_add(1, Ordering::Relaxed)
}

impl Trainer {
    /// Whether this trainer (a local rank on another device of the host) holds `leader`'s
    /// state: it copied the leader's current state, and both applied the same steps since.
    pub fn follows(&self, leader: &Trainer) -> bool {
        self.following == Some(leader.stamp) && self.step == leader.step
    }

    /// Makes this trainer hold `leader`'s state and follow its plan: a copy of its state when
    /// it does not [`Trainer::follows`] it, else nothing but the plan. Local ranks that apply
    /// the same reduced buffers stay equal step after step. Whether it copied.
    /// Local ranks with sharded state each hold their own blocks: nothing is copied, but
    /// they must be at the leader's step, sharded alike (else the group cannot train, and the
    /// next entry regroups every local rank).
    pub fn follow(&mut self, leader: &Trainer) -> Result<bool, TrainerError> {
        if self.shard.is_some() || leader.shard.is_some() {
            let group = |t: &Trainer| {
                t.shard_layout().map(|l| (l.tag(), l.world(), l.counts().to_vec(), l.replicas()))
            };
            if self.shard.is_none() || group(self) != group(leader) || self.step != leader.step {
                return Err(TrainerError::Reduce {
                    peer: None,
                    detail: format!(
                        "a local rank at step {} (sharded: {}), the host's at step {} (sharded: {})",
                        self.step,
                        self.shard.is_some(),
                        leader.step,
                        leader.shard.is_some()
                    ),
                    violation: false,
                });
            }
            self.take_plan(leader);
            return Ok(false);
        }
        let copy = !self.follows(leader);
        if copy {
            self.copy_state_from(leader)?;
            self.following = Some(leader.stamp);
        }
        self.take_plan(leader);
        Ok(copy)
    }

    /// Makes this trainer's state (parameters, optimizer state, step, data position, random
    /// state, predicted exponents) a copy of `leader`'s, tensor by tensor from its device to
    /// this one's: no image and no copy through host memory. Both of one job, unsharded. A
    /// pipeline stage's leader may hold other blocks than this trainer (its stage changed at
    /// an entry): this trainer is then made anew on its device for the leader's blocks.
    fn copy_state_from(&mut self, leader: &Trainer) -> Result<(), TrainerError> {
        leader.refuse_sharded("a local rank's copy of the host's state")?;
        if let Some(d) = self.job.diff(&leader.job) {
            return Err(TrainerError::Mismatch(format!("job field {d} (a local rank vs the host's)")));
        }
        if self.model.blocks() != leader.model.blocks() {
            let (blocks, device) = (leader.model.blocks(), self.model.device());
            *self = Trainer::on_device(self.job.clone(), self.data.shallow_clone(), blocks, device)?;
        }
        self.drop_shard();
        self.stamp = next_stamp();
        // Lazy zero moments (a view of one zero) cannot be written into: this rank's get
        // memory; the leader's read as zeros.
        self.optim.materialize();
        let pairs: Vec<(Tensor, Tensor)> = {
            let (mine, theirs) = (self.model.params(), leader.model.params());
            let params =
                mine.iter().zip(theirs).map(|((_, d), (_, s))| (d.shallow_clone(), s.shallow_clone()));
            let slots = self
                .optim
                .named_state(mine)
                .zip(leader.optim.named_state(theirs))
                .map(|((_, d), (_, s))| (d.shallow_clone(), s.shallow_clone()));
            params.chain(slots).collect()
        };
        tch::no_grad(|| -> Result<(), TrainerError> {
            for (mut dst, src) in pairs {
                dst.f_copy_(&src)?;
            }
            Ok(())
        })?;
        self.step = leader.step;
        self.cursor = leader.cursor;
        self.rng = leader.rng;
        self.exact_exponents = leader.exact_exponents.clone();
        self.exact_sum = None;
        Ok(())
    }

    /// The leader's batch plan, learning-rate scale and shares.
    fn take_plan(&mut self, leader: &Trainer) {
        self.plan = leader.plan;
        self.lr_scale = leader.lr_scale;
        self.shares = leader.shares.clone();
    }
}

mod on_device;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod collective_tests;

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
//! A local rank that leaves the step early (an error, a panic) marks the group aborted as
//! it is dropped, and every local rank waiting for it returns an error instead of waiting
//! for ever.

use super::Trainer;
use crate::{Reduce, TrainerError};
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
    /// The current collective's length and element type, as its first local rank gave them:
    /// every other rank must give the same.
    shape: Option<(usize, &'static str)>,
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
    /// A group of `n` local ranks (at least one) on one lane, with sums of its own.
    pub fn new(n: usize) -> LocalGroup {
        LocalGroup::with_sums(n, 1, &LocalSums::default())
    }

    /// A group of `n` local ranks driving `lanes` lanes between hosts (at least one, at
    /// most `n`: every host of the epoch must use the same count), summing into `sums` (no
    /// other group may be using them).
    pub fn with_sums(n: usize, lanes: usize, sums: &LocalSums) -> LocalGroup {
        sums.reset();
        let n = n.max(1);
        let state = State { sums: sums.clone(), ..State::default() };
        let shared =
            Shared { n, lanes: lanes.clamp(1, n), state: Mutex::new(state), changed: Condvar::new() };
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

impl LocalRank<'_> {
    /// The hierarchical collective: every local rank's `buf` combined into the host's sums
    /// (chunk by chunk, the ranks in parallel), each sum through its lane between hosts
    /// (driven by the local rank of that lane), and the result copied to every local rank.
    fn all<T: Copy + Default>(
        &mut self,
        buf: &mut [T],
        step: u64,
        slot: fn(&mut Chunk) -> &mut Vec<T>,
        combine: fn(&mut T, T),
        between: fn(&mut dyn Reduce, &mut [T], u64) -> Result<(), TrainerError>,
    ) -> Result<(), TrainerError> {
        let shared = Arc::clone(&self.shared);
        let lanes = shared.lanes;
        let ranges = cut(buf.len(), lanes);
        let chunks = {
            let mut st = shared.lock();
            if let Some(why) = &st.aborted {
                return Err(TrainerError::reduce(why.clone()));
            }
            let shape = (buf.len(), std::any::type_name::<T>());
            if *st.shape.get_or_insert(shape) != shape {
                // Local ranks run the same code on the same job: a bug, not a peer.
                let detail = format!(
                    "local rank {} reduces {} values of {}, another {:?}",
                    self.index, shape.0, shape.1, st.shape
                );
                st.aborted = Some(detail.clone());
                shared.changed.notify_all();
                return Err(TrainerError::Reduce { peer: None, detail, violation: true });
            }
            st.sums.first(ranges.len())
        };
        // Each rank starts at a chunk of its own, so ranks seldom wait for one another.
        let m = ranges.len();
        let start = if m == 0 { 0 } else { self.index * m / shared.n };
        for c in (0..m).map(|j| (start + j) % m) {
            let mut chunk = lock_chunk(&chunks[c]);
            let first = chunk.added == 0;
            chunk.added += 1;
            let (part, sum) = (&buf[ranges[c].clone()], slot(&mut chunk));
            if first {
                sum.clear();
                sum.extend_from_slice(part);
            } else {
                sum.iter_mut().zip(part).for_each(|(a, &b)| combine(a, b));
            }
        }
        let st = shared.barrier(shared.lock(), |_| {})?;
        drop(st);
        if let Some(inter) = self.inter.as_mut() {
            // This lane's chunks, in order (every host cuts alike); the lanes run at once,
            // the other local ranks wait on the condition variable meanwhile, and one that
            // leaves can still say so. A lane that fails stops; the others finish theirs
            // (their peers are still sending), and every local rank returns the failure.
            for c in chunks.iter().skip(self.index).step_by(lanes) {
                let mut chunk = lock_chunk(c);
                let crossed = between(&mut **inter, slot(&mut chunk), step);
                // Never the state's lock under a chunk's (barrier 3 takes them the other way).
                drop(chunk);
                if let Err(e) = crossed {
                    shared.lock().failed = Some(Failed::of(&e));
                    break;
                }
            }
        }
        let st = shared.barrier(shared.lock(), |_| {})?;
        let outcome = match st.failed.clone() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        };
        drop(st);
        if outcome.is_ok() {
            for c in (0..m).map(|j| (start + j) % m) {
                buf[ranges[c].clone()].copy_from_slice(slot(&mut lock_chunk(&chunks[c])));
            }
        }
        // Nobody starts the next collective's sums before every rank has copied this one.
        drop(shared.barrier(shared.lock(), |s| {
            s.failed = None;
            s.shape = None;
            for c in &chunks {
                lock_chunk(c).added = 0;
            }
        })?);
        outcome
    }
}

impl Reduce for LocalRank<'_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        self.all(buf, step, |c| &mut c.f32s, |a, b| *a += b, |r, b, s| r.allreduce_sum(b, s))
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        self.all(
            buf,
            step,
            |s| &mut s.i64s,
            |a, b| *a = a.wrapping_add(b),
            |r, b, s| r.allreduce_sum_i64(b, s),
        )
    }

    fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), TrainerError> {
        self.all(vals, step, |c| &mut c.i32s, |a, b| *a = (*a).max(b), |r, b, s| r.allreduce_max_i32(b, s))
    }
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
    pub fn follow(&mut self, leader: &Trainer) -> Result<bool, TrainerError> {
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
    /// this one's: no image and no copy through host memory. Both of one job, unsharded.
    fn copy_state_from(&mut self, leader: &Trainer) -> Result<(), TrainerError> {
        leader.refuse_sharded("a local rank's copy of the host's state")?;
        if let Some(d) = self.job.diff(&leader.job) {
            return Err(TrainerError::Mismatch(format!("job field {d} (a local rank vs the host's)")));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::tests::{job, synthetic};
    use crate::{JobSpec, ModelKind, NoReduce};

    /// Ranks on `hosts` hosts (each its local ranks on threads) for `steps` steps; the
    /// content hash of every rank after each step.
    fn run(job: &JobSpec, hosts: &[usize], steps: usize) -> Vec<Vec<String>> {
        let world: usize = hosts.iter().sum();
        let mut ranks: Vec<Trainer> =
            (0..world).map(|_| Trainer::try_new(job.clone(), synthetic()).unwrap()).collect();
        let mut hashes = Vec::new();
        // One lane per local rank of the host with the fewest, as an epoch gives them.
        let lanes = hosts.iter().copied().min().unwrap_or(1);
        for _ in 0..steps {
            // Between hosts: the hosts' sums through one more group per lane, standing for
            // the ring's lanes.
            let rings: Vec<LocalGroup> = (0..lanes).map(|_| LocalGroup::new(hosts.len())).collect();
            let groups: Vec<LocalGroup> =
                hosts.iter().map(|&n| LocalGroup::with_sums(n, lanes, &LocalSums::default())).collect();
            std::thread::scope(|s| {
                let mut rest = ranks.as_mut_slice();
                let mut first = 0;
                for (h, &n) in hosts.iter().enumerate() {
                    let (mine, tail) = rest.split_at_mut(n);
                    rest = tail;
                    let (group, rings) = (&groups[h], &rings);
                    for (i, t) in mine.iter_mut().enumerate() {
                        s.spawn(move || {
                            if i >= lanes {
                                return t.train_step(first + i, world, &mut group.rank(i, None)).unwrap();
                            }
                            let (mut between, mut alone) = (rings[i].rank(h, None), NoReduce);
                            let inter: &mut (dyn Reduce + Send) =
                                if hosts.len() > 1 { &mut between } else { &mut alone };
                            let mut local = group.rank(i, Some(inter));
                            t.train_step(first + i, world, &mut local).unwrap()
                        });
                    }
                    first += n;
                }
            });
            hashes.push(ranks.iter().map(|t| t.content_hash().unwrap()).collect());
        }
        hashes
    }

    #[test]
    fn two_hosts_of_two_devices_train_the_bits_of_four_hosts_of_one() {
        let data = synthetic();
        let mut exact = JobSpec { reproducible: true, ..job(ModelKind::Mlp, &data, 24, 4) };
        // Wide enough that the sums fill two lanes between the hosts of two devices.
        if let crate::model::ModelSpec::Mlp { hidden, .. } = &mut exact.model {
            *hidden = vec![256, 256];
        }
        let values = Trainer::try_new(exact.clone(), synthetic()).unwrap().buffer_len();
        assert!(cut(values, 2).len() == 2, "{values} values fill one lane");
        let a = run(&exact, &[2, 2], 3);
        let b = run(&exact, &[1, 1, 1, 1], 3);
        let one = run(&exact, &[1], 3);
        for ((x, y), z) in a.iter().zip(&b).zip(&one) {
            assert!(x.iter().chain(y).all(|h| h == &z[0]), "ranks differ: {x:?} {y:?} {z:?}");
        }
        // Unequal hosts: two lanes, and a third local rank that drives none.
        let c = run(&exact, &[3, 2], 3);
        for (x, z) in c.iter().zip(&one) {
            assert!(x.iter().all(|h| h == &z[0]), "ranks of hosts of 3 and 2 differ: {x:?} {z:?}");
        }
        // An ordinary job: every local rank holds the same bits, and the hosts agree.
        let plain = job(ModelKind::Mlp, &data, 24, 4);
        let a = run(&plain, &[2, 1], 2);
        assert!(a.iter().all(|x| x.iter().all(|h| h == &x[0])), "{a:?}");
    }

    #[test]
    fn a_local_rank_that_leaves_fails_the_others_instead_of_hanging() {
        let group = LocalGroup::new(3);
        std::thread::scope(|s| {
            let gone = group.rank(2, None);
            let waiting: Vec<_> = (0..2)
                .map(|i| {
                    let mut r = group.rank(i, None);
                    s.spawn(move || r.allreduce_sum(&mut [1.0, 2.0], 0))
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(gone);
            for w in waiting {
                let e = w.join().unwrap().unwrap_err();
                assert!(e.to_string().contains("local rank 2 left"), "{e}");
            }
        });
    }

    #[test]
    fn a_failure_between_hosts_reaches_every_local_rank_and_sums_are_hierarchical() {
        /// Fails its first collective (naming a peer), doubles the sum after.
        struct Flaky(usize);
        impl Reduce for Flaky {
            fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
                self.0 += 1;
                if self.0 == 1 {
                    return Err(TrainerError::Reduce {
                        peer: Some(7),
                        detail: "peer 7 closed".into(),
                        violation: false,
                    });
                }
                b.iter_mut().for_each(|v| *v *= 2.0);
                Ok(())
            }
        }
        let group = LocalGroup::new(2);
        let mut flaky = Flaky(0);
        std::thread::scope(|s| {
            let mut r1 = group.rank(1, None);
            let other = s.spawn(move || {
                let mut b = [3.0f32, 4.0];
                let first = r1.allreduce_sum(&mut b, 0).map(|_| b);
                let mut b = [3.0f32, 4.0];
                (first, r1.allreduce_sum(&mut b, 1).map(|_| b))
            });
            let mut r0 = group.rank(0, Some(&mut flaky));
            let e = r0.allreduce_sum(&mut [1.0, 2.0], 0).unwrap_err();
            assert!(matches!(e, TrainerError::Reduce { peer: Some(7), .. }), "{e}");
            // The group goes on: the next collective succeeds everywhere.
            let mut b = [1.0f32, 2.0];
            r0.allreduce_sum(&mut b, 1).unwrap();
            assert_eq!(b, [8.0, 12.0]);
            let (first, second) = other.join().unwrap();
            assert!(matches!(first, Err(TrainerError::Reduce { peer: Some(7), .. })));
            assert_eq!(second.unwrap(), [8.0, 12.0]);
        });
    }

    #[test]
    fn a_follower_copies_a_replaced_state_and_keeps_the_plan() {
        let data = synthetic();
        let j = job(ModelKind::Mlp, &data, 24, 4);
        let mut leader = Trainer::try_new(j.clone(), data.shallow_clone()).unwrap();
        let mut follower = Trainer::try_new(j, data).unwrap();
        assert!(follower.follow(&leader).unwrap(), "a first follow copies");
        assert!(!follower.follow(&leader).unwrap(), "equal states copy nothing");
        leader.train_step(0, 1, &mut NoReduce).unwrap();
        assert!(follower.follow(&leader).unwrap(), "a step apart copies");
        assert_eq!(follower.content_hash().unwrap(), leader.content_hash().unwrap());
        let image = leader.image().unwrap();
        leader.load_image(&image).unwrap();
        assert!(follower.follow(&leader).unwrap(), "a replaced state copies");
        leader.set_epoch_plan(12, 3, 0.5).unwrap();
        follower.follow(&leader).unwrap();
        assert_eq!((follower.plan(), follower.lr_scale), (leader.plan(), 0.5));
    }

    #[test]
    fn a_buffer_of_several_chunks_is_summed_in_parallel_and_crosses_hosts_chunk_by_chunk() {
        /// Counts the collectives between hosts and doubles each (a second host's equal sum).
        struct Counting(usize);
        impl Reduce for Counting {
            fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
                self.0 += 1;
                b.iter_mut().for_each(|v| *v *= 2.0);
                Ok(())
            }
        }
        let len = 2 * CHUNK + 5;
        let group = LocalGroup::new(3);
        let mut counting = Counting(0);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let others: Vec<_> = (1..3)
                .map(|i| {
                    let mut r = group.rank(i, None);
                    s.spawn(move || {
                        let mut b: Vec<f32> = (0..len).map(|v| (v % 7) as f32 * i as f32).collect();
                        r.allreduce_sum(&mut b, 0).unwrap();
                        b
                    })
                })
                .collect();
            let mut b: Vec<f32> = vec![1.0; len];
            group.rank(0, Some(&mut counting)).allreduce_sum(&mut b, 0).unwrap();
            std::iter::once(b).chain(others.into_iter().map(|h| h.join().unwrap())).collect()
        });
        assert_eq!(counting.0, 3, "one collective between hosts per chunk");
        let want: Vec<f32> = (0..len).map(|v| 2.0 * (1.0 + 3.0 * (v % 7) as f32)).collect();
        for r in &results {
            assert!(r == &want, "a local rank holds another sum");
        }
    }

    #[test]
    fn each_lane_carries_its_chunks_in_order_and_small_buffers_take_one_lane() {
        /// Records the lengths it carried and doubles each (a second host's equal sum).
        struct Lane(Vec<usize>);
        impl Reduce for Lane {
            fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
                self.0.push(b.len());
                b.iter_mut().for_each(|v| *v *= 2.0);
                Ok(())
            }
        }
        // The cut: near-equal chunks tiling the buffer, at least one per lane the buffer
        // fills, at most CHUNK values each.
        for (len, lanes, chunks) in [
            (0, 4, 1),
            (3, 4, 1),
            (2 * MIN_LANE_VALUES - 1, 4, 1),
            (2 * MIN_LANE_VALUES, 4, 2),
            (9 * CHUNK + 1, 4, 12),
            (9 * CHUNK + 1, 1, 10),
        ] {
            let c = cut(len, lanes);
            assert_eq!(c.len(), chunks, "{len} values over {lanes} lanes");
            assert!(c.first().unwrap().start == 0 && c.last().unwrap().end == len);
            assert!(c.windows(2).all(|w| w[0].end == w[1].start) && c.iter().all(|r| r.len() <= CHUNK));
            // Each lane the buffer fills takes as many chunks as the others.
            assert_eq!(c.len() % lanes.min(len / MIN_LANE_VALUES).max(1), 0, "{len} over {lanes}");
        }
        // Three local ranks driving three lanes: chunk c on lane c % 3, in order.
        let lanes = 3;
        for len in [7 * MIN_LANE_VALUES + 5, 5] {
            let group = LocalGroup::with_sums(lanes, lanes, &LocalSums::default());
            let mut carried: Vec<Lane> = (0..lanes).map(|_| Lane(Vec::new())).collect();
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = carried
                    .iter_mut()
                    .enumerate()
                    .map(|(i, lane)| {
                        let group = &group;
                        s.spawn(move || {
                            let mut r = group.rank(i, Some(lane));
                            let mut b: Vec<f32> = (0..len).map(|v| (v % 5) as f32 + i as f32).collect();
                            r.allreduce_sum(&mut b, 0).unwrap();
                            b
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let want: Vec<f32> = (0..len).map(|v| 2.0 * (3.0 * (v % 5) as f32 + 3.0)).collect();
            assert!(results.iter().all(|r| r == &want), "a local rank holds another sum");
            let chunks = cut(len, lanes);
            for (k, lane) in carried.iter().enumerate() {
                let mine: Vec<usize> = chunks.iter().skip(k).step_by(lanes).map(|r| r.len()).collect();
                assert_eq!(lane.0, mine, "lane {k} of {len} values");
            }
            if len < MIN_LANE_VALUES {
                assert!(carried[1].0.is_empty() && carried[2].0.is_empty(), "a small buffer took one lane");
            } else {
                assert!(carried.iter().all(|l| !l.0.is_empty()), "every lane carried its part");
            }
        }
    }

    #[test]
    fn a_failing_lane_fails_every_local_rank_and_copies_no_partial_sum() {
        /// A lane between hosts: doubles each sum (a second host's equal one), or fails.
        struct Lane(bool);
        impl Reduce for Lane {
            fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
                if self.0 {
                    let detail = "lane peer 9 closed".into();
                    return Err(TrainerError::Reduce { peer: Some(9), detail, violation: false });
                }
                b.iter_mut().for_each(|v| *v *= 2.0);
                Ok(())
            }
        }
        let len = 4 * MIN_LANE_VALUES;
        let group = LocalGroup::with_sums(3, 2, &LocalSums::default());
        let mut lanes = [Lane(false), Lane(true)];
        let outcomes: Vec<(Result<(), TrainerError>, Vec<f32>)> = std::thread::scope(|s| {
            let mut lanes = lanes.iter_mut();
            let handles: Vec<_> = (0..3)
                .map(|i| {
                    let lane = lanes.next().map(|l| l as &mut (dyn Reduce + Send));
                    let mut r = group.rank(i, lane);
                    s.spawn(move || {
                        let mut b = vec![1.0f32; len];
                        (r.allreduce_sum(&mut b, 0), b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (r, b)) in outcomes.iter().enumerate() {
            assert!(matches!(r, Err(TrainerError::Reduce { peer: Some(9), .. })), "local rank {i}: {r:?}");
            assert!(b.iter().all(|&v| v == 1.0), "local rank {i} copied a partial sum");
        }
    }

    #[test]
    fn local_ranks_that_disagree_on_a_collective_fail_it_instead_of_summing_wrong() {
        // Lengths of one and of two chunks: the chunk only one rank has would be its own.
        let group = LocalGroup::new(2);
        let results: Vec<Result<(), TrainerError>> = std::thread::scope(|s| {
            let lens = [CHUNK, CHUNK + 3];
            let handles: Vec<_> = (0..2)
                .map(|i| {
                    let mut r = group.rank(i, None);
                    s.spawn(move || r.allreduce_sum(&mut vec![1.0; lens[i]], 0))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r.is_err()), "{results:?}");
        assert!(results.iter().any(|r| matches!(r, Err(TrainerError::Reduce { violation: true, .. }))));
        // Sums kept from a group left mid-collective count nothing in the next group's.
        let sums = LocalSums::default();
        {
            let group = LocalGroup::with_sums(2, 1, &sums);
            let mut r0 = group.rank(0, None);
            let gone = group.rank(1, None);
            std::thread::scope(|s| {
                let h = s.spawn(move || r0.allreduce_sum(&mut [5.0, 5.0], 0));
                std::thread::sleep(std::time::Duration::from_millis(20));
                drop(gone);
                assert!(h.join().unwrap().is_err());
            });
        }
        let group = LocalGroup::with_sums(2, 1, &sums);
        let got: Vec<[f32; 2]> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|i| {
                    let mut r = group.rank(i, None);
                    s.spawn(move || {
                        let mut b = [1.0f32, 2.0];
                        r.allreduce_sum(&mut b, 1).unwrap();
                        b
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![[2.0, 4.0]; 2]);
    }
}

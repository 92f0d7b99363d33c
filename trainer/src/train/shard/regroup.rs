//! Rebuilding sharded optimizer state in a new group ([`Trainer::regroup`]): the ranks sum
//! a row of facts each (layout, step, position, parameters' digest), check every row, agree
//! on the step and on who gives each value, and move each slot (and the parameters, when a
//! rank lacks them) through exact allreduces in which every value comes from one rank.

use super::{flat_values, unflatten, ShardLayout, ShardState};
use crate::optim::Optimizer;
use crate::train::{Piece, Reduce, StepStats, Trainer};
use crate::TrainerError;
use limpet_snapshot::RngState;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

mod bounds;
pub use bounds::RegroupBounds;

/// Feeds each tensor's values (as f32, one tensor's copy at a time) to `h`.
fn hash_tensors<'a>(
    h: &mut blake3::Hasher,
    tensors: impl Iterator<Item = &'a Tensor>,
) -> Result<(), TrainerError> {
    for t in tensors {
        let t = t.detach().to_kind(Kind::Float).to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; t.numel() * 4];
        t.f_copy_data_u8(&mut bytes, t.numel())?;
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(())
}

/// Values in each rank's row of a regroup's facts (see [`Trainer::regroup`]).
const FACTS: usize = 25;

/// The most ranks a layout in a regroup's facts may have, and the most replicas: bounds on
/// what a peer's row can make this rank allocate and compute.
const MOST_RANKS: i64 = 1 << 16;
const MOST_REPLICAS: i64 = 64;

/// The value ranges a layout of a rank holds, from its facts (a peer's word, checked): of
/// `world` ranks, `m` block-holding ranks a host and `shards` in all, this rank's place among
/// them plus one (`0`: it owns an empty block), `replicas`.
fn checked_held(
    n: usize,
    world: i64,
    [m, shards, s]: [i64; 3],
    replicas: i64,
) -> Result<Vec<Range<usize>>, String> {
    if !(1..=world).contains(&m)
        || !(1..=world).contains(&shards)
        || shards % m != 0
        || !(0..=shards).contains(&s)
    {
        return Err(format!("{world} ranks on hosts of {m} holding blocks, {shards} in all, this one {s}"));
    }
    let hosts = shards / m;
    if hosts > 1 && replicas >= hosts {
        let what = if m == 1 && shards == world { "ranks" } else { "hosts" };
        let count = if what == "ranks" { world } else { hosts };
        return Err(format!("{replicas} replicas of each shard need more than {count} {what}"));
    }
    let replicas = if hosts == 1 { 0 } else { replicas as usize };
    let s = (s > 0).then(|| s as usize - 1);
    Ok(super::held_ranges(n, (shards as usize, m as usize), s, replicas))
}

/// The values rank `j` holds in its layout, from its row of a regroup's facts, checked (a
/// peer's word): `None` when it holds no shard.
fn checked_layout(n: usize, j: usize, row: &[i64]) -> Result<Option<Vec<Range<usize>>>, TrainerError> {
    let bad = |what: String| Err(TrainerError::Mismatch(format!("rank {j}'s facts in the regroup: {what}")));
    let [tag, world, replicas, rank, step, pending, norm_at, _, whole, ..] = row else {
        return bad(format!("{} values", row.len()));
    };
    if row.len() != FACTS {
        return bad(format!("{} values", row.len()));
    }
    if !(0..=i64::MAX / 2).contains(step) || *norm_at < 0 || *tag < 0 {
        return bad(format!("step {step}, tag {tag}, norm step {norm_at}"));
    }
    if [*pending, *whole, row[12], row[17]].iter().any(|f| !(0..=1).contains(f)) {
        return bad("a flag that is neither 0 nor 1".into());
    }
    if !(0..=MOST_REPLICAS + 1).contains(&row[18])
        || [row[20], row[24]].iter().any(|f| !(0..=MOST_RANKS).contains(f))
        || !(0..=MOST_RANKS + 1).contains(&row[23])
    {
        return bad(format!(
            "a target fact of {} (hosts of {} holding blocks, {} in all, this one {})",
            row[18], row[20], row[24], row[23]
        ));
    }
    if *world == 0 {
        return Ok(None);
    }
    if !(1..=MOST_RANKS).contains(world)
        || !(0..*world).contains(rank)
        || !(0..=MOST_REPLICAS).contains(replicas)
    {
        return bad(format!("rank {rank} of {world} with {replicas} replicas"));
    }
    match checked_held(n, *world, [row[19], row[22], row[21]], *replicas) {
        Ok(held) => Ok(Some(held)),
        Err(e) => bad(e),
    }
}

/// Who gives each value of `0..n`: `sources` are (rank, values it holds, preference: lower
/// first); each value goes to the most preferred source holding it (then the lowest rank).
/// The pieces in order, or the first range nobody holds.
fn givers(
    n: usize,
    mut sources: Vec<(usize, Range<usize>, (u8, i64))>,
) -> Result<Vec<(usize, Range<usize>)>, Range<usize>> {
    sources.retain(|(_, r, _)| !r.is_empty() && r.end <= n);
    sources.sort_by_key(|(j, _, pref)| (*pref, *j));
    let mut cuts: Vec<usize> = sources.iter().flat_map(|(_, r, _)| [r.start, r.end]).chain([0, n]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut by: Vec<Option<usize>> = vec![None; cuts.len().saturating_sub(1)];
    for (j, r, _) in &sources {
        // Ranges of one layout tile the values, so each layout walks each piece once.
        let first = cuts.partition_point(|&c| c < r.start);
        for (i, who) in by.iter_mut().enumerate().skip(first) {
            if cuts[i + 1] > r.end {
                break;
            }
            who.get_or_insert(*j);
        }
    }
    let mut pieces: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, who) in by.iter().enumerate() {
        let range = cuts[i]..cuts[i + 1];
        match (who, pieces.last_mut()) {
            (None, _) => {
                let end = by[i..].iter().position(Option::is_some).map_or(n, |k| cuts[i + k]);
                return Err(range.start..end);
            }
            (Some(j), Some((last, r))) if last == j && r.end == range.start => r.end = range.end,
            (Some(j), _) => pieces.push((*j, range)),
        }
    }
    Ok(pieces)
}

impl Trainer {
    /// A digest of the whole state (parameters, optimizer state, step and position in the
    /// data), read one tensor at a time: ranks compare digests to learn that they hold the
    /// same state without an image, which would copy all of it at once.
    pub fn state_digest(&self) -> Result<[u8; 32], TrainerError> {
        self.refuse_sharded("a state digest")?;
        if self.optim.is_released() {
            return Err(TrainerError::Config("the optimizer state was released".into()));
        }
        let mut h = blake3::Hasher::new();
        for v in [self.step, self.cursor, self.rng.seed, self.rng.draws] {
            h.update(&v.to_le_bytes());
        }
        if self.job.reproducible {
            // Ranks that agree on this digest take the same collectives next step: the
            // exponents decide which, and at what scale the gradients are summed.
            let e = self.exact_exponents.as_deref().unwrap_or_default();
            h.update(&(e.len() as u64).to_le_bytes());
            for x in e {
                h.update(&x.to_le_bytes());
            }
        }
        let params = self.model.params();
        let states = self.optim.named_state(params).map(|(_, s)| s);
        hash_tensors(&mut h, params.iter().map(|(_, p)| p).chain(states))?;
        Ok(*h.finalize().as_bytes())
    }

    /// This rank's row of the regroup's facts (see [`Trainer::regroup`]), `f` values.
    fn regroup_facts(&self, f: usize) -> Result<Vec<i64>, TrainerError> {
        let mut row = vec![0i64; f];
        row[4] = self.step as i64;
        // Bit casts: a u64 goes through the sum unchanged, every other rank adds zero.
        row[9..12].copy_from_slice(&[self.cursor as i64, self.rng.seed as i64, self.rng.draws as i64]);
        if let Some(s) = &self.shard {
            let l = &s.layout;
            row[..4].copy_from_slice(&[l.tag as i64, l.world() as i64, l.replicas as i64, l.rank as i64]);
            let (shards, m) = l.shards();
            (row[19], row[21], row[22]) =
                (m as i64, l.shard_rank().map_or(0, |s| s as i64 + 1), shards as i64);
            row[5] = i64::from(s.pending == Some(self.step));
            row[12] = i64::from(s.stale.is_some());
            row[17] = i64::from(self.kept_sum().is_some());
            if let Some((at, norm)) = s.last_norm {
                row[6] = at as i64 + 1;
                row[7] = norm.to_bits() as i64;
            }
        } else {
            row[8] = i64::from(!self.optim.is_released());
        }
        let mut h = blake3::Hasher::new();
        hash_tensors(&mut h, self.model.params().iter().map(|(_, p)| p))?;
        for (k, w) in h.finalize().as_bytes().chunks(8).enumerate() {
            row[13 + k] = i64::from_le_bytes(w.try_into().expect("8 bytes"));
        }
        Ok(row)
    }

    /// Writes this rank's values `range` of optimizer slot `k` (of the parameters when `k`
    /// is the slot count) into `all`, from the blocks it holds or its whole state.
    fn give_values(&self, k: usize, range: Range<usize>, all: &mut [f32]) -> Result<(), TrainerError> {
        let params = self.model.params();
        if k == self.optim.spec().slots().len() {
            let src: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
            return flat_values(&src, params, range.clone(), &mut all[range]);
        }
        let Some(s) = &self.shard else {
            let src: Vec<Tensor> = (0..params.len()).map(|i| self.optim.slot(k, i).shallow_clone()).collect();
            return flat_values(&src, params, range.clone(), &mut all[range]);
        };
        // A range may span several blocks this rank holds (a replica beside its own): each
        // gives its part.
        let mut given = 0;
        for (c, held) in &s.held {
            let b = &s.layout.blocks[*c];
            let (lo, hi) = (range.start.max(b.start), range.end.min(b.end));
            if lo < hi {
                let part = held[k].narrow(0, (lo - b.start) as i64, (hi - lo) as i64);
                part.to_device(Device::Cpu).f_copy_data(&mut all[lo..hi], hi - lo)?;
                given += hi - lo;
            }
        }
        if given != range.len() {
            return Err(TrainerError::Mismatch(format!("this rank gives values {range:?} it does not hold")));
        }
        Ok(())
    }

    /// The values (f32) the last [`Trainer::regroup`] moved to this rank from others, each
    /// slot's and the parameters' when they moved (a rank takes what it holds itself from
    /// itself).
    pub fn regroup_values(&self) -> u64 {
        self.regroup_values
    }

    /// Rebuilds sharded state in a new group (every rank of it calls this, with its rank
    /// and the same `world` and `step_tag`, the collectives' step marker): the ranks agree
    /// on the newest layout held (the highest tag, at the furthest step), each of its blocks
    /// and those blocks' parameters come from one rank that holds the block at that step
    /// (any holder: holders are bit-identical), and each rank keeps `target`'s blocks, or the
    /// whole state when `target` is `None`. A rank at another step, or holding nothing (a
    /// newcomer), gives nothing; it receives parameters of that step. With a `target` it also
    /// takes that step's position in the data (step, cursor, RNG) from a holder, so every
    /// rank leaves at the same step with the same parameters and its own blocks: no rank ever
    /// holds the whole optimizer state. Without one it must then load the whole state at
    /// that step (it is left unsharded, with zero moments). Returns the step rebuilt, or
    /// `None` when no rank held sharded state, or a rank holds whole state further on
    /// (nothing moved). Moves the parameters and the state once and needs one model-sized
    /// host vector while it runs, over a reduce whose relay moves values only to their takers
    /// (the ring's, and hosts' local ranks, with one more for the host); the default relay
    /// sums every piece's bits as integers across the group (two more such vectors per rank).
    ///
    /// `bounds` says what each rank may claim, in a group whose ranks may lie: a rank's
    /// layout counts only if the log gave it that layout (or, for an epoch the log does not
    /// know, another host holds it too), its step only within one of another host's in the
    /// same layout, and a whole state only if another host confirms it
    /// ([`RegroupBounds`]). So one rank publishing a newer layout, a step past everyone's or
    /// a whole state further on moves no honest rank's state, and claims that contradict
    /// each other fail the regroup instead of sending the holders to start afresh. `None`
    /// believes every rank (one process's own ranks, as tests and tools build them).
    pub fn regroup(
        &mut self,
        rank: usize,
        world: usize,
        target: Option<ShardLayout>,
        step_tag: u64,
        reduce: &mut dyn Reduce,
        bounds: Option<&RegroupBounds>,
    ) -> Result<Option<u64>, TrainerError> {
        let n = self.grads.grads_len();
        if rank >= world || target.as_ref().is_some_and(|t| (t.rank, t.world()) != (rank, world)) {
            return Err(TrainerError::Config(format!("a regroup as rank {rank} of {world} into {target:?}")));
        }
        if let Some(t) = &target {
            // Every rank works out what each other rank keeps from its replica count and
            // its place among the block-holding ranks alone.
            if ShardLayout::over_host_counts(n, t.counts(), rank, t.replicas)? != t.clone().tagged(0) {
                return Err(TrainerError::Config(format!("a layout of {:?} for {n} values", t.blocks)));
            }
        }
        // Every rank's layout (tag, world, replicas, rank), step, whether a step's gradient
        // waits for its norm, the last norm it gathered, whether it holds the whole state,
        // its position in the data (cursor, RNG seed and draws), whether its parameters are
        // stale, their digest, whether it keeps the fixed-point sum of the reproducible
        // step that brought it to its step, the layout it keeps (its replica count, one
        // up; 0: the whole state), and of its layout and the one it keeps the block-holding
        // ranks a host, its place among them (one up; 0: none) and their count: all decide
        // alike from these.
        const F: usize = FACTS;
        let mut facts = vec![0i64; F * world];
        let mut row = self.regroup_facts(F)?;
        row[18] = target.as_ref().map_or(0, |t| t.replicas as i64 + 1);
        if let Some(t) = &target {
            let (shards, m) = t.shards();
            (row[20], row[23], row[24]) =
                (m as i64, t.shard_rank().map_or(0, |s| s as i64 + 1), shards as i64);
        }
        facts[F * rank..F * (rank + 1)].copy_from_slice(&row);
        reduce.allreduce_sum_i64(&mut facts, step_tag)?;
        if facts[F * rank..F * (rank + 1)] != row[..] {
            return Err(TrainerError::Mismatch(
                "a peer altered this rank's facts in the regroup's sum".into(),
            ));
        }
        let fact = |j: usize, k: usize| facts[F * j + k];
        let mut layouts = (0..world)
            .map(|j| checked_layout(n, j, &facts[F * j..F * (j + 1)]))
            .collect::<Result<Vec<_>, _>>()?;
        // Whose whole state counts (with bounds, only one another host confirms).
        let whole_ok = match bounds {
            Some(b) => b.admit(&facts, &mut layouts)?,
            None => vec![true; world],
        };
        let holders: Vec<usize> = (0..world).filter(|&j| layouts[j].is_some()).collect();
        let Some(&newest) = holders.iter().max_by_key(|&&j| (fact(j, 0), fact(j, 4))) else {
            return Ok(None);
        };
        let (tag, step) = (fact(newest, 0), fact(newest, 4));
        let whole_at = |j: usize| (fact(j, 8) == 1 && whole_ok[j]).then(|| fact(j, 4));
        if (0..world).filter_map(whole_at).any(|w| w > step) {
            // Whole state further on than any shard: the entry copies it; nothing to rebuild.
            return Ok(None);
        }
        // The position every rank leaves with, checked before anything moves (every rank
        // checks the same facts, so all refuse alike).
        let (cursor, seed, draws) =
            (fact(newest, 9) as u64, fact(newest, 10) as u64, fact(newest, 11) as u64);
        if cursor < step as u64 || cursor > u64::MAX / 4 {
            return Err(TrainerError::Mismatch(format!(
                "rank {newest} is at step {step} with cursor {cursor}: {step} steps consume at least {step} samples"
            )));
        }
        let same_layout = |a: usize, b: usize| {
            (fact(a, 0), fact(a, 1), fact(a, 2), fact(a, 19), fact(a, 22))
                == (fact(b, 0), fact(b, 1), fact(b, 2), fact(b, 19), fact(b, 22))
                && layouts[a].is_some()
        };
        let of_newest = |j: usize| same_layout(j, newest);
        // A step some ranks applied and others did not, because the norm's allgather failed
        // on them: those have the step's gradient and finish it with the norm a peer of the
        // same layout got for that step.
        let norm_of_last = (0..world)
            .find(|&j| of_newest(j) && fact(j, 6) > 0 && fact(j, 6) == step)
            .map(|j| f64::from_bits(fact(j, 7) as u64));
        let finishes =
            |j: usize| of_newest(j) && fact(j, 4) == step - 1 && fact(j, 5) == 1 && norm_of_last.is_some();
        // A reproducible step whose fixed-point sum broke on some ranks after others had
        // all of it (a kill while the ring was gathering): those updated, these did not. A
        // holder a step behind finishes it from the sum a peer at the step kept (the sum,
        // the exponents and so the update are the same bits on every rank), so a block whose
        // other holders are gone is not lost.
        let sum_giver = (0..world).find(|&j| of_newest(j) && fact(j, 4) == step && fact(j, 17) == 1);
        let reproducible = self.job.reproducible;
        let catches_up = |j: usize| {
            reproducible && sum_giver.is_some() && of_newest(j) && fact(j, 4) == step - 1 && fact(j, 5) == 0
        };
        let effective = |j: usize| if finishes(j) || catches_up(j) { step } else { fact(j, 4) };
        // Who gives each value: a holder of the newest layout at the step, else a holder of
        // another layout at that step (a rank whose last re-cut broke keeps the layout before
        // it, whole, until one succeeds), else a rank with the whole state at that step.
        let mut sources: Vec<(usize, Range<usize>, (u8, i64))> = Vec::new();
        for j in (0..world).filter(|&j| effective(j) == step) {
            match &layouts[j] {
                Some(held) => {
                    let class = u8::from(!of_newest(j));
                    sources.extend(held.iter().map(|r| (j, r.clone(), (class, -fact(j, 0)))));
                }
                None if whole_at(j) == Some(step) => sources.push((j, 0..n, (2, 0))),
                None => {}
            }
        }
        // What each rank holds of the state at the step (it takes those values from itself:
        // holders are bit-identical) and what it keeps afterwards.
        let own: Vec<Vec<Range<usize>>> =
            (0..world).map(|j| sources.iter().filter(|s| s.0 == j).map(|s| s.1.clone()).collect()).collect();
        let keeps = (0..world)
            .map(|j| match fact(j, 18) {
                // Without a target at another step, a rank loads the whole state afterwards.
                0 if effective(j) != step => Ok(Vec::new()),
                0 => Ok(std::iter::once(0..n).collect()),
                r => checked_held(n, world as i64, [fact(j, 20), fact(j, 24), fact(j, 23)], r - 1)
                    .map_err(|e| TrainerError::Mismatch(format!("rank {j}'s target in the regroup: {e}"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The parameters move only to a rank without those of the step rebuilt: one at
        // another step, one finishing the step (its other blocks' parameters never came),
        // one whose parameters' allgather broke.
        let digest = |j: usize| &facts[F * j + 13..F * j + 17];
        let params_to: Vec<bool> = (0..world)
            .map(|j| {
                fact(j, 4) != step
                    || finishes(j)
                    || catches_up(j)
                    || fact(j, 12) == 1
                    || digest(j) != digest(newest)
            })
            .collect();
        let pieces = givers(n, sources).map_err(|gap| {
            TrainerError::ShardLost(format!(
                "no live rank holds values {gap:?} of the optimizer state at step {step} (layout {tag}): every holder is gone"
            ))
        })?;
        // A reproducible job's exponents for the next step are state, like its position:
        // every rank leaves with those of the rank it takes the position from. Taken before
        // anything here changes (every rank reaches this point), kept until the state is.
        let exponents = match self.job.reproducible {
            true => Some(exponents_of(
                newest,
                rank,
                self.exact_exponents.as_deref(),
                self.model.params().len() + 1,
                step_tag,
                reduce,
            )?),
            false => None,
        };
        if let Some(giver) = sum_giver.filter(|_| (0..world).any(catches_up)) {
            let sum = sum_of_step(
                giver,
                rank,
                self.kept_sum(),
                (n, self.model.params().len() + 1, self.plan.global_batch),
                step_tag,
                reduce,
            )?;
            if catches_up(rank) {
                let (acc, exps) = sum;
                let layout = self.shard.as_ref().expect("a holder").layout.clone();
                let next = self.dequantize_sum(&acc, &exps);
                let stats = self.update_exact_held(&layout, next, step as u64 - 1)?;
                self.unlogged = Some(stats);
                self.advance();
                self.shard.as_mut().expect("a holder").stale =
                    Some("a step finished at a regroup that did not complete".into());
            }
        }
        if finishes(rank) {
            let layout = self.shard.as_ref().expect("a holder").layout.clone();
            let norm = norm_of_last.expect("checked");
            let lr = self.apply_held(&layout, norm);
            let sums = &self.grads.as_mut_slice()[n..];
            self.unlogged = Some(StepStats {
                step: self.step,
                loss: f64::from(sums[0]) / f64::from(sums[1]),
                lr,
                grad_norm: norm,
                samples: sums[1] as usize,
                rank_mean_sq_sum: f64::from(sums[2]),
                agreed: false,
            });
            self.advance();
            let s = self.shard.as_mut().expect("a holder");
            (s.pending, s.last_norm) = (None, Some((step as u64 - 1, norm)));
            // The other blocks' parameters come in this regroup: if it breaks, no step runs.
            s.stale = Some("a step finished at a regroup that did not complete".into());
        }
        let device = self.model.device();
        let params = self.model.params();
        let slots = self.optim.spec().slots().len();
        let keep = match &target {
            Some(t) => t.held(),
            None => Vec::new(),
        };
        let mut kept: Vec<(usize, Vec<Tensor>)> = keep.iter().map(|&b| (b, Vec::new())).collect();
        let mut whole: Vec<Vec<Tensor>> = Vec::new();
        let mut all = vec![0f32; n];
        let rounds = if params_to.iter().any(|&m| m) { slots + 1 } else { slots };
        // Each slot goes from its givers to the ranks that keep it and do not hold it; the
        // parameters to the ranks that lack them.
        let slot_moves = relay_pieces(&pieces, &keeps, &own);
        let everything = |to: bool| std::iter::once(0..n).filter(|_| to).collect::<Vec<_>>();
        let param_moves = relay_pieces(
            &pieces,
            &params_to.iter().map(|&m| everything(m)).collect::<Vec<_>>(),
            &vec![Vec::new(); world],
        );
        let taken = |moves: &[Piece]| {
            moves.iter().filter(|p| p.to.contains(&rank)).map(|p| p.range.len()).sum::<usize>()
        };
        self.regroup_values = (slots * taken(&slot_moves) + (rounds - slots) * taken(&param_moves)) as u64;
        // Each slot, then the parameters (last, so a failure leaves them as they were): the
        // givers' values are copied, bit for bit.
        for k in 0..rounds {
            all.iter_mut().for_each(|v| *v = 0.0);
            for (_, range) in pieces.iter().filter(|p| p.0 == rank) {
                self.give_values(k, range.clone(), &mut all)?;
            }
            let moves = if k == slots { &param_moves } else { &slot_moves };
            reduce.relay(&mut all, moves, rank, step_tag)?;
            if k == slots {
                if params_to[rank] {
                    let values = unflatten(&all, params, device);
                    tch::no_grad(|| -> Result<(), TrainerError> {
                        for ((_, p), v) in params.iter().zip(&values) {
                            p.shallow_clone().f_copy_(v)?;
                        }
                        Ok(())
                    })?;
                }
                continue;
            }
            // What this rank holds at the step it takes from itself (a relay may have
            // passed other values over those places).
            for range in &own[rank] {
                self.give_values(k, range.clone(), &mut all)?;
            }
            if let Some(t) = &target {
                for (b, held) in &mut kept {
                    held.push(Tensor::from_slice(&all[t.blocks[*b].clone()]).to_device(device));
                }
            } else {
                whole.push(unflatten(&all, params, device));
            }
        }
        if target.is_none() && self.step as i64 != step {
            // Parameters of another step: this rank must load the whole state of `step`.
            self.shard = None;
            self.optim = Optimizer::new(self.optim.spec(), params);
            return Ok(Some(step as u64));
        }
        if let Some(e) = exponents {
            self.exact_exponents = e;
        }
        if target.is_some() {
            // Every rank leaves at the step rebuilt, where the chosen layout's holder is.
            if self.step as i64 != step {
                self.unlogged = None;
            }
            (self.step, self.cursor) = (step as u64, cursor);
            self.rng = RngState { seed, draws };
        }
        match target {
            Some(layout) => {
                if !self.optim.is_released() {
                    self.optim.release();
                }
                self.shard = Some(ShardState {
                    layout,
                    held: kept,
                    scratch: None,
                    stale: None,
                    pending: None,
                    last_norm: None,
                });
            }
            None => {
                self.shard = None;
                self.optim.restore(whole);
            }
        }
        Ok(Some(step as u64))
    }
}

/// What a relay moves so that every rank `j` ends with the values `takes[j]` in its buffer:
/// each of `pieces` (its giver, its values) cut where a rank's takes begin or end, each part
/// going to the ranks that take it and do not hold it already (`own[j]`; the giver holds its
/// own). Adjacent parts of one giver going to the same ranks are one piece.
fn relay_pieces(
    pieces: &[(usize, Range<usize>)],
    takes: &[Vec<Range<usize>>],
    own: &[Vec<Range<usize>>],
) -> Vec<Piece> {
    let covers =
        |set: &[Range<usize>], r: &Range<usize>| set.iter().any(|s| s.start <= r.start && r.end <= s.end);
    let mut out: Vec<Piece> = Vec::new();
    for (giver, range) in pieces {
        let mut cuts = vec![range.start, range.end];
        for t in takes.iter().chain(own).flatten() {
            cuts.extend([t.start, t.end].into_iter().filter(|c| range.start < *c && *c < range.end));
        }
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let part = w[0]..w[1];
            let to: Vec<usize> = (0..takes.len())
                .filter(|&j| j != *giver && covers(&takes[j], &part) && !covers(&own[j], &part))
                .collect();
            if to.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(p) if p.giver == *giver && p.range.end == part.start && p.to == to => {
                    p.range.end = part.end
                }
                _ => out.push(Piece { giver: *giver, range: part, to }),
            }
        }
    }
    out
}

/// The fixed-point sum of a reproducible step and its exponents that rank `giver` kept
/// (`mine` when this rank is it), for a gradient of `n` values and `tensors` tensors, given
/// to every rank of the group through one exact sum. What comes back is checked (the
/// exponents within their range) before it is used.
fn sum_of_step(
    giver: usize,
    rank: usize,
    mine: Option<(&[i64], &[i32])>,
    (n, tensors, global_batch): (usize, usize, usize),
    step_tag: u64,
    reduce: &mut dyn Reduce,
) -> Result<(Vec<i64>, Vec<i32>), TrainerError> {
    let len = n + 3 + 3 * tensors;
    let mut v = vec![0i64; len + tensors];
    if rank == giver {
        let Some((acc, exps)) = mine else {
            return Err(TrainerError::Mismatch("this rank gives a step's sum it does not keep".into()));
        };
        v[..len].copy_from_slice(acc);
        v[len..].iter_mut().zip(exps).for_each(|(d, &e)| *d = i64::from(e));
    }
    reduce.allreduce_sum_i64(&mut v, step_tag)?;
    // Checked on every rank alike (not only on those that use it), so that all refuse
    // together and none goes on into collectives the others left.
    if usize::try_from(v[n + 1]).ok() != Some(global_batch) {
        return Err(TrainerError::Mismatch(format!(
            "rank {giver} gave a step's sum of {} samples, not the global batch {global_batch}",
            v[n + 1]
        )));
    }
    let exps = v[len..]
        .iter()
        .map(|&e| {
            i32::try_from(e).ok().filter(|e| crate::train::exact::EXP_RANGE.contains(e)).ok_or_else(|| {
                TrainerError::Mismatch(format!("rank {giver} gave the exponent {e} with a step's sum"))
            })
        })
        .collect::<Result<Vec<i32>, _>>()?;
    v.truncate(len);
    Ok((v, exps))
}

/// The exponents rank `giver` holds (`mine` when this rank is it), for `tensors` tensors,
/// given to every rank of the group through one exact sum: `None` when the giver has none.
/// What comes back is checked (one rank's, within the exponents' range) before it is used.
fn exponents_of(
    giver: usize,
    rank: usize,
    mine: Option<&[i32]>,
    tensors: usize,
    step_tag: u64,
    reduce: &mut dyn Reduce,
) -> Result<Option<Vec<i32>>, TrainerError> {
    let mut v = vec![0i64; tensors + 1];
    if let Some(e) = mine.filter(|_| rank == giver) {
        if e.len() != tensors {
            return Err(TrainerError::Mismatch(format!(
                "this rank holds {} exponents for {tensors} tensors",
                e.len()
            )));
        }
        v[0] = 1;
        v[1..].iter_mut().zip(e).for_each(|(d, &x)| *d = i64::from(x));
    }
    let given = v.clone();
    reduce.allreduce_sum_i64(&mut v, step_tag)?;
    if rank == giver && v != given {
        return Err(TrainerError::Mismatch(
            "a peer altered the exponents this rank gave in the regroup".into(),
        ));
    }
    let range = super::super::exact::EXP_RANGE;
    match v[0] {
        0 if v[1..].iter().all(|&x| x == 0) => Ok(None),
        1 if v[1..].iter().all(|&x| (i64::from(*range.start())..=i64::from(*range.end())).contains(&x)) => {
            Ok(Some(v[1..].iter().map(|&x| x as i32).collect()))
        }
        _ => Err(TrainerError::Mismatch(format!(
            "the exponents rank {giver} was to give are not one rank's, or out of range"
        ))),
    }
}

#[cfg(test)]
#[path = "hostile_reduce.rs"]
mod hostile_reduce;

#[cfg(test)]
mod tests;

//! Rebuilding sharded optimizer state in a new group ([`Trainer::regroup`]): the ranks sum
//! a row of facts each (layout, step, position, parameters' digest), check every row, agree
//! on the step and on who gives each value, and move each slot (and the parameters, when a
//! rank lacks them) through exact allreduces in which every value comes from one rank.

use super::{flat_values, unflatten, ShardLayout, ShardState};
use crate::optim::Optimizer;
use crate::train::{Reduce, StepStats, Trainer};
use crate::TrainerError;
use limpet_snapshot::RngState;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

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
const FACTS: usize = 18;

/// The most ranks a layout in a regroup's facts may have, and the most replicas: bounds on
/// what a peer's row can make this rank allocate and compute.
const MOST_RANKS: i64 = 1 << 16;
const MOST_REPLICAS: i64 = 64;

/// Rank `j`'s layout from its row of a regroup's facts, checked (a peer's word): `None` when
/// it holds no shard.
fn checked_layout(n: usize, j: usize, row: &[i64]) -> Result<Option<ShardLayout>, TrainerError> {
    let bad = |what: String| Err(TrainerError::Mismatch(format!("rank {j}'s facts in the regroup: {what}")));
    let [tag, world, replicas, rank, step, pending, norm_at, _, whole, ..] = row else {
        return bad(format!("{} values", row.len()));
    };
    if !(0..=i64::MAX / 2).contains(step) || *norm_at < 0 || *tag < 0 {
        return bad(format!("step {step}, tag {tag}, norm step {norm_at}"));
    }
    if [*pending, *whole, row[12], row[17]].iter().any(|f| !(0..=1).contains(f)) {
        return bad("a flag that is neither 0 nor 1".into());
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
    let layout = ShardLayout::new(n, *world as usize, *rank as usize, *replicas as usize)?;
    Ok(Some(layout.tagged(*tag as u64)))
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

    /// The values (f32) the last [`Trainer::regroup`] summed over its group, each slot's and
    /// the parameters' when they moved: what its allreduces carried.
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
    /// host vector while it runs.
    pub fn regroup(
        &mut self,
        rank: usize,
        world: usize,
        target: Option<ShardLayout>,
        step_tag: u64,
        reduce: &mut dyn Reduce,
    ) -> Result<Option<u64>, TrainerError> {
        let n = self.grads.grads_len();
        if rank >= world || target.as_ref().is_some_and(|t| (t.rank, t.world()) != (rank, world)) {
            return Err(TrainerError::Config(format!("a regroup as rank {rank} of {world} into {target:?}")));
        }
        if let Some(t) = &target {
            if t.blocks.last().map(|b| b.end) != Some(n) {
                return Err(TrainerError::Config(format!("a layout of {:?} for {n} values", t.blocks)));
            }
        }
        // Every rank's layout (tag, world, replicas, rank), step, whether a step's gradient
        // waits for its norm, the last norm it gathered, whether it holds the whole state,
        // its position in the data (cursor, RNG seed and draws), whether its parameters are
        // stale, their digest, and whether it keeps the fixed-point sum of the reproducible
        // step that brought it to its step: all decide alike from these.
        const F: usize = FACTS;
        let mut facts = vec![0i64; F * world];
        let row = self.regroup_facts(F)?;
        facts[F * rank..F * (rank + 1)].copy_from_slice(&row);
        reduce.allreduce_sum_i64(&mut facts, step_tag)?;
        if facts[F * rank..F * (rank + 1)] != row[..] {
            return Err(TrainerError::Mismatch(
                "a peer altered this rank's facts in the regroup's sum".into(),
            ));
        }
        let fact = |j: usize, k: usize| facts[F * j + k];
        let layouts = (0..world)
            .map(|j| checked_layout(n, j, &facts[F * j..F * (j + 1)]))
            .collect::<Result<Vec<_>, _>>()?;
        let holders: Vec<usize> = (0..world).filter(|&j| layouts[j].is_some()).collect();
        let Some(&newest) = holders.iter().max_by_key(|&&j| (fact(j, 0), fact(j, 4))) else {
            return Ok(None);
        };
        let (tag, step) = (fact(newest, 0), fact(newest, 4));
        let whole_at = |j: usize| (fact(j, 8) == 1).then(|| fact(j, 4));
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
            (fact(a, 0), fact(a, 1), fact(a, 2)) == (fact(b, 0), fact(b, 1), fact(b, 2))
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
        let catches_up = |j: usize| {
            self.job.reproducible
                && sum_giver.is_some()
                && of_newest(j)
                && fact(j, 4) == step - 1
                && fact(j, 5) == 0
        };
        let effective = |j: usize| if finishes(j) || catches_up(j) { step } else { fact(j, 4) };
        // Who gives each value: a holder of the newest layout at the step, else a holder of
        // another layout at that step (a rank whose last re-cut broke keeps the layout before
        // it, whole, until one succeeds), else a rank with the whole state at that step.
        let mut sources: Vec<(usize, Range<usize>, (u8, i64))> = Vec::new();
        for j in (0..world).filter(|&j| effective(j) == step) {
            match &layouts[j] {
                Some(l) => {
                    let class = u8::from(!of_newest(j));
                    sources
                        .extend(l.held().into_iter().map(|c| (j, l.blocks[c].clone(), (class, -fact(j, 0)))));
                }
                None if whole_at(j) == Some(step) => sources.push((j, 0..n, (2, 0))),
                None => {}
            }
        }
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
                n,
                self.model.params().len() + 1,
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
        // The parameters move only to a rank without those of the step rebuilt: one at
        // another step, one finishing the step (its other blocks' parameters never came),
        // one whose parameters' allgather broke.
        let digest = |j: usize| &facts[F * j + 13..F * j + 17];
        let params_move = (0..world)
            .any(|j| fact(j, 4) != step || finishes(j) || fact(j, 12) == 1 || digest(j) != digest(newest));
        let rounds = if params_move { slots + 1 } else { slots };
        self.regroup_values = (rounds * n) as u64;
        // Each slot, then the parameters (last, so a failure leaves them as they were): every
        // element is given by one rank and zero elsewhere, so the sum is exact.
        for k in 0..rounds {
            all.iter_mut().for_each(|v| *v = 0.0);
            for (giver, range) in &pieces {
                if *giver != rank {
                    continue;
                }
                if k == slots {
                    let src: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
                    flat_values(&src, params, range.clone(), &mut all[range.clone()])?;
                } else if let Some(s) = &self.shard {
                    // A piece may span several blocks this rank holds (a replica beside its
                    // own): each gives its part.
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
                        return Err(TrainerError::Mismatch(format!(
                            "this rank gives values {range:?} it does not hold"
                        )));
                    }
                } else {
                    let src: Vec<Tensor> =
                        (0..params.len()).map(|i| self.optim.slot(k, i).shallow_clone()).collect();
                    flat_values(&src, params, range.clone(), &mut all[range.clone()])?;
                }
            }
            reduce.allreduce_sum(&mut all, step_tag)?;
            if k == slots {
                let values = unflatten(&all, params, device);
                tch::no_grad(|| -> Result<(), TrainerError> {
                    for ((_, p), v) in params.iter().zip(&values) {
                        p.shallow_clone().f_copy_(v)?;
                    }
                    Ok(())
                })?;
            } else if let Some(t) = &target {
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

/// The fixed-point sum of a reproducible step and its exponents that rank `giver` kept
/// (`mine` when this rank is it), for a gradient of `n` values and `tensors` tensors, given
/// to every rank of the group through one exact sum. What comes back is checked (the
/// exponents within their range) before it is used.
fn sum_of_step(
    giver: usize,
    rank: usize,
    mine: Option<(&[i64], &[i32])>,
    n: usize,
    tensors: usize,
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
mod tests {
    use super::hostile_reduce::Hostile;
    use super::*;
    use crate::train::tests::{job, synthetic};
    use crate::ModelKind;
    use proptest::prelude::*;

    fn sharded_trainer() -> Trainer {
        let data = synthetic();
        let mut j = job(ModelKind::Mlp, &data, 16, 16);
        j.optimizer = crate::optim::OptimizerSpec::adamw(1e-2, 0.01);
        let mut t = Trainer::try_new(j, data).unwrap();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 2, 0, 1).unwrap().tagged(3)).unwrap();
        t
    }

    /// A peer whose facts are rank 0's own (so the regroup gets as far as the exponents,
    /// with the peer as the rank they come from) and who then adds `exps` to them.
    struct ForgedExponents {
        facts: Vec<i64>,
        exps: Vec<i64>,
        calls: usize,
    }

    impl Reduce for ForgedExponents {
        fn allreduce_sum(&mut self, _: &mut [f32], _: u64) -> Result<(), TrainerError> {
            Ok(())
        }

        fn allreduce_sum_i64(&mut self, buf: &mut [i64], _: u64) -> Result<(), TrainerError> {
            self.calls += 1;
            let add = if self.calls == 1 { &self.facts } else { &self.exps };
            let from = if self.calls == 1 { FACTS } else { 0 };
            let start = from.min(buf.len());
            for (v, r) in buf[start..].iter_mut().zip(add.iter().cycle()) {
                *v = v.wrapping_add(*r);
            }
            Ok(())
        }
    }

    /// A peer whose facts say it is a step ahead in the same layout and kept that step's
    /// sum, which it then gives as `sum` (after giving no exponents).
    struct ForgedSum {
        facts: Vec<i64>,
        sum: Vec<i64>,
        calls: usize,
    }

    impl Reduce for ForgedSum {
        fn allreduce_sum(&mut self, _: &mut [f32], _: u64) -> Result<(), TrainerError> {
            Ok(())
        }

        fn allreduce_sum_i64(&mut self, buf: &mut [i64], _: u64) -> Result<(), TrainerError> {
            self.calls += 1;
            let (add, from) = match self.calls {
                1 => (&self.facts[..], FACTS),
                3 => (&self.sum[..], 0),
                _ => return Ok(()),
            };
            let start = from.min(buf.len());
            for (v, r) in buf[start..].iter_mut().zip(add) {
                *v = v.wrapping_add(*r);
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Whatever sum a peer that says it kept one gives a reproducible rank a step
        /// behind, the rank ends with an error or with the step finished, never a panic; a
        /// forged exponent or sample count is refused before the state changes.
        #[test]
        fn a_forged_sum_is_refused_or_finishes_the_step(
            values in proptest::collection::vec(prop_oneof![
                Just(0i64), Just(1), Just(-1), Just(1030), Just(1031), Just(i64::MAX), Just(i64::MIN), any::<i64>(),
            ], 1..64),
            exps_fit in any::<bool>(),
            count_fits in any::<bool>(),
        ) {
            let mut t = sharded_trainer();
            t.job.reproducible = true;
            let n = t.buffer_len() - 3;
            let tensors = t.model.params().len() + 1;
            let len = n + 3 + 3 * tensors;
            let mut facts = t.regroup_facts(FACTS).unwrap();
            (facts[3], facts[4], facts[9], facts[17]) = (1, 1, t.plan.global_batch as i64, 1);
            let mut sum: Vec<i64> = values.iter().cycle().take(len + tensors).copied().collect();
            match exps_fit {
                true => sum[len..].iter_mut().for_each(|e| *e = e.rem_euclid(1000)),
                false => sum[len + tensors - 1] = 1031,
            }
            sum[n + 1] = match count_fits {
                true => t.plan.global_batch as i64,
                false => sum[n + 1].clamp(-1 << 20, 1 << 20) * 64 + 1,
            };
            let before = t.step();
            let target = ShardLayout::new(n, 2, 0, 1).unwrap().tagged(3);
            let done = t.regroup(0, 2, Some(target), u64::MAX, &mut ForgedSum { facts, sum, calls: 0 });
            prop_assert!(t.step() == before || t.step() == before + 1);
            if exps_fit && count_fits {
                // Garbage that passes the checks is a sum like any other: the step is done.
                prop_assert!(done.is_ok(), "{done:?}");
                prop_assert_eq!(t.step(), before + 1);
            } else {
                let e = done.unwrap_err().to_string();
                prop_assert!(e.contains("exponent") || e.contains("sample count"), "{e}");
                prop_assert_eq!(t.step(), before, "a refused sum changed the step");
            }
        }

        /// Whatever exponents the rank they come from gives in a reproducible job's
        /// regroup, this rank ends with an error or with exponents in range, never a panic.
        #[test]
        fn forged_exponents_are_refused_or_in_range(
            exps in proptest::collection::vec(prop_oneof![
                Just(0i64), Just(1), Just(-1), Just(1030), Just(1031), Just(i64::MAX), Just(i64::MIN), any::<i64>(), -2000i64..2000,
            ], 0..12),
        ) {
            let mut t = sharded_trainer();
            t.job.reproducible = true;
            let n = t.buffer_len() - 3;
            let mut facts = t.regroup_facts(FACTS).unwrap();
            facts[3] = 1;
            let mut peer = ForgedExponents { facts, exps: exps.clone(), calls: 0 };
            let target = ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4);
            let done = t.regroup(0, 2, Some(target), u64::MAX, &mut peer);
            prop_assert!(peer.calls >= 2, "the regroup stopped before the exponents");
            if done.is_ok() {
                let range = super::super::super::exact::EXP_RANGE;
                let got = t.exact_exponents.clone().unwrap_or_default();
                prop_assert!(got.iter().all(|e| range.contains(e)), "{got:?}");
            }
            // Nothing given (the peer held none) is the one way to end with none.
            if exps.iter().all(|&e| e == 0) {
                prop_assert!(done.is_ok() && t.exact_exponents.is_none());
            }
        }

        /// Whatever a peer puts in its facts, a regroup ends with a result, never a panic,
        /// whatever world or replica count it forges (both are bounded before any use).
        #[test]
        fn a_hostile_peers_facts_never_panic(
            row in proptest::collection::vec(prop_oneof![
                Just(0i64), Just(1), Just(2), Just(-1), Just(i64::MAX), Just(i64::MIN), any::<i64>(), 0i64..1 << 20,
            ], FACTS),
            noise in any::<f32>(),
            recut in any::<bool>(),
        ) {
            let mut t = sharded_trainer();
            let n = t.buffer_len() - 3;
            let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
            let _ = t.regroup(0, 2, target, u64::MAX, &mut Hostile { row, from: FACTS, noise }); // rank 1's row
        }

        /// The same from a row that is rank 0's own with a few values changed: past the
        /// checks, into the choice of givers and the moves.
        #[test]
        fn a_peers_facts_near_an_honest_row_never_panic(
            edits in proptest::collection::vec((0usize..FACTS, prop_oneof![
                Just(0i64), Just(1), Just(2), Just(3), Just(4), Just(-1), Just(i64::MAX), any::<i64>(),
            ]), 1..4),
            noise in any::<f32>(),
            recut in any::<bool>(),
            reproducible in any::<bool>(),
        ) {
            let mut t = sharded_trainer();
            // A reproducible job also takes a step's sum from a peer that says it kept one.
            t.job.reproducible = reproducible;
            let n = t.buffer_len() - 3;
            let mut row = t.regroup_facts(FACTS).unwrap();
            row[3] = 1;
            for (i, v) in edits {
                row[i] = v;
            }
            let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
            let _ = t.regroup(0, 2, target, u64::MAX, &mut Hostile { row, from: FACTS, noise }); // rank 1's row
        }

        /// The pieces tile the values, each given by a source holding it, the most
        /// preferred one; a value nobody holds is named.
        #[test]
        fn givers_tile_the_values_from_the_preferred_holder(
            n in 0usize..300,
            raw in proptest::collection::vec((0usize..4, 0usize..320, 0usize..320, 0u8..3, -3i64..3), 0..12),
        ) {
            let sources: Vec<(usize, Range<usize>, (u8, i64))> =
                raw.iter().map(|&(j, a, b, p, t)| (j, a.min(b)..a.max(b), (p, t))).collect();
            let best = |v: usize| {
                sources.iter().filter(|(_, r, _)| r.contains(&v) && r.end <= n).min_by_key(|(j, _, p)| (*p, *j)).map(|s| s.0)
            };
            match givers(n, sources.clone()) {
                Ok(pieces) => {
                    let mut at = 0;
                    for (j, r) in &pieces {
                        prop_assert_eq!(r.start, at);
                        at = r.end;
                        for v in r.clone() {
                            prop_assert_eq!(best(v), Some(*j));
                        }
                    }
                    prop_assert_eq!(at, n);
                }
                Err(gap) => {
                    prop_assert!(!gap.is_empty());
                    prop_assert!((0..gap.start).all(|v| best(v).is_some()));
                    prop_assert!(gap.clone().all(|v| best(v).is_none()));
                    prop_assert!(gap.end == n || best(gap.end).is_some(), "the gap ends where a holder begins");
                }
            }
        }
    }

    /// A forged row is refused naming the rank and what was wrong.
    #[test]
    fn a_forged_world_is_refused_naming_the_rank() {
        let mut row = vec![0i64; FACTS];
        row[1] = 1 << 40;
        let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
        assert!(e.contains("rank 1's facts in the regroup"), "{e}");
        row[1] = 4;
        row[2] = 65;
        assert!(checked_layout(1000, 1, &row).is_err());
        row[2] = 3;
        row[3] = 2;
        assert_eq!(checked_layout(1000, 1, &row).unwrap().map(|l| l.held()), Some(vec![2, 1, 0, 3]));
    }
}

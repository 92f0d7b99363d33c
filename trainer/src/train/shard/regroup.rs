//! Rebuilding sharded optimizer state in a new group ([`Trainer::regroup`]), executed: each
//! rank states its state (`limpet_decide::regroup::RegroupFacts`), the group sums the rows,
//! every rank computes the same plan from them (`limpet_decide::regroup::plan`), and this
//! file carries it out: the exponents and a torn step's sum or norm, then each slot (and the
//! parameters, where a rank lacks them) through relays in which every value comes from one
//! rank.

use super::{flat_values, unflatten, ShardLayout, ShardState};
use crate::optim::Optimizer;
use crate::train::{Reduce, StepStats, Trainer};
use crate::TrainerError;
use limpet_decide::regroup::{self, RegroupBounds, RegroupFacts, RegroupPlan, WORDS};
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

    /// What this rank states in a regroup (its target aside).
    fn regroup_facts(&self) -> Result<RegroupFacts, TrainerError> {
        let mut h = blake3::Hasher::new();
        hash_tensors(&mut h, self.model.params().iter().map(|(_, p)| p))?;
        let shard = self.shard.as_ref();
        Ok(RegroupFacts {
            layout: shard.map(|s| s.layout.facts()),
            step: self.step,
            pending: shard.is_some_and(|s| s.pending == Some(self.step)),
            last_norm: shard.and_then(|s| s.last_norm),
            whole: shard.is_none() && !self.optim.is_released(),
            cursor: self.cursor,
            seed: self.rng.seed,
            draws: self.rng.draws,
            stale: shard.is_some_and(|s| s.stale.is_some()),
            digest: *h.finalize().as_bytes(),
            kept_sum: shard.is_some() && self.kept_sum().is_some(),
            target: None,
        })
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
        let mut mine = self.regroup_facts()?;
        mine.target = target.as_ref().map(ShardLayout::kept);
        let row = mine.encode();
        let mut words = vec![0i64; WORDS * world];
        words[WORDS * rank..WORDS * (rank + 1)].copy_from_slice(&row);
        reduce.allreduce_sum_i64(&mut words, step_tag)?;
        if words[WORDS * rank..WORDS * (rank + 1)] != row[..] {
            return Err(TrainerError::Mismatch(
                "a peer altered this rank's facts in the regroup's sum".into(),
            ));
        }
        let facts = regroup::decode_all(&words, world)?;
        match regroup::plan(n, &facts, bounds, self.job.reproducible)? {
            Some(plan) => self.carry_out(rank, target, &plan, step_tag, reduce).map(Some),
            None => Ok(None),
        }
    }

    /// Carries out a regroup's `plan` as rank `rank` (every rank of the group carries out
    /// the same plan, so all take the same collectives): returns the step rebuilt.
    fn carry_out(
        &mut self,
        rank: usize,
        target: Option<ShardLayout>,
        plan: &RegroupPlan,
        step_tag: u64,
        reduce: &mut dyn Reduce,
    ) -> Result<u64, TrainerError> {
        let (n, step) = (self.grads.grads_len(), plan.step);
        // A reproducible job's exponents for the next step are state, like its position:
        // every rank leaves with those of the rank it takes the position from. Taken before
        // anything here changes (every rank reaches this point), kept until the state is.
        let exponents = match self.job.reproducible {
            true => Some(exponents_of(
                plan.newest,
                rank,
                self.exact_exponents.as_deref(),
                self.model.params().len() + 1,
                step_tag,
                reduce,
            )?),
            false => None,
        };
        if let Some(giver) = plan.sum_giver.filter(|_| plan.catches_up.contains(&true)) {
            let sum = sum_of_step(
                giver,
                rank,
                self.kept_sum(),
                (n, self.model.params().len() + 1, self.plan.global_batch),
                step_tag,
                reduce,
            )?;
            if plan.catches_up[rank] {
                let (acc, exps) = sum;
                let layout = self.shard.as_ref().expect("a holder").layout.clone();
                let next = self.dequantize_sum(&acc, &exps);
                let stats = self.update_exact_held(&layout, next, step - 1)?;
                self.unlogged = Some(stats);
                self.advance();
                self.shard.as_mut().expect("a holder").stale =
                    Some("a step finished at a regroup that did not complete".into());
            }
        }
        if plan.finishes[rank] {
            let layout = self.shard.as_ref().expect("a holder").layout.clone();
            let norm = plan.norm.expect("a rank finishes with a norm");
            let lr = self.apply_held(&layout, norm)?;
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
            (s.pending, s.last_norm) = (None, Some((step - 1, norm)));
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
        let rounds = if plan.moves_params() { slots + 1 } else { slots };
        let taken = |moves: &[regroup::Piece]| {
            moves.iter().filter(|p| p.to.contains(&rank)).map(|p| p.range.len()).sum::<usize>()
        };
        self.regroup_values =
            (slots * taken(&plan.slot_moves) + (rounds - slots) * taken(&plan.param_moves)) as u64;
        // Each slot, then the parameters (last, so a failure leaves them as they were): the
        // givers' values are copied, bit for bit.
        for k in 0..rounds {
            all.iter_mut().for_each(|v| *v = 0.0);
            for (_, range) in plan.pieces.iter().filter(|p| p.0 == rank) {
                self.give_values(k, range.clone(), &mut all)?;
            }
            let moves = if k == slots { &plan.param_moves } else { &plan.slot_moves };
            reduce.relay(&mut all, moves, rank, step_tag)?;
            if k == slots {
                if plan.params_to[rank] {
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
            for range in &plan.own[rank] {
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
        if target.is_none() && self.step != step {
            // Parameters of another step: this rank must load the whole state of `step`.
            self.shard = None;
            self.optim = Optimizer::new(self.optim.spec(), params);
            return Ok(step);
        }
        if let Some(e) = exponents {
            self.exact_exponents = e;
        }
        if target.is_some() {
            // Every rank leaves at the step rebuilt, where the chosen layout's holder is.
            if self.step != step {
                self.unlogged = None;
            }
            (self.step, self.cursor) = (step, plan.cursor);
            self.rng = RngState { seed: plan.seed, draws: plan.draws };
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
        Ok(step)
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

//! [`Trainer`]: one rank's model, optimizer state, position in the data, and the split step.
//!
//! A step is three calls so that the network can sit in the middle:
//! [`Trainer::compute_grads`] sums per-sample gradients of this rank's share (accumulating over
//! micro-batches) into one flat buffer with the loss sum, the sample count and the squared
//! norm of its own mean gradient (for AdaScale's variance estimate) at its end; a
//! [`Reduce`] sums the buffers of all ranks elementwise, in place; [`Trainer::apply_reduced`]
//! divides by the global sample count, clips, and steps the optimizer. Every rank that
//! reduces the same buffers applies the same update. The buffer is the trainer's own (see
//! [`grads`]): on the CPU it is where backward writes the gradients.

mod buckets;
mod eval;
mod exact;
mod file;
mod grads;
mod local;
mod mode;
mod overlap;
mod reduce;
mod shard;
mod stage;

pub use eval::EvalSums;

pub(crate) use exact::shard_count;
pub use exact::{MAX_SHARDS, SHARDS};
pub use local::{LocalGroup, LocalRank, LocalSums};
pub use mode::{StepMode, StepOutcome};
pub use overlap::OverlapProbe;
pub use reduce::{NoReduce, Piece, Reduce};
pub use shard::{CheckpointPart, ShardLayout};

use crate::data::Dataset;
use crate::job::JobSpec;
use crate::model::Model;
use crate::optim::{clip_global_norm, scale_and_clip_on_device, Kernels, Optimizer};
use crate::sampler::{BatchPlan, Sampler};
use crate::TrainerError;
use grads::GradBuffer;
use limpet_snapshot::{Dtype, RawTensor, RngState, StateImage};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// What one applied step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// The step that was applied (0-based).
    pub step: u64,
    /// Mean training loss over the global batch.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Samples in the global batch.
    pub samples: usize,
    /// Sum over ranks of the squared norm of each rank's own mean gradient: with the global
    /// mean's norm it estimates the per-sample gradient variance (AdaScale).
    pub rank_mean_sq_sum: f64,
    /// A reproducible step computed at exponents the ranks agreed on, because the
    /// prediction missed or there was none (see `train/exact.rs`): one collective and one
    /// set of passes more.
    pub agreed: bool,
}

/// Held-out metrics.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Eval {
    /// Mean loss per test sample.
    pub loss: f64,
    /// Fraction of test predictions that were right (per token for character models).
    pub accuracy: f64,
}

/// One step of a job's sample order (what `limpet train --print-order` writes).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepOrder {
    /// The step (0-based).
    pub step: u64,
    /// Its learning rate.
    pub lr: f64,
    /// Its samples in order, where the dataset's files hold them.
    pub samples: Vec<crate::data::Source>,
}

/// One rank's training state and the machinery to advance it.
#[derive(Debug)]
pub struct Trainer {
    job: JobSpec,
    data: Dataset,
    model: Model,
    optim: Optimizer,
    sampler: Sampler,
    plan: BatchPlan,
    step: u64,
    /// Samples consumed so far: where the next step's global batch starts in the sample
    /// order. Equals `step * global_batch` while the batch never changed.
    cursor: u64,
    /// Learning-rate multiplier set by the elastic batch policy (1 for a fixed global batch).
    lr_scale: f64,
    rng: RngState,
    grads: GradBuffer,
    /// Samples each rank computes per step, when they are unequal (see
    /// [`BatchPlan::share_in`]); empty: equal shares.
    shares: Vec<u64>,
    /// Milliseconds the last step's own work took: forward and backward of this rank's
    /// blocks over its samples, without waiting on peers (see [`Trainer::compute_ms`]).
    compute_ms: f64,
    /// Milliseconds the current pipelined step spent in its stage links (not compute).
    link_ms: f64,
    /// A reproducible job's exponents for the next step, per tensor and the loss (see
    /// [`exact`]): state, carried in images.
    exact_exponents: Option<Vec<i32>>,
    /// A reproducible step's fixed-point sum, kept between steps to spare the allocation.
    exact_acc: Vec<i64>,
    /// The step count a reproducible step's sum in `exact_acc` brought this rank to, and the
    /// exponents it was made at: set once the sum is whole, cleared when a step begins.
    exact_sum: Option<(u64, Vec<i32>)>,
    /// A reproducible step's second gradient buffer (see `exact.rs`), made when first needed.
    exact_spare: Option<GradBuffer>,
    /// The thread an overlapped step sums its buckets on (see `overlap.rs`), kept from step
    /// to step; made when first needed.
    bucket_thread: Option<std::sync::Arc<rayon::ThreadPool>>,
    /// How the last overlapped step's buckets met its backward (see [`OverlapProbe`]).
    overlap: std::sync::Arc<overlap::OverlapProbe>,
    /// The optimizer state of the blocks this rank holds, when it is sharded (`optim` is
    /// then empty).
    shard: Option<shard::ShardState>,
    /// A sharded step applied after its collectives broke (see [`Trainer::take_unlogged`]).
    unlogged: Option<StepStats>,
    /// Values the last regroup moved to this rank from others (see [`Trainer::regroup_values`]).
    regroup_values: u64,
    /// Tells this state from a replaced one (see [`Trainer::stamp`]).
    stamp: u64,
    /// The stamp of the leader whose state this local rank copied last.
    following: Option<u64>,
}

impl Trainer {
    /// A fresh trainer at step 0, initialized from the job's seed.
    pub fn try_new(job: JobSpec, data: Dataset) -> Result<Self, TrainerError> {
        let blocks = 0..job.model.num_blocks();
        Self::for_stage(job, data, blocks)
    }

    /// A fresh trainer of blocks `blocks` of the job's model: one pipeline stage. Its state
    /// (and image) holds only those blocks' parameters and optimizer slots, with the names
    /// and initial values they have in the whole model.
    pub fn for_stage(job: JobSpec, data: Dataset, blocks: Range<usize>) -> Result<Self, TrainerError> {
        Self::on_device(job, data, blocks, Device::Cpu)
    }

    /// A fresh trainer of blocks `blocks` whose parameters and optimizer state live on
    /// `device`. Batches are read on the host and copied there; gradients come back to the
    /// host as one flat buffer per step, so every other part of limpet sees host bytes.
    pub fn on_device(
        job: JobSpec,
        data: Dataset,
        blocks: Range<usize>,
        device: Device,
    ) -> Result<Self, TrainerError> {
        job.validate(&data)?;
        if job.reproducible && device != Device::Cpu {
            // The same bits on every rank need the same kernels: deterministic ones on a GPU.
            crate::device::reproducible_kernels().map_err(|e| TrainerError::Config(e.to_string()))?;
        }
        let model = Model::build(&job.model, blocks, job.seed, device, job.precision)?;
        let optim = Optimizer::new(&job.optimizer, model.params());
        let plan = BatchPlan::try_new(job.global_batch, job.micro_batch)?;
        let sampler = Sampler::new(job.seed, data.train.len());
        let rng = RngState::new(job.seed);
        // A job that gives its device gradients back between steps, or whose two buffers take
        // them in turn, keeps each gradient its own.
        let own = job.reproducible || job.shard_state.is_some_and(|s| s.gradients);
        let grads = GradBuffer::new(model.params(), device, own)?;
        Ok(Trainer {
            job,
            data,
            model,
            optim,
            sampler,
            plan,
            step: 0,
            cursor: 0,
            lr_scale: 1.0,
            rng,
            grads,
            shares: Vec::new(),
            compute_ms: 0.0,
            link_ms: 0.0,
            exact_exponents: None,
            exact_acc: Vec::new(),
            exact_sum: None,
            exact_spare: None,
            bucket_thread: None,
            overlap: Default::default(),
            shard: None,
            unlogged: None,
            regroup_values: 0,
            stamp: local::next_stamp(),
            following: None,
        })
    }

    /// Restores a trainer from `image`. The image's own job is used; if `expected` is given it
    /// must equal the image's job, and the error names the first field that differs.
    pub fn from_image(
        image: &StateImage,
        data: Dataset,
        expected: Option<&JobSpec>,
    ) -> Result<Self, TrainerError> {
        let meta = image.meta();
        let job: JobSpec = serde_json::from_value(meta.job.clone())
            .map_err(|e| TrainerError::Mismatch(format!("checkpoint's job spec is unreadable: {e}")))?;
        if let Some(d) = expected.and_then(|e| e.diff(&job)) {
            return Err(TrainerError::Mismatch(format!("job field {d} (expected vs checkpoint)")));
        }
        let mut t = Trainer::try_new(job, data)?;
        t.load_image(image)?;
        Ok(t)
    }

    /// Replaces this trainer's state (parameters, optimizer state, step, cursor, RNG) with
    /// `image`'s, which must be of the same job: how a newcomer or a lagging rank takes a
    /// live peer's state. Nothing changes when the image does not fit.
    pub fn load_image(&mut self, image: &StateImage) -> Result<(), TrainerError> {
        // A whole image replaces sharded state too (the way back after a failed re-cut).
        self.drop_shard();
        self.stamp = local::next_stamp();
        let meta = image.meta();
        let job: JobSpec = serde_json::from_value(meta.job.clone())
            .map_err(|e| TrainerError::Mismatch(format!("the image's job spec is unreadable: {e}")))?;
        if let Some(d) = self.job.diff(&job) {
            return Err(TrainerError::Mismatch(format!("job field {d} (this trainer vs the image)")));
        }
        if meta.cursor < meta.step {
            return Err(TrainerError::Mismatch(format!(
                "field 'cursor' is {} but {} steps consume at least {} samples",
                meta.cursor, meta.step, meta.step
            )));
        }
        let mut expected_names = Vec::new();
        self.optim.materialize();
        let targets: Vec<(String, Tensor)> = {
            let params = self.model.params();
            let mut v: Vec<(String, Tensor)> =
                params.iter().map(|(n, p)| (format!("param/{n}"), p.shallow_clone())).collect();
            v.extend(self.optim.named_state(params).map(|(n, s)| (n, s.shallow_clone())));
            v
        };
        // Check every tensor before copying any, so a bad image changes nothing.
        for (name, dst) in &targets {
            let src = image
                .tensors()
                .get(name)
                .ok_or_else(|| TrainerError::Mismatch(format!("tensor '{name}' is missing")))?;
            check_fits(name, src, dst)?;
            expected_names.push(name.clone());
        }
        let exponents = self.exponents_in(image)?;
        expected_names.push(exact::EXPONENTS.to_string());
        if let Some(extra) = image.tensors().keys().find(|k| !expected_names.contains(k)) {
            return Err(TrainerError::Mismatch(format!("tensor '{extra}' does not belong to this model")));
        }
        for (name, dst) in targets {
            load_into(&image.tensors()[&name], dst)?;
        }
        self.step = meta.step;
        self.cursor = meta.cursor;
        self.rng = meta.rng;
        self.exact_exponents = exponents;
        self.exact_sum = None;
        Ok(())
    }

    /// Replaces the seed's initial weights with a Hugging Face LLaMA checkpoint's (the job's
    /// `init_from`): only before the first step, only weights whose fingerprint the job
    /// records, and only for the model the job describes.
    pub fn init_from_hf(&mut self, dir: &std::path::Path) -> Result<(), TrainerError> {
        if self.step != 0 {
            return Err(TrainerError::Config(format!(
                "init_from applies at step 0, this state is at step {}",
                self.step
            )));
        }
        let crate::model::ModelSpec::Llama(ours) = &self.job.model else {
            return Err(TrainerError::Config("init_from needs model 'llama'".into()));
        };
        self.stamp = local::next_stamp();
        let w = crate::hf::read_weights(dir, Some(ours.context))?;
        if &w.spec != ours {
            return Err(TrainerError::Mismatch(format!(
                "{} describes {:?}, the job's model is {ours:?}",
                dir.display(),
                w.spec
            )));
        }
        if self.job.init.as_deref() != Some(w.fingerprint.as_str()) {
            return Err(TrainerError::Mismatch(format!(
                "the weights in {} have fingerprint {}, the job records {:?}",
                dir.display(),
                w.fingerprint,
                self.job.init
            )));
        }
        self.model.load_named(&w.tensors)
    }

    /// Sets the batch plan and learning-rate multiplier of an epoch (the elastic batch
    /// policy's decision). Under `fixed-global` this keeps the job's own batch and scale 1.
    pub fn set_epoch_plan(
        &mut self,
        global_batch: usize,
        micro_batch: usize,
        lr_scale: f64,
    ) -> Result<(), TrainerError> {
        if !(lr_scale.is_finite() && lr_scale > 0.0) {
            return Err(TrainerError::Config(format!("lr scale {lr_scale} is not a positive number")));
        }
        self.plan = BatchPlan::try_new(global_batch, micro_batch)?;
        self.lr_scale = lr_scale;
        self.shares.clear();
        Ok(())
    }

    /// Sets the samples each rank computes per step (an epoch that gives a slower host a
    /// smaller share); empty for equal shares. Which samples a step trains does not change,
    /// only who computes them.
    pub fn set_shares(&mut self, shares: Vec<u64>) {
        self.shares = shares;
    }

    /// Milliseconds the last step's own work took on this host: forward and backward of its
    /// blocks over its samples, without the time spent receiving from or sending to peers
    /// and reducing with them (what a straggler drill stretches).
    pub fn compute_ms(&self) -> f64 {
        self.compute_ms
    }

    /// The current batch plan.
    pub fn plan(&self) -> BatchPlan {
        self.plan
    }

    /// The job.
    pub fn job(&self) -> &JobSpec {
        &self.job
    }

    /// The data.
    pub fn data(&self) -> &Dataset {
        &self.data
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Next step to run (= steps applied so far).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Length of the flat buffer [`Trainer::compute_grads`] fills: every parameter element,
    /// then the loss sum, the sample count and the squared norm of this rank's mean gradient.
    pub fn buffer_len(&self) -> usize {
        self.model.num_elements() + 3
    }

    /// Computes this rank's share of the current step into the trainer's buffer: the sum
    /// over its samples of the per-sample loss gradients, then the loss sum, the sample count
    /// and the squared norm of the share's mean gradient. The caller sums the buffer over
    /// ranks in place, then calls [`Trainer::apply_reduced`].
    pub fn compute_grads(&mut self, rank: usize, world: usize) -> Result<&mut [f32], TrainerError> {
        self.compute_share(rank, world, true)?;
        Ok(self.grads.as_mut_slice())
    }

    /// [`Trainer::compute_grads`], leaving staged gradients on the device (the buffer's
    /// gradient values then undefined) unless `stage`.
    fn compute_share(&mut self, rank: usize, world: usize, stage: bool) -> Result<(), TrainerError> {
        let started = std::time::Instant::now();
        self.grads.zero(self.model.params(), self.shards_gradients())?;
        let share = self.plan.share_in(rank, world, &self.shares);
        let positions = self.cursor + share.start as u64..self.cursor + share.end as u64;
        let step_seed = self.peek_step_seed();
        let mut loss_sum = 0.0;
        for (k, mb) in self.plan.micro_batches(positions.clone()).enumerate() {
            self.seed_micro_batch(step_seed, mb.start, k);
            let idx = self.sampler.indices(mb);
            let (x, y) = self.batch_on_device(&idx)?;
            loss_sum += self.model.loss_backward(&x, &y, self.job.memory_plan())?;
        }
        self.finish_grads(loss_sum, (positions.end - positions.start) as f64, stage)?;
        self.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// Finishes the current step alone, as the step its group of `world` ranks broke in
    /// would have gone: every rank's share computed here as that rank computed it (its
    /// samples, micro-batches and dropout), summed, then the update. A reproducible job's
    /// step is the same bits as the group's; any other rounds otherwise (the same values
    /// summed in another order). For a survivor a step behind another, which then checks
    /// the other's state against its own (the agent's entry).
    pub fn finish_step_alone(&mut self, world: usize) -> Result<StepStats, TrainerError> {
        self.refuse_sharded("finishing a step alone")?;
        if self.job.reproducible {
            return self.exact_step(0, 1, &mut NoReduce);
        }
        let mut sum: Vec<f32> = Vec::new();
        for rank in 0..world.max(1) {
            let part = self.compute_grads(rank, world.max(1))?;
            match sum.is_empty() {
                true => sum = part.to_vec(),
                false => sum.iter_mut().zip(part.iter()).for_each(|(s, p)| *s += p),
            }
        }
        self.apply_update(&sum)
    }

    /// Applies the update from `reduced`, a buffer summed over ranks elsewhere (the sum of
    /// every rank's [`Trainer::compute_grads`] output), and advances to the next step.
    pub fn apply_update(&mut self, reduced: &[f32]) -> Result<StepStats, TrainerError> {
        let n = self.grads.grads_len();
        if reduced.len() != n + 3 {
            return Err(TrainerError::reduce(format!(
                "buffer has {} values, expected {}",
                reduced.len(),
                n + 3
            )));
        }
        self.grads.as_mut_slice().copy_from_slice(reduced);
        self.apply_reduced()
    }

    /// Applies the update from the trainer's buffer, which the caller summed over ranks in
    /// place after [`Trainer::compute_grads`], and advances to the next step.
    pub fn apply_reduced(&mut self) -> Result<StepStats, TrainerError> {
        self.apply_sums(false)
    }

    /// [`Trainer::apply_reduced`], where staged gradients' sums are on the device already
    /// when `on_device` (a reduce that summed them there), else in the host buffer.
    fn apply_sums(&mut self, on_device: bool) -> Result<StepStats, TrainerError> {
        self.refuse_sharded("an unsharded step")?;
        let n = self.grads.grads_len();
        let staged = self.grads.is_staged();
        let reduced = self.grads.as_mut_slice();
        let rank_mean_sq_sum = f64::from(reduced[n + 2]);
        let samples = reduced[n + 1];
        check_count(samples, self.plan.global_batch, "rank")?;
        let loss = f64::from(reduced[n]) / f64::from(samples);
        let inv = 1.0 / samples;
        if staged {
            // The sum goes back to the device as the ring left it, in one copy (none when
            // it was summed there), and is averaged, normed and clipped there: no pass over
            // it on the host.
            let g = match on_device {
                true => self.grads.staged().expect("staged").shallow_clone(),
                false => self.grads.grads()?,
            };
            let grad_norm = scale_and_clip_on_device(&g, inv, self.job.clip_norm)?;
            return self.apply_clipped(loss, grad_norm, samples as usize, rank_mean_sq_sum, &g);
        }
        let grad = &mut reduced[..n];
        grad.iter_mut().for_each(|g| *g *= inv);
        let grad_norm = clip_global_norm(grad, self.job.clip_norm);
        let g = self.grads.grads()?;
        self.apply_clipped(loss, grad_norm, samples as usize, rank_mean_sq_sum, &g)
    }

    /// Steps the optimizer with the averaged, clipped gradient `g` (the buffer's, as
    /// [`grads::GradBuffer::grads`] gave it) and advances to the next step.
    fn apply_clipped(
        &mut self,
        loss: f64,
        grad_norm: f64,
        samples: usize,
        rank_mean_sq_sum: f64,
        g: &Tensor,
    ) -> Result<StepStats, TrainerError> {
        let lr =
            self.job.optimizer.lr() * self.job.schedule.factor(self.step, self.job.steps) * self.lr_scale;
        self.optim.apply(
            self.model.params(),
            g,
            lr,
            self.step + 1,
            Kernels::for_job(self.job.reproducible, self.model.device()),
        )?;
        let stats =
            StepStats { step: self.step, loss, lr, grad_norm, samples, rank_mean_sq_sum, agreed: false };
        self.advance();
        Ok(stats)
    }

    /// Seeds the stochastic layers for micro-batch `k` of a step, which starts at position
    /// `start` of the sample order. Masks depend on the training RNG and the micro-batch's
    /// stream position only, so a replay from a checkpoint draws the same ones.
    fn seed_micro_batch(&self, step_seed: u64, start: u64, k: usize) {
        if self.model.is_stochastic() {
            self.model.seed_dropout(step_seed ^ start.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k as u64);
        }
    }

    /// Moves on to the next step once one is applied.
    fn advance(&mut self) {
        self.next_step_seed();
        self.step += 1;
        self.cursor += self.plan.global_batch as u64;
    }

    pub(crate) fn refuse_sharded(&self, what: &str) -> Result<(), TrainerError> {
        match &self.shard {
            Some(_) => Err(TrainerError::Config(format!(
                "{what} needs the whole optimizer state, which is sharded over the ranks: unshard it first"
            ))),
            None => Ok(()),
        }
    }

    /// The samples and learning rate of step `step` of this job while its global batch is
    /// the job's: the same for any number of ranks, since shares tile each step's samples.
    /// What another framework needs to train on the very same sequence.
    pub fn order(&mut self, step: u64) -> StepOrder {
        let b = self.job.global_batch as u64;
        let samples = self
            .sampler
            .indices(step * b..(step + 1) * b)
            .into_iter()
            .map(|i| self.data.train.source_of(i as u64))
            .collect();
        let lr = self.job.optimizer.lr() * self.job.schedule.factor(step, self.job.steps);
        StepOrder { step, lr, samples }
    }

    /// The samples at `indices` of the training split, on the model's device.
    fn batch_on_device(&self, indices: &[i64]) -> Result<(Tensor, Tensor), TrainerError> {
        let (x, y) = self.data.train.batch(indices)?;
        let d = self.model.device();
        Ok((self.shaped(x).to_device(d), y.to_device(d)))
    }

    /// Inputs as the model takes them: limpet's own models read array rows flat; a
    /// TorchScript module gets each row in the shape its file has (`[batch, C, H, W]` for
    /// images stored that way).
    fn shaped(&self, x: Tensor) -> Tensor {
        match (&self.job.model, self.data.train.row_shape()) {
            (crate::model::ModelSpec::Torchscript(_), Some(shape)) => {
                let mut full = vec![x.size()[0]];
                full.extend(shape.iter().map(|&d| d as i64));
                x.view(full.as_slice())
            }
            _ => x,
        }
    }

    /// Completes the buffer after this rank's backward passes: the gradients in place (copied
    /// from the device when they are not views of it, but for staged gradients left on the
    /// device unless `stage`), then the loss sum, the sample count
    /// and the squared norm of the mean gradient.
    fn finish_grads(&mut self, loss_sum: f64, count: f64, stage: bool) -> Result<(), TrainerError> {
        if stage || !self.grads.is_staged() {
            self.grads.collect(self.model.params(), self.shards_gradients())?;
        }
        let n = self.grads.grads_len();
        // Staged: squared on the device, which holds the same values.
        let on_device = self.grads.staged().map(crate::optim::device_sum_of_squares).transpose()?;
        let buf = self.grads.as_mut_slice();
        let sq: f64 = match on_device {
            Some(sq) => sq,
            None => buf[..n].iter().map(|&g| f64::from(g) * f64::from(g)).sum(),
        };
        buf[n] = loss_sum as f32;
        buf[n + 1] = count as f32;
        buf[n + 2] = if count > 0.0 { (sq / (count * count)) as f32 } else { 0.0 };
        Ok(())
    }

    /// How many values of the gradient buffer may travel between ranks in bfloat16: every
    /// gradient when the job says `reduce_dtype = "bf16"`, else none. Never the step's loss
    /// and sample count, which follow them.
    pub fn lossy_values(&self) -> usize {
        match self.job.reduce_dtype {
            crate::ReduceDtype::Bf16 => self.grads.grads_len(),
            crate::ReduceDtype::Fp32 => 0,
        }
    }

    /// The whole state as a portable image (parameters, optimizer slots, step, cursor, RNG).
    pub fn image(&self) -> Result<StateImage, TrainerError> {
        self.refuse_sharded("a state image")?;
        let mut slots = BTreeMap::new();
        for (name, s) in self.optim.named_state(self.model.params()) {
            let t = raw(&name, s)?;
            slots.insert(name, t);
        }
        self.image_with(slots)
    }

    /// The image of this trainer's parameters, step, cursor and RNG with the optimizer
    /// state `slots` (its own, or gathered from shards).
    pub(super) fn image_with(
        &self,
        mut tensors: BTreeMap<String, RawTensor>,
    ) -> Result<StateImage, TrainerError> {
        for (name, p) in self.model.params() {
            tensors.insert(format!("param/{name}"), raw(&format!("param/{name}"), p)?);
        }
        if let Some(t) = self.exponents_tensor()? {
            tensors.insert(exact::EXPONENTS.to_string(), t);
        }
        let job = serde_json::to_value(&self.job).expect("JobSpec serializes");
        Ok(StateImage::new(self.step, self.cursor, self.rng, job, tensors))
    }

    fn rng_at(&self) -> ChaCha8Rng {
        let mut r = ChaCha8Rng::seed_from_u64(self.rng.seed);
        // Each draw is one 64-bit value: two 32-bit words of the ChaCha stream.
        r.set_word_pos(u128::from(self.rng.draws) * 2);
        r
    }

    fn peek_step_seed(&self) -> u64 {
        self.rng_at().next_u64()
    }

    fn next_step_seed(&mut self) -> u64 {
        let v = self.rng_at().next_u64();
        self.rng.draws += 1;
        v
    }
}

/// Copies an f32 tensor out as raw bytes.
fn raw(name: &str, t: &Tensor) -> Result<RawTensor, TrainerError> {
    let shape = t.size().iter().map(|&d| d as usize).collect();
    Ok(RawTensor::try_new(name, Dtype::F32, shape, host_bytes(t)?)?)
}

/// An f32 tensor's bytes in host memory (little-endian, row-major), wherever it lives.
fn host_bytes(t: &Tensor) -> Result<Vec<u8>, TrainerError> {
    let t = t.detach().to_kind(Kind::Float).to_device(Device::Cpu).contiguous();
    let n = t.numel();
    let mut bytes = vec![0u8; n * 4];
    t.f_copy_data_u8(&mut bytes, n)?;
    Ok(bytes)
}

/// Copies an image tensor into a parameter or slot, checking dtype and shape.
fn check_fits(name: &str, src: &RawTensor, dst: &Tensor) -> Result<(), TrainerError> {
    let want: Vec<usize> = dst.size().iter().map(|&d| d as usize).collect();
    if src.dtype() != Dtype::F32 || src.shape() != want.as_slice() {
        return Err(TrainerError::Mismatch(format!(
            "tensor '{name}' is {} {:?}, the model needs F32 {want:?}",
            src.dtype().name(),
            src.shape()
        )));
    }
    Ok(())
}

fn load_into(src: &RawTensor, mut dst: Tensor) -> Result<(), TrainerError> {
    let values = src.to_f32().expect("checked F32");
    tch::no_grad(|| dst.f_copy_(&Tensor::from_slice(&values).view_as(&dst)))?;
    Ok(())
}

#[cfg(test)]
mod tests;

/// Refuses a reduced sample count that is not the global batch: some `whose` share is
/// missing from the sum or counted twice.
fn check_count(samples: f32, global_batch: usize, whose: &str) -> Result<(), TrainerError> {
    if samples.round() as usize != global_batch {
        return Err(TrainerError::reduce(format!(
            "reduced sample count {samples} is not the global batch {global_batch}: a {whose}'s share is missing or doubled"
        )));
    }
    Ok(())
}

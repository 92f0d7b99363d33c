//! limpet's trainer: everything one rank needs to train, and nothing about networking.
//!
//! Data flows through it like this. A [`JobSpec`] names the model, data, optimizer and batch.
//! [`data::Dataset`] loads real data (digits, a character corpus) or a seeded synthetic set and
//! splits it deterministically. [`sampler`] turns `(step, rank, world, plan)` into the sample
//! indices of a rank's share of the global batch, so the union over ranks is the same global
//! batch for any world size. A [`Trainer`] computes summed gradients for its share into one flat
//! buffer ([`Trainer::compute_grads`]), hands the buffer to a [`Reduce`] (identity in one
//! process, a ring allreduce across hosts), and applies the averaged update with an optimizer
//! whose state it owns ([`optim`]). [`Trainer::image`] and [`Trainer::from_image`] convert the
//! whole state to and from the portable [`limpet_snapshot::StateImage`], whose content hash is
//! how ranks prove they hold the same state.

// Audited exceptions, each marked where it is: the gradient buffer lends libtorch's memory to
// the collectives (train/grads.rs), which no safe tch call can do without a model-sized
// copy; it calls forget_grad.cpp with a tensor's handle (what tch does not expose); and
// device.rs asks glibc to hand freed heap pages back (malloc_trim, which takes no pointers).
#![deny(unsafe_code)]

pub mod data;
pub mod device;
mod error;
pub mod hf;
mod job;
pub mod job_keys;
pub mod model;
pub mod optim;
pub mod pipeline;
pub mod profile;
mod run;
pub mod sampler;
mod train;
pub mod workload;

pub use error::{Malformed, NotOneOf, TrainerError};
pub use job::{JobSpec, ModelKind, ReduceDtype, Sharding};
pub use run::{
    peak_rss_bytes, pending_checkpoint_path, place_checkpoint, rss_bytes, run_local, save_checkpoint,
    save_image, Progress, RunOptions, RunReport, CHECKPOINT_FILE, PENDING_CHECKPOINT_FILE,
};
pub use train::{
    CheckpointPart, Eval, EvalSums, LocalGroup, LocalRank, LocalSums, NoReduce, OverlapProbe, Piece, Reduce,
    ShardLayout, StepMode, StepOrder, StepOutcome, StepStats, Trainer, MAX_SHARDS, SHARDS,
};

/// Makes libtorch use `n` intra-op threads. limpet runs one thread per rank by default, so
/// several ranks on one machine do not oversubscribe it and results do not depend on how a
/// reduction was split across threads.
pub fn set_threads(n: usize) {
    tch::set_num_threads(n.clamp(1, i32::MAX as usize) as i32);
    tch::set_num_interop_threads(1);
}

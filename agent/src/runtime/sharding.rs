//! A job's sharded optimizer state (`[job].shard_state = "optimizer"`) across epochs. At an
//! entry the new group re-cuts it directly: each rank takes the blocks the new layout gives
//! it from a live holder (so a `kill -9` of one holder loses nothing), the parameters and the
//! step's position come along, and no rank ever holds the whole state. In a new job's first
//! epoch every rank holds the same state: each cuts its own shard once the ranks agree on
//! its digest. Otherwise, where no rank holds a shard (a rank with whole state further on, a
//! checkpoint loaded) the entry copies whole states as for any job and the state is cut
//! once the entry agreed. A checkpoint the ranks know is due is written as shards by their
//! holders, or gathered whole into one host rank's memory, the ranks keeping their blocks.
//! The job's final checkpoint is written by each host's first rank from the gathers
//! themselves, one optimizer tensor held at a time ([`Trainer::write_gathered_file`]), under
//! a pending name until the job is known to have ended there ([`Final`]). A block with no live
//! holder sends every rank back to the newest checkpoint.
//!
//! A host of several local ranks (`[node].devices`) shards over its devices: each local
//! rank is a rank of the layout, which places every block's replicas on other hosts
//! ([`ShardLayout::over_hosts`]), and every local rank takes part in the re-cut, the
//! gathers and the checkpoint's parts ([`super::local_ranks::each`]). On hosts of unequal
//! device counts the first `m` devices of every host (`m` the fewest any host has) hold the
//! blocks, as on hosts of `m`; a host's other devices own empty blocks, train, and take the
//! gathered parameters ([`ShardLayout::over_host_counts`]).

use super::checkpointer;
use super::error::AgentError;
use crate::Group;
use limpet_consensus::state::{ClusterState, Epoch};
use limpet_decide::regroup::RegroupBounds;
use limpet_snapshot::StateImage;
use limpet_trainer::{JobSpec, ShardLayout, Trainer, TrainerError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sharded job's final checkpoint on this host, made by its ranks together at the job's
/// last step or at an entry past it; the host's agent writes it into place when the job
/// finishes there.
pub(super) enum Final {
    /// The whole state gathered into host memory (at a last step a periodic checkpoint was
    /// due at too, which is written from it).
    Image(Arc<StateImage>),
    /// Written from the gathers a tensor at a time under the pending name in the state
    /// directory ([`limpet_trainer::PENDING_CHECKPOINT_FILE`]), with its content hash.
    Pending { path: PathBuf, hash: String },
    /// The gathers went through, but the file could not be written (a full disk, a
    /// directory that cannot be made): the job's end fails on this host as a failed final
    /// write always has.
    Failed(TrainerError),
}

/// How the state of a job that shards it entered an epoch.
pub(super) enum Sharded {
    /// Re-cut for the new group: the entry is done but for its barrier. The bytes this rank
    /// took from others (not those it passed on for them), and the time it took; past the
    /// job's last step, the host's final checkpoint (unless it wrote one already).
    Recut { bytes: u64, ms: u64, final_state: Option<Final> },
    /// The entry copies whole states as for any job, after `redone` steps were given up
    /// (a block lost with every holder sent the ranks back to a checkpoint).
    Whole { redone: u64 },
}

/// The first part of an entry into `n` for a job that shards its state (every rank of the
/// group calls it, with its host's trainers: `trainer` and the `followers` of its other
/// devices; `step_tag` marks the collectives). `Some`: the state is re-cut for the
/// new group, every rank at the same step with the same parameters (past the job's end,
/// with the final checkpoint written, pending, into `final_dir` where the host has not
/// written its own): the entry is done but for its barrier. `None`: the entry copies whole states: no rank held a shard, a rank held whole
/// state further on, or a lost block sent every rank back to a checkpoint. A rank left with state of another step than
/// the one rebuilt (or a shard) then starts afresh, so the entry copies the state to it as
/// to a newcomer; a host's followers then copy the host's state after the entry.
pub(super) fn enter(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    group: &mut Group,
    dirs @ (job, _, _): (&JobSpec, Option<&Path>, Option<(&Path, &str)>),
    st: &ClusterState,
    n: &Epoch,
    step_tag: u64,
    final_dir: Option<&Path>,
) -> Result<Sharded, AgentError> {
    if job.shard_state.is_none() {
        return Ok(Sharded::Whole { redone: 0 });
    }
    let (me, world) = (group.rank(), n.total_ranks());
    let first = n.first_rank_of(me);
    let target = layout_of(trainer, job, n, first);
    let recut = target.is_some();
    let started = Instant::now();
    let bounds = regroup_bounds(trainer, job, st, n);
    let regrouped = super::local_ranks::each(trainer, followers, n, me, group, |r, t, reduce| {
        let target = layout_of(t, job, n, r);
        t.regroup(r, world, target, step_tag, reduce, Some(&bounds))
    })?;
    // Every local rank decided from the same facts; a rank's own failure is the host's.
    let mut outcome = None;
    for r in regrouped {
        match (r, &outcome) {
            (Err(TrainerError::ShardLost(why)), _) => outcome = Some(Err(why)),
            (Err(e), _) => return Err(e.into()),
            (Ok(s), None) => outcome = Some(Ok(s)),
            (Ok(s), Some(Ok(t))) if s == *t => {}
            (Ok(_), Some(_)) => {
                return Err(AgentError::entry(format!("epoch {}: local ranks rebuilt different steps", n.id)))
            }
        }
    }
    let count = (n.local_ranks_of(me) as usize).saturating_sub(1).min(followers.len());
    let local = &mut followers[..count];
    match outcome.unwrap_or(Ok(None)) {
        Ok(Some(step)) if recut => {
            let final_state = if step >= job.steps {
                // The job's final checkpoint is whole; the ranks keep their blocks. A host
                // that wrote its own already only sends its blocks (for a newcomer's).
                let written = final_of_host((&mut *trainer, &mut *local), group, n, final_dir)?;
                match &written {
                    Some(Final::Failed(e)) => tracing::error!(
                        epoch = n.id,
                        step,
                        %e,
                        "the job's final checkpoint could not be written here; every rank keeps its blocks"
                    ),
                    Some(_) => tracing::info!(
                        epoch = n.id,
                        step,
                        "the job's final checkpoint written from the gathered state, a tensor at a time; every rank keeps its blocks"
                    ),
                    None => tracing::info!(
                        epoch = n.id,
                        step,
                        "the whole state gathered for other hosts' final checkpoints; this host wrote its own"
                    ),
                }
                written
            } else {
                None
            };
            // What this host's ranks took from others (a relay passes some values on through
            // ranks between a giver and a taker, which these do not count).
            let bytes =
                (trainer.regroup_values() + local.iter().map(Trainer::regroup_values).sum::<u64>()) * 4;
            let held = held_by((trainer, local));
            tracing::info!(epoch = n.id, step, %held, bytes, "optimizer state re-cut for the new group");
            Ok(Sharded::Recut { bytes, ms: started.elapsed().as_millis() as u64, final_state })
        }
        // Every rank takes this guard's collective (the facts, hence `None`, are the
        // group's); the step is checked after it, when it is known to be every rank's.
        Ok(None)
            if recut
                && all_hold_one_state((&*trainer, &*local), group, n, step_tag)?
                && trainer.step() < job.steps =>
        {
            for (i, t) in std::iter::once(&mut *trainer).chain(local.iter_mut()).enumerate() {
                let layout = layout_of(t, job, n, first + i).expect("a re-cut has a layout");
                t.shard_state(layout)?;
            }
            limpet_trainer::device::return_freed_host_memory();
            let held = held_by((trainer, local));
            tracing::info!(
                epoch = n.id,
                rank = first,
                %held,
                "every rank holds the same state: each keeps its own shard"
            );
            Ok(Sharded::Recut { bytes: 0, ms: started.elapsed().as_millis() as u64, final_state: None })
        }
        Ok(rebuilt) => {
            if let Some(step) = rebuilt {
                tracing::info!(epoch = n.id, step, "optimizer state gathered from its shards for the entry");
            }
            if trainer.shard_layout().is_some() || rebuilt.is_some_and(|s| s != trainer.step()) {
                *trainer = fresh(trainer, job)?;
            }
            unshard_followers(followers, job)?;
            Ok(Sharded::Whole { redone: 0 })
        }
        Err(why) => {
            let redone = back_to_checkpoint(trainer, group, dirs, st, n, &why, step_tag)?;
            unshard_followers(followers, job)?;
            Ok(Sharded::Whole { redone })
        }
    }
}

/// The blocks each local rank holds (one list for a host of one device), for the log.
fn held_by((trainer, followers): (&Trainer, &[Trainer])) -> String {
    let held = |t: &Trainer| t.shard_layout().map(ShardLayout::held).unwrap_or_default();
    match followers {
        [] => format!("{:?}", held(trainer)),
        _ => format!("{:?}", std::iter::once(trainer).chain(followers).map(held).collect::<Vec<_>>()),
    }
}

/// Starts afresh each follower holding a shard: after a whole-state entry it copies the
/// host's state, which a shard would refuse.
fn unshard_followers(followers: &mut [Trainer], job: &JobSpec) -> Result<(), AgentError> {
    for f in followers.iter_mut().filter(|f| f.shard_layout().is_some()) {
        *f = fresh(f, job)?;
    }
    Ok(())
}

/// The whole state of node `me` of `n`, gathered from the shards into host memory (a
/// collective of the group, whose ring is `group`) and kept, if `keep`, by the host's first
/// rank; every rank keeps its blocks, and no device ever holds the whole optimizer state.
fn image_of_host(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    group: &mut Group,
    n: &Epoch,
    keep: bool,
) -> Result<Option<StateImage>, TrainerError> {
    let me = group.rank();
    let first = n.first_rank_of(me);
    let gathered = super::local_ranks::each(trainer, followers, n, me, group, |r, t, reduce| {
        t.gathered_image(reduce, keep && r == first)
    })?;
    let mut image = None;
    for g in gathered {
        // Local rank 0's comes first; the others keep none, but each may have failed.
        image = image.or(g?);
    }
    Ok(image)
}

/// What [`after_step`] made: the whole state gathered for this step's checkpoint, and past
/// the job's last step its final checkpoint.
pub(super) struct AfterStep {
    pub image: Option<Arc<StateImage>>,
    pub final_state: Option<Final>,
}

/// After a step with sharded state (every rank of the group calls it, after the same
/// step): at the job's end every host's first rank writes its final checkpoint into
/// `state_dir`, pending, from the gathers a tensor at a time; if any rank has a checkpoint
/// due at that step, the whole state is gathered into host memory instead, for both. A
/// checkpoint due by the step count is written as parts, each local rank its own, when
/// every host's directory is shared; otherwise the first host's first rank gathers the
/// whole state for it (returned). The ranks agree first: parts only if every host's
/// directory is shared, and none if a rank's previous checkpoint is still being written (a
/// set missing one part is no checkpoint); the same vote finds hosts that copy to different
/// places in S3 (logged as an error). Every rank keeps its blocks throughout.
pub(super) fn after_step(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    group: &mut Group,
    n: &Epoch,
    (checkpointer, sink): (&mut checkpointer::Checkpointer, &checkpointer::Sink<'_>),
    nb: usize,
    state_dir: &Path,
) -> Result<AfterStep, TrainerError> {
    let step = trainer.step();
    let image_only = |image: Option<StateImage>| AfterStep { image: image.map(Arc::new), final_state: None };
    if step >= trainer.job().steps {
        // Only the first rank writes a whole checkpoint (`Checkpointer::maybe_write`), and
        // its due (a time trigger's) is its alone: the ranks take its word.
        let mut due = [i32::from(group.rank() == 0 && checkpointer.due_now(step))];
        group.allreduce_max_i32(&mut due, step).map_err(|e| e.into_trainer())?;
        if due[0] == 1 {
            let image = image_of_host((trainer, followers), group, n, true)?.map(Arc::new);
            let final_state = image.clone().map(Final::Image);
            return Ok(AfterStep { image, final_state });
        }
        let final_state = final_of_host((trainer, followers), group, n, Some(state_dir))?;
        return Ok(AfterStep { image: None, final_state });
    }
    if !checkpointer.due_by_steps(step) {
        return Ok(image_only(None));
    }
    let mut votes = votes(checkpointer);
    group.allreduce_max_i32(&mut votes, step).map_err(|e| e.into_trainer())?;
    let (agreed, same_s3) = decide(votes);
    if !same_s3 {
        // Written as shards, a host copying elsewhere, or not at all, leaves every set in
        // the bucket without its shards: a new cluster could never resume from it. Gathered
        // whole, the copy is whichever host's first rank writes it. The log says so at each
        // checkpoint.
        tracing::error!(
            step,
            "the hosts' [checkpoint].s3 differ (another bucket or prefix, or none): no set of shards in S3 will be whole; give every host of the job the same s3"
        );
        metrics::counter!("limpet_config_disagreements_total", "key" => "checkpoint.s3").increment(1);
    }
    match agreed {
        [1, _] => {
            tracing::warn!(
                step,
                "a rank's previous checkpoint is still being written; every rank skips this one"
            );
            Ok(image_only(None))
        }
        // Only the first host writes a whole checkpoint (`Checkpointer::maybe_write`).
        [_, 1] => {
            let first_host = group.rank() == 0;
            image_of_host((trainer, followers), group, n, first_host).map(image_only)
        }
        _ => {
            let parts = parts_of_host((trainer, followers), group, n)?;
            checkpointer.write_shards(parts, n, nb, sink);
            Ok(image_only(None))
        }
    }
}

/// This rank's votes on a checkpoint due by the step count, each to be taken as its maximum
/// over the group: whether its previous checkpoint is still being written, whether its
/// directory is not shared, and where it copies to S3 (the digest and its negation, whose
/// maxima are the group's largest and smallest).
fn votes(checkpointer: &checkpointer::Checkpointer) -> [i32; 4] {
    let s3 = checkpointer.s3_digest();
    [i32::from(checkpointer.is_busy()), i32::from(!checkpointer.writes_shards()), s3, -s3]
}

/// What the group's maxima of [`votes`] decide: the first two (skip, gather whole), and
/// whether every rank copies to the same place in S3.
fn decide(maxima: [i32; 4]) -> ([i32; 2], bool) {
    ([maxima[0], maxima[1]], maxima[2] == -maxima[3])
}

/// The final checkpoint of node `me` of `n`, written by the host's first rank into `dir`
/// (if given), pending, from the whole state gathered a tensor at a time (a collective of the
/// group, whose ring is `group`; the others only send); every rank keeps its blocks. `Err`:
/// a gather failed; a file that could not be written is [`Final::Failed`].
fn final_of_host(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    group: &mut Group,
    n: &Epoch,
    dir: Option<&Path>,
) -> Result<Option<Final>, TrainerError> {
    let me = group.rank();
    let first = n.first_rank_of(me);
    // A directory that cannot be made fails the file, not the gathers the others wait in.
    let (path, unwritable) = match dir.map(limpet_trainer::pending_checkpoint_path).transpose() {
        Ok(path) => (path, None),
        Err(e) => (None, Some(e)),
    };
    // Between its gathers a writer reads and hashes every parameter and writes each
    // tensor into its file, while its peers wait in the next gather: they wait longer than
    // for a step's sums, by the state's size (at 100 MB/s; a rank that is gone still breaks
    // the group at once when its sockets close).
    let bytes = 4 * trainer.buffer_len() as u64;
    let patience = group.patience();
    group.set_patience(patience + Duration::from_millis(bytes / 100_000));
    let written = super::local_ranks::each(trainer, followers, n, me, group, |r, t, reduce| {
        t.write_gathered_file(reduce, path.as_deref().filter(|_| r == first))
    });
    group.set_patience(patience);
    let written = written?;
    let mut file = None;
    for w in written {
        // Local rank 0's comes first; the others write none, but each may have failed.
        file = file.or(w?);
    }
    Ok(match (unwritable, path, file) {
        (Some(e), _, _) | (None, _, Some(Err(e))) => Some(Final::Failed(e)),
        (None, Some(path), Some(Ok(hash))) => Some(Final::Pending { path, hash }),
        (None, _, _) => None,
    })
}

/// Every local rank's part of a sharded checkpoint (a collective of the group).
fn parts_of_host(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    group: &mut Group,
    n: &Epoch,
) -> Result<Vec<limpet_trainer::CheckpointPart>, TrainerError> {
    let me = group.rank();
    super::local_ranks::each(trainer, followers, n, me, group, |_, t, reduce| t.checkpoint_part(reduce))?
        .into_iter()
        .collect()
}

/// Whether every rank of the group holds the same whole state, at a step the epoch may
/// start at (a new job's first epoch: each rank built it from the job's seed): then each
/// cuts its own shard and nothing moves. The entry protocol would find the same (every
/// rank keeps its state) after copying each state into an image, which would hold the whole
/// optimizer state twice more.
fn all_hold_one_state(
    (trainer, followers): (&Trainer, &[Trainer]),
    group: &mut Group,
    n: &Epoch,
    step_tag: u64,
) -> Result<bool, AgentError> {
    const F: usize = 6;
    let (rank, world) = (group.rank(), group.world());
    let mut facts = vec![0i64; F * world];
    // A host's devices count only if each holds the host's state (a host that does not
    // says it holds none, so every rank copies states).
    let digest =
        trainer.state_digest().ok().filter(|d| followers.iter().all(|f| f.state_digest().ok() == Some(*d)));
    if let Some(digest) = digest {
        facts[F * rank] = 1;
        facts[F * rank + 1] = trainer.step() as i64;
        for (k, w) in digest.chunks(8).enumerate() {
            facts[F * rank + 2 + k] = i64::from_le_bytes(w.try_into().expect("8 bytes"));
        }
    }
    group.allreduce_sum_i64(&mut facts, step_tag)?;
    let first = &facts[..F];
    Ok(first[0] == 1 && first[1] >= n.start_step as i64 && facts.chunks(F).all(|f| f == first))
}

/// Every rank saw the same facts, so every rank comes here: each loads the newest
/// checkpoint it can read (past the job's end, the final checkpoint this process wrote,
/// `written`: its directory and content hash, which the log does not record: the ranks keep
/// their blocks after the end, so a block lost with every holder then is there); one that
/// cannot starts afresh and is copied the state in the entry; if none can, every rank fails
/// the entry alike. The steps this rank gives up.
fn back_to_checkpoint(
    trainer: &mut Trainer,
    group: &mut Group,
    (job, ckpt_dir, written): (&JobSpec, Option<&Path>, Option<(&Path, &str)>),
    st: &ClusterState,
    n: &Epoch,
    why: &str,
    step_tag: u64,
) -> Result<u64, AgentError> {
    let loaded = written
        .and_then(|w| own_final(trainer, job, w))
        .or_else(|| checkpointer::newest(trainer, job, st, ckpt_dir));
    let mut read = vec![0i64; group.world()];
    read[group.rank()] = loaded.as_ref().map_or(0, |t| t.step() as i64 + 1);
    group.allreduce_sum_i64(&mut read, step_tag)?;
    if read.iter().all(|&r| r == 0) {
        return Err(AgentError::entry(format!(
            "epoch {}: {why}, and no rank can read a checkpoint the log records",
            n.id
        )));
    }
    let to = read.iter().max().map_or(0, |&r| r.saturating_sub(1).max(0) as u64);
    tracing::error!(
        epoch = n.id,
        from = trainer.step(),
        to,
        %why,
        "a shard of the optimizer state is lost with every holder: back to the newest checkpoint"
    );
    metrics::counter!("limpet_shard_losses_total").increment(1);
    let redone = trainer.step().saturating_sub(to);
    *trainer = match loaded {
        Some(t) => t,
        None => fresh(trainer, job)?,
    };
    Ok(redone)
}

/// Past the job's last step, the job's final checkpoint this process wrote into `state_dir`
/// with content hash `hash`, loaded; `None` before the end, or when that file is not there
/// to read (a file of an earlier run of the same job is another state).
fn own_final(trainer: &Trainer, job: &JobSpec, (state_dir, hash): (&Path, &str)) -> Option<Trainer> {
    if trainer.step() < job.steps {
        return None;
    }
    let path = state_dir.join(limpet_trainer::CHECKPOINT_FILE);
    let loaded = limpet_snapshot::read_file(&path).map_err(AgentError::from).and_then(|image| {
        if image.meta().step != job.steps {
            return Err(AgentError::entry(format!(
                "it is of step {}, not the job's last",
                image.meta().step
            )));
        }
        if image.content_hash() != hash {
            return Err(AgentError::entry(format!(
                "its content hash is {}, not the {hash} this process wrote",
                image.content_hash()
            )));
        }
        let mut t = fresh(trainer, job)?;
        t.load_image(&image)?;
        Ok(t)
    });
    match loaded {
        Ok(t) => {
            tracing::info!(path = %path.display(), "the job's final checkpoint loaded");
            Some(t)
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), %e, "could not load the job's final checkpoint");
            None
        }
    }
}

/// A trainer at step 0 of the job, on the same data and device: what a newcomer enters with.
fn fresh(trainer: &Trainer, job: &JobSpec) -> Result<Trainer, AgentError> {
    let blocks = 0..job.model.num_blocks();
    Ok(Trainer::on_device(job.clone(), trainer.data().shallow_clone(), blocks, trainer.model().device())?)
}

/// The layout of epoch `n`'s state for this rank (`None`: the job keeps it whole, the epoch
/// is pipelined, or the job's steps are done: its final checkpoint is whole).
pub(super) fn layout_for(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
    if trainer.step() >= job.steps {
        return None;
    }
    layout_of(trainer, job, n, rank)
}

/// Epochs of the log the re-cut checks layouts against: the newest ones before `n`, few
/// enough that every rank of `n` still holds them all, however much further its log is (the
/// log keeps `MAX_EPOCH_HISTORY`), so that every rank decides alike.
const KNOWN_EPOCHS: usize = 16;

/// What the log lets each device rank of epoch `n` claim in the re-cut: its host, and the
/// layouts its device held in the log's recent epochs (the same device of the same node).
fn regroup_bounds(trainer: &Trainer, job: &JobSpec, st: &ClusterState, n: &Epoch) -> RegroupBounds {
    let mut earlier: Vec<&Epoch> =
        st.history.iter().map(|e| &**e).chain(&st.current).filter(|e| e.id < n.id).collect();
    earlier.sort_by_key(|e| std::cmp::Reverse(e.id));
    earlier.dedup_by_key(|e| e.id);
    earlier.truncate(KNOWN_EPOCHS);
    let mut bounds =
        RegroupBounds { known: earlier.iter().map(|e| e.id).collect(), ..RegroupBounds::default() };
    for (p, &node) in n.ranks.iter().enumerate() {
        for device in 0..n.local_ranks_of(p) {
            bounds.hosts.push(node);
            let held = earlier.iter().filter_map(|e| {
                let q = e.ranks.iter().position(|&r| r == node)?;
                (device < e.local_ranks_of(q)).then_some(())?;
                layout_of(trainer, job, e, e.first_rank_of(q) + device as usize).map(|l| l.facts())
            });
            bounds.layouts.push(held.collect());
        }
    }
    bounds
}

/// The layout of epoch `n`'s state for rank `rank` of its devices whatever the step
/// (`None`: whole state).
fn layout_of(trainer: &Trainer, job: &JobSpec, n: &Epoch, rank: usize) -> Option<ShardLayout> {
    let sharding = job.shard_state?;
    if n.layout.pipeline > 1 {
        return None;
    }
    let replicas = sharding.replicas.min(n.ranks.len().saturating_sub(1));
    let len = trainer.buffer_len() - 3;
    ShardLayout::over_host_counts(len, &super::local_ranks::host_counts(n), rank, replicas)
        .ok()
        .map(|l| l.tagged(n.id))
}

/// Cuts the whole state of an entered epoch into each local rank's shard (node `me`'s,
/// whose followers hold the host's state by now).
pub(super) fn shard_after_entry(
    (trainer, followers): (&mut Trainer, &mut [Trainer]),
    job: &JobSpec,
    n: &Epoch,
    me: usize,
) -> Result<(), AgentError> {
    let (first, count) = (n.first_rank_of(me), n.local_ranks_of(me) as usize);
    let local = followers.iter_mut().take(count.saturating_sub(1));
    for (i, t) in std::iter::once(trainer).chain(local).enumerate() {
        if let Some(layout) = layout_for(t, job, n, first + i) {
            let held = layout.held();
            t.shard_state(layout)?;
            tracing::info!(
                epoch = n.id,
                rank = first + i,
                ?held,
                "optimizer state sharded over the epoch's ranks"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The group's maxima of the ranks' votes: one S3 place everywhere, or none anywhere, is
    /// agreement; a host without a copy, or with another, is not.
    #[test]
    fn ranks_copying_to_different_s3_places_are_found_out() {
        let group = |ranks: &[[i32; 4]]| {
            let mut most = [i32::MIN; 4];
            for r in ranks {
                for (m, v) in most.iter_mut().zip(r) {
                    *m = (*m).max(*v);
                }
            }
            decide(most)
        };
        let at = |busy: i32, s3: i32| [busy, 0, s3, -s3];
        assert_eq!(group(&[at(0, 7), at(0, 7), at(0, 7)]), ([0, 0], true));
        assert_eq!(group(&[at(0, 0), at(1, 0)]), ([1, 0], true));
        assert!(!group(&[at(0, 7), at(0, 0), at(0, 7)]).1);
        assert!(!group(&[at(0, 7), at(0, 9)]).1);
        assert!(!group(&[at(0, 1 << 24), at(0, 1)]).1);
        // What a checkpointer votes: no S3 copy without settings.
        assert_eq!(votes(&checkpointer::Checkpointer::new(None)), [0, 1, 0, 0]);
    }

    /// Past the job's end a rank reloads the final checkpoint this process wrote (the log
    /// never records it), and nothing else: not before the end, not another step's file, not
    /// one of another hash, not another job's.
    #[test]
    fn past_the_end_a_rank_reloads_its_own_final_checkpoint_only() {
        use limpet_trainer::data::{DataSpec, Dataset};
        let spec = DataSpec::Synthetic { samples: 200, features: 6, classes: 3, seed: 5 };
        let data = Dataset::load(&spec, None).unwrap();
        let job =
            JobSpec { steps: 25, ..JobSpec::defaults_for(limpet_trainer::ModelKind::Mlp, &data).unwrap() };
        let mut trained = Trainer::try_new(job.clone(), data.shallow_clone()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for _ in 0..24 {
            trained.train_step(0, 1, &mut limpet_trainer::NoReduce).unwrap();
        }
        limpet_trainer::save_checkpoint(&trained, dir.path()).unwrap();
        let at_24 = trained.content_hash().unwrap();
        // Before the end: none; at the end, a file of step 24 is not the job's end.
        assert!(own_final(&trained, &job, (dir.path(), &at_24)).is_none());
        trained.train_step(0, 1, &mut limpet_trainer::NoReduce).unwrap();
        assert!(own_final(&trained, &job, (dir.path(), &at_24)).is_none());
        limpet_trainer::save_checkpoint(&trained, dir.path()).unwrap();
        let written = trained.content_hash().unwrap();
        let back = own_final(&trained, &job, (dir.path(), &written)).expect("the job's final checkpoint");
        assert_eq!(back.step(), 25);
        assert_eq!(back.content_hash().unwrap(), written);
        // Not a file of this job's end that this process did not write (an earlier run's:
        // another hash); not another job's (another seed) of the same length; not a missing
        // file.
        assert!(own_final(&trained, &job, (dir.path(), &at_24)).is_none());
        let other = JobSpec { seed: job.seed + 1, ..job.clone() };
        assert!(own_final(&trained, &other, (dir.path(), &written)).is_none());
        assert!(own_final(&trained, &job, (&dir.path().join("gone"), &written)).is_none());
    }
}

//! Durable checkpoints from the trainer loop: when one is due (pure: [`due`]), the state is
//! copied at the step boundary and a tracked thread encodes it, writes the part, prunes old
//! ones, copies it to S3 and records it in the log while training goes on. Also the other
//! direction: a new cluster's first epoch loading the checkpoint it resumes from.

use super::config::CheckpointSettings;
use super::tasks::Tasks;
use super::AgentError;
use crate::remote::PartName;
use limpet_consensus::state::{ClusterState, Command, Epoch, NodeId};
use limpet_consensus::{ConsensusError, NodeHandle};
use limpet_trainer::{JobSpec, Trainer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether a checkpoint is due at `step`, `since` the last one began, for a rank of an epoch
/// with `stages` pipeline stages. The time trigger only applies without stages: each stage
/// decides alone, and only a step count gives them all the same answer.
pub(crate) fn due(c: &CheckpointSettings, step: u64, stages: usize, since: Duration) -> bool {
    (c.every_steps > 0 && step % c.every_steps == 0) || c.every().is_some_and(|d| stages == 1 && since >= d)
}

/// One rank's checkpoint writer.
pub(super) struct Checkpointer {
    settings: Option<CheckpointSettings>,
    /// Why the last checkpoint failed, until one succeeds (shown in `limpet status`).
    failure: Arc<std::sync::Mutex<Option<String>>>,
    /// When this rank last started writing a checkpoint (the time trigger's origin).
    last: Option<Instant>,
    /// A checkpoint is being written in the background: the next trigger waits for it.
    writing: Arc<AtomicBool>,
    /// The S3 client checkpoints are copied with, built at the first copy and kept: a new
    /// client would load the configuration and fetch credentials (on EC2, from the instance
    /// metadata service) again for every checkpoint.
    remote: Arc<tokio::sync::OnceCell<crate::remote::Remote>>,
    /// The write in flight (one at a time: `writing`): its step, and the step training went
    /// back to past it, once it did (set once and kept: a later rollback to a later step does
    /// not bring the abandoned state back).
    in_flight: Option<(u64, Abandoned)>,
}

/// The step training went back to while a write of a later step was in flight, if it did.
type Abandoned = Arc<std::sync::Mutex<Option<u64>>>;

/// What writing a checkpoint needs of the agent.
pub(super) struct Sink<'a> {
    pub me: NodeId,
    pub handle: &'a NodeHandle,
    pub rt: &'a tokio::runtime::Handle,
    pub tasks: &'a Tasks,
}

impl Checkpointer {
    pub fn new(settings: Option<CheckpointSettings>) -> Checkpointer {
        Checkpointer {
            settings,
            failure: Arc::default(),
            last: None,
            writing: Arc::default(),
            remote: Arc::default(),
            in_flight: None,
        }
    }

    /// Training went back to the state of `step` (a checkpoint, a stage's shadow): a write in
    /// flight of a later step is of a state no rank trains on, and is not recorded (recorded,
    /// it could name the step's directory once the new timeline has written other shards there).
    pub fn went_back(&self, step: u64) {
        if let Some((written, mark)) = &self.in_flight {
            if *written > step {
                mark.lock().expect("abandoned lock").get_or_insert(step);
            }
        }
    }

    /// Marks a write of `step` as the one in flight; its mark of abandonment.
    fn begin(&mut self, step: u64) -> Abandoned {
        let mark = Abandoned::default();
        self.in_flight = Some((step, Arc::clone(&mark)));
        mark
    }

    /// Whether a checkpoint is due at `step` by the step count alone: what every rank of a
    /// sharded job decides alike, to gather the state for it together (a clock would give
    /// the ranks different steps).
    pub fn due_by_steps(&self, step: u64) -> bool {
        self.settings.as_ref().is_some_and(|c| due(c, step, 2, Duration::ZERO))
    }

    /// Whether this rank's checkpoint is due at `step`, by the step count or by its own clock
    /// (what [`Checkpointer::maybe_write`] decides, for a data-parallel epoch), without
    /// starting the clock.
    pub fn due_now(&self, step: u64) -> bool {
        let since = self.last.map_or(Duration::ZERO, |l| l.elapsed());
        self.settings.as_ref().is_some_and(|c| due(c, step, 1, since))
    }

    /// Whether a sharded job's checkpoints are written as shards, one per rank, into a
    /// directory every host sees (`[checkpoint].shared`), rather than gathered whole (with
    /// S3, each owner copies its own shard there too).
    pub fn writes_shards(&self) -> bool {
        self.settings.as_ref().is_some_and(|c| c.shared)
    }

    /// Where this rank's checkpoints are copied in S3 (`[checkpoint].s3`'s bucket and
    /// prefix) as a number from 1 to 2^24 (what the ring's integer maximum carries exactly),
    /// or 0 without a copy: what the ranks of a sharded job compare, since a set of shards in
    /// S3 is whole only if every host copies its own to the same place.
    pub fn s3_digest(&self) -> i32 {
        let Some(r) = self.settings.as_ref().and_then(|c| c.s3.as_ref()) else { return 0 };
        let h = blake3::hash(format!("{}/{}", r.bucket, r.prefix).as_bytes());
        let v = u32::from_le_bytes(h.as_bytes()[..4].try_into().expect("four bytes"));
        (v % (1 << 24)) as i32 + 1
    }

    /// Whether a checkpoint is being written in the background (a sharded job's ranks skip a
    /// checkpoint together when any of theirs is).
    pub fn is_busy(&self) -> bool {
        self.writing.load(Ordering::SeqCst)
    }

    /// Writes this host's shards of a sharded job's checkpoint, one per local rank (every
    /// host writes its own at once, in the background as any part; a host's one after the
    /// other, shard 0 last, and none after one that failed); shard 0's writer records the
    /// checkpoint in the log, with the whole state's hash, once every shard is in.
    pub fn write_shards(
        &mut self,
        parts: Vec<limpet_trainer::CheckpointPart>,
        epoch: &Epoch,
        nb: usize,
        sink: &Sink<'_>,
    ) {
        let Some(c) = self.settings.clone() else { return };
        if self.writing.swap(true, Ordering::SeqCst) {
            let step = parts.first().map(|p| p.image.meta().step);
            tracing::warn!(?step, "the previous checkpoint is still being written; skipping these shards");
            return;
        }
        self.last = Some(Instant::now());
        let mut writers = epoch.ranks.clone();
        writers.dedup();
        let mut parts: Vec<_> = parts
            .into_iter()
            .map(|p| {
                let kind = Kind::Shard { index: p.index, parts: p.parts, writers: writers.clone() };
                (Arc::new(p.image), p.whole_hash, kind)
            })
            .collect();
        // Shard 0 last: its writer waits for every other shard, this host's too.
        parts.sort_by_key(|(_, _, k)| matches!(k, Kind::Shard { index: 0, .. }));
        self.spawn(c, parts, epoch, nb, sink);
    }

    /// Writes each image (recorded with its hash, as a part of its kind), in order, on one
    /// tracked thread of its own; the caller marked the writer busy.
    fn spawn(
        &mut self,
        settings: CheckpointSettings,
        images: Vec<(Arc<limpet_snapshot::StateImage>, String, Kind)>,
        epoch: &Epoch,
        nb: usize,
        sink: &Sink<'_>,
    ) {
        let Some(step) = images.first().map(|(image, _, _)| image.meta().step) else {
            self.writing.store(false, Ordering::SeqCst);
            return;
        };
        let abandoned = self.begin(step);
        let parts: Vec<Part> = images
            .into_iter()
            .map(|(image, hash, kind)| Part {
                settings: settings.clone(),
                hash,
                image,
                kind,
                stop: sink.tasks.token(),
                model_blocks: nb,
                step,
                epoch: epoch.id,
                me: sink.me,
                handle: sink.handle.clone(),
                rt: sink.rt.clone(),
                remote: Arc::clone(&self.remote),
                failure: Arc::clone(&self.failure),
                abandoned: Arc::clone(&abandoned),
            })
            .collect();
        let (busy, failure) = (Arc::clone(&self.writing), Arc::clone(&self.failure));
        let write = move || {
            // A part whose copy to S3 failed: it stands here, so the others are written, but
            // a later part's success must not hide the failure.
            let mut not_copied = None;
            let mut all_stand = true;
            for part in &parts {
                let stands = part.write();
                let why = failure.lock().expect("failure lock").clone();
                // Each part sets or clears the failure: after a failed one the checkpoint is
                // incomplete.
                if !stands {
                    all_stand = false;
                    break;
                }
                not_copied = not_copied.or(why);
            }
            // A host's other shards are copied once its shard files are all in the shared
            // directory (shard 0's writer waits for every one, within a limit that an upload
            // between two writes would eat into).
            // Not a state training went back from: no rank trains on it, and its objects
            // would take the names of a set of that step already there.
            for part in parts.iter().filter(|p| all_stand && p.copied_later() && p.abandoned().is_none()) {
                if let Some(Err(e)) = part.copy(&part.kind.name().path(part.settings.dir(), part.step), false)
                {
                    part.not_copied(&e);
                    not_copied = not_copied.or_else(|| failure.lock().expect("failure lock").clone());
                }
            }
            if let Some(why) = not_copied {
                failure.lock().expect("failure lock").get_or_insert(why);
            }
            // The images (a sharded job's gathered state among them) go back to the system,
            // not to the allocator's free lists for the rest of the job.
            drop(parts);
            limpet_trainer::device::return_freed_host_memory();
            busy.store(false, Ordering::SeqCst);
        };
        if let Err(e) = sink.tasks.spawn_thread("checkpoint", write) {
            tracing::error!(step, %e, "could not start the checkpoint writer");
            self.writing.store(false, Ordering::SeqCst);
        }
    }

    /// Why the last checkpoint failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("failure lock").clone()
    }

    /// Writes this rank's part of a durable checkpoint when one is due: the ranks of the
    /// first replica write, one part per stage (the whole model in a data-parallel epoch).
    /// A sharded trainer's is the whole state `gathered` for it (`sharding::after_step`).
    pub fn maybe_write(
        &mut self,
        (trainer, gathered): (&Trainer, Option<Arc<limpet_snapshot::StateImage>>),
        epoch: &Epoch,
        rank: usize,
        nb: usize,
        sink: &Sink<'_>,
    ) {
        let Some(c) = self.settings.clone() else { return };
        if trainer.shard_layout().is_some() && gathered.is_none() {
            // Sharded state is gathered for the steps `due_by_steps` names; at any other
            // step this rank holds no whole state to write.
            return;
        }
        let stages = epoch.layout.pipeline.max(1) as usize;
        if rank >= stages {
            return;
        }
        let step = trainer.step();
        let since = *self.last.get_or_insert_with(Instant::now);
        if !due(&c, step, stages, since.elapsed()) {
            return;
        }
        if self.writing.swap(true, Ordering::SeqCst) {
            tracing::warn!(step, "the previous checkpoint is still being written; skipping this one");
            return;
        }
        self.last = Some(Instant::now());
        let image = match gathered.map_or_else(|| trainer.image().map(Arc::new), Ok) {
            Ok(i) => i,
            Err(e) => {
                tracing::error!(step, %e, "could not copy the state for a checkpoint");
                self.writing.store(false, Ordering::SeqCst);
                return;
            }
        };
        let hash = image.content_hash().to_string();
        self.spawn(c, vec![(image, hash, Kind::Blocks(trainer.model().blocks()))], epoch, nb, sink);
    }
}

/// What a part of a checkpoint holds.
enum Kind {
    /// Whole blocks of the model (a stage's, or every one).
    Blocks(std::ops::Range<usize>),
    /// Shard `index` of `parts` of a sharded job's state, the others written by the nodes
    /// `writers` (the epoch's: a gone one's shard never comes).
    Shard { index: usize, parts: usize, writers: Vec<NodeId> },
}

impl Kind {
    /// The part's name (its file's, its object's in S3).
    fn name(&self) -> PartName {
        match self {
            Kind::Blocks(blocks) => PartName::Blocks(blocks.clone()),
            Kind::Shard { index, parts, .. } => PartName::Shard { index: *index, of: *parts },
        }
    }
}

/// One checkpoint part to write, copy and record, owned by the writer thread.
struct Part {
    settings: CheckpointSettings,
    /// Shared with the job's final checkpoint when the job ends at this step.
    image: Arc<limpet_snapshot::StateImage>,
    /// The content hash the log records: the image's, or the whole state's for a shard.
    hash: String,
    /// The agent's root token: a writer waiting for other ranks' shards stops with it.
    stop: tokio_util::sync::CancellationToken,
    kind: Kind,
    model_blocks: usize,
    step: u64,
    epoch: u64,
    me: NodeId,
    handle: NodeHandle,
    rt: tokio::runtime::Handle,
    remote: Arc<tokio::sync::OnceCell<crate::remote::Remote>>,
    failure: Arc<std::sync::Mutex<Option<String>>>,
    /// Set when training goes back past this write's step.
    abandoned: Abandoned,
}

impl Part {
    /// Why this write is no checkpoint to record any more: training went back past its step.
    fn abandoned(&self) -> Option<String> {
        let to = (*self.abandoned.lock().expect("abandoned lock"))?;
        Some(format!("training went back to step {to} while it was being written"))
    }

    /// Writes the part, prunes old ones, copies it to S3 if configured, and records it in
    /// the log; failures are counted and logged (the local copy stands if S3 fails). Whether
    /// the part stands here (written, and for shard 0 its set complete): after one that does
    /// not, the checkpoint is incomplete.
    fn write(&self) -> bool {
        let started = Instant::now();
        let (dir, min_free) = (self.settings.dir(), self.settings.min_free.0);
        let written = match &self.kind {
            Kind::Blocks(blocks) => crate::checkpoint::write_part(dir, &self.image, blocks, min_free),
            Kind::Shard { index, parts, .. } => {
                crate::checkpoint::write_shard(dir, &self.image, (*index, *parts), min_free)
            }
        }
        .and_then(|path| crate::checkpoint::verify_part(&path, &self.image).map(|()| path));
        match written {
            Ok(path) => {
                let secs = started.elapsed().as_secs_f64();
                metrics::counter!("limpet_checkpoints_total").increment(1);
                metrics::gauge!("limpet_checkpoint_step").set(self.step as f64);
                metrics::histogram!("limpet_checkpoint_seconds").record(secs);
                let job = &self.image.meta().job;
                let mut location = path.display().to_string();
                match &self.kind {
                    Kind::Blocks(blocks) => {
                        tracing::info!(step = self.step, ?blocks, path = %path.display(), ms = (secs * 1e3) as u64, "checkpoint written");
                    }
                    &Kind::Shard { index, parts, ref writers } => {
                        tracing::info!(step = self.step, shard = index, of = parts, path = %path.display(), ms = (secs * 1e3) as u64, "checkpoint shard written");
                        if index != 0 {
                            // Shard 0's writer records the checkpoint once every shard is in;
                            // this one's copy to S3 waits for the host's other shards to be
                            // written (`copied_later`).
                            *self.failure.lock().expect("failure lock") = None;
                            return true;
                        }
                        // Every shard of this write, or no checkpoint: the others write theirs
                        // at once, each taking about as long as this one did.
                        let wait = Duration::from_secs(120).max(started.elapsed() * 4);
                        // Not past shutdown, nor past a writer's end: a shard that never comes
                        // would hold up the next checkpoint (the ranks skip one while any
                        // writer is busy) for the whole wait.
                        let stop = || {
                            if self.stop.is_cancelled() {
                                return Some("the agent is stopping".to_string());
                            }
                            if let Some(why) = self.abandoned() {
                                return Some(why);
                            }
                            gone_writer(&self.handle.watch().borrow().state, writers)
                        };
                        match crate::checkpoint::await_shards(dir, self.step, parts, &self.hash, wait, &stop)
                        {
                            Ok(d) => location = d.display().to_string(),
                            Err(e) => {
                                metrics::counter!("limpet_checkpoint_failures_total").increment(1);
                                tracing::error!(step = self.step, %e, "a checkpoint's shards did not all arrive; not recorded");
                                self.failed(format!("step {}: {e}", self.step));
                                return false;
                            }
                        }
                    }
                };
                if let Err(e) =
                    crate::checkpoint::prune(self.settings.dir(), self.settings.keep, self.model_blocks, job)
                {
                    tracing::warn!(%e, "could not delete old checkpoints");
                }
                match self.copy(&path, true) {
                    // A set of shards stays recorded by its step's directory: no one object
                    // is the checkpoint.
                    Some(Ok(url)) if matches!(self.kind, Kind::Blocks(_)) => location = url,
                    Some(Ok(_)) | None => {}
                    Some(Err(e)) => {
                        self.not_copied(&e);
                        self.record(location);
                        return true;
                    }
                }
                *self.failure.lock().expect("failure lock") = None;
                self.record(location);
                true
            }
            Err(e) => {
                metrics::counter!("limpet_checkpoint_failures_total").increment(1);
                tracing::error!(step = self.step, %e, "writing a checkpoint failed");
                self.failed(format!("step {}: {e}", self.step));
                false
            }
        }
    }

    /// Whether this part's copy to S3 is made after the host's other parts are written: a
    /// shard other than 0 (shard 0's writer copies its own once the set is in).
    fn copied_later(&self) -> bool {
        self.settings.s3.is_some() && matches!(self.kind, Kind::Shard { index, .. } if index != 0)
    }

    /// Copies the part written at `path` to S3, if configured (`None` if not), tagged with
    /// its job and, for a shard, the whole state's hash; then, with `prune`, deletes old steps
    /// there. Its URL.
    fn copy(&self, path: &Path, prune: bool) -> Option<Result<String, crate::checkpoint::CheckpointError>> {
        let r = self.settings.remote()?;
        let copied = self.rt.block_on(async {
            let remote = self.remote.get_or_init(|| crate::remote::Remote::connect(&r)).await;
            let hash = self.image.content_hash().to_string();
            let job = limpet_snapshot::job_fingerprint(&self.image.meta().job);
            // A shard carries the whole state's hash (`hash` the log records): a set counts in
            // S3 only when every shard names the same.
            let whole = matches!(self.kind, Kind::Shard { .. }).then_some(self.hash.as_str());
            let url = remote.upload(self.step, &self.kind.name(), path, &hash, &job, whole).await?;
            if prune {
                if let Err(e) = remote.prune(self.settings.keep, self.model_blocks, &job, self.step).await {
                    tracing::warn!(%e, "could not delete old checkpoints in S3");
                }
            }
            Ok::<_, crate::checkpoint::CheckpointError>(url)
        });
        if let Ok(url) = &copied {
            tracing::info!(step = self.step, url, "checkpoint copied to S3");
        }
        Some(copied)
    }

    /// Counts and keeps a failed copy to S3 (the local copy stands; the failure counter is
    /// what alerts).
    fn not_copied(&self, e: &crate::checkpoint::CheckpointError) {
        metrics::counter!("limpet_checkpoint_failures_total").increment(1);
        tracing::error!(step = self.step, %e, "copying a checkpoint to S3 failed");
        self.failed(format!("step {}: copying to S3: {e}", self.step));
    }

    /// Keeps why this checkpoint failed for the agent's reports (and so `limpet status`).
    fn failed(&self, why: String) {
        *self.failure.lock().expect("failure lock") = Some(why);
    }

    /// Records the checkpoint (at `location`) in the log, unless training went back past
    /// its step. A proposal forwarded to a leader that dies is lost without an answer, so it
    /// is sent again when an attempt gets none within a second (the node holds a proposal
    /// until some leader is known) for a while: the log takes the same record twice as once.
    fn record(&self, location: String) {
        let record = limpet_consensus::state::CheckpointRecord {
            step: self.step,
            epoch: self.epoch,
            content_hash: self.hash.clone(),
            location,
            node: self.me,
        };
        let deadline = Instant::now() + RECORD_FOR;
        loop {
            if let Some(why) = self.abandoned() {
                tracing::warn!(
                    step = self.step,
                    why,
                    "checkpoint written but not recorded: no rank trains on its state"
                );
                return;
            }
            let cmd = Command::RecordCheckpoint { record: record.clone() };
            let e = match self.rt.block_on(self.handle.propose(cmd, Some(RECORD_ATTEMPT))) {
                Ok(_) => return,
                Err(e) => e,
            };
            let retry = matches!(
                e,
                ConsensusError::Timeout { .. } | ConsensusError::NoLeader | ConsensusError::Transport(_)
            );
            if !retry || self.stop.is_cancelled() || Instant::now() >= deadline {
                tracing::warn!(step = self.step, %e, "checkpoint written but not recorded in the log");
                return;
            }
            tracing::debug!(step = self.step, %e, "recording the checkpoint again");
        }
    }
}

/// How long one proposal of a checkpoint's record waits for the log, and how long the writer
/// keeps trying (its rank skips checkpoints meanwhile).
const RECORD_ATTEMPT: Duration = Duration::from_secs(1);
const RECORD_FOR: Duration = Duration::from_secs(10);

/// A node of `writers` that will write nothing more (failed, gone or no member), named: the
/// shard it was to write may never come.
fn gone_writer(st: &ClusterState, writers: &[NodeId]) -> Option<String> {
    use limpet_consensus::state::MemberStatus::{Failed, Gone};
    writers.iter().find_map(|id| match st.members.get(id).map(|m| m.status) {
        Some(status @ (Failed | Gone)) => Some(format!("node {id}, a writer of the set, is {status:?}")),
        None => Some(format!("node {id}, a writer of the set, is no member")),
        Some(_) => None,
    })
}

/// A new cluster's first epoch `n` starts at the step of the checkpoint it resumes from: a
/// rank that can read that checkpoint loads it into a new trainer (the others copy it from
/// such a rank in the entry protocol, as any newcomer would). `None`: nothing to load here.
pub(super) fn resume(
    trainer: &Trainer,
    job: &JobSpec,
    st: &ClusterState,
    n: &Epoch,
    local: Option<&Path>,
) -> Option<Trainer> {
    if trainer.step() >= n.start_step {
        return None;
    }
    let rec = st.checkpoints.iter().rev().find(|c| c.step == n.start_step && c.epoch == 0)?;
    load_record(trainer, job, rec, local)
}

/// The newest checkpoint the log records that loads here, into a new trainer (what a job
/// whose sharded state lost a block goes back to): a newer one that does not load (a shard
/// never written, a part corrupt) is passed over. `None`: none recorded, or none readable
/// here. `local`: this host's `[checkpoint].dir` (where a record of a copy in S3 is looked
/// for).
pub(super) fn newest(
    trainer: &Trainer,
    job: &JobSpec,
    st: &ClusterState,
    local: Option<&Path>,
) -> Option<Trainer> {
    // The newest step first and, within a step (written again after going back), the
    // latest record first; a record tried once.
    let mut records: Vec<&limpet_consensus::state::CheckpointRecord> = st.checkpoints.iter().rev().collect();
    records.sort_by_key(|c| std::cmp::Reverse(c.step));
    records.dedup_by(|a, b| (a.step, &a.content_hash) == (b.step, &b.content_hash));
    records.into_iter().find_map(|rec| load_record(trainer, job, rec, local))
}

fn load_record(
    trainer: &Trainer,
    job: &JobSpec,
    rec: &limpet_consensus::state::CheckpointRecord,
    local: Option<&Path>,
) -> Option<Trainer> {
    let loaded = step_dir_of(rec, local)
        .ok_or_else(|| AgentError::entry(format!("{} is not a checkpoint step here", rec.location)))
        .and_then(|step_dir| {
            let root = step_dir.parent().unwrap_or(&step_dir);
            let listed = crate::checkpoint::listed_at(root, rec.step)?;
            let image = crate::checkpoint::load(&listed, job.model.num_blocks())?;
            // `has_hash`: a checkpoint an earlier build wrote is recorded in its hash's form.
            if !image.has_hash(&rec.content_hash) {
                return Err(AgentError::entry("its content hash differs from the one recorded in the log"));
            }
            let data = trainer.data().shallow_clone();
            let blocks = 0..job.model.num_blocks();
            let mut t = Trainer::on_device(job.clone(), data, blocks, trainer.model().device())?;
            t.load_image(&image)?;
            Ok(t)
        });
    match loaded {
        Ok(t) => {
            tracing::info!(step = rec.step, location = %rec.location, "resumed from the checkpoint");
            Some(t)
        }
        Err(e) => {
            tracing::warn!(
                step = rec.step,
                location = %rec.location,
                %e,
                "cannot read the checkpoint to resume from here; a peer that can will hand it over"
            );
            None
        }
    }
}

/// The directory of a record's step on this host: the one the record names (a step's
/// directory, or a part's file in one), or for a copy in S3 (`s3://...`, what a part's
/// writer records once its copy is verified) that step under this host's
/// `[checkpoint].dir` (`local`), where the writer kept its own copy and where a shared
/// directory holds every host's.
fn step_dir_of(rec: &limpet_consensus::state::CheckpointRecord, local: Option<&Path>) -> Option<PathBuf> {
    if rec.location.starts_with("s3://") {
        return local.map(|dir| crate::checkpoint::step_dir(dir, rec.step));
    }
    let at = Path::new(&rec.location);
    if at.extension().is_some_and(|e| e == "limpet") {
        at.parent().map(Path::to_path_buf)
    } else {
        Some(at.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(every_steps: u64, every: Option<Duration>) -> CheckpointSettings {
        let every_minutes = every.map_or(0.0, |d| d.as_secs_f64() / 60.0);
        CheckpointSettings {
            every_minutes,
            keep: 2,
            resume: crate::runtime::Resume::Never,
            min_free: crate::config_value::Reserve(0),
            ..CheckpointSettings::every_steps(every_steps, PathBuf::new())
        }
    }

    /// Hosts copying to one bucket and prefix give one digest; another prefix, another
    /// bucket or no copy give others (0 for none), and every digest is one the ranks can
    /// compare through a maximum of it and of its negation.
    #[test]
    fn the_s3_digest_names_the_bucket_and_prefix() {
        let with = |bucket: &str, prefix: &str, endpoint: Option<&str>| {
            let s3 = crate::config_value::S3Url { bucket: bucket.into(), prefix: prefix.into() };
            let s3_endpoint = endpoint.map(Into::into);
            Checkpointer::new(Some(CheckpointSettings { s3: Some(s3), s3_endpoint, ..settings(10, None) }))
                .s3_digest()
        };
        let a = with("ckpt", "runs/a", None);
        assert_eq!(
            a,
            with("ckpt", "runs/a", Some("http://127.0.0.1:9000")),
            "an endpoint is a host's way there"
        );
        let others = [with("ckpt", "runs/b", None), with("ckpt2", "runs/a", None), with("ckpt", "", None)];
        assert!(others.iter().all(|&o| o != a), "{a} {others:?}");
        assert_eq!(Checkpointer::new(Some(settings(10, None))).s3_digest(), 0);
        assert_eq!(Checkpointer::new(None).s3_digest(), 0);
        assert!([a].iter().chain(&others).all(|d| (1..=1 << 24).contains(d)));
    }

    #[test]
    fn checkpoints_are_due_by_steps_everywhere_and_by_time_without_stages() {
        let by_steps = settings(50, None);
        assert!(due(&by_steps, 100, 2, Duration::ZERO));
        assert!(!due(&by_steps, 101, 1, Duration::from_secs(999)));
        let by_time = settings(0, Some(Duration::from_secs(60)));
        assert!(due(&by_time, 7, 1, Duration::from_secs(61)));
        assert!(!due(&by_time, 7, 1, Duration::from_secs(59)));
        // Stages decide alone: a clock would give them different steps.
        assert!(!due(&by_time, 7, 2, Duration::from_secs(61)));
    }

    #[test]
    fn a_write_past_the_step_training_went_back_to_is_abandoned() {
        let mut c = Checkpointer::new(None);
        let marked = |m: &Abandoned| *m.lock().unwrap();
        let forty = c.begin(40);
        c.went_back(40);
        assert_eq!(marked(&forty), None, "the state gone back to is the one written");
        c.went_back(20);
        assert_eq!(marked(&forty), Some(20));
        // Trained on to 60, then back to 50: the state of step 40 written before is still no
        // rank's.
        c.went_back(50);
        assert_eq!(marked(&forty), Some(20));
        // A write of the new timeline is its own.
        let sixty = c.begin(60);
        c.went_back(60);
        assert_eq!(marked(&sixty), None);
        c.went_back(30);
        assert_eq!(marked(&sixty), Some(30));
    }

    #[test]
    fn a_shards_wait_ends_when_a_writer_of_the_set_is_failed_or_gone() {
        use limpet_consensus::state::{Hardware, Member, MemberSpec, MemberStatus};
        let member = |id: NodeId, status| Member {
            spec: MemberSpec {
                id,
                name: format!("node-{id}"),
                control_addr: String::new(),
                data_addr: String::new(),
                hardware: Hardware::default(),
            },
            status,
            reason: String::new(),
            deadline_ms: None,
        };
        let mut st = ClusterState::bootstrap("c", &[]);
        for (id, status) in
            [(1, MemberStatus::Active), (2, MemberStatus::Leaving), (3, MemberStatus::Draining)]
        {
            st.members.insert(id, std::sync::Arc::new(member(id, status)));
        }
        // Leaving and draining nodes still write what they took.
        assert_eq!(gone_writer(&st, &[1, 2, 3]), None);
        std::sync::Arc::make_mut(st.members.get_mut(&3).unwrap()).status = MemberStatus::Failed;
        assert_eq!(gone_writer(&st, &[1, 2, 3]).unwrap(), "node 3, a writer of the set, is Failed");
        assert_eq!(gone_writer(&st, &[1, 2]), None);
        std::sync::Arc::make_mut(st.members.get_mut(&2).unwrap()).status = MemberStatus::Gone;
        assert!(gone_writer(&st, &[1, 2]).unwrap().contains("node 2"));
        assert!(gone_writer(&st, &[1, 9]).unwrap().contains("node 9, a writer of the set, is no member"));
    }

    /// A part's writer records the URL of its verified copy in S3: going back to that
    /// checkpoint reads the copy it kept (or a shared directory's) under this host's
    /// `[checkpoint].dir`, and a host without the directory cannot read it.
    #[test]
    fn a_checkpoint_recorded_by_its_s3_copy_loads_from_the_local_directory() {
        use limpet_trainer::data::{DataSpec, Dataset};
        let spec = DataSpec::Synthetic { samples: 200, features: 6, classes: 3, seed: 5 };
        let data = Dataset::load(&spec, None).unwrap();
        let job = JobSpec::defaults_for(limpet_trainer::ModelKind::Mlp, &data).unwrap();
        let mut trained = Trainer::try_new(job.clone(), data.shallow_clone()).unwrap();
        for _ in 0..3 {
            trained.train_step(0, 1, &mut limpet_trainer::NoReduce).unwrap();
        }
        let image = trained.image().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let blocks = 0..job.model.num_blocks();
        let part = crate::checkpoint::write_part(dir.path(), &image, &blocks, 0).unwrap();
        let file = part.file_name().unwrap().to_string_lossy().to_string();
        let step = crate::checkpoint::step_dir(Path::new(""), 3).display().to_string();
        let rec = limpet_consensus::state::CheckpointRecord {
            step: 3,
            epoch: 1,
            content_hash: image.content_hash().to_string(),
            location: format!("s3://bucket/runs/a/{step}/{file}"),
            node: 1,
        };
        let mut st = ClusterState::bootstrap("c", &[]);
        st.checkpoints.push(rec.clone());
        let fresh = Trainer::try_new(job.clone(), data).unwrap();
        let back = newest(&fresh, &job, &st, Some(dir.path())).expect("loads from the local copy");
        assert_eq!(back.step(), 3);
        assert_eq!(back.image().unwrap().content_hash(), image.content_hash());
        assert!(newest(&fresh, &job, &st, None).is_none(), "no directory here: nothing to read");
        // A record naming the part's local file loads as before.
        st.checkpoints[0].location = part.display().to_string();
        assert!(newest(&fresh, &job, &st, None).is_some());
        assert_eq!(step_dir_of(&rec, Some(dir.path())), Some(dir.path().join(&step)));
        // A member's forged record, newer than every other, naming the same part with a
        // made-up hash: passed over for the newest that loads.
        let forged = limpet_consensus::state::CheckpointRecord {
            step: 1_000_000,
            content_hash: "ab".repeat(32),
            node: 2,
            ..st.checkpoints[0].clone()
        };
        st.checkpoints.push(forged);
        let back = newest(&fresh, &job, &st, Some(dir.path())).expect("the honest record loads");
        assert_eq!(back.step(), 3);
    }
}

//! Durable checkpoints: a directory of training states that outlives every host of a
//! cluster, and finding the newest usable one when a new cluster starts.
//!
//! Layout: `DIR/step-000000001200/blocks-0-4.limpet`, one part per pipeline stage (a
//! data-parallel job writes one part holding every block), or
//! `DIR/step-000000001200/shard-2-of-4.limpet`, one part per rank of a job whose optimizer
//! state is sharded over a shared directory (each part a set of whole tensors, marked with the
//! content hash of the state they join into: [`limpet_snapshot::shards`]). Each part is a
//! complete, checksummed [`StateImage`] written atomically, so a directory holds only whole
//! parts; a checkpoint is usable when its parts cover every block of the model, or are every
//! shard of one write. A crash while
//! writing leaves the previous checkpoints intact and at worst an incomplete newest one,
//! which the search skips. Which old checkpoints are deleted is `retention.rs`'s.

use limpet_snapshot::{SnapshotError, StateImage};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod retention;

pub use retention::prune;

/// Why a checkpoint directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// Where.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A part is corrupt or does not belong with the others.
    #[error("{path}: {detail}")]
    Bad {
        /// The part.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Writing would leave the disk with less than the reserve (`[checkpoint].min_free`):
    /// the raft log on the same disk needs the room more than one more checkpoint does.
    #[error(
        "{path}: a checkpoint of {size} bytes would leave {left} bytes free, below the reserve of \
         {min_free} ([checkpoint].min_free): not written"
    )]
    NoRoom {
        /// The directory.
        path: PathBuf,
        /// The checkpoint part's size.
        size: u64,
        /// What would be left.
        left: u64,
        /// The reserve.
        min_free: u64,
    },
    /// The directory may be an unmounted mount point, not the real one
    /// (`[checkpoint].resume = "required"` waits for it).
    #[error("the checkpoint directory {path}: {detail}")]
    Untrusted {
        /// The directory.
        path: PathBuf,
        /// Why it is not trusted.
        detail: String,
    },
    /// A checkpoint copy's address that is not `s3://BUCKET[/PREFIX]`.
    #[error("{url:?}: {detail}")]
    Url {
        /// The address given.
        url: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The snapshot layer refused.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

/// The directory of the checkpoint at `step`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:012}"))
}

/// The file of the part holding `blocks` of the checkpoint at `step`.
pub fn part_path(dir: &Path, step: u64, blocks: &Range<usize>) -> PathBuf {
    step_dir(dir, step).join(format!("blocks-{}-{}.limpet", blocks.start, blocks.end))
}

/// The file of shard `index` of `parts` of the checkpoint at `step`.
pub fn shard_path(dir: &Path, step: u64, index: usize, parts: usize) -> PathBuf {
    step_dir(dir, step).join(format!("shard-{index}-of-{parts}.limpet"))
}

/// The shard a part's file name stands for (`shard-2-of-4.limpet`: index, parts), if it is
/// one of ours.
pub fn parse_shard(name: &str) -> Option<(usize, usize)> {
    let (a, b) = name.strip_prefix("shard-")?.strip_suffix(".limpet")?.split_once("-of-")?;
    // One spelling of each shard: no leading zeros.
    let digits = |s: &str| {
        !s.is_empty()
            && s.len() <= 6
            && s.bytes().all(|c| c.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'))
    };
    if !digits(a) || !digits(b) {
        return None;
    }
    let (i, n) = (a.parse().ok()?, b.parse().ok()?);
    (i < n).then_some((i, n))
}

/// The step a directory name stands for (`step-000000001200`), if it is one of ours.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() != 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The blocks a part's file name stands for (`blocks-0-4.limpet`), if it is one of ours.
pub fn parse_part(name: &str) -> Option<Range<usize>> {
    let (a, b) = name.strip_prefix("blocks-")?.strip_suffix(".limpet")?.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|c| c.is_ascii_digit());
    if !digits(a) || !digits(b) {
        return None;
    }
    let (a, b) = (a.parse().ok()?, b.parse().ok()?);
    (a < b).then_some(a..b)
}

/// Writes one part (a stage's state, or the whole model's) of the checkpoint at the image's
/// step, unless that would leave less than `min_free` bytes on the disk; its path.
pub fn write_part(
    dir: &Path,
    image: &StateImage,
    blocks: &Range<usize>,
    min_free: u64,
) -> Result<PathBuf, CheckpointError> {
    write_at(dir, image, &part_path(dir, image.meta().step, blocks), min_free)
}

/// Writes shard `index` of `parts` of the checkpoint at the image's step (as [`write_part`]).
pub fn write_shard(
    dir: &Path,
    image: &StateImage,
    (index, parts): (usize, usize),
    min_free: u64,
) -> Result<PathBuf, CheckpointError> {
    write_at(dir, image, &shard_path(dir, image.meta().step, index, parts), min_free)
}

/// Writes `image` at `path`, a part's file in the step's directory of `dir`.
fn write_at(dir: &Path, image: &StateImage, path: &Path, min_free: u64) -> Result<PathBuf, CheckpointError> {
    let step = image.meta().step;
    let create = |d: &Path| {
        std::fs::create_dir_all(d).map_err(|source| CheckpointError::Io {
            op: "creating",
            path: d.to_path_buf(),
            source,
        })
    };
    // The bytes and the room first: the step's directory appears only to be filled at
    // once, so nobody lists an empty checkpoint (or one left by a refusal).
    create(dir)?;
    if min_free > 0 {
        check_room(dir, image.encoded_len(), min_free)?;
    }
    // Created once, by whichever writer comes first (stages on several hosts may share the
    // directory): the others find it there.
    match std::fs::OpenOptions::new().write(true).create_new(true).open(dir.join(MARKER)) {
        Ok(f) => f.sync_all().map_err(|source| CheckpointError::Io {
            op: "syncing",
            path: dir.join(MARKER),
            source,
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(CheckpointError::Io { op: "creating", path: dir.join(MARKER), source }),
    }
    let sd = step_dir(dir, step);
    create(&sd)?;
    // The step's directory entry itself must survive a power loss, or the part fsynced
    // inside it could vanish with it (write_atomic syncs the step directory, not its parent).
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|source| CheckpointError::Io {
        op: "syncing",
        path: dir.to_path_buf(),
        source,
    })?;
    // Streamed into the file: the encoding is never held beside the image.
    limpet_snapshot::write_image_atomic(path, image)?;
    Ok(path.to_path_buf())
}

/// The file that marks a directory limpet has written checkpoints to.
pub const MARKER: &str = ".limpet-checkpoints";

/// Whether `dir` is a checkpoint directory a new cluster may trust to be the real one (what
/// `[checkpoint].resume = "required"` asks): one holding checkpoints or limpet's [`MARKER`]
/// (it wrote there), or on a filesystem other than the root's or mounted on its own (a fresh
/// EFS volume, `/mnt/efs/limpet` on it). An empty directory on the root filesystem is
/// neither: it is what an unmounted mount point looks like, and starting there would start
/// the job over. The reason when not.
pub fn trusted_dir(dir: &Path) -> Result<(), CheckpointError> {
    use std::os::unix::fs::MetadataExt;
    let untrusted = |detail: String| CheckpointError::Untrusted { path: dir.to_path_buf(), detail };
    let meta = std::fs::metadata(dir).map_err(|e| untrusted(format!("is missing ({e})")))?;
    if !meta.is_dir() {
        return Err(untrusted("is not a directory".into()));
    }
    if dir.join(MARKER).exists() || list(dir).is_ok_and(|l| !l.is_empty()) {
        return Ok(());
    }
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    let parent = dir.join("..");
    if dev(Path::new("/")) != Some(meta.dev()) || dev(&parent) != Some(meta.dev()) {
        return Ok(());
    }
    Err(untrusted(format!(
        "is empty, on the root filesystem, and holds no {MARKER}: an unmounted mount point looks like \
         this; to start a new job there, create {MARKER} in it"
    )))
}

/// Whether `size` more bytes in `dir` leave at least `min_free` available to unprivileged
/// writers (what limpetd, not root, can still use).
fn check_room(dir: &Path, size: u64, min_free: u64) -> Result<(), CheckpointError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| CheckpointError::Io {
        op: "measuring free space on",
        path: dir.to_path_buf(),
        source: e.into(),
    })?;
    #[allow(clippy::useless_conversion)] // the field types differ between platforms
    let free = u64::from(st.blocks_available()).saturating_mul(u64::from(st.fragment_size()));
    if free.saturating_sub(size) < min_free {
        return Err(CheckpointError::NoRoom {
            path: dir.to_path_buf(),
            size,
            left: free.saturating_sub(size),
            min_free,
        });
    }
    Ok(())
}

/// A checkpoint on disk: its step and its parts (file, blocks), in block order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// The step.
    pub step: u64,
    /// The parts.
    pub parts: Vec<(PathBuf, Range<usize>)>,
    /// The shards (file, index, of how many), in order.
    pub shards: Vec<(PathBuf, usize, usize)>,
}

impl Listed {
    /// The checkpoint at `step` made of `files` (a step directory's entries, or the objects of
    /// a step in S3), going by their names; files whose names are not ours are left out.
    pub fn of_files(step: u64, files: impl IntoIterator<Item = PathBuf>) -> Listed {
        let name = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_string);
        let (mut parts, mut shards) = (Vec::new(), Vec::new());
        for p in files {
            let Some(n) = name(&p) else { continue };
            if let Some(blocks) = parse_part(&n) {
                parts.push((p, blocks));
            } else if let Some((i, of)) = parse_shard(&n) {
                shards.push((p, i, of));
            }
        }
        parts.sort_by_key(|(_, r)| (r.start, r.end));
        shards.sort_by_key(|s| (s.2, s.1));
        Listed { step, parts, shards }
    }

    /// Whether the parts tile `0..blocks`, or the shards are every one of a write (going by
    /// the names; contents are checked on load).
    pub fn complete(&self, blocks: usize) -> bool {
        self.shard_set().is_some()
            || cover(&self.parts.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(), blocks).is_some()
    }

    /// The files of a whole set of shards (`0..n` of one `n`, the largest such), if any.
    pub fn shard_set(&self) -> Option<Vec<PathBuf>> {
        self.shard_sets().into_iter().next()
    }

    /// The files of every whole set of shards, one per shard count, largest first: a step
    /// written by two worlds (a write at the step, then training back at it in another
    /// world) holds two.
    pub fn shard_sets(&self) -> Vec<Vec<PathBuf>> {
        let mut counts: Vec<usize> = self.shards.iter().map(|s| s.2).collect();
        counts.sort_unstable();
        counts.dedup();
        counts
            .into_iter()
            .rev()
            .filter_map(|n| {
                let of_n: Vec<&(PathBuf, usize, usize)> = self.shards.iter().filter(|s| s.2 == n).collect();
                (0..n).map(|i| of_n.iter().find(|s| s.1 == i).map(|s| s.0.clone())).collect()
            })
            .collect()
    }

    /// Every file of the checkpoint, parts and shards.
    pub fn files(&self) -> impl Iterator<Item = &PathBuf> {
        self.parts.iter().map(|(p, _)| p).chain(self.shards.iter().map(|(p, _, _)| p))
    }
}

/// Parts (of any overlap) chosen to tile `0..blocks` from left to right, if they can.
pub(crate) fn cover(parts: &[Range<usize>], blocks: usize) -> Option<Vec<usize>> {
    let mut at = 0;
    let mut chosen = Vec::new();
    while at < blocks {
        // The part starting exactly here that reaches furthest.
        let (i, r) = parts.iter().enumerate().filter(|(_, r)| r.start == at).max_by_key(|(_, r)| r.end)?;
        chosen.push(i);
        at = r.end;
    }
    (at == blocks).then_some(chosen)
}

/// Every checkpoint in `dir`, oldest first (a missing directory holds none).
pub fn list(dir: &Path) -> Result<Vec<Listed>, CheckpointError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(CheckpointError::Io { op: "listing", path: dir.to_path_buf(), source }),
    };
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let Some(step) = entry.file_name().to_str().and_then(parse_step_dir) else { continue };
        out.push(listed_at(dir, step)?);
    }
    out.sort_by_key(|l| l.step);
    Ok(out)
}

/// The checkpoint at `step` in `dir`: its parts, in block order.
pub fn listed_at(dir: &Path, step: u64) -> Result<Listed, CheckpointError> {
    let sd = step_dir(dir, step);
    let entries = std::fs::read_dir(&sd).map_err(|source| CheckpointError::Io {
        op: "listing",
        path: sd.clone(),
        source,
    })?;
    Ok(Listed::of_files(step, entries.flatten().map(|e| e.path())))
}

/// Whether the headers of `files` (one write's shards) make one whole state: its step, job
/// and content hash, or why not.
pub fn shards_agree(files: &[PathBuf]) -> Result<(u64, serde_json::Value, String), CheckpointError> {
    let heads = files
        .iter()
        .map(|p| {
            limpet_snapshot::read_header(p)
                .map_err(|e| CheckpointError::Bad { path: p.clone(), detail: e.to_string() })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let dir = files.first().and_then(|p| p.parent()).map(Path::to_path_buf).unwrap_or_default();
    let whole = limpet_snapshot::shards::headers_agree(&heads)
        .map_err(|e| CheckpointError::Bad { path: dir, detail: e.to_string() })?;
    let m = &heads[0].0;
    Ok((m.step, m.job.clone(), whole))
}

/// Waits until every shard of the write of `parts` shards at `step` is in `dir` and their
/// headers make the state of content hash `whole`, within `wait` and unless `stop` names a
/// reason to give up (the agent stopping, a writer of the set gone); removes shards of other
/// writes of that step (of another world, before going back), so one set is left. The
/// step's directory.
pub fn await_shards(
    dir: &Path,
    step: u64,
    parts: usize,
    whole: &str,
    wait: std::time::Duration,
    stop: &dyn Fn() -> Option<String>,
) -> Result<PathBuf, CheckpointError> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let l = listed_at(dir, step)?;
        let files: Vec<PathBuf> = (0..parts)
            .filter_map(|i| l.shards.iter().find(|s| (s.1, s.2) == (i, parts)).map(|s| s.0.clone()))
            .collect();
        if files.len() == parts {
            let (_, _, hash) = shards_agree(&files)?;
            if hash != whole {
                return Err(CheckpointError::Bad {
                    path: step_dir(dir, step),
                    detail: format!("the shards make a state of hash {hash}, not the {whole} written"),
                });
            }
            for (p, _, n) in &l.shards {
                if *n != parts {
                    let _ = std::fs::remove_file(p);
                }
            }
            return Ok(step_dir(dir, step));
        }
        let why = match stop() {
            Some(why) => why,
            None if std::time::Instant::now() >= deadline => format!("after {wait:?}"),
            None => {
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        return Err(CheckpointError::Bad {
            path: step_dir(dir, step),
            detail: format!("{} of its {parts} shards, {why}", files.len()),
        });
    }
}

/// Reads back a part just written and checks it holds `image` (its content hash): a part
/// that does not is no checkpoint, and nothing is pruned or recorded for it.
pub fn verify_part(path: &Path, image: &StateImage) -> Result<(), CheckpointError> {
    // Checked as it is read, a buffer at a time: neither the file's bytes nor its tensors are
    // held (a whole read held both beside the image just written).
    let back = limpet_snapshot::verify_file(path).map_err(|e| CheckpointError::Bad {
        path: path.to_path_buf(),
        detail: format!("does not read back: {e}"),
    })?;
    if back.content_hash != image.content_hash() {
        return Err(CheckpointError::Bad {
            path: path.to_path_buf(),
            detail: format!("reads back as {}, not the {} written", back.content_hash, image.content_hash()),
        });
    }
    Ok(())
}

/// Reads a checkpoint's parts and joins them into one image of the whole model, checking
/// that every part is intact, at the checkpoint's step, and of one job and one data order.
/// A step holding whole sets of shards of two worlds joins the first that loads, the largest
/// first (a set fetched from S3 beside a stale one, a step two worlds wrote); the error is
/// the first set's.
pub fn load(listed: &Listed, blocks: usize) -> Result<StateImage, CheckpointError> {
    let mut first_error = None;
    for files in listed.shard_sets() {
        match load_shards(listed.step, &files) {
            Ok(image) => return Ok(image),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let mut tensors = BTreeMap::new();
    let mut meta: Option<limpet_snapshot::StateMeta> = None;
    for path in covering_parts(listed, blocks)? {
        let image = limpet_snapshot::read_file(path)
            .map_err(|e| CheckpointError::Bad { path: path.clone(), detail: e.to_string() })?;
        agree(path, image.meta(), listed.step, &mut meta)?;
        for (name, t) in image.tensors() {
            tensors.insert(name.clone(), t.clone());
        }
    }
    let m = meta.expect("a cover of at least one block has a part");
    Ok(StateImage::new(m.step, m.cursor, m.rng, m.job, tensors))
}

/// Checks a checkpoint of parts as [`load`] reads it (parts that cover the blocks, each
/// intact and of the checkpoint's step, with one job, data cursor and random state), each
/// part read back a buffer at a time ([`limpet_snapshot::verify_file`]): never a part's bytes
/// or tensors held, where loading holds the joined state and a part's bytes (what pruning
/// judged by, beside the image the writer still held). The parts' metadata.
pub fn verify_parts(listed: &Listed, blocks: usize) -> Result<limpet_snapshot::StateMeta, CheckpointError> {
    let mut meta = None;
    for path in covering_parts(listed, blocks)? {
        let m = limpet_snapshot::verify_file(path)
            .map_err(|e| CheckpointError::Bad { path: path.clone(), detail: e.to_string() })?;
        agree(path, &m, listed.step, &mut meta)?;
    }
    Ok(meta.expect("a cover of at least one block has a part"))
}

/// The parts of `listed` that cover blocks `0..blocks`, as [`load`] joins them.
fn covering_parts(listed: &Listed, blocks: usize) -> Result<Vec<&PathBuf>, CheckpointError> {
    let ranges: Vec<Range<usize>> = listed.parts.iter().map(|(_, r)| r.clone()).collect();
    let chosen = cover(&ranges, blocks).ok_or_else(|| CheckpointError::Bad {
        path: listed.parts.first().map_or_else(PathBuf::new, |(p, _)| p.parent().unwrap_or(p).to_path_buf()),
        detail: format!("the parts {ranges:?} do not cover blocks 0..{blocks}"),
    })?;
    Ok(chosen.into_iter().map(|i| &listed.parts[i].0).collect())
}

/// Checks part `path`'s metadata `m` against its checkpoint's `step` and the first part's
/// (`first`, set from the first part).
fn agree(
    path: &Path,
    m: &limpet_snapshot::StateMeta,
    step: u64,
    first: &mut Option<limpet_snapshot::StateMeta>,
) -> Result<(), CheckpointError> {
    if m.step != step {
        return Err(CheckpointError::Bad {
            path: path.to_path_buf(),
            detail: format!("holds step {}, but sits in the checkpoint of step {step}", m.step),
        });
    }
    match first {
        Some(f) if (f.cursor, f.rng, &f.job) != (m.cursor, m.rng, &m.job) => Err(CheckpointError::Bad {
            path: path.to_path_buf(),
            detail: "its job, data cursor or random state differs from the other parts'".into(),
        }),
        Some(_) => Ok(()),
        None => {
            *first = Some(m.clone());
            Ok(())
        }
    }
}

/// Reads a checkpoint's shards and joins them into the whole state (every shard at the
/// checkpoint's step, and the joined state the one they name).
fn load_shards(step: u64, files: &[PathBuf]) -> Result<StateImage, CheckpointError> {
    let mut images = Vec::with_capacity(files.len());
    for path in files {
        let image = limpet_snapshot::read_file(path)
            .map_err(|e| CheckpointError::Bad { path: path.clone(), detail: e.to_string() })?;
        if image.meta().step != step {
            return Err(CheckpointError::Bad {
                path: path.clone(),
                detail: format!(
                    "holds step {}, but sits in the checkpoint of step {step}",
                    image.meta().step
                ),
            });
        }
        images.push(image);
    }
    let dir = files.first().and_then(|p| p.parent()).map(Path::to_path_buf).unwrap_or_default();
    limpet_snapshot::shards::join(images, |i| files[i].display().to_string())
        .map_err(|e| CheckpointError::Bad { path: dir, detail: e.to_string() })
}

/// A usable checkpoint: where its parts are, and the whole model's state they hold.
pub type Found = (Listed, StateImage);

/// The newest checkpoint in `dir` that loads and whose job is `job`; the ones passed over
/// and why (a newest checkpoint that is corrupt falls back to the one before).
pub fn newest(
    dir: &Path,
    blocks: usize,
    job: &serde_json::Value,
) -> Result<(Option<Found>, Vec<String>), CheckpointError> {
    let mut skipped = Vec::new();
    for l in list(dir)?.into_iter().rev() {
        if !l.complete(blocks) {
            skipped.push(format!("{}: incomplete", step_dir(dir, l.step).display()));
            continue;
        }
        match load(&l, blocks) {
            Ok(image) if &image.meta().job == job => return Ok((Some((l, image)), skipped)),
            Ok(_) => skipped.push(format!("{}: another job", step_dir(dir, l.step).display())),
            Err(e) => skipped.push(e.to_string()),
        }
    }
    Ok((None, skipped))
}

#[cfg(test)]
mod tests;

//! Checkpoint files on disk: atomic replacement and verified reads.

use crate::{SnapshotError, StateImage, StateMeta, META_KEY};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SnapshotError + 'a {
    move |source| SnapshotError::Io { op, path: path.to_path_buf(), source }
}

/// Writes `bytes` to `path` so that a crash at any moment leaves either the previous file or the
/// complete new one: write a temporary file beside it, fsync it, rename it over `path`, then
/// fsync the directory so the rename itself survives power loss.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    atomically(path, |tmp| {
        let mut f = File::create(tmp).map_err(io_err("create", tmp))?;
        f.write_all(bytes).map_err(io_err("write", tmp))
    })
}

/// Writes `image`'s encoding to `path` as [`write_atomic`] writes bytes, but as it is made,
/// a buffer at a time: a model-sized encoding is never held in memory beside the image.
pub fn write_image_atomic(path: &Path, image: &StateImage) -> Result<(), SnapshotError> {
    atomically(path, |tmp| image.write_new_file(tmp))
}

/// Runs `write` on a temporary file in a staging directory of its own beside `path`, then
/// makes it `path` durably (fsync, rename, fsync of the directory); on any failure removes
/// the staging directory and leaves the old file, if any, untouched.
///
/// The staging directory (`.NAME.tmp-OWNER-PID-N`: OWNER names this machine and process
/// namespace, N this process's write) holds whatever the write makes, safetensors' own
/// temporary included, so a writer killed mid-write (`kill -9`, a revoked host) leaves one
/// directory named for itself. The next write of `path` by a process of the same OWNER
/// removes those of processes no longer running: a model-sized leftover is not left for
/// good. Where the owner cannot be told (no machine id or host name, no process namespace
/// to read), nothing is swept.
pub(crate) fn atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), SnapshotError>,
) -> Result<(), SnapshotError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let owner = owner();
    let prefix = format!(".{name}.tmp-{}-", owner.as_deref().unwrap_or("unknown"));
    if owner.is_some() {
        sweep_dead_writers(dir, &prefix);
    }
    // One of this process's writes: two threads writing one path never share a directory.
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let stage = dir.join(format!("{prefix}{}-{n}", std::process::id()));
    let tmp = stage.join(&name);
    let result = (|| {
        fs::create_dir(&stage).map_err(io_err("create", &stage))?;
        write(&tmp)?;
        // Readable by others as a file `File::create` makes under the usual umask: a writer
        // that makes its file private (safetensors' does) would lock out a reader running as
        // another user (an evaluation job, a copy to storage).
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644)).map_err(io_err("chmod", &tmp))?;
        }
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err("fsync", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))
    })();
    // Empty once the file is in place; on a failure it holds what the write left.
    let _ = fs::remove_dir_all(&stage);
    result
}

/// Moves `from`, a file one of the atomic writers put in place, to `to` in the same
/// directory durably (rename, fsync of the directory): `to` is the old file or the whole new
/// one, never part of either.
pub fn rename_durable(from: &Path, to: &Path) -> Result<(), SnapshotError> {
    fs::rename(from, to).map_err(io_err("rename into place", to))?;
    let dir = match to.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))
}

/// A name for this machine and process namespace, for the staging directories' owner: a
/// process id means one process only within one namespace of one machine. `None` where
/// either cannot be read.
fn owner() -> Option<String> {
    let machine = ["/etc/machine-id", "/proc/sys/kernel/random/boot_id", "/proc/sys/kernel/hostname"]
        .iter()
        .find_map(|p| fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))?;
    let namespace = fs::read_link("/proc/self/ns/pid").ok()?;
    let mut h = blake3::Hasher::new();
    h.update(machine.as_bytes());
    h.update(namespace.as_os_str().as_encoded_bytes());
    Some(h.finalize().to_hex()[..16].to_string())
}

/// Removes the staging directories in `dir` named `prefix` + a process id (+ `-N`) whose
/// process is no longer running.
fn sweep_dead_writers(dir: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|p| p.split_once('-'))
            .and_then(|(pid, n)| n.parse::<u64>().ok().and(pid.parse::<u32>().ok()))
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Reads and fully verifies a checkpoint file.
pub fn read_file(path: &Path) -> Result<StateImage, SnapshotError> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    StateImage::decode(&bytes)
}

/// The largest safetensors header [`read_meta`] reads (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Reads only a checkpoint file's metadata (its header), not its tensors, and does not verify
/// them: enough to tell whose a file is (its job) without reading a model's worth of bytes.
pub fn read_meta(path: &Path) -> Result<StateMeta, SnapshotError> {
    Ok(read_header(path)?.0)
}

/// Reads only a state file's header: its metadata and each tensor's dtype and shape, by
/// name (nothing of the tensors' bytes is read or checked).
pub fn read_header(path: &Path) -> Result<(StateMeta, crate::shards::Header), SnapshotError> {
    let (_, _, meta, entries) = open_with_header(path)?;
    Ok((meta, entries.into_iter().map(|(name, e)| (name, (e.dtype, e.shape))).collect()))
}

/// A tensor's entry in a state file's header.
struct Entry {
    dtype: crate::image::Dtype,
    shape: Vec<usize>,
    /// Where its bytes are, from the start of the data (after the header).
    offsets: (u64, u64),
}

/// Opens a state file and reads its header: the file, positioned at its first tensor byte,
/// the header's length, the metadata, and each tensor's entry by name.
fn open_with_header(path: &Path) -> Result<(File, u64, StateMeta, BTreeMap<String, Entry>), SnapshotError> {
    use std::io::Read;
    let mut f = File::open(path).map_err(io_err("open", path))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io_err("read", path))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(SnapshotError::Format(format!("a header of {n} bytes (at most {MAX_HEADER})")));
    }
    let mut header = Vec::with_capacity(n as usize);
    (&mut f).take(n).read_to_end(&mut header).map_err(io_err("read", path))?;
    if header.len() as u64 != n {
        return Err(SnapshotError::Format(format!("the file ends inside its {n}-byte header")));
    }
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| SnapshotError::Format(format!("header: {e}")))?;
    // safetensors' metadata is strings only: a file with another value there is refused as
    // its decoder refuses it.
    let metadata = header.get("__metadata__");
    if metadata.and_then(serde_json::Value::as_object).is_some_and(|m| m.values().any(|v| !v.is_string())) {
        return Err(SnapshotError::Format("header: metadata that is not all strings".into()));
    }
    let meta = metadata
        .and_then(|m| m.get(META_KEY))
        .and_then(serde_json::Value::as_str)
        .ok_or(SnapshotError::MissingMeta { key: META_KEY })?;
    let meta = crate::image::parse_meta(meta)?;
    let mut tensors = BTreeMap::new();
    for (name, t) in header.as_object().into_iter().flatten().filter(|(n, _)| *n != "__metadata__") {
        let bad = |what: &str| SnapshotError::Format(format!("header: tensor {name}: {what}"));
        let dtype = t.get("dtype").and_then(serde_json::Value::as_str).ok_or_else(|| bad("no dtype"))?;
        let dtype = crate::image::Dtype::from_name(dtype).ok_or_else(|| bad("an unknown dtype"))?;
        let shape = t
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("a shape that is not a list of sizes"))?;
        let offsets = match t.get("data_offsets").and_then(serde_json::Value::as_array).map(Vec::as_slice) {
            Some([a, b]) => a.as_u64().zip(b.as_u64()),
            _ => None,
        }
        .ok_or_else(|| bad("no data offsets"))?;
        tensors.insert(name.clone(), Entry { dtype, shape, offsets });
    }
    Ok((f, n, meta, tensors))
}

/// Reads a state file back a buffer at a time and checks it as [`read_file`] does (its
/// tensors those its metadata lists, each tensor's checksum, the content hash), without
/// holding its bytes or its tensors: how a writer checks the file it wrote. Its metadata.
pub fn verify_file(path: &Path) -> Result<StateMeta, SnapshotError> {
    use std::io::Read;
    let (mut f, n, meta, entries) = open_with_header(path)?;
    let file_len = f.metadata().map_err(io_err("stat", path))?.len();
    let mut order: Vec<(&String, &Entry)> = entries.iter().collect();
    order.sort_by_key(|(_, e)| e.offsets);
    let mut buf = vec![0u8; (8 << 20).min(file_len as usize).max(1)];
    let mut at = 0u64;
    let mut found = BTreeMap::new();
    for (name, e) in order {
        let bad = |what: String| SnapshotError::Format(format!("tensor {name}: {what}"));
        let (begin, end) = e.offsets;
        if begin != at || end < begin {
            return Err(bad(format!(
                "its bytes {begin}..{end} do not follow the tensor before, which ends at {at}"
            )));
        }
        let want = e
            .shape
            .iter()
            .try_fold(e.dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("a shape of {:?} elements overflows", e.shape)))?;
        if end - begin != want {
            return Err(bad(format!(
                "{} bytes for its shape {:?}, which needs {want}",
                end - begin,
                e.shape
            )));
        }
        if (8 + n).saturating_add(end) > file_len {
            return Err(bad(format!("its bytes end at {end}, past the file's {file_len} bytes")));
        }
        let mut h = blake3::Hasher::new();
        let mut left = end - begin;
        while left > 0 {
            let k = (left as usize).min(buf.len());
            f.read_exact(&mut buf[..k]).map_err(io_err("read", path))?;
            h.update(&buf[..k]);
            left -= k as u64;
        }
        let sum = h.finalize().to_hex().to_string();
        let expected = meta.checksums.get(name).ok_or_else(|| SnapshotError::TensorSet {
            name: name.clone(),
            problem: "is in the file but not listed in the checkpoint metadata",
        })?;
        if &sum != expected {
            return Err(SnapshotError::Checksum {
                name: name.clone(),
                expected: expected.clone(),
                found: sum,
            });
        }
        found.insert(name.as_str(), sum);
        at = end;
    }
    if 8 + n + at != file_len {
        return Err(SnapshotError::Format(format!(
            "the file has {file_len} bytes where its header and tensors make {}",
            8 + n + at
        )));
    }
    if let Some(name) = meta.checksums.keys().find(|n| !found.contains_key(n.as_str())) {
        return Err(SnapshotError::TensorSet {
            name: name.clone(),
            problem: "is listed in the checkpoint metadata but missing from the file",
        });
    }
    let hashed = crate::image::check_hash(
        &meta.content_hash,
        (meta.step, meta.cursor, meta.rng),
        &meta.job,
        entries
            .iter()
            .map(|(name, e)| (name.as_str(), e.dtype, e.shape.as_slice(), found[name.as_str()].as_str())),
    );
    if let Err(hashed) = hashed {
        return Err(SnapshotError::ContentHash { expected: meta.content_hash, found: hashed });
    }
    Ok(meta)
}

/// A short fingerprint of a job (blake3 of its JSON, whose keys serde_json keeps sorted):
/// what tells one run's checkpoints from another's where only a tag fits (S3 metadata).
pub fn job_fingerprint(job: &serde_json::Value) -> String {
    let bytes = serde_json::to_vec(job).expect("JSON values serialize");
    blake3::hash(&bytes).to_hex()[..32].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RngState, StateImage};

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.safetensors");
        let a = StateImage::new(1, 8, RngState::new(3), serde_json::json!({"j": 1}), Default::default());
        let b = StateImage::new(2, 16, RngState::new(3), serde_json::json!({"j": 1}), Default::default());
        write_atomic(&path, &a.encode().unwrap()).unwrap();
        write_atomic(&path, &b.encode().unwrap()).unwrap();
        assert_eq!(read_file(&path).unwrap(), b);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "temporary left behind: {names:?}");
    }

    /// What a writer killed mid-write left (its staging directory, with safetensors' own
    /// temporary in it) goes at the next write of the same file by the same owner; a live
    /// process's, another owner's and another file's stay.
    #[test]
    fn a_dead_writers_leftovers_go_at_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.safetensors");
        let me = owner().expect("this machine and namespace have a name");
        // A process id no process has (above the kernel's pid_max, which is at most 2^22).
        let gone = 1u32 << 30;
        let stage =
            |owner: &str, file: &str, pid: u32| dir.path().join(format!(".{file}.tmp-{owner}-{pid}-3"));
        let dead = stage(&me, "checkpoint.safetensors", gone);
        let kept = [
            stage(&me, "checkpoint.safetensors", 1),
            stage(&format!("{me}x"), "checkpoint.safetensors", gone),
            stage("0123456789abcdef", "checkpoint.safetensors", gone),
            stage(&me, "other", gone),
            dir.path().join(format!(".checkpoint.safetensors.tmp-{me}-{gone}")),
        ];
        for d in kept.iter().chain([&dead]) {
            fs::create_dir(d).unwrap();
            fs::write(d.join(".tmpAbC123"), vec![7u8; 4096]).unwrap();
        }
        let a = StateImage::new(1, 8, RngState::new(3), serde_json::json!({"j": 1}), Default::default());
        write_image_atomic(&path, &a).unwrap();
        assert_eq!(read_file(&path).unwrap(), a);
        assert!(!dead.exists(), "a dead writer's staging directory stayed");
        for d in &kept {
            assert!(d.join(".tmpAbC123").exists(), "{} was removed", d.display());
        }
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), kept.len() + 1, "{names:?}");
    }

    /// Threads writing one path at once each write through a directory of their own: every
    /// write succeeds and the file is one of them, whole.
    #[test]
    fn concurrent_writes_of_one_path_do_not_share_a_staging_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.safetensors");
        let images: Vec<StateImage> = (0..4)
            .map(|i| {
                let t =
                    crate::RawTensor::try_new("w", crate::Dtype::U8, vec![1 << 16], vec![i as u8; 1 << 16])
                        .unwrap();
                StateImage::new(i, 8, RngState::new(3), serde_json::json!({}), [("w".to_string(), t)].into())
            })
            .collect();
        std::thread::scope(|s| {
            for img in &images {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..8 {
                        write_image_atomic(path, img).unwrap();
                    }
                });
            }
        });
        assert!(images.contains(&read_file(&path).unwrap()));
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// The header alone gives the metadata; a truncated header or a header length past the
    /// bound is an error, not an allocation.
    #[test]
    fn the_metadata_reads_without_the_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.safetensors");
        let tensors = std::collections::BTreeMap::from([(
            "w".to_string(),
            crate::RawTensor::try_new("w", crate::Dtype::F32, vec![2], vec![0u8; 8]).unwrap(),
        )]);
        let a = StateImage::new(7, 8, RngState::new(3), serde_json::json!({"j": 1}), tensors);
        let bytes = a.encode().unwrap();
        write_atomic(&path, &bytes).unwrap();
        assert_eq!(&read_meta(&path).unwrap(), a.meta());
        assert_ne!(job_fingerprint(&a.meta().job), job_fingerprint(&serde_json::json!({"j": 2})));
        write_atomic(&path, &bytes[..20]).unwrap();
        assert!(read_meta(&path).unwrap_err().to_string().contains("header"));
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        write_atomic(&path, &huge).unwrap();
        assert!(read_meta(&path).unwrap_err().to_string().contains("at most"));
    }

    #[test]
    fn failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("x");
        let err = write_atomic(&path, b"abc").unwrap_err();
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }
}

//! Checkpoint files on disk: atomic replacement and verified reads.

use crate::{SnapshotError, StateImage};
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
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
        f.write_all(bytes).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))
    })();
    if result.is_err() {
        // Leave no half-written temporary behind; the old file, if any, is untouched.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Reads and fully verifies a checkpoint file.
pub fn read_file(path: &Path) -> Result<StateImage, SnapshotError> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    StateImage::decode(&bytes)
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

    #[test]
    fn failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("x");
        let err = write_atomic(&path, b"abc").unwrap_err();
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }
}

//! The cluster secret file (`[node].secret_file`, `--secret-file`): read and checked in one
//! place, for `limpetd`, its `validate` and `limpet fleet`.

use std::path::Path;

/// The fewest bytes a cluster secret may have (the data plane's HMAC key).
pub const MIN_SECRET_BYTES: usize = 16;

/// The secret in `path`, or why not, naming the file: unreadable, or shorter than
/// [`MIN_SECRET_BYTES`]. The caller says which setting named the file.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let secret = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if secret.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "{} holds {} bytes; the cluster secret needs at least {MIN_SECRET_BYTES}",
            path.display(),
            secret.len()
        ));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A readable secret of 16 bytes or more is returned whole; a short or missing one is
    /// refused naming the file and what was wrong.
    #[test]
    fn a_secret_is_read_whole_or_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good");
        std::fs::write(&good, [7u8; 16]).unwrap();
        assert_eq!(read_secret(&good).unwrap(), vec![7u8; 16]);
        let short = dir.path().join("short");
        std::fs::write(&short, b"fifteen bytes!!").unwrap();
        let e = read_secret(&short).unwrap_err();
        assert!(e.contains("short") && e.contains("15 bytes") && e.contains("at least 16"), "{e}");
        let e = read_secret(&dir.path().join("missing")).unwrap_err();
        assert!(e.contains("missing") && e.contains("No such file"), "{e}");
    }
}

//! Token shards: a directory of flat little-endian `uint16` or `uint32` token files (the
//! nanoGPT / Megatron `.bin` convention) described by a small JSON manifest,
//! [`MANIFEST_FILE`], that lists every file with its token count and blake3.
//!
//! Opening a dataset reads the manifest and checks each file's size against it; it never
//! reads or hashes the tokens, so opening 100 GB is as quick as opening 100 KB. The dataset's
//! fingerprint is the blake3 of the manifest, whose per-file hashes were computed once when
//! the shards were written (`limpet data tokenize` / `limpet data index`); `limpet data
//! verify` checks them against the files.
//!
//! Sample `j` of a split is the `context + 1` tokens at offset `j * context` of one shard
//! (windows never straddle two files): inputs are the first `context`, targets the last.
//! Windows are read with positional reads, a few kilobytes at a time, and never cached by
//! the process; the kernel's page cache does that. Positional reads rather than a memory
//! map because a shard truncated or replaced under a running job then yields an error that
//! names the file and offset, where a mapping would kill the process with SIGBUS.

use crate::Malformed;
use crate::TrainerError;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// The manifest's file name inside a shard directory.
pub const MANIFEST_FILE: &str = "limpet-tokens.json";
/// The value of the manifest's `format` field.
pub const MANIFEST_FORMAT: &str = "limpet-tokens";
/// Largest manifest accepted: a million shards fit well within it.
const MANIFEST_MAX_BYTES: u64 = 64 << 20;
/// Largest number of windows held out for evaluation when the manifest has no `val` files.
const HELD_OUT_MAX: u64 = 256;

/// Width of one token on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Two bytes, little-endian: vocabularies up to 65,536.
    Uint16,
    /// Four bytes, little-endian.
    Uint32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn width(self) -> u64 {
        match self {
            TokenDtype::Uint16 => 2,
            TokenDtype::Uint32 => 4,
        }
    }

    /// The narrowest dtype that holds ids below `vocab`.
    pub fn for_vocab(vocab: u64) -> Self {
        if vocab <= 1 << 16 {
            TokenDtype::Uint16
        } else {
            TokenDtype::Uint32
        }
    }
}

/// One shard file as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Path relative to the manifest's directory.
    pub file: String,
    /// Tokens in the file (its size divided by the dtype's width).
    pub tokens: u64,
    /// blake3 of the file's bytes, hex.
    pub blake3: String,
}

/// A shard directory's manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Format version (1).
    pub version: u32,
    /// Token width on disk.
    pub dtype: TokenDtype,
    /// Vocabulary size: every token id is below it.
    pub vocab: u64,
    /// The tokenizer the shards were made with (a `tokenizer.json` beside the manifest), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// Training shards, in order.
    pub train: Vec<ShardEntry>,
    /// Held-out shards (optional: without them the last windows of `train` are held out).
    #[serde(default)]
    pub val: Vec<ShardEntry>,
}

impl Manifest {
    /// Parses and checks a manifest's bytes (untrusted: a fuzz target and property tests
    /// cover this). The error says which field is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Self, Malformed> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| format!("not a token manifest: {e}"))
            .map_err(Malformed)?;
        m.check()?;
        Ok(m)
    }

    /// Checks the fields against each other (not against the files).
    pub fn check(&self) -> Result<(), Malformed> {
        if self.format != MANIFEST_FORMAT {
            return Err(Malformed(format!("format is {:?}, expected {MANIFEST_FORMAT:?}", self.format)));
        }
        if self.version != 1 {
            return Err(Malformed(format!(
                "version {} is not supported (this limpet reads version 1)",
                self.version
            )));
        }
        let max_vocab = 1u64 << (8 * self.dtype.width());
        if self.vocab == 0 || self.vocab > max_vocab {
            return Err(Malformed(format!(
                "vocab {} is not within 1..={max_vocab} for dtype {:?}",
                self.vocab, self.dtype
            )));
        }
        if self.train.is_empty() {
            return Err(Malformed("train lists no files".into()));
        }
        for (split, entries) in [("train", &self.train), ("val", &self.val)] {
            for (i, e) in entries.iter().enumerate() {
                let at = format!("{split}[{i}] ({:?})", e.file);
                check_relative(&e.file).map_err(|m| format!("{at}: {m}")).map_err(Malformed)?;
                if e.tokens.checked_mul(self.dtype.width()).is_none() {
                    return Err(Malformed(format!("{at}: {} tokens is too many", e.tokens)));
                }
                if e.blake3.len() != 64 || !e.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(Malformed(format!("{at}: blake3 {:?} is not 64 hex digits", e.blake3)));
                }
            }
        }
        if let Some(t) = &self.tokenizer {
            check_relative(t).map_err(|m| format!("tokenizer: {m}")).map_err(Malformed)?;
        }
        Ok(())
    }

    /// The manifest as written to disk: pretty JSON with a final newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        v.push(b'\n');
        v
    }

    /// blake3 of the canonical serialization: the dataset's fingerprint.
    pub fn fingerprint(&self) -> String {
        blake3::hash(&serde_json::to_vec(self).expect("a manifest serializes")).to_hex().to_string()
    }
}

/// A manifest path must stay inside the shard directory.
fn check_relative(file: &str) -> Result<(), Malformed> {
    let p = Path::new(file);
    if file.is_empty() || file.contains('\0') {
        return Err(Malformed("is empty or holds a NUL".into()));
    }
    if !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(Malformed(
            "must be a relative path inside the directory (no '/', '..' or '.' at the start)".into(),
        ));
    }
    Ok(())
}

/// An open shard: its path, handle, and token count.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    file: File,
    tokens: u64,
    /// Index of this shard's first window within its split.
    first_window: u64,
}

/// The open shards of one split and how they cut into windows.
#[derive(Debug)]
pub struct ShardSet {
    shards: Vec<Shard>,
    dtype: TokenDtype,
    vocab: u64,
    context: u64,
    windows: u64,
}

impl ShardSet {
    fn open(dir: &Path, entries: &[ShardEntry], m: &Manifest, context: u64) -> Result<Self, TrainerError> {
        let mut shards = Vec::with_capacity(entries.len());
        let mut windows = 0u64;
        for e in entries {
            let path = dir.join(&e.file);
            let file = File::open(&path)
                .map_err(|err| data_err(&path, format!("cannot open a shard the manifest lists: {err}")))?;
            let meta = file.metadata().map_err(|err| data_err(&path, err.to_string()))?;
            if !meta.is_file() {
                return Err(data_err(&path, "a shard the manifest lists is not a file (a directory?)"));
            }
            let len = meta.len();
            let want = e.tokens * m.dtype.width();
            if len != want {
                return Err(data_err(
                    &path,
                    format!(
                        "the manifest says {} tokens ({want} bytes) but the file has {len} bytes{}",
                        e.tokens,
                        if len < want { ": truncated?" } else { "" }
                    ),
                ));
            }
            let first_window = windows;
            windows += e.tokens.saturating_sub(1) / context;
            shards.push(Shard { path, file, tokens: e.tokens, first_window });
        }
        Ok(ShardSet { shards, dtype: m.dtype, vocab: m.vocab, context, windows })
    }

    /// Number of windows.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Reads window `j` (`context + 1` tokens) into `out`, checking every id against the
    /// vocabulary.
    /// The shard file window `j` is read from and the index of its first token there.
    fn locate(&self, j: u64) -> (&Shard, u64) {
        let s = self.shards.partition_point(|s| s.first_window <= j) - 1;
        let shard = &self.shards[s];
        (shard, (j - shard.first_window) * self.context)
    }

    fn read_window(&self, j: u64, out: &mut Vec<i64>) -> Result<(), TrainerError> {
        let (shard, first_token) = self.locate(j);
        debug_assert!(first_token + self.context < shard.tokens);
        let width = self.dtype.width();
        let mut bytes = vec![0u8; ((self.context + 1) * width) as usize];
        let offset = first_token * width;
        shard.file.read_exact_at(&mut bytes, offset).map_err(|e| {
            data_err(
                &shard.path,
                format!(
                    "reading {} bytes at byte offset {offset}: {e} (was the shard truncated?)",
                    bytes.len()
                ),
            )
        })?;
        for (k, chunk) in bytes.chunks_exact(width as usize).enumerate() {
            let id = match self.dtype {
                TokenDtype::Uint16 => u64::from(u16::from_le_bytes([chunk[0], chunk[1]])),
                TokenDtype::Uint32 => u64::from(u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])),
            };
            if id >= self.vocab {
                return Err(data_err(
                    &shard.path,
                    format!(
                        "token {id} at byte offset {} is not below the vocabulary size {}",
                        offset + k as u64 * width,
                        self.vocab
                    ),
                ));
            }
            out.push(id as i64);
        }
        Ok(())
    }
}

/// A range of one shard set's windows: a split.
#[derive(Clone, Debug)]
pub struct Windows {
    set: Arc<ShardSet>,
    first: u64,
    len: u64,
}

impl Windows {
    /// Number of windows.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when the split holds no windows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shard file window `j` of this split starts in (its file name) and the index of
    /// its first token there.
    pub fn source_of(&self, j: u64) -> (String, u64) {
        let (shard, token) = self.set.locate(self.first + j);
        let name = shard.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        (name, token)
    }

    /// The windows at `indices` (relative to this split) as `[n, context]` inputs and targets.
    pub fn read(
        &self,
        indices: impl Iterator<Item = u64>,
    ) -> Result<(Vec<i64>, Vec<i64>, usize), TrainerError> {
        let c = self.set.context as usize;
        let (mut x, mut y, mut n) = (Vec::new(), Vec::new(), 0);
        let mut w = Vec::with_capacity(c + 1);
        for j in indices {
            assert!(j < self.len, "window {j} outside a split of {}", self.len);
            w.clear();
            self.set.read_window(self.first + j, &mut w)?;
            x.extend_from_slice(&w[..c]);
            y.extend_from_slice(&w[1..]);
            n += 1;
        }
        Ok((x, y, n))
    }
}

/// An opened shard directory: its manifest and the train and held-out windows.
#[derive(Debug)]
pub struct TokenShards {
    /// The manifest as read.
    pub manifest: Manifest,
    /// Training windows.
    pub train: Windows,
    /// Held-out windows.
    pub test: Windows,
}

fn data_err(path: &Path, detail: impl Into<String>) -> TrainerError {
    TrainerError::Data { path: path.to_path_buf(), detail: detail.into() }
}

/// Reads and checks `dir`'s manifest.
pub fn read_manifest(dir: &Path) -> Result<Manifest, TrainerError> {
    let path = dir.join(MANIFEST_FILE);
    let meta = std::fs::metadata(&path).map_err(|e| {
        data_err(&path, format!("{e} (make shards with `limpet data tokenize`, or describe existing .bin files with `limpet data index`)"))
    })?;
    if meta.len() > MANIFEST_MAX_BYTES {
        return Err(data_err(
            &path,
            format!("{} bytes is larger than a manifest may be ({MANIFEST_MAX_BYTES})", meta.len()),
        ));
    }
    let bytes = std::fs::read(&path).map_err(|e| data_err(&path, e.to_string()))?;
    Manifest::parse(&bytes).map_err(|m| data_err(&path, m))
}

/// Opens the shard directory `dir` for windows of `context` tokens.
pub fn open(dir: &Path, context: usize) -> Result<TokenShards, TrainerError> {
    if context == 0 {
        return Err(TrainerError::Config("tokens context must be at least 1".into()));
    }
    let manifest = read_manifest(dir)?;
    let c = context as u64;
    let train_set = Arc::new(ShardSet::open(dir, &manifest.train, &manifest, c)?);
    let (train, test) = if manifest.val.is_empty() {
        let n = train_set.windows;
        let held = (n / 10).clamp(1, HELD_OUT_MAX);
        if n < 2 {
            return Err(data_err(dir, format!("the train shards hold {n} windows of {context}+1 tokens: too few to train and hold some out")));
        }
        (
            Windows { set: Arc::clone(&train_set), first: 0, len: n - held },
            Windows { set: train_set, first: n - held, len: held },
        )
    } else {
        let val_set = Arc::new(ShardSet::open(dir, &manifest.val, &manifest, c)?);
        let (n, v) = (train_set.windows, val_set.windows.min(HELD_OUT_MAX));
        if n == 0 || v == 0 {
            return Err(data_err(
                dir,
                format!("{n} train and {v} val windows of {context}+1 tokens: each split needs at least one"),
            ));
        }
        (Windows { set: train_set, first: 0, len: n }, Windows { set: val_set, first: 0, len: v })
    };
    Ok(TokenShards { manifest, train, test })
}

/// Writes tokens to shard files as they come, cutting a new file every `shard_tokens`
/// tokens, and finally the manifest: what `limpet data tokenize` uses.
#[derive(Debug)]
pub struct ShardWriter {
    dir: PathBuf,
    prefix: String,
    dtype: TokenDtype,
    vocab: u64,
    shard_tokens: u64,
    entries: Vec<ShardEntry>,
    current: Option<(std::io::BufWriter<File>, blake3::Hasher, u64, String)>,
}

impl ShardWriter {
    /// A writer of `prefix-NNNNN.bin` files in `dir` for ids below `vocab`.
    pub fn new(dir: &Path, prefix: &str, vocab: u64, shard_tokens: u64) -> Self {
        ShardWriter {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            dtype: TokenDtype::for_vocab(vocab),
            vocab,
            shard_tokens: shard_tokens.max(1),
            entries: Vec::new(),
            current: None,
        }
    }

    /// Appends tokens.
    pub fn write(&mut self, ids: &[u32]) -> std::io::Result<()> {
        use std::io::Write;
        for &id in ids {
            debug_assert!(u64::from(id) < self.vocab);
            if self.current.is_none() {
                let name = format!("{}-{:05}.bin", self.prefix, self.entries.len());
                let f = File::create(self.dir.join(&name))?;
                self.current = Some((std::io::BufWriter::new(f), blake3::Hasher::new(), 0, name));
            }
            let (w, h, n, _) = self.current.as_mut().expect("opened above");
            let bytes = id.to_le_bytes();
            let b = &bytes[..self.dtype.width() as usize];
            w.write_all(b)?;
            h.update(b);
            *n += 1;
            if *n == self.shard_tokens {
                self.finish_shard()?;
            }
        }
        Ok(())
    }

    fn finish_shard(&mut self) -> std::io::Result<()> {
        use std::io::Write;
        if let Some((mut w, h, tokens, file)) = self.current.take() {
            w.flush()?;
            w.get_ref().sync_all()?;
            self.entries.push(ShardEntry { file, tokens, blake3: h.finalize().to_hex().to_string() });
        }
        Ok(())
    }

    /// Closes the last shard and returns the entries written.
    pub fn finish(mut self) -> std::io::Result<(TokenDtype, Vec<ShardEntry>)> {
        self.finish_shard()?;
        Ok((self.dtype, self.entries))
    }
}

/// Writes a whole shard directory: `train` and `val` ids in shards of `shard_tokens`, and the
/// manifest (no tokenizer). For tests, benchmarks and data made in memory.
pub fn write_dataset(
    dir: &Path,
    train: &[u32],
    val: &[u32],
    vocab: u64,
    shard_tokens: u64,
) -> Result<Manifest, TrainerError> {
    let io = |e: std::io::Error| data_err(dir, e.to_string());
    let split = |prefix: &str, ids: &[u32]| -> Result<(TokenDtype, Vec<ShardEntry>), TrainerError> {
        let mut w = ShardWriter::new(dir, prefix, vocab, shard_tokens);
        w.write(ids).map_err(io)?;
        w.finish().map_err(io)
    };
    let (dtype, train) = split("train", train)?;
    let (_, val) = split("val", val)?;
    let m =
        Manifest { format: MANIFEST_FORMAT.into(), version: 1, dtype, vocab, tokenizer: None, train, val };
    write_manifest(dir, &m)?;
    Ok(m)
}

/// Writes `manifest` into `dir` atomically.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<PathBuf, TrainerError> {
    let path = dir.join(MANIFEST_FILE);
    limpet_snapshot::write_atomic(&path, &manifest.to_bytes())?;
    Ok(path)
}

/// blake3 of a file, reading it in 1 MiB pieces and reporting bytes hashed to `progress`.
pub fn hash_file(path: &Path, mut progress: impl FnMut(u64)) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = File::open(path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress(n as u64);
    }
    Ok(h.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests;

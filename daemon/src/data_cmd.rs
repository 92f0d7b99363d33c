//! `limpet data tokenize / index / verify` (token shards for `data = "tokens"`).
//!
//! `tokenize` lives in [`crate::tokenize_cmd`]. `index` describes `.bin` files made elsewhere (nanoGPT's
//! `prepare.py`, Megatron tools) by hashing them once and checking every id against the
//! vocabulary; `verify` hashes them again against the manifest.

use crate::UsageError;
use anyhow::Context;
use clap::{Args, Subcommand};
use indicatif::ProgressBar;
use limpet_trainer::data::tokens::{
    self, hash_file, read_manifest, Manifest, ShardEntry, TokenDtype, MANIFEST_FORMAT,
};
use std::path::{Path, PathBuf};

/// `limpet data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Documents in (text files, JSONL), token shards and their manifest out.
    Tokenize(crate::tokenize_cmd::TokenizeArgs),
    /// Write the manifest for existing .bin token files (files named val* are held out).
    Index(IndexArgs),
    /// Hash every shard again and compare with the manifest.
    Verify {
        /// The shard directory.
        dir: PathBuf,
    },
}

/// `limpet data index`.
#[derive(Debug, Args)]
pub struct IndexArgs {
    /// The directory of .bin files.
    pub dir: PathBuf,
    /// Token width of the files.
    #[arg(long, value_parser = ["uint16", "uint32"])]
    pub dtype: String,
    /// Vocabulary size (every id must be below it).
    #[arg(long)]
    pub vocab: u64,
}

/// Runs `limpet data ...`.
pub fn run(cmd: DataCommand) -> crate::Result<()> {
    match cmd {
        DataCommand::Tokenize(a) => crate::tokenize_cmd::tokenize(a),
        DataCommand::Index(a) => index(a),
        DataCommand::Verify { dir } => verify(&dir),
    }
}

/// Hashes `path` and checks its ids against `vocab`; the error names the file and offset.
fn index_file(
    path: &Path,
    dtype: TokenDtype,
    vocab: u64,
    progress: &ProgressBar,
) -> crate::Result<ShardEntry> {
    use std::io::Read;
    let len = std::fs::metadata(path)?.len();
    let w = dtype.width();
    if len % w != 0 {
        crate::fail!("{}: {len} bytes is not a whole number of {w}-byte tokens", path.display());
    }
    foreign_format(path)?;
    let mut f = std::fs::File::open(path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        // Reads of a regular file return whole multiples of 1 MiB until the end, so tokens
        // never straddle two reads.
        h.update(&buf[..n]);
        for (k, c) in buf[..n].chunks_exact(w as usize).enumerate() {
            let id = if w == 2 {
                u64::from(u16::from_le_bytes([c[0], c[1]]))
            } else {
                u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            };
            if id >= vocab {
                crate::fail!(
                    "{}: token {id} at byte offset {} is not below --vocab {vocab}",
                    path.display(),
                    offset + k as u64 * w
                );
            }
        }
        offset += n as u64;
        progress.inc(n as u64);
    }
    let file =
        path.file_name().and_then(|n| n.to_str()).context("a file name that is not UTF-8")?.to_string();
    Ok(ShardEntry { file, tokens: len / w, blake3: h.finalize().to_hex().to_string() })
}

/// llm.c's shards start with a 256-int header whose first int is this.
const LLMC_MAGIC: i32 = 20240520;
/// A Megatron indexed dataset's `.idx` starts with these bytes.
const MEGATRON_MAGIC: &[u8] = b"MMIDIDX\x00\x00";

/// Refuses `.bin` files that hold more than flat tokens, naming the format and what to do:
/// read as tokens they would train on their headers or on documents in the wrong order.
fn foreign_format(path: &Path) -> crate::Result<()> {
    use std::io::Read;
    let mut head = [0u8; 8];
    let n = std::fs::File::open(path)?.read(&mut head)?;
    if n >= 8 && i32::from_le_bytes(head[..4].try_into().expect("4 bytes")) == LLMC_MAGIC {
        let version = i32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
        crate::fail!(
            "{}: an llm.c shard (magic {LLMC_MAGIC}, version {version}): its first 1024 bytes are a header, not tokens; \
             write the tokens alone (tail -c +1025 {} > tokens.bin) and index that",
            path.display(),
            path.display()
        );
    }
    let idx = path.with_extension("idx");
    let mut magic = [0u8; 9];
    if std::fs::File::open(&idx).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == MEGATRON_MAGIC
    {
        crate::fail!(
            "{}: a Megatron indexed dataset ({} beside it holds its document index): limpet data index reads flat token files, \
             not Megatron's; export the documents' tokens in order to one flat file and index that",
            path.display(),
            idx.display()
        );
    }
    Ok(())
}

fn index(a: IndexArgs) -> crate::Result<()> {
    let dtype = if a.dtype == "uint16" { TokenDtype::Uint16 } else { TokenDtype::Uint32 };
    let max = 1u64 << (8 * dtype.width());
    if a.vocab == 0 || a.vocab > max {
        return Err(UsageError(format!("--vocab {} is not within 1..={max} for {}", a.vocab, a.dtype)).into());
    }
    let mut bins: Vec<PathBuf> = std::fs::read_dir(&a.dir)
        .with_context(|| format!("reading {}", a.dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "bin"))
        .collect();
    bins.sort();
    if bins.is_empty() {
        return Err(UsageError(format!("{} holds no .bin files", a.dir.display())).into());
    }
    let total = bins.iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let progress = crate::tokenize_cmd::bar(total, "hashing");
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for p in &bins {
        let e = index_file(p, dtype, a.vocab, &progress)?;
        if e.file.starts_with("val") {
            val.push(e)
        } else {
            train.push(e)
        }
    }
    progress.finish_and_clear();
    if train.is_empty() {
        crate::fail!("every .bin file in {} is named val*: nothing to train on", a.dir.display());
    }
    let tokenizer = a.dir.join("tokenizer.json").exists().then(|| "tokenizer.json".to_string());
    let m =
        Manifest { format: MANIFEST_FORMAT.into(), version: 1, dtype, vocab: a.vocab, tokenizer, train, val };
    let path = tokens::write_manifest(&a.dir, &m)?;
    println!(
        "limpet data index: {} train and {} held-out files; manifest {}",
        m.train.len(),
        m.val.len(),
        path.display()
    );
    Ok(())
}

fn verify(dir: &Path) -> crate::Result<()> {
    let m = read_manifest(dir)?;
    let entries: Vec<&ShardEntry> = m.train.iter().chain(&m.val).collect();
    let total = entries.iter().map(|e| e.tokens * m.dtype.width()).sum();
    let progress = crate::tokenize_cmd::bar(total, "verifying");
    let mut bad = Vec::new();
    for e in &entries {
        let path = dir.join(&e.file);
        let got =
            hash_file(&path, |n| progress.inc(n)).with_context(|| format!("reading {}", path.display()))?;
        if got != e.blake3 {
            bad.push(format!("{}: blake3 {got}, the manifest says {}", path.display(), e.blake3));
        }
    }
    progress.finish_and_clear();
    if !bad.is_empty() {
        crate::fail!(
            "{} of {} shards differ from the manifest:\n  {}",
            bad.len(),
            entries.len(),
            bad.join("\n  ")
        );
    }
    println!(
        "limpet data verify: {} shards match {}",
        entries.len(),
        dir.join(tokens::MANIFEST_FILE).display()
    );
    Ok(())
}

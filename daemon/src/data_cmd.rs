//! `limpet data tokenize / index / verify` (token shards for `data = "tokens"`) and
//! `limpet export --hf` (a LLaMA checkpoint as a Hugging Face directory).
//!
//! `tokenize` reads text files through a Hugging Face `tokenizer.json` (the `tokenizers`
//! crate), or a byte-level BPE it first trains on the same files, and writes shards with
//! their manifest; every 20th chunk of 1,024 tokens goes to the held-out split, so a single
//! file still gets one. `index` describes `.bin` files made elsewhere (nanoGPT's
//! `prepare.py`, Megatron tools) by hashing them once and checking every id against the
//! vocabulary; `verify` hashes them again against the manifest.

use crate::UsageError;
use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use limpet_trainer::data::tokens::{
    self, hash_file, read_manifest, Manifest, ShardEntry, ShardWriter, TokenDtype, MANIFEST_FORMAT,
};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Tokens per chunk when splitting the stream into train and held-out parts.
const VAL_CHUNK: usize = 1024;
/// One chunk in this many goes to the held-out split.
const VAL_EVERY: usize = 20;
/// The document separator a trained BPE reserves.
const EOS: &str = "<|endoftext|>";

/// `limpet data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Text files in, token shards and their manifest out.
    Tokenize(TokenizeArgs),
    /// Write the manifest for existing .bin token files (files named val* are held out).
    Index(IndexArgs),
    /// Hash every shard again and compare with the manifest.
    Verify {
        /// The shard directory.
        dir: PathBuf,
    },
}

/// `limpet data tokenize`.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Text files or directories (read recursively, in name order).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The shard directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// A Hugging Face tokenizer.json.
    #[arg(long, conflicts_with = "train_bpe", required_unless_present = "train_bpe")]
    pub tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this vocabulary size on the inputs first (saved as
    /// OUT/tokenizer.json).
    #[arg(long, value_name = "VOCAB")]
    pub train_bpe: Option<usize>,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 27)]
    pub shard_tokens: u64,
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

/// `limpet export`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("format").required(true).args(["hf", "torchscript"])))]
pub struct ExportArgs {
    /// Write a Hugging Face LlamaForCausalLM directory here (model llama).
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    /// Write the TorchScript module with the trained weights to this file (model
    /// torchscript; PyTorch loads it with torch.jit.load).
    #[arg(long, value_name = "FILE", requires = "module")]
    pub torchscript: Option<PathBuf>,
    /// The job's TorchScript module file (what it was trained from).
    #[arg(long, value_name = "FILE")]
    pub module: Option<PathBuf>,
    /// The checkpoint: a checkpoint.safetensors file, or the directory holding one.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// A tokenizer.json to copy beside the weights (with --hf).
    #[arg(long, requires = "hf")]
    pub tokenizer: Option<PathBuf>,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {what} {{bar:30}} {{bytes}}/{{total_bytes}} ({{bytes_per_sec}}, {{eta}})"
        ))
        .expect("valid template"),
    );
    b
}

/// Runs `limpet data ...`.
pub fn run(cmd: DataCommand) -> anyhow::Result<()> {
    match cmd {
        DataCommand::Tokenize(a) => tokenize(a),
        DataCommand::Index(a) => index(a),
        DataCommand::Verify { dir } => verify(&dir),
    }
}

/// The text files under `inputs`, in name order.
fn text_files(inputs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in inputs {
        let meta = std::fs::metadata(p).with_context(|| format!("input {}", p.display()))?;
        if meta.is_file() {
            out.push(p.clone());
        } else {
            let mut entries: Vec<PathBuf> =
                std::fs::read_dir(p)?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            entries.sort();
            out.extend(text_files(&entries.into_iter().filter(|e| !e.is_symlink()).collect::<Vec<_>>())?);
        }
    }
    Ok(out)
}

fn train_bpe(files: &[PathBuf], vocab: usize, out: &Path) -> anyhow::Result<Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, TokenizerBuilder};
    if vocab < 257 {
        return Err(
            UsageError(format!("--train-bpe {vocab}: a byte-level BPE needs at least 257 tokens")).into()
        );
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .show_progress(true)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(EOS, true)])
        .build();
    use tokenizers::{NormalizerWrapper, PostProcessorWrapper};
    let mut tk =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, PostProcessorWrapper, ByteLevel>::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(|e| anyhow::anyhow!("building a BPE tokenizer: {e}"))?;
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    tk.train_from_files(&mut trainer, names).map_err(|e| anyhow::anyhow!("training the BPE: {e}"))?;
    let path = out.join("tokenizer.json");
    tk.save(&path, false).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    let t: Tokenizer = tk.into();
    Ok(t)
}

fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    if a.shard_tokens == 0 {
        return Err(UsageError("--shard-tokens must be at least 1".into()).into());
    }
    let files = text_files(&a.inputs)?;
    if files.is_empty() {
        return Err(UsageError("no input files".into()).into());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating --out {}", a.out.display()))?;
    let tk = match (&a.tokenizer, a.train_bpe) {
        (Some(path), _) => {
            let tk = Tokenizer::from_file(path)
                .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", path.display()))?;
            std::fs::copy(path, a.out.join("tokenizer.json"))
                .context("copying the tokenizer beside the shards")?;
            tk
        }
        (None, Some(v)) => train_bpe(&files, v, &a.out)?,
        (None, None) => unreachable!("clap requires one"),
    };
    let vocab = tk.get_vocab_size(true) as u64;
    let eos = tk.token_to_id(EOS);
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    let progress = bar(total, "tokenizing");
    let mut split = Splitter {
        train: ShardWriter::new(&a.out, "train", vocab, a.shard_tokens),
        val: ShardWriter::new(&a.out, "val", vocab, a.shard_tokens),
        pending: Vec::with_capacity(VAL_CHUNK),
        chunk_no: 0,
    };
    let mut written = 0u64;
    for f in &files {
        let text = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        for piece in pieces(&String::from_utf8_lossy(&text)) {
            let enc = tk.encode(piece, false).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
            split.push(enc.get_ids())?;
            written += enc.get_ids().len() as u64;
            progress.inc(piece.len() as u64);
        }
        split.push(eos.as_slice())?;
    }
    progress.finish_and_clear();
    let (dtype, train, val) = split.finish()?;
    if train.is_empty() {
        bail!("the inputs produced {written} tokens: too few for a training split");
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: 1,
        dtype,
        vocab,
        tokenizer: Some("tokenizer.json".into()),
        train,
        val,
    };
    let path = tokens::write_manifest(&a.out, &manifest)?;
    let count = |v: &[ShardEntry]| v.iter().map(|e| e.tokens).sum::<u64>();
    println!(
        "limpet data tokenize: {} files, {} tokens ({} train, {} held out), vocab {vocab}, {:?} shards; manifest {}",
        files.len(),
        written + files.len() as u64 * u64::from(eos.is_some()),
        count(&manifest.train),
        count(&manifest.val),
        dtype,
        path.display()
    );
    Ok(())
}

/// `text` in pieces of about 1 MiB cut at line ends, so big files tokenize in flat memory.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = rest.len().min(1 << 20);
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        if cut < rest.len() {
            cut = rest[..cut].rfind('\n').map_or(cut, |i| i + 1);
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// Routes the token stream in chunks of `VAL_CHUNK` ids: every `VAL_EVERY`-th chunk to the
/// held-out split, the rest to training.
struct Splitter {
    train: ShardWriter,
    val: ShardWriter,
    pending: Vec<u32>,
    chunk_no: usize,
}

impl Splitter {
    fn push(&mut self, ids: &[u32]) -> std::io::Result<()> {
        for &id in ids {
            self.pending.push(id);
            if self.pending.len() == VAL_CHUNK {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let w = if self.chunk_no % VAL_EVERY == VAL_EVERY - 1 { &mut self.val } else { &mut self.train };
        w.write(&self.pending)?;
        self.chunk_no += 1;
        self.pending.clear();
        Ok(())
    }

    fn finish(mut self) -> std::io::Result<(TokenDtype, Vec<ShardEntry>, Vec<ShardEntry>)> {
        if !self.pending.is_empty() {
            self.flush()?;
        }
        let (dtype, train) = self.train.finish()?;
        let (_, val) = self.val.finish()?;
        Ok((dtype, train, val))
    }
}

/// Hashes `path` and checks its ids against `vocab`; the error names the file and offset.
fn index_file(
    path: &Path,
    dtype: TokenDtype,
    vocab: u64,
    progress: &ProgressBar,
) -> anyhow::Result<ShardEntry> {
    use std::io::Read;
    let len = std::fs::metadata(path)?.len();
    let w = dtype.width();
    if len % w != 0 {
        bail!("{}: {len} bytes is not a whole number of {w}-byte tokens", path.display());
    }
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
                bail!(
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

fn index(a: IndexArgs) -> anyhow::Result<()> {
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
    let progress = bar(total, "hashing");
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
        bail!("every .bin file in {} is named val*: nothing to train on", a.dir.display());
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

fn verify(dir: &Path) -> anyhow::Result<()> {
    let m = read_manifest(dir)?;
    let entries: Vec<&ShardEntry> = m.train.iter().chain(&m.val).collect();
    let total = entries.iter().map(|e| e.tokens * m.dtype.width()).sum();
    let progress = bar(total, "verifying");
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
        bail!("{} of {} shards differ from the manifest:\n  {}", bad.len(), entries.len(), bad.join("\n  "));
    }
    println!(
        "limpet data verify: {} shards match {}",
        entries.len(),
        dir.join(tokens::MANIFEST_FILE).display()
    );
    Ok(())
}

/// Runs `limpet export`.
pub fn export(a: ExportArgs) -> anyhow::Result<()> {
    let file = if a.checkpoint.is_dir() {
        a.checkpoint.join(limpet_trainer::CHECKPOINT_FILE)
    } else {
        a.checkpoint.clone()
    };
    let image = limpet_snapshot::read_file(&file)
        .map_err(limpet_trainer::TrainerError::from)
        .with_context(|| format!("checkpoint {}", file.display()))?;
    if let (Some(out), Some(module)) = (&a.torchscript, &a.module) {
        let job: limpet_trainer::JobSpec = serde_json::from_value(image.meta().job.clone())
            .with_context(|| format!("the job in {}", file.display()))?;
        let limpet_trainer::model::ModelSpec::Torchscript(spec) = &job.model else {
            return Err(UsageError(format!(
                "--torchscript: {} holds a {} model, not a TorchScript module",
                file.display(),
                serde_json::to_value(&job.model)?["kind"].as_str().unwrap_or("?")
            ))
            .into());
        };
        limpet_trainer::model::script::register_as(module, spec)
            .map_err(|e| UsageError(format!("--module: {e}")))?;
        limpet_trainer::model::script::export(spec, &image, out)?;
        println!(
            "limpet export: step {} of {} written to {} (TorchScript)",
            image.meta().step,
            file.display(),
            out.display()
        );
        return Ok(());
    }
    let hf = a.hf.as_ref().expect("clap requires --hf or --torchscript");
    limpet_trainer::hf::export(&image, hf)?;
    if let Some(t) = &a.tokenizer {
        std::fs::copy(t, hf.join("tokenizer.json")).with_context(|| format!("copying {}", t.display()))?;
    }
    println!(
        "limpet export: step {} of {} written to {} (config.json, model.safetensors)",
        image.meta().step,
        file.display(),
        hf.display()
    );
    Ok(())
}

//! `limpet data tokenize`: documents in, token shards and their manifest out.
//!
//! Documents are the unit: one per text file (or per blank-line block with `--documents
//! blank-lines`), one per JSONL record or Parquet row (`--field`, default `text`: the record's
//! field or the Parquet column; Parquet is read a row group at a time). Each document gets the
//! beginning and end tokens its tokenizer says a sequence gets: the post-processor's own
//! template (Llama 3's `<|begin_of_text|>`), else `tokenizer_config.json`'s `add_bos_token` /
//! `bos_token` and `eos_token`, else a trained BPE's `<|endoftext|>`; `--bos`, `--eos` and
//! `--separator` override. Files are read streaming, in pieces of about 1 MiB cut at line
//! ends, and pieces are encoded in parallel with the tokenizers crate's batch API; the output
//! is the same whatever the core count. Every 20th chunk of 1,024 tokens goes to the held-out
//! split, so a single file still gets one.

use crate::UsageError;
use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use limpet_trainer::data::tokens::{self, Manifest, ShardEntry, ShardWriter, TokenDtype, MANIFEST_FORMAT};
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Tokens per chunk when splitting the stream into train and held-out parts.
const VAL_CHUNK: usize = 1024;
/// One chunk in this many goes to the held-out split.
const VAL_EVERY: usize = 20;
/// The document separator a trained BPE reserves.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Text encoded per piece, about.
const PIECE_BYTES: usize = 1 << 20;
/// Text encoded per batch (the pieces of one batch run in parallel).
const BATCH_BYTES: usize = 16 << 20;

/// What a document is in a text file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Documents {
    /// The whole file.
    File,
    /// Each block of lines between blank lines.
    BlankLines,
}

/// `limpet data tokenize`.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Text files, .jsonl or .parquet files, or directories of them (read recursively, in
    /// name order).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The shard directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// A Hugging Face tokenizer.json (its tokenizer_config.json is read from beside it).
    #[arg(long, conflicts_with = "train_bpe", required_unless_present = "train_bpe")]
    pub tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE of this vocabulary size on the inputs first (saved as
    /// OUT/tokenizer.json).
    #[arg(long, value_name = "VOCAB")]
    pub train_bpe: Option<usize>,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 1 << 27)]
    pub shard_tokens: u64,
    /// What a document is in a text file.
    #[arg(long, value_enum, default_value_t = Documents::File)]
    pub documents: Documents,
    /// The field holding a JSONL record's text, or the Parquet column.
    #[arg(long, default_value = "text")]
    pub field: String,
    /// The token that begins each document, or `none` [default: the tokenizer's].
    #[arg(long)]
    pub bos: Option<String>,
    /// The token that ends each document, or `none` [default: the tokenizer's].
    #[arg(long)]
    pub eos: Option<String>,
    /// A token placed between documents, after the end token [default: none].
    #[arg(long)]
    pub separator: Option<String>,
}

/// A progress bar over `len` bytes.
pub(crate) fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {what} {{bar:30}} {{bytes}}/{{total_bytes}} ({{bytes_per_sec}}, {{eta}})"
        ))
        .expect("valid template"),
    );
    b
}

/// The largest vocabulary `--train-bpe` trains (token ids are stored as uint32 either way).
const MAX_BPE_VOCAB: usize = 1 << 20;

/// The input files under `inputs`, in name order, leaving out the shard directory `skip`
/// (`--out`): run again over the same directory, the shards, tokenizer and manifest written
/// last time are not documents.
fn input_files(inputs: &[PathBuf], skip: &Path) -> crate::Result<Vec<PathBuf>> {
    let skip = skip.canonicalize().ok();
    let mut out = Vec::new();
    for p in inputs {
        let meta = std::fs::metadata(p).with_context(|| format!("input {}", p.display()))?;
        if meta.is_file() {
            out.push(p.clone());
        } else if skip.is_none() || p.canonicalize().ok() != skip {
            let mut entries: Vec<PathBuf> =
                std::fs::read_dir(p)?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            entries.sort();
            let entries: Vec<PathBuf> = entries.into_iter().filter(|e| !e.is_symlink()).collect();
            out.extend(input_files(&entries, skip.as_deref().unwrap_or(Path::new("")))?);
        }
    }
    Ok(out)
}

/// Trains a byte-level BPE of `vocab` tokens on the documents of `files` (read as tokenizing
/// reads them: a JSONL record's field, a Parquet column, not the file's raw bytes), streaming
/// them to the trainer through a bounded channel; saves it as `out/tokenizer.json`.
fn train_bpe(files: &[PathBuf], a: &TokenizeArgs, vocab: usize, out: &Path) -> crate::Result<Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder};
    if vocab < 257 {
        return Err(
            UsageError(format!("--train-bpe {vocab}: a byte-level BPE needs at least 257 tokens")).into()
        );
    }
    // The trainer allocates by the vocabulary; LLM vocabularies are a few hundred thousand.
    if vocab > MAX_BPE_VOCAB {
        return Err(UsageError(format!("--train-bpe {vocab}: at most {MAX_BPE_VOCAB} tokens")).into());
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(ENDOFTEXT, true)])
        .build();
    let mut tk =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, PostProcessorWrapper, ByteLevel>::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(|e| anyhow::anyhow!("building a BPE tokenizer: {e}"))?;
    let total = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    let progress = bar(total, "training BPE");
    let (tx, rx) = std::sync::mpsc::sync_channel::<String>(16);
    let trained = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let tx = tx;
            for f in files {
                read_pieces(f, a, &progress, &mut |p| {
                    // The trainer hung up: it failed, and says why below.
                    tx.send(p.text).map_err(|_| crate::Failure::msg("the BPE trainer stopped"))
                })?;
            }
            Ok::<_, crate::Failure>(())
        });
        let trained = tk
            .train(&mut trainer, rx.into_iter())
            .map(|_| ())
            .map_err(|e| crate::Failure::msg(format!("training the BPE: {e}")));
        let read = reader.join().unwrap_or_else(|_| Err(crate::Failure::msg("the BPE's reader panicked")));
        read.and(trained)
    });
    progress.finish_and_clear();
    trained?;
    let path = out.join("tokenizer.json");
    tk.save(&path, false).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(tk.into())
}

/// The tokens around every document.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Framing {
    /// Before each document.
    pub begin: Vec<u32>,
    /// After each document.
    pub end: Vec<u32>,
    /// Between documents (after `end`).
    pub separator: Vec<u32>,
}

/// The framing `tk` (with `config`, its `tokenizer_config.json` if any) gives a document, with
/// the overrides (`none` for no token). Errors name the flag or key whose token is unknown.
pub fn framing(
    tk: &Tokenizer,
    config: Option<&Value>,
    bos: Option<&str>,
    eos: Option<&str>,
    separator: Option<&str>,
) -> crate::Result<Framing> {
    let id = |what: &str, text: &str| -> crate::Result<u32> {
        tk.token_to_id(text)
            .ok_or_else(|| UsageError(format!("{what}: {text:?} is not a token of the tokenizer")).into())
    };
    let pick = |flag: &str, over: Option<&str>, default: Vec<u32>| -> crate::Result<Vec<u32>> {
        match over {
            Some("none") => Ok(Vec::new()),
            Some(t) => Ok(vec![id(flag, t)?]),
            None => Ok(default),
        }
    };
    // What the post-processor puts around a sequence: encode a probe with and without it.
    let probe = "limpet";
    let plain = tk.encode(probe, false).map_err(|e| anyhow::anyhow!("the tokenizer: {e}"))?;
    let full = tk.encode(probe, true).map_err(|e| anyhow::anyhow!("the tokenizer: {e}"))?;
    let (plain, full) = (plain.get_ids(), full.get_ids());
    let (mut begin, mut end) = match full.windows(plain.len().max(1)).position(|w| w == plain) {
        Some(at) if !plain.is_empty() => (full[..at].to_vec(), full[at + plain.len()..].to_vec()),
        _ => (Vec::new(), Vec::new()),
    };
    let flag = |key: &str| config.and_then(|c| c.get(key)).and_then(Value::as_bool);
    let text = |key: &str| limpet_trainer::hf::special_token_text(config.and_then(|c| c.get(key)));
    if begin.is_empty() && flag("add_bos_token") == Some(true) {
        if let Some(t) = text("bos_token") {
            begin = vec![id("tokenizer_config.json bos_token", &t)?];
        }
    }
    if end.is_empty() {
        // A document ends with the tokenizer's end token (what packs documents apart).
        let eos_text = text("eos_token").or_else(|| tk.token_to_id(ENDOFTEXT).map(|_| ENDOFTEXT.to_string()));
        if let Some(t) = eos_text {
            end = vec![id("tokenizer_config.json eos_token", &t)?];
        }
    }
    Ok(Framing {
        begin: pick("--bos", bos, begin)?,
        end: pick("--eos", eos, end)?,
        separator: pick("--separator", separator, Vec::new())?,
    })
}

/// A piece of text and whether a document ends with it.
struct Piece {
    text: String,
    ends_document: bool,
}

/// Reads the pieces of one input file, streaming, into `sink`; `progress` gets bytes read.
fn read_pieces(
    path: &Path,
    a: &TokenizeArgs,
    progress: &ProgressBar,
    sink: &mut dyn FnMut(Piece) -> crate::Result<()>,
) -> crate::Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    if path.extension().is_some_and(|e| e == "parquet") {
        return read_parquet(file, path, &a.field, progress, sink);
    }
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut line = Vec::new();
    let mut current = String::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        progress.inc(n as u64);
        if jsonl {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let record: Value = serde_json::from_slice(&line)
                .map_err(|e| UsageError(format!("{}:{line_no}: not a JSON record: {e}", path.display())))?;
            let text = record.get(&a.field).and_then(Value::as_str).ok_or_else(|| {
                UsageError(format!("{}:{line_no}: no string field {:?} (--field)", path.display(), a.field))
            })?;
            sink(Piece { text: text.to_string(), ends_document: true })?;
            continue;
        }
        let text = String::from_utf8_lossy(&line);
        if a.documents == Documents::BlankLines && text.trim().is_empty() {
            if !current.is_empty() {
                sink(Piece { text: std::mem::take(&mut current), ends_document: true })?;
            }
            continue;
        }
        current.push_str(&text);
        if current.len() >= PIECE_BYTES {
            sink(Piece { text: std::mem::take(&mut current), ends_document: false })?;
        }
    }
    if !jsonl && !current.is_empty() {
        sink(Piece { text: current, ends_document: true })?;
    }
    Ok(())
}

/// Reads column `field` of a Parquet file, one document per row, a row group at a time (so a
/// file is never wholly in memory); `progress` gets each group's compressed bytes.
fn read_parquet(
    file: std::fs::File,
    path: &Path,
    field: &str,
    progress: &ProgressBar,
    sink: &mut dyn FnMut(Piece) -> crate::Result<()>,
) -> crate::Result<()> {
    use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    use parquet::schema::types::Type;
    let bad = |what: String| UsageError(format!("{}: {what}", path.display()));
    let reader = SerializedFileReader::new(file).map_err(|e| bad(format!("not a Parquet file: {e}")))?;
    let meta = reader.metadata();
    let columns = meta.file_metadata().schema_descr().root_schema().get_fields();
    let Some(column) = columns.iter().find(|c| c.name() == field) else {
        let names: Vec<&str> = columns.iter().map(|c| c.name()).collect();
        return Err(bad(format!("no column {field:?} (--field); its columns are {names:?}")).into());
    };
    let info = column.get_basic_info();
    let is_string = column.is_primitive()
        && column.get_physical_type() == Physical::BYTE_ARRAY
        && (matches!(info.logical_type_ref(), Some(LogicalType::String))
            || info.converted_type() == ConvertedType::UTF8);
    if !is_string {
        return Err(bad(format!("column {field:?} does not hold strings ({column:?})")).into());
    }
    let projection = Type::group_type_builder("schema")
        .with_fields(vec![column.clone()])
        .build()
        .map_err(|e| bad(format!("projecting column {field:?}: {e}")))?;
    let mut row_no = 0u64;
    for g in 0..meta.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| bad(format!("row group {g}: {e}")))?;
        let rows =
            group.get_row_iter(Some(projection.clone())).map_err(|e| bad(format!("row group {g}: {e}")))?;
        for row in rows {
            row_no += 1;
            let row = row.map_err(|e| bad(format!("row {row_no}: {e}")))?;
            match row.get_column_iter().next().map(|(_, f)| f) {
                Some(Field::Str(text)) => sink(Piece { text: text.clone(), ends_document: true })?,
                Some(Field::Null) => {
                    return Err(bad(format!("row {row_no}: column {field:?} is null")).into());
                }
                other => return Err(bad(format!("row {row_no}: column {field:?} holds {other:?}")).into()),
            }
        }
        progress.inc(meta.row_group(g).compressed_size().max(0) as u64);
    }
    Ok(())
}

/// Encodes pieces a batch at a time and writes the framed ids.
struct Encoder<'a> {
    tk: &'a Tokenizer,
    framing: Framing,
    batch: Vec<Piece>,
    batch_bytes: usize,
    at_document_start: bool,
    documents: u64,
    split: Splitter,
}

impl Encoder<'_> {
    fn push(&mut self, p: Piece) -> crate::Result<()> {
        self.batch_bytes += p.text.len();
        self.batch.push(p);
        if self.batch_bytes >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> crate::Result<()> {
        let pieces = std::mem::take(&mut self.batch);
        self.batch_bytes = 0;
        let texts: Vec<&str> = pieces.iter().map(|p| p.text.as_str()).collect();
        let encodings = self.tk.encode_batch(texts, false).map_err(|e| anyhow::anyhow!("encoding: {e}"))?;
        for (p, enc) in pieces.iter().zip(encodings) {
            if self.at_document_start {
                self.split.push(&self.framing.begin)?;
            }
            self.split.push(enc.get_ids())?;
            self.at_document_start = p.ends_document;
            if p.ends_document {
                self.split.push(&self.framing.end)?;
                self.split.push(&self.framing.separator)?;
                self.documents += 1;
            }
        }
        Ok(())
    }
}

/// Runs `limpet data tokenize`.
pub fn tokenize(a: TokenizeArgs) -> crate::Result<()> {
    if a.shard_tokens == 0 {
        return Err(UsageError("--shard-tokens must be at least 1".into()).into());
    }
    let files = input_files(&a.inputs, &a.out)?;
    if files.is_empty() {
        return Err(UsageError("no input files".into()).into());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating --out {}", a.out.display()))?;
    let (tk, config) = match (&a.tokenizer, a.train_bpe) {
        (Some(path), _) => {
            let tk = Tokenizer::from_file(path)
                .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", path.display()))?;
            std::fs::copy(path, a.out.join("tokenizer.json"))
                .context("copying the tokenizer beside the shards")?;
            let cfg_path = path.with_file_name("tokenizer_config.json");
            let config = match std::fs::read(&cfg_path) {
                Ok(bytes) => {
                    let v: Value = serde_json::from_slice(&bytes)
                        .map_err(|e| UsageError(format!("{}: not JSON: {e}", cfg_path.display())))?;
                    std::fs::copy(&cfg_path, a.out.join("tokenizer_config.json"))
                        .context("copying tokenizer_config.json beside the shards")?;
                    Some(v)
                }
                Err(_) => None,
            };
            (tk, config)
        }
        (None, Some(v)) => (train_bpe(&files, &a, v, &a.out)?, None),
        (None, None) => unreachable!("clap requires one"),
    };
    let framing = framing(&tk, config.as_ref(), a.bos.as_deref(), a.eos.as_deref(), a.separator.as_deref())?;
    let vocab = tk.get_vocab_size(true) as u64;
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    let progress = bar(total, "tokenizing");
    let mut enc = Encoder {
        tk: &tk,
        framing: framing.clone(),
        batch: Vec::new(),
        batch_bytes: 0,
        at_document_start: true,
        documents: 0,
        split: Splitter {
            train: ShardWriter::new(&a.out, "train", vocab, a.shard_tokens),
            val: ShardWriter::new(&a.out, "val", vocab, a.shard_tokens),
            pending: Vec::with_capacity(VAL_CHUNK),
            chunk_no: 0,
            written: 0,
        },
    };
    for f in &files {
        read_pieces(f, &a, &progress, &mut |p| enc.push(p))?;
    }
    enc.flush()?;
    progress.finish_and_clear();
    let (documents, written) = (enc.documents, enc.split.written);
    let (dtype, train, val) = enc.split.finish()?;
    if train.is_empty() {
        crate::fail!("the inputs produced {written} tokens: too few for a training split");
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
    let name = |ids: &[u32]| match ids {
        [] => "none".to_string(),
        ids => ids
            .iter()
            .map(|&i| tk.id_to_token(i).unwrap_or_else(|| i.to_string()))
            .collect::<Vec<_>>()
            .join(" "),
    };
    println!(
        "limpet data tokenize: {} files, {documents} documents (begin {}, end {}), {written} tokens ({} train, {} held out), vocab {vocab}, {:?} shards; manifest {}",
        files.len(),
        name(&framing.begin),
        name(&framing.end),
        count(&manifest.train),
        count(&manifest.val),
        dtype,
        path.display()
    );
    Ok(())
}

/// Routes the token stream in chunks of `VAL_CHUNK` ids: every `VAL_EVERY`-th chunk to the
/// held-out split, the rest to training.
struct Splitter {
    train: ShardWriter,
    val: ShardWriter,
    pending: Vec<u32>,
    chunk_no: usize,
    written: u64,
}

impl Splitter {
    fn push(&mut self, ids: &[u32]) -> std::io::Result<()> {
        self.written += ids.len() as u64;
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

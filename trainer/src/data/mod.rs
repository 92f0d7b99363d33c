//! Datasets: token shards on disk ([`tokens`], read a window at a time, never whole),
//! scikit-learn's handwritten digits (fetched once by the project's setup), a byte-level
//! character corpus from any text file or directory, and a seeded synthetic classification set
//! for benchmarks. Every dataset is split into train and test the same way on every host, and
//! carries a fingerprint of its source bytes (for token shards: of their manifest).

pub mod tensors;
pub mod tokens;

use crate::TrainerError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Seed of the train/test split: fixed, so every host and every run splits identically.
const SPLIT_SEED: u64 = 0x5eed_da7a;
/// Directory of text present on Debian and Ubuntu machines, the default character corpus.
pub const DEFAULT_CORPUS: &str = "/usr/share/common-licenses";

/// Which dataset a job trains on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSpec {
    /// 1,797 8x8 handwritten digits, 10 classes (scikit-learn's `digits.csv.gz`).
    Digits,
    /// Next-byte prediction over windows of `context` bytes of a text corpus.
    Chars {
        /// Window length in bytes.
        context: usize,
    },
    /// Windows of `context` + 1 tokens from a directory of token shards ([`tokens`]).
    Tokens {
        /// Window length in tokens (the model sees `context`, predicts the next of each).
        context: usize,
    },
    /// Rows of `x` and `y` arrays in `.npy` or safetensors files ([`tensors`]).
    Tensors,
    /// Gaussian features labelled by a random linear teacher.
    Synthetic {
        /// Number of samples (train and test together).
        samples: usize,
        /// Features per sample.
        features: usize,
        /// Number of classes.
        classes: usize,
        /// Generator seed.
        seed: u64,
    },
}

/// The shape of a dataset's inputs and targets, which sizes the model.
#[derive(Clone, Debug, PartialEq)]
pub enum DataInfo {
    /// Flat float features and a class label per sample.
    Classify {
        /// Features per sample.
        features: usize,
        /// Number of classes.
        classes: usize,
        /// (height, width) when the features are a one-channel image.
        image: Option<(usize, usize)>,
    },
    /// Float features and float targets per sample.
    Regress {
        /// Features per sample.
        features: usize,
        /// Target values per sample.
        outputs: usize,
    },
    /// Token sequences; targets are the inputs shifted by one.
    Tokens {
        /// Vocabulary size (every id is below it).
        vocab: usize,
        /// Window length.
        context: usize,
    },
}

/// Where a training sample comes from, in terms of the dataset's own files.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum Source {
    /// Row of the array files (or index into an in-memory dataset).
    Index(u64),
    /// A window of `context + 1` tokens starting at token `token` of shard `file`.
    Window {
        /// The shard's file name.
        file: String,
        /// Index of the window's first token in that file.
        token: u64,
    },
}

/// Inputs and targets of one split, indexed by sample: in memory, or windows of token shards
/// read when asked for.
#[derive(Debug)]
pub enum Split {
    /// Tensors with samples along dimension 0.
    Memory {
        /// Inputs.
        x: Tensor,
        /// Targets.
        y: Tensor,
    },
    /// Windows of token shards on disk.
    Windows(tokens::Windows),
    /// Rows of tensor files on disk.
    Rows(tensors::Rows),
}

impl Split {
    fn memory(x: Tensor, y: Tensor) -> Self {
        Split::Memory { x, y }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            Split::Memory { x, .. } => x.size()[0] as usize,
            Split::Windows(w) => w.len(),
            Split::Rows(r) => r.len(),
        }
    }

    /// True when the split holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of one input row of an array dataset (none for in-memory and token data).
    pub fn row_shape(&self) -> Option<&[usize]> {
        match self {
            Split::Rows(r) => Some(r.row_shape()),
            Split::Memory { .. } | Split::Windows(_) => None,
        }
    }

    /// Where sample `index` comes from in the source files: the row of an array dataset,
    /// the first token's position in the shards' concatenation, or the index itself for
    /// in-memory data. What `limpet train --print-order` shows, so another framework can
    /// read the very same samples.
    pub fn source_of(&self, index: u64) -> Source {
        match self {
            Split::Memory { .. } => Source::Index(index),
            Split::Windows(w) => {
                let (file, token) = w.source_of(index);
                Source::Window { file, token }
            }
            Split::Rows(r) => Source::Index(r.source_of(index)),
        }
    }

    /// The samples at `indices`, as (inputs, targets) on the CPU.
    pub fn batch(&self, indices: &[i64]) -> Result<(Tensor, Tensor), TrainerError> {
        match self {
            Split::Memory { x, y } => {
                let idx = Tensor::from_slice(indices);
                Ok((x.index_select(0, &idx), y.index_select(0, &idx)))
            }
            Split::Windows(w) => window_tensors(w, indices.iter().map(|&i| i as u64)),
            Split::Rows(r) => row_tensors(r, indices.iter().map(|&i| i as u64)),
        }
    }

    /// Samples `start..start+len` in order (for evaluation).
    pub fn range(&self, start: usize, len: usize) -> Result<(Tensor, Tensor), TrainerError> {
        match self {
            Split::Memory { x, y } => {
                Ok((x.narrow(0, start as i64, len as i64), y.narrow(0, start as i64, len as i64)))
            }
            Split::Windows(w) => window_tensors(w, start as u64..(start + len) as u64),
            Split::Rows(r) => row_tensors(r, start as u64..(start + len) as u64),
        }
    }

    fn shallow_clone(&self) -> Split {
        match self {
            Split::Memory { x, y } => Split::Memory { x: x.shallow_clone(), y: y.shallow_clone() },
            Split::Windows(w) => Split::Windows(w.clone()),
            Split::Rows(r) => Split::Rows(r.clone()),
        }
    }
}

fn row_tensors(r: &tensors::Rows, ids: impl Iterator<Item = u64>) -> Result<(Tensor, Tensor), TrainerError> {
    let b = r.read(ids)?;
    let x = Tensor::from_slice(&b.x).view([b.n as i64, -1]);
    let y = if r.is_regression() {
        Tensor::from_slice(&b.values).view([b.n as i64, r.target_width() as i64])
    } else {
        Tensor::from_slice(&b.labels)
    };
    Ok((x, y))
}

fn window_tensors(
    w: &tokens::Windows,
    ids: impl Iterator<Item = u64>,
) -> Result<(Tensor, Tensor), TrainerError> {
    let (x, y, n) = w.read(ids)?;
    let shape = [n as i64, (x.len() / n.max(1)) as i64];
    Ok((Tensor::from_slice(&x).view(shape), Tensor::from_slice(&y).view(shape)))
}

/// A loaded dataset.
#[derive(Debug)]
pub struct Dataset {
    /// What was asked for.
    pub spec: DataSpec,
    /// Input and target shapes.
    pub info: DataInfo,
    /// blake3 hex of the source bytes (or of the spec, for synthetic data).
    pub fingerprint: String,
    /// Where the data came from, for messages.
    pub source: String,
    /// Training samples.
    pub train: Split,
    /// Held-out samples.
    pub test: Split,
    /// For character data: token id to byte.
    pub vocab: Vec<u8>,
}

/// Where setup puts the digits file: `$LIMPET_DIGITS`, else the limpet cache directory.
pub fn default_digits_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LIMPET_DIGITS") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("limpet").join("data").join("digits.csv.gz")
}

impl Dataset {
    /// Another handle on the same samples (the tensors are shared, not copied).
    pub fn shallow_clone(&self) -> Dataset {
        Dataset {
            spec: self.spec.clone(),
            info: self.info.clone(),
            fingerprint: self.fingerprint.clone(),
            source: self.source.clone(),
            train: self.train.shallow_clone(),
            test: self.test.shallow_clone(),
            vocab: self.vocab.clone(),
        }
    }

    /// Loads `spec`, reading from `path` when given, else from the dataset's default place.
    pub fn load(spec: &DataSpec, path: Option<&Path>) -> Result<Self, TrainerError> {
        match spec {
            DataSpec::Digits => {
                let path = path.map(Path::to_path_buf).unwrap_or_else(default_digits_path);
                load_digits(&path)
            }
            DataSpec::Chars { context } => {
                let path = path.unwrap_or(Path::new(DEFAULT_CORPUS));
                load_chars(path, *context)
            }
            DataSpec::Tokens { context } => {
                let dir = path.ok_or_else(|| {
                    TrainerError::Config("data 'tokens' needs the shard directory (data_path)".into())
                })?;
                load_tokens(dir, *context)
            }
            DataSpec::Tensors => {
                let p = path.ok_or_else(|| {
                    TrainerError::Config(
                        "data 'tensors' needs data_path: a directory with x.npy and y.npy, or a safetensors file".into(),
                    )
                })?;
                load_tensors(p)
            }
            DataSpec::Synthetic { .. } => synthetic(spec),
        }
    }
}

fn data_err(path: &Path, detail: impl Into<String>) -> TrainerError {
    TrainerError::Data { path: path.to_path_buf(), detail: detail.into() }
}

/// A seeded permutation of `0..n` (Fisher-Yates over ChaCha8, portable across platforms).
pub(crate) fn permutation(n: usize, seed: u64, stream: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        p.swap(i, j);
    }
    p
}

/// Splits feature rows and labels into train (first 80% of a fixed permutation) and test.
fn split_classify(features: Vec<f32>, labels: Vec<i64>, width: usize) -> (Split, Split) {
    let n = labels.len();
    let perm = permutation(n, SPLIT_SEED, 0);
    let n_test = n / 5;
    let take = |ids: &[u32]| {
        let x: Vec<f32> = ids
            .iter()
            .flat_map(|&i| features[i as usize * width..(i as usize + 1) * width].iter().copied())
            .collect();
        let y: Vec<i64> = ids.iter().map(|&i| labels[i as usize]).collect();
        Split::memory(Tensor::from_slice(&x).view([ids.len() as i64, width as i64]), Tensor::from_slice(&y))
    };
    (take(&perm[..n - n_test]), take(&perm[n - n_test..]))
}

fn load_digits(path: &Path) -> Result<Dataset, TrainerError> {
    let raw = std::fs::read(path)
        .map_err(|e| data_err(path, format!("{e} (run `make setup`, or name the file with --data-path)")))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(&raw[..])
        .read_to_string(&mut text)
        .map_err(|e| data_err(path, format!("not a gzip-compressed CSV: {e}")))?;
    let (mut features, mut labels) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != 65 {
            return Err(data_err(
                path,
                format!("line {}: expected 65 values, found {}", i + 1, fields.len()),
            ));
        }
        for (col, f) in fields.iter().enumerate() {
            let v: f32 = f.trim().parse().map_err(|_| {
                data_err(path, format!("line {}, column {}: '{f}' is not a number", i + 1, col + 1))
            })?;
            let limit = if col == 64 { 9.0 } else { 16.0 };
            if !(0.0..=limit).contains(&v) || v.fract() != 0.0 {
                return Err(data_err(
                    path,
                    format!("line {}, column {}: {v} is outside 0..={limit}", i + 1, col + 1),
                ));
            }
            if col == 64 {
                labels.push(v as i64);
            } else {
                features.push(v / 16.0);
            }
        }
    }
    if labels.len() < 10 {
        return Err(data_err(path, format!("only {} samples", labels.len())));
    }
    let (train, test) = split_classify(features, labels, 64);
    Ok(Dataset {
        spec: DataSpec::Digits,
        info: DataInfo::Classify { features: 64, classes: 10, image: Some((8, 8)) },
        fingerprint: blake3::hash(text.as_bytes()).to_hex().to_string(),
        source: path.display().to_string(),
        train,
        test,
        vocab: Vec::new(),
    })
}

/// Reads a text file, or every regular file of a directory in name order (links are skipped so
/// that a licence reachable under two names is read once).
fn read_corpus(path: &Path) -> Result<Vec<u8>, TrainerError> {
    let meta = std::fs::metadata(path).map_err(|e| data_err(path, e.to_string()))?;
    if meta.is_file() {
        return std::fs::read(path).map_err(|e| data_err(path, e.to_string()));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| data_err(path, e.to_string()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.path())
        .collect();
    files.sort();
    let mut text = Vec::new();
    for f in files {
        text.extend(std::fs::read(&f).map_err(|e| data_err(&f, e.to_string()))?);
        text.push(b'\n');
    }
    Ok(text)
}

fn load_chars(path: &Path, context: usize) -> Result<Dataset, TrainerError> {
    if context == 0 {
        return Err(TrainerError::Config("chars context must be at least 1".into()));
    }
    let text = read_corpus(path)?;
    let mut vocab: Vec<u8> = text.clone();
    vocab.sort_unstable();
    vocab.dedup();
    let mut id = [0i64; 256];
    for (i, b) in vocab.iter().enumerate() {
        id[*b as usize] = i as i64;
    }
    let tokens: Vec<i64> = text.iter().map(|b| id[*b as usize]).collect();
    // The last tenth of the text is held out; windows never straddle the cut.
    let cut = tokens.len() - tokens.len() / 10;
    let windows = |t: &[i64]| -> Result<Split, TrainerError> {
        let n = t.len().saturating_sub(1) / context;
        if n == 0 {
            return Err(data_err(path, format!("{} bytes is too short for context {context}", text.len())));
        }
        let (mut x, mut y) = (Vec::with_capacity(n * context), Vec::with_capacity(n * context));
        for w in 0..n {
            x.extend_from_slice(&t[w * context..(w + 1) * context]);
            y.extend_from_slice(&t[w * context + 1..(w + 1) * context + 1]);
        }
        let shape = [n as i64, context as i64];
        Ok(Split::memory(Tensor::from_slice(&x).view(shape), Tensor::from_slice(&y).view(shape)))
    };
    Ok(Dataset {
        spec: DataSpec::Chars { context },
        info: DataInfo::Tokens { vocab: vocab.len(), context },
        fingerprint: blake3::hash(&text).to_hex().to_string(),
        source: path.display().to_string(),
        train: windows(&tokens[..cut])?,
        test: windows(&tokens[cut..])?,
        vocab,
    })
}

fn load_tensors(path: &Path) -> Result<Dataset, TrainerError> {
    let t = tensors::open(path)?;
    let info = if t.regression {
        DataInfo::Regress { features: t.features, outputs: t.outputs }
    } else {
        DataInfo::Classify { features: t.features, classes: t.outputs, image: t.image }
    };
    Ok(Dataset {
        spec: DataSpec::Tensors,
        info,
        fingerprint: t.fingerprint,
        source: path.display().to_string(),
        train: Split::Rows(t.train),
        test: Split::Rows(t.test),
        vocab: Vec::new(),
    })
}

fn load_tokens(dir: &Path, context: usize) -> Result<Dataset, TrainerError> {
    let shards = tokens::open(dir, context)?;
    Ok(Dataset {
        spec: DataSpec::Tokens { context },
        info: DataInfo::Tokens { vocab: shards.manifest.vocab as usize, context },
        fingerprint: shards.manifest.fingerprint(),
        source: dir.display().to_string(),
        train: Split::Windows(shards.train),
        test: Split::Windows(shards.test),
        vocab: Vec::new(),
    })
}

fn synthetic(spec: &DataSpec) -> Result<Dataset, TrainerError> {
    let DataSpec::Synthetic { samples, features, classes, seed } = *spec else {
        unreachable!("called with a synthetic spec")
    };
    if samples < 10 || features == 0 || classes < 2 {
        return Err(TrainerError::Config(format!(
            "synthetic data needs samples >= 10, features >= 1, classes >= 2 (got {samples}, {features}, {classes})"
        )));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut normal =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.sample(rand_distr::StandardNormal)).collect() };
    let teacher = Tensor::from_slice(&normal(features * classes)).view([features as i64, classes as i64]);
    let x = normal(samples * features);
    let logits = Tensor::from_slice(&x).view([samples as i64, features as i64]).matmul(&teacher);
    let labels: Vec<i64> = Vec::try_from(logits.argmax(-1, false).to_kind(Kind::Int64))?;
    let (train, test) = split_classify(x, labels, features);
    Ok(Dataset {
        spec: spec.clone(),
        info: DataInfo::Classify { features, classes, image: None },
        fingerprint: blake3::hash(serde_json::to_string(spec).unwrap_or_default().as_bytes())
            .to_hex()
            .to_string(),
        source: format!("synthetic(seed {seed})"),
        train,
        test,
        vocab: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gz(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(text.as_bytes()).unwrap();
        f.write_all(&enc.finish().unwrap()).unwrap();
        f
    }

    #[test]
    fn digits_load_and_split_deterministically() {
        let a = Dataset::load(&DataSpec::Digits, None).expect("digits installed by setup");
        let b = Dataset::load(&DataSpec::Digits, None).unwrap();
        assert_eq!((a.train.len(), a.test.len()), (1438, 359));
        assert_eq!(a.fingerprint, b.fingerprint);
        let (xa, ya) = a.test.range(0, 359).unwrap();
        let (xb, yb) = b.test.range(0, 359).unwrap();
        assert!(xa.equal(&xb) && ya.equal(&yb));
    }

    #[test]
    fn malformed_digits_name_line_and_column() {
        let f = gz(&format!("{}\n{}x\n", ["0"; 65].join(","), ["1"; 65].join(",")));
        let err = Dataset::load(&DataSpec::Digits, Some(f.path())).unwrap_err().to_string();
        assert!(err.contains("line 2, column 65: '1x' is not a number"), "{err}");
        let f = gz("1,2,3\n");
        let err = Dataset::load(&DataSpec::Digits, Some(f.path())).unwrap_err().to_string();
        assert!(err.contains("line 1: expected 65 values, found 3"), "{err}");
        let f = tempfile::NamedTempFile::new().unwrap();
        let err = Dataset::load(&DataSpec::Digits, Some(f.path())).unwrap_err().to_string();
        assert!(err.contains("not a gzip-compressed CSV"), "{err}");
    }

    #[test]
    fn chars_windows_shift_by_one() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&b"abcdefghijklmnopqrstuvwxyz0123456789".repeat(2)).unwrap();
        let d = Dataset::load(&DataSpec::Chars { context: 4 }, Some(f.path())).unwrap();
        assert_eq!(d.info, DataInfo::Tokens { vocab: 36, context: 4 });
        let (x, y) = d.train.range(0, 1).unwrap();
        let (x, y): (Vec<i64>, Vec<i64>) =
            (Vec::try_from(x.view(-1)).unwrap(), Vec::try_from(y.view(-1)).unwrap());
        let dec = |v: &[i64]| v.iter().map(|&t| d.vocab[t as usize] as char).collect::<String>();
        assert_eq!((dec(&x), dec(&y)), ("abcd".to_string(), "bcde".to_string()));
    }

    #[test]
    fn default_corpus_is_present() {
        let d = Dataset::load(&DataSpec::Chars { context: 64 }, None).unwrap();
        assert!(d.train.len() > 1000, "{}", d.train.len());
    }

    #[test]
    fn synthetic_is_seeded() {
        let spec = DataSpec::Synthetic { samples: 100, features: 5, classes: 3, seed: 9 };
        let (a, b) = (Dataset::load(&spec, None).unwrap(), Dataset::load(&spec, None).unwrap());
        assert!(a.train.range(0, 80).unwrap().0.equal(&b.train.range(0, 80).unwrap().0));
        assert_eq!(a.test.len(), 20);
    }
}

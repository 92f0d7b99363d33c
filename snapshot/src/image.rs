//! [`StateImage`]: named raw tensors plus metadata, with checksums, a content hash, and the
//! safetensors encoding that checkpoint files and state handoff share.

use crate::SnapshotError;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Version of the metadata layout this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// Key of the safetensors header metadata entry that holds [`StateMeta`] as JSON.
pub const META_KEY: &str = "limpet";
/// Keys of the job that say how the state is spread over the ranks, not what it is: a run
/// with sharded optimizer state holds, step for step, the state an unsharded run of the
/// same job holds, so the content hash leaves them out and the two hashes are equal.
pub const LAYOUT_KEYS: &[&str] = &["shard_state"];

/// Element types a state image stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    /// 32-bit float (parameters, optimizer slots).
    F32,
    /// 64-bit float.
    F64,
    /// 16-bit brain float.
    BF16,
    /// 16-bit IEEE float.
    F16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Unsigned byte.
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// Name as safetensors spells it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::U8 => "U8",
        }
    }

    /// The dtype safetensors spells `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        [Dtype::F32, Dtype::F64, Dtype::BF16, Dtype::F16, Dtype::I64, Dtype::I32, Dtype::U8]
            .into_iter()
            .find(|d| d.name() == name)
    }

    pub(crate) fn to_safetensors(self) -> StDtype {
        match self {
            Dtype::F32 => StDtype::F32,
            Dtype::F64 => StDtype::F64,
            Dtype::BF16 => StDtype::BF16,
            Dtype::F16 => StDtype::F16,
            Dtype::I64 => StDtype::I64,
            Dtype::I32 => StDtype::I32,
            Dtype::U8 => StDtype::U8,
        }
    }

    fn from_safetensors(d: StDtype) -> Option<Self> {
        Some(match d {
            StDtype::F32 => Dtype::F32,
            StDtype::F64 => Dtype::F64,
            StDtype::BF16 => Dtype::BF16,
            StDtype::F16 => Dtype::F16,
            StDtype::I64 => Dtype::I64,
            StDtype::I32 => Dtype::I32,
            StDtype::U8 => Dtype::U8,
            _ => return None,
        })
    }
}

/// The bytes `shape` elements of `dtype` take (`usize::MAX` past the address space, which no
/// buffer has).
pub(crate) fn needed_bytes(dtype: Dtype, shape: &[usize]) -> usize {
    shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d)).unwrap_or(usize::MAX)
}

/// One tensor as bytes: little-endian elements in row-major order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl RawTensor {
    /// Builds a tensor, checking that `data` holds exactly `shape` elements of `dtype`.
    pub fn try_new(
        name: &str,
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<Self, SnapshotError> {
        let needed = needed_bytes(dtype, &shape);
        if needed != data.len() {
            return Err(SnapshotError::Size {
                name: name.to_string(),
                bytes: data.len(),
                shape,
                dtype: dtype.name(),
                needed,
            });
        }
        Ok(RawTensor { dtype, shape, data })
    }

    /// Builds an f32 tensor from values (the shape's element count must match).
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Result<Self, SnapshotError> {
        // Allocated once: collecting a flat map would grow the vector to up to twice a
        // model-sized tensor's bytes.
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Self::try_new(name, Dtype::F32, shape, data)
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Raw little-endian bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The values of an f32 tensor, `None` for any other dtype.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        (self.dtype == Dtype::F32).then(|| {
            self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        })
    }
}

/// Position of the training RNG: a seed and how many 64-bit values were drawn from it.
/// The trainer's generator is a counter-based stream, so this pair restores it exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngState {
    /// Seed of the stream.
    pub seed: u64,
    /// Values drawn so far.
    pub draws: u64,
}

impl RngState {
    /// A fresh stream.
    pub fn new(seed: u64) -> Self {
        RngState { seed, draws: 0 }
    }
}

/// Everything in a state image besides the tensors; stored as JSON in the safetensors header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateMeta {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format: u32,
    /// Number of optimizer steps applied: the next step to run.
    pub step: u64,
    /// Global sample position where the next step's batch starts.
    pub cursor: u64,
    /// Training RNG position.
    pub rng: RngState,
    /// The job this state belongs to (model, data, optimizer, ...), owned by the trainer.
    pub job: serde_json::Value,
    /// blake3 hex of each tensor's bytes, by tensor name.
    pub checksums: BTreeMap<String, String>,
    /// blake3 hex over the metadata above (the job without its [`LAYOUT_KEYS`]) and every
    /// tensor's name, dtype, shape and checksum.
    pub content_hash: String,
}

/// A complete, self-verifying training state.
#[derive(Clone, Debug, PartialEq)]
pub struct StateImage {
    meta: StateMeta,
    tensors: BTreeMap<String, RawTensor>,
}

pub(crate) fn checksum(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}

fn content_hash(
    step: u64,
    cursor: u64,
    rng: RngState,
    job: &serde_json::Value,
    tensors: &BTreeMap<String, RawTensor>,
    checksums: &BTreeMap<String, String>,
) -> String {
    content_hash_of(step, cursor, rng, job, entries(tensors, checksums))
}

/// Each tensor's name, dtype, shape and checksum, in name order: what the content hash covers
/// of the tensors.
pub(crate) fn entries<'a>(
    tensors: &'a BTreeMap<String, RawTensor>,
    checksums: &'a BTreeMap<String, String>,
) -> impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a str)> + Clone {
    tensors.iter().map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice(), checksums[n].as_str()))
}

/// The content hash of an image from its metadata and each tensor's name, dtype, shape and
/// checksum (in name order), without the tensors' bytes.
pub(crate) fn content_hash_of<'a>(
    step: u64,
    cursor: u64,
    rng: RngState,
    job: &serde_json::Value,
    tensors: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a str)>,
) -> String {
    hash_over(step, cursor, rng, &hashed_job(job), tensors)
}

/// The job as the content hash covers it: without [`LAYOUT_KEYS`] (borrowed when it has none).
fn hashed_job(job: &serde_json::Value) -> std::borrow::Cow<'_, serde_json::Value> {
    match job.as_object() {
        Some(o) if LAYOUT_KEYS.iter().any(|k| o.contains_key(*k)) => {
            let mut o = o.clone();
            for k in LAYOUT_KEYS {
                o.remove(*k);
            }
            std::borrow::Cow::Owned(serde_json::Value::Object(o))
        }
        _ => std::borrow::Cow::Borrowed(job),
    }
}

/// The content hash of this state as this build computes it, and for a job with layout keys
/// the form builds before [`LAYOUT_KEYS`] computed (over the whole job), whose checkpoints stay
/// readable.
pub(crate) fn hash_forms<'a, I>(
    (step, cursor, rng): (u64, u64, RngState),
    job: &serde_json::Value,
    tensors: I,
) -> (String, Option<String>)
where
    I: Iterator<Item = (&'a str, Dtype, &'a [usize], &'a str)> + Clone,
{
    let hashed = hashed_job(job);
    let now = hash_over(step, cursor, rng, &hashed, tensors.clone());
    let earlier =
        matches!(hashed, std::borrow::Cow::Owned(_)).then(|| hash_over(step, cursor, rng, job, tensors));
    (now, earlier)
}

/// Checks that `stored` is the content hash of this state in either of its [`hash_forms`];
/// the error holds the hash this build computes.
pub(crate) fn check_hash<'a, I>(
    stored: &str,
    position: (u64, u64, RngState),
    job: &serde_json::Value,
    tensors: I,
) -> Result<(), String>
where
    I: Iterator<Item = (&'a str, Dtype, &'a [usize], &'a str)> + Clone,
{
    match hash_forms(position, job, tensors) {
        (now, earlier) if now == stored || earlier.as_deref() == Some(stored) => Ok(()),
        (now, _) => Err(now),
    }
}

fn hash_over<'a>(
    step: u64,
    cursor: u64,
    rng: RngState,
    job: &serde_json::Value,
    tensors: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a str)>,
) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"limpet-state\0");
    h.update(&FORMAT_VERSION.to_le_bytes());
    for v in [step, cursor, rng.seed, rng.draws] {
        h.update(&v.to_le_bytes());
    }
    // serde_json's Value keeps object keys sorted, so this encoding is canonical.
    let job = job.to_string();
    h.update(&(job.len() as u64).to_le_bytes());
    h.update(job.as_bytes());
    for (name, dtype, shape, checksum) in tensors {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(dtype.name().as_bytes());
        h.update(&(shape.len() as u64).to_le_bytes());
        for d in shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(checksum.as_bytes());
    }
    h.finalize().to_hex().to_string()
}

impl StateImage {
    /// Builds an image, computing per-tensor checksums and the content hash.
    pub fn new(
        step: u64,
        cursor: u64,
        rng: RngState,
        job: serde_json::Value,
        tensors: BTreeMap<String, RawTensor>,
    ) -> Self {
        let checksums: BTreeMap<_, _> = tensors.iter().map(|(n, t)| (n.clone(), checksum(&t.data))).collect();
        let content_hash = content_hash(step, cursor, rng, &job, &tensors, &checksums);
        StateImage {
            meta: StateMeta { format: FORMAT_VERSION, step, cursor, rng, job, checksums, content_hash },
            tensors,
        }
    }

    /// The part of this state whose tensor names `keep` accepts (e.g. the blocks of one
    /// pipeline stage, `b03.` to `b05.`), with the same step, cursor, RNG and job; a handoff
    /// of one stage sends only this. Checksums are reused, not recomputed.
    pub fn select(&self, keep: impl Fn(&str) -> bool) -> StateImage {
        let tensors: BTreeMap<String, RawTensor> =
            self.tensors.iter().filter(|(n, _)| keep(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
        let checksums: BTreeMap<String, String> =
            tensors.keys().map(|n| (n.clone(), self.meta.checksums[n].clone())).collect();
        let m = &self.meta;
        let content_hash = content_hash(m.step, m.cursor, m.rng, &m.job, &tensors, &checksums);
        StateImage { meta: StateMeta { checksums, content_hash, ..m.clone() }, tensors }
    }

    /// The metadata.
    pub fn meta(&self) -> &StateMeta {
        &self.meta
    }

    /// All tensors by name.
    pub fn tensors(&self) -> &BTreeMap<String, RawTensor> {
        &self.tensors
    }

    /// Hash of the whole state: equal hashes mean bit-identical states.
    pub fn content_hash(&self) -> &str {
        &self.meta.content_hash
    }

    /// This image under `hash`, which [`Self::has_hash`] accepted: the form its writer used.
    pub(crate) fn with_hash(mut self, hash: String) -> Self {
        self.meta.content_hash = hash;
        self
    }

    /// Whether `hash` is this state's content hash, as this build computes it or as an
    /// earlier build did (see [`LAYOUT_KEYS`]).
    pub fn has_hash(&self, hash: &str) -> bool {
        let m = &self.meta;
        check_hash(hash, (m.step, m.cursor, m.rng), &m.job, entries(&self.tensors, &m.checksums)).is_ok()
    }

    /// Encodes as safetensors bytes with the metadata in the header.
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        let (views, header) = self.views()?;
        safetensors::serialize(views, Some(header)).map_err(|e| SnapshotError::Format(e.to_string()))
    }

    /// Writes [`StateImage::encode`]'s bytes into a new file at `path` as they are made (a
    /// buffer at a time), never holding the encoding in memory: the state's bytes are not
    /// copied a second time. Not atomic: [`crate::write_image_atomic`] is.
    pub(crate) fn write_new_file(&self, path: &std::path::Path) -> Result<(), SnapshotError> {
        let (views, header) = self.views()?;
        safetensors::serialize_to_file(views, Some(header), path).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => {
                SnapshotError::Io { op: "write", path: path.to_path_buf(), source }
            }
            e => SnapshotError::Format(e.to_string()),
        })
    }

    /// At least as many bytes as [`StateImage::encode`] makes (for a disk-space check): the
    /// tensors', and a bound on the header's (the metadata and each name as JSON strings
    /// inside JSON, so every byte escaped at most twice over, plus each entry's fields).
    pub fn encoded_len(&self) -> u64 {
        let meta = serde_json::to_string(&self.meta).map_or(0, |m| m.len() as u64);
        let per_tensor =
            |n: &String, t: &RawTensor| (2 * n.len() + 96 + 24 * t.shape.len()) as u64 + t.data.len() as u64;
        8 + 128 + 4 * meta + self.tensors.iter().map(|(n, t)| per_tensor(n, t)).sum::<u64>()
    }

    /// The tensors as safetensors views, and the header's metadata.
    #[allow(clippy::type_complexity)]
    fn views(&self) -> Result<(Vec<(&str, TensorView<'_>)>, HashMap<String, String>), SnapshotError> {
        let views = self
            .tensors
            .iter()
            .map(|(name, t)| {
                TensorView::new(t.dtype.to_safetensors(), t.shape.clone(), &t.data)
                    .map(|v| (name.as_str(), v))
                    .map_err(|e| SnapshotError::Format(format!("tensor '{name}': {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let meta = serde_json::to_string(&self.meta).map_err(|e| SnapshotError::Meta(e.to_string()))?;
        Ok((views, HashMap::from([(META_KEY.to_string(), meta)])))
    }

    /// Decodes and verifies bytes from an untrusted source (a file or a peer).
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| SnapshotError::Format(e.to_string()))?;
        let meta_json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or(SnapshotError::MissingMeta { key: META_KEY })?;
        let meta = parse_meta(meta_json)?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| SnapshotError::Format(e.to_string()))?;

        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let dtype = Dtype::from_safetensors(view.dtype()).ok_or_else(|| SnapshotError::Dtype {
                name: name.clone(),
                dtype: format!("{:?}", view.dtype()),
            })?;
            let expected = meta.checksums.get(&name).ok_or_else(|| SnapshotError::TensorSet {
                name: name.clone(),
                problem: "is in the file but not listed in the checkpoint metadata",
            })?;
            let found = checksum(view.data());
            if &found != expected {
                return Err(SnapshotError::Checksum { name, expected: expected.clone(), found });
            }
            let t = RawTensor::try_new(&name, dtype, view.shape().to_vec(), view.data().to_vec())?;
            tensors.insert(name, t);
        }
        if let Some(name) = meta.checksums.keys().find(|n| !tensors.contains_key(*n)) {
            return Err(SnapshotError::TensorSet {
                name: name.clone(),
                problem: "is listed in the checkpoint metadata but missing from the file",
            });
        }
        let position = (meta.step, meta.cursor, meta.rng);
        if let Err(found) =
            check_hash(&meta.content_hash, position, &meta.job, entries(&tensors, &meta.checksums))
        {
            return Err(SnapshotError::ContentHash { expected: meta.content_hash, found });
        }
        Ok(StateImage { meta, tensors })
    }
}

/// Parses the metadata JSON, checking the version before the fields so that a file from a newer
/// build says so instead of complaining about a field it does not know.
pub(crate) fn parse_meta(json: &str) -> Result<StateMeta, SnapshotError> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| SnapshotError::Meta(e.to_string()))?;
    let format = value
        .get("format")
        .and_then(|f| f.as_u64())
        .ok_or_else(|| SnapshotError::Meta("field 'format' is missing or not a number".into()))?;
    if format != u64::from(FORMAT_VERSION) {
        return Err(SnapshotError::Version {
            found: u32::try_from(format).unwrap_or(u32::MAX),
            supported: FORMAT_VERSION,
        });
    }
    serde_json::from_value(value).map_err(|e| SnapshotError::Meta(e.to_string()))
}

#[cfg(test)]
mod tests;

//! Tensor datasets: inputs `x` and targets `y` as numpy `.npy` files (a directory with
//! `x.npy` and `y.npy`, optionally `x_test.npy` and `y_test.npy`) or as one safetensors file
//! with tensors `x` and `y` (optionally `x_test` and `y_test`): what numpy and PyTorch users
//! already have. Integer targets make a classification set (classes: the largest label + 1),
//! float targets a regression set.
//!
//! Only headers are read at open; rows are read when a batch asks for them, with positional
//! reads (see [`super::tokens`] for why not a memory map). The labels are scanned once, a
//! megabyte at a time, to count the classes and refuse negative ones. Without test files, a
//! seeded permutation of the rows holds out a tenth (at most 10,000) for evaluation, in
//! constant memory.

use crate::sampler::feistel;
use crate::Malformed;
use crate::TrainerError;
use safetensors::tensor::{Dtype as StDtype, Metadata};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest `.npy` or safetensors header read.
const HEADER_MAX: u64 = 1 << 20;
/// Key of the held-out permutation.
const SPLIT_KEY: u64 = 0x7e57_da7a;
/// Most rows held out when there are no test files.
const HELD_OUT_MAX: u64 = 10_000;

/// Element types a column may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// `<f4`
    F32,
    /// `<f8`
    F64,
    /// `|u1`
    U8,
    /// `<i4`
    I32,
    /// `<i8`
    I64,
}

impl Elem {
    fn size(self) -> u64 {
        match self {
            Elem::U8 => 1,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F64)
    }

    fn value(self, b: &[u8]) -> f64 {
        let a = |n: usize| -> [u8; 8] {
            let mut x = [0u8; 8];
            x[..n].copy_from_slice(&b[..n]);
            x
        };
        match self {
            Elem::U8 => f64::from(b[0]),
            Elem::F32 => f64::from(f32::from_le_bytes(b[..4].try_into().expect("4 bytes"))),
            Elem::I32 => f64::from(i32::from_le_bytes(b[..4].try_into().expect("4 bytes"))),
            Elem::F64 => f64::from_le_bytes(a(8)),
            Elem::I64 => i64::from_le_bytes(a(8)) as f64,
        }
    }
}

/// What a `.npy` header says: element type, shape, and where the data starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    /// Element type.
    pub elem: Elem,
    /// Dimensions (row-major).
    pub shape: Vec<usize>,
    /// Byte offset of the first element.
    pub data_offset: u64,
}

/// Parses the start of a `.npy` file (untrusted: a fuzz target and property tests cover it).
/// Accepts little-endian (or byte) f32, f64, u8, i32 and i64 in C order.
pub fn parse_npy_header(bytes: &[u8]) -> Result<NpyHeader, Malformed> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(Malformed("not a .npy file (no \\x93NUMPY magic)".into()));
    }
    let (len, start) = match bytes[6] {
        1 => (u64::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10u64),
        2 | 3 if bytes.len() >= 12 => {
            (u64::from(u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]])), 12)
        }
        v => return Err(Malformed(format!("format version {v} is not 1, 2 or 3"))),
    };
    let end = start + len;
    if len > HEADER_MAX || end > bytes.len() as u64 {
        return Err(Malformed(format!("header of {len} bytes runs past the {} bytes read", bytes.len())));
    }
    let text = std::str::from_utf8(&bytes[start as usize..end as usize])
        .map_err(|_| "header is not text".to_string())
        .map_err(Malformed)?;
    let field = |key: &str| -> Result<&str, Malformed> {
        let k = format!("'{key}':");
        let at = text.find(&k).ok_or_else(|| format!("header has no '{key}'")).map_err(Malformed)?;
        Ok(text[at + k.len()..].trim_start())
    };
    let descr = field("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("descr is not a string")
        .map_err(|m| Malformed(m.into()))?;
    let elem = match descr {
        "<f4" => Elem::F32,
        "<f8" => Elem::F64,
        "|u1" | "<u1" => Elem::U8,
        "<i4" => Elem::I32,
        "<i8" => Elem::I64,
        other => {
            return Err(Malformed(format!(
                "dtype {other:?} is not one of <f4, <f8, |u1, <i4, <i8 (little-endian)"
            )))
        }
    };
    if field("fortran_order")?.starts_with("True") {
        return Err(Malformed(
            "fortran_order is True: save the array in C order (np.ascontiguousarray)".into(),
        ));
    }
    let shape = field("shape")?;
    let inner = shape
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("shape is not a tuple")
        .map_err(|m| Malformed(m.into()))?;
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim_end_matches('L').parse::<usize>().map_err(|_| format!("shape entry {s:?} is not a size"))
        })
        .collect::<Result<_, _>>()
        .map_err(Malformed)?;
    if shape.is_empty() {
        return Err(Malformed("a scalar array has no rows".into()));
    }
    Ok(NpyHeader { elem, shape, data_offset: end })
}

/// One array on disk: where its rows are and what they hold.
#[derive(Debug)]
pub struct Column {
    path: PathBuf,
    file: File,
    offset: u64,
    elem: Elem,
    /// Rows, then the shape of one row.
    shape: Vec<usize>,
    row_bytes: u64,
}

fn data_err(path: &Path, detail: impl Into<String>) -> TrainerError {
    TrainerError::Data { path: path.to_path_buf(), detail: detail.into() }
}

impl Column {
    /// A column of `shape` at `offset`; with `exact_end` the file must end where it does (a
    /// `.npy` file holds one array), otherwise it must merely hold it.
    fn new(
        path: &Path,
        file: File,
        offset: u64,
        elem: Elem,
        shape: Vec<usize>,
        exact_end: bool,
    ) -> Result<Self, TrainerError> {
        let row_elems = shape[1..].iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let row_bytes = row_elems
            .and_then(|n| n.checked_mul(elem.size()))
            .ok_or_else(|| data_err(path, "rows are too large"))?;
        let need = row_bytes.checked_mul(shape[0] as u64).and_then(|b| b.checked_add(offset));
        let len = file.metadata().map_err(|e| data_err(path, e.to_string()))?.len();
        if need.is_none_or(|n| if exact_end { n != len } else { n > len }) {
            return Err(data_err(
                path,
                format!("the header describes {:?} {:?} ({} data bytes from byte {offset}), but the file has {len} bytes", elem, shape, need.map_or("too many".to_string(), |n| (n - offset).to_string())),
            ));
        }
        Ok(Column { path: path.to_path_buf(), file, offset, elem, shape, row_bytes })
    }

    /// Opens a `.npy` file.
    fn npy(path: &Path) -> Result<Self, TrainerError> {
        let file = File::open(path).map_err(|e| data_err(path, e.to_string()))?;
        let mut head = vec![0u8; 4096];
        let n = file.read_at(&mut head, 0).map_err(|e| data_err(path, e.to_string()))?;
        head.truncate(n);
        // A longer header (many dimensions) is read in full once its length is known.
        if let Err(first) = parse_npy_header(&head) {
            if n == 4096 && first.0.starts_with("header of") {
                head = vec![0u8; HEADER_MAX as usize + 12];
                let n = file.read_at(&mut head, 0).map_err(|e| data_err(path, e.to_string()))?;
                head.truncate(n);
            }
        }
        let h = parse_npy_header(&head).map_err(|m| data_err(path, m))?;
        Column::new(path, file, h.data_offset, h.elem, h.shape, true)
    }

    /// Opens tensor `name` of a safetensors file, if it has one.
    fn safetensors(path: &Path, name: &str) -> Result<Option<Self>, TrainerError> {
        let file = File::open(path).map_err(|e| data_err(path, e.to_string()))?;
        let mut n8 = [0u8; 8];
        file.read_exact_at(&mut n8, 0).map_err(|e| data_err(path, format!("not a safetensors file: {e}")))?;
        let n = u64::from_le_bytes(n8);
        if n > HEADER_MAX {
            return Err(data_err(
                path,
                format!("a safetensors header of {n} bytes is larger than limpet reads ({HEADER_MAX})"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| data_err(path, format!("the header is cut short: {e}")))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| data_err(path, format!("not a safetensors header: {e}")))?;
        let Some(info) = meta.info(name) else { return Ok(None) };
        let elem = match info.dtype {
            StDtype::F32 => Elem::F32,
            StDtype::F64 => Elem::F64,
            StDtype::U8 => Elem::U8,
            StDtype::I32 => Elem::I32,
            StDtype::I64 => Elem::I64,
            other => {
                return Err(data_err(
                    path,
                    format!("tensor '{name}' has dtype {other:?}; limpet reads F32, F64, U8, I32, I64"),
                ))
            }
        };
        if info.shape.is_empty() {
            return Err(data_err(path, format!("tensor '{name}' is a scalar: it has no rows")));
        }
        let (s, e) = info.data_offsets;
        let offset = 8 + n + s as u64;
        let bytes = info.shape.iter().try_fold(elem.size(), |a, &d| a.checked_mul(d as u64));
        if e < s || bytes != Some((e - s) as u64) {
            return Err(data_err(
                path,
                format!("tensor '{name}': offsets {s}..{e} do not hold {:?} {:?}", elem, info.shape),
            ));
        }
        Column::new(path, file, offset, elem, info.shape.clone(), false).map(Some)
    }

    fn rows(&self) -> u64 {
        self.shape[0] as u64
    }

    fn row_elems(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Row `i`'s values, appended to `out`.
    fn read_row(&self, i: u64, out: &mut Vec<f64>) -> Result<(), TrainerError> {
        let mut bytes = vec![0u8; self.row_bytes as usize];
        let at = self.offset + i * self.row_bytes;
        self.file.read_exact_at(&mut bytes, at).map_err(|e| {
            data_err(
                &self.path,
                format!(
                    "reading row {i} ({} bytes at byte offset {at}): {e} (was the file truncated?)",
                    bytes.len()
                ),
            )
        })?;
        out.extend(bytes.chunks_exact(self.elem.size() as usize).map(|b| self.elem.value(b)));
        Ok(())
    }
}

/// Inputs and targets of a tensor dataset and which rows a split takes.
#[derive(Debug)]
pub struct Pair {
    x: Column,
    y: Column,
}

/// Rows read for a batch.
#[derive(Debug, Default)]
pub struct RowBatch {
    /// Inputs, row after row, as f32.
    pub x: Vec<f32>,
    /// Class labels (classification).
    pub labels: Vec<i64>,
    /// Target values, row after row (regression).
    pub values: Vec<f32>,
    /// Rows read.
    pub n: usize,
}

/// A split of a tensor dataset: `len` rows, row `j` at position `first + j` of a seeded
/// permutation of the pair's rows (or of the identity, for test files).
#[derive(Clone, Debug)]
pub struct Rows {
    pair: Arc<Pair>,
    permuted: bool,
    first: u64,
    len: u64,
    regression: bool,
}

impl Rows {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when the split holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rows at `indices`: inputs as f32 values and targets (class labels, or f32 values
    /// for regression).
    pub fn read(&self, indices: impl Iterator<Item = u64>) -> Result<RowBatch, TrainerError> {
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        let mut n = 0;
        for j in indices {
            assert!(j < self.len, "row {j} outside a split of {}", self.len);
            let row = self.source_of(j);
            self.pair.x.read_row(row, &mut xs)?;
            self.pair.y.read_row(row, &mut ys)?;
            n += 1;
        }
        let x: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
        Ok(if self.regression {
            RowBatch { x, values: ys.iter().map(|&v| v as f32).collect(), n, ..Default::default() }
        } else {
            RowBatch { x, labels: ys.iter().map(|&v| v as i64).collect(), n, ..Default::default() }
        })
    }

    /// The row of the files that split row `j` is.
    pub fn source_of(&self, j: u64) -> u64 {
        let pos = self.first + j;
        if self.permuted {
            feistel(pos, self.pair.x.rows(), SPLIT_KEY)
        } else {
            pos
        }
    }

    /// Shape of one input row.
    pub fn row_shape(&self) -> &[usize] {
        &self.pair.x.shape[1..]
    }

    /// Values per target row (1 for class labels).
    pub fn target_width(&self) -> usize {
        self.pair.y.row_elems()
    }

    /// Whether targets are regression values.
    pub fn is_regression(&self) -> bool {
        self.regression
    }
}

/// What an opened tensor dataset holds.
#[derive(Debug)]
pub struct TensorData {
    /// Training rows.
    pub train: Rows,
    /// Held-out rows.
    pub test: Rows,
    /// Features per row, and the image shape when rows are 2-D (or 1 x H x W).
    pub features: usize,
    /// (height, width) of image rows.
    pub image: Option<(usize, usize)>,
    /// Classes (classification) or target values per row (regression).
    pub outputs: usize,
    /// Float targets.
    pub regression: bool,
    /// blake3 over the files' bytes.
    pub fingerprint: String,
}

fn pair(x: Column, y: Column) -> Result<Pair, TrainerError> {
    if x.rows() != y.rows() {
        return Err(data_err(
            &y.path,
            format!("{} target rows for {} input rows in {}", y.rows(), x.rows(), x.path.display()),
        ));
    }
    if x.rows() == 0 {
        return Err(data_err(&x.path, "no rows"));
    }
    Ok(Pair { x, y })
}

/// The largest class label (scanning a megabyte at a time); a negative one is an error
/// naming its row.
fn max_label(y: &Column) -> Result<u64, TrainerError> {
    if y.row_elems() != 1 {
        return Err(data_err(
            &y.path,
            format!("integer targets must be one label per row, not {:?}", &y.shape[1..]),
        ));
    }
    let size = y.elem.size();
    let per = (1u64 << 20) / size;
    let mut max = 0u64;
    let mut buf = vec![0u8; (per * size) as usize];
    let mut row = 0;
    while row < y.rows() {
        let n = per.min(y.rows() - row);
        let b = &mut buf[..(n * size) as usize];
        y.file.read_exact_at(b, y.offset + row * size).map_err(|e| data_err(&y.path, e.to_string()))?;
        for (k, c) in b.chunks_exact(size as usize).enumerate() {
            let v = y.elem.value(c);
            if v < 0.0 {
                return Err(data_err(&y.path, format!("label {v} at row {} is negative", row + k as u64)));
            }
            max = max.max(v as u64);
        }
        row += n;
    }
    Ok(max)
}

fn hash(paths: &[&Path]) -> Result<String, TrainerError> {
    let mut h = blake3::Hasher::new();
    for p in paths {
        let one = super::tokens::hash_file(p, |_| {}).map_err(|e| data_err(p, e.to_string()))?;
        h.update(one.as_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Opens a tensor dataset at `path`: a directory of `.npy` files or a safetensors file.
pub fn open(path: &Path) -> Result<TensorData, TrainerError> {
    let (train, test, files): (Pair, Option<Pair>, Vec<PathBuf>) = if path.is_dir() {
        let f = |n: &str| path.join(n);
        let train = pair(Column::npy(&f("x.npy"))?, Column::npy(&f("y.npy"))?)?;
        let mut files = vec![f("x.npy"), f("y.npy")];
        let test = if f("x_test.npy").exists() {
            files.extend([f("x_test.npy"), f("y_test.npy")]);
            Some(pair(Column::npy(&f("x_test.npy"))?, Column::npy(&f("y_test.npy"))?)?)
        } else {
            None
        };
        (train, test, files)
    } else {
        let col = |name: &str| -> Result<Option<Column>, TrainerError> { Column::safetensors(path, name) };
        let need = |name: &str| -> Result<Column, TrainerError> {
            col(name)?.ok_or_else(|| {
                data_err(path, format!("no tensor '{name}' (a tensor dataset holds 'x' and 'y')"))
            })
        };
        let train = pair(need("x")?, need("y")?)?;
        let test = match col("x_test")? {
            Some(x) => Some(pair(x, need("y_test")?)?),
            None => None,
        };
        (train, test, vec![path.to_path_buf()])
    };
    let regression = train.y.elem.is_float();
    if test.as_ref().is_some_and(|t| {
        t.x.shape[1..] != train.x.shape[1..]
            || t.y.elem.is_float() != regression
            || t.y.shape[1..] != train.y.shape[1..]
    }) {
        return Err(data_err(
            path,
            "the test arrays' row shapes or target kind differ from the training arrays'",
        ));
    }
    let outputs = if regression {
        train.y.row_elems()
    } else {
        let mut m = max_label(&train.y)?;
        if let Some(t) = &test {
            m = m.max(max_label(&t.y)?);
        }
        if m >= 1 << 24 {
            return Err(data_err(&train.y.path, format!("label {m} is too large for a class index")));
        }
        m as usize + 1
    };
    let row = &train.x.shape[1..];
    let image = match row {
        [h, w] | [1, h, w] if *h >= 2 && *w >= 2 => Some((*h, *w)),
        _ => None,
    };
    let features = row.iter().product();
    let fingerprint = hash(&files.iter().map(PathBuf::as_path).collect::<Vec<_>>())?;
    let (train, test) = match test {
        Some(t) => {
            let (n, m) = (train.x.rows(), t.x.rows());
            (
                Rows { pair: Arc::new(train), permuted: false, first: 0, len: n, regression },
                Rows { pair: Arc::new(t), permuted: false, first: 0, len: m, regression },
            )
        }
        None => {
            let n = train.x.rows();
            let held = (n / 10).clamp(1, HELD_OUT_MAX);
            if n < 2 {
                return Err(data_err(path, "one row cannot be both trained on and held out"));
            }
            let p = Arc::new(train);
            (
                Rows { pair: Arc::clone(&p), permuted: true, first: 0, len: n - held, regression },
                Rows { pair: p, permuted: true, first: n - held, len: held, regression },
            )
        }
    };
    Ok(TensorData { train, test, features, image, outputs, regression, fingerprint })
}

#[cfg(test)]
mod tests;

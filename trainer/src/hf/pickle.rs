//! PyTorch's `.bin` weights (a `torch.save` zip archive of a state dict) read without running
//! Python's unpickler: a pickle machine that knows the opcodes `torch.save` emits and builds
//! only what `torch.load(weights_only=True)` would allow in a state dict (dicts, tuples, lists,
//! strings, numbers, `OrderedDict`, tensors rebuilt from storages). Any other global is refused
//! by name before anything is called, so a hostile archive cannot run code; every length and
//! index is checked against the bytes present, so it cannot panic or allocate beyond them.
//! Untrusted input: a fuzz target and property tests cover [`parse_state_dict`].

use crate::Malformed;
use std::collections::BTreeMap;
use std::io::{Cursor, Read};
use tch::{Kind, Tensor};

/// Memo entries and stack depth a state dict needs at most (each key and tensor adds a few).
const MAX_ITEMS: usize = 1 << 22;
/// Nesting a state dict needs at most (dict, rebuild arguments, a shape tuple: 4).
const MAX_DEPTH: usize = 16;
/// Largest `data.pkl` read (a state dict's is about 100 bytes per tensor).
const MAX_PICKLE_BYTES: u64 = 64 << 20;
/// Longest input text quoted in an error.
const QUOTE: usize = 80;

fn quote(s: &str) -> String {
    if s.len() <= QUOTE {
        return format!("{s:?}");
    }
    let mut end = QUOTE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &s[..end], s.len())
}

/// A tensor the pickle describes: where its values are and how they are laid out.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    /// The storage's file name inside the archive's `data/`.
    pub key: String,
    /// Element type.
    pub kind: Kind,
    /// Elements in the storage.
    pub storage_numel: u64,
    /// Offset of the first element, in elements.
    pub offset: u64,
    /// Shape.
    pub shape: Vec<i64>,
    /// Stride, in elements.
    pub stride: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    Global(String, String),
    Storage { key: String, kind: Kind, numel: u64 },
    Tensor(TensorRef),
}

/// Nodes in `v` and its nesting depth, counted without recursion (a hostile pickle may nest
/// deeper than any stack).
fn measure(v: &V) -> (usize, usize) {
    let (mut nodes, mut depth) = (0, 0);
    let mut todo = vec![(v, 1usize)];
    while let Some((v, d)) = todo.pop() {
        nodes += 1;
        depth = depth.max(d);
        match v {
            V::Tuple(items) | V::List(items) => todo.extend(items.iter().map(|i| (i, d + 1))),
            V::Dict(items) => todo.extend(items.iter().flat_map(|(k, v)| [(k, d + 1), (v, d + 1)])),
            _ => {}
        }
    }
    (nodes, depth)
}

fn storage_kind(name: &str) -> Option<Kind> {
    Some(match name {
        "FloatStorage" => Kind::Float,
        "BFloat16Storage" => Kind::BFloat16,
        "HalfStorage" => Kind::Half,
        "DoubleStorage" => Kind::Double,
        _ => return None,
    })
}

/// The globals a state dict may name; everything else is refused.
fn allowed(module: &str, name: &str) -> bool {
    matches!(
        (module, name),
        ("collections", "OrderedDict")
            | ("torch._utils", "_rebuild_tensor_v2")
            | ("torch._utils", "_rebuild_parameter")
    ) || (module == "torch" && storage_kind(name).is_some())
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<V>,
    marks: Vec<usize>,
    memo: BTreeMap<u32, V>,
    /// Values made and copied so far, against `budget`: memo copies cannot multiply the input.
    spent: usize,
    budget: usize,
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| {
                format!("the pickle ends inside an operand at byte {} ({n} bytes wanted)", self.pos)
            })
            .map_err(Malformed)?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn line(&mut self) -> Result<String, Malformed> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("a GLOBAL name without its newline")
            .map_err(|m| Malformed(m.into()))?;
        let s = String::from_utf8(rest[..n].to_vec())
            .map_err(|_| "a GLOBAL name that is not UTF-8")
            .map_err(|m| Malformed(m.into()))?;
        self.pos += n + 1;
        Ok(s)
    }

    fn text(&mut self, n: usize) -> Result<V, Malformed> {
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map(V::Str)
            .map_err(|_| Malformed(format!("a string at byte {} is not UTF-8", self.pos)))
    }

    fn push(&mut self, v: V) -> Result<(), Malformed> {
        if self.stack.len() >= MAX_ITEMS {
            return Err(Malformed("the pickle's stack is deeper than a state dict needs".into()));
        }
        self.spend(1)?;
        self.stack.push(v);
        Ok(())
    }

    fn spend(&mut self, n: usize) -> Result<(), Malformed> {
        self.spent = self.spent.saturating_add(n);
        if self.spent > self.budget {
            return Err(Malformed(format!(
                "the pickle makes more values than its {} bytes can describe",
                self.data.len()
            )));
        }
        Ok(())
    }

    /// Checks that `items` can go one level down inside a container (on the stack, not yet
    /// inside another: values are copied, never shared) without nesting too deep.
    fn fits_inside(&self, items: &[V]) -> Result<(), Malformed> {
        let depth = 1 + items.iter().map(|v| measure(v).1).max().unwrap_or(0);
        if depth > MAX_DEPTH {
            return Err(Malformed(format!(
                "values nested {depth} deep at byte {}; a state dict needs at most {MAX_DEPTH}",
                self.pos
            )));
        }
        Ok(())
    }

    fn pop(&mut self) -> Result<V, Malformed> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(Malformed(format!("an operand taken from below a MARK at byte {}", self.pos)));
        }
        self.stack.pop().ok_or_else(|| Malformed(format!("the stack is empty at byte {}", self.pos)))
    }

    fn pop_mark(&mut self) -> Result<Vec<V>, Malformed> {
        let m = self
            .marks
            .pop()
            .ok_or_else(|| format!("no MARK for the operation at byte {}", self.pos))
            .map_err(Malformed)?;
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }

    fn top(&mut self) -> Result<&mut V, Malformed> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(Malformed(format!("an operand taken from below a MARK at byte {}", self.pos)));
        }
        self.stack.last_mut().ok_or_else(|| Malformed(format!("the stack is empty at byte {}", self.pos)))
    }

    fn memo_put(&mut self, i: u32) -> Result<(), Malformed> {
        if self.memo.len() >= MAX_ITEMS && !self.memo.contains_key(&i) {
            return Err(Malformed("the pickle's memo is larger than a state dict needs".into()));
        }
        let (nodes, _) =
            measure(self.stack.last().ok_or("PUT on an empty stack").map_err(|m| Malformed(m.into()))?);
        self.spend(nodes)?;
        let v = self.stack.last().expect("checked above").clone();
        self.memo.insert(i, v);
        Ok(())
    }

    fn memo_get(&mut self, i: u32) -> Result<(), Malformed> {
        let (nodes, _) = measure(
            self.memo.get(&i).ok_or_else(|| format!("memo entry {i} was never stored")).map_err(Malformed)?,
        );
        self.spend(nodes)?;
        let v = self.memo[&i].clone();
        self.push(v)
    }

    fn set_items(&mut self, items: Vec<V>) -> Result<(), Malformed> {
        if items.len() % 2 != 0 {
            return Err(Malformed("SETITEMS with an odd number of operands".into()));
        }
        self.fits_inside(&items)?;
        let V::Dict(d) = self.top()? else {
            return Err(Malformed("SETITEM on something that is not a dict".into()));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.push((k, v));
        }
        Ok(())
    }

    fn run(mut self) -> Result<V, Malformed> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(Malformed(format!("pickle protocol {proto} is newer than 5")));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b')' => self.push(V::Tuple(Vec::new()))?,
                b'}' => self.push(V::Dict(Vec::new()))?,
                b']' => self.push(V::List(Vec::new()))?,
                b'N' => self.push(V::None)?,
                0x88 => self.push(V::Bool(true))?,
                0x89 => self.push(V::Bool(false))?,
                b'K' => {
                    let v = self.u8()?;
                    self.push(V::Int(v.into()))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
                    self.push(V::Int(v.into()))?
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
                    self.push(V::Int(v.into()))?
                }
                0x8a => {
                    let n = self.u8()? as usize;
                    if n > 8 {
                        return Err(Malformed(format!("an integer of {n} bytes at byte {at}")));
                    }
                    let b = self.take(n)?;
                    let mut buf = [if b.last().is_some_and(|&x| x & 0x80 != 0) { 0xff } else { 0 }; 8];
                    buf[..n].copy_from_slice(b);
                    self.push(V::Int(i64::from_le_bytes(buf)))?
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                    self.push(V::Float(v))?
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let s = self.text(n)?;
                    self.push(s)?
                }
                0x8c | b'U' => {
                    let n = self.u8()? as usize;
                    let s = self.text(n)?;
                    self.push(s)?
                }
                b'T' => {
                    let n = self.u32()? as usize;
                    let s = self.text(n)?;
                    self.push(s)?
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(i.into())?
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(i)?
                }
                0x94 => {
                    let i = u32::try_from(self.memo.len())
                        .map_err(|_| "memo overflow")
                        .map_err(|m| Malformed(m.into()))?;
                    self.memo_put(i)?
                }
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(i.into())?
                }
                b'j' => {
                    let i = self.u32()?;
                    self.memo_get(i)?
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.fits_inside(&items)?;
                    self.push(V::Tuple(items))?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.fits_inside(&items)?;
                    self.push(V::Tuple(items))?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?
                }
                b'a' => {
                    let v = self.pop()?;
                    let V::List(l) = self.top()? else {
                        return Err(Malformed("APPEND to something that is not a list".into()));
                    };
                    l.push(v)
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let V::List(l) = self.top()? else {
                        return Err(Malformed("APPENDS to something that is not a list".into()));
                    };
                    l.extend(items)
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module, name)?
                }
                0x93 => {
                    let (V::Str(name), V::Str(module)) = (self.pop()?, self.pop()?) else {
                        return Err(Malformed(format!("STACK_GLOBAL without two names at byte {at}")));
                    };
                    self.global(module, name)?
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let storage = persistent(pid)?;
                    self.push(storage)?
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = reduce(f, args)?;
                    self.push(v)?
                }
                b'b' => {
                    // A state dict's `_metadata` attribute (module versions): not weights.
                    let _state = self.pop()?;
                    if !matches!(self.top()?, V::Dict(_)) {
                        return Err(Malformed(format!("BUILD on something that is not a dict at byte {at}")));
                    }
                }
                other => {
                    return Err(Malformed(format!(
                        "pickle opcode 0x{other:02x} at byte {at} is not one a state dict uses"
                    )))
                }
            }
        }
    }

    fn global(&mut self, module: String, name: String) -> Result<(), Malformed> {
        if !allowed(&module, &name) {
            return Err(Malformed(format!(
                "the archive names the global {}, which a state dict of tensors does not (refused: loading it could run code)",
                quote(&format!("{module}.{name}"))
            )));
        }
        self.push(V::Global(module, name))
    }
}

fn int(v: &V, what: &str) -> Result<i64, Malformed> {
    match v {
        V::Int(i) => Ok(*i),
        _ => Err(Malformed(format!("{what} is not an integer"))),
    }
}

fn ints(v: &V, what: &str) -> Result<Vec<i64>, Malformed> {
    match v {
        V::Tuple(items) => items.iter().map(|i| int(i, what)).collect(),
        _ => Err(Malformed(format!("{what} is not a tuple"))),
    }
}

/// `('storage', torch.XStorage, key, location, numel)`.
fn persistent(pid: V) -> Result<V, Malformed> {
    let V::Tuple(items) = pid else { return Err(Malformed("a persistent id that is not a tuple".into())) };
    match items.as_slice() {
        [V::Str(tag), V::Global(_, ty), V::Str(key), _location, numel] if tag == "storage" => {
            let kind = storage_kind(ty)
                .ok_or_else(|| format!("storage type {ty} is not a float storage"))
                .map_err(Malformed)?;
            let numel = u64::try_from(int(numel, "a storage's size")?)
                .map_err(|_| "a negative storage size")
                .map_err(|m| Malformed(m.into()))?;
            Ok(V::Storage { key: key.clone(), kind, numel })
        }
        _ => Err(Malformed("a persistent id that is not a tensor storage".into())),
    }
}

fn reduce(f: V, args: V) -> Result<V, Malformed> {
    let V::Global(module, name) = f else {
        return Err(Malformed("REDUCE of something that is not a global".into()));
    };
    let V::Tuple(args) = args else {
        return Err(Malformed(format!("{module}.{name} called without a tuple")));
    };
    match (module.as_str(), name.as_str()) {
        ("collections", "OrderedDict") if args.is_empty() => Ok(V::Dict(Vec::new())),
        ("torch._utils", "_rebuild_tensor_v2") if args.len() >= 4 => {
            let V::Storage { key, kind, numel } = &args[0] else {
                return Err(Malformed("_rebuild_tensor_v2 without a storage".into()));
            };
            let offset = u64::try_from(int(&args[1], "a tensor's offset")?)
                .map_err(|_| "a negative tensor offset")
                .map_err(|m| Malformed(m.into()))?;
            let (shape, stride) = (ints(&args[2], "a tensor's shape")?, ints(&args[3], "a tensor's stride")?);
            let t = TensorRef { key: key.clone(), kind: *kind, storage_numel: *numel, offset, shape, stride };
            check_layout(&t)?;
            Ok(V::Tensor(t))
        }
        ("torch._utils", "_rebuild_parameter") if !args.is_empty() => match &args[0] {
            V::Tensor(_) => Ok(args[0].clone()),
            _ => Err(Malformed("_rebuild_parameter without a tensor".into())),
        },
        _ => Err(Malformed(format!(
            "{} called with arguments a state dict does not use",
            quote(&format!("{module}.{name}"))
        ))),
    }
}

/// The layout stays inside the storage and reads no element twice: its element count is at
/// most the storage's (a state dict's tensors are views of their own storage), so a few bytes
/// cannot describe a tensor of gigabytes.
fn check_layout(t: &TensorRef) -> Result<(), Malformed> {
    let bad = || {
        Malformed(format!("a tensor of shape {:?}, stride {:?} and offset {}", t.shape, t.stride, t.offset))
    };
    if t.shape.len() != t.stride.len() || t.shape.len() > 8 {
        return Err(bad());
    }
    if t.shape.iter().chain(&t.stride).any(|&d| d < 0) {
        return Err(Malformed(format!("{} has a negative size", bad())));
    }
    let numel = t.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).ok_or_else(bad)?;
    if numel > t.storage_numel {
        return Err(Malformed(format!("{} has more elements than its storage's {}", bad(), t.storage_numel)));
    }
    if numel == 0 {
        return Ok(());
    }
    let mut last = t.offset;
    for (&n, &s) in t.shape.iter().zip(&t.stride) {
        let span = (n as u64 - 1).checked_mul(s as u64).ok_or_else(bad)?;
        last = last.checked_add(span).ok_or_else(bad)?;
    }
    if last >= t.storage_numel {
        return Err(Malformed(format!("{} reads past its storage of {} elements", bad(), t.storage_numel)));
    }
    Ok(())
}

/// The tensors a state dict's pickle names, in the file's order.
pub fn parse_state_dict(pickle: &[u8]) -> Result<Vec<(String, TensorRef)>, Malformed> {
    let budget = pickle.len().saturating_mul(4).saturating_add(1024);
    let m = Machine {
        data: pickle,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: BTreeMap::new(),
        spent: 0,
        budget,
    };
    let V::Dict(items) = m.run()? else {
        return Err(Malformed("the archive holds something other than a dict".into()));
    };
    items
        .into_iter()
        .map(|(k, v)| match (k, v) {
            (V::Str(k), V::Tensor(t)) => Ok((k, t)),
            (V::Str(k), _) => {
                Err(Malformed(format!("entry {} of the state dict is not a tensor", quote(&k))))
            }
            _ => Err(Malformed("a state dict key that is not a string".into())),
        })
        .collect()
}

/// Refuses a zip64 archive whose central directory claims more entries than its size can
/// hold: the zip reader reserves memory for the claimed count before reading any.
fn check_entry_count(bytes: &[u8]) -> Result<(), Malformed> {
    const ZIP64_EOCD: [u8; 4] = [0x50, 0x4b, 0x06, 0x06];
    let tail = bytes.len().saturating_sub(65_557 + 56);
    let Some(at) = bytes[tail..].windows(4).rposition(|w| w == ZIP64_EOCD).map(|i| tail + i) else {
        return Ok(()); // a plain end record counts at most 65,535 entries
    };
    let field =
        |o: usize| bytes.get(at + o..at + o + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let (Some(entries), Some(dir_size)) = (field(32), field(40)) else {
        return Err(Malformed("a truncated zip64 end record".into()));
    };
    // A central directory entry is at least 46 bytes.
    if entries > dir_size / 46 + 1 || dir_size > bytes.len() as u64 {
        return Err(Malformed(format!("the zip directory claims {entries} entries in {dir_size} bytes")));
    }
    Ok(())
}

/// Reads a `torch.save` zip archive of a state dict (`bytes`, the whole file) into f32
/// tensors by name. What it reads is bounded by the file: storages' bytes in all, and the
/// tensors' elements in all, are at most the file's size.
pub fn read_archive(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, Malformed> {
    check_entry_count(bytes)?;
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| format!("not a zip archive ({e}); legacy (pre-1.6) torch.save files are not read"))
        .map_err(Malformed)?;
    // Exactly one top-level data.pkl: with two, which one a reader takes would be arbitrary.
    let mut pkls: Vec<String> = zip
        .file_names()
        .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .map(str::to_string)
        .collect();
    pkls.sort();
    let pkl = match pkls.as_slice() {
        [one] => one.clone(),
        [] => return Err(Malformed("no data.pkl in the archive".into())),
        more => {
            return Err(Malformed(format!(
                "{} data.pkl files in one archive ({})",
                more.len(),
                more.join(", ")
            )))
        }
    };
    let prefix = pkl.trim_end_matches("data.pkl").to_string();
    let mut read_total = 0u64;
    let mut entry = |zip: &mut zip::ZipArchive<Cursor<&[u8]>>,
                     name: &str,
                     most: u64|
     -> Result<Vec<u8>, Malformed> {
        let mut f = zip.by_name(name).map_err(|e| format!("{name}: {e}")).map_err(Malformed)?;
        if f.compression() != zip::CompressionMethod::Stored {
            return Err(Malformed(format!("{name} is compressed; torch.save stores entries")));
        }
        let size = f.size();
        read_total = read_total.saturating_add(size);
        if size > most || read_total > bytes.len() as u64 {
            return Err(Malformed(format!("{name} claims {size} bytes, more than the archive holds for it")));
        }
        let mut out = Vec::with_capacity(size as usize);
        f.read_to_end(&mut out).map_err(|e| format!("{name}: {e}")).map_err(Malformed)?;
        Ok(out)
    };
    let whole = bytes.len() as u64;
    let order_name = format!("{prefix}byteorder");
    if zip.file_names().any(|n| n == order_name) {
        let order = entry(&mut zip, &order_name, 16)?;
        if order != b"little" {
            return Err(Malformed(format!(
                "byte order {:?}: only little-endian archives are read",
                String::from_utf8_lossy(&order)
            )));
        }
    }
    let refs = parse_state_dict(&entry(&mut zip, &pkl, MAX_PICKLE_BYTES)?)?;
    let mut storages: BTreeMap<String, (Tensor, Kind, u64)> = BTreeMap::new();
    let mut out = Vec::with_capacity(refs.len());
    let mut elements = 0u64;
    for (name, r) in refs {
        if !storages.contains_key(&r.key) {
            let raw = entry(&mut zip, &format!("{prefix}data/{}", r.key), whole)?;
            let want = r.storage_numel.checked_mul(r.kind.elt_size_in_bytes() as u64);
            if want != Some(raw.len() as u64) {
                return Err(Malformed(format!(
                    "storage {} holds {} bytes, its tensors say {want:?}",
                    quote(&r.key),
                    raw.len()
                )));
            }
            let t = Tensor::f_from_data_size(&raw, &[r.storage_numel as i64], r.kind)
                .map_err(|e| e.to_string())
                .map_err(Malformed)?;
            storages.insert(r.key.clone(), (t, r.kind, r.storage_numel));
        }
        let (storage, kind, numel) = &storages[&r.key];
        if (*kind, *numel) != (r.kind, r.storage_numel) {
            return Err(Malformed(format!("storage {} is described twice, differently", quote(&r.key))));
        }
        elements = elements.saturating_add(r.shape.iter().product::<i64>() as u64);
        if elements > whole {
            return Err(Malformed("the tensors hold more elements than the archive has bytes".into()));
        }
        let t = storage
            .f_as_strided(r.shape.as_slice(), r.stride.as_slice(), Some(r.offset as i64))
            .and_then(|t| t.f_to_kind(Kind::Float))
            .and_then(|t| t.f_contiguous())
            .map_err(|e| format!("tensor {}: {e}", quote(&name)))
            .map_err(Malformed)?;
        out.push((name, t));
    }
    Ok(out)
}

#[cfg(test)]
#[path = "pickle_tests.rs"]
mod tests;

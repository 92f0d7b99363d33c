//! State handoff: a newcomer copies a live peer's encoded `StateImage` over the network.
//!
//! The sender *offers* an image's bytes, a consistent copy taken at a step boundary, so it
//! keeps training while it serves. An offer is cut into chunks, each with a blake3 checksum,
//! listed in a manifest with the hash of the whole. The receiver asks any source for the
//! manifest, then fetches chunks over several connections in parallel, checks every chunk
//! against the manifest and re-requests the ones that arrive damaged, reconnects after a
//! broken connection and continues with the chunks it lacks, moves to the next source when
//! one vanishes, and checks the whole against the manifest's hash at the end.
//!
//! The protocol runs over any byte stream the caller dials (`Dialer`); the agent dials its
//! authenticated data-plane connections, tests and benchmarks plain TCP. Wire records:
//!
//! | record | bytes |
//! |---|---|
//! | request | `"LMPH"`, kind (1 manifest, 2 chunks), 3 zero bytes, offer hash (32), start u64, count u64 |
//! | manifest | `"LMPH"`, 1, 3 zero, total u64, chunk size u32, chunks u32, offer hash (32), chunk hashes (32 each) |
//! | chunk | `"LMPH"`, 2, 3 zero, index u32, length u32, chunk hash (32), bytes |
//! | error | `"LMPH"`, 3, 3 zero, length u32, UTF-8 message |
//!
//! A manifest request names the offer it wants (all zeros: the newest).

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"LMPH";
/// Bytes of a request.
pub const REQUEST_LEN: usize = 56;
const CHUNK_HEADER_LEN: usize = 48;
/// Largest chunk the protocol allows.
pub const MAX_CHUNK: u32 = 64 << 20;
/// Largest offer the protocol allows (1 TiB).
pub const MAX_TOTAL: u64 = 1 << 40;

/// What went wrong in a handoff.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// A socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Bytes that do not follow the protocol.
    #[error("handoff protocol: {0}")]
    Protocol(String),
    /// The source refused (e.g. it offers nothing, or not the wanted state).
    #[error("source {source_addr} refused: {message}")]
    Refused {
        /// The source.
        source_addr: String,
        /// What it said.
        message: String,
    },
    /// Every source failed.
    #[error("no source could complete the transfer: {0}")]
    SourcesExhausted(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HandoffError {
    let what = what.into();
    move |source| HandoffError::Io { what, source }
}

/// A consistent copy of a state's bytes, cut into checksummed chunks.
pub struct Offer {
    bytes: Arc<Vec<u8>>,
    manifest: Manifest,
}

/// The 32-byte label of a state: its content hash (hex) decoded, or hashed if not hex.
pub fn label_of(content_hash: &str) -> [u8; 32] {
    blake3::Hash::from_hex(content_hash)
        .map_or_else(|_| *blake3::hash(content_hash.as_bytes()).as_bytes(), |h| *h.as_bytes())
}

fn root_of(total: u64, chunk_size: u32, chunk_hashes: &[[u8; 32]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&total.to_le_bytes());
    h.update(&chunk_size.to_le_bytes());
    for c in chunk_hashes {
        h.update(c);
    }
    *h.finalize().as_bytes()
}

impl Offer {
    /// Prepares `bytes` (an encoded `StateImage` whose content hash is `label`) for serving
    /// in chunks of `chunk_size`.
    pub fn new(bytes: Vec<u8>, chunk_size: u32, label: [u8; 32]) -> Offer {
        let chunk_size = chunk_size.clamp(4096, MAX_CHUNK);
        let chunk_hashes: Vec<[u8; 32]> =
            bytes.chunks(chunk_size as usize).map(|c| *blake3::hash(c).as_bytes()).collect();
        let total = bytes.len() as u64;
        let root = root_of(total, chunk_size, &chunk_hashes);
        Offer { bytes: Arc::new(bytes), manifest: Manifest { total, chunk_size, label, root, chunk_hashes } }
    }

    /// The offer's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

/// What a receiver learns before fetching.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Bytes in the offer.
    pub total: u64,
    /// Bytes per chunk (the last may be shorter).
    pub chunk_size: u32,
    /// The state's content hash, which the receiver may insist on.
    pub label: [u8; 32],
    /// blake3 over (total, chunk size, chunk hashes): names this exact byte sequence.
    pub root: [u8; 32],
    /// blake3 of each chunk.
    pub chunk_hashes: Vec<[u8; 32]>,
}

const MANIFEST_HEAD: usize = 88;

impl Manifest {
    /// Encodes the manifest record.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MANIFEST_HEAD + 32 * self.chunk_hashes.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&[1, 0, 0, 0]);
        b.extend_from_slice(&self.total.to_le_bytes());
        b.extend_from_slice(&self.chunk_size.to_le_bytes());
        b.extend_from_slice(&(self.chunk_hashes.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.label);
        b.extend_from_slice(&self.root);
        for h in &self.chunk_hashes {
            b.extend_from_slice(h);
        }
        b
    }

    /// Reads a manifest record from a stream, checking that its numbers and root agree.
    pub fn read_from(r: &mut impl Read) -> Result<Manifest, HandoffError> {
        Manifest::read_at_most(r, MAX_TOTAL)
    }

    /// [`Manifest::read_from`] refusing, before any chunk hash is read, a state of more than
    /// `max_total` bytes (what the receiving state can be): a source offering a terabyte
    /// would otherwise have its 2^28 hashes read first.
    pub fn read_at_most(r: &mut impl Read, max_total: u64) -> Result<Manifest, HandoffError> {
        let mut head = [0u8; MANIFEST_HEAD];
        r.read_exact(&mut head[..8]).map_err(io("reading the manifest"))?;
        check_magic(&head[..8], 1, r)?;
        r.read_exact(&mut head[8..]).map_err(io("reading the manifest"))?;
        let total = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        let chunk_size = u32::from_le_bytes(head[16..20].try_into().expect("4 bytes"));
        let n = u32::from_le_bytes(head[20..24].try_into().expect("4 bytes"));
        let bad = |d: String| HandoffError::Protocol(format!("manifest: {d}"));
        if total > MAX_TOTAL.min(max_total) {
            return Err(bad(format!(
                "{total} bytes is more than the {} this state can be",
                MAX_TOTAL.min(max_total)
            )));
        }
        if !(4096..=MAX_CHUNK).contains(&chunk_size) {
            return Err(bad(format!("chunk size {chunk_size}")));
        }
        if u64::from(n) != total.div_ceil(u64::from(chunk_size)) {
            return Err(bad(format!("{n} chunks of {chunk_size} bytes cannot hold {total} bytes")));
        }
        let label = head[24..56].try_into().expect("32 bytes");
        let root = head[56..88].try_into().expect("32 bytes");
        // Grown as hashes arrive: a lying count must not reserve gigabytes up front.
        let mut chunk_hashes = Vec::with_capacity((n as usize).min(1 << 12));
        for _ in 0..n {
            let mut h = [0u8; 32];
            r.read_exact(&mut h).map_err(io("reading the manifest's chunk hashes"))?;
            chunk_hashes.push(h);
        }
        if root_of(total, chunk_size, &chunk_hashes) != root {
            return Err(bad("its chunk hashes do not match its root".into()));
        }
        Ok(Manifest { total, chunk_size, label, root, chunk_hashes })
    }

    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * u64::from(self.chunk_size);
        (self.total - start).min(u64::from(self.chunk_size)) as usize
    }
}

/// A request from a receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// The manifest of the offer with this label (all zeros: the newest).
    Manifest([u8; 32]),
    /// `count` chunks of the offer with this root from `start`.
    Chunks {
        /// The offer's root.
        offer: [u8; 32],
        /// First chunk index.
        start: u64,
        /// How many.
        count: u64,
    },
}

impl Request {
    /// Encodes the request record.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..4].copy_from_slice(&MAGIC);
        let (kind, offer, start, count) = match *self {
            Request::Manifest(h) => (1, h, 0, 0),
            Request::Chunks { offer, start, count } => (2, offer, start, count),
        };
        b[4] = kind;
        b[8..40].copy_from_slice(&offer);
        b[40..48].copy_from_slice(&start.to_le_bytes());
        b[48..56].copy_from_slice(&count.to_le_bytes());
        b
    }

    /// Decodes a request record.
    pub fn decode(b: &[u8]) -> Result<Request, HandoffError> {
        let bad = |d: String| HandoffError::Protocol(format!("request: {d}"));
        if b.len() != REQUEST_LEN || b[..4] != MAGIC || b[5..8] != [0, 0, 0] {
            return Err(bad("not a handoff request".into()));
        }
        let offer: [u8; 32] = b[8..40].try_into().expect("32 bytes");
        let start = u64::from_le_bytes(b[40..48].try_into().expect("8 bytes"));
        let count = u64::from_le_bytes(b[48..56].try_into().expect("8 bytes"));
        match b[4] {
            1 if start == 0 && count == 0 => Ok(Request::Manifest(offer)),
            2 => Ok(Request::Chunks { offer, start, count }),
            k => Err(bad(format!("kind {k} with start {start}, count {count}"))),
        }
    }
}

fn check_magic(head: &[u8], kind: u8, r: &mut impl Read) -> Result<(), HandoffError> {
    if head[..4] != MAGIC {
        return Err(HandoffError::Protocol(format!("record starts with {:02x?}", &head[..4])));
    }
    if head[4] == 3 {
        // An error record: [magic, 3, 0, 0, 0] then length and text.
        let mut len = [0u8; 4];
        r.read_exact(&mut len).map_err(io("reading an error record"))?;
        let len = u32::from_le_bytes(len).min(4096) as usize;
        let mut text = vec![0u8; len];
        r.read_exact(&mut text).map_err(io("reading an error record"))?;
        return Err(HandoffError::Refused {
            source_addr: String::new(),
            message: String::from_utf8_lossy(&text).into_owned(),
        });
    }
    if head[4] != kind || head[5..8] != [0, 0, 0] {
        return Err(HandoffError::Protocol(format!("record kind {} where {kind} was due", head[4])));
    }
    Ok(())
}

fn error_record(message: &str) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&[3, 0, 0, 0]);
    b.extend_from_slice(&(message.len() as u32).to_le_bytes());
    b.extend_from_slice(message.as_bytes());
    b
}

/// Serves offers to receivers. Keeps the newest offers (two unless told otherwise), so a
/// receiver that started on the previous one can finish while the sender has moved on, and
/// older offers stay reachable by label.
#[derive(Clone)]
pub struct Server {
    offers: Arc<Mutex<VecDeque<Arc<Offer>>>>,
    keep: usize,
}

impl Default for Server {
    fn default() -> Server {
        Server::with_capacity(2)
    }
}

/// A hook that may alter a chunk before it is sent (fault injection in tests).
pub type ChunkHook = dyn Fn(usize, &mut Vec<u8>) -> bool + Send + Sync;

impl Server {
    /// A server with nothing offered.
    pub fn new() -> Server {
        Server::default()
    }

    /// A server that keeps the `keep` newest offers (at least one).
    pub fn with_capacity(keep: usize) -> Server {
        Server { offers: Arc::default(), keep: keep.max(1) }
    }

    /// Makes `offer` the newest.
    pub fn offer(&self, offer: Offer) {
        let mut offers = self.offers.lock().expect("offers lock");
        offers.push_front(Arc::new(offer));
        offers.truncate(self.keep);
    }

    /// Stops serving the offers labelled `label` once nobody needs them (a transfer under
    /// way keeps its own reference and finishes): a model-sized offer kept for nothing is
    /// resident memory the training could use.
    pub fn withdraw(&self, label: &[u8; 32]) {
        self.offers.lock().expect("offers lock").retain(|o| o.manifest.label != *label);
    }

    fn find(&self, label: Option<&[u8; 32]>, root: Option<&[u8; 32]>) -> Option<Arc<Offer>> {
        let offers = self.offers.lock().expect("offers lock");
        match (label, root) {
            (Some(l), _) if *l == [0; 32] => offers.front().cloned(),
            (Some(l), _) => offers.iter().find(|o| o.manifest.label == *l).cloned(),
            (_, Some(r)) => offers.iter().find(|o| o.manifest.root == *r).cloned(),
            _ => None,
        }
    }

    /// Answers requests on one connection until the receiver closes it.
    pub fn serve(
        &self,
        stream: &mut (impl Read + Write),
        hook: Option<&ChunkHook>,
    ) -> Result<(), HandoffError> {
        let mut raw = [0u8; REQUEST_LEN];
        loop {
            match stream.read_exact(&mut raw) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(HandoffError::Io { what: "reading a request".into(), source: e }),
            }
            match Request::decode(&raw)? {
                Request::Manifest(label) => match self.find(Some(&label), None) {
                    Some(o) => stream.write_all(&o.manifest.encode()).map_err(io("sending the manifest"))?,
                    None => {
                        let _ = stream.write_all(&error_record("no such state offered here"));
                        return Ok(());
                    }
                },
                Request::Chunks { offer, start, count } => {
                    let Some(o) = self.find(None, Some(&offer)) else {
                        let _ = stream.write_all(&error_record("the requested state is no longer offered"));
                        return Ok(());
                    };
                    let n = o.manifest.chunk_hashes.len() as u64;
                    if start >= n || count > n - start {
                        return Err(HandoffError::Protocol(format!("chunks {start}+{count} of {n}")));
                    }
                    for i in start..start + count {
                        let i = i as usize;
                        let cs = o.manifest.chunk_size as usize;
                        let data = &o.bytes[i * cs..((i + 1) * cs).min(o.bytes.len())];
                        let mut head = [0u8; CHUNK_HEADER_LEN];
                        head[..4].copy_from_slice(&MAGIC);
                        head[4] = 2;
                        head[8..12].copy_from_slice(&(i as u32).to_le_bytes());
                        head[12..16].copy_from_slice(&(data.len() as u32).to_le_bytes());
                        head[16..48].copy_from_slice(&o.manifest.chunk_hashes[i]);
                        stream.write_all(&head).map_err(io("sending a chunk header"))?;
                        match hook {
                            Some(h) => {
                                let mut copy = data.to_vec();
                                if !h(i, &mut copy) {
                                    return Ok(()); // the hook dropped the connection
                                }
                                stream.write_all(&copy).map_err(io("sending a chunk"))?;
                            }
                            None => stream.write_all(data).map_err(io("sending a chunk"))?,
                        }
                    }
                }
            }
        }
    }
}

/// Opens byte streams to sources.
pub trait Dialer: Sync {
    /// The stream type.
    type Stream: Read + Write + Send;
    /// Connects to `source`.
    fn dial(&self, source: &str) -> std::io::Result<Self::Stream>;
}

/// Plain TCP (tests, benchmarks, and a base for authenticated dialers).
pub struct TcpDialer {
    /// Connect timeout.
    pub timeout: Duration,
}

impl Dialer for TcpDialer {
    type Stream = std::net::TcpStream;
    fn dial(&self, source: &str) -> std::io::Result<std::net::TcpStream> {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(source)?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no address in {source:?}"))
        })?;
        let s = std::net::TcpStream::connect_timeout(&addr, self.timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.timeout))?;
        Ok(s)
    }
}

/// How a receiver fetches.
#[derive(Clone, Debug)]
pub struct FetchOptions {
    /// Parallel connections.
    pub streams: usize,
    /// Chunks asked for per request.
    pub batch: usize,
    /// Reconnects per source before moving to the next one.
    pub reconnects: usize,
    /// The label (state content hash) the receiver insists on, if known (from the epoch).
    pub expect: Option<[u8; 32]>,
    /// The most bytes the receiver will take: what its job's state can be. A manifest
    /// announcing more is refused before anything is allocated for it.
    pub max_bytes: u64,
}

impl Default for FetchOptions {
    fn default() -> FetchOptions {
        FetchOptions { streams: 4, batch: 4, reconnects: 3, expect: None, max_bytes: MAX_TOTAL }
    }
}

/// What a fetch saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Bytes received.
    pub bytes: u64,
    /// Chunks that arrived damaged and were fetched again.
    pub repaired_chunks: u64,
    /// Connections re-established after breaking.
    pub reconnects: u64,
    /// Sources given up on.
    pub sources_failed: u64,
    /// The source that served the manifest.
    pub source: String,
}

struct Shared {
    todo: VecDeque<usize>,
    done: usize,
    stats: FetchStats,
    dead: Vec<bool>,
    last_error: String,
}

/// Fetches the state offered by `sources` (tried in order), verified against its manifest.
pub fn fetch<D: Dialer>(
    dialer: &D,
    sources: &[String],
    opts: &FetchOptions,
) -> Result<(Vec<u8>, FetchStats), HandoffError> {
    let want = opts.expect.unwrap_or([0; 32]);
    let (manifest, first) = first_manifest(dialer, sources, want, opts.max_bytes)?;
    if manifest.total > opts.max_bytes {
        return Err(HandoffError::Protocol(format!(
            "{} offers {} bytes, more than the {} this state can be",
            sources.get(first).map_or("the source", String::as_str),
            manifest.total,
            opts.max_bytes
        )));
    }
    let n = manifest.chunk_hashes.len();
    let mut bytes = vec![0u8; manifest.total as usize];
    // One lock per chunk: streams read straight into their chunk's place in the result.
    let slots: Vec<Mutex<&mut [u8]>> =
        bytes.chunks_mut(manifest.chunk_size as usize).map(Mutex::new).collect();
    let shared = Mutex::new(Shared {
        todo: (0..n).collect(),
        done: 0,
        stats: FetchStats { source: sources[first].clone(), ..FetchStats::default() },
        dead: vec![false; sources.len()],
        last_error: String::new(),
    });
    for d in shared.lock().expect("lock").dead.iter_mut().take(first) {
        *d = true;
    }
    std::thread::scope(|s| {
        for w in 0..opts.streams.max(1) {
            let (shared, slots, manifest) = (&shared, &slots, &manifest);
            s.spawn(move || worker(dialer, sources, manifest, shared, slots, opts, w));
        }
    });
    drop(slots);
    let shared = shared.into_inner().expect("lock");
    if shared.done < n {
        return Err(HandoffError::SourcesExhausted(shared.last_error));
    }
    // Every chunk matched its hash in the manifest, and the manifest matched its root: the
    // bytes are the sender's, so there is no second pass over them.
    let mut stats = shared.stats;
    stats.bytes = bytes.len() as u64;
    Ok((bytes, stats))
}

fn first_manifest<D: Dialer>(
    dialer: &D,
    sources: &[String],
    want: [u8; 32],
    max_bytes: u64,
) -> Result<(Manifest, usize), HandoffError> {
    let mut errors = Vec::new();
    for (i, src) in sources.iter().enumerate() {
        let attempt = || -> Result<Manifest, HandoffError> {
            let mut s = dialer.dial(src).map_err(io(format!("connecting to {src}")))?;
            s.write_all(&Request::Manifest(want).encode()).map_err(io("asking for the manifest"))?;
            Manifest::read_at_most(&mut s, max_bytes)
        };
        match attempt() {
            Ok(m) if want == [0; 32] || m.label == want => return Ok((m, i)),
            Ok(_) => errors.push(format!("{src}: offers another state")),
            Err(HandoffError::Refused { message, .. }) => errors.push(format!("{src}: {message}")),
            Err(e) => errors.push(format!("{src}: {e}")),
        }
    }
    Err(HandoffError::SourcesExhausted(errors.join("; ")))
}

fn worker<D: Dialer>(
    dialer: &D,
    sources: &[String],
    manifest: &Manifest,
    shared: &Mutex<Shared>,
    slots: &[Mutex<&mut [u8]>],
    opts: &FetchOptions,
    w: usize,
) {
    let mut failures_here: BTreeMap<usize, usize> = BTreeMap::new();
    'sources: loop {
        let src = {
            let sh = shared.lock().expect("lock");
            if sh.todo.is_empty() {
                return;
            }
            match (0..sources.len()).map(|k| (k + w) % sources.len()).find(|&k| !sh.dead[k]) {
                Some(k) => k,
                None => return,
            }
        };
        let mut stream = match dialer.dial(&sources[src]) {
            Ok(s) => s,
            Err(e) => {
                note_failure(shared, &mut failures_here, src, opts, &format!("{}: {e}", sources[src]));
                continue 'sources;
            }
        };
        loop {
            let batch: Vec<usize> = {
                let mut sh = shared.lock().expect("lock");
                let mut b = Vec::new();
                while b.len() < opts.batch.max(1) {
                    match sh.todo.pop_front() {
                        Some(i) => b.push(i),
                        None => break,
                    }
                }
                b
            };
            if batch.is_empty() {
                return;
            }
            match fetch_batch(&mut stream, manifest, &batch, slots) {
                Ok(bad) => {
                    let mut sh = shared.lock().expect("lock");
                    sh.done += batch.len() - bad.len();
                    sh.stats.repaired_chunks += bad.len() as u64;
                    if !bad.is_empty() {
                        // A source that keeps sending damaged chunks is given up on.
                        let count = failures_here.entry(src).or_insert(0);
                        *count += 1;
                        if *count > 4 * opts.reconnects.max(1) && !sh.dead[src] {
                            sh.dead[src] = true;
                            sh.stats.sources_failed += 1;
                            sh.last_error = format!("{}: keeps sending damaged chunks", sources[src]);
                        }
                    }
                    sh.todo.extend(bad);
                }
                Err((remaining, e)) => {
                    let mut sh = shared.lock().expect("lock");
                    sh.done += batch.len() - remaining.len();
                    sh.todo.extend(remaining);
                    drop(sh);
                    note_failure(shared, &mut failures_here, src, opts, &format!("{}: {e}", sources[src]));
                    continue 'sources;
                }
            }
        }
    }
}

fn note_failure(
    shared: &Mutex<Shared>,
    failures: &mut BTreeMap<usize, usize>,
    src: usize,
    opts: &FetchOptions,
    why: &str,
) {
    let count = failures.entry(src).or_insert(0);
    *count += 1;
    let mut sh = shared.lock().expect("lock");
    sh.last_error = why.to_string();
    if *count > opts.reconnects {
        if !sh.dead[src] {
            sh.dead[src] = true;
            sh.stats.sources_failed += 1;
        }
    } else {
        sh.stats.reconnects += 1;
    }
}

/// Fetches one batch of chunks straight into their slots. Returns the indices that arrived
/// damaged; when the stream fails, returns every index of the batch not stored yet.
fn fetch_batch(
    stream: &mut (impl Read + Write),
    m: &Manifest,
    batch: &[usize],
    slots: &[Mutex<&mut [u8]>],
) -> Result<Vec<usize>, (Vec<usize>, HandoffError)> {
    // One request per index: after repairs a batch need not be contiguous.
    let mut req = Vec::with_capacity(batch.len() * REQUEST_LEN);
    for &i in batch {
        req.extend_from_slice(&Request::Chunks { offer: m.root, start: i as u64, count: 1 }.encode());
    }
    stream.write_all(&req).map_err(|e| (batch.to_vec(), io("requesting chunks")(e)))?;
    let mut bad = Vec::new();
    for (k, &i) in batch.iter().enumerate() {
        let mut slot = slots[i].lock().expect("slot lock");
        if let Err(e) = read_chunk(stream, m, i, &mut slot) {
            return Err((bad.iter().chain(&batch[k..]).copied().collect(), e));
        }
        if *blake3::hash(&slot).as_bytes() != m.chunk_hashes[i] {
            bad.push(i);
        }
    }
    Ok(bad)
}

/// Reads chunk `i`'s record into `dst` (its place in the result), checking its index and
/// length (not its hash).
fn read_chunk(stream: &mut impl Read, m: &Manifest, i: usize, dst: &mut [u8]) -> Result<(), HandoffError> {
    let mut head = [0u8; CHUNK_HEADER_LEN];
    stream.read_exact(&mut head[..8]).map_err(io("reading a chunk header"))?;
    check_magic(&head[..8], 2, stream)?;
    stream.read_exact(&mut head[8..]).map_err(io("reading a chunk header"))?;
    let index = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let len = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if index != i || len != m.chunk_len(i) || len != dst.len() {
        return Err(HandoffError::Protocol(format!("chunk {index} of {len} bytes where chunk {i} was due")));
    }
    stream.read_exact(dst).map_err(io(format!("reading chunk {i}")))
}

/// Copies `bytes` over one TCP connection and back into memory: the baseline the handoff
/// benchmark compares against. Returns seconds taken.
pub fn plain_copy_seconds(bytes: &[u8]) -> std::io::Result<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let t = Instant::now();
    std::thread::scope(|s| -> std::io::Result<()> {
        let sender = s.spawn(move || -> std::io::Result<()> {
            let mut c = std::net::TcpStream::connect(addr)?;
            c.write_all(bytes)
        });
        let (mut conn, _) = listener.accept()?;
        let mut out = vec![0u8; bytes.len()];
        conn.read_exact(&mut out)?;
        sender.join().expect("sender thread")?;
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

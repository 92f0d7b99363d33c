//! `SledLog`: the Raft log of an agent in a sled database, its record layout
//! ([`decode_record`]) and the identity and flush watermark that keep a damaged or foreign
//! state directory from being mistaken for a fresh one.

use super::{
    applied_from_snapshot, check_append, check_range, entries_size_limited, fresh_snapshot, initial_state,
    snapshot_of, snapshot_term, AppliedState, LogStore,
};
use crate::codec::CodecError;
use crate::error::{ConsensusError, Result};
use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};
use std::path::{Path, PathBuf};

/// Which cluster and node a state directory belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    /// Layout version of the sled records.
    pub format: u32,
    /// The cluster's wire id.
    pub cluster_id: u64,
    /// This node's Raft id.
    pub node_id: u64,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {} of cluster {:#018x}", self.node_id, self.cluster_id)
    }
}

/// The sled record layout version.
pub const SLED_FORMAT: u32 = 1;

/// A marker file beside the database, written once the database is initialized.
pub const IDENTITY_FILE: &str = "identity.json";

const KEY_IDENTITY: &[u8] = b"meta/identity";
const KEY_HARD_STATE: &[u8] = b"meta/hard_state";
const KEY_SNAPSHOT: &[u8] = b"meta/snapshot";
const KEY_APPLIED_INDEX: &[u8] = b"meta/applied_index";
const KEY_APPLIED_CONF: &[u8] = b"meta/applied_conf";
const KEY_APPLIED_DATA: &[u8] = b"meta/applied_data";
const ENTRY_PREFIX: &[u8] = b"log/";

fn entry_key(index: u64) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(ENTRY_PREFIX);
    k[4..].copy_from_slice(&index.to_be_bytes());
    k
}

/// One record of the sled layout, decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredRecord {
    /// `meta/identity`.
    Identity(Identity),
    /// `meta/hard_state`.
    HardState(HardState),
    /// `meta/snapshot`.
    Snapshot(Snapshot),
    /// `meta/applied_index`.
    AppliedIndex(u64),
    /// `meta/applied_conf`.
    AppliedConf(ConfState),
    /// `meta/applied_data`: kept encoded; `Core` decodes it with the cluster id.
    AppliedData(Vec<u8>),
    /// `log/<index>`: the key's index and the entry.
    Entry(u64, Entry),
}

/// Decodes one stored record by its key. Every record the store reads passes through here,
/// so a damaged record is reported by name instead of misread.
pub fn decode_record(key: &[u8], value: &[u8]) -> std::result::Result<StoredRecord, RecordError> {
    fn pb<M: raft_prost::Message + Default>(v: &[u8]) -> std::result::Result<M, RecordError> {
        Ok(crate::codec::decode(v).map_err(CodecError::from)?)
    }
    match key {
        KEY_IDENTITY => serde_json::from_slice(value)
            .map(StoredRecord::Identity)
            .map_err(|e| RecordError::Identity(e.to_string())),
        KEY_HARD_STATE => pb(value).map(StoredRecord::HardState),
        KEY_SNAPSHOT => pb(value).map(StoredRecord::Snapshot),
        KEY_APPLIED_INDEX => value
            .try_into()
            .map(|b| StoredRecord::AppliedIndex(u64::from_be_bytes(b)))
            .map_err(|_| RecordError::Length { len: value.len(), want: 8 }),
        KEY_APPLIED_CONF => pb(value).map(StoredRecord::AppliedConf),
        KEY_APPLIED_DATA => Ok(StoredRecord::AppliedData(value.to_vec())),
        k if k.len() == 12 && k.starts_with(ENTRY_PREFIX) => {
            let index = u64::from_be_bytes(k[4..].try_into().expect("8 bytes"));
            let entry = crate::codec::decode_entry(value)?;
            if entry.index != index {
                return Err(RecordError::Index { key: index, record: entry.index });
            }
            Ok(StoredRecord::Entry(index, entry))
        }
        k => Err(RecordError::UnknownKey(String::from_utf8_lossy(k).into_owned())),
    }
}

/// Why a stored record does not decode.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RecordError {
    /// A raft record (hard state, snapshot, configuration, entry) does not decode or check.
    #[error(transparent)]
    Raft(#[from] CodecError),
    /// The identity record is not the JSON limpet writes.
    #[error("{0}")]
    Identity(String),
    /// A fixed-size record of another size.
    #[error("{len} bytes, not {want}")]
    Length {
        /// Its size.
        len: usize,
        /// The size it has to be.
        want: usize,
    },
    /// An entry stored under another index than its own.
    #[error("key says index {key}, record holds {record}")]
    Index {
        /// The index its key says.
        key: u64,
        /// The index it holds.
        record: u64,
    },
    /// A key limpet never writes.
    #[error("unknown key {0:?}")]
    UnknownKey(String),
}

/// The Raft log in a sled database: one tree, entries keyed by big-endian index, metadata
/// records beside them. Index bounds, hard state and snapshot are cached in memory; entries
/// are read from sled.
pub struct SledLog {
    path: PathBuf,
    db: sled::Db,
    hard_state: HardState,
    snapshot: Snapshot,
    last: u64,
    applied: Option<AppliedState>,
    watermark: Watermark,
}

/// What the last flush made durable, kept in a 32-byte file beside the database.
///
/// sled recovers from damaged files by keeping the prefix of its log that checks out, which
/// would silently forget flushed votes and committed entries. Raft's safety depends on
/// them, so after each flush the store records the term and commit index it made durable,
/// and refuses to open a database that holds less.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Watermark {
    term: u64,
    commit: u64,
}

const WATERMARK_FILE: &str = "flushed.bin";

impl Watermark {
    fn encode(self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.term.to_le_bytes());
        b[8..16].copy_from_slice(&self.commit.to_le_bytes());
        let sum = blake3::hash(&b[..16]);
        b[16..].copy_from_slice(&sum.as_bytes()[..8]);
        b
    }

    fn decode(b: &[u8]) -> Option<Watermark> {
        if b.len() != 24 || blake3::hash(&b[..16]).as_bytes()[..8] != b[16..] {
            return None;
        }
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Some(Watermark { term: word(0..8), commit: word(8..16) })
    }
}

impl SledLog {
    /// Opens (or creates) the log in `dir`, checking that it belongs to `identity` and that
    /// every record decodes and the entries are contiguous. Never resets a damaged directory.
    pub fn open(dir: &Path, identity: Identity) -> Result<SledLog> {
        let path = dir.to_path_buf();
        let shown = path.display().to_string();
        std::fs::create_dir_all(dir)
            .map_err(|e| ConsensusError::Storage { path: shown.clone(), detail: e.to_string() })?;
        // sled panics on some kinds of damage instead of returning an error; a damaged
        // directory must give a clear error, not a crash.
        let sled_dir = dir.join("sled");
        let open = || std::panic::catch_unwind(|| sled::Config::new().path(&sled_dir).open());
        let mut opened = open();
        // sled releases its file lock from a background thread after the last handle drops,
        // so a reopen in the same process can find it held for a moment; another process
        // holding it is another limpetd on this directory, which is not damage.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        // sled reports a held lock as an `Io` error of kind `Other` with this text (the OS's
        // WouldBlock only inside the message); it has no variant of its own.
        let locked = |o: &std::thread::Result<sled::Result<sled::Db>>| matches!(o, Ok(Err(sled::Error::Io(e))) if e.to_string().contains("could not acquire lock"));
        while locked(&opened) {
            if std::time::Instant::now() > deadline {
                return Err(ConsensusError::Storage {
                    path: shown,
                    detail: "the sled database is locked by another process (is another limpetd using this state_dir?)"
                        .into(),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            opened = open();
        }
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) => {
                return Err(ConsensusError::Corrupt {
                    path: shown,
                    what: "sled database".into(),
                    detail: e.to_string(),
                })
            }
            Err(_) => {
                return Err(ConsensusError::Corrupt {
                    path: shown,
                    what: "sled database".into(),
                    detail: "sled could not read its files (it panicked while recovering)".into(),
                })
            }
        };
        let mut log = SledLog {
            path,
            db,
            hard_state: HardState::default(),
            snapshot: Snapshot::default(),
            last: 0,
            applied: None,
            watermark: Watermark::default(),
        };
        log.check_identity(identity)?;
        log.load()?;
        log.check_watermark()?;
        Ok(log)
    }

    fn storage_err(&self, e: impl std::fmt::Display) -> ConsensusError {
        ConsensusError::Storage { path: self.path.display().to_string(), detail: e.to_string() }
    }

    fn corrupt(&self, what: impl Into<String>, detail: impl std::fmt::Display) -> ConsensusError {
        ConsensusError::Corrupt {
            path: self.path.display().to_string(),
            what: what.into(),
            detail: detail.to_string(),
        }
    }

    fn get(&self, key: &[u8]) -> Result<Option<sled::IVec>> {
        self.db.get(key).map_err(|e| self.storage_err(e))
    }

    fn check_identity(&mut self, expected: Identity) -> Result<()> {
        match self.get(KEY_IDENTITY)? {
            Some(raw) => {
                let StoredRecord::Identity(found) = self.record("identity record", KEY_IDENTITY, &raw)?
                else {
                    unreachable!("decode_record maps the identity key to an identity")
                };
                if found.format != SLED_FORMAT {
                    return Err(self.corrupt(
                        "identity record",
                        format!("layout version {} (this build reads {SLED_FORMAT})", found.format),
                    ));
                }
                if found != expected {
                    return Err(ConsensusError::WrongIdentity {
                        path: self.path.display().to_string(),
                        found: found.to_string(),
                        expected: expected.to_string(),
                    });
                }
                Ok(())
            }
            None => {
                // The marker file outlives damage that makes sled recover an empty database:
                // that must be an error, never a fresh start that forgets votes and entries.
                if self.path.join(IDENTITY_FILE).exists() {
                    return Err(self.corrupt(
                        "sled database",
                        format!("holds no identity record although {IDENTITY_FILE} says it was initialized"),
                    ));
                }
                if self.db.iter().next().is_some() {
                    return Err(self.corrupt("identity record", "missing, but the database holds records"));
                }
                let raw = serde_json::to_vec(&expected).expect("identity serializes");
                self.db.insert(KEY_IDENTITY, raw.as_slice()).map_err(|e| self.storage_err(e))?;
                self.db.flush().map_err(|e| self.storage_err(e))?;
                limpet_snapshot::write_atomic(&self.path.join(IDENTITY_FILE), &raw)
                    .map_err(|e| self.storage_err(e))?;
                Ok(())
            }
        }
    }

    fn record(&self, what: &str, key: &[u8], raw: &[u8]) -> Result<StoredRecord> {
        decode_record(key, raw).map_err(|e| self.corrupt(what, e))
    }

    fn load(&mut self) -> Result<()> {
        if let Some(raw) = self.get(KEY_HARD_STATE)? {
            if let StoredRecord::HardState(hs) = self.record("hard state", KEY_HARD_STATE, &raw)? {
                self.hard_state = hs;
            }
        }
        if let Some(raw) = self.get(KEY_SNAPSHOT)? {
            if let StoredRecord::Snapshot(snap) = self.record("snapshot", KEY_SNAPSHOT, &raw)? {
                self.snapshot = snap;
            }
        }
        self.applied = self.load_applied()?;
        let snap_index = self.snapshot.get_metadata().index;
        let mut expected = snap_index + 1;
        let mut prev_term = self.snapshot.get_metadata().term;
        for item in self.db.scan_prefix(ENTRY_PREFIX) {
            let (key, raw) = item.map_err(|e| self.storage_err(e))?;
            let (index, entry) = match decode_record(&key, &raw) {
                Ok(StoredRecord::Entry(index, entry)) => (index, entry),
                Ok(_) => unreachable!("log keys decode to entries"),
                Err(e) => {
                    let what = match key.get(4..).and_then(|k| <[u8; 8]>::try_from(k).ok()) {
                        Some(k) => format!("log entry {}", u64::from_be_bytes(k)),
                        None => format!("log key {key:?}"),
                    };
                    return Err(self.corrupt(what, e));
                }
            };
            let what = format!("log entry {index}");
            if index != expected {
                return Err(
                    self.corrupt(what, format!("expected index {expected}, record holds {}", entry.index))
                );
            }
            if entry.term < prev_term {
                return Err(self.corrupt(what, format!("term {} after term {prev_term}", entry.term)));
            }
            prev_term = entry.term;
            expected += 1;
        }
        self.last = expected - 1;
        if let Some(a) = &self.applied {
            if a.index < snap_index || a.index > self.last.max(snap_index) {
                return Err(self.corrupt(
                    "applied index",
                    format!("{} is outside the log [{snap_index}, {}]", a.index, self.last),
                ));
            }
        }
        if self.hard_state.commit > self.last.max(snap_index) {
            return Err(self.corrupt(
                "hard state",
                format!("commit {} beyond the last entry {}", self.hard_state.commit, self.last),
            ));
        }
        Ok(())
    }

    fn check_watermark(&mut self) -> Result<()> {
        let path = self.path.join(WATERMARK_FILE);
        let raw = match std::fs::read(&path) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(self.storage_err(format!("{}: {e}", path.display()))),
        };
        let mark =
            Watermark::decode(&raw).ok_or_else(|| self.corrupt(WATERMARK_FILE, "checksum mismatch"))?;
        let have = Watermark { term: self.hard_state.term, commit: self.hard_state.commit };
        if have.term < mark.term || have.commit < mark.commit {
            return Err(self.corrupt(
                "sled database",
                format!(
                    "holds term {} and commit {}, but term {} and commit {} were flushed: sled lost \
                     durable records (damaged files?)",
                    have.term, have.commit, mark.term, mark.commit
                ),
            ));
        }
        self.watermark = mark;
        Ok(())
    }

    fn load_applied(&self) -> Result<Option<AppliedState>> {
        let Some(raw_index) = self.get(KEY_APPLIED_INDEX)? else { return Ok(None) };
        let StoredRecord::AppliedIndex(index) =
            self.record("applied index", KEY_APPLIED_INDEX, &raw_index)?
        else {
            unreachable!("decode_record maps the applied-index key to an index")
        };
        let conf_raw =
            self.get(KEY_APPLIED_CONF)?.ok_or_else(|| self.corrupt("applied configuration", "missing"))?;
        let data = self.get(KEY_APPLIED_DATA)?.ok_or_else(|| self.corrupt("applied state", "missing"))?;
        Ok(Some(AppliedState {
            index,
            conf: match self.record("applied configuration", KEY_APPLIED_CONF, &conf_raw)? {
                StoredRecord::AppliedConf(c) => c,
                _ => unreachable!("decode_record maps the conf key to a configuration"),
            },
            data: data.to_vec(),
        }))
    }

    fn snap_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    fn read_entry(&self, index: u64) -> raft::Result<Entry> {
        let other = |e: String| raft::Error::Store(StorageError::Other(e.into()));
        let raw = self
            .db
            .get(entry_key(index))
            .map_err(|e| other(e.to_string()))?
            .ok_or_else(|| other(format!("log entry {index} missing in {}", self.path.display())))?;
        crate::codec::decode_entry(&raw).map_err(|e| other(format!("log entry {index}: {e}")))
    }

    /// The directory holding the database.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn pb_bytes<M: raft_prost::Message>(m: &M) -> Vec<u8> {
    crate::codec::encode(m)
}

impl Storage for SledLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(initial_state(&self.hard_state, &self.snapshot, self.applied.as_ref()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        check_range(low, high, self.snap_index(), self.last.max(self.snap_index()))?;
        let max_size = max_size.into();
        let mut out = Vec::with_capacity((high - low) as usize);
        let mut size = 0u64;
        for index in low..high {
            let e = self.read_entry(index)?;
            size += crate::codec::size(&e);
            out.push(e);
            if max_size.is_some_and(|m| size > m) {
                break;
            }
        }
        Ok(entries_size_limited(out, max_size))
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        match snapshot_term(idx, &self.snapshot, self.last.max(self.snap_index()))? {
            Some(t) => Ok(t),
            None => Ok(self.read_entry(idx)?.term),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snap_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last.max(self.snap_index()))
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        fresh_snapshot(self, self.applied.as_ref(), request_index)
    }
}

impl LogStore for SledLog {
    fn append(&mut self, entries: &[Entry]) -> Result<()> {
        let Some(first) = entries.first() else { return Ok(()) };
        let last = self.last.max(self.snap_index());
        check_append(first.index, self.snap_index(), last)?;
        let mut batch = sled::Batch::default();
        for index in first.index..=last {
            batch.remove(&entry_key(index));
        }
        for e in entries {
            batch.insert(&entry_key(e.index), pb_bytes(e));
        }
        self.db.apply_batch(batch).map_err(|e| self.storage_err(e))?;
        self.last = entries.last().map_or(last, |e| e.index);
        Ok(())
    }

    fn set_hard_state(&mut self, hs: &HardState) -> Result<()> {
        self.db.insert(KEY_HARD_STATE, pb_bytes(hs)).map_err(|e| self.storage_err(e))?;
        self.hard_state = hs.clone();
        Ok(())
    }

    fn save_applied(&mut self, state: &AppliedState) -> Result<()> {
        let mut hs = self.hard_state.clone();
        hs.commit = hs.commit.max(state.index);
        let mut batch = sled::Batch::default();
        batch.insert(KEY_APPLIED_INDEX, &state.index.to_be_bytes());
        batch.insert(KEY_APPLIED_CONF, pb_bytes(&state.conf));
        batch.insert(KEY_APPLIED_DATA, state.data.as_slice());
        batch.insert(KEY_HARD_STATE, pb_bytes(&hs));
        self.db.apply_batch(batch).map_err(|e| self.storage_err(e))?;
        self.hard_state = hs;
        self.applied = Some(state.clone());
        Ok(())
    }

    fn applied_state(&self) -> Option<AppliedState> {
        self.applied.clone()
    }

    fn install_snapshot(&mut self, snapshot: &Snapshot) -> Result<()> {
        let meta = snapshot.get_metadata();
        let mut hs = self.hard_state.clone();
        hs.term = hs.term.max(meta.term);
        hs.commit = hs.commit.max(meta.index);
        let applied = applied_from_snapshot(snapshot);
        let mut batch = sled::Batch::default();
        for item in self.db.scan_prefix(ENTRY_PREFIX).keys() {
            batch.remove(item.map_err(|e| self.storage_err(e))?);
        }
        batch.insert(KEY_SNAPSHOT, pb_bytes(snapshot));
        batch.insert(KEY_HARD_STATE, pb_bytes(&hs));
        batch.insert(KEY_APPLIED_INDEX, &applied.index.to_be_bytes());
        batch.insert(KEY_APPLIED_CONF, pb_bytes(&applied.conf));
        batch.insert(KEY_APPLIED_DATA, applied.data.as_slice());
        self.db.apply_batch(batch).map_err(|e| self.storage_err(e))?;
        self.hard_state = hs;
        self.snapshot = snapshot.clone();
        self.last = meta.index;
        self.applied = Some(applied);
        Ok(())
    }

    fn compact_to_applied(&mut self) -> Result<()> {
        let Some(applied) = self.applied.clone() else { return Ok(()) };
        let old = self.snap_index();
        if applied.index <= old {
            return Ok(());
        }
        let term = self.term(applied.index)?;
        let snapshot = snapshot_of(&applied, term);
        let mut batch = sled::Batch::default();
        batch.insert(KEY_SNAPSHOT, pb_bytes(&snapshot));
        for index in old + 1..=applied.index {
            batch.remove(&entry_key(index));
        }
        self.db.apply_batch(batch).map_err(|e| self.storage_err(e))?;
        self.snapshot = snapshot;
        self.last = self.last.max(applied.index);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.db.flush().map_err(|e| self.storage_err(e))?;
        let now = Watermark { term: self.hard_state.term, commit: self.hard_state.commit };
        if now != self.watermark {
            use std::io::Write;
            let path = self.path.join(WATERMARK_FILE);
            let write = || -> std::io::Result<()> {
                // One small in-place write and fdatasync: a 24-byte record never spans sectors.
                let mut f =
                    std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&path)?;
                f.write_all(&now.encode())?;
                f.sync_data()
            };
            write().map_err(|e| self.storage_err(format!("{}: {e}", path.display())))?;
            self.watermark = now;
        }
        Ok(())
    }
}

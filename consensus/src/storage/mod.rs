//! The Raft log's storage: raft-rs's `Storage` plus the writes the Ready loop makes.
//!
//! Two implementations with one contract (`tests/storage_contract.rs` runs the same suite
//! against both): `MemLog` (`memory.rs`) for the in-memory harness and property tests,
//! `SledLog` (`sled_log.rs`) for agents; what they share is here.
//! Besides the log, hard state and latest snapshot, a store keeps the *applied state*: the
//! encoded `ClusterState` at the applied index with the configuration at that index. A node
//! restarts from it and replays only the committed entries after it, so configuration changes
//! are never applied twice.

use crate::error::{ConsensusError, Result};
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{RaftState, Storage, StorageError};

mod memory;
mod sled_log;

pub use memory::MemLog;
pub use sled_log::{decode_record, Identity, RecordError, SledLog, StoredRecord, IDENTITY_FILE, SLED_FORMAT};

/// The state machine as of an index, with the configuration in force at that index.
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedState {
    /// The last applied log index.
    pub index: u64,
    /// The Raft configuration after applying `index`.
    pub conf: ConfState,
    /// The encoded `SnapshotData` at `index`.
    pub data: Vec<u8>,
}

/// What the Ready loop writes, on top of what raft-rs reads.
pub trait LogStore: Storage {
    /// Appends entries, first discarding any stored entries at or after the first new index.
    fn append(&mut self, entries: &[Entry]) -> Result<()>;
    /// Records term, vote and commit.
    fn set_hard_state(&mut self, hs: &HardState) -> Result<()>;
    /// Records the state machine after applying `state.index` (raising the stored commit to it).
    fn save_applied(&mut self, state: &AppliedState) -> Result<()>;
    /// The last saved applied state, if any.
    fn applied_state(&self) -> Option<AppliedState>;
    /// Replaces log and state with a snapshot from the leader.
    fn install_snapshot(&mut self, snapshot: &Snapshot) -> Result<()>;
    /// Makes the saved applied state the latest snapshot and discards the entries it covers.
    fn compact_to_applied(&mut self) -> Result<()>;
    /// Makes every write so far durable.
    fn flush(&mut self) -> Result<()>;
}

fn snapshot_of(state: &AppliedState, term: u64) -> Snapshot {
    let mut meta = SnapshotMetadata { index: state.index, term, ..Default::default() };
    meta.set_conf_state(state.conf.clone());
    let mut snap = Snapshot::default();
    snap.set_metadata(meta);
    snap.data = state.data.clone();
    snap
}

/// The snapshot a leader sends: the applied state, not the last compaction point, so that its
/// configuration includes the node it is sent to (raft-rs ignores a snapshot whose
/// configuration lacks the receiver, and a new learner is added after the last compaction).
fn fresh_snapshot<S: Storage>(
    store: &S,
    applied: Option<&AppliedState>,
    request_index: u64,
) -> raft::Result<Snapshot> {
    match applied {
        Some(a) if a.index >= request_index && a.index > 0 => Ok(snapshot_of(a, store.term(a.index)?)),
        _ => Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable)),
    }
}

fn applied_from_snapshot(snap: &Snapshot) -> AppliedState {
    AppliedState {
        index: snap.get_metadata().index,
        conf: snap.get_metadata().get_conf_state().clone(),
        data: snap.data.to_vec(),
    }
}

/// The state raft-rs starts from: the hard state, and the configuration of the applied state
/// (or of the snapshot when nothing was applied since).
fn initial_state(hs: &HardState, snapshot: &Snapshot, applied: Option<&AppliedState>) -> RaftState {
    let conf = match applied {
        Some(a) => a.conf.clone(),
        None => snapshot.get_metadata().get_conf_state().clone(),
    };
    RaftState::new(hs.clone(), conf)
}

/// Refuses entry reads below the snapshot or past the last entry.
fn check_range(low: u64, high: u64, snap_index: u64, last: u64) -> raft::Result<()> {
    if low <= snap_index {
        return Err(raft::Error::Store(StorageError::Compacted));
    }
    if high > last + 1 {
        return Err(raft::Error::Store(StorageError::Unavailable));
    }
    Ok(())
}

/// The term of `idx` when the snapshot answers it (`Some`), an error when `idx` is outside
/// the log, `None` when an entry must be read.
fn snapshot_term(idx: u64, snapshot: &Snapshot, last: u64) -> raft::Result<Option<u64>> {
    let meta = snapshot.get_metadata();
    if idx == meta.index {
        return Ok(Some(meta.term));
    }
    if idx < meta.index {
        return Err(raft::Error::Store(StorageError::Compacted));
    }
    if idx > last {
        return Err(raft::Error::Store(StorageError::Unavailable));
    }
    Ok(None)
}

fn entries_size_limited(mut entries: Vec<Entry>, max_size: Option<u64>) -> Vec<Entry> {
    raft::util::limit_size(&mut entries, max_size);
    entries
}

/// Refuses appends that would leave a gap or rewrite compacted entries: raft-rs never asks
/// for either, so one means a bug, and a bug must not damage the log.
fn check_append(first: u64, snap_index: u64, last: u64) -> Result<()> {
    if first <= snap_index {
        return Err(ConsensusError::Raft(raft::Error::Store(StorageError::Compacted)));
    }
    if first > last + 1 {
        return Err(ConsensusError::Raft(raft::Error::Store(StorageError::Unavailable)));
    }
    Ok(())
}

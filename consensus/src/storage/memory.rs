//! `MemLog`: the Raft log held in memory, the storage of the harness and the property tests.

use super::{
    applied_from_snapshot, check_append, check_range, entries_size_limited, fresh_snapshot, initial_state,
    snapshot_of, snapshot_term, AppliedState, LogStore,
};
use crate::error::Result;
use raft::prelude::{Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage};

/// An in-memory log: the harness's storage, with exactly the sled store's behaviour.
#[derive(Default, Clone)]
pub struct MemLog {
    hard_state: HardState,
    snapshot: Snapshot,
    entries: Vec<Entry>,
    applied: Option<AppliedState>,
}

impl MemLog {
    /// An empty log (a node that has never been part of a cluster).
    pub fn new() -> MemLog {
        MemLog::default()
    }

    fn snap_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    fn last(&self) -> u64 {
        self.entries.last().map_or(self.snap_index(), |e| e.index)
    }
}

impl Storage for MemLog {
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
        check_range(low, high, self.snap_index(), self.last())?;
        let offset = self.snap_index() + 1;
        let slice = &self.entries[(low - offset) as usize..(high - offset) as usize];
        Ok(entries_size_limited(slice.to_vec(), max_size.into()))
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        match snapshot_term(idx, &self.snapshot, self.last())? {
            Some(t) => Ok(t),
            None => Ok(self.entries[(idx - self.snap_index() - 1) as usize].term),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snap_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        fresh_snapshot(self, self.applied.as_ref(), request_index)
    }
}

impl LogStore for MemLog {
    fn append(&mut self, entries: &[Entry]) -> Result<()> {
        let Some(first) = entries.first() else { return Ok(()) };
        check_append(first.index, self.snap_index(), self.last())?;
        self.entries.truncate((first.index - self.snap_index() - 1) as usize);
        self.entries.extend_from_slice(entries);
        Ok(())
    }

    fn set_hard_state(&mut self, hs: &HardState) -> Result<()> {
        self.hard_state = hs.clone();
        Ok(())
    }

    fn save_applied(&mut self, state: &AppliedState) -> Result<()> {
        self.hard_state.commit = self.hard_state.commit.max(state.index);
        self.applied = Some(state.clone());
        Ok(())
    }

    fn applied_state(&self) -> Option<AppliedState> {
        self.applied.clone()
    }

    fn install_snapshot(&mut self, snapshot: &Snapshot) -> Result<()> {
        let meta = snapshot.get_metadata();
        self.hard_state.term = self.hard_state.term.max(meta.term);
        self.hard_state.commit = self.hard_state.commit.max(meta.index);
        self.entries.clear();
        self.snapshot = snapshot.clone();
        self.applied = Some(applied_from_snapshot(snapshot));
        Ok(())
    }

    fn compact_to_applied(&mut self) -> Result<()> {
        let Some(applied) = self.applied.clone() else { return Ok(()) };
        if applied.index <= self.snap_index() {
            return Ok(());
        }
        let term = self.term(applied.index)?;
        let keep_from = (applied.index - self.snap_index()) as usize;
        self.entries.drain(..keep_from.min(self.entries.len()));
        self.snapshot = snapshot_of(&applied, term);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
}

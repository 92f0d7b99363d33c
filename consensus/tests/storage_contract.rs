//! One storage contract, run against `MemLog` and `SledLog` alike; then what only the sled
//! store can show: restarts, identity checks and damaged directories.

use limpet_consensus::storage::{AppliedState, Identity, LogStore, MemLog, SledLog, SLED_FORMAT};
use limpet_consensus::ConsensusError;
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, Storage, StorageError};

fn entry(index: u64, term: u64) -> Entry {
    Entry { index, term, data: format!("entry {index}@{term}").into_bytes(), ..Default::default() }
}

fn entries(range: std::ops::Range<u64>, term: u64) -> Vec<Entry> {
    range.map(|i| entry(i, term)).collect()
}

fn read<S: Storage>(s: &S, lo: u64, hi: u64) -> raft::Result<Vec<Entry>> {
    s.entries(lo, hi, None, GetEntriesContext::empty(false))
}

fn conf(voters: &[u64]) -> ConfState {
    ConfState { voters: voters.to_vec(), ..Default::default() }
}

fn applied(index: u64, voters: &[u64]) -> AppliedState {
    AppliedState { index, conf: conf(voters), data: format!("state@{index}").into_bytes() }
}

fn snapshot(index: u64, term: u64, voters: &[u64]) -> Snapshot {
    let mut meta = SnapshotMetadata { index, term, ..Default::default() };
    meta.set_conf_state(conf(voters));
    let mut s = Snapshot::default();
    s.set_metadata(meta);
    s.data = b"snapshot state".to_vec();
    s
}

fn is_compacted<T: std::fmt::Debug>(r: raft::Result<T>) -> bool {
    matches!(r, Err(raft::Error::Store(StorageError::Compacted)))
}

/// The contract every `LogStore` meets.
fn contract<S: LogStore>(mut new: impl FnMut() -> S) {
    // An empty store.
    let s = new();
    assert_eq!(s.first_index().unwrap(), 1);
    assert_eq!(s.last_index().unwrap(), 0);
    assert_eq!(s.initial_state().unwrap().hard_state, HardState::default());
    assert!(s.snapshot(0, 2).is_err(), "no snapshot before anything is applied");
    assert_eq!(s.applied_state(), None);

    // Append, read, terms, size limits.
    let mut s = new();
    s.append(&entries(1..6, 1)).unwrap();
    assert_eq!(s.last_index().unwrap(), 5);
    assert_eq!(read(&s, 2, 5).unwrap(), entries(2..5, 1));
    assert_eq!(s.term(3).unwrap(), 1);
    assert_eq!(s.term(0).unwrap(), 0);
    assert!(matches!(s.term(6), Err(raft::Error::Store(StorageError::Unavailable))));
    let one = limpet_consensus::codec::size(&entry(1, 1));
    assert_eq!(s.entries(1, 6, Some(one * 2), GetEntriesContext::empty(false)).unwrap().len(), 2);
    assert_eq!(s.entries(1, 6, Some(0), GetEntriesContext::empty(false)).unwrap().len(), 1, "at least one");

    // A conflicting append replaces the suffix.
    s.append(&entries(4..6, 2)).unwrap();
    assert_eq!(s.last_index().unwrap(), 5);
    assert_eq!(s.term(3).unwrap(), 1);
    assert_eq!(s.term(4).unwrap(), 2);
    s.append(&entries(3..4, 3)).unwrap();
    assert_eq!(s.last_index().unwrap(), 3, "entries after a replaced one are gone");
    assert_eq!(s.term(3).unwrap(), 3);

    // A gap is refused and changes nothing.
    assert!(s.append(&entries(9..10, 3)).is_err());
    assert_eq!(s.last_index().unwrap(), 3);

    // Hard state.
    let hs = HardState { term: 3, vote: 2, commit: 2 };
    s.set_hard_state(&hs).unwrap();
    assert_eq!(s.initial_state().unwrap().hard_state, hs);

    // Applied state raises commit and gives the fresh snapshot a leader sends.
    s.save_applied(&applied(3, &[1, 2, 3])).unwrap();
    assert_eq!(s.initial_state().unwrap().hard_state.commit, 3);
    assert_eq!(s.initial_state().unwrap().conf_state, conf(&[1, 2, 3]));
    let snap = s.snapshot(0, 9).unwrap();
    assert_eq!((snap.get_metadata().index, snap.get_metadata().term), (3, 3));
    assert_eq!(&snap.data[..], b"state@3");
    assert!(s.snapshot(4, 9).is_err(), "a snapshot older than requested is refused");

    // Compaction keeps the term of the snapshot index and drops what it covers.
    s.append(&entries(4..8, 3)).unwrap();
    s.compact_to_applied().unwrap();
    assert_eq!(s.first_index().unwrap(), 4);
    assert_eq!(s.last_index().unwrap(), 7);
    assert_eq!(s.term(3).unwrap(), 3);
    assert!(is_compacted(s.term(2)));
    assert!(is_compacted(read(&s, 3, 5)));
    assert!(s.append(&entries(2..3, 3)).is_err(), "rewriting compacted entries is refused");
    assert_eq!(read(&s, 4, 8).unwrap(), entries(4..8, 3));

    // Installing a leader's snapshot replaces the log and the applied state.
    s.install_snapshot(&snapshot(20, 5, &[1, 2, 3, 4])).unwrap();
    assert_eq!(s.first_index().unwrap(), 21);
    assert_eq!(s.last_index().unwrap(), 20);
    assert_eq!(s.term(20).unwrap(), 5);
    let st = s.initial_state().unwrap();
    assert_eq!((st.hard_state.term, st.hard_state.commit), (5, 20));
    assert_eq!(s.applied_state().unwrap().index, 20);
    assert_eq!(s.applied_state().unwrap().conf, conf(&[1, 2, 3, 4]));
    s.append(&entries(21..23, 5)).unwrap();
    assert_eq!(read(&s, 21, 23).unwrap(), entries(21..23, 5));
    s.flush().unwrap();
}

#[test]
fn mem_log_meets_the_contract() {
    contract(MemLog::new);
}

fn identity(node: u64) -> Identity {
    Identity { format: SLED_FORMAT, cluster_id: 0xfeed, node_id: node }
}

#[test]
fn sled_log_meets_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    contract(|| {
        n += 1;
        SledLog::open(&dir.path().join(format!("db{n}")), identity(1)).unwrap()
    });
}

#[test]
fn sled_log_restarts_with_everything_it_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    {
        let mut s = SledLog::open(&path, identity(1)).unwrap();
        s.append(&entries(1..10, 2)).unwrap();
        let hs = HardState { term: 2, vote: 1, commit: 6 };
        s.set_hard_state(&hs).unwrap();
        s.save_applied(&applied(5, &[1, 2, 3])).unwrap();
        s.compact_to_applied().unwrap();
        s.flush().unwrap();
    }
    let s = SledLog::open(&path, identity(1)).unwrap();
    assert_eq!((s.first_index().unwrap(), s.last_index().unwrap()), (6, 9));
    let st = s.initial_state().unwrap();
    assert_eq!((st.hard_state.term, st.hard_state.vote, st.hard_state.commit), (2, 1, 6));
    assert_eq!(s.applied_state(), Some(applied(5, &[1, 2, 3])));
    assert_eq!(read(&s, 6, 10).unwrap(), entries(6..10, 2));
}

#[test]
fn a_directory_of_another_node_or_cluster_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(SledLog::open(dir.path(), identity(1)).unwrap());
    let err = SledLog::open(dir.path(), identity(2)).err().unwrap();
    assert!(matches!(err, ConsensusError::WrongIdentity { .. }), "{err}");
    assert!(err.to_string().contains("node 1 of cluster"), "{err}");
    let other = Identity { cluster_id: 0xbeef, ..identity(1) };
    assert!(SledLog::open(dir.path(), other).is_err());
}

#[test]
fn a_damaged_record_names_itself_and_the_directory_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = SledLog::open(dir.path(), identity(1)).unwrap();
        s.append(&entries(1..4, 1)).unwrap();
        s.flush().unwrap();
    }
    {
        let db = raw_sled(dir.path());
        let mut key = b"log/".to_vec();
        key.extend_from_slice(&2u64.to_be_bytes());
        db.insert(key, &b"\xff\xfe not an entry"[..]).unwrap();
        db.flush().unwrap();
    }
    let err = SledLog::open(dir.path(), identity(1)).err().unwrap();
    assert!(err.is_fatal());
    assert!(err.to_string().contains("log entry 2"), "{err}");
    // Nothing was reset: the other entries are still there.
    let db = raw_sled(dir.path());
    assert_eq!(db.scan_prefix(b"log/").count(), 3);
}

#[test]
fn a_gap_in_the_log_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = SledLog::open(dir.path(), identity(1)).unwrap();
        s.append(&entries(1..5, 1)).unwrap();
        s.flush().unwrap();
    }
    {
        let db = raw_sled(dir.path());
        let mut key = b"log/".to_vec();
        key.extend_from_slice(&3u64.to_be_bytes());
        db.remove(key).unwrap();
        db.flush().unwrap();
    }
    let err = SledLog::open(dir.path(), identity(1)).err().unwrap();
    assert!(err.to_string().contains("log entry 4: expected index 3"), "{err}");
}

#[test]
fn damaged_database_files_give_an_error_not_a_crash_or_a_reset() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut s = SledLog::open(dir.path(), identity(1)).unwrap();
        s.append(&entries(1..200, 1)).unwrap();
        let hs = HardState { term: 1, commit: 199, ..Default::default() };
        s.set_hard_state(&hs).unwrap();
        s.flush().unwrap();
    }
    // Overwrite the middle of every file sled wrote with garbage.
    let mut damaged = 0;
    for f in walk(dir.path()) {
        let mut bytes = std::fs::read(&f).unwrap();
        if bytes.len() > 64 {
            let mid = bytes.len() / 2;
            for b in &mut bytes[mid - 16..mid + 16] {
                *b ^= 0x5a;
            }
            std::fs::write(&f, bytes).unwrap();
            damaged += 1;
        }
    }
    assert!(damaged > 0);
    match SledLog::open(dir.path(), identity(1)) {
        Err(e) => assert!(e.is_fatal(), "{e}"),
        // Damage sled did not notice must still leave every flushed entry readable.
        Ok(s) => {
            assert_eq!(s.last_index().unwrap(), 199, "flushed entries lost without an error");
            read(&s, 1, 200).unwrap();
        }
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Opens the store's sled database directly, waiting for a just-closed handle's background
/// thread to release its lock.
fn raw_sled(dir: &std::path::Path) -> sled::Db {
    for _ in 0..100 {
        if let Ok(db) = sled::open(dir.join("sled")) {
            return db;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("sled database stays locked")
}

#[test]
fn a_directory_held_by_another_handle_is_locked_not_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    drop(SledLog::open(dir.path(), identity(1)).unwrap());
    let held = raw_sled(dir.path());
    let err = SledLog::open(dir.path(), identity(1)).err().unwrap();
    assert!(!matches!(err, ConsensusError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("locked by another process"), "{err}");
    drop(held);
    // Released, it opens with everything in place (sled frees the lock shortly after).
    assert!(SledLog::open(dir.path(), identity(1)).is_ok());
}

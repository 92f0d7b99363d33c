//! Raft snapshots in chunks. A snapshot message whose data passes one chunk travels as its
//! data's chunks (`SendSnapshotChunk`, in order, each at most [`SNAPSHOT_CHUNK_BYTES`]) and
//! then the message itself with its data left out and its batch marked: a large cluster's
//! snapshot never meets the request limit. A receiver assembles at most
//! [`MAX_ASSEMBLIES`] snapshots at once, one a sender, each at most [`MAX_SNAPSHOT_BYTES`],
//! and drops one idle for [`ASSEMBLY_IDLE`] (its sender died mid-way). A chunk out of
//! order, of another snapshot or past the size it announced is refused, and a marked batch
//! whose snapshot was not received whole is refused too: raft sends the snapshot again.

use crate::error::ConsensusError;
use crate::state::NodeId;
use raft::eraftpb::{Message, MessageType};
use std::collections::HashMap;
use std::sync::Mutex;

/// Bytes of snapshot data a chunk carries at most.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// The largest snapshot a node assembles (a state of tens of thousands of members).
pub const MAX_SNAPSHOT_BYTES: u64 = 256 << 20;

/// Snapshots a node assembles at once: one leader sends them, and a second covers a
/// leadership change mid-way.
pub const MAX_ASSEMBLIES: usize = 2;

/// An assembly with no chunk for this long is dropped.
pub const ASSEMBLY_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Which snapshot a chunk belongs to: its index and term.
pub type SnapshotId = (u64, u64);

/// The snapshot message of `msgs` whose data should travel in chunks of `chunk` bytes: its
/// position, when there is exactly one and its data is larger than one chunk.
pub fn chunked_snapshot(msgs: &[Message], chunk: usize) -> Option<usize> {
    let mut snaps = msgs.iter().enumerate().filter(|(_, m)| m.get_msg_type() == MessageType::MsgSnapshot);
    let (i, m) = snaps.next()?;
    (snaps.next().is_none() && m.get_snapshot().data.len() > chunk).then_some(i)
}

/// A snapshot message's id.
pub fn snapshot_id(m: &Message) -> SnapshotId {
    let meta = m.get_snapshot().get_metadata();
    (meta.index, meta.term)
}

fn refused(detail: String) -> ConsensusError {
    ConsensusError::Decode { what: "snapshot chunk", detail }
}

/// One sender's snapshot being assembled.
struct Assembly {
    id: SnapshotId,
    total: u64,
    data: Vec<u8>,
    last: std::time::Instant,
}

/// The snapshots being received, one per sender.
#[derive(Default)]
pub struct Assemblies(Mutex<HashMap<NodeId, Assembly>>);

impl Assemblies {
    /// Adds a chunk from `from`: `data` at `offset` of snapshot `id`, `total` bytes in all.
    /// Offset 0 starts the snapshot anew (a sender that starts again drops what came before).
    pub fn add(
        &self,
        from: NodeId,
        id: SnapshotId,
        offset: u64,
        total: u64,
        data: &[u8],
    ) -> Result<(), ConsensusError> {
        if total > MAX_SNAPSHOT_BYTES {
            return Err(refused(format!("a snapshot of {total} bytes (at most {MAX_SNAPSHOT_BYTES})")));
        }
        if data.is_empty() || data.len() > SNAPSHOT_CHUNK_BYTES {
            return Err(refused(format!("{} bytes (1 to {SNAPSHOT_CHUNK_BYTES})", data.len())));
        }
        let mut all = self.0.lock().expect("assemblies lock");
        let now = std::time::Instant::now();
        all.retain(|_, a| now.duration_since(a.last) < ASSEMBLY_IDLE);
        if offset == 0 {
            if !all.contains_key(&from) && all.len() >= MAX_ASSEMBLIES {
                return Err(refused(format!(
                    "from node {from}: {MAX_ASSEMBLIES} other snapshots are being received"
                )));
            }
            all.insert(from, Assembly { id, total, data: Vec::new(), last: now });
        }
        let Some(a) = all.get_mut(&from) else {
            return Err(refused(format!("from node {from} at offset {offset}, with no snapshot begun")));
        };
        if a.id != id || a.total != total || a.data.len() as u64 != offset {
            let got = format!("snapshot {id:?} of {total} bytes at offset {offset}");
            let want = format!("snapshot {:?} of {} bytes at offset {}", a.id, a.total, a.data.len());
            all.remove(&from);
            return Err(refused(format!("from node {from}: {got}, expected {want}")));
        }
        if offset + data.len() as u64 > total {
            all.remove(&from);
            return Err(refused(format!("from node {from} passes the {total} bytes announced")));
        }
        a.data.extend_from_slice(data);
        a.last = now;
        Ok(())
    }

    /// The whole data of snapshot `id` from `from`, if every byte of it arrived; it is
    /// forgotten either way.
    pub fn take(&self, from: NodeId, id: SnapshotId) -> Result<Vec<u8>, ConsensusError> {
        let a = self.0.lock().expect("assemblies lock").remove(&from);
        match a {
            Some(a) if a.id == id && a.data.len() as u64 == a.total => Ok(a.data),
            Some(a) => Err(refused(format!(
                "node {from}'s snapshot {id:?} is not whole: {} of {} bytes of {:?} arrived",
                a.data.len(),
                a.total,
                a.id
            ))),
            None => Err(refused(format!("node {from}'s snapshot {id:?}: no chunk arrived"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_in_order_make_the_whole_snapshot_and_anything_else_is_refused() {
        let a = Assemblies::default();
        let id = (10, 2);
        a.add(1, id, 0, 5, b"abc").unwrap();
        a.add(1, id, 3, 5, b"de").unwrap();
        assert_eq!(a.take(1, id).unwrap(), b"abcde");
        // Taken once.
        assert!(a.take(1, id).is_err());
        // Out of order, another snapshot, past the total, too large: refused, and forgotten.
        a.add(1, id, 0, 5, b"abc").unwrap();
        assert!(a.add(1, id, 4, 5, b"e").is_err());
        assert!(a.add(1, id, 3, 5, b"de").is_err(), "a refused chunk leaves nothing to add to");
        a.add(1, id, 0, 5, b"abc").unwrap();
        assert!(a.add(1, (11, 2), 3, 5, b"de").is_err());
        a.add(1, id, 0, 5, b"abc").unwrap();
        assert!(a.add(1, id, 3, 5, b"def").is_err());
        assert!(a.add(1, id, 0, MAX_SNAPSHOT_BYTES + 1, b"a").is_err());
        assert!(a.add(1, id, 0, 5, b"").is_err());
        assert!(a.add(1, id, 7, 9, b"a").is_err(), "no snapshot begun");
        // Not whole: refused; senders are kept apart; starting again drops the old one.
        a.add(1, id, 0, 5, b"abc").unwrap();
        a.add(2, id, 0, 2, b"xy").unwrap();
        assert!(a.add(3, id, 0, 2, b"xy").is_err(), "a third sender at once");
        assert!(a.take(1, id).is_err());
        assert_eq!(a.take(2, id).unwrap(), b"xy");
        a.add(3, id, 0, 4, b"ab").unwrap();
        a.add(3, (12, 3), 0, 2, b"zz").unwrap();
        assert_eq!(a.take(3, (12, 3)).unwrap(), b"zz");
    }

    proptest::proptest! {
        /// Any sequence of chunks from hostile or confused senders: nothing panics, no
        /// sender's assembly passes its announced size, and a snapshot taken whole is
        /// exactly the chunks accepted for it since its offset 0, in order.
        #[test]
        fn any_chunks_give_whole_snapshots_or_refusals(
            ops in proptest::collection::vec(
                (1u64..=2, 0u64..2, 0u64..12, 1u64..12, proptest::collection::vec(0u8..255, 0..6), proptest::bool::ANY),
                0..60,
            )
        ) {
            let a = Assemblies::default();
            let mut model: HashMap<NodeId, (SnapshotId, u64, Vec<u8>)> = HashMap::new();
            for (from, index, offset, total, data, take) in ops {
                let id = (index, 1);
                if take {
                    let want = model.remove(&from).filter(|(i, t, d)| *i == id && d.len() as u64 == *t);
                    proptest::prop_assert_eq!(a.take(from, id).ok(), want.map(|(_, _, d)| d));
                    continue;
                }
                let ok = a.add(from, id, offset, total, &data).is_ok();
                let expect = !data.is_empty() && match (offset, model.get(&from)) {
                    (0, _) => data.len() as u64 <= total,
                    (_, Some((i, t, d))) => *i == id && *t == total && d.len() as u64 == offset
                        && offset + data.len() as u64 <= total,
                    (_, None) => false,
                };
                proptest::prop_assert_eq!(ok, expect);
                if ok {
                    let e = model.entry(from).or_insert((id, total, Vec::new()));
                    if offset == 0 {
                        *e = (id, total, Vec::new());
                    }
                    e.2.extend_from_slice(&data);
                } else if !data.is_empty() {
                    model.remove(&from);
                }
            }
        }
    }

    #[test]
    fn only_a_lone_snapshot_past_one_chunk_is_chunked() {
        let snap = |len: usize| {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgSnapshot);
            m.mut_snapshot().data = vec![7; len];
            m
        };
        let other = Message::default();
        assert_eq!(chunked_snapshot(&[other.clone(), snap(9)], 8), Some(1));
        assert_eq!(chunked_snapshot(&[snap(8)], 8), None);
        assert_eq!(chunked_snapshot(&[snap(9), snap(9)], 8), None);
        assert_eq!(chunked_snapshot(&[other], 8), None);
    }
}

//! raft-rs's messages and records to and from bytes, through prost (raft-rs's `prost-codec`):
//! every raft message a peer sends and every record read back from the log passes through
//! here. prost bounds recursion instead of overflowing the stack on crafted input; it also
//! keeps an enum field as the number that was sent, and raft-rs's accessors panic on a number
//! that names no variant, so a message or entry is checked for those before anyone reads it.

use raft::eraftpb::{
    ConfChange, ConfChangeTransition, ConfChangeType, ConfChangeV2, Entry, EntryType, Message, MessageType,
};

pub use raft_prost::DecodeError;

/// Decodes one raft-rs type (a hard state, a snapshot: types without enum fields; messages
/// and entries go through [`decode_message`] and [`decode_entry`]).
pub fn decode<M: raft_prost::Message + Default>(bytes: &[u8]) -> Result<M, DecodeError> {
    M::decode(bytes)
}

/// Encodes one raft-rs type.
pub fn encode<M: raft_prost::Message>(m: &M) -> Vec<u8> {
    m.encode_to_vec()
}

/// Its encoded size, as raft-rs counts entry sizes.
pub fn size<M: raft_prost::Message>(m: &M) -> u64 {
    m.encoded_len() as u64
}

/// Why bytes from a peer or the log are not a raft message or entry raft-rs can read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// The bytes are not the protobuf they claim to be.
    #[error("{0}")]
    Decode(#[from] DecodeError),
    /// A message type that names no variant.
    #[error("message type {0} is none of raft's")]
    MessageType(i32),
    /// An entry type that names no variant.
    #[error("entry type {0} is none of raft's")]
    EntryType(i32),
    /// A configuration change entry whose data does not decode.
    #[error("configuration change: {0}")]
    ConfChange(DecodeError),
    /// A configuration change type that names no variant.
    #[error("configuration change type {0} is none of raft's")]
    ChangeType(i32),
    /// A configuration transition that names no variant.
    #[error("configuration transition {0} is none of raft's")]
    Transition(i32),
    /// One of a message's entries is refused.
    #[error("entry {index}: {source}")]
    InEntry {
        /// The entry's log index.
        index: u64,
        /// Why it is refused.
        source: Box<CodecError>,
    },
}

/// Decodes a raft message whose every enum (its type, its entries' types, their
/// configuration changes') names a variant.
pub fn decode_message(bytes: &[u8]) -> Result<Message, CodecError> {
    let m: Message = decode(bytes)?;
    check_message(&m)?;
    Ok(m)
}

/// Decodes a log entry, checked like a message's.
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, CodecError> {
    let e: Entry = decode(bytes)?;
    check_entry(&e)?;
    Ok(e)
}

/// Whether raft-rs can read every enum of `m` without panicking.
pub fn check_message(m: &Message) -> Result<(), CodecError> {
    if MessageType::from_i32(m.msg_type).is_none() {
        return Err(CodecError::MessageType(m.msg_type));
    }
    for e in &m.entries {
        check_entry(e).map_err(|d| CodecError::InEntry { index: e.index, source: Box::new(d) })?;
    }
    Ok(())
}

/// Whether raft-rs can read every enum of `e` (and of the configuration change it carries)
/// without panicking.
pub fn check_entry(e: &Entry) -> Result<(), CodecError> {
    let kind = EntryType::from_i32(e.entry_type).ok_or(CodecError::EntryType(e.entry_type))?;
    let change = |t: i32| ConfChangeType::from_i32(t).map(|_| ()).ok_or(CodecError::ChangeType(t));
    match kind {
        EntryType::EntryNormal => Ok(()),
        EntryType::EntryConfChange => {
            let cc: ConfChange = decode(&e.data).map_err(CodecError::ConfChange)?;
            change(cc.change_type)
        }
        EntryType::EntryConfChangeV2 => {
            let cc: ConfChangeV2 = decode(&e.data).map_err(CodecError::ConfChange)?;
            if ConfChangeTransition::from_i32(cc.transition).is_none() {
                return Err(CodecError::Transition(cc.transition));
            }
            cc.changes.iter().try_for_each(|c| change(c.change_type))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_that_name_no_variant_are_refused_before_raft_reads_them() {
        let mut m = Message { msg_type: 99, ..Default::default() };
        assert!(decode_message(&encode(&m)).unwrap_err().to_string().contains("message type 99"));
        m.msg_type = MessageType::MsgAppend as i32;
        m.entries = vec![Entry { entry_type: 7, index: 5, ..Default::default() }];
        assert!(decode_message(&encode(&m)).unwrap_err().to_string().contains("entry 5: entry type 7"));
        let cc = ConfChangeV2 { transition: 9, ..Default::default() };
        m.entries = vec![Entry {
            entry_type: EntryType::EntryConfChangeV2 as i32,
            data: encode(&cc),
            ..Default::default()
        }];
        assert!(decode_message(&encode(&m)).unwrap_err().to_string().contains("transition 9"));
        let cc = ConfChange { change_type: 4, ..Default::default() };
        let e =
            Entry { entry_type: EntryType::EntryConfChange as i32, data: encode(&cc), ..Default::default() };
        assert!(decode_entry(&encode(&e)).unwrap_err().to_string().contains("change type 4"));
        let ok = Entry {
            entry_type: EntryType::EntryConfChange as i32,
            data: encode(&ConfChange::default()),
            ..Default::default()
        };
        assert_eq!(decode_entry(&encode(&ok)).unwrap(), ok);
    }

    #[test]
    fn deeply_nested_unknown_groups_are_an_error_not_a_stack_overflow() {
        // RUSTSEC-2024-0437: rust-protobuf 2 skipped nested unknown groups by recursing
        // without a limit. Field 1000, "start group", a hundred thousand times over: prost
        // stops at its recursion limit.
        let tag = (1000u32 << 3) | 3;
        let mut bytes = Vec::new();
        for _ in 0..100_000 {
            bytes.extend_from_slice(&[(tag as u8 & 0x7f) | 0x80, (tag >> 7) as u8]);
        }
        let e = decode_message(&bytes).unwrap_err().to_string();
        assert!(e.contains("recursion"), "{e}");
    }
}

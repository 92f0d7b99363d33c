//! The data plane's frame header and handshake messages, as fixed-size little-endian
//! records. Every decoder here reads bytes that come from the network and is fuzzed
//! (`fuzz/fuzz_targets/dataplane_frame.rs`) and property-tested.

use crate::dataplane::DataPlaneError;

/// First bytes of every header and hello: "LMPD".
pub const MAGIC: [u8; 4] = *b"LMPD";
/// Protocol version spoken by this build.
pub const VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 32;
/// Largest payload one frame may carry.
pub const MAX_PAYLOAD: u32 = 16 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A chunk of a collective's buffer.
    Data = 1,
    /// The sender gave up on the collective (it saw an error); the receiver must too.
    Abort = 2,
}

/// A frame header: which collective (epoch, step, sequence number) and how many bytes follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What follows.
    pub kind: Kind,
    /// The epoch the sender is in.
    pub epoch: u64,
    /// The training step.
    pub step: u64,
    /// The collective's number within this group (0, 1, ...).
    pub seq: u32,
    /// Payload bytes after the header.
    pub len: u32,
}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.epoch.to_le_bytes());
        b[16..24].copy_from_slice(&self.step.to_le_bytes());
        b[24..28].copy_from_slice(&self.seq.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header, refusing bad magic, unknown kinds, nonzero padding and oversized
    /// payloads.
    pub fn decode(b: &[u8]) -> Result<Header, DataPlaneError> {
        let bad = |d: String| DataPlaneError::Protocol(format!("frame header: {d}"));
        if b.len() != HEADER_LEN {
            return Err(bad(format!("{} bytes, expected {HEADER_LEN}", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(bad(format!("magic {:02x?}", &b[..4])));
        }
        let kind = match b[4] {
            1 => Kind::Data,
            2 => Kind::Abort,
            k => return Err(bad(format!("unknown kind {k}"))),
        };
        if b[5..8] != [0, 0, 0] {
            return Err(bad("nonzero padding".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let len = u32_at(28);
        if len > MAX_PAYLOAD {
            return Err(bad(format!("payload of {len} bytes (at most {MAX_PAYLOAD})")));
        }
        Ok(Header { kind, epoch: u64_at(8), step: u64_at(16), seq: u32_at(24), len })
    }
}

/// Which use a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The ring of a collective group (from the left neighbour).
    Ring,
    /// State handoff.
    Handoff,
    /// Activations and their gradients between neighbouring pipeline stages (from the
    /// previous stage).
    Pipe,
    /// Another lane of the ring (1 to [`MAX_LANES`] - 1): a host of several local ranks
    /// drives one ring per local rank between the hosts, each on its part of a buffer.
    Lane(u8),
    /// Another pipe link between the same neighbouring stages (1 to [`MAX_LANES`] - 1): in a
    /// pipeline of hosts of several local ranks, local rank `k` of a stage's host is a
    /// replica of its own, linked to local rank `k` of the next stage's host.
    PipeLane(u8),
    /// A link of a group's butterfly, both ways between two ranks, that small collectives
    /// take in log2(W) rounds instead of the ring's 2(W-1) hops (`ring/tree.rs`).
    Tree,
    /// The ring of a group's ranks in one zone (from the left neighbour in the zone), the
    /// first level of a large reduction across zones (`ring/levels.rs`).
    Zone,
    /// The ring of the ranks of the same place in each zone (from the left neighbour across
    /// zones), the second level (`ring/levels.rs`).
    Across,
}

/// Most ring lanes between two hosts (the ring itself is lane 0): one per local rank of the
/// hosts with the fewest, as NCCL runs several channels; eight GPUs a host is the most the
/// hosts limpet runs on have.
pub const MAX_LANES: usize = 8;

impl Channel {
    /// The ring's lane `lane` (the ring itself for 0); `None` past [`MAX_LANES`].
    pub fn lane(lane: usize) -> Option<Channel> {
        match lane {
            0 => Some(Channel::Ring),
            l if l < MAX_LANES => Some(Channel::Lane(l as u8)),
            _ => None,
        }
    }

    /// Pipe link `lane` between two stages (the pipe itself for 0); `None` past
    /// [`MAX_LANES`].
    pub fn pipe(lane: usize) -> Option<Channel> {
        match lane {
            0 => Some(Channel::Pipe),
            l if l < MAX_LANES => Some(Channel::PipeLane(l as u8)),
            _ => None,
        }
    }

    /// The hello's channel byte and lane byte. (A lane is made by [`Channel::lane`] or
    /// [`Channel::pipe`]: lane 0 is the ring or the pipe and travels as it, a lane past the
    /// most would be refused by every peer.)
    fn code(self) -> (u8, u8) {
        debug_assert!(
            !matches!(self, Channel::Lane(l) | Channel::PipeLane(l) if l == 0 || usize::from(l) >= MAX_LANES),
            "{self:?} is not a lane: use Channel::lane or Channel::pipe"
        );
        match self {
            Channel::Ring => (1, 0),
            Channel::Handoff => (2, 0),
            Channel::Pipe => (3, 0),
            Channel::Lane(l) => (1, l),
            Channel::PipeLane(l) => (3, l),
            Channel::Tree => (4, 0),
            Channel::Zone => (5, 0),
            Channel::Across => (6, 0),
        }
    }
}

/// Most dimensions a tensor sent between stages may have.
pub const MAX_DIMS: usize = 8;
/// Most bytes one tensor sent between stages may have (it travels in several frames).
pub const MAX_TENSOR_BYTES: u64 = 1 << 32;

/// Encodes the shape frame that precedes a tensor's values: the number of dimensions
/// (u32), 4 zero bytes, then each dimension (i64), little-endian.
pub fn encode_shape(shape: &[i64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + 8 * shape.len());
    b.extend_from_slice(&(shape.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    for d in shape {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b
}

/// Decodes a shape frame, refusing more than [`MAX_DIMS`] dimensions, negative ones, a
/// length that does not match, and tensors over [`MAX_TENSOR_BYTES`] of f32 values.
pub fn decode_shape(b: &[u8]) -> Result<Vec<i64>, DataPlaneError> {
    let bad = |d: String| DataPlaneError::Protocol(format!("tensor shape: {d}"));
    if b.len() < 8 {
        return Err(bad(format!("{} bytes, at least 8 expected", b.len())));
    }
    let n = u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as usize;
    if n > MAX_DIMS {
        return Err(bad(format!("{n} dimensions (at most {MAX_DIMS})")));
    }
    if b[4..8] != [0; 4] {
        return Err(bad("nonzero padding".into()));
    }
    if b.len() != 8 + 8 * n {
        return Err(bad(format!("{} bytes for {n} dimensions", b.len())));
    }
    let dims: Vec<i64> =
        b[8..].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    let mut bytes: u64 = 4;
    for &d in &dims {
        if d < 0 {
            return Err(bad(format!("negative dimension {d}")));
        }
        bytes = bytes.saturating_mul(d as u64);
    }
    if bytes > MAX_TENSOR_BYTES {
        return Err(bad(format!("{dims:?} is {bytes} bytes (at most {MAX_TENSOR_BYTES})")));
    }
    Ok(dims)
}

/// Bytes of a `Hello`.
pub const HELLO_LEN: usize = 56;

/// What a connecting peer says first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The cluster's id (hash of its name).
    pub cluster_id: u64,
    /// The connecting node.
    pub node: u64,
    /// The epoch it connects for.
    pub epoch: u64,
    /// What the connection is for.
    pub channel: Channel,
    /// Fresh randomness, so a recorded handshake cannot be replayed.
    pub nonce: [u8; 16],
}

impl Hello {
    /// Encodes the hello.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        (b[6], b[7]) = self.channel.code();
        b[8..16].copy_from_slice(&self.cluster_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.node.to_le_bytes());
        b[24..32].copy_from_slice(&self.epoch.to_le_bytes());
        b[32..48].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes a hello, refusing other magics, versions and channels.
    pub fn decode(b: &[u8]) -> Result<Hello, DataPlaneError> {
        let bad = |d: String| DataPlaneError::Protocol(format!("hello: {d}"));
        if b.len() != HELLO_LEN {
            return Err(bad(format!("{} bytes, expected {HELLO_LEN}", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(bad(format!("magic {:02x?} (not a limpet data-plane peer)", &b[..4])));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(bad(format!("protocol version {version} (this build speaks {VERSION})")));
        }
        let channel = match (b[6], b[7]) {
            (1, 0) => Channel::Ring,
            (1, l) if usize::from(l) < MAX_LANES => Channel::Lane(l),
            (1, l) => return Err(bad(format!("ring lane {l} (at most {})", MAX_LANES - 1))),
            (2, 0) => Channel::Handoff,
            (3, 0) => Channel::Pipe,
            (3, l) if usize::from(l) < MAX_LANES => Channel::PipeLane(l),
            (3, l) => return Err(bad(format!("pipe lane {l} (at most {})", MAX_LANES - 1))),
            (4, 0) => Channel::Tree,
            (5, 0) => Channel::Zone,
            (6, 0) => Channel::Across,
            (2 | 4 | 5 | 6, l) => return Err(bad(format!("lane {l} of a channel that has none"))),
            (c, _) => return Err(bad(format!("unknown channel {c}"))),
        };
        if b[48..] != [0u8; 8] {
            return Err(bad("nonzero padding".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let nonce = b[32..48].try_into().expect("16 bytes");
        Ok(Hello { cluster_id: u64_at(8), node: u64_at(16), epoch: u64_at(24), channel, nonce })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_refusals() {
        let h = Header { kind: Kind::Data, epoch: 3, step: 9, seq: 2, len: 4096 };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().to_string().contains("magic"));
        let mut big = h.encode();
        big[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Header::decode(&big).unwrap_err().to_string().contains("payload"));
    }
}

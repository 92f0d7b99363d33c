//! Entering an epoch, the decisions: what a rank can serve another (one training state's
//! step, content hash and blocks), how every rank's published states travel (`wire`), and
//! from them who copies what from whom (`plan`). The agent executes the plan.

pub mod plan;
pub mod wire;

/// One state a rank can serve: its step, content hash and blocks `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// The step the state is at (the next step it would train).
    pub step: u64,
    /// Its content hash.
    pub hash: [u8; 32],
    /// The model blocks it holds.
    pub blocks: (usize, usize),
}

impl Desc {
    /// Whether this state holds `block`.
    pub fn holds(&self, block: usize) -> bool {
        (self.blocks.0..self.blocks.1).contains(&block)
    }
}

/// A content hash's hex text as bytes (zeros where the text is not hex).
pub fn hash_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = hex.get(2 * i..2 * i + 2).and_then(|x| u8::from_str_radix(x, 16).ok()).unwrap_or(0);
    }
    out
}

/// A content hash's bytes as hex text.
pub fn hex_of(h: &[u8; 32]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `n`'s groups connect a butterfly for small collectives: only when the host of
/// every rank says its data plane takes one. A host of an older build refuses the links, and
/// a cluster upgraded host by host must keep forming its groups meanwhile. Every rank reads
/// the same records (a member's record changes when it joins, before any epoch counts it).
pub fn butterfly(st: &limpet_consensus::state::ClusterState, n: &limpet_consensus::state::Epoch) -> bool {
    n.ranks.iter().all(|r| st.members.get(r).is_some_and(|m| m.spec.hardware.butterfly))
}

/// Each rank's zone (`[node].zone`, in rank order) when `n`'s hosts span several zones and
/// every rank's host takes large reductions in two levels (as [`butterfly`], an older host
/// refuses their links); `None` otherwise, when the epoch's reductions keep the flat ring.
/// A host that names no zone is in the zone of the others that name none.
pub fn zone_levels(
    st: &limpet_consensus::state::ClusterState,
    n: &limpet_consensus::state::Epoch,
) -> Option<Vec<String>> {
    let hw: Vec<_> =
        n.ranks.iter().map(|r| st.members.get(r).map(|m| &m.spec.hardware)).collect::<Option<_>>()?;
    if !hw.iter().all(|h| h.zone_levels) {
        return None;
    }
    let zones: Vec<String> = hw.iter().map(|h| h.zone.clone()).collect();
    let first = zones.first()?;
    let several = zones.iter().any(|z| z != first);
    let shared = zones.iter().enumerate().any(|(i, z)| zones[..i].contains(z));
    (several && shared).then_some(zones)
}

/// The block a state tensor belongs to: `param/bNN.x` and `optim/<slot>/bNN.x` are block NN's.
pub fn block_of(name: &str) -> Option<usize> {
    let leaf = name.rsplit('/').next()?;
    let digits = leaf.strip_prefix('b')?.split('.').next()?;
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn hashes_round_trip_through_hex() {
        let hex = "00ff10203040506070808090a0b0c0d0e0f0112233445566778899aabbccddee";
        assert_eq!(super::hex_of(&super::hash_bytes(hex)), hex);
    }
}

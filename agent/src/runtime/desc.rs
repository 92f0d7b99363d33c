//! What a rank can serve another: one training state's step, content hash and blocks. The
//! entry protocol publishes these; snapshots and shadows are kept with them.

/// One state a rank can serve: its step, content hash and blocks `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub step: u64,
    pub hash: [u8; 32],
    pub blocks: (usize, usize),
}

impl Desc {
    /// Whether this state holds `block`.
    pub fn holds(&self, block: usize) -> bool {
        (self.blocks.0..self.blocks.1).contains(&block)
    }
}

/// A content hash's hex text as bytes (zeros where the text is not hex).
pub(crate) fn hash_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = hex.get(2 * i..2 * i + 2).and_then(|x| u8::from_str_radix(x, 16).ok()).unwrap_or(0);
    }
    out
}

/// A content hash's bytes as hex text.
pub(crate) fn hex_of(h: &[u8; 32]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn hashes_round_trip_through_hex() {
        let hex = "00ff10203040506070808090a0b0c0d0e0f0112233445566778899aabbccddee";
        assert_eq!(super::hex_of(&super::hash_bytes(hex)), hex);
    }
}

//! The relay: each piece of a buffer copied from its giver to the ranks that take it, along
//! the ring only as far as its last taker (a re-cut of sharded state moves each value to
//! the ranks that keep it, not through an allreduce to every rank).

use super::{Group, Op, Plan, RecvItem, SendItem};
use crate::dataplane::DataPlaneError;
use std::ops::Range;

impl Group {
    /// Copies each piece's values (giver, range, the ranks that take them) from its giver's
    /// `buf` into the `buf` of every rank that takes them, bit for bit. A piece travels right from its giver, chunk by chunk, through the
    /// ranks between it and its furthest taker, each copying the chunk as it passes (so
    /// `buf` outside what this rank gives or takes is left undefined) and sending it on as
    /// soon as it is whole. Every rank calls this with the same pieces.
    pub fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[(usize, Range<usize>, &[usize])],
        step: u64,
    ) -> Result<(), DataPlaneError> {
        self.check()?;
        let (w, r) = (self.world(), self.rank);
        for (giver, range, to) in pieces {
            if *giver >= w || range.start > range.end || range.end > buf.len() || to.iter().any(|&t| t >= w) {
                return Err(DataPlaneError::Config(format!(
                    "a relay piece from rank {giver} of values {range:?} to ranks {to:?}: a world of {w}, a buffer of {}",
                    buf.len()
                )));
            }
        }
        if w == 1 {
            return Ok(());
        }
        let mut plan = Plan::default();
        for (giver, range, to) in pieces {
            let hops = |j: usize| (j + w - giver) % w;
            let far = to.iter().map(|&j| hops(j)).max().unwrap_or(0);
            let k = hops(r);
            if far == 0 || k > far {
                continue;
            }
            for range in self.chunks(range.clone(), 0) {
                let after = (k > 0).then(|| {
                    plan.recvs.push(RecvItem { range: range.clone(), op: Op::Copy, round: false });
                    plan.recvs.len() - 1
                });
                if k < far {
                    plan.sends.push(SendItem { range, after });
                }
            }
        }
        self.run(&plan, buf, step, "relay")
    }
}

//! How gradients are cut into buckets (DDP's `bucket_cap_mb`): the values per bucket, and a
//! bucket's share of each block. The overlapped step and sharded state's gathers both cut by
//! them.

use std::ops::Range;

/// Values per bucket: 25 MB of f32, DDP's default `bucket_cap_mb`. Fewer, larger buckets
/// cost fewer ring rounds; smaller ones start the reduction sooner.
pub(crate) const BUCKET_VALUES: usize = 25 * (1 << 20) / 4;

#[cfg(test)]
thread_local! {
    /// Tests cut small models into several buckets.
    static CAP: std::cell::Cell<usize> = const { std::cell::Cell::new(BUCKET_VALUES) };
}

/// Cuts this thread's steps into buckets (and sharded gradients' gathers into windows) of
/// `values` values, so that tests of small models see several.
#[cfg(test)]
pub(crate) fn set_bucket_values(values: usize) {
    CAP.with(|c| c.set(values));
}

pub(super) fn bucket_values() -> usize {
    #[cfg(test)]
    return CAP.with(|c| c.get());
    #[cfg(not(test))]
    BUCKET_VALUES
}

/// Each of `blocks` (which tile a buffer) cut to `range` and counted from its start: blocks
/// that tile `range`, some of them empty.
pub(super) fn within(blocks: &[Range<usize>], range: Range<usize>) -> Vec<Range<usize>> {
    blocks
        .iter()
        .map(|b| {
            let (lo, hi) = (b.start.clamp(range.start, range.end), b.end.clamp(range.start, range.end));
            lo - range.start..hi - range.start
        })
        .collect()
}

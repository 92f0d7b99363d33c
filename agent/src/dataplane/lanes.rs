//! A ring's other lanes: for hosts of several local ranks, one more ring per lane between
//! the same hosts in the same order, each its own pair of TCP connections
//! ([`Channel::Lane`]), so the local ranks take their parts of a buffer between the hosts at
//! once (as NCCL runs several channels) instead of one socket carrying all of it.

use crate::dataplane::frame::{Channel, MAX_LANES};
use crate::dataplane::ring::Group;
use crate::dataplane::{DataPlaneError, Endpoint};
use std::time::Instant;

/// Connects lanes `1..count` of `epoch`'s ring (`ranks` in rank order, their data
/// `addrs`): every rank calls it with the same count after the ring itself formed. Each lane
/// is a [`Group`] of its own. Waits for the left neighbours' connections until `deadline`,
/// giving up early when `abort` says so.
pub fn connect(
    ep: &Endpoint,
    epoch: u64,
    ranks: &[u64],
    addrs: &[String],
    count: usize,
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Vec<Group>, DataPlaneError> {
    if count > MAX_LANES {
        return Err(DataPlaneError::Config(format!("{count} ring lanes (at most {MAX_LANES})")));
    }
    let lane = |k: usize| Channel::lane(k).expect("lanes below MAX_LANES");
    let (right, left) = Group::neighbours(ep, ranks, addrs)?;
    let (Some(right), Some(left)) = (right, left) else {
        // A world of one: lanes with nothing to cross, as its ring.
        return (1..count).map(|_| Group::assemble(ep, epoch, ranks, None, None)).collect();
    };
    // Every connection out first: the right neighbour's endpoint answers each handshake on
    // its own threads, so no rank waits for another's accept before its own.
    let connect_by = deadline.min(Instant::now() + ep.config().timeout);
    let outs = (1..count)
        .map(|k| ep.connect_until(&addrs[right], ranks[right], epoch, lane(k), connect_by, abort))
        .collect::<Result<Vec<_>, _>>()?;
    outs.into_iter()
        .zip(1..count)
        .map(|(out, k)| {
            let inc = ep.accept_until(ranks[left], epoch, lane(k), deadline, abort)?;
            Group::assemble(ep, epoch, ranks, Some(out), Some(inc))
        })
        .collect()
}

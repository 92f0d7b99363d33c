//! Large reductions across failure domains in two levels: a ring inside each zone, a ring
//! across zones, then the zone's ring again.
//!
//! A flat ring over hosts in several zones (availability zones, racks) waits on a link
//! across zones at every one of its 2(W-1) steps, and only the few links where the ring
//! crosses a zone boundary carry anything across. Here a reduction runs in three passes:
//! a reduce-scatter on the ring of the rank's zone leaves each of the zone's first `m` ranks
//! (`m`: the smallest zone's size) with one of `m` segments summed over the zone; the ranks
//! of the same place in every zone allreduce their segment on a ring across zones; an
//! allgather on the zone's ring gives every rank every segment. A zone's ranks past `m` own
//! empty segments: they add theirs into the others' and take the result. So the cross-zone
//! latency is paid 2(Z-1) times instead of 2(W-1), and `m` links per zone carry a segment
//! each across at once.
//!
//! Every segment is summed in one order inside each zone, once across zones, then copied, so
//! every rank ends with the same bits, as on the flat ring; i64 sums (a reproducible job's
//! fixed-point gradients) are exact in any order, so they are the flat ring's to the bit.
//! f32 sums are added in another order than the flat ring's.

use super::{Group, Op};
use crate::dataplane::frame::Channel;
use crate::dataplane::{DataPlaneError, Endpoint};
use std::ops::Range;
use std::time::Instant;

/// The step the levels' first count travels as (no step of training is numbered so).
const LEVELS_CHECK_STEP: u64 = u64::MAX - 1;

/// A rank's two levels: its zone's ring and (for the first `segments` ranks of each zone)
/// the ring across zones.
pub(crate) struct Levels {
    zone: Group,
    across: Option<Group>,
    /// This rank's place in its zone (its index on the zone's ring).
    place: usize,
    /// Segments a buffer is cut into: the smallest zone's size.
    segments: usize,
}

/// The zones' members as positions in rank order, zones in the order their first rank
/// comes: what every rank computes alike from the same list.
pub fn zone_members(zones: &[String]) -> Vec<Vec<usize>> {
    let mut order: Vec<&str> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (i, z) in zones.iter().enumerate() {
        match order.iter().position(|o| *o == z.as_str()) {
            Some(k) => members[k].push(i),
            None => {
                order.push(z);
                members.push(vec![i]);
            }
        }
    }
    members
}

/// Whether a group whose ranks lie in `zones` gains from two levels: at least two zones, and
/// a zone of more than one rank (with one rank a zone, the ring across zones is the flat
/// ring).
pub fn spans_zones(zones: &[String]) -> bool {
    let members = zone_members(zones);
    members.len() >= 2 && members.iter().any(|m| m.len() >= 2)
}

/// Rank `place`'s block of a zone's reduce-scatter over `n` units of `unit` words, cut into
/// `segments`: the segment of its place, empty (at the end) for places past them.
fn block(place: usize, n: usize, segments: usize, unit: usize) -> Range<usize> {
    if place >= segments {
        return unit * n..unit * n;
    }
    unit * (place * n / segments)..unit * ((place + 1) * n / segments)
}

impl Group {
    /// Connects this rank's two levels when the group's ranks span several zones (`zones`:
    /// each rank's, in rank order; [`spans_zones`]); the reductions the butterfly does not
    /// take run over them from then on. Every rank calls it with the same list after the ring
    /// formed: the zone's ring first, then the ring across zones, each connection out before
    /// its accept, then a count of the ranks over both levels, so that a rank that did not
    /// connect them fails this call on every rank rather than a later reduction.
    pub fn connect_levels(
        &mut self,
        ep: &Endpoint,
        addrs: &[String],
        zones: &[String],
        (deadline, abort): (Instant, &dyn Fn() -> bool),
    ) -> Result<(), DataPlaneError> {
        let w = self.world();
        if zones.len() != w || addrs.len() != w {
            return Err(DataPlaneError::Config(format!(
                "{w} ranks but {} zones and {} addresses",
                zones.len(),
                addrs.len()
            )));
        }
        if !spans_zones(zones) || self.levels.is_some() {
            return Ok(());
        }
        let members = zone_members(zones);
        let segments = members.iter().map(Vec::len).min().expect("two zones or more");
        let mine = members.iter().find(|m| m.contains(&self.rank)).expect("every rank has a zone");
        let place = mine.iter().position(|&i| i == self.rank).expect("in its zone");
        let sub = |of: &[usize], channel| {
            let ranks: Vec<u64> = of.iter().map(|&i| self.ranks[i]).collect();
            let at: Vec<String> = of.iter().map(|&i| addrs[i].clone()).collect();
            Group::connect_on(ep, self.epoch, &ranks, &at, (deadline, abort), channel)
        };
        let mut zone = sub(mine, Channel::Zone)?;
        zone.label = "zone ";
        let across = if place < segments {
            let same: Vec<usize> = members.iter().map(|m| m[place]).collect();
            let mut g = sub(&same, Channel::Across)?;
            g.label = "across-zone ";
            Some(g)
        } else {
            None
        };
        let mut levels = Levels { zone, across, place, segments };
        levels.set_patience(self.timeout);
        self.levels = Some(Box::new(levels));
        let mut one = [1.0f32];
        self.levels_reduce(&mut one, (1, Op::Add), 0, LEVELS_CHECK_STEP)?;
        if one[0] != w as f32 {
            let e = DataPlaneError::Protocol(format!("the two levels counted {} of {w} ranks", one[0]));
            self.break_group(&e, LEVELS_CHECK_STEP, self.seq);
            return Err(e);
        }
        Ok(())
    }

    /// Whether this group has two levels across zones ([`Group::connect_levels`]): its
    /// reductions that the butterfly does not take run over them.
    pub fn has_levels(&self) -> bool {
        self.levels.is_some()
    }

    /// Sums every rank's `buf` (`unit` words an element, added with `add`, `buf[..lossy]`
    /// in bfloat16) over the two levels; on a failure the whole group breaks, as a failure of
    /// its ring breaks it.
    pub(super) fn levels_reduce(
        &mut self,
        buf: &mut [f32],
        (unit, add): (usize, Op),
        lossy: usize,
        step: u64,
    ) -> Result<(), DataPlaneError> {
        let lv = self.levels.as_deref_mut().expect("levels_reduce without levels");
        let n = buf.len() / unit;
        let blocks: Vec<Range<usize>> =
            (0..lv.zone.world()).map(|p| block(p, n, lv.segments, unit)).collect();
        let own = block(lv.place, n, lv.segments, unit);
        let done = lv
            .zone
            .reduce_scatter_with(buf, &blocks, 0, (add, lossy), step)
            .and_then(|()| match &mut lv.across {
                Some(across) => {
                    let part_lossy = lossy.clamp(own.start, own.end) - own.start;
                    across.allreduce_op(&mut buf[own.clone()], unit, add, part_lossy, step)
                }
                None => Ok(()),
            })
            .and_then(|()| lv.zone.allgather_op(buf, &blocks, lossy, step));
        if let Err(e) = &done {
            self.break_group(e, step, self.seq);
        }
        done
    }

    /// Clones of the levels' sockets (none without levels).
    pub(super) fn levels_sockets(&self) -> Vec<std::net::TcpStream> {
        self.levels.iter().flat_map(|l| l.groups().flat_map(Group::sockets)).collect()
    }

    /// Breaks the levels' rings with the group: their neighbours fail at once too.
    pub(super) fn break_levels(&mut self, e: &DataPlaneError, step: u64) {
        if let Some(l) = self.levels.as_deref_mut() {
            for g in [Some(&mut l.zone), l.across.as_mut()].into_iter().flatten() {
                if g.broken.is_none() {
                    let seq = g.seq;
                    g.break_group(e, step, seq);
                }
            }
        }
    }
}

impl Levels {
    fn groups(&self) -> impl Iterator<Item = &Group> {
        std::iter::once(&self.zone).chain(self.across.iter())
    }

    /// Sets both rings' patience (the group's, as [`Group::set_patience`] sets it).
    pub(super) fn set_patience(&mut self, timeout: std::time::Duration) {
        self.zone.set_patience(timeout);
        if let Some(a) = &mut self.across {
            a.set_patience(timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{block, spans_zones, zone_members};

    fn zones(z: &[&str]) -> Vec<String> {
        z.iter().map(|s| s.to_string()).collect()
    }

    /// Zones are listed in the order their first rank comes, each with its ranks in rank
    /// order; two levels only where they differ from the flat ring.
    #[test]
    fn zones_group_ranks_in_rank_order() {
        let z = zones(&["b", "a", "b", "c", "a"]);
        assert_eq!(zone_members(&z), vec![vec![0, 2], vec![1, 4], vec![3]]);
        assert!(spans_zones(&z));
        assert!(!spans_zones(&zones(&["a", "a", "a"])), "one zone");
        assert!(!spans_zones(&zones(&["a", "b", "c"])), "a rank a zone is the flat ring");
        assert!(!spans_zones(&[]));
    }

    /// The segments of a zone's places tile the buffer in whole units, the places past the
    /// smallest zone's size owning nothing.
    #[test]
    fn blocks_tile_the_buffer_in_whole_units() {
        for (n, segments, places, unit) in
            [(10, 3, 5, 1), (7, 2, 2, 2), (1, 4, 4, 1), (0, 2, 3, 2), (1000, 7, 9, 2)]
        {
            let blocks: Vec<_> = (0..places).map(|p| block(p, n, segments, unit)).collect();
            assert_eq!(blocks[0].start, 0);
            assert_eq!(blocks.last().unwrap().end, unit * n);
            for w in blocks.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{blocks:?}");
            }
            assert!(blocks.iter().all(|b| b.start % unit == 0 && b.end % unit == 0));
            assert!(blocks[segments.min(places)..].iter().all(|b| b.is_empty()));
        }
    }
}

//! What each rank states in a regroup: a typed record ([`RegroupFacts`]) and its wire form,
//! a fixed row of `i64` words that the group sums (every other rank adds zeros, so each
//! row arrives bit for bit). Decoding checks every field a peer controls before anything
//! uses it: a forged world or replica count cannot make a rank allocate or compute more than
//! these bounds allow.

use super::{held_ranges, RegroupError};
use bytemuck::{Pod, Zeroable};
use std::ops::Range;

/// The most ranks a layout in a row may have, and the most replicas: bounds on what a
/// peer's row can make this rank allocate and compute.
pub const MOST_RANKS: i64 = 1 << 16;
/// See [`MOST_RANKS`].
pub const MOST_REPLICAS: i64 = 64;

/// The row as it travels. Counts are as stated; "one up" fields are 0 for none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct Wire {
    /// The layout held (world 0: none): its tag, ranks, replicas and this rank in it.
    tag: i64,
    world: i64,
    replicas: i64,
    rank: i64,
    step: i64,
    pending: i64,
    /// The step whose norm it gathered last, one up, and the norm's bits.
    norm_step: i64,
    norm_bits: i64,
    whole: i64,
    /// Bit casts of u64s.
    cursor: i64,
    seed: i64,
    draws: i64,
    stale: i64,
    digest: [i64; 4],
    kept_sum: i64,
    /// The layout it keeps: its replicas one up (0: the whole state).
    target_replicas: i64,
    /// Block-holding ranks a host, of the layout held and of the one kept; places one up.
    per_host: i64,
    target_per_host: i64,
    place: i64,
    shards: i64,
    target_place: i64,
    target_shards: i64,
}

/// Words in a rank's row.
pub const WORDS: usize = std::mem::size_of::<Wire>() / 8;

/// A sharded layout a rank holds, as it states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLayout {
    /// The group (epoch) it is of.
    pub tag: u64,
    /// Ranks in it.
    pub world: usize,
    /// Other hosts' blocks each block-holding rank holds too (0 on one host).
    pub replicas: usize,
    /// This rank in it.
    pub rank: usize,
    /// Block-holding ranks a host.
    pub per_host: usize,
    /// This rank's place among the block-holding ranks (`None`: it owns an empty block).
    pub place: Option<usize>,
    /// Block-holding ranks in all.
    pub shards: usize,
}

/// The layout a rank keeps after the regroup (in the group's world).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptLayout {
    /// Replicas, as [`HeldLayout::replicas`].
    pub replicas: usize,
    /// Block-holding ranks a host.
    pub per_host: usize,
    /// This rank's place among them.
    pub place: Option<usize>,
    /// Block-holding ranks in all.
    pub shards: usize,
}

/// One rank's statement of its state at a regroup.
#[derive(Clone, Debug, PartialEq)]
pub struct RegroupFacts {
    /// The sharded layout it holds (`None`: no shard).
    pub layout: Option<HeldLayout>,
    /// Steps applied.
    pub step: u64,
    /// Its current step's gradient waits for the norm (the norm's allgather broke).
    pub pending: bool,
    /// The last norm it gathered, and the step it was for.
    pub last_norm: Option<(u64, f64)>,
    /// It holds a whole (unsharded) optimizer state.
    pub whole: bool,
    /// Its position in the data: samples consumed, the RNG's seed and draws.
    pub cursor: u64,
    /// See `cursor`.
    pub seed: u64,
    /// See `cursor`.
    pub draws: u64,
    /// Its parameters are not those of its step (their allgather broke).
    pub stale: bool,
    /// A digest of its parameters.
    pub digest: [u8; 32],
    /// It keeps the fixed-point sum of the reproducible step that brought it to its step.
    pub kept_sum: bool,
    /// The layout it keeps afterwards (`None`: the whole state).
    pub target: Option<KeptLayout>,
}

fn one_up(p: Option<usize>) -> i64 {
    p.map_or(0, |s| s as i64 + 1)
}

impl RegroupFacts {
    /// The row this rank puts in the group's sum.
    pub fn encode(&self) -> Vec<i64> {
        let mut w = Wire {
            step: self.step as i64,
            pending: i64::from(self.pending),
            whole: i64::from(self.whole),
            cursor: self.cursor as i64,
            seed: self.seed as i64,
            draws: self.draws as i64,
            stale: i64::from(self.stale),
            kept_sum: i64::from(self.kept_sum),
            ..Wire::default()
        };
        for (d, c) in w.digest.iter_mut().zip(self.digest.chunks(8)) {
            *d = i64::from_le_bytes(c.try_into().expect("8 bytes"));
        }
        if let Some((at, norm)) = self.last_norm {
            (w.norm_step, w.norm_bits) = (at as i64 + 1, norm.to_bits() as i64);
        }
        if let Some(l) = &self.layout {
            (w.tag, w.world, w.replicas, w.rank) =
                (l.tag as i64, l.world as i64, l.replicas as i64, l.rank as i64);
            (w.per_host, w.place, w.shards) = (l.per_host as i64, one_up(l.place), l.shards as i64);
        }
        if let Some(t) = &self.target {
            w.target_replicas = t.replicas as i64 + 1;
            (w.target_per_host, w.target_place, w.target_shards) =
                (t.per_host as i64, one_up(t.place), t.shards as i64);
        }
        bytemuck::cast_slice(std::slice::from_ref(&w)).to_vec()
    }

    /// A row back into a statement, every field checked, in a group of `group` ranks (which
    /// the layout kept must fit).
    pub fn decode(row: &[i64], group: usize) -> Result<Self, String> {
        if row.len() != WORDS {
            return Err(format!("{} values", row.len()));
        }
        let w: Wire = bytemuck::pod_read_unaligned(bytemuck::cast_slice(row));
        if !(0..=i64::MAX / 2).contains(&w.step) || w.norm_step < 0 || w.tag < 0 {
            return Err(format!("step {}, tag {}, norm step {}", w.step, w.tag, w.norm_step));
        }
        if [w.pending, w.whole, w.stale, w.kept_sum].iter().any(|f| !(0..=1).contains(f)) {
            return Err("a flag that is neither 0 nor 1".into());
        }
        if !(0..=MOST_REPLICAS + 1).contains(&w.target_replicas)
            || [w.target_per_host, w.target_shards].iter().any(|f| !(0..=MOST_RANKS).contains(f))
            || !(0..=MOST_RANKS + 1).contains(&w.target_place)
        {
            return Err(format!(
                "a target fact of {} (hosts of {} holding blocks, {} in all, this one {})",
                w.target_replicas, w.target_per_host, w.target_shards, w.target_place
            ));
        }
        let layout = match w.world {
            0 => None,
            world => {
                if !(1..=MOST_RANKS).contains(&world)
                    || !(0..world).contains(&w.rank)
                    || !(0..=MOST_REPLICAS).contains(&w.replicas)
                {
                    return Err(format!("rank {} of {world} with {} replicas", w.rank, w.replicas));
                }
                check_layout(world, [w.per_host, w.shards, w.place], w.replicas)?;
                Some(HeldLayout {
                    tag: w.tag as u64,
                    world: world as usize,
                    replicas: w.replicas as usize,
                    rank: w.rank as usize,
                    per_host: w.per_host as usize,
                    place: (w.place > 0).then(|| w.place as usize - 1),
                    shards: w.shards as usize,
                })
            }
        };
        let target = match w.target_replicas {
            0 => None,
            r => {
                let fits =
                    check_layout(group as i64, [w.target_per_host, w.target_shards, w.target_place], r - 1);
                fits.map_err(|e| format!("the layout it keeps: {e}"))?;
                Some(KeptLayout {
                    replicas: r as usize - 1,
                    per_host: w.target_per_host as usize,
                    place: (w.target_place > 0).then(|| w.target_place as usize - 1),
                    shards: w.target_shards as usize,
                })
            }
        };
        let mut digest = [0u8; 32];
        for (c, d) in digest.chunks_mut(8).zip(w.digest) {
            c.copy_from_slice(&d.to_le_bytes());
        }
        Ok(RegroupFacts {
            layout,
            step: w.step as u64,
            pending: w.pending == 1,
            last_norm: (w.norm_step > 0)
                .then(|| (w.norm_step as u64 - 1, f64::from_bits(w.norm_bits as u64))),
            whole: w.whole == 1,
            cursor: w.cursor as u64,
            seed: w.seed as u64,
            draws: w.draws as u64,
            stale: w.stale == 1,
            digest,
            kept_sum: w.kept_sum == 1,
            target,
        })
    }
}

/// Every rank's row of a group's summed rows, decoded; the first bad one is named.
pub fn decode_all(words: &[i64], group: usize) -> Result<Vec<RegroupFacts>, RegroupError> {
    if words.len() != WORDS * group {
        let detail = format!("{} words for {group} ranks", words.len());
        return Err(RegroupError::Bounds(detail));
    }
    words
        .chunks_exact(WORDS)
        .enumerate()
        .map(|(rank, row)| {
            RegroupFacts::decode(row, group).map_err(|detail| RegroupError::Record { rank, detail })
        })
        .collect()
}

/// Whether a layout of `world` ranks, `m` block-holding ranks a host, `shards` in all, this
/// rank's place `s` one up, and `replicas` can be one.
fn check_layout(world: i64, [m, shards, s]: [i64; 3], replicas: i64) -> Result<(), String> {
    if !(1..=world).contains(&m)
        || !(1..=world).contains(&shards)
        || shards % m != 0
        || !(0..=shards).contains(&s)
    {
        return Err(format!("{world} ranks on hosts of {m} holding blocks, {shards} in all, this one {s}"));
    }
    let hosts = shards / m;
    if hosts > 1 && replicas >= hosts {
        let what = if m == 1 && shards == world { "ranks" } else { "hosts" };
        let count = if what == "ranks" { world } else { hosts };
        return Err(format!("{replicas} replicas of each shard need more than {count} {what}"));
    }
    Ok(())
}

impl HeldLayout {
    /// The value ranges it holds of a gradient of `n` values.
    pub fn held(&self, n: usize) -> Vec<Range<usize>> {
        held_of(n, self.shards, self.per_host, self.place, self.replicas)
    }

    /// What holders of one layout share: its tag, ranks, replicas and block-holding ranks.
    pub fn group(&self) -> (u64, usize, usize, usize, usize) {
        (self.tag, self.world, self.replicas, self.per_host, self.shards)
    }
}

impl KeptLayout {
    /// The value ranges it keeps of a gradient of `n` values.
    pub fn held(&self, n: usize) -> Vec<Range<usize>> {
        held_of(n, self.shards, self.per_host, self.place, self.replicas)
    }
}

/// The value ranges of a layout's place among `shards` block-holding ranks, `per_host` a
/// host, with `replicas` (none on a single host: a kill takes all its ranks at once).
fn held_of(
    n: usize,
    shards: usize,
    per_host: usize,
    place: Option<usize>,
    replicas: usize,
) -> Vec<Range<usize>> {
    let replicas = if shards / per_host == 1 { 0 } else { replicas };
    held_ranges(n, (shards, per_host), place, replicas)
}

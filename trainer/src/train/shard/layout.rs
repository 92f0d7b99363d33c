//! [`ShardLayout`]: which block of the flat gradient (and of the optimizer state) each rank
//! owns, over hosts of equal or unequal rank counts, and which other hosts' blocks each rank
//! holds as replicas.

use crate::TrainerError;
use limpet_decide::regroup::{cut, HeldLayout, KeptLayout};
use std::ops::Range;

/// Which block of the flat gradient (and optimizer state) each rank owns, and which other
/// hosts' blocks a rank also holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub(super) blocks: Vec<Range<usize>>,
    pub(super) rank: usize,
    pub(super) replicas: usize,
    /// Ranks on each host, in host order (host `h`'s ranks follow host `h - 1`'s). The
    /// first `m` of every host (`m` the fewest any host has) hold the blocks, in the order of
    /// a layout of hosts of `m`; a host's other ranks own an empty block at the end of its
    /// own. A block's replicas are the same local rank's on the hosts after its owner's.
    pub(super) counts: Vec<usize>,
    /// Which group the layout is of (the agent's epoch), so ranks tell layouts apart.
    pub(super) tag: u64,
}

/// Hosts' rank counts as a person reads them: `2` when every host has two, else the list.
pub(super) fn describe_counts(counts: &[usize]) -> String {
    match counts.first() {
        Some(&c) if counts.iter().all(|&x| x == c) => c.to_string(),
        _ => format!("{counts:?}"),
    }
}

impl ShardLayout {
    /// Near-equal blocks of a gradient of `len` values over `world` ranks, one rank per
    /// host; this rank is `rank` and holds the `replicas` blocks before its own too (none in
    /// a world of one).
    pub fn new(len: usize, world: usize, rank: usize, replicas: usize) -> Result<Self, TrainerError> {
        ShardLayout::over_hosts(len, world, 1, rank, replicas)
    }

    /// The same over hosts of `per_host` local ranks each (`world` a multiple of it): rank
    /// `rank` holds its own block and, for each of `replicas` hosts before its own around
    /// the ring, the block of the same local rank there, so no two holders of a block share
    /// a host. A single host holds no replicas: a kill takes all its ranks at once.
    pub fn over_hosts(
        len: usize,
        world: usize,
        per_host: usize,
        rank: usize,
        replicas: usize,
    ) -> Result<Self, TrainerError> {
        if per_host == 0 || world % per_host != 0 {
            return Err(TrainerError::Config(format!(
                "{world} ranks are not hosts of {per_host} local ranks each"
            )));
        }
        ShardLayout::over_host_counts(len, &vec![per_host; world / per_host], rank, replicas)
    }

    /// The same over hosts of `counts[h]` local ranks (at least one each; ranks numbered
    /// host after host). With `m` the fewest any host has, the first `m` local ranks of
    /// every host hold blocks as over hosts of `m` (their replicas on other hosts, as
    /// there); a host's ranks past `m` own empty blocks and hold nothing else, so hosts of
    /// unequal device counts still shard (the state over `m` ranks a host; its other
    /// devices train and take the gathered parameters).
    pub fn over_host_counts(
        len: usize,
        counts: &[usize],
        rank: usize,
        replicas: usize,
    ) -> Result<Self, TrainerError> {
        let world: usize = counts.iter().sum();
        if world == 0 || rank >= world || counts.contains(&0) {
            return Err(TrainerError::Config(format!("rank {rank} of hosts of {counts:?} ranks")));
        }
        let hosts = counts.len();
        if hosts > 1 && replicas >= hosts {
            let (what, count) = if world == hosts { ("ranks", world) } else { ("hosts", hosts) };
            return Err(TrainerError::Config(format!(
                "{replicas} replicas of each shard need more than {count} {what}"
            )));
        }
        let m = *counts.iter().min().expect("at least one host");
        let shards = hosts * m;
        let mut blocks = Vec::with_capacity(world);
        for (h, &c) in counts.iter().enumerate() {
            for k in 0..c {
                blocks.push(match k < m {
                    true => cut(len, shards, h * m + k)..cut(len, shards, h * m + k + 1),
                    false => {
                        let end = cut(len, shards, (h + 1) * m);
                        end..end
                    }
                });
            }
        }
        let replicas = if hosts == 1 { 0 } else { replicas };
        Ok(ShardLayout { blocks, rank, replicas, counts: counts.to_vec(), tag: 0 })
    }

    /// The same layout, marked as the group `tag`'s.
    pub fn tagged(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// The group the layout is of.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// One block per rank, in rank order, tiling the gradient.
    pub fn blocks(&self) -> &[Range<usize>] {
        &self.blocks
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.blocks.len()
    }

    /// Other hosts' blocks (before its own, around the ring) each rank holds as well.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Ranks on each host, in host order.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Block-holding ranks on each host (the fewest ranks any host has), and those in all.
    pub(crate) fn shards(&self) -> (usize, usize) {
        let m = *self.counts.iter().min().expect("at least one host");
        (self.counts.len() * m, m)
    }

    /// Rank `r`'s host and local rank.
    fn place(&self, r: usize) -> (usize, usize) {
        let mut first = 0;
        for (h, &c) in self.counts.iter().enumerate() {
            if r < first + c {
                return (h, r - first);
            }
            first += c;
        }
        unreachable!("rank {r} of {} ranks", self.world())
    }

    /// The rank of host `h`'s local rank `k`.
    fn rank_at(&self, h: usize, k: usize) -> usize {
        self.counts[..h].iter().sum::<usize>() + k
    }

    /// The layout as its holder states it in a regroup (and as the log's bounds name it).
    pub fn facts(&self) -> HeldLayout {
        let (shards, per_host) = self.shards();
        HeldLayout {
            tag: self.tag,
            world: self.world(),
            replicas: self.replicas,
            rank: self.rank,
            per_host,
            place: self.shard_rank(),
            shards,
        }
    }

    /// The layout as a rank that keeps it states it in a regroup.
    pub fn kept(&self) -> KeptLayout {
        let (shards, per_host) = self.shards();
        KeptLayout { replicas: self.replicas, per_host, place: self.shard_rank(), shards }
    }

    /// This rank's place among the block-holding ranks (`None`: it owns an empty block,
    /// past its host's first `m`).
    pub(crate) fn shard_rank(&self) -> Option<usize> {
        let (h, k) = self.place(self.rank);
        let (_, m) = self.shards();
        (k < m).then_some(h * m + k)
    }

    /// The blocks this rank holds: its own first, then the `replicas` hosts' before it (only
    /// its own, empty, when it is past its host's first `m`).
    pub fn held(&self) -> Vec<usize> {
        let (h, k) = self.place(self.rank);
        let (hosts, (_, m)) = (self.counts.len(), self.shards());
        if k >= m {
            return vec![self.rank];
        }
        (0..=self.replicas).map(|j| self.rank_at((h + hosts - j % hosts) % hosts, k)).collect()
    }

    /// The ranks holding block `b`: its owner first, then its replicas in order (none for a
    /// block past the world).
    pub fn holders(&self, b: usize) -> Vec<usize> {
        if b >= self.world() {
            return Vec::new();
        }
        let (h, k) = self.place(b);
        let (hosts, (_, m)) = (self.counts.len(), self.shards());
        if k >= m {
            return vec![b];
        }
        (0..=self.replicas).map(|j| self.rank_at((h + j) % hosts, k)).collect()
    }
}

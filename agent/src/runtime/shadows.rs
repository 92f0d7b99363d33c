//! Shadows of pipeline stages: every `shadow_every` steps a rank keeps its own state as a
//! snapshot (offered to peers under a label they can compute) and fetches, in the
//! background, the next stage's snapshot of the same step. After that, losing any one stage
//! host costs at most `shadow_every` steps: the entry protocol rolls back to the newest step
//! at which live states, snapshots and shadows together hold the whole model.

use super::error::AgentError;
use super::tasks::Tasks;
use crate::dataplane::handoff::HandoffDialer;
use crate::Endpoint;
use limpet_consensus::state::{Epoch, NodeId};
use limpet_decide::entry::{block_of, hash_bytes, Desc};
use limpet_snapshot::handoff::{fetch, FetchOptions, Offer, Server};
use limpet_snapshot::StateImage;
use limpet_trainer::Trainer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A state kept for a rollback: its descriptor and encoded bytes.
#[derive(Clone)]
pub(super) struct Snap {
    pub desc: Desc,
    pub bytes: Arc<Vec<u8>>,
}

/// The offer label of `node`'s own snapshot (or, with `shadow`, of the neighbour's snapshot
/// it keeps) at `step`: known to every rank without asking, unlike a content hash.
pub(super) fn snap_label(node: NodeId, step: u64, shadow: bool) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"limpet snapshot");
    h.update(&node.to_le_bytes());
    h.update(&step.to_le_bytes());
    h.update(&[u8::from(shadow)]);
    *h.finalize().as_bytes()
}

/// Puts `snap` among `kept` (replacing one of the same step) and keeps the newest two.
fn keep_newest(kept: &mut Vec<Snap>, snap: Snap) {
    kept.retain(|k| k.desc.step != snap.desc.step);
    kept.push(snap);
    kept.sort_by_key(|k| std::cmp::Reverse(k.desc.step));
    kept.truncate(2);
}

/// The rank in a pipelined epoch whose stage follows rank `i`'s in the same replica (the
/// last stage's follows the first's).
fn next_stage(i: usize, pipeline: usize) -> usize {
    (i / pipeline) * pipeline + (i % pipeline + 1) % pipeline
}

/// A rank's kept states.
#[derive(Default)]
pub(super) struct Shadows {
    /// This rank's own state at its last two shadowing steps, newest first. Two, because
    /// the newest step's shadow may still be on its way when a host dies: the step before is
    /// then the newest one both copies exist for.
    pub snapshots: Vec<Snap>,
    /// The next stage's state at those steps, fetched in the background, newest first.
    pub shadows: Arc<Mutex<Vec<Snap>>>,
    /// Bumped per shadowing round; an older round's fetch gives up.
    round: Arc<AtomicU64>,
}

/// What a shadowing round needs of the agent.
pub(super) struct Links<'a> {
    pub me: NodeId,
    pub endpoint: &'a Arc<Endpoint>,
    pub server: &'a Server,
    pub tasks: &'a Tasks,
}

impl Shadows {
    /// The kept shadows as they are now (the background fetch may add one meanwhile).
    pub fn shadows_now(&self) -> Vec<Snap> {
        self.shadows.lock().expect("shadow lock").clone()
    }

    /// Forgets every kept state newer than `step` (they belong to an abandoned lineage).
    pub fn forget_after(&mut self, step: u64) {
        self.snapshots.retain(|k| k.desc.step <= step);
        self.shadows.lock().expect("shadow lock").retain(|k| k.desc.step <= step);
    }

    /// Keeps `trainer`'s state as this rank's snapshot and starts fetching the next stage's
    /// of the same step. `addrs` are the epoch's data addresses in rank order.
    pub fn take(
        &mut self,
        trainer: &Trainer,
        epoch: &Epoch,
        addrs: &[String],
        l: &Links<'_>,
    ) -> Result<(), AgentError> {
        let image = trainer.image()?;
        let bytes = image.encode()?;
        let step = trainer.step();
        let b = trainer.model().blocks();
        // A peer's shadow can be no larger than this job's state can be.
        let most = state_bound(bytes.len() as u64, (b.start, b.end), trainer.job().model.num_blocks());
        l.server.offer(Offer::new(bytes.clone(), 1 << 20, snap_label(l.me, step, false)));
        keep_newest(
            &mut self.snapshots,
            Snap {
                desc: Desc { step, hash: hash_bytes(image.content_hash()), blocks: (b.start, b.end) },
                bytes: Arc::new(bytes),
            },
        );
        let Some(i) = epoch.ranks.iter().position(|&r| r == l.me) else { return Ok(()) };
        let next = next_stage(i, epoch.layout.pipeline as usize);
        // The blocks the next stage's snapshot must hold: what it offers is a peer's word.
        let nb = trainer.job().model.num_blocks();
        let want = match epoch.layout.stage_blocks(nb) {
            Ok(stages) => stages[next % stages.len()].clone(),
            Err(e) => return Err(AgentError::entry(e.to_string())),
        };
        let (node, addr) = (epoch.ranks[next], addrs[next].clone());
        let round = self.round.fetch_add(1, Ordering::SeqCst) + 1;
        let (endpoint, server, shadow, rounds) =
            (Arc::clone(l.endpoint), l.server.clone(), Arc::clone(&self.shadows), Arc::clone(&self.round));
        let (me, epoch_id, stop) = (l.me, epoch.id, l.tasks.token());
        let fetch_one = move || {
            let give_up = Instant::now() + Duration::from_secs(10);
            let opts = FetchOptions {
                expect: Some(snap_label(node, step, false)),
                reconnects: 0,
                max_bytes: most,
                ..Default::default()
            };
            while rounds.load(Ordering::SeqCst) == round && Instant::now() < give_up && !stop.is_cancelled() {
                let dialer = HandoffDialer { endpoint: &endpoint, epoch: epoch_id };
                let got = fetch(&dialer, &[format!("{node}@{addr}")], &opts)
                    .map_err(|e| e.to_string())
                    .and_then(|(bytes, stats)| {
                        crate::dataplane::count_bytes(false, "handoff", stats.bytes);
                        Ok((StateImage::decode(&bytes).map_err(|e| e.to_string())?, bytes))
                    });
                match got {
                    Ok((img, bytes)) if img.meta().step == step => {
                        let blocks = blocks_held(img.tensors().keys().map(String::as_str), nb);
                        if blocks != Some((want.start, want.end)) {
                            tracing::warn!(
                                step,
                                from = node,
                                ?blocks,
                                ?want,
                                "the next stage's snapshot does not hold its stage's blocks; not kept"
                            );
                            return;
                        }
                        let blocks = (want.start, want.end);
                        server.offer(Offer::new(bytes.clone(), 1 << 20, snap_label(me, step, true)));
                        tracing::debug!(step, from = node, "shadowed the next stage");
                        keep_newest(
                            &mut shadow.lock().expect("shadow lock"),
                            Snap {
                                desc: Desc { step, hash: hash_bytes(img.content_hash()), blocks },
                                bytes: Arc::new(bytes),
                            },
                        );
                        return;
                    }
                    // Not offered yet (the neighbour finishes the step a moment later).
                    other => {
                        if let Err(e) = other {
                            tracing::debug!(step, from = node, %e, "shadow fetch");
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
            if rounds.load(Ordering::SeqCst) == round {
                tracing::warn!(step, from = node, "could not shadow the next stage's state");
            }
        };
        l.tasks
            .spawn_thread("shadow", fetch_one)
            .map_err(|source| AgentError::io("starting the shadow fetch", source))
    }
}

/// The blocks a state's parameters and optimizer slots (named `param/bNN.x`,
/// `optim/<slot>/bNN.x`) hold, as one range: none when one of them names no block or a block
/// past the model's `blocks`, or there are none. Other tensors (the exponents of a
/// reproducible job) hold no block.
fn blocks_held<'a>(names: impl Iterator<Item = &'a str>, blocks: usize) -> Option<(usize, usize)> {
    let mut range: Option<(usize, usize)> = None;
    for name in names.filter(|n| n.starts_with("param/") || n.starts_with("optim/")) {
        let k = block_of(name).filter(|&k| k < blocks)?;
        range = Some(range.map_or((k, k + 1), |(lo, hi)| (lo.min(k), hi.max(k + 1))));
    }
    range
}

/// The most bytes a peer's state of this job can take: this rank's own state of `held`
/// blocks scaled to the whole model of `blocks`, twice over (blocks differ in size) and
/// 64 MiB besides (metadata, small models).
pub(super) fn state_bound(own_bytes: u64, held: (usize, usize), blocks: usize) -> u64 {
    let held = held.1.saturating_sub(held.0).max(1) as u64;
    own_bytes.saturating_mul(blocks.max(1) as u64).div_ceil(held).saturating_mul(2).saturating_add(64 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(step: u64) -> Snap {
        Snap { desc: Desc { step, hash: [0; 32], blocks: (0, 1) }, bytes: Arc::new(Vec::new()) }
    }

    #[test]
    fn two_newest_are_kept_and_a_step_is_replaced() {
        let mut kept = Vec::new();
        for s in [10, 30, 20, 30] {
            keep_newest(&mut kept, snap(s));
        }
        assert_eq!(kept.iter().map(|k| k.desc.step).collect::<Vec<_>>(), vec![30, 20]);
    }

    #[test]
    fn a_snapshots_blocks_are_within_the_model() {
        let held = |names: &[&str]| blocks_held(names.iter().copied(), 6);
        assert_eq!(held(&["param/b02.w", "optim/m/b03.w", "param/b02.b"]), Some((2, 4)));
        assert_eq!(held(&[]), None);
        // Past the model, past usize, or no block at all: none (before, (usize::MAX, 0)).
        assert_eq!(held(&["param/b02.w", "param/b06.w"]), None);
        assert_eq!(held(&["param/b18446744073709551615.w"]), None);
        assert_eq!(held(&["param/b99999999999999999999.w"]), None);
        assert_eq!(held(&["param/b02.w", "optim/m/w"]), None);
        assert_eq!(held(&["param/b02.w", "exact/exponents"]), Some((2, 3)));
    }

    #[test]
    fn the_next_stage_wraps_within_the_replica() {
        // 2 replicas x 3 stages: ranks 0,1,2 and 3,4,5.
        assert_eq!((0..6).map(|i| next_stage(i, 3)).collect::<Vec<_>>(), vec![1, 2, 0, 4, 5, 3]);
        assert_ne!(snap_label(1, 5, false), snap_label(1, 5, true));
    }
}

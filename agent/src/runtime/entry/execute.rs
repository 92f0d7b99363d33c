//! Entering an epoch with the trainer's state: publish this rank's states, agree on a plan
//! with every rank's (`limpet_decide::entry::plan`), fetch and check what it takes, switch
//! the trainer to it, and connect what the epoch trains over (`entry` has the protocol's
//! steps that need no trainer).

use super::abandon;
use super::{
    addrs_of, exchange_states, fetch_state, form_group, survivors_of, Pending, ENTRY_STEP, ENTRY_WAIT,
};
use crate::runtime::checkpointer;
use crate::runtime::config::AgentConfig;
use crate::runtime::error::AgentError;
use crate::runtime::shadows::{snap_label, state_bound, Shadows, Snap};
use crate::runtime::sharding;
use crate::stage::StageConnections;
use crate::{Endpoint, Group};
use limpet_consensus::state::Epoch;
use limpet_decide::entry::{hash_bytes, hex_of, plan, Desc};
use limpet_decide::DecideError;
use limpet_snapshot::handoff::{label_of, Offer, Server};
use limpet_snapshot::StateImage;
use limpet_trainer::Trainer;
use plan::{entry_plan, Entry, RankState, Src};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What a rank of the current epoch trains over.
pub(in crate::runtime) enum Conn {
    /// Data parallelism: one ring over every rank.
    Ring(Group),
    /// A data x pipeline layout: its stage's replicas, its replica's stages, pipe links.
    Stages(Box<StageConnections>),
}

/// What entering needs of the agent.
pub(in crate::runtime) struct Entering<'a> {
    pub cfg: &'a AgentConfig,
    pub endpoint: &'a Arc<Endpoint>,
    pub server: &'a Server,
    pub watch: &'a watch::Receiver<limpet_consensus::LocalState>,
    pub stop: &'a CancellationToken,
    pub trainer: &'a mut Trainer,
    /// The trainers of the host's other devices (`[node].devices`), given its state here.
    pub followers: &'a mut [Trainer],
    pub shadows: &'a mut Shadows,
    pub pending: Option<Pending>,
    /// What this rank did about a torn step (see [`finish_torn_step`]), across attempts.
    pub torn: &'a mut Torn,
    /// The ranks of the epoch this rank last trained in (its step's shares and batch plan),
    /// for finishing a torn step of it.
    pub trained_world: Option<usize>,
    /// The content hash of the job's final checkpoint this process wrote into its state
    /// directory, once it did.
    pub final_written: Option<&'a str>,
    /// Whether this process wrote the job's end already (and has not given steps up since):
    /// it then keeps nothing of a gather past the end, which is for a newcomer's final.
    pub finished: bool,
}

/// What an entry did, for the transition record.
pub(in crate::runtime) struct Entered {
    pub conn: Conn,
    /// The ring's other lanes, for hosts of several local ranks (`local_ranks::lanes_of`).
    pub lanes: Vec<Group>,
    pub fetched_bytes: u64,
    pub fetch_ms: u64,
    pub repaired: bool,
    /// Steps this rank trained again: after a rollback to shadows, or after it alone applied
    /// the step in flight (0 otherwise).
    pub redone_steps: u64,
    /// Sharded state past the job's last step: the host's final checkpoint, written pending
    /// (the trainers keep their blocks).
    pub final_state: Option<sharding::Final>,
}

/// Enters epoch `n`: forms its group, agrees on one state and switches to it.
pub(in crate::runtime) fn enter(mut x: Entering<'_>, n: &Epoch) -> Result<Entered, AgentError> {
    x.endpoint.set_min_epoch(n.id);
    let st = Arc::clone(&x.watch.borrow().state);
    let addrs = addrs_of(&st, n)?;
    let by = Instant::now() + ENTRY_WAIT;
    let give_up = abandon::give_up(x.watch, x.stop, n.id);
    let tree = limpet_decide::entry::butterfly(&st, n);
    let mut group = form_group(x.endpoint, x.pending.take(), n, &addrs, (by, &give_up), tree)?;
    let abandon = abandon::Abandon::watch(&group, abandon::replaced(x.watch, x.stop, n.id));
    let host = (&mut *x.trainer, &mut *x.followers);
    let local = x.cfg.checkpoint.as_ref().map(|c| c.dir());
    let dirs = (&x.cfg.job, local, x.final_written.map(|h| (x.cfg.state_dir.as_path(), h)));
    let final_dir = (!x.finished).then_some(x.cfg.state_dir.as_path());
    let given_up = match sharding::enter(host, &mut group, dirs, &st, n, ENTRY_STEP, final_dir)? {
        sharding::Sharded::Recut { bytes, ms, final_state } => {
            // The followers take the plan from the host's trainer before each step.
            x.trainer.set_epoch_plan(
                n.batch.global_batch as usize,
                n.batch.micro_batch as usize,
                n.lr_scale,
            )?;
            x.trainer.set_shares(n.shares.clone());
            group.barrier(ENTRY_STEP)?;
            drop(abandon);
            limpet_trainer::device::return_freed_host_memory();
            let (conn, lanes) = connect(&x, n, group, &addrs, &give_up)?;
            return Ok(Entered {
                conn,
                lanes,
                fetched_bytes: bytes,
                fetch_ms: ms,
                repaired: false,
                redone_steps: 0,
                final_state,
            });
        }
        sharding::Sharded::Whole { redone } => redone,
    };

    if let Some(t) = checkpointer::resume(x.trainer, &x.cfg.job, &st, n, local) {
        *x.trainer = t;
    }
    // Publish this rank's states, then agree on (step, blocks held, hash).
    let mine = publish(&mut x)?;
    let nb = x.cfg.job.model.num_blocks();
    let ranks = exchange_states(&mut group, &mine.state, n, nb)?;
    let me = group.rank();
    let stages = n.layout.stage_blocks(nb).map_err(|e| AgentError::entry(e.to_string()))?;
    let target = stages[me % stages.len()].clone();
    let survivors = survivors_of(&st, n);
    let plan = match entry_plan(&ranks, me, target.clone(), nb, &survivors) {
        Err(DecideError::TornStep { behind, ahead, step }) => {
            let old_world = x.trained_world;
            return Err(torn_step(&mut x, n, me, (&ranks, &addrs, &mine), (behind, ahead, step), old_world));
        }
        plan => plan?,
    };
    let mine = offer_live(&mut x, &mut group, n, (&ranks, &stages, nb, &survivors), mine)?;
    let redone = x.trainer.step().saturating_sub(plan.step);
    let (mut fetched_bytes, mut fetch_ms) = (0, 0);
    let repaired = plan.action == Entry::Repair;
    if plan.action != Entry::Keep {
        if repaired {
            tracing::warn!(
                epoch = n.id,
                step = plan.step,
                "state hash differs from the source's at the same step; repairing"
            );
        }
        let started = Instant::now();
        let (merged, bytes) = assemble(&x, n, &addrs, (&plan, &ranks, me), &mine)?;
        fetched_bytes = bytes;
        let held = x.trainer.model().blocks();
        if target != held {
            tracing::info!(epoch = n.id, from = ?held, to = ?target, "this rank's blocks change");
            *x.trainer = Trainer::on_device(
                x.cfg.job.clone(),
                x.trainer.data().shallow_clone(),
                target.clone(),
                x.trainer.model().device(),
            )?;
        }
        if let Some(r) = plan.reference {
            check_copied(&merged, &ranks, n, plan.step, r)?;
        }
        x.trainer.load_image(&merged)?;
        fetch_ms = started.elapsed().as_millis() as u64;
        if redone > 0 {
            let (from, to) = (plan.step + redone, plan.step);
            if plan.action == Entry::Rollback {
                tracing::warn!(
                    epoch = n.id,
                    from,
                    to,
                    "a stage had no live replica: back to the shadowed snapshot"
                );
            } else {
                // This rank applied the step in flight, and no other survivor confirms it:
                // the step is trained again from the state the others agree on.
                tracing::warn!(
                    epoch = n.id,
                    from,
                    to,
                    "back to the survivors' agreed step: no other rank confirms this one's"
                );
            }
            // Kept states newer than the lineage's new head belong to the abandoned one.
            x.shadows.forget_after(plan.step);
        }
    }
    x.trainer.set_epoch_plan(n.batch.global_batch as usize, n.batch.micro_batch as usize, n.lr_scale)?;
    x.trainer.set_shares(n.shares.clone());
    let live = mine.live_label;
    drop(mine);
    // The devices this epoch trains (a pipelined epoch may count fewer than the host has).
    let used = (n.local_ranks_of(me) as usize).saturating_sub(1).min(x.followers.len());
    if used > 0 {
        // Before the barrier: the other hosts wait here, not in the first step's collective.
        // Before the state is cut: each device then keeps its own shard of the host's state.
        crate::runtime::local_ranks::sync(x.trainer, &mut x.followers[..used])?;
    }
    sharding::shard_after_entry((&mut *x.trainer, &mut *x.followers), &x.cfg.job, n, me)?;
    group.barrier(ENTRY_STEP)?;
    drop(abandon);
    // Every rank passed the barrier, so every copy of this rank's live state is done; the
    // next entry offers the state of its own step.
    x.server.withdraw(&live);
    x.torn.offered = None;
    limpet_trainer::device::return_freed_host_memory();
    let (conn, lanes) = connect(&x, n, group, &addrs, &give_up)?;
    // Whatever took this rank back (a rollback, or a step it alone applied), the steps it
    // leaves are trained again: they are out of the lineage, not applied twice.
    let redone_steps = redone.max(given_up);
    Ok(Entered { conn, lanes, fetched_bytes, fetch_ms, repaired, redone_steps, final_state: None })
}

/// What the entered epoch trains over, connected once every rank passed the entry's
/// barrier (so every ring connection of the entry is taken: the stage groups' and the
/// lanes' connections, of the same epoch, cannot be mistaken for them): the stages of a
/// pipelined epoch, else `group` and, for hosts of several local ranks, its other lanes.
fn connect(
    x: &Entering<'_>,
    n: &Epoch,
    group: Group,
    addrs: &[String],
    give_up: &dyn Fn() -> bool,
) -> Result<(Conn, Vec<Group>), AgentError> {
    // A deadline of its own: the entry's may be spent by now (peers waited for, a state
    // copied), and the left neighbours connect only once past the barrier.
    let by = Instant::now() + ENTRY_WAIT;
    if n.layout.pipeline > 1 {
        drop(group);
        // Every host of a pipelined epoch has as many local ranks (the controller's rule).
        let local = n.local_ranks_of(0) as usize;
        let layout = (n.layout.data as usize, n.layout.pipeline as usize, local);
        let tree = limpet_decide::entry::butterfly(&x.watch.borrow().state, n);
        let stages =
            StageConnections::connect_with(x.endpoint, n.id, layout, &n.ranks, addrs, (by, give_up), tree)?;
        if local > 1 {
            tracing::info!(
                epoch = n.id,
                local_ranks = local,
                "pipe and ring lanes connected, one per local rank"
            );
        }
        return Ok((Conn::Stages(Box::new(stages)), Vec::new()));
    }
    let count = crate::runtime::local_ranks::lanes_of(n);
    let mut lanes = Vec::new();
    let mut group = group;
    if count > 1 {
        lanes = crate::dataplane::lanes::connect(x.endpoint, n.id, &n.ranks, addrs, count, by, give_up)?;
        tracing::info!(epoch = n.id, lanes = count, "ring lanes connected, one per local rank");
    } else if let Some(zones) = limpet_decide::entry::zone_levels(&x.watch.borrow().state, n) {
        // Lanes cut a buffer between a host's local ranks, each its own ring: they keep the
        // flat ring, the levels being for hosts of one rank.
        group.connect_levels(x.endpoint, addrs, &zones, (by, give_up))?;
        let spans = crate::dataplane::ring::zone_members(&zones).len();
        tracing::info!(epoch = n.id, zones = spans, "rings inside and across zones connected");
    }
    Ok((Conn::Ring(group), lanes))
}

/// What this rank assembled is the reference's state (the agreed rank at the epoch's step
/// that holds the same blocks) bit for bit: what the plan assumes, checked before it is
/// loaded, so a part of the state left behind fails the entry here instead of a collective
/// later.
fn check_copied(
    merged: &StateImage,
    ranks: &[RankState],
    n: &Epoch,
    step: u64,
    r: usize,
) -> Result<(), AgentError> {
    let got = merged.content_hash().to_string();
    if hash_bytes(&got) != ranks[r].live.hash {
        return Err(AgentError::entry(format!(
            "epoch {}: the state assembled for step {step} hashes to {got}, node {} trains with {}",
            n.id,
            n.ranks[r],
            hex_of(&ranks[r].live.hash)
        )));
    }
    Ok(())
}

/// What this rank publishes at an entry: the descriptors of its live state and of the kept
/// snapshots and shadows, as they are now. The live state is made an image, and offered to
/// peers under its content hash, only where a plan copies it (`offer_live`).
struct Published {
    /// The live state's image, where this rank's own plan copies from it.
    image: Option<StateImage>,
    /// Its tensors' bytes: what bounds the states this rank will take from peers.
    bytes: u64,
    /// The label its live state is offered under, withdrawn once the entry is done.
    live_label: [u8; 32],
    snapshots: Vec<Snap>,
    shadows: Vec<Snap>,
    state: RankState,
}

fn publish(x: &mut Entering<'_>) -> Result<Published, AgentError> {
    // The hash read a tensor at a time: most entries copy nothing (every rank at the same
    // step with the same state), and an image and its encoding would be two copies of the
    // state for nothing.
    let hash = x.trainer.content_hash()?;
    let bytes = x.trainer.state_bytes();
    let live_label = label_of(&hash);
    let held = x.trainer.model().blocks();
    let snapshots = x.shadows.snapshots.clone();
    let shadows = x.shadows.shadows_now();
    let slot = |v: &[Snap], i: usize| v.get(i).map(|s| s.desc);
    let state = RankState {
        live: Desc { step: x.trainer.step(), hash: hash_bytes(&hash), blocks: (held.start, held.end) },
        snaps: [slot(&snapshots, 0), slot(&snapshots, 1)],
        shadows: [slot(&shadows, 0), slot(&shadows, 1)],
    };
    Ok(Published { image: None, bytes, live_label, snapshots, shadows, state })
}

/// Makes this rank's live state an image where a plan copies from it (a peer's, so it is
/// also encoded and offered, or its own), and holds every rank at a barrier until the
/// offers are up where any rank fetches a peer's live state. Every rank computes every
/// rank's plan (it is pure, from the states all ranks exchanged), so they agree on both.
fn offer_live(
    x: &mut Entering<'_>,
    group: &mut Group,
    n: &Epoch,
    (ranks, stages, nb, survivors): (&[RankState], &[std::ops::Range<usize>], usize, &[bool]),
    mut mine: Published,
) -> Result<Published, AgentError> {
    let me = group.rank();
    // Per rank, the ranks whose live state its plan copies (a plan that fails names none:
    // that rank's entry fails on its own).
    let copied: Vec<Vec<usize>> = (0..ranks.len())
        .map(|j| match entry_plan(ranks, j, stages[j % stages.len()].clone(), nb, survivors) {
            Ok(p) if p.action != Entry::Keep => {
                p.sources.iter().filter(|(_, kind, _)| *kind == Src::Live).map(|(src, _, _)| *src).collect()
            }
            _ => Vec::new(),
        })
        .collect();
    let offered = copied.iter().enumerate().any(|(j, srcs)| j != me && srcs.contains(&me));
    let own_use = copied[me].contains(&me);
    if offered || own_use {
        let image = x.trainer.image()?;
        if label_of(image.content_hash()) != mine.live_label {
            return Err(AgentError::entry("the live state changed after its hash was published"));
        }
        if offered {
            let encoded = image.encode()?;
            let bytes = encoded.len();
            x.server.offer(Offer::new(encoded, 1 << 20, mine.live_label));
            tracing::info!(epoch = n.id, bytes, "live state offered to the ranks that copy it");
        }
        // A rank that only serves keeps the encoding alone while its peers fetch.
        mine.image = own_use.then_some(image);
    }
    if copied.iter().enumerate().any(|(j, srcs)| srcs.iter().any(|&s| s != j)) {
        group.barrier(ENTRY_STEP)?;
    }
    Ok(mine)
}

/// The state the plan names, assembled block by block from this rank's own states and the
/// peers' (each checked against the hash its holder published), and the bytes fetched.
fn assemble(
    x: &Entering<'_>,
    n: &Epoch,
    addrs: &[String],
    (plan, ranks, me): (&plan::EntryPlan, &[RankState], usize),
    mine: &Published,
) -> Result<(StateImage, u64), AgentError> {
    let mut fetched_bytes = 0;
    let mut tensors = BTreeMap::new();
    let mut unblocked = BTreeMap::new();
    let mut meta = None;
    for (src, kind, blocks) in &plan.sources {
        let desc = ranks[*src].desc(*kind).expect("the plan names descriptors that exist");
        let hex = hex_of(&desc.hash);
        let fetched;
        let img = if *src == me {
            let keep = match kind {
                Src::Live => None,
                Src::Snapshot(i) => mine.snapshots.get(*i),
                Src::Shadow(i) => mine.shadows.get(*i),
            };
            match keep {
                None => mine.image.as_ref().ok_or_else(|| {
                    AgentError::entry("the plan copies this rank's live state, which it did not keep")
                })?,
                Some(k) => {
                    fetched = StateImage::decode(&k.bytes)?;
                    if fetched.content_hash() != hex {
                        return Err(AgentError::entry("a kept snapshot no longer hashes to its descriptor"));
                    }
                    &fetched
                }
            }
        } else {
            let src_node = n.ranks[*src];
            let label = match kind {
                Src::Live => label_of(&hex),
                Src::Snapshot(_) => snap_label(src_node, desc.step, false),
                Src::Shadow(_) => snap_label(src_node, desc.step, true),
            };
            let most = state_bound(mine.bytes, mine.state.live.blocks, x.cfg.job.model.num_blocks());
            let (img, bytes) =
                fetch_state(x.endpoint, n.id, &format!("{src_node}@{}", addrs[*src]), label, most)?;
            if img.content_hash() != hex {
                return Err(AgentError::entry(format!(
                    "state from node {src_node} does not hash to what it announced"
                )));
            }
            fetched_bytes += bytes;
            tracing::info!(
                epoch = n.id,
                step = plan.step,
                from = src_node,
                ?blocks,
                bytes,
                "state copied from a peer"
            );
            fetched = img;
            &fetched
        };
        // The state of the step as a whole (a reproducible job's predicted exponents: no
        // block's) comes with the step's metadata, from one source: left out, a newcomer would
        // disagree with every survivor on how the next step is summed.
        let whole_step = meta.is_none() || *src != me;
        if whole_step {
            let m = img.meta();
            meta = Some((m.step, m.cursor, m.rng, m.job.clone()));
            unblocked.clear();
        }
        for (name, t) in img.tensors() {
            match limpet_decide::entry::block_of(name) {
                Some(b) if blocks.contains(&b) => {
                    tensors.insert(name.clone(), t.clone());
                }
                Some(_) => {}
                None if whole_step => {
                    unblocked.insert(name.clone(), t.clone());
                }
                None => {}
            }
        }
    }
    tensors.append(&mut unblocked);
    let (step, cursor, rng, job) = meta.expect("an entry that copies names a source");
    Ok((StateImage::new(step, cursor, rng, job, tensors), fetched_bytes))
}

/// What a rank did about a torn step, remembered across entry attempts: the state it
/// offered as the survivor ahead (offered once), and the peer state it refused as the one
/// behind (not fetched and checked again).
#[derive(Debug, Default)]
pub(in crate::runtime) struct Torn {
    offered: Option<[u8; 32]>,
    refused: Option<[u8; 32]>,
}

/// The two survivors are a step apart and nobody else tells which is right (`TornStep`).
/// The one ahead offers its live state. The one behind fetches it, finishes the step alone
/// from its own state (every rank's share of the old epoch, as each computed it), and checks
/// the fetched state against its own: the same bits in a reproducible job, else each run of
/// 64 values within half the step's own change to it (`near`: the ring summed the same values
/// in another order). It takes the state when it passes; when it does not, it goes back to
/// its own state and refuses that state for good (the entry waits, loudly). Nobody else
/// copies anything here; the next attempt finds the two alike. Always an error: the attempt
/// ends.
fn torn_step(
    x: &mut Entering<'_>,
    n: &Epoch,
    me: usize,
    (ranks, addrs, mine): (&[RankState], &[String], &Published),
    (behind, ahead, step): (usize, usize, u64),
    old_world: Option<usize>,
) -> AgentError {
    let result = match me {
        i if i == ahead => offer_torn(x, mine),
        i if i == behind => finish_torn_step(x, n, (ranks, addrs, mine), (ahead, step), old_world),
        _ => Ok(()),
    };
    let (from, to) = (n.ranks[behind], n.ranks[ahead]);
    match result {
        Ok(()) => AgentError::entry(format!(
            "epoch {}: node {from} finishes step {step} alone to check node {to}'s state (the ring broke after node {to} applied it); entering again",
            n.id
        )),
        Err(e) => e,
    }
}

/// The survivor ahead: offers its live state to the one behind (once per state).
fn offer_torn(x: &mut Entering<'_>, mine: &Published) -> Result<(), AgentError> {
    if x.torn.offered == Some(mine.live_label) {
        return Ok(());
    }
    let image = x.trainer.image()?;
    if label_of(image.content_hash()) != mine.live_label {
        return Err(AgentError::entry("the live state changed after its hash was published"));
    }
    x.server.offer(Offer::new(image.encode()?, 1 << 20, mine.live_label));
    x.torn.offered = Some(mine.live_label);
    Ok(())
}

/// The survivor behind: fetch, finish alone, check, take or refuse (see [`torn_step`]).
fn finish_torn_step(
    x: &mut Entering<'_>,
    n: &Epoch,
    (ranks, addrs, mine): (&[RankState], &[String], &Published),
    (ahead, step): (usize, u64),
    old_world: Option<usize>,
) -> Result<(), AgentError> {
    let theirs_hash = ranks[ahead].live.hash;
    let peer = n.ranks[ahead];
    if x.torn.refused == Some(theirs_hash) {
        return Err(AgentError::entry(format!(
            "epoch {}: node {peer}'s state at step {} was refused: it is not what step {step} gives (drain or remove one of the two)",
            n.id,
            step + 1
        )));
    }
    if step >= x.cfg.job.steps {
        return Err(AgentError::entry(format!(
            "epoch {}: node {peer} claims a step past the job's {}",
            n.id, x.cfg.job.steps
        )));
    }
    let Some(world) = old_world.filter(|&w| w > 0) else {
        return Err(AgentError::entry(format!(
            "epoch {}: no epoch before it to finish step {step} of",
            n.id
        )));
    };
    let most = state_bound(mine.bytes, mine.state.live.blocks, x.cfg.job.model.num_blocks());
    let label = label_of(&hex_of(&theirs_hash));
    let (theirs, _) = fetch_state(x.endpoint, n.id, &format!("{peer}@{}", addrs[ahead]), label, most)?;
    let refuse = |x: &mut Entering<'_>, why: String| {
        x.torn.refused = Some(theirs_hash);
        tracing::error!(epoch = n.id, step, peer, %why, "refused the state of the survivor that applied the step the ring broke in: it is not what the step gives");
        AgentError::entry(format!(
            "epoch {}: node {peer}'s state at step {} is not what step {step} gives from this rank's: {why}",
            n.id,
            step + 1
        ))
    };
    if hash_bytes(theirs.content_hash()) != theirs_hash {
        return Err(refuse(x, format!("it serves a state hashing to {}", theirs.content_hash())));
    }
    let started = Instant::now();
    let before = x.trainer.image()?;
    x.trainer.finish_step_alone(world)?;
    // From here on, whatever fails leaves this rank's own state as it was.
    let taken = x.trainer.image().map_err(AgentError::from).and_then(|own| {
        let checked = match x.cfg.job.reproducible {
            true if own.content_hash() == theirs.content_hash() => Ok(()),
            true => Err(format!("{} against this rank's {}", theirs.content_hash(), own.content_hash())),
            false => near(&before, &own, &theirs),
        };
        match checked {
            Ok(()) => x.trainer.load_image(&theirs).map_err(|e| refuse(x, e.to_string())),
            Err(why) => Err(refuse(x, why)),
        }
    });
    if let Err(e) = taken {
        x.trainer.load_image(&before)?;
        return Err(e);
    }
    tracing::warn!(
        epoch = n.id,
        step,
        peer,
        ms = started.elapsed().as_millis() as u64,
        "finished alone the step the ring broke in (the peer applied it, this rank had not); the peer's state matches, taken"
    );
    Ok(())
}

/// `theirs` is what the step gives from `before`, as `own` computed it: the same job, step,
/// position and tensors, and each run of 64 values of a tensor within half the step's own
/// change to that run (plus a floor of rounding). The ring summed the same values in another
/// order; a rounding flip of an update's sign moves one value by two of its steps, well
/// inside. So a peer can move no value by more than a few steps' worth of its own change.
fn near(before: &StateImage, own: &StateImage, theirs: &StateImage) -> Result<(), String> {
    let (a, b) = (own.meta(), theirs.meta());
    if (a.step, a.cursor, a.rng) != (b.step, b.cursor, b.rng) {
        return Err(format!(
            "step {}, cursor {}, rng {:?} against this rank's {}, {}, {:?}",
            b.step, b.cursor, b.rng, a.step, a.cursor, a.rng
        ));
    }
    if a.job != b.job {
        return Err("another job".into());
    }
    let (start, mine, other) = (before.tensors(), own.tensors(), theirs.tensors());
    if mine.keys().ne(other.keys()) || mine.keys().ne(start.keys()) {
        return Err("other tensors".into());
    }
    const RUN: usize = 64;
    let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    for (name, t) in mine {
        let (u, w) = (&other[name], &start[name]);
        if t.dtype() != u.dtype() || t.shape() != u.shape() {
            return Err(format!("{name}: another dtype or shape"));
        }
        let (Some(x), Some(y), Some(z)) = (t.to_f32(), u.to_f32(), w.to_f32()) else {
            if t.data() != u.data() {
                return Err(format!("{name}: other values"));
            }
            continue;
        };
        for (k, ((x, y), z)) in x.chunks(RUN).zip(y.chunks(RUN)).zip(z.chunks(RUN)).enumerate() {
            let diff = norm(&mut x.iter().zip(y).map(|(p, q)| p - q));
            let change = norm(&mut x.iter().zip(z).map(|(p, q)| p - q));
            let bound = 0.5 * change + 1e-6 * norm(&mut x.iter().copied()) + 1e-30;
            if diff.is_nan() || diff > bound {
                let at = k * RUN;
                return Err(format!(
                    "{name}[{at}..] differs by {diff:.3e}, beyond {bound:.3e} (the step changed it by {change:.3e})"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::near;
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    use std::collections::BTreeMap;

    fn image(step: u64, values: &[f32]) -> StateImage {
        let t = RawTensor::from_f32("param/b00.w", vec![values.len()], values).unwrap();
        let tensors = BTreeMap::from([("param/b00.w".to_string(), t)]);
        StateImage::new(step, step * 8, RngState::new(1), serde_json::json!({}), tensors)
    }

    /// What a torn step's check accepts of the peer's state: the step's rounding, not
    /// another step, a state moved by more than a small part of the step, or NaN.
    #[test]
    fn a_peers_state_is_near_only_to_the_steps_rounding() {
        let before: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let own: Vec<f32> = before.iter().enumerate().map(|(i, v)| v - 1e-3 * (i as f32).cos()).collect();
        let rounded: Vec<f32> = own.iter().map(|v| v * (1.0 + 1e-7)).collect();
        let (b, o) = (image(4, &before), image(5, &own));
        assert_eq!(near(&b, &o, &image(5, &rounded)), Ok(()));
        let mut moved = own.clone();
        moved[17] += 0.01;
        let e = near(&b, &o, &image(5, &moved)).unwrap_err();
        assert!(e.contains("param/b00.w[0..] differs"), "{e}");
        // One value moved by four of its steps, though a ten-thousandth of the tensor's norm:
        // refused; a sign flip of one value's update (two of its steps) passes.
        let mut few = own.clone();
        few[700] -= 4e-3 * (700f32).cos();
        assert!(near(&b, &o, &image(5, &few)).unwrap_err().contains("[640..]"));
        let mut flip = own.clone();
        flip[700] += 2e-3 * (700f32).cos();
        assert_eq!(near(&b, &o, &image(5, &flip)), Ok(()));
        assert!(near(&b, &o, &image(6, &own)).unwrap_err().contains("step 6"));
        let nan: Vec<f32> = own.iter().map(|_| f32::NAN).collect();
        assert!(near(&b, &o, &image(5, &nan)).is_err());
    }
}

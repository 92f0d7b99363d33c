//! Joins admitted in waves (controller rule 3): newcomers wait for their wave to settle, a
//! wave that never settles is bounded, and the first epoch waits for every founder a while.

use super::*;

/// Sixteen hosts of a refill become ready over 1.5 s: while more keep coming, none is
/// admitted; a second after the last, all sixteen come in one epoch. A wave that never
/// settles is admitted `JOIN_WAVE_MAX_MS` after its first host anyway, and a failure meanwhile takes every
/// ready newcomer at once.
#[test]
fn joins_are_admitted_in_waves() {
    use limpet_decide::controller::{JOIN_SETTLE_MS, JOIN_WAVE_MAX_MS};
    let mut sim = Sim::training(4, 10);
    let t0 = sim.now;
    for (k, id) in (5..=20).enumerate() {
        sim.state.apply(&Command::Join { member: spec(id) }).unwrap();
        sim.progress.insert(id, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
        sim.ready_since.insert(id, t0 + 100 * k as u64);
    }
    sim.now = t0 + 1500;
    let why = sim.control();
    assert!(sim.state.scheduled.is_none() && why.contains("wave to settle"), "{why}");
    sim.now = t0 + 1500 + JOIN_SETTLE_MS;
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap_or_else(|| panic!("{why}"));
    assert_eq!(e.ranks, (1..=20).collect::<Vec<_>>(), "{why}");
    assert_eq!(e.sources.len(), 16);
    // A trickle: a host every 200 ms never settles, and is admitted at the wave's bound.
    let mut sim = Sim::training(4, 10);
    let t0 = sim.now;
    for (k, id) in (5..=20).enumerate() {
        sim.state.apply(&Command::Join { member: spec(id) }).unwrap();
        sim.progress.insert(id, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
        sim.ready_since.insert(id, t0 + 200 * k as u64);
    }
    sim.now = t0 + JOIN_WAVE_MAX_MS - 1;
    sim.control();
    assert!(sim.state.scheduled.is_none());
    sim.now = t0 + JOIN_WAVE_MAX_MS;
    sim.control();
    assert_eq!(sim.state.scheduled.as_ref().unwrap().ranks.len(), 20);
    // A failure does not wait for the wave.
    let mut sim = Sim::training(4, 10);
    sim.state.apply(&Command::Join { member: spec(5) }).unwrap();
    sim.progress.insert(5, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    sim.ready_since.insert(5, sim.now);
    sim.progress.get_mut(&4).unwrap().heartbeat_age_ms = 60_000;
    let why = sim.control();
    assert_eq!(sim.state.scheduled.as_ref().unwrap().ranks, vec![1, 2, 3, 5], "{why}");
}

/// The first epoch waits for every founder to be ready (at most `FORM_WAIT_MS` after the
/// first was, well past a joining wave's bound), so a cluster forms whole rather than with
/// whoever booted first.
#[test]
fn the_first_epoch_waits_for_every_founder_a_while() {
    use limpet_decide::controller::{FORM_WAIT_MS, JOIN_WAVE_MAX_MS};
    let mut sim = Sim::new(4);
    let t0 = sim.now;
    sim.progress.remove(&4);
    for id in 1..=3 {
        sim.ready_since.insert(id, t0);
    }
    sim.now = t0 + 2000;
    sim.control();
    assert!(sim.state.scheduled.is_none(), "formed without node 4");
    sim.progress.insert(4, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    sim.ready_since.insert(4, sim.now);
    sim.control();
    assert_eq!(sim.state.scheduled.as_ref().unwrap().ranks, vec![1, 2, 3, 4]);
    // A founder that never comes is waited for a while only.
    let mut sim = Sim::new(4);
    sim.progress.remove(&4);
    for id in 1..=3 {
        sim.ready_since.insert(id, sim.now);
    }
    let t0 = sim.now;
    sim.now = t0 + JOIN_WAVE_MAX_MS;
    sim.control();
    assert!(sim.state.scheduled.is_none(), "formed without node 4 at a joining wave's bound");
    sim.now = t0 + FORM_WAIT_MS - 1;
    sim.control();
    assert!(sim.state.scheduled.is_none(), "formed without node 4 before the bound");
    sim.now = t0 + FORM_WAIT_MS;
    sim.control();
    assert_eq!(sim.state.scheduled.as_ref().unwrap().ranks, vec![1, 2, 3]);
}

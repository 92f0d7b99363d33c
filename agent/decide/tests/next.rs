//! The trainer loop's decision, called directly: what a rank does next given the committed
//! log and where it stands (train, connect the next epoch early, enter it at the boundary or
//! at once after a failure, sit out, finish, or leave once removed).

use limpet_consensus::state::{ClusterState, Command, Epoch, EpochBatch, Layout};
use limpet_decide::next::{next_action, Action, Position};
use limpet_decide::report::Phase;

mod common;
use common::spec;

fn epoch(id: u64, start_step: u64, ranks: &[u64]) -> Epoch {
    Epoch {
        id,
        start_step,
        ranks: ranks.to_vec(),
        layout: Layout { data: ranks.len() as u32, pipeline: 1, cuts: Vec::new() },
        batch: EpochBatch { global_batch: 64, micro_batch: 64 },
        lr_scale: 1.0,
        sources: Default::default(),
        cause: String::new(),
        causes: Vec::new(),
        shares: Vec::new(),
        local_ranks: Vec::new(),
    }
}

/// Members 1-3 training epoch 1 (from step 0), and `scheduled` next if given.
fn state(scheduled: Option<Epoch>) -> ClusterState {
    let mut st = ClusterState::bootstrap("c", &[spec(1), spec(2), spec(3)]);
    st.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
    st.current = Some(epoch(1, 0, &[1, 2, 3]));
    st.last_epoch_id = scheduled.as_ref().map_or(1, |e| e.id);
    st.scheduled = scheduled;
    st
}

fn at(epoch: Option<u64>, step: u64) -> Position {
    Position { epoch, step, broken: false, was_member: true, job_steps: 100 }
}

#[test]
fn a_rank_in_the_current_epoch_trains() {
    assert_eq!(next_action(&state(None), 2, at(Some(1), 10)), Action::Train { connect_ahead: None });
}

#[test]
fn a_survivor_connects_the_next_epoch_early_and_switches_at_its_start() {
    let next = epoch(2, 20, &[1, 2]);
    let st = state(Some(next.clone()));
    assert_eq!(next_action(&st, 1, at(Some(1), 15)), Action::Train { connect_ahead: Some(next.clone()) });
    assert_eq!(next_action(&st, 1, at(Some(1), 20)), Action::Enter(next.clone()));
    // A broken collective does not wait for the boundary.
    let broken = Position { broken: true, ..at(Some(1), 15) };
    assert_eq!(next_action(&st, 1, broken), Action::Enter(next));
}

#[test]
fn a_rank_left_out_trains_to_the_boundary_then_sits_out() {
    let st = state(Some(epoch(2, 20, &[1, 2])));
    assert_eq!(next_action(&st, 3, at(Some(1), 15)), Action::Train { connect_ahead: None });
    assert_eq!(next_action(&st, 3, at(Some(1), 20)), Action::SitOut(2));
    let broken = Position { broken: true, ..at(Some(1), 15) };
    assert_eq!(next_action(&st, 3, broken), Action::SitOut(2));
}

#[test]
fn a_newcomer_enters_at_once_and_a_spare_waits() {
    let mut st = state(Some(epoch(2, 20, &[1, 2, 3, 4])));
    st.apply(&Command::Join { member: spec(4) }).unwrap();
    st.apply(&Command::Join { member: spec(5) }).unwrap();
    assert!(matches!(next_action(&st, 4, at(None, 0)), Action::Enter(e) if e.id == 2));
    assert_eq!(next_action(&st, 5, at(None, 0)), Action::Wait { phase: Phase::Waiting, ms: 100 });
}

#[test]
fn a_broken_rank_without_a_next_epoch_waits() {
    let broken = Position { broken: true, ..at(Some(1), 15) };
    assert_eq!(next_action(&state(None), 2, broken), Action::Wait { phase: Phase::Waiting, ms: 50 });
}

#[test]
fn the_last_step_finishes() {
    assert_eq!(next_action(&state(None), 2, at(Some(1), 100)), Action::Finish { connect_ahead: None });
}

#[test]
fn a_removed_node_leaves_once_it_is_no_voter_and_a_draining_one_reports_left() {
    // Node 3 drained and left: the epoch after it trains without it.
    let mut st = state(None);
    st.current = Some(epoch(2, 40, &[1, 2]));
    st.last_epoch_id = 2;
    st.apply(&Command::Drain { id: 3, reason: "test".into() }).unwrap();
    assert_eq!(next_action(&st, 3, at(None, 40)), Action::Wait { phase: Phase::Left, ms: 100 });
    st.apply(&Command::Remove { id: 3, reason: "left its last epoch".into() }).unwrap();
    st.voters.retain(|&v| v != 3);
    assert!(matches!(next_action(&st, 3, at(None, 40)), Action::Removed(_)));
    // One that never was a member in this process (restarted after a drain) waits instead.
    let fresh = Position { was_member: false, ..at(None, 0) };
    assert!(matches!(next_action(&st, 3, fresh), Action::Wait { .. }));
    // One whose record was dropped since (the state's bounded past) has left too.
    let mut dropped = st.clone();
    dropped.members.remove(&3);
    dropped.gone.retain(|&g| g != 3);
    assert!(
        matches!(next_action(&dropped, 3, at(None, 40)), Action::Removed(why) if why.contains("dropped"))
    );
    assert!(matches!(next_action(&dropped, 3, fresh), Action::Wait { .. }));
}

/// Groups connect a butterfly only when every rank's host advertises it
/// (`limpet_decide::entry::butterfly`).
#[test]
fn a_butterfly_needs_every_rank() {
    let with = |id: u64, butterfly: bool| {
        let mut s = spec(id);
        s.hardware.butterfly = butterfly;
        s
    };
    let st = ClusterState::bootstrap("c", &[with(1, true), with(2, true), with(3, false)]);
    assert!(limpet_decide::entry::butterfly(&st, &epoch(1, 0, &[1, 2])));
    assert!(!limpet_decide::entry::butterfly(&st, &epoch(1, 0, &[1, 2, 3])));
    assert!(!limpet_decide::entry::butterfly(&st, &epoch(1, 0, &[1, 9])), "a rank without a record");
}

/// An epoch's reductions take two levels only when its hosts span several zones, a zone
/// holds more than one of them, and every rank's host advertises the levels
/// (`limpet_decide::entry::zone_levels`).
#[test]
fn zone_levels_need_several_zones_and_every_rank() {
    let with = |id: u64, zone: &str, levels: bool| {
        let mut s = spec(id);
        s.hardware.zone = zone.into();
        s.hardware.zone_levels = levels;
        s
    };
    let specs = [
        with(1, "a", true),
        with(2, "a", true),
        with(3, "b", true),
        with(4, "b", false),
        with(5, "c", true),
        with(6, "", true),
    ];
    let st = ClusterState::bootstrap("c", &specs);
    let levels = |ranks: &[u64]| limpet_decide::entry::zone_levels(&st, &epoch(1, 0, ranks));
    assert_eq!(levels(&[3, 1, 2]), Some(vec!["b".to_string(), "a".into(), "a".into()]));
    assert_eq!(levels(&[1, 2, 3, 4]), None, "node 4 does not take them");
    assert_eq!(levels(&[1, 2]), None, "one zone");
    assert_eq!(levels(&[1, 3, 5]), None, "a host a zone is the flat ring");
    assert_eq!(
        levels(&[1, 2, 6]),
        Some(vec!["a".to_string(), "a".into(), String::new()]),
        "no zone is a zone"
    );
    assert_eq!(levels(&[1, 9]), None, "a rank without a record");
}

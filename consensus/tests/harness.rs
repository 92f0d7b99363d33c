//! Protocol scenarios on the in-memory network: five real raft-rs nodes with the real state
//! machine, messages dropped, links cut, nodes crashed and restarted.

use limpet_consensus::harness::{spec, Network};
use limpet_consensus::state::{Command, Hardware, MemberStatus};
use limpet_consensus::{CoreConfig, NodeId};

fn config() -> CoreConfig {
    CoreConfig::new(1, "harness")
}

fn five() -> Network {
    let mut net = Network::new(5, config(), 7);
    assert!(net.run_until(100, |n| n.leader().is_some()), "no leader elected");
    net
}

fn bump(id: NodeId, n: u64) -> Command {
    Command::UpdateHardware { id, hardware: Hardware { samples_per_sec_milli: n, ..Hardware::default() } }
}

/// Proposes through `via` and waits until the proposer applied it, proposing again when the
/// proposal was dropped (no leader yet, or a leadership transfer running), as clients do.
fn commit(net: &mut Network, via: NodeId, cmd: Command) -> bool {
    for _ in 0..5 {
        match net.propose(via, cmd.clone()) {
            Some(id) if net.run_until(50, |n| n.outcome(id).is_some()) => return true,
            Some(_) => {}
            None => net.run(10),
        }
    }
    false
}

fn assert_healthy(net: &Network) {
    assert_eq!(net.violations(), &[] as &[String]);
    net.check_committed_prefixes().unwrap();
}

fn converge(net: &mut Network) {
    assert!(net.run_until(400, Network::converged), "cluster did not converge");
    net.check_states_match().unwrap();
    assert_healthy(net);
}

#[test]
fn five_nodes_elect_one_leader_and_commit_through_any_node() {
    let mut net = five();
    for via in 1..=5 {
        assert!(commit(&mut net, via, bump(via, via)), "proposal via node {via} not applied");
    }
    converge(&mut net);
    let hw = &net.node(3).state().members[&4].spec.hardware;
    assert_eq!(hw.samples_per_sec_milli, 4);
}

#[test]
fn losing_the_leader_elects_another_and_the_old_one_catches_up_from_its_log() {
    let mut net = five();
    let old = net.leader().unwrap();
    assert!(commit(&mut net, old, bump(1, 1)));
    net.crash(old);
    assert!(net.run_until(100, |n| n.leader().is_some_and(|l| l != old)), "no new leader");
    let new = net.leader().unwrap();
    assert!(commit(&mut net, new, bump(2, 2)), "new leader cannot commit");
    net.restart(old);
    converge(&mut net);
    assert_eq!(net.node(old).state().members[&2].spec.hardware.samples_per_sec_milli, 2);
}

#[test]
fn a_minority_partition_cannot_commit_and_the_majority_can() {
    let mut net = five();
    let leader = net.leader().unwrap();
    let others: Vec<NodeId> = (1..=5).filter(|&i| i != leader).collect();
    // The old leader and one follower on the small side.
    let minority = [leader, others[0]];
    net.partition(&minority);
    let stuck = net.propose(leader, bump(1, 11));
    assert!(
        net.run_until(100, |n| n.leader().is_some_and(|l| !minority.contains(&l))),
        "majority has no leader"
    );
    assert!(commit(&mut net, others[2], bump(others[2], 22)), "majority side cannot commit");
    net.run(30);
    assert!(stuck.is_none_or(|id| net.outcome(id).is_none()), "minority side committed");
    net.heal();
    converge(&mut net);
    assert_eq!(net.node(leader).state().members[&others[2]].spec.hardware.samples_per_sec_milli, 22);
    // The proposal stranded on the minority was overwritten, never applied.
    assert_ne!(net.node(leader).state().members[&1].spec.hardware.samples_per_sec_milli, 11);
}

#[test]
fn without_a_majority_nothing_commits_until_the_network_heals() {
    let mut net = five();
    net.partition(&[1, 2]);
    net.partition(&[3, 4]);
    let before = net.node(5).status().commit;
    let p = net.propose(5, bump(5, 5));
    net.run(100);
    for id in 1..=5 {
        assert!(net.node(id).status().commit <= before + 1, "node {id} committed without a majority");
    }
    assert!(p.is_none_or(|id| net.outcome(id).is_none()));
    net.heal();
    converge(&mut net);
    assert!(commit(&mut net, 5, bump(5, 55)));
}

fn join(net: &mut Network, id: NodeId) {
    net.add_empty_node(id);
    let leader = net.leader().unwrap();
    assert!(commit(net, leader, Command::Join { member: spec(id) }));
    assert!(
        net.run_until(200, |n| n.node(id).applied() > 0 && n.node(leader).state().learners.contains(&id)),
        "node {id} did not become a learner"
    );
}

#[test]
fn a_revoked_voter_is_swapped_for_a_learner_by_joint_consensus() {
    let mut net = five();
    join(&mut net, 6);
    let leader = net.leader().unwrap();
    let victim = (1..=5).find(|&i| i != leader).unwrap();
    // The victim's own watcher gives the notice (raft forwards a node's proposals about itself).
    assert!(commit(
        &mut net,
        victim,
        Command::Notice { id: victim, deadline_ms: 120_000, source: "aws".into() }
    ));
    let swapped = net.run_until(200, |n| {
        let s = n.node(leader).status();
        s.voters.contains(&6) && !s.voters.contains(&victim) && s.voters_outgoing.is_empty()
    });
    assert!(swapped, "voter {victim} not replaced: {:?}", net.node(leader).status());
    let s = net.node(leader).status();
    assert_eq!(s.voters.len(), 5);
    assert!(s.learners.contains(&victim), "a leaving node still receives the log until it is gone");
    assert!(s.last_decision.contains(&format!("voter {victim} is Leaving")), "{}", s.last_decision);
    converge(&mut net);
}

#[test]
fn a_revoked_leader_hands_over_before_it_is_replaced() {
    let mut net = five();
    join(&mut net, 6);
    let leader = net.leader().unwrap();
    assert!(commit(&mut net, leader, Command::Notice { id: leader, deadline_ms: 1, source: "gcp".into() }));
    assert!(net.run_until(200, |n| n.leader().is_some_and(|l| l != leader)), "leadership not transferred");
    let new = net.leader().unwrap();
    assert!(
        net.run_until(200, |n| {
            let s = n.node(new).status();
            !s.voters.contains(&leader) && s.voters.contains(&6)
        }),
        "old leader not replaced"
    );
    converge(&mut net);
}

/// A cluster founded by more nodes than may vote elects among the first `max_voters` only:
/// the others are learners from the first entry, never candidates, and follow the log.
#[test]
fn founders_past_the_voter_limit_are_learners_from_the_start() {
    let mut net = Network::new(9, config(), 13);
    for id in 1..=9 {
        let s = net.node(id).status();
        assert_eq!((s.voters, s.learners), (vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9]), "node {id} at start");
    }
    assert!(net.run_until(100, |n| n.leader().is_some()), "no leader");
    assert!(net.leader().unwrap() <= 5, "a learner led: {:?}", net.leader());
    let leader = net.leader().unwrap();
    assert!(commit(&mut net, leader, Command::Notice { id: 9, deadline_ms: 1, source: "aws".into() }));
    net.run(20);
    assert_eq!(net.node(1).status().voters.len(), 5);
    converge(&mut net);
}

#[test]
fn joining_nodes_are_promoted_up_to_the_voter_limit() {
    let mut net = Network::new(1, config(), 3);
    assert!(net.run_until(50, |n| n.leader() == Some(1)));
    for id in 2..=7 {
        join(&mut net, id);
    }
    assert!(
        net.run_until(300, |n| n.node(1).status().voters.len() == 5),
        "voters: {:?}",
        net.node(1).status()
    );
    net.run(20);
    let s = net.node(1).status();
    assert_eq!(s.voters.len(), 5, "never more than max_voters");
    assert_eq!(s.learners.len(), 2);
    converge(&mut net);
    assert_eq!(net.node(7).state().voters, s.voters);
}

#[test]
fn a_silent_voter_is_replaced_after_the_timeout() {
    let mut net = five();
    join(&mut net, 6);
    let leader = net.leader().unwrap();
    let victim = (1..=5).find(|&i| i != leader).unwrap();
    net.crash(victim);
    net.run(30);
    assert!(net.node(leader).status().voters.contains(&victim), "replaced before the timeout");
    assert!(net.run_until(100, |n| !n.node(leader).status().voters.contains(&victim)), "silent voter kept");
    assert!(net.node(leader).status().voters.contains(&6));
    assert_healthy(&net);
}

#[test]
fn a_lagging_node_catches_up_by_snapshot() {
    let mut cfg = config();
    cfg.snapshot_interval = 10;
    let mut net = Network::new(5, cfg, 11);
    assert!(net.run_until(100, |n| n.leader().is_some()));
    let leader = net.leader().unwrap();
    let lagging = (1..=5).find(|&i| i != leader).unwrap();
    net.isolate(lagging);
    for n in 0..40 {
        assert!(commit(&mut net, leader, bump(leader, n)));
    }
    let first = net.node(leader).status().snapshot_index;
    assert!(first > net.node(lagging).status().last_index, "leader did not compact past the lagging node");
    net.heal();
    converge(&mut net);
    assert!(net.node(lagging).status().snapshot_index >= first, "caught up without a snapshot");
    assert_eq!(net.node(lagging).state().members[&leader].spec.hardware.samples_per_sec_milli, 39);
}

#[test]
fn random_drops_do_not_break_agreement() {
    let mut net = five();
    net.set_drop_rate(0.2);
    for n in 0..30 {
        let via = 1 + n % 5;
        let _ = net.propose(via, bump(via, n));
        net.run(3);
    }
    net.heal();
    converge(&mut net);
}

#[test]
fn members_move_through_their_statuses_in_the_log() {
    let mut net = five();
    // A node drains itself; the leader's controller marks another failed (a follower may
    // not: raft forwards only a node's proposals about itself).
    let follower = (1..=5).find(|&n| Some(n) != net.leader() && n != 5).unwrap();
    assert!(!commit(&mut net, follower, Command::MarkFailed { id: 5, reason: "heartbeats".into() }));
    assert!(commit(&mut net, 4, Command::Drain { id: 4, reason: "maintenance".into() }));
    // (Draining node 4 may have handed leadership over: ask who leads now.)
    assert!(net.run_until(100, |n| n.leader().is_some()));
    let leader = net.leader().unwrap();
    assert!(commit(&mut net, leader, Command::MarkFailed { id: 5, reason: "heartbeats".into() }));
    converge(&mut net);
    let st = net.node(1).state();
    assert_eq!(st.members[&4].status, MemberStatus::Draining);
    assert_eq!(st.members[&5].status, MemberStatus::Failed);
}

/// Nine nodes over three zones, joining zone by zone (a, a, a, a, then b, then c): the
/// voters end spread 2-2-1 whatever the order of the joins, and with every node of zone a
/// (the first leader among them) crashed at once, the rest elect a leader and commit.
#[test]
fn the_quorum_survives_the_loss_of_any_one_zone() {
    let zone = |id: NodeId| match id {
        1..=4 => "a",
        5..=7 => "b",
        _ => "c",
    };
    let with_zone = |id: NodeId| {
        let mut m = spec(id);
        m.hardware.zone = zone(id).into();
        m
    };
    let mut net = Network::new(1, config(), 11);
    assert!(net.run_until(100, |n| n.leader().is_some()), "no leader elected");
    let hardware = Hardware { zone: "a".into(), ..Hardware::default() };
    assert!(commit(&mut net, 1, Command::UpdateHardware { id: 1, hardware }));
    for id in 2..=9 {
        net.add_empty_node(id);
        let leader = net.leader().unwrap();
        assert!(commit(&mut net, leader, Command::Join { member: with_zone(id) }));
        assert!(
            net.run_until(200, |n| n.node(id).applied() > 0 && n.node(leader).state().learners.contains(&id)
                || n.node(leader).state().voters.contains(&id)),
            "node {id} did not join"
        );
    }
    let spread = net.run_until(2000, |n| {
        let Some(l) = n.leader() else { return false };
        let s = n.node(l).status();
        let per = |z: &str| s.voters.iter().filter(|&&v| zone(v) == z).count();
        s.voters.len() == 5 && s.voters_outgoing.is_empty() && ["a", "b", "c"].iter().all(|z| per(z) <= 2)
    });
    let l = net.leader().unwrap();
    assert!(spread, "voters not spread over the zones: {:?}", net.node(l).status());
    converge(&mut net);
    for id in 1..=4 {
        net.crash(id);
    }
    assert!(
        net.run_until(500, |n| n.leader().is_some_and(|l| zone(l) != "a")),
        "no leader after zone a was lost"
    );
    let leader = net.leader().unwrap();
    assert!(commit(&mut net, leader, bump(leader, 77)), "nothing commits without zone a");
    assert_healthy(&net);
}

/// The applied state is written every `save_every` entries, not every batch: a node killed
/// in between restarts from the last written state and replays the rest from its own log,
/// alone (cut off from its peers), to the same state. With `save_every` 1 every batch is
/// written.
#[test]
fn a_node_restarts_from_its_last_written_state_and_replays_the_rest_of_its_log() {
    use limpet_consensus::storage::LogStore as _;
    for save_every in [32, 1] {
        // Never written for time alone here: the test counts entries.
        let mut net = Network::new(5, CoreConfig { save_every, save_ticks: 1 << 40, ..config() }, 11);
        assert!(net.run_until(100, |n| n.leader().is_some()), "no leader elected");
        let victim = (1..=5).find(|&i| Some(i) != net.leader()).unwrap();
        for n in 0..10 {
            assert!(commit(&mut net, victim, bump(victim, 100 + n)), "proposal {n} not applied");
        }
        converge(&mut net);
        let speed =
            |net: &Network| net.node(victim).state().members[&victim].spec.hardware.samples_per_sec_milli;
        assert_eq!(speed(&net), 109);
        let written = net.node(victim).store().applied_state().expect("a written state").index;
        let applied = net.node(victim).applied();
        if save_every == 1 {
            assert_eq!(written, applied);
        } else {
            assert!(written < applied, "save_every {save_every}: state written at {written} of {applied}");
        }
        net.isolate(victim);
        net.crash(victim);
        net.restart(victim);
        net.run(5);
        assert_eq!(speed(&net), 109, "save_every {save_every}: the log after the written state was replayed");
        assert_eq!(net.node(victim).applied(), applied);
        net.heal();
        converge(&mut net);
    }
}

//! What a buggy or hostile peer can send a node's core, on the in-memory network of real
//! raft-rs nodes. raft-rs trusts its peers: each crafted message below would panic it or
//! change the voters behind the membership controller. `Core::step` refuses them, the
//! cluster goes on committing, and its committed logs agree. Arbitrary messages (a proptest)
//! never panic a node.

use limpet_consensus::harness::{entry, message, spec, Network, HARNESS_CLUSTER};
use limpet_consensus::state::{
    cluster_id, CapacityAction, CapacityRecord, CheckpointRecord, Command, Epoch, EpochBatch, Hardware,
    Layout, Market, Pool, Proposal, ProposalId, SnapshotData, FORMAT_VERSION,
};
use limpet_consensus::{ClusterState, CoreConfig, NodeId, StepError};
use proptest::prelude::*;
use raft::prelude::{ConfChangeSingle, ConfChangeType, ConfChangeV2, EntryType, Message, MessageType};

fn settled() -> Network {
    let mut net = Network::new(3, CoreConfig::new(1, "harness"), 11);
    assert!(net.run_until(100, |n| n.leader().is_some()), "no leader elected");
    for i in 1..=3 {
        assert!(commit(&mut net, bump(i, i)), "proposal {i} not applied");
    }
    net
}

fn bump(id: NodeId, n: u64) -> Command {
    Command::UpdateHardware { id, hardware: Hardware { samples_per_sec_milli: n, ..Hardware::default() } }
}

fn commit(net: &mut Network, cmd: Command) -> bool {
    for _ in 0..5 {
        let via = net.leader().unwrap_or(1);
        match net.propose(via, cmd.clone()) {
            Some(id) if net.run_until(50, |n| n.outcome(id).is_some()) => return true,
            _ => net.run(10),
        }
    }
    false
}

fn refused(net: &mut Network, to: NodeId, m: Message, want: &str) {
    match net.node_mut(to).step(m) {
        Err(StepError::Refused(why)) => assert!(why.contains(want), "{why:?} lacks {want:?}"),
        other => panic!("expected a refusal containing {want:?}, got {other:?}"),
    }
}

/// After the attempts: still one cluster, committing, with agreeing logs and states.
fn still_healthy(mut net: Network) {
    assert!(commit(&mut net, bump(2, 77)), "no commit after the attempts");
    assert!(net.run_until(400, Network::converged), "cluster did not converge");
    net.check_states_match().unwrap();
    net.check_committed_prefixes().unwrap();
    assert_eq!(net.violations(), &[] as &[String]);
    assert_eq!(net.node(1).state().members[&2].spec.hardware.samples_per_sec_milli, 77);
}

#[test]
fn messages_that_would_panic_raft_or_bypass_the_state_machine_are_refused() {
    let mut net = settled();
    let leader = net.leader().unwrap();
    let (follower, rogue) = {
        let others: Vec<NodeId> = (1..=3).filter(|&n| n != leader).collect();
        (others[0], others[1])
    };
    let st = net.node(follower).status();
    let (t, last) = (st.term, st.last_index);

    // A heartbeat committing past the log: raft-rs's commit_to panics.
    let mut m = message(MessageType::MsgHeartbeat, leader, follower, t);
    m.commit = last + 1000;
    refused(&mut net, follower, m, "past its last index");

    // An append matching the log's end but carrying index 1 with another term: raft-rs finds
    // a conflict below the commit index and panics.
    let mut m = message(MessageType::MsgAppend, rogue, follower, t + 3);
    (m.index, m.log_term, m.commit) = (last, t, last);
    m.entries = vec![entry(EntryType::EntryNormal, 1, t + 3, vec![])];
    refused(&mut net, follower, m, "holds entry 1");

    // An acknowledgement past the leader's log.
    let mut m = message(MessageType::MsgAppendResponse, rogue, leader, t);
    m.index = net.node(leader).status().last_index + 50;
    refused(&mut net, leader, m, "past the last index");

    // A peer's proposal carrying a configuration change: voters changed behind the controller.
    let mut cc = ConfChangeV2::default();
    let mut one = ConfChangeSingle::default();
    one.set_change_type(ConfChangeType::RemoveNode);
    one.node_id = follower;
    cc.changes = vec![one];
    let mut m = message(MessageType::MsgPropose, rogue, leader, 0);
    m.entries = vec![entry(EntryType::EntryConfChangeV2, 0, 0, limpet_consensus::codec::encode(&cc))];
    refused(&mut net, leader, m, "configuration change");

    // A proposal claiming another node proposed it, joining as that node at a new address.
    let mut takeover = spec(follower);
    takeover.data_addr = "mem:rogue".into();
    let p = Proposal {
        v: FORMAT_VERSION,
        origin: ProposalId { node: follower, seq: 9 },
        command: Command::Join { member: takeover.clone() },
    };
    let mut m = message(MessageType::MsgPropose, rogue, leader, 0);
    m.entries = vec![entry(EntryType::EntryNormal, 0, 0, p.encode())];
    refused(&mut net, leader, m, &format!("speaks for node {follower}"));
    // The same Join as the rogue's own proposal: still another live member's.
    let p = Proposal { origin: ProposalId { node: rogue, seq: 9 }, ..p };
    let mut m = message(MessageType::MsgPropose, rogue, leader, 0);
    m.entries = vec![entry(EntryType::EntryNormal, 0, 0, p.encode())];
    refused(&mut net, leader, m, &format!("may propose join only about itself, not node {follower}"));
    // What only the leader's controllers or an operator decide, forwarded by a member: an
    // on-demand launch, removing another node, an epoch, another's failure or notice.
    let forwarded = |command: Command| {
        let p = Proposal { v: FORMAT_VERSION, origin: ProposalId { node: rogue, seq: 10 }, command };
        let mut m = message(MessageType::MsgPropose, rogue, leader, 0);
        m.entries = vec![entry(EntryType::EntryNormal, 0, 0, p.encode())];
        m
    };
    let launch = CapacityRecord {
        seq: 1,
        at_ms: 1,
        by: rogue,
        action: CapacityAction::Launch {
            pool: Pool { instance_type: "p4d.24xlarge".into(), subnet: "subnet-1".into() },
            market: Market::OnDemand,
            token: "rogue".into(),
            node_name: None,
        },
        reason: "rogue".into(),
    };
    let epoch = Epoch {
        id: 99,
        start_step: 0,
        ranks: vec![rogue],
        layout: Layout::data_parallel(1),
        batch: EpochBatch { global_batch: 8, micro_batch: 8 },
        lr_scale: 1.0,
        sources: Default::default(),
        cause: "rogue".into(),
        causes: Vec::new(),
        shares: Vec::new(),
        local_ranks: Vec::new(),
    };
    for (command, want) in [
        (Command::RecordCapacity { record: launch }, "may not propose record_capacity"),
        (Command::Remove { id: follower, reason: "rogue".into() }, "may not propose remove"),
        (Command::ScheduleEpoch { epoch }, "may not propose schedule_epoch"),
        (Command::MarkFailed { id: follower, reason: "rogue".into() }, "may not propose mark_failed"),
        (
            Command::Notice { id: follower, deadline_ms: 1, source: "rogue".into() },
            "may propose notice only about itself",
        ),
        (bump(follower, 5), "may propose update_hardware only about itself"),
    ] {
        refused(&mut net, leader, forwarded(command), &format!("node {rogue} {want}"));
    }
    // A checkpoint it claims to have written in no epoch it trains in (here: none; a new
    // cluster's resume record, epoch 0, is the leader's): such a record at a huge step would
    // make the log refuse every real one after it.
    let hash = "0123456789abcdef".repeat(4);
    let record = CheckpointRecord {
        step: u64::MAX,
        epoch: 0,
        content_hash: hash.clone(),
        location: "/x".into(),
        node: rogue,
    };
    let report = |record: &CheckpointRecord| forwarded(Command::RecordCheckpoint { record: record.clone() });
    refused(&mut net, leader, report(&record), "which it does not train in");
    // A record's shape, checked first: a hash that is not one, and a location that is
    // empty, huge (kept in every snapshot), or holding an escape sequence for the operator's
    // terminal (`limpet status` prints it).
    for (content_hash, location, want) in [
        ("x".to_string(), "/x".to_string(), "not 64 lowercase hex digits (1 bytes)"),
        (hash.to_uppercase(), "/x".to_string(), "not 64 lowercase hex digits (64 bytes)"),
        (hash.clone(), String::new(), "location that is empty"),
        (hash.clone(), "/".repeat(4097), "longer than 4096 bytes"),
        (hash.clone(), "/x\u{1b}[2J".to_string(), "holds a control character"),
    ] {
        let bad = CheckpointRecord { content_hash, location, ..record.clone() };
        refused(&mut net, leader, report(&bad), want);
    }
    // Its own hardware is its to report.
    assert!(net.node_mut(leader).step(forwarded(bump(rogue, 5))).is_ok());

    // A node outside the configuration speaks raft, or speaks as a leader.
    refused(
        &mut net,
        follower,
        message(MessageType::MsgRequestVote, 9, follower, t),
        "not in the configuration",
    );
    refused(
        &mut net,
        follower,
        message(MessageType::MsgHeartbeat, 9, follower, t),
        "not in the configuration",
    );
    // A term far past the node's: adopted, it would overflow at the next election.
    for term in [u64::MAX, t + limpet_consensus::MAX_TERM_LEAD + 1] {
        refused(
            &mut net,
            follower,
            message(MessageType::MsgRequestVote, rogue, follower, term),
            "past this node's",
        );
    }
    // Entries of a term past the message's own.
    let mut m = message(MessageType::MsgAppend, rogue, follower, t + 1);
    (m.index, m.log_term) = (last, t);
    m.entries = vec![entry(EntryType::EntryNormal, last + 1, t + 2, vec![])];
    refused(&mut net, follower, m, "log term past its term");
    // "Campaign now" from a member that does not lead, and from the leader at another term.
    refused(
        &mut net,
        follower,
        message(MessageType::MsgTimeoutNow, rogue, follower, t),
        &format!("which node {leader} leads"),
    );
    refused(
        &mut net,
        follower,
        message(MessageType::MsgTimeoutNow, leader, follower, t + 1),
        "tells this node to campaign",
    );
    // Bytes that are no proposal at all.
    let mut m = message(MessageType::MsgPropose, rogue, leader, 0);
    m.entries = vec![entry(EntryType::EntryNormal, 0, 0, b"{\"v\":1}".to_vec())];
    refused(&mut net, leader, m, "a proposal from node");

    // Asking the leader to hand leadership over.
    refused(
        &mut net,
        leader,
        message(MessageType::MsgTransferLeader, rogue, leader, t),
        "asks for leadership",
    );

    // Another cluster's state as a snapshot.
    let data =
        SnapshotData { v: FORMAT_VERSION, cluster_id: 1, state: ClusterState::bootstrap("other", &[]) };
    let mut m = message(MessageType::MsgSnapshot, leader, follower, t);
    m.mut_snapshot().data = data.encode();
    m.mut_snapshot().mut_metadata().index = last + 10;
    m.mut_snapshot().mut_metadata().term = t;
    refused(&mut net, follower, m, "snapshot from node");

    assert_eq!(net.node(leader).state().members[&follower].spec.data_addr, format!("mem:{follower}"));
    still_healthy(net);
}

/// A leader's message of `kind` from `from` at `term`, as a peer taking the log over would
/// send it: an append that would add an entry, a heartbeat that would commit, a snapshot of a
/// made-up state (no revocations, one member, the sender, as the only voter).
fn leader_claim(kind: MessageType, from: NodeId, to: NodeId, term: u64, last: u64) -> Message {
    let mut m = message(kind, from, to, term);
    match kind {
        MessageType::MsgAppend => {
            (m.index, m.log_term, m.commit) = (last, term - 1, last);
            m.entries = vec![entry(EntryType::EntryNormal, last + 1, term, vec![])];
        }
        MessageType::MsgHeartbeat => m.commit = last,
        _ => {
            let state = ClusterState::bootstrap(HARNESS_CLUSTER, &[spec(from)]);
            let data = SnapshotData { v: FORMAT_VERSION, cluster_id: cluster_id(HARNESS_CLUSTER), state };
            m.mut_snapshot().data = data.encode();
            let meta = m.mut_snapshot().mut_metadata();
            (meta.index, meta.term) = (last + 10, term);
            meta.mut_conf_state().voters = vec![from];
        }
    }
    m
}

#[test]
fn an_outsider_at_a_higher_term_does_not_lead() {
    let mut net = settled();
    // Node 4 joins as a learner, then dies and is marked failed (it stays in the
    // configuration, a learner, until it is removed); its certificate is the attacker's.
    net.add_empty_node(4);
    let leader = net.leader().unwrap();
    assert!(commit(&mut net, Command::Join { member: spec(4) }), "node 4 not admitted");
    assert!(
        net.run_until(200, |n| n.node(4).applied() > 0 && n.node(leader).state().learners.contains(&4)),
        "node 4 did not become a learner"
    );
    net.crash(4);
    assert!(commit(&mut net, Command::MarkFailed { id: 4, reason: "test".into() }));
    assert!(net.run_until(200, Network::converged), "not converged after the failure");
    let leader = net.leader().unwrap();
    let follower = (1..=3).find(|&n| n != leader).unwrap();
    let before: Vec<ClusterState> = (1..=3).map(|n| net.node(n).state().clone()).collect();
    let st = net.node(leader).status();
    let (t, last) = (st.term, st.last_index);

    // Node 9 was never admitted (a spare's credential, say); node 4 is failed. Each claims a
    // newer term as a leader, to the leader and to a follower alike.
    for (from, want) in [(9, "node 9 was never admitted"), (4, "node 4 is Failed in the log")] {
        for to in [leader, follower] {
            for kind in [MessageType::MsgAppend, MessageType::MsgHeartbeat, MessageType::MsgSnapshot] {
                refused(&mut net, to, leader_claim(kind, from, to, t + 1, last), want);
            }
        }
    }
    // At the current term only the leader speaks as one: a voter that does not lead cannot
    // make a follower follow it, and a failed learner cannot either.
    let other = (1..=3).find(|&n| n != leader && n != follower).unwrap();
    refused(&mut net, follower, leader_claim(MessageType::MsgHeartbeat, other, follower, t, last), "leads");
    refused(&mut net, follower, leader_claim(MessageType::MsgAppend, 4, follower, t, last), "leads");
    // "Campaign now" from the leader itself, while the log says it stays.
    refused(&mut net, follower, message(MessageType::MsgTimeoutNow, leader, follower, t), "says it stays");

    assert!(net.node(leader).is_leader(), "node {leader} stopped leading");
    for n in 1..=3 {
        assert_eq!(net.node(n).term(), t, "node {n} moved to another term");
        assert_eq!(net.node(n).state(), &before[n as usize - 1], "node {n}'s state changed");
    }
    // The leader stays through what follows, and the cluster commits.
    net.run(30);
    assert_eq!(net.leader(), Some(leader));
    assert!(commit(&mut net, bump(2, 77)), "no commit after the attempts");
    assert!(net.run_until(400, Network::converged), "cluster did not converge");
    net.check_states_match().unwrap();
    assert_eq!(net.violations(), &[] as &[String]);
}

const KINDS: [MessageType; 14] = [
    MessageType::MsgAppend,
    MessageType::MsgAppendResponse,
    MessageType::MsgRequestVote,
    MessageType::MsgRequestVoteResponse,
    MessageType::MsgSnapshot,
    MessageType::MsgHeartbeat,
    MessageType::MsgHeartbeatResponse,
    MessageType::MsgTransferLeader,
    MessageType::MsgTimeoutNow,
    MessageType::MsgReadIndex,
    MessageType::MsgReadIndexResp,
    MessageType::MsgRequestPreVote,
    MessageType::MsgRequestPreVoteResponse,
    MessageType::MsgPropose,
];

const ENTRY_KINDS: [EntryType; 3] =
    [EntryType::EntryNormal, EntryType::EntryConfChange, EntryType::EntryConfChangeV2];

/// Mostly a value near the log's (below `near`), where the checks are subtle; else any u64
/// (huge terms and indexes, where sums overflow).
fn near_or_any(near: u64) -> impl Strategy<Value = u64> {
    prop_oneof![4 => 0..near, 1 => any::<u64>(), 1 => (u64::MAX - 4)..=u64::MAX]
}

prop_compose! {
    /// A message a peer could send: any kind, indexes and terms near the log's, entries with
    /// any index, term, kind and bytes, `reject` either way.
    fn any_message()(
        kind in 0..KINDS.len(),
        from in prop_oneof![8 => 1u64..=3, 1 => any::<u64>()],
        term in near_or_any(12),
        index in near_or_any(40),
        log_term in near_or_any(12),
        commit in near_or_any(60),
        reject in any::<bool>(),
        reject_hint in near_or_any(40),
        entries in proptest::collection::vec((near_or_any(45), near_or_any(12), 0..ENTRY_KINDS.len(), proptest::collection::vec(any::<u8>(), 0..24)), 0..4),
        snap_index in near_or_any(60),
        snap_voters in proptest::collection::vec(0u64..6, 0..4),
        snap_valid in any::<bool>(),
        // Now and then an enum number that names nothing (prost keeps it as sent).
        bad_kind in proptest::option::weighted(0.05, 14i32..100),
        bad_entry_kind in proptest::option::weighted(0.05, 3i32..100),
    ) -> Message {
        let mut m = message(KINDS[kind], from, 0, term);
        (m.index, m.log_term, m.commit, m.reject, m.reject_hint) = (index, log_term, commit, reject, reject_hint);
        m.entries = entries.into_iter().map(|(i, t, k, d)| entry(ENTRY_KINDS[k], i, t, d)).collect::<Vec<_>>();
        if let (Some(k), Some(e)) = (bad_entry_kind, m.entries.first_mut()) {
            e.entry_type = k;
        }
        if m.get_msg_type() == MessageType::MsgSnapshot {
            // Half of them hold this cluster's state (they pass the cluster check and reach
            // raft-rs's restore), with any voters.
            if snap_valid {
                let members: Vec<_> = (1..=3).map(spec).collect();
                let state = ClusterState::bootstrap(HARNESS_CLUSTER, &members);
                let data = SnapshotData { v: FORMAT_VERSION, cluster_id: cluster_id(HARNESS_CLUSTER), state };
                m.mut_snapshot().data = data.encode();
            }
            let meta = m.mut_snapshot().mut_metadata();
            (meta.index, meta.term) = (snap_index, log_term);
            meta.mut_conf_state().voters = snap_voters;
        }
        if let Some(k) = bad_kind {
            m.msg_type = k;
        }
        m
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// No message from a peer panics a node, whatever it holds: each goes to a node other than
    /// its sender, and the network then runs on.
    #[test]
    fn no_peer_message_panics_a_node(msgs in proptest::collection::vec(any_message(), 1..8)) {
        let mut net = settled();
        for mut m in msgs {
            m.to = match m.from { 1 => 2, 2 => 3, _ => 1 };
            let _ = net.node_mut(m.to).step(m);
            net.run(2);
        }
        net.run(50);
    }
}

use super::*;

fn spec(id: NodeId, name: &str) -> MemberSpec {
    MemberSpec {
        id,
        name: name.into(),
        control_addr: format!("127.0.0.1:{}", 7000 + id),
        data_addr: format!("127.0.0.1:{}", 8000 + id),
        hardware: Hardware::default(),
    }
}

/// Founders past `max_voters` are learners from the start; every founder is a member.
#[test]
fn a_cluster_founded_by_many_votes_with_its_first_founders() {
    let specs: Vec<MemberSpec> = (1..=7).rev().map(|i| spec(i, &format!("n{i}"))).collect();
    let s = ClusterState::founded("c", &specs, 3);
    assert_eq!((s.voters.clone(), s.learners.clone()), (vec![1, 2, 3], vec![4, 5, 6, 7]));
    assert_eq!(s.members.len(), 7);
    s.validate().unwrap();
    let few = ClusterState::founded("c", &specs[4..], 5);
    assert_eq!((few.voters, few.learners), (vec![1, 2, 3], vec![]));
}

fn three() -> ClusterState {
    ClusterState::bootstrap("c", &[spec(1, "a"), spec(2, "b"), spec(3, "c")])
}

fn epoch(id: u64, start: u64, ranks: &[NodeId]) -> Epoch {
    Epoch {
        id,
        start_step: start,
        ranks: ranks.to_vec(),
        layout: Layout::data_parallel(ranks.len()),
        batch: EpochBatch { global_batch: 64, micro_batch: 16 },
        lr_scale: 1.0,
        sources: BTreeMap::new(),
        cause: "test".into(),
        causes: Vec::new(),
        shares: Vec::new(),
        local_ranks: Vec::new(),
    }
}

#[test]
fn an_epoch_with_sources_survives_the_log() {
    let mut e = epoch(3, 10, &[1, 2]);
    e.sources.insert(2, 1);
    let p = Proposal {
        v: FORMAT_VERSION,
        origin: ProposalId { node: 1, seq: 1 },
        command: Command::ScheduleEpoch { epoch: e.clone() },
    };
    let back = Proposal::decode(&p.encode()).unwrap();
    assert_eq!(back, p);
    let twice = String::from_utf8(p.encode()).unwrap().replace("[[2,1]]", "[[2,1],[2,3]]");
    let err = Proposal::decode(twice.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("two state sources"), "{err}");
}

#[test]
fn a_refused_command_changes_nothing() {
    let mut st = three();
    let before = st.clone();
    assert!(st.apply(&Command::Join { member: spec(4, "a") }).unwrap_err().0.contains("taken by node 1"));
    assert!(st.apply(&Command::Activate { id: 9 }).is_err());
    assert!(st.apply(&Command::ScheduleEpoch { epoch: epoch(1, 0, &[1, 9]) }).is_err());
    assert_eq!(st, before);
}

#[test]
fn members_follow_their_life_cycle() {
    let mut st = three();
    st.apply(&Command::Join { member: spec(4, "d") }).unwrap();
    assert_eq!(st.members[&4].status, MemberStatus::Joining);
    st.apply(&Command::Activate { id: 4 }).unwrap();
    st.apply(&Command::Notice { id: 4, deadline_ms: 500, source: "aws".into() }).unwrap();
    assert_eq!(st.members[&4].status, MemberStatus::Leaving);
    assert_eq!(st.members[&4].deadline_ms, Some(500));
    assert!(st.apply(&Command::Activate { id: 4 }).unwrap_err().0.contains("cannot activate"));
    st.apply(&Command::Remove { id: 4, reason: "left".into() }).unwrap();
    assert!(st.apply(&Command::Notice { id: 4, deadline_ms: 9, source: "aws".into() }).is_err());
    // A gone node may come back under its name, and its name is free for others.
    st.apply(&Command::Join { member: spec(4, "d") }).unwrap();
    assert_eq!(st.members[&4].status, MemberStatus::Joining);
}

#[test]
fn epochs_only_move_forward() {
    let mut st = three();
    st.apply(&Command::ScheduleEpoch { epoch: epoch(1, 0, &[1, 2, 3]) }).unwrap();
    st.apply(&Command::ActivateEpoch { id: 1 }).unwrap();
    assert!(st.apply(&Command::ScheduleEpoch { epoch: epoch(1, 5, &[1, 2]) }).is_err(), "same id");
    st.apply(&Command::ScheduleEpoch { epoch: epoch(2, 10, &[1, 2]) }).unwrap();
    assert!(st.apply(&Command::ScheduleEpoch { epoch: epoch(3, 2, &[1, 2]) }).is_ok());
    assert!(st.apply(&Command::ActivateEpoch { id: 2 }).unwrap_err().0.contains("epoch 3 is"));
    let mut bad = epoch(4, 20, &[1, 2]);
    bad.layout = Layout::data_parallel(1);
    assert!(st.apply(&Command::ScheduleEpoch { epoch: bad }).unwrap_err().0.contains("does not cover"));
    let mut bad = epoch(4, 20, &[1, 2]);
    bad.layout = Layout { data: 1, pipeline: 2, cuts: vec![] };
    assert!(st
        .apply(&Command::ScheduleEpoch { epoch: bad })
        .unwrap_err()
        .0
        .contains("need 1 increasing block cuts"));
    let mut bad = epoch(4, 20, &[1, 2]);
    bad.layout = Layout { data: 1, pipeline: 2, cuts: vec![0] };
    assert!(st.apply(&Command::ScheduleEpoch { epoch: bad }).is_err(), "a stage without blocks");
    let pipelined = Layout { data: 1, pipeline: 2, cuts: vec![3] };
    assert_eq!(pipelined.stage_blocks(5).unwrap(), vec![0..3, 3..5]);
    assert!(pipelined.stage_blocks(3).unwrap_err().0.contains("do not split 3 blocks"));
    let mut bad = epoch(4, 20, &[1, 2]);
    bad.lr_scale = f64::NAN;
    assert!(st.apply(&Command::ScheduleEpoch { epoch: bad }).is_err());
    let early = epoch(4, 0, &[1]);
    st.apply(&Command::ActivateEpoch { id: 3 }).unwrap();
    assert!(st.apply(&Command::ScheduleEpoch { epoch: early }).unwrap_err().0.contains("before the current"));
}

#[test]
fn the_job_is_set_once() {
    let mut st = three();
    let job = serde_json::json!({"model": "mlp", "steps": 10});
    st.apply(&Command::SetJob { job: job.clone() }).unwrap();
    st.apply(&Command::SetJob { job }).unwrap();
    assert!(st.apply(&Command::SetJob { job: serde_json::json!({"model": "gpt"}) }).is_err());
}

#[test]
fn checkpoint_records_are_ordered_and_bounded() {
    let mut st = three();
    st.apply(&Command::ScheduleEpoch { epoch: epoch(1, 0, &[1]) }).unwrap();
    let rec =
        |step| CheckpointRecord { step, epoch: 1, content_hash: "h".into(), location: "l".into(), node: 1 };
    for step in 0..20 {
        st.apply(&Command::RecordCheckpoint { record: rec(step) }).unwrap();
    }
    assert_eq!(st.checkpoints.len(), MAX_CHECKPOINT_RECORDS);
    assert!(st.apply(&Command::RecordCheckpoint { record: rec(3) }).is_err());
    let future = CheckpointRecord { epoch: 7, ..rec(30) };
    assert!(st.apply(&Command::RecordCheckpoint { record: future }).is_err());
    // A record sent again (its first proposal went unanswered) is kept once; another writer's
    // record of the same step is its own.
    let at_19 = |st: &ClusterState| st.checkpoints.iter().filter(|c| c.step == 19).count();
    let again = st.apply(&Command::RecordCheckpoint { record: rec(19) }).unwrap();
    assert!(again.contains("already recorded"), "{again}");
    assert_eq!(at_19(&st), 1);
    let stage = CheckpointRecord { node: 2, location: "m".into(), ..rec(19) };
    st.apply(&Command::RecordCheckpoint { record: stage.clone() }).unwrap();
    st.apply(&Command::RecordCheckpoint { record: rec(19) }).unwrap();
    assert_eq!(at_19(&st), 2);
    assert_eq!(st.checkpoints.last(), Some(&stage));
}

/// A member's record at the job's last step, with a made-up hash: the log still takes every
/// honest writer's later records, and the forger's flood of records does not flush them out.
#[test]
fn a_forged_checkpoint_record_hides_nothing() {
    let mut st = three();
    st.apply(&Command::ScheduleEpoch { epoch: epoch(1, 0, &[1, 2]) }).unwrap();
    let rec = |node, step| CheckpointRecord {
        step,
        epoch: 1,
        content_hash: format!("{node}"),
        location: format!("/ckpt/{node}/{step}"),
        node,
    };
    st.apply(&Command::RecordCheckpoint { record: rec(1, 10) }).unwrap();
    st.apply(&Command::RecordCheckpoint { record: rec(2, 1_000_000) }).unwrap();
    for step in [20, 30] {
        let done = st.apply(&Command::RecordCheckpoint { record: rec(1, step) });
        assert!(done.is_ok(), "an honest record after the forged one: {done:?}");
    }
    // The records stay in step order; the forger orders only its own.
    let steps: Vec<u64> = st.checkpoints.iter().map(|c| c.step).collect();
    assert_eq!(steps, [10, 20, 30, 1_000_000]);
    assert!(st.apply(&Command::RecordCheckpoint { record: rec(2, 5) }).unwrap_err().0.contains("node 2's"));
    // Twenty more forged records, then one honest: the honest writer's newest are kept.
    for step in 0..20 {
        st.apply(&Command::RecordCheckpoint { record: rec(2, 1_000_001 + step) }).unwrap();
    }
    st.apply(&Command::RecordCheckpoint { record: rec(1, 40) }).unwrap();
    assert_eq!(st.checkpoints.len(), MAX_CHECKPOINT_RECORDS);
    let honest: Vec<u64> = st.checkpoints.iter().filter(|c| c.node == 1).map(|c| c.step).collect();
    assert_eq!(honest, [10, 20, 30, 40]);
    st.validate().unwrap();
}

/// A member joining under a spare credential's name: before the spare's launch it holds the
/// name only until the spare itself joins; after the launch it cannot take it.
#[test]
fn a_member_cannot_take_a_spares_name() {
    let mut st = three();
    let spare = |name: &str| MemberSpec { id: node_id_of_name(name), ..spec(9, name) };
    st.apply(&Command::Join { member: spec(9, "spare-1") }).unwrap();
    st.apply(&Command::Join { member: spare("spare-1") }).unwrap();
    assert_eq!(st.members[&node_id_of_name("spare-1")].spec.name, "spare-1");
    assert_eq!(st.members[&9].spec.name, "spare-1#9");
    // Nor can the squatter take it back.
    assert!(st.apply(&Command::Join { member: spec(9, "spare-1") }).unwrap_err().0.contains("taken"));
    let launch = CapacityRecord {
        seq: 1,
        at_ms: 1,
        by: 1,
        action: CapacityAction::Launch {
            pool: Pool { instance_type: "p4d.24xlarge".into(), subnet: "subnet-1".into() },
            market: Market::Spot,
            token: "t".into(),
            node_name: Some("spare-2".into()),
        },
        reason: "refill".into(),
    };
    st.apply(&Command::RecordCapacity { record: launch }).unwrap();
    let e = st.apply(&Command::Join { member: spec(8, "spare-2") }).unwrap_err();
    assert!(e.0.contains("launched spare's"), "{e}");
    st.apply(&Command::Join { member: spare("spare-2") }).unwrap();
}

#[test]
fn proposals_of_another_version_are_refused_by_name() {
    let p = Proposal { v: 2, origin: ProposalId { node: 1, seq: 1 }, command: Command::Activate { id: 1 } };
    let err = Proposal::decode(&p.encode()).unwrap_err();
    assert!(err.to_string().contains("format version 2"), "{err}");
    assert!(Proposal::decode(b"{\"v\":1}").unwrap_err().to_string().contains("missing field"));
}

#[test]
fn unequal_shares_must_split_the_global_batch_over_data_parallel_ranks() {
    let mut st = three();
    let mut e = epoch(1, 0, &[1, 2, 3]);
    e.shares = vec![30, 30, 5];
    assert!(st.apply(&Command::ScheduleEpoch { epoch: e.clone() }).unwrap_err().0.contains("shares"));
    e.shares = vec![30, 34];
    assert!(st.apply(&Command::ScheduleEpoch { epoch: e.clone() }).is_err());
    e.shares = vec![u64::MAX, 2, 0];
    assert!(st.apply(&Command::ScheduleEpoch { epoch: e.clone() }).is_err());
    e.shares = vec![30, 30, 4];
    st.apply(&Command::ScheduleEpoch { epoch: e }).unwrap();
}

#[test]
fn a_hosts_record_comes_back_from_the_log_as_the_same_record() {
    // One rank is written without the field and read back as 0: the same host.
    for ranks in [0, 1, 4] {
        let hw =
            Hardware { instance_type: "g5.12xlarge".into(), cpus: 48, gpus: 4, ranks, ..Hardware::default() };
        let back: Hardware = serde_json::from_str(&serde_json::to_string(&hw).unwrap()).unwrap();
        assert_eq!(back, hw, "ranks {ranks}");
    }
    let one = Hardware { ranks: 1, ..Hardware::default() };
    assert_ne!(one, Hardware { ranks: 2, ..Hardware::default() });
    assert_ne!(one, Hardware { cpus: 1, ..one.clone() });
}

#[test]
fn local_ranks_number_devices_and_split_a_hosts_share() {
    let mut st = three();
    for (id, n) in [(1, 2), (3, 4)] {
        let hardware = Hardware { ranks: n, ..Hardware::default() };
        st.apply(&Command::UpdateHardware { id, hardware }).unwrap();
    }
    let mut e = epoch(1, 0, &[1, 2, 3]);
    e.local_ranks = vec![2, 1, 4];
    // More ranks than a node announced: refused.
    let greedy = Epoch { local_ranks: vec![2, 2, 4], ..e.clone() };
    assert!(st.apply(&Command::ScheduleEpoch { epoch: greedy }).unwrap_err().0.contains("announced 1"));
    assert_eq!((e.total_ranks(), e.first_rank_of(0), e.first_rank_of(1), e.first_rank_of(2)), (7, 0, 2, 3));
    assert!(e.rank_shares().is_empty(), "equal shares stay equal per device");
    e.shares = vec![20, 10, 34];
    assert_eq!(e.rank_shares(), vec![10, 10, 10, 9, 9, 8, 8]);
    // Refused: a count per node or none, each 1..=MAX_LOCAL_RANKS, as many each in a
    // pipeline, at most MAX_PIPELINE_LOCAL_RANKS.
    for bad in [vec![2, 1], vec![0, 1, 1], vec![1, 1, MAX_LOCAL_RANKS + 1]] {
        let e = Epoch { local_ranks: bad, ..e.clone() };
        assert!(st.apply(&Command::ScheduleEpoch { epoch: e }).unwrap_err().0.contains("local ranks"));
    }
    let mut piped = epoch(1, 0, &[1, 2]);
    piped.layout = Layout { data: 1, pipeline: 2, cuts: vec![1] };
    piped.local_ranks = vec![2, 1];
    let uneven = Epoch { local_ranks: vec![2, 1], ..piped.clone() };
    assert!(st.apply(&Command::ScheduleEpoch { epoch: uneven }).unwrap_err().0.contains("local ranks"));
    let mut wide = piped.clone();
    (wide.ranks, wide.local_ranks) = (vec![1, 3], vec![MAX_PIPELINE_LOCAL_RANKS + 1; 2]);
    let hardware = Hardware { ranks: MAX_PIPELINE_LOCAL_RANKS + 1, ..Hardware::default() };
    for id in [1, 3] {
        st.apply(&Command::UpdateHardware { id, hardware: hardware.clone() }).unwrap();
    }
    assert!(st.apply(&Command::ScheduleEpoch { epoch: wide }).unwrap_err().0.contains("at most 8"));
    for (id, n) in [(1, 2), (3, 4)] {
        st.apply(&Command::UpdateHardware { id, hardware: Hardware { ranks: n, ..Hardware::default() } })
            .unwrap();
    }
    // As many on each node of a pipeline: accepted.
    let even = Epoch { ranks: vec![1, 3], local_ranks: vec![2, 2], ..piped.clone() };
    st.clone().apply(&Command::ScheduleEpoch { epoch: even }).unwrap();
    // Older records: no counts, one rank each.
    let old = epoch(1, 0, &[1, 2]);
    assert_eq!((old.total_ranks(), old.first_rank_of(1), old.local_ranks_of(5)), (2, 1, 1));
    st.apply(&Command::ScheduleEpoch { epoch: e }).unwrap();
}

/// The leader-measured speed steers the pipeline planner's placement: only the leader's
/// `RecordSpeed` sets it, never a member's own record (its hardware update, its join or a
/// rejoin), which keeps the speed the log holds.
#[test]
fn a_members_word_does_not_set_its_measured_speed() {
    let mut st = three();
    st.apply(&Command::RecordSpeed { id: 2, speed_milli: 350 }).unwrap();
    assert_eq!(st.members[&2].spec.hardware.speed_milli, 350);
    // A member claiming to be ten times faster, in its hardware update and in its join.
    let fast = Hardware { speed_milli: 10_000, cpus: 64, ..st.members[&2].spec.hardware.clone() };
    st.apply(&Command::UpdateHardware { id: 2, hardware: fast.clone() }).unwrap();
    assert_eq!((st.members[&2].spec.hardware.speed_milli, st.members[&2].spec.hardware.cpus), (350, 64));
    let mut again = st.members[&2].spec.clone();
    again.hardware = fast.clone();
    st.apply(&Command::Join { member: again.clone() }).unwrap();
    assert_eq!(st.members[&2].spec.hardware.speed_milli, 350);
    // A newcomer's or a failed member's claim is no measurement either.
    let mut newcomer = again.clone();
    (newcomer.id, newcomer.name) = (9, "node-9".into());
    st.apply(&Command::Join { member: newcomer }).unwrap();
    assert_eq!(st.members[&9].spec.hardware.speed_milli, 0);
    st.apply(&Command::MarkFailed { id: 2, reason: "gone quiet".into() }).unwrap();
    st.apply(&Command::Join { member: again }).unwrap();
    assert_eq!(st.members[&2].spec.hardware.speed_milli, 0);
    assert!(st
        .apply(&Command::RecordSpeed { id: 77, speed_milli: 1 })
        .unwrap_err()
        .0
        .contains("not a member"));
}

/// Gone members' records are bounded: past `MAX_GONE_RECORDS` the ones that left first are
/// dropped, except one still a raft learner (kept, a later one dropped in its place, until
/// the configuration lets it go); a gone member that rejoins is a member again and no longer
/// counted.
#[test]
fn gone_records_are_bounded_and_the_newest_kept() {
    let mut st = three();
    let n = MAX_GONE_RECORDS as u64 + 40;
    for id in 100..100 + n + 1 {
        st.apply(&Command::Join { member: spec(id, &format!("n{id}")) }).unwrap();
    }
    st.set_configuration(&[1, 2, 3], &[100]);
    for id in 100..100 + n {
        st.apply(&Command::Remove { id, reason: "left".into() }).unwrap();
    }
    let gone = |st: &ClusterState| st.members.values().filter(|m| m.status == MemberStatus::Gone).count();
    assert_eq!(gone(&st), MAX_GONE_RECORDS);
    assert!(st.members.contains_key(&100), "a learner's record stays");
    assert!(
        !st.members.contains_key(&101) && !st.members.contains_key(&140),
        "the first to leave went first"
    );
    assert!(st.members.contains_key(&141) && st.members.contains_key(&(100 + n - 1)));
    assert_eq!(st.gone.len(), MAX_GONE_RECORDS);
    // Out of the configuration, the learner's record is the first to go.
    st.set_configuration(&[1, 2, 3], &[]);
    st.apply(&Command::Remove { id: 100 + n, reason: "left".into() }).unwrap();
    assert!(!st.members.contains_key(&100) && st.members.contains_key(&141));
    assert_eq!((gone(&st), st.gone.len()), (MAX_GONE_RECORDS, MAX_GONE_RECORDS));
    // A gone member that rejoins is counted no more; one whose record went joins anew.
    let back = 100 + n - 1;
    st.apply(&Command::Join { member: spec(back, "back") }).unwrap();
    assert!(!st.gone.contains(&back) && st.members[&back].status == MemberStatus::Joining);
    st.apply(&Command::Join { member: spec(101, "again") }).unwrap();
    assert_eq!(st.members[&101].status, MemberStatus::Joining);
    assert_eq!(st.validate(), Ok(()));
    // The list survives the log's encoding, and a list naming a member that is not gone is
    // refused.
    let back_again = SnapshotData::decode(&SnapshotData::encode_state(7, &st), 7).unwrap().state;
    assert_eq!(back_again.gone, st.gone);
    let mut bad = st.clone();
    bad.gone.push_back(1);
    assert!(bad.validate().is_err());
}

/// The bytes written for the applied state without a copy are a snapshot's.
#[test]
fn a_state_encoded_in_place_is_a_snapshots_bytes() {
    let st = three();
    let whole = SnapshotData { v: FORMAT_VERSION, cluster_id: 9, state: st.clone() }.encode();
    assert_eq!(SnapshotData::encode_state(9, &st), whole);
}

/// Applying to a copy of the state (the one a node applies to while its readers hold the
/// last) copies the records the command changes and shares every other; the copy the
/// readers hold is unchanged, and both encode as plain records.
#[test]
fn a_copy_shares_the_records_a_command_leaves_alone() {
    let held = three();
    let mut next = held.clone();
    let out = next.apply(&Command::Drain { id: 2, reason: "test".into() });
    assert!(out.is_ok(), "{out:?}");
    for id in [1, 3] {
        assert!(Arc::ptr_eq(&held.members[&id], &next.members[&id]), "node {id} copied");
    }
    assert!(!Arc::ptr_eq(&held.members[&2], &next.members[&2]));
    assert_eq!(held.members[&2].status, MemberStatus::Active);
    assert_eq!(next.members[&2].status, MemberStatus::Draining);
    // A refused command changes no record, shared or not.
    let before = next.clone();
    assert!(next.apply(&Command::Activate { id: 9 }).is_err());
    assert_eq!(next, before);
    // The records encode as themselves (as before they were shared): a state written by an
    // older build reads back, and the reverse.
    let json = serde_json::to_value(&next).unwrap();
    assert_eq!(json["members"]["2"]["status"], serde_json::json!("Draining"), "{json}");
    let back: ClusterState = serde_json::from_value(json).unwrap();
    assert_eq!(back, next);
}

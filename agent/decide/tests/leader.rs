//! The leader's round, called directly: what it proposes from the replicated state and the
//! agents' reports (a rank that entered a scheduled epoch activates it, a joiner that trains
//! becomes active, a quiet peer named by a broken collective whose port does not answer is
//! treated as failed at once (one whose port accepts lives, and waits for the timeout), and
//! a group broken with everyone alive is rebuilt after the failure timeout).

use limpet_consensus::state::{ClusterState, Command, MemberStatus, NodeId};
use limpet_decide::leader::{plan_round, LeaderSettings, Reports};
use limpet_decide::policy::{BaseBatch, BatchPolicy};
use limpet_decide::report::{AgentReport, Broken, Phase, REPORT_VERSION};
use limpet_decide::stuck::{rebuild_after_ms, Stuck};

mod common;
use common::spec;

fn settings() -> LeaderSettings {
    LeaderSettings {
        heartbeat_ms: 100,
        heartbeat_timeout_ms: 1000,
        lead_ms: 400,
        notice_margin_ms: 1000,
        min_nodes: 2,
        policy: BatchPolicy::FixedGlobal,
        base: BaseBatch { global_batch: 64, micro_batch: 64, world: 3 },
        straggler_ratio: 1.5,
        straggler_steps: 100,
    }
}

fn report(node: NodeId, epoch: u64, step: u64) -> AgentReport {
    AgentReport {
        v: REPORT_VERSION,
        node,
        pid: 0,
        phase: Phase::Training,
        epoch,
        applied_step: step,
        loss: None,
        step_time_ms: 10.0,
        samples_per_s: 0.0,
        broken: None,
        transitions: Vec::new(),
        grad_stats: None,
        ms_per_sample: 0.0,
        profile_ms: 0.0,
        checkpoint_error: None,
        notice: None,
        eval: None,
        refused: Vec::new(),
    }
}

const NOW: u64 = 1_000_000;

/// Three members with the job set, the first epoch scheduled by the leader's first round.
fn founded() -> (ClusterState, u64) {
    let mut st = ClusterState::bootstrap("c", &[spec(1), spec(2), spec(3)]);
    st.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
    let fresh: Reports = (1..=3).map(|id| (id, (0, report(id, 0, 0)))).collect();
    let round = plan_round(&settings(), &st, &fresh, NOW);
    let id = round
        .commands
        .iter()
        .find_map(|c| match c {
            Command::ScheduleEpoch { epoch } => Some(epoch.id),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no first epoch: {round:?}"));
    for c in &round.commands {
        st.apply(c).unwrap();
    }
    (st, id)
}

#[test]
fn an_entered_epoch_is_activated_and_not_before() {
    let (st, id) = founded();
    let waiting: Reports = (1..=3).map(|n| (n, (0, report(n, 0, 0)))).collect();
    let round = plan_round(&settings(), &st, &waiting, NOW);
    assert!(!round.commands.contains(&Command::ActivateEpoch { id }), "{round:?}");
    let mut entered = waiting.clone();
    entered.insert(2, (0, report(2, id, 0)));
    let round = plan_round(&settings(), &st, &entered, NOW);
    assert!(round.commands.contains(&Command::ActivateEpoch { id }), "{round:?}");
}

#[test]
fn a_joiner_training_in_the_current_epoch_becomes_active() {
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    st.apply(&Command::Join { member: spec(4) }).unwrap();
    assert_eq!(st.members[&4].status, MemberStatus::Joining);
    let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.insert(4, (0, report(4, 0, 0)));
    let round = plan_round(&settings(), &st, &reports, NOW);
    assert!(!round.commands.contains(&Command::Activate { id: 4 }), "{round:?}");
    reports.insert(4, (0, report(4, id, 50)));
    let round = plan_round(&settings(), &st, &reports, NOW);
    assert!(round.commands.contains(&Command::Activate { id: 4 }), "{round:?}");
}

#[test]
fn a_quiet_peer_named_by_a_broken_collective_fails_before_the_timeout() {
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    // Node 3 has been silent 500 ms: below the 1 s timeout, above three heartbeats.
    let mut reports: Reports = (1..=2).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.insert(3, (500, report(3, id, 50)));
    let calm = plan_round(&settings(), &st, &reports, NOW);
    assert!(!calm.commands.iter().any(|c| matches!(c, Command::ScheduleEpoch { .. })), "{calm:?}");
    let mut broken = report(1, id, 50);
    broken.phase = Phase::Waiting;
    broken.broken = Some(Broken {
        epoch: id,
        since_ms: 200,
        suspect: Some(3),
        error: "peer 3 closed".into(),
        violation: false,
    });
    reports.insert(1, (0, broken));
    let round = plan_round(&settings(), &st, &reports, NOW);
    let next = round.commands.iter().find_map(|c| match c {
        Command::ScheduleEpoch { epoch } => Some(epoch.ranks.clone()),
        _ => None,
    });
    assert_eq!(next, Some(vec![1, 2]), "{round:?}");
    // The same quiet peer whose port accepted the leader's connection lives (stalled, or
    // slow): only the failure timeout fails it.
    use limpet_decide::leader::{plan_round_with, Evidence};
    let answered = Evidence { answered: [3].into(), ..Evidence::default() };
    let alive = plan_round_with(&settings(), &st, &reports, NOW, &answered);
    assert!(!alive.commands.iter().any(|c| matches!(c, Command::MarkFailed { .. })), "{alive:?}");
    reports.get_mut(&3).unwrap().0 = 1001;
    let timed_out = plan_round_with(&settings(), &st, &reports, NOW, &answered);
    assert!(
        timed_out.commands.iter().any(|c| matches!(c, Command::MarkFailed { id: 3, .. })),
        "{timed_out:?}"
    );
}

/// A peer whose data port refused a rank's connection (the next epoch's ring, where a peer
/// killed after the old ring broke is named by no broken collective) is probed, and failed at
/// once when the leader's probe is refused too; the rank's word alone fails nobody, a rank
/// naming itself is ignored, and one report names at most `MAX_REFUSED_NAMED` peers.
#[test]
fn a_peer_whose_data_port_refused_a_rank_is_failed_once_the_leaders_probe_is_refused_too() {
    use limpet_decide::leader::{plan_round_with, suspects, Evidence, MAX_REFUSED_NAMED};
    let mut st = ClusterState::bootstrap("c", &(1..=12).map(spec).collect::<Vec<_>>());
    st.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
    let fresh: Reports = (1..=12).map(|id| (id, (0, report(id, 0, 0)))).collect();
    let round = plan_round(&settings(), &st, &fresh, NOW);
    for c in &round.commands {
        st.apply(c).unwrap();
    }
    let id = st.scheduled.as_ref().expect("the first epoch").id;
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    let mut reports: Reports = (1..=12).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.get_mut(&1).unwrap().1.refused = vec![1, 3];
    assert_eq!(suspects(&st, &reports, 1000), vec![3], "a rank naming itself is no suspect");
    let failed = |round: &limpet_decide::leader::Round| -> Vec<NodeId> {
        round
            .commands
            .iter()
            .filter_map(|c| match c {
                Command::MarkFailed { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    };
    let word_only = plan_round_with(&settings(), &st, &reports, NOW, &Evidence::default());
    assert_eq!(failed(&word_only), Vec::<NodeId>::new(), "{word_only:?}");
    let answered = Evidence { answered: [3].into(), ..Evidence::default() };
    assert_eq!(failed(&plan_round_with(&settings(), &st, &reports, NOW, &answered)), Vec::<NodeId>::new());
    let dead = Evidence { refused: [3].into(), ..Evidence::default() };
    let round = plan_round_with(&settings(), &st, &reports, NOW, &dead);
    assert_eq!(failed(&round), vec![3], "{round:?}");
    // One report names a bounded number of peers to probe.
    reports.get_mut(&2).unwrap().1.refused = (3..=12).collect();
    assert_eq!(suspects(&st, &reports, 1000).len(), MAX_REFUSED_NAMED);
}

/// A suspect whose control port refused the leader's connection is failed at once, though
/// it reported 20 ms ago (a `kill -9` just now): the evidence is the leader's own. The same
/// suspect not refusing waits (for the quiet rule if its port does not answer, for the
/// timeout if it does), and a port refusing without a rank naming its owner fails nobody.
#[test]
fn a_suspect_whose_port_refuses_fails_at_once_and_a_slow_one_does_not() {
    use limpet_decide::leader::{plan_round_with, suspects, Evidence};
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.insert(3, (20, report(3, id, 50)));
    let refused = Evidence { refused: [3].into(), ..Evidence::default() };
    let epoch_of = |round: &limpet_decide::leader::Round| {
        round.commands.iter().find_map(|c| match c {
            Command::ScheduleEpoch { epoch } => Some(epoch.ranks.clone()),
            _ => None,
        })
    };
    let nobody_named = plan_round_with(&settings(), &st, &reports, NOW, &refused);
    assert_eq!(epoch_of(&nobody_named), None, "{nobody_named:?}");
    let mut broken = report(1, id, 50);
    broken.phase = Phase::Waiting;
    broken.broken = Some(Broken {
        epoch: id,
        since_ms: 5,
        suspect: Some(3),
        error: "peer 3 reset".into(),
        violation: false,
    });
    reports.insert(1, (0, broken));
    assert_eq!(suspects(&st, &reports, 1000), vec![3]);
    // A rank naming itself is no suspect (nor an address for the leader to probe).
    let mut own = reports.clone();
    own.get_mut(&1).unwrap().1.broken.as_mut().unwrap().suspect = Some(1);
    assert_eq!(suspects(&st, &own, 1000), Vec::<NodeId>::new());
    let slow = plan_round_with(&settings(), &st, &reports, NOW, &Evidence::default());
    assert_eq!(epoch_of(&slow), None, "a stalled suspect failed early: {slow:?}");
    let dead = plan_round_with(&settings(), &st, &reports, NOW, &refused);
    assert!(dead.commands.iter().any(|c| matches!(c, Command::MarkFailed { id: 3, .. })), "{dead:?}");
    assert_eq!(epoch_of(&dead), Some(vec![1, 2]), "{dead:?}");
}

/// What one rank reports of its ring and its pace steers nothing alone: a spare naming a
/// quiet rank as its suspect does not fail it early, one rank's huge `since_ms` rebuilds
/// nothing (above), and one rank's step time does not set the boundary's lead.
#[test]
fn one_ranks_reports_do_not_steer_the_leader() {
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    st.apply(&Command::Join { member: spec(4) }).unwrap();
    let mut reports: Reports = (1..=2).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.insert(3, (500, report(3, id, 50)));
    let mut spare = report(4, 0, 0);
    spare.broken =
        Some(Broken { epoch: id, since_ms: 1 << 40, suspect: Some(3), error: "x".into(), violation: false });
    reports.insert(4, (0, spare));
    let round = plan_round(&settings(), &st, &reports, NOW);
    assert!(
        !round.commands.iter().any(|c| matches!(c, Command::MarkFailed { .. })),
        "a spare's suspect failed a rank: {round:?}"
    );
    // A notice for node 2: the boundary leads by the epoch's step time (10 ms: 40 steps of
    // the 400 ms lead), whatever node 1 claims its steps take.
    st.apply(&Command::Notice { id: 2, deadline_ms: NOW + 600_000, source: "aws".into() }).unwrap();
    let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, 50)))).collect();
    reports.get_mut(&1).unwrap().1.step_time_ms = 1e9;
    let round = plan_round(&settings(), &st, &reports, NOW);
    let start = round.commands.iter().find_map(|c| match c {
        Command::ScheduleEpoch { epoch } => Some(epoch.start_step),
        _ => None,
    });
    assert_eq!(start, Some(90), "{round:?}");
}

#[test]
fn a_group_broken_with_everyone_alive_is_rebuilt_after_the_timeout() {
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, 50)))).collect();
    let mut broken = report(2, id, 50);
    broken.broken =
        Some(Broken { epoch: id, since_ms: 400, suspect: None, error: "reset".into(), violation: false });
    reports.insert(2, (0, broken.clone()));
    let early = plan_round(&settings(), &st, &reports, NOW);
    assert!(!early.commands.iter().any(|c| matches!(c, Command::ScheduleEpoch { .. })), "{early:?}");
    broken.broken.as_mut().unwrap().since_ms = 1500;
    reports.insert(2, (0, broken.clone()));
    // One rank's word that it waited long enough is no rebuild: the ring broke under every
    // rank, and a second one must say so too.
    let alone = plan_round(&settings(), &st, &reports, NOW);
    assert!(!alone.commands.iter().any(|c| matches!(c, Command::ScheduleEpoch { .. })), "{alone:?}");
    broken.node = 3;
    broken.broken.as_mut().unwrap().since_ms = 1200;
    reports.insert(3, (0, broken));
    let late = plan_round(&settings(), &st, &reports, NOW);
    let next = late.commands.iter().find_map(|c| match c {
        Command::ScheduleEpoch { epoch } => Some(epoch.ranks.clone()),
        _ => None,
    });
    assert_eq!(next, Some(vec![1, 2, 3]), "{late:?}");
}

/// Scaling by value's points: an epoch's throughput is recorded once every rank trained
/// `MEASURE_STEPS` of it (the slowest rank's step time sets the pace), and only once.
#[test]
fn an_epoch_that_ran_long_enough_has_its_throughput_recorded_once() {
    use limpet_decide::leader::MEASURE_STEPS;
    let (mut st, id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    let start = st.current.as_ref().unwrap().start_step;
    let recorded = |round: &limpet_decide::leader::Round| {
        round.commands.iter().find_map(|c| match c {
            Command::RecordThroughput { record } => Some(*record),
            _ => None,
        })
    };
    let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, start + MEASURE_STEPS)))).collect();
    reports.insert(3, (0, report(3, id, start + MEASURE_STEPS - 1)));
    assert_eq!(recorded(&plan_round(&settings(), &st, &reports, NOW)), None, "node 3 is not there yet");
    let mut slow = report(3, id, start + MEASURE_STEPS);
    slow.step_time_ms = 16.0;
    reports.insert(3, (0, slow));
    let t = recorded(&plan_round(&settings(), &st, &reports, NOW)).expect("recorded");
    // 64 samples every 16 ms (the slowest rank), all counting under fixed-global.
    assert_eq!((t.world, t.epoch, t.samples_milli, t.useful_milli), (3, id, 4_000_000, 4_000_000));
    st.apply(&Command::RecordThroughput { record: t }).unwrap();
    assert_eq!(recorded(&plan_round(&settings(), &st, &reports, NOW)), None, "once per epoch");
}

/// A pipelined job's host whose profile of the model takes three times its peers' has its
/// speed recorded as 0.35, once; the others, within the straggler ratio of the median, stay
/// unrecorded.
#[test]
fn a_pipeline_host_profiled_slower_has_its_speed_recorded_once() {
    use limpet_decide::planner::{BlockCost, Link, ModelProfile, PipelineJob};
    let mut st = ClusterState::bootstrap("c", &(1..=4).map(spec).collect::<Vec<_>>());
    let block = BlockCost {
        fwd_ms: 1.0,
        bwd_ms: 2.0,
        fixed_fwd_ms: 0.0,
        fixed_bwd_ms: 0.0,
        apply_ms: 0.1,
        out_bytes: 4096,
        saved_bytes: 4096,
        param_bytes: 2 << 20,
        optim_bytes: 4 << 20,
    };
    let job = PipelineJob {
        profile: ModelProfile {
            model: "t".into(),
            micro_batch: 16,
            blocks: vec![block; 4],
            overhead_ms: 0.0,
        },
        link: Link { bytes_per_s: 1e9, latency_ms: 0.05 },
        depth: Some(2),
        cuts: None,
        mem_bytes: 20 << 20,
    };
    st.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp", "pipeline": job}) }).unwrap();
    let s = LeaderSettings { min_nodes: 1, ..settings() };
    let speeds = |st: &ClusterState, reports: &Reports| -> Vec<(NodeId, u64)> {
        plan_round(&s, st, reports, NOW)
            .commands
            .iter()
            .filter_map(|c| match c {
                Command::RecordSpeed { id, speed_milli } => Some((*id, *speed_milli)),
                _ => None,
            })
            .collect()
    };
    // Node 3 takes 36 ms; the others 12 to 14 (noise).
    let reports: Reports = (1..=4)
        .map(|id| {
            let mut r = report(id, 0, 0);
            r.profile_ms = [12.0, 14.0, 36.0, 12.5][id as usize - 1];
            (id, (0, r))
        })
        .collect();
    // Against the median host (12.5 ms): 12.5 / 36 = 0.35.
    assert_eq!(speeds(&st, &reports), vec![(3, 350)]);
    st.apply(&Command::RecordSpeed { id: 3, speed_milli: 350 }).unwrap();
    assert!(speeds(&st, &reports).is_empty(), "recorded once");
    // Without a pipeline, nothing is recorded.
    let mut plain = ClusterState::bootstrap("c", &(1..=4).map(spec).collect::<Vec<_>>());
    plain.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
    assert!(speeds(&plain, &reports).is_empty());
}

/// Plays rebuild after rebuild at step 50: each round's rebuild epoch is applied and
/// activated, then node 2 reports its group broken again (`violation`, after `since_ms`).
/// Returns the rounds' stuck verdicts and whether each scheduled a rebuild.
fn rebuild_rounds(violation: bool, rounds: usize, since_ms: u64) -> Vec<(Option<Stuck>, bool)> {
    let (mut st, mut id) = founded();
    st.apply(&Command::ActivateEpoch { id }).unwrap();
    let mut out = Vec::new();
    for _ in 0..rounds {
        let mut reports: Reports = (1..=3).map(|n| (n, (0, report(n, id, 50)))).collect();
        let mut broken = report(2, id, 50);
        broken.broken = Some(Broken {
            epoch: id,
            since_ms,
            suspect: Some(3),
            error: "protocol violation: node 3 sent 28 bytes where 52296 were due".into(),
            violation,
        });
        reports.insert(2, (0, broken.clone()));
        // Its neighbour saw the ring break too, as a reset connection.
        broken.node = 1;
        broken.broken =
            broken.broken.map(|b| Broken { error: "reset by node 2".into(), violation: false, ..b });
        reports.insert(1, (0, broken));
        let round = plan_round(&settings(), &st, &reports, NOW);
        let next = round.commands.iter().find_map(|c| match c {
            Command::ScheduleEpoch { epoch } => Some(epoch.clone()),
            _ => None,
        });
        out.push((round.stuck.clone(), next.is_some()));
        if let Some(e) = next {
            assert_eq!((e.start_step, e.cause.as_str()), (50, "collective failure with every rank alive"));
            for c in &round.commands {
                st.apply(c).unwrap();
            }
            st.apply(&Command::ActivateEpoch { id: e.id }).unwrap();
            id = e.id;
        }
    }
    out
}

#[test]
fn a_protocol_violation_is_rebuilt_once_then_the_job_is_stuck_loudly() {
    let rounds = rebuild_rounds(true, 5, 1500);
    // The first epoch broke: one rebuild, not yet stuck.
    assert_eq!(rounds[0], (None, true), "{rounds:?}");
    // The rebuild broke the same way: stuck at step 50, and no more rebuilds, ever.
    for (stuck, rebuilt) in &rounds[1..] {
        let s = stuck.as_ref().unwrap_or_else(|| panic!("not stuck: {rounds:?}"));
        assert!(!rebuilt, "{rounds:?}");
        assert_eq!((s.step, s.rebuilds, s.node, s.violation), (50, 1, 2, true));
        assert!(s.to_string().contains("step 50") && s.to_string().contains("28 bytes"), "{s}");
    }
}

#[test]
fn transient_breakage_at_one_step_is_rebuilt_with_growing_pauses_and_reported_stuck() {
    // Past the failure timeout (1 s) but within the first pause (2 s): three rebuilds, then
    // the job is stuck and waits longer.
    let rounds = rebuild_rounds(false, 5, 1500);
    assert!(rounds[..3].iter().all(|r| *r == (None, true)), "{rounds:?}");
    for (stuck, rebuilt) in &rounds[3..] {
        assert!(!rebuilt, "{rounds:?}");
        assert_eq!(stuck.as_ref().map(|s| (s.rebuilds, s.violation)), Some((3, false)), "{rounds:?}");
    }
    // Waited out the pause: rebuilt again, still reported stuck.
    let rounds = rebuild_rounds(false, 5, 2500);
    assert!(rounds[..4].iter().all(|r| r.1), "{rounds:?}");
    assert_eq!(rounds[3].0.as_ref().map(|s| s.rebuilds), Some(3), "{rounds:?}");
    // One more in a row doubles the pause again (4 s).
    assert!(!rounds[4].1, "{rounds:?}");
    assert_eq!(rebuild_after_ms(rounds[4].0.as_ref(), 1000), Some(4000));
    assert_eq!(rebuild_after_ms(None, 1000), Some(1000));
}

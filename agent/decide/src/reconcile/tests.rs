use super::*;
use limpet_consensus::state::{Command, MemberSpec};

const MIN: u64 = 60_000;

fn pool(t: &str, s: &str) -> Pool {
    Pool { instance_type: t.into(), subnet: s.into() }
}

fn policy() -> CapacityPolicy {
    CapacityPolicy {
        target: 3,
        min: 2,
        max: 4,
        pools: vec![
            pool("g5.xlarge", "subnet-a"),
            pool("g5.xlarge", "subnet-b"),
            pool("g6.xlarge", "subnet-a"),
        ],
        on_demand_after_ms: 10 * MIN,
        spot_retry_ms: 15 * MIN,
        pool_cooldown_ms: 5 * MIN,
        join_timeout_ms: 15 * MIN,
        spares_required: false,
        min_marginal_value: None,
    }
}

fn spec(name: &str) -> MemberSpec {
    MemberSpec {
        id: limpet_consensus::state::node_id_of_name(name),
        name: name.into(),
        control_addr: format!("{name}:7400"),
        data_addr: format!("{name}:7401"),
        hardware: Default::default(),
    }
}

/// Three members named after their instances, each on a listed spot instance.
fn cluster() -> (ClusterState, Vec<Instance>) {
    let names = ["i-1", "i-2", "i-3"];
    let st = ClusterState::bootstrap("prod", &names.iter().map(|n| spec(n)).collect::<Vec<_>>());
    let inst = names.iter().map(|n| instance(n, Market::Spot, pool("g5.xlarge", "subnet-a"), 0)).collect();
    (st, inst)
}

fn instance(id: &str, market: Market, pool: Pool, at: u64) -> Instance {
    Instance {
        id: id.into(),
        state: "running".into(),
        market,
        pool,
        launched_ms: Some(at),
        launch_token: None,
        node_name: None,
    }
}

/// Records `d` (as the leader does) and returns the record's sequence number.
fn record(st: &mut ClusterState, d: &Decision, now: u64) -> u64 {
    let r = record_of(d, &st.capacity, 1, now).expect("a new record");
    st.apply(&Command::RecordCapacity { record: r.clone() }).unwrap();
    r.seq
}

fn outcome(st: &mut ClusterState, action: CapacityAction, now: u64) {
    let r = CapacityRecord { seq: st.capacity.last_seq + 1, at_ms: now, by: 1, action, reason: "EC2".into() };
    st.apply(&Command::RecordCapacity { record: r }).unwrap();
}

fn launched(d: &Decision) -> (Pool, Market, String) {
    match &d.next {
        Next::Record(CapacityAction::Launch { pool, market, token, .. }) => {
            (pool.clone(), *market, token.clone())
        }
        other => panic!("expected a launch, got {other:?}: {}", d.reason),
    }
}

fn fail(st: &mut ClusterState, seq: u64, now: u64) {
    outcome(
        st,
        CapacityAction::Failed { launch: seq, code: "InsufficientInstanceCapacity".into(), capacity: true },
        now,
    );
}

#[test]
fn a_full_fleet_holds_once_per_reason() {
    let (st, inst) = cluster();
    let d = decide(&policy(), &st, &inst, &[], 0);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold));
    assert_eq!(d.reason, "3 of 3 hosts");
    let mut st = st;
    record(&mut st, &d, 0);
    assert!(record_of(&decide(&policy(), &st, &inst, &[], 1000), &st.capacity, 1, 1000).is_none());
}

#[test]
fn a_revoked_host_is_replaced_in_the_least_used_spot_pool_once() {
    let (mut st, mut inst) = cluster();
    st.apply(&Command::Notice { id: spec("i-3").id, deadline_ms: 120_000, source: "aws".into() }).unwrap();
    let d = decide(&policy(), &st, &inst, &[], 1000);
    let (p, market, token) = launched(&d);
    assert_eq!((p, market), (pool("g5.xlarge", "subnet-b"), Market::Spot), "{}", d.reason);
    assert!(d.reason.contains("2 of 3 hosts") && d.reason.contains("i-3 leaving"), "{}", d.reason);
    let seq = record(&mut st, &d, 1000);
    assert_eq!(token, launch_token("prod", seq, 1000));
    // Until EC2 answers, every decision resumes that launch: a new leader does the same.
    assert_eq!(decide(&policy(), &st, &inst, &[], 2000).next, Next::Resume(seq));
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-4".into()] }, 2000);
    // Launched but not listed yet (EC2's listing lags): counted, nothing more launched.
    let d = decide(&policy(), &st, &inst, &[], 3000);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold), "{}", d.reason);
    assert!(d.reason.contains("1 launching: i-4"), "{}", d.reason);
    let mut four = instance("i-4", Market::Spot, pool("g5.xlarge", "subnet-b"), 2000);
    four.launch_token = Some(token);
    inst.push(four);
    assert_eq!(decide(&policy(), &st, &inst, &[], 4000).next, Next::Record(CapacityAction::Hold));
    // It never joins: terminated after the join timeout, then replaced.
    let d = decide(&policy(), &st, &inst, &[], 2000 + 15 * MIN);
    assert_eq!(
        d.next,
        Next::Record(CapacityAction::Terminate { instances: vec!["i-4".into()] }),
        "{}",
        d.reason
    );
}

#[test]
fn gone_members_instances_are_terminated() {
    let (mut st, inst) = cluster();
    st.apply(&Command::Remove { id: spec("i-2").id, reason: "drained".into() }).unwrap();
    let d = decide(&policy(), &st, &inst, &[], 0);
    assert_eq!(d.next, Next::Record(CapacityAction::Terminate { instances: vec!["i-2".into()] }));
}

#[test]
fn capacity_errors_walk_the_pools_then_fall_back_to_on_demand_then_return() {
    let p = policy();
    let (mut st, mut inst) = cluster();
    st.apply(&Command::MarkFailed { id: spec("i-1").id, reason: "kill".into() }).unwrap();
    let mut tried = Vec::new();
    let mut now = 0;
    for _ in 0..3 {
        let d = decide(&p, &st, &inst, &[], now);
        let (pool, market, _) = launched(&d);
        assert_eq!(market, Market::Spot);
        tried.push(pool);
        let seq = record(&mut st, &d, now);
        fail(&mut st, seq, now + 100);
        now += MIN;
    }
    tried.sort();
    let mut all = p.pools.clone();
    all.sort();
    assert_eq!(tried, all, "each pool once");
    // Every pool cooling, spot out for 3 minutes: hold.
    let d = decide(&p, &st, &inst, &[], now);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold), "{}", d.reason);
    assert!(d.reason.contains("on-demand 600 s after"), "{}", d.reason);
    // The pools cool down at 5 minutes: spot is tried again, and fails.
    now = 5 * MIN + 200;
    let d = decide(&p, &st, &inst, &[], now);
    assert_eq!(launched(&d).1, Market::Spot);
    let seq = record(&mut st, &d, now);
    fail(&mut st, seq, now);
    // At 10 minutes after the first error, on-demand.
    let before = decide(&p, &st, &inst, &[], 10 * MIN + 99);
    assert!(
        !matches!(before.next, Next::Record(CapacityAction::Launch { market: Market::OnDemand, .. })),
        "{}",
        before.reason
    );
    now = 10 * MIN + 100;
    let d = decide(&p, &st, &inst, &[], now);
    let (pool, market, _) = launched(&d);
    assert_eq!(market, Market::OnDemand, "{}", d.reason);
    let seq = record(&mut st, &d, now);
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-9".into()] }, now);
    inst.push(instance("i-9", Market::OnDemand, pool, now));
    st.apply(&Command::Join { member: spec("i-9") }).unwrap();
    st.apply(&Command::Activate { id: spec("i-9").id }).unwrap();
    // Full again, with one on-demand host: spot is probed spot_retry after its last try.
    let last_spot_try = 5 * MIN + 200;
    let d = decide(&p, &st, &inst, &[], last_spot_try + 15 * MIN - 1);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold), "{}", d.reason);
    assert!(d.reason.contains("1 on-demand"), "{}", d.reason);
    now = last_spot_try + 15 * MIN;
    let d = decide(&p, &st, &inst, &[], now);
    let (pool, market, _) = launched(&d);
    assert_eq!(market, Market::Spot, "{}", d.reason);
    let seq = record(&mut st, &d, now);
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-10".into()] }, now);
    inst.push(instance("i-10", Market::Spot, pool, now));
    st.apply(&Command::Join { member: spec("i-10") }).unwrap();
    // The spot host is not training yet: nothing is drained.
    let d = decide(&p, &st, &inst, &[], now + 500);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold), "{}", d.reason);
    st.apply(&Command::Activate { id: spec("i-10").id }).unwrap();
    // Spot is back: 4 hosts for 3, the on-demand one is drained.
    let d = decide(&p, &st, &inst, &[], now + 1000);
    assert_eq!(
        d.next,
        Next::Record(CapacityAction::Drain { node: spec("i-9").id, instance: "i-9".into() }),
        "{}",
        d.reason
    );
}

#[test]
fn a_refused_launch_waits_for_the_cooldown() {
    let (mut st, inst) = cluster();
    st.apply(&Command::MarkFailed { id: spec("i-1").id, reason: "kill".into() }).unwrap();
    let d = decide(&policy(), &st, &inst, &[], 0);
    let seq = record(&mut st, &d, 0);
    outcome(
        &mut st,
        CapacityAction::Failed { launch: seq, code: "UnauthorizedOperation".into(), capacity: false },
        10,
    );
    let d = decide(&policy(), &st, &inst, &[], MIN);
    assert!(
        d.reason.contains("UnauthorizedOperation") && d.next == Next::Record(CapacityAction::Hold),
        "{}",
        d.reason
    );
    assert!(matches!(
        decide(&policy(), &st, &inst, &[], 5 * MIN + 10).next,
        Next::Record(CapacityAction::Launch { .. })
    ));
}

#[test]
fn spare_credentials_name_new_hosts_once_each() {
    let p = CapacityPolicy { spares_required: true, ..policy() };
    let (mut st, inst) = cluster();
    st.apply(&Command::MarkFailed { id: spec("i-1").id, reason: "kill".into() }).unwrap();
    st.apply(&Command::MarkFailed { id: spec("i-2").id, reason: "kill".into() }).unwrap();
    let spares = vec!["node-a".to_string()];
    let d = decide(&p, &st, &inst, &spares, 0);
    match &d.next {
        Next::Record(CapacityAction::Launch { node_name, .. }) => {
            assert_eq!(node_name.as_deref(), Some("node-a"))
        }
        other => panic!("{other:?}"),
    }
    let seq = record(&mut st, &d, 0);
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-7".into()] }, 0);
    let d = decide(&p, &st, &inst, &spares, 1);
    assert!(d.reason.contains("no spare credential"), "{}", d.reason);
}

/// Records `per_s` samples per second (all counting) at `world` hosts.
fn measured(st: &mut ClusterState, world: u32, per_s: u64) {
    st.last_epoch_id += 1;
    let record = limpet_consensus::state::Throughput {
        world,
        epoch: st.last_epoch_id,
        samples_milli: per_s * 1000,
        useful_milli: per_s * 1000,
        at_ms: 0,
    };
    st.apply(&Command::RecordThroughput { record }).unwrap();
}

#[test]
fn scaling_by_value_tries_a_host_more_then_gives_it_back_past_the_knee() {
    // 1M samples per dollar at the margin; a host costs $1/h.
    let p = CapacityPolicy { target: 3, min: 2, max: 5, min_marginal_value: Some(1e6), ..policy() };
    let (mut st, mut inst) = cluster();
    assert!(scale(&p, &st, Some(1.0)).is_none(), "nothing measured: no opinion");
    assert!(scale(&CapacityPolicy { min_marginal_value: None, ..p.clone() }, &st, Some(1.0)).is_none());
    // 600 samples/s at 2 hosts, 900 at 3: a line, so a 4th should add 300/s = 1.08M samples/$.
    measured(&mut st, 2, 600);
    measured(&mut st, 3, 900);
    assert!(scale(&p, &st, None).is_none(), "no price: no opinion");
    let d = scale(&p, &st, Some(1.0)).unwrap();
    assert_eq!(d.next, Next::Record(CapacityAction::Scale { target: 4 }), "{}", d.reason);
    assert!(d.reason.contains("predicted") && d.reason.contains("1.08M samples/$"), "{}", d.reason);
    record(&mut st, &d, 0);
    assert_eq!(p.target_now(&st.capacity), 4);
    assert!(scale(&p, &st, Some(1.0)).is_none(), "recorded once");
    // The reconciler launches the 4th.
    let d = decide(&p, &st, &inst, &[], 10);
    assert!(matches!(d.next, Next::Record(CapacityAction::Launch { .. })), "{}", d.reason);
    let seq = record(&mut st, &d, 10);
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-4".into()] }, 20);
    inst.push(instance("i-4", Market::Spot, pool("g6.xlarge", "subnet-a"), 20));
    st.apply(&Command::Join { member: spec("i-4") }).unwrap();
    st.apply(&Command::Activate { id: spec("i-4").id }).unwrap();
    // Measured at 4: it added 50/s (180,000 samples/$): back to 3 (the 3rd's 300/s still
    // pays), the newest host drained.
    measured(&mut st, 4, 950);
    let d = scale(&p, &st, Some(1.0)).unwrap();
    assert_eq!(d.next, Next::Record(CapacityAction::Scale { target: 3 }), "{}", d.reason);
    assert!(d.reason.contains("measured") && d.reason.contains("the knee"), "{}", d.reason);
    record(&mut st, &d, 30);
    let d = decide(&p, &st, &inst, &[], 40);
    assert_eq!(
        d.next,
        Next::Record(CapacityAction::Drain { node: spec("i-4").id, instance: "i-4".into() }),
        "{}",
        d.reason
    );
    // It leaves and is terminated: EC2 no longer lists it, and it is not counted as a
    // launch on its way (its Launched record is recent).
    st.apply(&Command::Drain { id: spec("i-4").id, reason: "value".into() }).unwrap();
    st.apply(&Command::Remove { id: spec("i-4").id, reason: "left".into() }).unwrap();
    outcome(&mut st, CapacityAction::Terminate { instances: vec!["i-4".into()] }, 50);
    inst.pop();
    let d = decide(&p, &st, &inst, &[], 60);
    assert_eq!((d.next, d.reason.as_str()), (Next::Record(CapacityAction::Hold), "3 of 3 hosts"));
    // At $1.10/h the 3rd host gives 981,818 samples/$: below the threshold but above the
    // shrink band (800,000), so the target stays (no flapping at every price tick); at
    // $1.50/h, 720,000: two hosts.
    assert!(scale(&p, &st, Some(1.1)).is_none(), "between the bands: keep 3");
    let d = scale(&p, &st, Some(1.5)).unwrap();
    assert_eq!(d.next, Next::Record(CapacityAction::Scale { target: 2 }), "{}", d.reason);
}

#[test]
fn a_host_that_stays_slow_is_replaced_then_drained() {
    let (mut st, mut inst) = cluster();
    let mut e = limpet_consensus::state::Epoch {
        id: 1,
        start_step: 0,
        ranks: vec![spec("i-1").id, spec("i-2").id, spec("i-3").id],
        layout: limpet_consensus::state::Layout::data_parallel(3),
        batch: limpet_consensus::state::EpochBatch { global_batch: 64, micro_batch: 64 },
        lr_scale: 1.0,
        sources: Default::default(),
        cause: String::new(),
        causes: Vec::new(),
        shares: vec![30, 30, 4],
        local_ranks: Vec::new(),
    };
    st.apply(&Command::ScheduleEpoch { epoch: e.clone() }).unwrap();
    st.apply(&Command::ActivateEpoch { id: 1 }).unwrap();
    assert_eq!(slow_members(&st, 2.0), vec![spec("i-3").id]);
    assert!(slow_members(&st, 0.0).is_empty());
    let slow = [spec("i-3").id];
    let d = decide_with(&policy(), &st, &inst, &[], &slow, 0);
    assert!(matches!(d.next, Next::Record(CapacityAction::Launch { .. })), "{}", d.reason);
    assert!(d.reason.contains("2 of 3 hosts") && d.reason.contains("i-3 slow, replacing"), "{}", d.reason);
    let seq = record(&mut st, &d, 0);
    outcome(&mut st, CapacityAction::Launched { launch: seq, instances: vec!["i-4".into()] }, 0);
    inst.push(instance("i-4", Market::Spot, pool("g5.xlarge", "subnet-b"), 0));
    st.apply(&Command::Join { member: spec("i-4") }).unwrap();
    // Not before the replacement trains.
    let d = decide_with(&policy(), &st, &inst, &[], &slow, 10);
    assert_eq!(d.next, Next::Record(CapacityAction::Hold), "{}", d.reason);
    st.apply(&Command::Activate { id: spec("i-4").id }).unwrap();
    let d = decide_with(&policy(), &st, &inst, &[], &slow, 20);
    assert_eq!(
        d.next,
        Next::Record(CapacityAction::Drain { node: spec("i-3").id, instance: "i-3".into() }),
        "{}",
        d.reason
    );
    // Equal shares again: nobody is slow.
    e.id = 2;
    e.shares.clear();
    st.apply(&Command::ScheduleEpoch { epoch: e.clone() }).unwrap();
    st.apply(&Command::ActivateEpoch { id: 2 }).unwrap();
    assert!(slow_members(&st, 2.0).is_empty());
    // A host of one device among hosts of two takes half their shares without being slow.
    for name in ["i-1", "i-2"] {
        let hardware = limpet_consensus::state::Hardware { ranks: 2, ..Default::default() };
        st.apply(&Command::UpdateHardware { id: spec(name).id, hardware }).unwrap();
    }
    e.id = 3;
    e.shares = vec![28, 28, 8];
    e.local_ranks = vec![2, 2, 1];
    st.apply(&Command::ScheduleEpoch { epoch: e }).unwrap();
    st.apply(&Command::ActivateEpoch { id: 3 }).unwrap();
    assert!(slow_members(&st, 2.0).is_empty());
}

proptest::proptest! {
    /// Whatever the fleet and the log, the reconciler never plans past `max` hosts, never
    /// launches into a pool cooling down after a capacity error, and resumes an open launch.
    #[test]
    fn launches_stay_within_max_and_out_of_cooling_pools(
        failed in proptest::collection::vec(0usize..3, 0..6),
        gone in 0usize..3,
        now in 0u64..(30 * MIN),
    ) {
        let p = policy();
        let (mut st, inst) = cluster();
        for k in 0..gone {
            st.apply(&Command::MarkFailed { id: spec(&format!("i-{}", k + 1)).id, reason: "x".into() }).unwrap();
        }
        for (k, f) in failed.iter().enumerate() {
            let r = CapacityRecord {
                seq: st.capacity.last_seq + 1,
                at_ms: k as u64 * MIN,
                by: 1,
                action: CapacityAction::Launch { pool: p.pools[*f].clone(), market: Market::Spot, token: format!("t{k}"), node_name: None },
                reason: String::new(),
            };
            st.apply(&Command::RecordCapacity { record: r }).unwrap();
            let seq = st.capacity.last_seq;
            fail(&mut st, seq, k as u64 * MIN);
        }
        let now = now.max(failed.len() as u64 * MIN);
        let d = decide(&p, &st, &inst, &[], now);
        proptest::prop_assert!(d.have <= p.max);
        if let Next::Record(CapacityAction::Launch { pool, market: Market::Spot, .. }) = &d.next {
            proptest::prop_assert!(d.have < p.max);
            for (k, f) in failed.iter().enumerate() {
                if &p.pools[*f] == pool {
                    proptest::prop_assert!(now >= k as u64 * MIN + p.pool_cooldown_ms, "{}", d.reason);
                }
            }
        }
    }
}

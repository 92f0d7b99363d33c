use super::*;

fn block(ms: f64, param_bytes: u64) -> BlockCost {
    BlockCost {
        fwd_ms: ms,
        bwd_ms: 2.0 * ms,
        fixed_fwd_ms: 0.0,
        fixed_bwd_ms: 0.0,
        apply_ms: 0.01,
        out_bytes: 4096,
        saved_bytes: 8192,
        param_bytes,
        optim_bytes: 2 * param_bytes,
    }
}

fn input(blocks: Vec<BlockCost>, hosts: &[(f64, u64)]) -> PlanInput {
    PlanInput {
        profile: ModelProfile { model: "test".into(), micro_batch: 8, blocks, overhead_ms: 0.0 },
        hosts: hosts
            .iter()
            .enumerate()
            .map(|(i, &(speed, mem))| HostSpec { name: format!("h{i}"), speed, mem_bytes: mem })
            .collect(),
        link: Link { bytes_per_s: 1e9, latency_ms: 0.05 },
        global_batch: 64,
        max_depth: None,
        local_ranks: 1,
        replica_batch: None,
    }
}

/// Blocks `0..cut` on h0 and `cut..end` on h1, one replica, micro-batches of `micro`.
fn two_stages(cut: usize, end: usize, micro: usize) -> HostLayout {
    HostLayout {
        data: 1,
        micro_batch: micro,
        stages: vec![
            StageLayout { start: 0, end: cut, hosts: vec!["h0".into()] },
            StageLayout { start: cut, end, hosts: vec!["h1".into()] },
        ],
    }
}

#[test]
fn one_host_trains_the_whole_model() {
    let inp = input(vec![block(1.0, 1000); 3], &[(1.0, 1 << 30)]);
    let r = plan(&inp).unwrap();
    assert_eq!(r.best.layout.data, 1);
    assert_eq!(r.best.layout.stages, vec![StageLayout { start: 0, end: 3, hosts: vec!["h0".into()] }]);
    // 8 micro-batches of 9 ms plus the optimizer.
    assert!((r.best.step_ms - (8.0 * 9.0 + 0.03)).abs() < 1e-9, "{}", r.best.step_ms);
}

#[test]
fn memory_forces_a_pipeline() {
    // Each block needs 4 MB of weights, gradients and optimizer state; a host holds 6 MB.
    let inp = input(vec![block(1.0, 1 << 20); 4], &[(1.0, 6 << 20); 4]);
    let r = plan(&inp).unwrap();
    assert_eq!(r.best.layout.pipeline(), 4, "{}", r.best.layout);
    for p in std::iter::once(&r.best).chain(&r.runners_up) {
        for (s, st) in p.stages.iter().enumerate() {
            assert!(st.mem_bytes <= 6 << 20, "stage {s} of {} needs {}", p.layout, st.mem_bytes);
        }
    }
    let small = input(vec![block(1.0, 4 << 20); 2], &[(1.0, 6 << 20); 4]);
    let e = plan(&small).unwrap_err();
    assert!(e.to_string().contains("even the largest block alone needs"), "{e}");
}

#[test]
fn faster_hosts_get_heavier_stages() {
    // Eight equal blocks on one fast and one slow host (no memory limit): data parallelism
    // would make the fast host wait, so a pipeline gives the fast host more blocks.
    let mut inp = input(vec![block(1.0, 1000); 8], &[(3.0, 1 << 30), (1.0, 1 << 30)]);
    inp.link.latency_ms = 0.0;
    let r = plan(&inp).unwrap();
    assert_eq!(r.best.layout.pipeline(), 2, "{}", r.best.layout);
    let on = |name: &str| r.best.layout.stages.iter().find(|s| s.hosts[0] == name).unwrap();
    let (fast, slow) = (on("h0"), on("h1"));
    assert!(fast.end - fast.start > slow.end - slow.start, "{}", r.best.layout);
    assert_eq!(fast.end - fast.start, 6, "{}", r.best.layout);
}

#[test]
fn forced_layouts_are_checked() {
    let inp = input(vec![block(1.0, 1000); 3], &[(1.0, 1 << 30); 2]);
    let ok = two_stages(1, 3, 8);
    assert_eq!(ok.to_string(), "1x2 micro 8: blocks 0..1 on h0 | blocks 1..3 on h1");
    predict(&inp, &ok).unwrap();
    let mut gap = ok.clone();
    gap.stages[1].start = 2;
    assert!(predict(&inp, &gap).unwrap_err().to_string().contains("must start at block 1"));
    let mut twice = ok.clone();
    twice.stages[1].hosts = vec!["h0".into()];
    assert!(predict(&inp, &twice).unwrap_err().to_string().contains("holds two"));
    let mut unknown = ok.clone();
    unknown.stages[0].hosts = vec!["h9".into()];
    assert!(predict(&inp, &unknown).unwrap_err().to_string().contains("'h9'"));
    assert_eq!(ok.spec().parse::<HostLayout>().unwrap(), ok);
    for (text, says) in [
        ("0..2", "is not START..END@HOST"),
        ("0-2@a", "is not START..END"),
        ("0..x@a", "\"x\" is not a block number"),
        ("0..1@a,b|1..2@c", "stage 1 names 1 hosts but stage 0 names 2"),
        ("0..1@a,", "an empty host name"),
        ("0..1@a;micro=0", "is not micro=N"),
    ] {
        let e = text.parse::<HostLayout>().unwrap_err().to_string();
        assert!(e.contains(says), "{text}: {e}");
    }
}

#[test]
fn bad_input_is_named() {
    let mut inp = input(vec![block(1.0, 1000)], &[(1.0, 1 << 30)]);
    inp.hosts[0].speed = 0.0;
    assert!(plan(&inp).unwrap_err().to_string().contains("host 'h0': speed 0"));
    let mut inp = input(vec![block(f64::NAN, 1000)], &[(1.0, 1 << 30)]);
    assert!(plan(&inp).unwrap_err().to_string().contains("block 0: fwd_ms"));
    inp.profile.blocks.clear();
    assert!(plan(&inp).unwrap_err().to_string().contains("no blocks"));
}

/// A host's devices split its share of the batch: on a link fast enough not to count, hosts
/// of four devices plan, per device, what hosts of one plan for a quarter of the batch (with
/// no replicas to sum between hosts, nothing else differs), so each device still runs several
/// micro-batches; on a real link the four devices' activations share it.
#[test]
fn a_hosts_devices_split_its_share() {
    let blocks = vec![block(1.0, 1000); 4];
    let mut four = input(blocks.clone(), &[(1.0, 1 << 30); 2]);
    four.local_ranks = 4;
    let mut quarter = input(blocks, &[(1.0, 1 << 30); 2]);
    quarter.global_batch = 16;
    for inp in [&mut four, &mut quarter] {
        inp.link = Link { bytes_per_s: 1e18, latency_ms: 0.0 };
    }
    let (a, b) = (plan(&four).unwrap(), plan(&quarter).unwrap());
    let all =
        |r: &PlanReport| std::iter::once(r.best.clone()).chain(r.runners_up.clone()).collect::<Vec<_>>();
    let pipelined =
        |r: &PlanReport| all(r).into_iter().find(|p| p.layout.data == 1 && p.layout.pipeline() == 2).unwrap();
    let (pa, pb) = (pipelined(&a), pipelined(&b));
    assert_eq!((&pa.layout, pa.micro_batches), (&pb.layout, pb.micro_batches));
    assert!((pa.step_ms - pb.step_ms).abs() < 1e-9, "{} against {}", pa.step_ms, pb.step_ms);
    assert_eq!(pa.layout.micro_batch * pa.micro_batches, 16, "{}", pa.layout);
    assert!(pa.micro_batches >= 2, "{}: {} micro-batches a device", pa.layout, pa.micro_batches);
    // The devices send at once over their host's link: a micro-batch's transfer takes four
    // times a lone device's.
    let forced = |local: usize| {
        let mut inp = input(vec![block(1.0, 1000); 2], &[(1.0, 1 << 30); 2]);
        inp.local_ranks = local;
        inp.link.latency_ms = 0.0;
        let p = predict(&inp, &two_stages(1, 2, 2)).unwrap();
        p.stages[0].micro_ms - 3.0 * 2.0 / 8.0
    };
    assert!((forced(4) - 4.0 * forced(1)).abs() < 1e-9, "{} against {}", forced(4), forced(1));
    // Planned as hosts of one device, the micro-batch is a whole host's: over four devices
    // that would leave each fewer micro-batches to overlap.
    let linked = |local: usize| {
        let mut inp = input(vec![block(1.0, 1000); 4], &[(1.0, 1 << 30); 2]);
        inp.local_ranks = local;
        pipelined(&plan(&inp).unwrap())
    };
    let (blind, real) = (linked(1), linked(4));
    assert!(blind.layout.micro_batch > real.layout.micro_batch, "{} against {}", blind.layout, real.layout);
    // Replicas of a stage sum one buffer a host between hosts, whatever its devices.
    let two = |local: usize| {
        let mut inp = input(vec![block(1.0, 1 << 20); 2], &[(1.0, 1 << 30); 2]);
        inp.local_ranks = local;
        let layout = HostLayout {
            data: 2,
            micro_batch: 1,
            stages: vec![StageLayout { start: 0, end: 2, hosts: vec!["h0".into(), "h1".into()] }],
        };
        predict(&inp, &layout).unwrap().stages[0].tail_ms
    };
    assert_eq!(two(4), two(1));
    four.local_ranks = 0;
    assert!(plan(&four).unwrap_err().to_string().contains("local_ranks is 0"));
}

//! The planner's dynamic program against exhaustive search, on random profiles and hosts.

use limpet_decide::planner::{exhaustive, plan, predict, BlockCost, HostSpec, Link, ModelProfile, PlanInput};
use proptest::prelude::*;

fn arb_block() -> impl Strategy<Value = BlockCost> {
    (0.1f64..5.0, 0.5f64..3.0, 1u64..64, 1u64..64, 1u64..256).prop_map(
        |(fwd, bwd_x, out_k, saved_k, param_k)| BlockCost {
            fwd_ms: fwd,
            bwd_ms: fwd * bwd_x,
            fixed_fwd_ms: fwd / 8.0,
            fixed_bwd_ms: 0.0,
            apply_ms: param_k as f64 * 1e-3,
            out_bytes: out_k << 10,
            saved_bytes: saved_k << 10,
            param_bytes: param_k << 10,
            optim_bytes: 2 * (param_k << 10),
        },
    )
}

fn arb_input() -> impl Strategy<Value = PlanInput> {
    (
        prop::collection::vec(arb_block(), 1..=6),
        prop::collection::vec((prop::sample::select(vec![0.5, 1.0, 1.5, 2.0, 3.0]), 256u64..4096), 1..=5),
        1usize..=64,
        1usize..=16,
        prop::sample::select(vec![1e7, 1e8, 1e9]),
    )
        .prop_map(|(blocks, hosts, global_batch, micro_batch, bw)| PlanInput {
            profile: ModelProfile { model: "random".into(), micro_batch, blocks, overhead_ms: 0.3 },
            hosts: hosts
                .into_iter()
                .enumerate()
                .map(|(i, (speed, mem_k))| HostSpec { name: format!("h{i}"), speed, mem_bytes: mem_k << 10 })
                .collect(),
            link: Link { bytes_per_s: bw, latency_ms: 0.02 },
            global_batch,
            max_depth: None,
            local_ranks: 1,
            replica_batch: None,
        })
}

/// Inputs whose hosts repeat a few kinds (one speed and memory of two each), as fleets of a
/// few instance types do: groups fall into classes of several alike.
fn arb_fleet() -> impl Strategy<Value = PlanInput> {
    (
        arb_input(),
        prop::collection::vec(
            (prop::sample::select(vec![1.0, 2.0]), prop::sample::select(vec![1024u64, 4096])),
            2..=7,
        ),
    )
        .prop_map(|(mut inp, kinds)| {
            inp.hosts = kinds
                .into_iter()
                .enumerate()
                .map(|(i, (speed, mem_k))| HostSpec { name: format!("h{i}"), speed, mem_bytes: mem_k << 10 })
                .collect();
            inp
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// On random profiles and hosts.
    #[test]
    fn dp_equals_exhaustive_search(inp in arb_input()) {
        dp_matches_exhaustive(&inp)?;
    }

    /// The same where hosts repeat a few kinds, so the DP counts groups by class.
    #[test]
    fn dp_equals_exhaustive_search_over_alike_groups(inp in arb_fleet()) {
        dp_matches_exhaustive(&inp)?;
    }
}

/// For every (data, pipeline) shape, the DP's best layout is as fast as the best that
/// exhaustive search finds, and exists exactly when some layout of that shape fits.
fn dp_matches_exhaustive(inp: &PlanInput) -> Result<(), TestCaseError> {
    let report = plan(inp);
    let shapes: Vec<_> = match &report {
        Ok(r) => std::iter::once(&r.best).chain(&r.runners_up).cloned().collect(),
        Err(_) => Vec::new(),
    };
    let h = inp.hosts.len();
    for d in 1..=h {
        for p in 1..=(h / d).min(inp.profile.blocks.len()) {
            let reference = exhaustive(inp, d, p);
            let found = shapes.iter().find(|s| s.layout.data == d && s.layout.pipeline() == p);
            match (reference, found) {
                (None, None) => {}
                (Some(r), Some(f)) => {
                    prop_assert!(
                        (r.step_ms - f.step_ms).abs() <= 1e-9 * r.step_ms.max(1.0),
                        "{d}x{p}: exhaustive {} ({}) vs DP {} ({})",
                        r.step_ms,
                        r.layout,
                        f.step_ms,
                        f.layout
                    );
                    // The DP's layout really has the time it claims, and fits.
                    let again = predict(inp, &f.layout).unwrap();
                    prop_assert_eq!(again.step_ms, f.step_ms);
                }
                (r, f) => prop_assert!(
                    false,
                    "{d}x{p}: exhaustive {:?} vs DP {:?}",
                    r.map(|p| p.layout.to_string()),
                    f.map(|p| p.layout.to_string())
                ),
            }
        }
    }
    if let Ok(r) = &report {
        for other in &r.runners_up {
            prop_assert!(r.best.step_ms <= other.step_ms);
        }
        for (s, st) in r.best.stages.iter().enumerate() {
            for host in &r.best.layout.stages[s].hosts {
                let mem = inp.hosts.iter().find(|x| &x.name == host).unwrap().mem_bytes;
                prop_assert!(
                    st.mem_bytes <= mem,
                    "stage {} needs {} on {} with {}",
                    s,
                    st.mem_bytes,
                    host,
                    mem
                );
            }
        }
    }
    Ok(())
}

proptest! {
    /// Any layout text, well-formed or not, gives a layout or an error, and a parsed layout
    /// gives a prediction or an error naming the problem: never a panic.
    #[test]
    fn arbitrary_layouts_never_panic(
        inp in arb_input(),
        stages in prop::collection::vec((0usize..9, 0usize..9, prop::collection::vec(0usize..7, 0..4)), 0..5),
        micro in prop::option::of(0usize..40),
    ) {
        let mut text = stages
            .iter()
            .map(|(a, b, hs)| format!("{a}..{b}@{}", hs.iter().map(|h| format!("h{h}")).collect::<Vec<_>>().join(",")))
            .collect::<Vec<_>>()
            .join("|");
        if let Some(m) = micro {
            text.push_str(&format!(";micro={m}"));
        }
        if let Ok(layout) = text.parse::<limpet_decide::planner::HostLayout>() {
            if let Ok(p) = predict(&inp, &layout) {
                prop_assert!(p.step_ms.is_finite() && p.step_ms >= 0.0);
                prop_assert_eq!(p.layout.spec().parse::<limpet_decide::planner::HostLayout>().unwrap(), p.layout.clone());
            }
        }
    }
}

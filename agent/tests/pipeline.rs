//! Pipelined training over the data plane computes the same updates as unpipelined training:
//! each layout below runs its stages as threads with their own endpoints, real TCP links
//! between stages (activations forward, gradients back) and ring groups among the replicas
//! of each stage, and is compared, step by step and parameter by parameter, with one trainer
//! holding the whole model. Hosts of several local ranks run each local rank's trainer on a
//! thread of the host's, as `limpetd` does.

use limpet_agent::stage::StageConnections;
use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::model::ModelSpec;
use limpet_trainer::{JobSpec, ModelKind, NoReduce, Trainer};
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{Duration, Instant};

const STEPS: u64 = 6;

fn job() -> (JobSpec, Dataset) {
    let data = Dataset::load(&DataSpec::Chars { context: 16 }, None).unwrap();
    let mut job = JobSpec::defaults_for(ModelKind::Gpt, &data).unwrap();
    if let ModelSpec::Gpt { width, layers, heads, .. } = &mut job.model {
        (*width, *layers, *heads) = (32, 3, 2);
    }
    job.steps = STEPS;
    job.global_batch = 12;
    job.micro_batch = 3;
    job.schedule.warmup_steps = 1;
    // Small enough that clipping is active on some steps: the norm must be the whole model's.
    job.clip_norm = Some(0.5);
    (job, data)
}

struct RankResult {
    stage: usize,
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: BTreeMap<String, Vec<f32>>,
    hash: String,
}

/// Trains `STEPS` steps in `d` replicas of the pipeline cut at `stages`, on hosts of `local`
/// local ranks. One result per host (its first local rank's), after checking that its other
/// local ranks end with the same state.
fn run_layout(d: usize, stages: &[Range<usize>], local: usize) -> Vec<RankResult> {
    let p = stages.len();
    let eps: Vec<Endpoint> = (0..d * p)
        .map(|i| {
            let cfg = DataPlaneConfig::new(7, i as u64 + 1, b"sixteen-byte-secret!".to_vec());
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    std::thread::scope(|sc| {
        let handles: Vec<_> = eps
            .iter()
            .enumerate()
            .map(|(i, ep)| {
                let (r, s) = (i / p, i % p);
                let addrs = &addrs;
                let blocks = stages[s].clone();
                sc.spawn(move || {
                    let ranks: Vec<u64> = (0..d * p).map(|i| i as u64 + 1).collect();
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut conn =
                        StageConnections::connect(ep, 1, (d, p, local), &ranks, addrs, deadline, &|| false)
                            .unwrap();
                    assert_eq!((conn.pos.replica, conn.pos.stage), (r, s));
                    let (job, data) = job();
                    // The other local ranks start with the whole model, as an agent's do: the
                    // first step makes them the stage's.
                    let all = 0..job.model.num_blocks();
                    let mut followers: Vec<Trainer> = (1..local)
                        .map(|_| Trainer::for_stage(job.clone(), data.shallow_clone(), all.clone()).unwrap())
                        .collect();
                    let mut t = Trainer::for_stage(job, data, blocks).unwrap();
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(local.max(2) - 1).build().unwrap();
                    let sums = limpet_trainer::LocalSums::default();
                    let (mut losses, mut norms) = (Vec::new(), Vec::new());
                    for _ in 0..STEPS {
                        let st = if local == 1 {
                            conn.step(&mut t)
                        } else {
                            conn.step_local(&mut t, &mut followers, &sums, &pool)
                        };
                        let st = st.unwrap();
                        losses.push(st.loss);
                        norms.push(st.grad_norm);
                    }
                    let image = t.image().unwrap();
                    for (k, f) in followers.iter().enumerate() {
                        let theirs = f.image().unwrap();
                        assert_eq!(
                            theirs.content_hash(),
                            image.content_hash(),
                            "replica {r} stage {s}: local rank {} holds another state",
                            k + 1
                        );
                    }
                    let params = image
                        .tensors()
                        .iter()
                        .filter(|(n, _)| n.starts_with("param/"))
                        .map(|(n, raw)| (n.clone(), raw.to_f32().unwrap()))
                        .collect();
                    RankResult { stage: s, losses, norms, params, hash: image.content_hash().to_string() }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn reference() -> (Vec<f64>, Vec<f64>, BTreeMap<String, Vec<f32>>) {
    let (job, data) = job();
    let mut t = Trainer::try_new(job, data).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let st = t.train_step(0, 1, &mut NoReduce).unwrap();
        losses.push(st.loss);
        norms.push(st.grad_norm);
    }
    let params = t
        .image()
        .unwrap()
        .tensors()
        .iter()
        .filter(|(n, _)| n.starts_with("param/"))
        .map(|(n, raw)| (n.clone(), raw.to_f32().unwrap()))
        .collect();
    (losses, norms, params)
}

/// Relative tolerance for losses and norms: the pipelined step sums the same per-sample
/// gradients in another order (per stage, per replica), and the norm's square crosses
/// stages in f32.
const TOL: f64 = 2e-4;
/// Tolerance for parameters, relative to each tensor's scale (its largest value, at least
/// 0.05). Looser than for losses: AdamW divides each gradient by its own running size, so a
/// coordinate whose true gradient is zero (the key bias of attention, which softmax ignores)
/// moves by the sign of rounding noise, up to the learning rate per step, in either run.
const PARAM_TOL: f32 = 2e-3;

fn threads() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| limpet_trainer::set_threads(1));
}

fn check(layout: &str, d: usize, stages: &[Range<usize>], local: usize) {
    let (losses, norms, params) = reference();
    assert!(norms.iter().any(|&n| n > 0.5), "clipping never engaged: {norms:?}");
    let ranks = run_layout(d, stages, local);
    let mut covered = BTreeMap::new();
    let mut largest = 0f32;
    for r in &ranks {
        for (step, (a, b)) in losses.iter().zip(&r.losses).enumerate() {
            assert!(
                (a - b).abs() <= TOL * a.abs(),
                "{layout} stage {}: step {step} loss {b} vs {a}",
                r.stage
            );
        }
        for (step, (a, b)) in norms.iter().zip(&r.norms).enumerate() {
            assert!(
                (a - b).abs() <= TOL * a.abs(),
                "{layout} stage {}: step {step} norm {b} vs {a}",
                r.stage
            );
        }
        for (name, got) in &r.params {
            let want = &params[name];
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(0.05);
            let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs() / scale).fold(0f32, f32::max);
            assert!(worst <= PARAM_TOL, "{layout}: {name} differs by {worst} (relative to its scale)");
            largest = largest.max(worst);
            covered.insert(name.clone(), ());
        }
    }
    assert_eq!(covered.len(), params.len(), "{layout}: the stages do not hold every parameter");
    eprintln!("{layout}: largest parameter difference {largest:.2e} of scale");
    // The replicas of a stage hold bit-identical state.
    for r in &ranks {
        let first = ranks.iter().find(|x| x.stage == r.stage).unwrap();
        assert_eq!(r.hash, first.hash, "{layout}: replicas of stage {} differ", r.stage);
    }
}

#[test]
fn two_stages_train_like_one_model() {
    threads();
    check("1x2", 1, &[0..2, 2..5], 1);
}

#[test]
fn three_stages_train_like_one_model() {
    threads();
    check("1x3", 1, &[0..1, 1..3, 3..5], 1);
}

#[test]
fn two_replicas_of_two_stages_train_like_one_model() {
    threads();
    check("2x2", 2, &[0..3, 3..5], 1);
}

/// Two replicas of hosts of two local ranks each: four replicas of each stage, whose
/// gradients are summed through each host's memory and two ring lanes between the hosts.
#[test]
fn two_replicas_of_hosts_of_two_local_ranks_train_like_one_model() {
    threads();
    check("2x2 of 2 local ranks", 2, &[0..3, 3..5], 2);
}

/// One host of two local ranks per stage computes what two hosts of one do, bit for bit: the
/// same replicas take the same samples, and a sum of two is the same either way.
#[test]
fn hosts_of_two_local_ranks_train_a_pipeline_bit_for_bit_as_twice_the_hosts_of_one() {
    threads();
    let stages = [0..2, 2..5];
    let local = run_layout(1, &stages, 2);
    let hosts = run_layout(2, &stages, 1);
    for s in 0..stages.len() {
        let a = local.iter().find(|r| r.stage == s).unwrap();
        let b = hosts.iter().find(|r| r.stage == s).unwrap();
        assert_eq!(a.losses, b.losses, "stage {s}: losses");
        assert_eq!(a.norms, b.norms, "stage {s}: norms");
        assert_eq!(a.hash, b.hash, "stage {s}: state after {STEPS} steps");
    }
}

/// A stage that vanishes mid-run (its sockets close, as when its process is killed) makes
/// every other stage's step fail at once, not after the data-plane timeout.
#[test]
fn a_vanished_stage_fails_its_neighbours_fast() {
    threads();
    let (d, p) = (1, 3);
    let stages = [0..1, 1..3, 3..5];
    let eps: Vec<Endpoint> = (0..d * p)
        .map(|i| {
            let mut cfg = DataPlaneConfig::new(7, i as u64 + 1, b"sixteen-byte-secret!".to_vec());
            cfg.timeout = Duration::from_secs(20);
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    /// Per stage: the steps it ran before it left, or the error it saw and how long it took.
    type Outcome = (usize, Result<u64, (String, Duration)>);
    let outcomes: Vec<Outcome> = std::thread::scope(|sc| {
        let handles: Vec<_> = eps
            .iter()
            .enumerate()
            .map(|(i, ep)| {
                let (addrs, blocks) = (&addrs, stages[i].clone());
                sc.spawn(move || {
                    let ranks: Vec<u64> = (1..=3).collect();
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut conn =
                        StageConnections::connect(ep, 1, (d, p, 1), &ranks, addrs, deadline, &|| false)
                            .unwrap();
                    let (job, data) = job();
                    let mut t = Trainer::for_stage(job, data, blocks).unwrap();
                    for step in 0..STEPS {
                        if i == 1 && step == 2 {
                            // The middle stage is gone: its connections close with it.
                            return (i, Ok(step));
                        }
                        let started = Instant::now();
                        if let Err(e) = conn.step(&mut t) {
                            return (i, Err((e.to_string(), started.elapsed())));
                        }
                    }
                    (i, Ok(STEPS))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, out) in outcomes {
        match (i, out) {
            (1, Ok(2)) => {}
            (_, Err((e, waited))) => {
                assert!(waited < Duration::from_secs(3), "stage {i} waited {waited:?} for: {e}");
                assert!(e.contains("node 2") || e.contains("closed"), "stage {i}: {e}");
            }
            (i, other) => panic!("stage {i}: {other:?}"),
        }
    }
}

#[test]
fn a_wrong_or_huge_activation_from_the_previous_stage_is_an_error_not_a_panic() {
    threads();
    let stages = [0..2, 2..5];
    // Shapes a buggy or hostile first stage sends instead of its activation: more values
    // than memory, another width than the model's (a GPT's is checked whole), the wrong
    // number of rows.
    let bad: [(&str, Vec<i64>); 3] = [
        ("values", vec![1 << 14, 1 << 15]),
        ("(expected [4, 16, 32])", vec![4, 16, 3]),
        ("for 4 samples", vec![5, 16, 32]),
    ];
    for (want, shape) in bad {
        let eps: Vec<Endpoint> = (0..2)
            .map(|i| {
                let mut cfg = DataPlaneConfig::new(7, i as u64 + 1, b"sixteen-byte-secret!".to_vec());
                cfg.timeout = Duration::from_secs(10);
                Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
            })
            .collect();
        let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
        let err = std::thread::scope(|sc| {
            let (addrs, eps, stages, shape) = (&addrs, &eps, &stages, &shape);
            let rogue = sc.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut conn =
                    StageConnections::connect(&eps[0], 1, (1, 2, 1), &[1, 2], addrs, deadline, &|| false)
                        .unwrap();
                let n =
                    if shape.iter().product::<i64>() < 1 << 20 { shape.iter().product::<i64>() } else { 0 };
                let _ = conn.link.send_activation(0, 0, shape, &vec![0.5; n as usize]);
                // Stay connected until the other side has given up.
                std::thread::sleep(Duration::from_secs(2));
            });
            let victim = sc.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut conn =
                    StageConnections::connect(&eps[1], 1, (1, 2, 1), &[1, 2], addrs, deadline, &|| false)
                        .unwrap();
                let (mut job, data) = job();
                job.micro_batch = 4;
                let mut t = Trainer::for_stage(job, data, stages[1].clone()).unwrap();
                conn.step(&mut t).map(|_| ()).unwrap_err().to_string()
            });
            rogue.join().unwrap();
            victim.join().expect("the stage's trainer must not panic")
        });
        assert!(err.contains(want), "{shape:?}: {err}");
    }
}

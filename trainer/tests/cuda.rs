//! The device paths, on the device the environment names: `LIMPET_TEST_DEVICE` (`cpu` when
//! unset, so `make test` runs every test here on the CPU; `make gpu-test` and the GPU kit's
//! `deploy/gpu-check.sh` set `cuda:0`). On the CPU the comparisons with the CPU are between
//! equals, but every path is the one a GPU takes. A test that needs more devices than the
//! host has says so and passes; one that only measures a GPU says so on the CPU.

use limpet_trainer::data::tokens::write_dataset;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::device::{Device, DeviceChoice};
use limpet_trainer::model::{LlamaSpec, ModelSpec, Precision};
use limpet_trainer::{JobSpec, LocalGroup, ModelKind, NoReduce, Reduce, ShardLayout, Sharding, Trainer};
use std::time::Instant;

/// The device under test: `LIMPET_TEST_DEVICE`, resolved on this host (`cpu` when unset).
fn device() -> Device {
    let name = std::env::var("LIMPET_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let choice = DeviceChoice::parse(&name).unwrap_or_else(|e| panic!("LIMPET_TEST_DEVICE={name:?}: {e}"));
    choice.resolve().unwrap_or_else(|e| panic!("LIMPET_TEST_DEVICE={name:?}: {e}"))
}

/// Waits for the device's queued work, so a clock read after it counts that work.
fn synchronize(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn data(dir: &std::path::Path) -> Dataset {
    let ids: Vec<u32> = (0..20_000u32).map(|i| (i * 7919 + i / 5) % 97).collect();
    write_dataset(dir, &ids, &[], 97, 1 << 20).unwrap();
    Dataset::load(&DataSpec::Tokens { context: 32 }, Some(dir)).unwrap()
}

fn llama_job(d: &Dataset, steps: u64) -> JobSpec {
    let mut job = JobSpec::defaults_for(ModelKind::Llama, d).unwrap();
    job.steps = steps;
    job.schedule.warmup_steps = 1;
    job
}

/// A trainer of `job` on `device`, with data of its own.
fn trainer(job: &JobSpec, device: Device) -> Trainer {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 0..job.model.num_blocks();
    Trainer::on_device(job.clone(), data(dir.path()), blocks, device).unwrap()
}

fn trained(device: Device, precision: Precision, steps: u64) -> Trainer {
    let dir = tempfile::tempdir().unwrap();
    let mut job = llama_job(&data(dir.path()), steps);
    job.precision = precision;
    let mut t = trainer(&job, device);
    for _ in 0..steps {
        t.train_step(0, 1, &mut NoReduce).unwrap();
    }
    t
}

/// The largest relative difference between two trainers' parameter tensors.
fn max_rel(a: &Trainer, b: &Trainer) -> f64 {
    let (ia, ib) = (a.image().unwrap(), b.image().unwrap());
    ia.tensors()
        .iter()
        .filter(|(k, _)| k.starts_with("param/"))
        .map(|(k, t)| {
            let (x, y) = (t.to_f32().unwrap(), ib.tensors()[k].to_f32().unwrap());
            let d: f64 = x.iter().zip(&y).map(|(p, q)| f64::from(p - q).powi(2)).sum::<f64>().sqrt();
            d / y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>().sqrt().max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// Runs `f` on every one of `ranks` (local ranks of one host, each on its thread) with its
/// rank index and its reduce through a host group of their own.
fn on_local_ranks(ranks: &mut [Trainer], f: impl Fn(usize, &mut Trainer, &mut (dyn Reduce + Send)) + Sync) {
    let group = LocalGroup::new(ranks.len());
    std::thread::scope(|s| {
        for (i, t) in ranks.iter_mut().enumerate() {
            let (group, f) = (&group, &f);
            s.spawn(move || {
                let mut alone = NoReduce;
                let inter: Option<&mut (dyn Reduce + Send)> = if i == 0 { Some(&mut alone) } else { None };
                f(i, t, &mut group.rank(i, inter));
            });
        }
    });
}

/// `ranks` (local ranks of one host) take one step each.
fn local_step(ranks: &mut [Trainer]) {
    let n = ranks.len();
    on_local_ranks(ranks, |i, t, reduce| {
        t.train_step(i, n, reduce).unwrap();
    });
}

#[test]
fn training_on_the_device_matches_the_cpu_and_images_move_between_them() {
    let dev = device();
    // What the GPU check reports of the machine: the backend and the class of device.
    eprintln!("libtorch: {}", limpet_trainer::device::backend());
    eprintln!("device class: {}", limpet_trainer::device::device_class(dev));
    let on_dev = trained(dev, Precision::Fp32, 20);
    let cpu = trained(Device::Cpu, Precision::Fp32, 20);
    let diff = max_rel(&on_dev, &cpu);
    assert!(diff < 1e-3, "{dev:?} and cpu parameters differ by {diff:e}");
    // An image taken on the device loads on the CPU with the same content hash.
    let img = on_dev.image().unwrap();
    let mut back = trainer(on_dev.job(), Device::Cpu);
    back.load_image(&img).unwrap();
    assert_eq!(back.content_hash().unwrap(), on_dev.content_hash().unwrap());
}

#[test]
fn bf16_trains_close_to_f32() {
    let dev = device();
    let bf16 = trained(dev, Precision::Bf16, 20);
    let f32 = trained(dev, Precision::Fp32, 20);
    let (a, b) = (bf16.evaluate().unwrap().loss, f32.evaluate().unwrap().loss);
    assert!((a - b).abs() < 0.05 * b, "bf16 test loss {a} vs f32 {b}");
}

/// A state taken on the device, resumed on the CPU, and taken back to the device ends where
/// an uninterrupted run on the device does: bit for bit where the device is the CPU, to
/// rounding where the CPU's kernels round otherwise.
#[test]
fn a_state_moves_to_the_cpu_and_back_and_training_goes_on() {
    let dev = device();
    let whole = trained(dev, Precision::Fp32, 12);
    let job = whole.job().clone();
    let mut a = trainer(&job, dev);
    for _ in 0..6 {
        a.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let mut b = trainer(&job, Device::Cpu);
    b.load_image(&a.image().unwrap()).unwrap();
    for _ in 0..3 {
        b.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let mut c = trainer(&job, dev);
    c.load_image(&b.image().unwrap()).unwrap();
    for _ in 0..3 {
        c.train_step(0, 1, &mut NoReduce).unwrap();
    }
    assert_eq!(c.step(), whole.step());
    if dev == Device::Cpu {
        assert_eq!(c.content_hash().unwrap(), whole.content_hash().unwrap());
    }
    let diff = max_rel(&c, &whole);
    assert!(diff < 1e-3, "moved and uninterrupted differ by {diff:e}");
}

/// Two local ranks on one device (`cuda:0` twice on a GPU), each on its own thread, through
/// the reduction that overlaps backward: the same bits on both, close to one process.
#[test]
fn two_local_ranks_on_one_device_train_as_one_process() {
    let dev = device();
    let dir = tempfile::tempdir().unwrap();
    let job = llama_job(&data(dir.path()), 10);
    let mut ranks = vec![trainer(&job, dev), trainer(&job, dev)];
    for _ in 0..job.steps {
        local_step(&mut ranks);
    }
    assert_eq!(ranks[0].content_hash().unwrap(), ranks[1].content_hash().unwrap(), "local ranks differ");
    let one = trained(dev, Precision::Fp32, job.steps);
    let diff = max_rel(&ranks[0], &one);
    assert!(diff < 1e-3, "two local ranks and one process differ by {diff:e}");
}

/// A host's GPUs as local ranks (every GPU libtorch sees, at least two), each rank on its
/// own thread and device: the same bits on every rank, close to one CPU process.
#[test]
fn local_ranks_on_every_gpu_train_as_one_process() {
    let gpus = limpet_trainer::device::gpu_count();
    if gpus < 2 {
        // `make gpu-test` runs on one-GPU hosts too: said, not failed.
        eprintln!("not run: this test needs two GPUs, libtorch sees {gpus}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = llama_job(&data(dir.path()), 10);
    let mut ranks: Vec<Trainer> = (0..gpus).map(|g| trainer(&job, Device::Cuda(g))).collect();
    for _ in 0..job.steps {
        local_step(&mut ranks);
    }
    let first = ranks[0].content_hash().unwrap();
    assert!(ranks.iter().all(|t| t.content_hash().unwrap() == first), "local ranks differ");
    let cpu = trained(Device::Cpu, Precision::Fp32, job.steps);
    let diff = max_rel(&ranks[0], &cpu);
    assert!(diff < 1e-3, "local ranks on GPUs and one CPU process differ by {diff:e}");
}

/// Two local ranks of one host with sharded optimizer state (ZeRO-1) and with sharded
/// gradients too (ZeRO-2): the same losses, and, gathered, the same tensors.
#[test]
fn sharded_optimizer_state_and_sharded_gradients_train_the_same_bits() {
    let dev = device();
    let dir = tempfile::tempdir().unwrap();
    let base = llama_job(&data(dir.path()), 4);
    let run = |gradients: bool| {
        let job = JobSpec { shard_state: Some(Sharding { replicas: 0, gradients }), ..base.clone() };
        let mut ranks = vec![trainer(&job, dev), trainer(&job, dev)];
        for (r, t) in ranks.iter_mut().enumerate() {
            let n = t.buffer_len() - 3;
            t.shard_state(ShardLayout::over_host_counts(n, &[2], r, 0).unwrap()).unwrap();
        }
        for _ in 0..job.steps {
            local_step(&mut ranks);
        }
        on_local_ranks(&mut ranks, |_, t, reduce| t.unshard(reduce).unwrap());
        // The tensors, not the content hash: that covers the job, which differs.
        ranks.iter().map(|t| t.image().unwrap().tensors().clone()).collect::<Vec<_>>()
    };
    let (zero1, zero2) = (run(false), run(true));
    assert!(zero1[0] == zero1[1] && zero2[0] == zero2[1], "ranks differ");
    assert!(zero1[0] == zero2[0], "ZeRO-1 and ZeRO-2 differ");
}

/// A reproducible job: the same content hash run to run, and on one rank or two.
#[test]
fn a_reproducible_job_keeps_its_bits_run_to_run_and_over_one_and_two_ranks() {
    let dev = device();
    let dir = tempfile::tempdir().unwrap();
    let job = JobSpec { reproducible: true, ..llama_job(&data(dir.path()), 4) };
    let alone = || {
        let mut t = trainer(&job, dev);
        for _ in 0..job.steps {
            t.train_step(0, 1, &mut NoReduce).unwrap();
        }
        t.content_hash().unwrap()
    };
    let first = alone();
    assert_eq!(alone(), first, "run to run");
    let mut ranks = vec![trainer(&job, dev), trainer(&job, dev)];
    for _ in 0..job.steps {
        local_step(&mut ranks);
    }
    assert_eq!(ranks[0].content_hash().unwrap(), first, "two ranks against one");
    assert_eq!(ranks[1].content_hash().unwrap(), first, "two ranks against one");
}

/// A GPT with dropout trains on the device (its masks are made where its activations are),
/// and its masks come from the model's own generator: two runs give the same bits.
#[test]
fn a_gpt_with_dropout_trains_on_the_device_the_same_way_twice() {
    let dev = device();
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut job = JobSpec::defaults_for(ModelKind::Gpt, &d).unwrap();
    if let ModelSpec::Gpt { dropout, .. } = &mut job.model {
        *dropout = 0.1;
    }
    job.steps = 5;
    job.schedule.warmup_steps = 1;
    let run = || {
        let mut t = trainer(&job, dev);
        let losses: Vec<f64> =
            (0..job.steps).map(|_| t.train_step(0, 1, &mut NoReduce).unwrap().loss).collect();
        (losses, t.content_hash().unwrap())
    };
    let (losses, hash) = run();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_eq!(run(), (losses, hash));
}

/// A 125m LLaMA's time per step on the device, the figure `deploy/gpu-check.sh` sets beside
/// plain PyTorch's (`bench/hf_train.py` with the configuration written to
/// `LIMPET_GPU_OUT`): measured on a GPU only.
#[test]
fn a_125m_step_time_on_the_device() {
    let dev = device();
    if dev == Device::Cpu {
        eprintln!("not measured: LIMPET_TEST_DEVICE is the CPU (the CPU's figures are `bench train`'s)");
        return;
    }
    let (batch, context, steps, warmup) = (8, 512, 10, 3);
    let dir = tempfile::tempdir().unwrap();
    let vocab = 32_000;
    let ids: Vec<u32> =
        (0..(batch * (context + 1) * 64) as u32).map(|i| (i * 7919 + i / 5) % vocab).collect();
    write_dataset(dir.path(), &ids, &[], u64::from(vocab), 1 << 22).unwrap();
    let d = Dataset::load(&DataSpec::Tokens { context }, Some(dir.path())).unwrap();
    let spec = LlamaSpec::preset("125m", vocab as usize, context).unwrap();
    let mut job = JobSpec::defaults_with(ModelKind::Llama, ModelSpec::Llama(spec.clone()), &d);
    job.global_batch = batch;
    job.micro_batch = batch;
    job.steps = (steps + warmup) as u64;
    let mut t = Trainer::on_device(job.clone(), d, 0..job.model.num_blocks(), dev).unwrap();
    // The peak from here: the model, its gradients and moments, and a step's activations.
    limpet_trainer::device::device_memory(dev, true).unwrap();
    let mut times = Vec::new();
    for s in 0..steps + warmup {
        synchronize(dev);
        let t0 = Instant::now();
        t.train_step(0, 1, &mut NoReduce).unwrap();
        synchronize(dev);
        if s >= warmup {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let ms = times.iter().sum::<f64>() / times.len() as f64;
    let (_, peak) = limpet_trainer::device::device_memory(dev, false).unwrap().expect("a GPU's allocator");
    // Parameters, gradients and AdamW's two moments in f32 at the least: a reading below
    // them is not the allocator's.
    let state = 16 * spec.num_params();
    assert!(peak >= state, "a peak of {peak} bytes for {state} bytes of state");
    println!(
        "{}",
        serde_json::json!({"limpet_125m_ms_per_step": ms, "batch": batch, "context": context, "device": format!("{dev:?}"),
            "limpet_125m_peak_device_mib": peak as f64 / f64::from(1 << 20), "state_mib": state as f64 / f64::from(1 << 20)})
    );
    if let Ok(out) = std::env::var("LIMPET_GPU_OUT") {
        let config = limpet_trainer::hf::hf_config(&spec);
        std::fs::write(std::path::Path::new(&out).join("config-125m.json"), config.to_string()).unwrap();
    }
}

/// Grouped-query attention in f32 on the device, forward and backward, as SDPA's own
/// grouping runs it (its math kernel, which keeps every `B x H x T x T` probability) and as
/// limpet runs it on a GPU (each K/V head repeated for its query heads, so a fused kernel
/// takes it): the device allocator's peak either way, for a 1b preset's heads at batch 8 x
/// 2048. Measured on a GPU only.
#[test]
fn grouped_query_attention_in_f32_peaks_lower_expanded() {
    let dev = device();
    if dev == Device::Cpu {
        eprintln!(
            "not measured: LIMPET_TEST_DEVICE is the CPU (the CPU's SDPA has no fused f32 kernel to reach)"
        );
        return;
    }
    let (b, h, kv, t, hd) = (8i64, 32i64, 8i64, 2048i64, 64i64);
    let opts = (tch::Kind::Float, dev);
    let peak_of = |expand: bool| {
        let q = tch::Tensor::randn([b, h, t, hd], opts).set_requires_grad(true);
        let k = tch::Tensor::randn([b, kv, t, hd], opts).set_requires_grad(true);
        let v = tch::Tensor::randn([b, kv, t, hd], opts).set_requires_grad(true);
        synchronize(dev);
        limpet_trainer::device::device_memory(dev, true).unwrap();
        let y = if expand {
            let repeat =
                |x: &tch::Tensor| x.unsqueeze(2).expand([b, kv, h / kv, t, hd], false).reshape([b, h, t, hd]);
            tch::Tensor::scaled_dot_product_attention::<tch::Tensor>(
                &q,
                &repeat(&k),
                &repeat(&v),
                None,
                0.0,
                true,
                None,
                false,
            )
        } else {
            tch::Tensor::scaled_dot_product_attention::<tch::Tensor>(&q, &k, &v, None, 0.0, true, None, true)
        };
        y.sum(tch::Kind::Float).backward();
        synchronize(dev);
        limpet_trainer::device::device_memory(dev, false).unwrap().expect("a GPU's allocator").1
    };
    let (grouped, expanded) = (peak_of(false), peak_of(true));
    let mib = |x: u64| x as f64 / f64::from(1 << 20);
    println!(
        "{}",
        serde_json::json!({"gqa_f32_peak_mib_grouped": mib(grouped), "gqa_f32_peak_mib_expanded": mib(expanded),
            "shape": [b, h, kv, t, hd]})
    );
    assert!(
        expanded < grouped,
        "expanded K/V heads peaked at {expanded} bytes, SDPA's grouping at {grouped}"
    );
}

/// The kernel choices a reproducible job makes on a GPU (deterministic algorithms, SDPA's
/// math kernel, no TF32) hold for the whole process, so this test checks them in a process
/// of its own (this binary again): refused without cuBLAS's workspace setting, naming it; in
/// force once made, libtorch's defaults once turned off.
#[test]
fn reproducible_kernels_are_chosen_for_the_whole_process() {
    use limpet_trainer::device::{reproducible_kernels, reproducible_kernels_on, set_reproducible_kernels};
    let (key, value) = limpet_trainer::device::CUBLAS_WORKSPACE;
    if std::env::var_os("LIMPET_KERNELS_CHILD").is_some() {
        assert!(!reproducible_kernels_on(), "on before anyone asked");
        let e = reproducible_kernels().unwrap_err().to_string();
        assert!(e.contains(&format!("start the process with {key}={value}")), "{e}");
        assert!(!reproducible_kernels_on(), "refused, yet on");
        set_reproducible_kernels(true).unwrap();
        assert!(reproducible_kernels_on());
        set_reproducible_kernels(false).unwrap();
        assert!(!reproducible_kernels_on());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["reproducible_kernels_are_chosen_for_the_whole_process", "--exact", "--nocapture"])
        .env("LIMPET_KERNELS_CHILD", "1")
        .env_remove(key)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "the child process: {text}");
}

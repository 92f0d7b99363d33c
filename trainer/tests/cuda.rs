//! The device paths on a real GPU. These machines have none, so the tests are `#[ignore]`d
//! and `make gpu-test` runs them where libtorch sees CUDA (and says it skipped them where
//! not). The same code runs on the CPU in every other test.

use limpet_trainer::data::tokens::write_dataset;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::device::Device;
use limpet_trainer::model::Precision;
use limpet_trainer::{JobSpec, ModelKind, NoReduce, Trainer};

fn data(dir: &std::path::Path) -> Dataset {
    let ids: Vec<u32> = (0..20_000u32).map(|i| (i * 7919 + i / 5) % 97).collect();
    write_dataset(dir, &ids, &[], 97, 1 << 20).unwrap();
    Dataset::load(&DataSpec::Tokens { context: 32 }, Some(dir)).unwrap()
}

fn trained(device: Device, precision: Precision, steps: u64) -> Trainer {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut job = JobSpec::defaults_for(ModelKind::Llama, &d).unwrap();
    job.steps = steps;
    job.schedule.warmup_steps = 1;
    job.precision = precision;
    let blocks = 0..job.model.num_blocks();
    let mut t = Trainer::on_device(job, d, blocks, device).unwrap();
    for _ in 0..steps {
        t.train_step(0, 1, &mut NoReduce).unwrap();
    }
    t
}

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

#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn training_on_cuda_matches_the_cpu_and_images_move_between_them() {
    let gpu = trained(Device::Cuda(0), Precision::Fp32, 20);
    let cpu = trained(Device::Cpu, Precision::Fp32, 20);
    let diff = max_rel(&gpu, &cpu);
    assert!(diff < 1e-3, "cuda and cpu parameters differ by {diff:e}");
    // An image taken on the GPU loads on the CPU with the same content hash.
    let img = gpu.image().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut back =
        Trainer::on_device(gpu.job().clone(), data(dir.path()), 0..gpu.job().model.num_blocks(), Device::Cpu)
            .unwrap();
    back.load_image(&img).unwrap();
    assert_eq!(back.content_hash().unwrap(), gpu.content_hash().unwrap());
}

#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn bf16_on_cuda_trains_close_to_f32() {
    let bf16 = trained(Device::Cuda(0), Precision::Bf16, 20);
    let f32 = trained(Device::Cuda(0), Precision::Fp32, 20);
    let (a, b) = (bf16.evaluate().unwrap().loss, f32.evaluate().unwrap().loss);
    assert!((a - b).abs() < 0.05 * b, "bf16 test loss {a} vs f32 {b}");
}

/// A host's GPUs as local ranks (every GPU libtorch sees, at least two): the host's sum
/// through host memory (`LocalGroup`), each rank on its own thread and device; every rank
/// holds the same bits after the steps, close to one CPU process of the same job.
#[test]
#[ignore = "needs two CUDA devices: make gpu-test"]
fn local_ranks_on_every_gpu_train_as_one_process() {
    let gpus = limpet_trainer::device::gpu_count();
    assert!(gpus >= 2, "this test needs two GPUs, libtorch sees {gpus}");
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut job = JobSpec::defaults_for(ModelKind::Llama, &d).unwrap();
    job.steps = 10;
    job.schedule.warmup_steps = 1;
    let blocks = 0..job.model.num_blocks();
    let mut ranks: Vec<Trainer> = (0..gpus)
        .map(|g| Trainer::on_device(job.clone(), d.shallow_clone(), blocks.clone(), Device::Cuda(g)).unwrap())
        .collect();
    for _ in 0..job.steps {
        let group = limpet_trainer::LocalGroup::new(gpus);
        std::thread::scope(|s| {
            for (i, t) in ranks.iter_mut().enumerate() {
                let group = &group;
                s.spawn(move || {
                    let mut alone = NoReduce;
                    let inter: Option<&mut (dyn limpet_trainer::Reduce + Send)> =
                        if i == 0 { Some(&mut alone) } else { None };
                    t.train_step(i, gpus, &mut group.rank(i, inter)).unwrap();
                });
            }
        });
    }
    let first = ranks[0].content_hash().unwrap();
    assert!(ranks.iter().all(|t| t.content_hash().unwrap() == first), "local ranks differ");
    let cpu = trained(Device::Cpu, Precision::Fp32, job.steps);
    let diff = max_rel(&ranks[0], &cpu);
    assert!(diff < 1e-3, "local ranks on GPUs and one CPU process differ by {diff:e}");
}

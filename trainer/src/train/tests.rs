//! The trainer's contract: it learns, its state round-trips bit-exactly, resuming equals not
//! stopping, micro-batching and splitting across ranks do not change the update.

use super::grads::Bind;
use super::*;
use crate::data::{DataSpec, Dataset};
use crate::optim::OptimizerSpec;
use crate::{ModelKind, RunOptions};
use proptest::prelude::*;

pub(super) fn synthetic() -> Dataset {
    Dataset::load(&DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 5 }, None).unwrap()
}

pub(super) fn job(kind: ModelKind, data: &Dataset, batch: usize, micro: usize) -> JobSpec {
    let mut j = JobSpec::defaults_for(kind, data).unwrap();
    j.global_batch = batch;
    j.micro_batch = micro;
    j.steps = 40;
    j.schedule.warmup_steps = 4;
    j
}

pub(super) fn char_data() -> Dataset {
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(60);
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    Dataset::load(&DataSpec::Chars { context: 16 }, Some(f.path())).unwrap()
}

fn params_of(t: &Trainer) -> Vec<Tensor> {
    t.model().params().iter().map(|(_, p)| p.detach().copy()).collect()
}

#[test]
fn mlp_learns_digits_past_95_percent() {
    let data = Dataset::load(&DataSpec::Digits, None).expect("digits installed by setup");
    let mut t = Trainer::try_new(JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap(), data).unwrap();
    let first = t.train_step(0, 1, &mut NoReduce).unwrap().loss;
    let dir = tempfile::tempdir().unwrap();
    let opts = RunOptions { out: dir.path().into(), stop_at: None, checkpoint_every: None, eval_every: None };
    let report = crate::run_local(&mut t, &opts, |_| {}).unwrap();
    assert!(report.train_loss.unwrap() < first / 5.0, "loss {first} -> {:?}", report.train_loss);
    assert!(report.test_accuracy >= 0.95, "test accuracy {}", report.test_accuracy);
}

#[test]
fn gpt_loss_falls_on_repetitive_text() {
    let data = char_data();
    let mut t = Trainer::try_new(job(ModelKind::Gpt, &data, 16, 16), data).unwrap();
    let first = t.train_step(0, 1, &mut NoReduce).unwrap().loss;
    let mut last = first;
    for _ in 1..40 {
        last = t.train_step(0, 1, &mut NoReduce).unwrap().loss;
    }
    assert!(last < first * 0.6, "gpt loss {first} -> {last}");
}

#[test]
fn image_round_trips_bit_exactly() {
    let data = synthetic();
    let mut a = Trainer::try_new(job(ModelKind::Mlp, &data, 32, 32), data).unwrap();
    for _ in 0..5 {
        a.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let img = a.image().unwrap();
    let decoded = StateImage::decode(&img.encode().unwrap()).unwrap();
    let b = Trainer::from_image(&decoded, synthetic(), Some(a.job())).unwrap();
    assert_eq!(b.step(), 5);
    assert_eq!(b.content_hash().unwrap(), img.content_hash());
    for (pa, pb) in params_of(&a).iter().zip(params_of(&b)) {
        assert!(pa.equal(&pb));
    }
}

/// A state file written from the trainer's tensors is the file its image writes, byte for
/// byte: fresh (the moments unwritten zeros), after steps, and a reproducible job's with its
/// exponents; a sharded trainer is refused.
#[test]
fn the_state_file_from_the_tensors_is_the_image_s_file() {
    let data = char_data();
    for reproducible in [false, true] {
        let mut j = job(ModelKind::Gpt, &data, 8, 8);
        j.reproducible = reproducible;
        let mut t = Trainer::try_new(j, data.shallow_clone()).unwrap();
        for steps in [0, 3] {
            for _ in 0..steps {
                t.train_step(0, 1, &mut NoReduce).unwrap();
            }
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = (dir.path().join("image"), dir.path().join("tensors"));
            let img = t.image().unwrap();
            limpet_snapshot::write_image_atomic(&a, &img).unwrap();
            assert_eq!(t.write_state_file(&b).unwrap(), img.content_hash());
            assert_eq!(t.content_hash().unwrap(), img.content_hash());
            assert_eq!(
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap(),
                "reproducible {reproducible}, step {}",
                t.step()
            );
            assert_eq!(reproducible && steps > 0, img.tensors().contains_key(super::exact::EXPONENTS));
        }
    }
    let mut t = Trainer::try_new(job(ModelKind::Mlp, &synthetic(), 8, 8), synthetic()).unwrap();
    t.shard_state(super::shard::ShardLayout::new(t.grads.grads_len(), 1, 0, 0).unwrap()).unwrap();
    let e = t.write_state_file(&tempfile::tempdir().unwrap().path().join("x")).unwrap_err();
    assert!(e.to_string().contains("sharded"), "{e}");
}

/// The optimizer state a rank counts as held: all of AdamW's two slots unsharded; sharded,
/// its own block's and its replica's (at world 4 with one replica, about half), counted from
/// the layout, not from the trainer's tensors.
#[test]
fn a_sharded_rank_counts_the_optimizer_state_of_its_blocks() {
    let mut j = job(ModelKind::Mlp, &synthetic(), 8, 8);
    j.optimizer = OptimizerSpec::adamw(1e-2, 0.01);
    let mut t = Trainer::try_new(j, synthetic()).unwrap();
    let n: usize = t.model().params().iter().map(|(_, p)| p.numel()).sum();
    let whole = (2 * 4 * n) as u64;
    assert_eq!(t.optim_state_bytes(), (whole, whole));
    let layout = super::shard::ShardLayout::new(n, 4, 1, 1).unwrap();
    let values: usize = [0, 1].iter().map(|&b| layout.blocks()[b].len()).sum();
    t.shard_state(layout).unwrap();
    assert_eq!(t.optim_state_bytes(), ((2 * 4 * values) as u64, whole));
    assert!(values.abs_diff(n / 2) <= 32, "{values} of {n} values held");
}

/// Stopping, saving, loading and going on gives the same bits as never stopping, for each
/// model family and optimizer, with micro-batching and (for the transformer) dropout.
#[test]
fn resumed_training_equals_uninterrupted() {
    let cases: Vec<(ModelKind, Dataset, OptimizerSpec, usize)> = vec![
        (ModelKind::Mlp, synthetic(), OptimizerSpec::adamw(1e-2, 0.01), 8),
        (ModelKind::Mlp, synthetic(), OptimizerSpec::sgd(0.05, 1e-4), 32),
        (ModelKind::Gpt, char_data(), OptimizerSpec::adamw(3e-3, 0.01), 4),
    ];
    for (kind, data, opt, micro) in cases {
        let mut j = job(kind, &data, 16, micro);
        j.optimizer = opt;
        if let crate::model::ModelSpec::Gpt { dropout, .. } = &mut j.model {
            *dropout = 0.1;
        }
        let fresh = |d: Dataset| Trainer::try_new(j.clone(), d).unwrap();
        let data2 = clone_data(&data);
        let data3 = clone_data(&data);
        let mut straight = fresh(data);
        for _ in 0..12 {
            straight.train_step(0, 1, &mut NoReduce).unwrap();
        }
        let mut first = fresh(data2);
        for _ in 0..5 {
            first.train_step(0, 1, &mut NoReduce).unwrap();
        }
        let bytes = first.image().unwrap().encode().unwrap();
        drop(first);
        let mut resumed = Trainer::from_image(&StateImage::decode(&bytes).unwrap(), data3, None).unwrap();
        for _ in 5..12 {
            resumed.train_step(0, 1, &mut NoReduce).unwrap();
        }
        assert_eq!(resumed.content_hash().unwrap(), straight.content_hash().unwrap(), "{kind:?}");
    }
}

/// Loads the same dataset again (datasets hold libtorch tensors and are not `Clone`).
fn clone_data(d: &Dataset) -> Dataset {
    match &d.spec {
        DataSpec::Chars { .. } => char_data(),
        spec => Dataset::load(spec, None).unwrap(),
    }
}

/// Two ranks that each compute half the batch and sum their buffers end with the same
/// parameters as each other (bit for bit) and as one rank on the whole batch (up to float
/// summation order: relative 1e-4, absolute 1e-6 after 10 steps).
#[test]
fn two_ranks_match_one() {
    let data = synthetic();
    let j = job(ModelKind::Mlp, &data, 30, 30);
    let mut one = Trainer::try_new(j.clone(), data).unwrap();
    let mut r0 = Trainer::try_new(j.clone(), synthetic()).unwrap();
    let mut r1 = Trainer::try_new(j, synthetic()).unwrap();
    for _ in 0..10 {
        one.train_step(0, 1, &mut NoReduce).unwrap();
        let mut a = r0.compute_grads(0, 2).unwrap().to_vec();
        let b = r1.compute_grads(1, 2).unwrap();
        a.iter_mut().zip(b.iter()).for_each(|(x, y)| *x += y);
        r0.apply_update(&a).unwrap();
        r1.apply_update(&a).unwrap();
    }
    assert_eq!(r0.content_hash().unwrap(), r1.content_hash().unwrap());
    for (p1, p0) in params_of(&one).iter().zip(params_of(&r0)) {
        assert!(p1.allclose(&p0, 1e-4, 1e-6, false), "max diff {}", (p1 - &p0).abs().max().double_value(&[]));
    }
}

/// A rank whose group broke after its peer applied a step, and before it did, finishes the
/// step alone (the whole batch, from its own state): a reproducible job ends with the
/// peer's bits, any other job with the peer's values to rounding (what the entry checks
/// before it takes the peer's state).
#[test]
fn a_step_finished_alone_is_the_groups_step() {
    for reproducible in [false, true] {
        let data = synthetic();
        // Micro-batches smaller than a rank's share: each share is cut as its rank cut it.
        let mut j = job(ModelKind::Mlp, &data, 30, 10);
        j.reproducible = reproducible;
        let mut ranks: Vec<Trainer> =
            (0..2).map(|_| Trainer::try_new(j.clone(), synthetic()).unwrap()).collect();
        let mut behind = None;
        for step in 0..4 {
            if step == 3 {
                behind = Some(ranks[1].image().unwrap());
            }
            // A group a step: a rank's handle leaving ends the group's step.
            let group = LocalGroup::new(2);
            std::thread::scope(|s| {
                for (r, t) in ranks.iter_mut().enumerate() {
                    let group = &group;
                    s.spawn(move || {
                        let mut reduce = group.rank(r, None);
                        match reproducible {
                            true => t.exact_step(r, 2, &mut reduce),
                            false => t.train_step(r, 2, &mut reduce),
                        }
                        .unwrap();
                    });
                }
            });
        }
        let mut alone = Trainer::try_new(j, synthetic()).unwrap();
        alone.load_image(&behind.unwrap()).unwrap();
        assert_eq!(alone.step(), 3);
        alone.finish_step_alone(2).unwrap();
        assert_eq!((alone.step(), alone.cursor), (4, ranks[0].cursor));
        if reproducible {
            assert_eq!(alone.content_hash().unwrap(), ranks[0].content_hash().unwrap());
        } else {
            for (p, q) in params_of(&alone).iter().zip(params_of(&ranks[0])) {
                assert!(
                    p.allclose(&q, 1e-4, 1e-6, false),
                    "max diff {}",
                    (p - &q).abs().max().double_value(&[])
                );
            }
        }
    }
}

#[test]
fn a_missing_share_is_detected() {
    let data = synthetic();
    let mut r0 = Trainer::try_new(job(ModelKind::Mlp, &data, 30, 30), data).unwrap();
    r0.compute_grads(0, 2).unwrap();
    let err = r0.apply_reduced().unwrap_err().to_string();
    assert!(err.contains("is not the global batch 30"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Accumulating k micro-batches gives the gradient of the whole share, within relative
    /// 1e-5 of the largest gradient (float summation order differs).
    #[test]
    fn micro_batches_accumulate_to_the_batch_gradient(batch in 1usize..48, micro in 1usize..48, step in 0u64..30) {
        let data = synthetic();
        let mut whole = Trainer::try_new(job(ModelKind::Mlp, &data, batch, batch), data).unwrap();
        let mut parts = Trainer::try_new(job(ModelKind::Mlp, &synthetic(), batch, micro), synthetic()).unwrap();
        whole.step = step;
        parts.step = step;
        let a = whole.compute_grads(0, 1).unwrap().to_vec();
        let b = parts.compute_grads(0, 1).unwrap().to_vec();
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            prop_assert!((x - y).abs() <= 1e-5 * scale, "element {}: {} vs {}", i, x, y);
        }
    }
}

#[test]
fn mismatched_images_name_what_differs() {
    let data = synthetic();
    let mut j = job(ModelKind::Mlp, &data, 16, 16);
    let t = Trainer::try_new(j.clone(), data).unwrap();
    let img = t.image().unwrap();

    // Every rank of an epoch evaluates at the same steps: another rate is another job.
    let mut other_rate = j.clone();
    other_rate.eval_every = Some(7);
    let err = Trainer::from_image(&img, synthetic(), Some(&other_rate)).unwrap_err().to_string();
    assert!(err.contains("eval_every"), "{err}");

    j.optimizer.set_lr(0.5);
    let err = Trainer::from_image(&img, synthetic(), Some(&j)).unwrap_err().to_string();
    assert!(err.contains("optimizer.lr"), "{err}");

    let other = Dataset::load(&DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 6 }, None)
        .unwrap();
    let err = Trainer::from_image(&img, other, None).unwrap_err().to_string();
    assert!(err.contains("fingerprint"), "{err}");

    let mut tensors = img.tensors().clone();
    let name = tensors.keys().find(|k| k.starts_with("param/")).unwrap().clone();
    tensors.insert(name.clone(), RawTensor::from_f32(&name, vec![1], &[0.0]).unwrap());
    let meta = img.meta();
    let bad = StateImage::new(meta.step, meta.cursor, meta.rng, meta.job.clone(), tensors.clone());
    let err = Trainer::from_image(&bad, synthetic(), None).unwrap_err().to_string();
    assert!(err.contains(&format!("tensor '{name}' is F32 [1]")), "{err}");

    tensors.remove(&name);
    let bad = StateImage::new(meta.step, meta.cursor, meta.rng, meta.job.clone(), tensors);
    let err = Trainer::from_image(&bad, synthetic(), None).unwrap_err().to_string();
    assert!(err.contains(&format!("tensor '{name}' is missing")), "{err}");

    let bad = StateImage::new(3, 2, meta.rng, meta.job.clone(), img.tensors().clone());
    let err = Trainer::from_image(&bad, synthetic(), None).unwrap_err().to_string();
    assert!(err.contains("field 'cursor' is 2"), "{err}");
}

/// The CPU path (gradients are views of the buffer: backward writes into it) and the device
/// path (gradients gathered and copied into it once) fill the same buffer; the views
/// accumulate over backward passes and zero in place.
#[test]
fn bound_and_collected_gradient_buffers_agree() {
    let params = || {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]).set_requires_grad(true);
        let b = Tensor::from_slice(&[5.0f32, 6.0]).set_requires_grad(true);
        let c = Tensor::from_slice(&[7.0f32]).set_requires_grad(true);
        vec![("a".to_string(), a), ("b".to_string(), b), ("c".to_string(), c)]
    };
    let backward = |p: &[(String, Tensor)]| {
        ((&p[0].1 * 2.0).sum(Kind::Float) + (&p[1].1 * &p[1].1).sum(Kind::Float)).backward();
    };
    let want = [2.0, 2.0, 2.0, 2.0, 10.0, 12.0, 0.0];
    let (bp, cp) = (params(), params());
    let sp = params();
    let mut bound = super::grads::GradBuffer::with_binding(&bp, Bind::Views).unwrap();
    let mut collected = super::grads::GradBuffer::with_binding(&cp, Bind::Copied).unwrap();
    let mut staged = super::grads::GradBuffer::with_binding(&sp, Bind::Staged(tch::Device::Cpu)).unwrap();
    assert!(bound.as_mut_slice().iter().all(|&v| v == 0.0));
    backward(&bp);
    backward(&cp);
    backward(&sp);
    // Staged: nothing reaches the host buffer until it is collected, then all at once.
    assert!(staged.as_mut_slice().iter().all(|&v| v == 0.0));
    collected.collect(&cp, false).unwrap();
    staged.collect(&sp, false).unwrap();
    assert_eq!(bound.as_mut_slice()[..7], want);
    assert_eq!(collected.as_mut_slice()[..7], want);
    assert_eq!(staged.as_mut_slice()[..7], want);
    // A bucket's range alone crosses, and only it.
    staged.zero(&sp, false).unwrap();
    backward(&sp);
    staged.collect_range(&sp, &(4..6), false).unwrap().wait().unwrap();
    assert_eq!(staged.as_mut_slice()[..7], [0.0, 0.0, 0.0, 0.0, 10.0, 12.0, 0.0]);
    // What the update reads goes back to the device's buffer, which the gradients view.
    staged.as_mut_slice()[4] = 5.0;
    let g = staged.grads().unwrap();
    assert_eq!(g.double_value(&[4]), 5.0);
    assert_eq!(sp[1].1.grad().double_value(&[0]), 5.0);
    backward(&bp);
    let twice: Vec<f32> = want.iter().map(|v| v * 2.0).collect();
    assert_eq!(bound.as_mut_slice()[..7], twice[..]);
    bound.zero(&bp, false).unwrap();
    backward(&bp);
    assert_eq!(bound.as_mut_slice()[..7], want);
    // The gradient tensor the optimizer reads is the buffer itself.
    let g = bound.grads().unwrap();
    bound.as_mut_slice()[0] = 42.0;
    assert_eq!(g.double_value(&[0]), 42.0);
}

/// Activation checkpointing changes no bit of the update (also in a reproducible job, whose
/// content hash stays the same); a chunked loss rounds differently and nothing more.
#[test]
fn memory_plans_compute_the_same_update() {
    let data = char_data();
    let run = |edit: &dyn Fn(&mut JobSpec)| {
        let mut j = job(ModelKind::Llama, &data, 8, 4);
        edit(&mut j);
        let mut t = Trainer::try_new(j, clone_data(&data)).unwrap();
        let mut losses: Vec<f64> = (0..3).map(|_| t.train_step(0, 1, &mut NoReduce).unwrap().loss).collect();
        // The held-out loss last: a chunked loss evaluates a chunk at a time too.
        losses.push(t.evaluate().unwrap().loss);
        (losses, params_of(&t), t.content_hash().unwrap())
    };
    let (losses, params, _) = run(&|_| {});
    let (l, p, _) = run(&|j| j.activation_checkpointing = true);
    assert_eq!(l, losses, "checkpointing changed the loss");
    assert!(p.iter().zip(&params).all(|(a, b)| a.equal(b)), "checkpointing changed the parameters");
    for (edit, what) in [
        (&(|j: &mut JobSpec| j.loss_chunk = Some(5)) as &dyn Fn(&mut JobSpec), "a chunked loss"),
        (
            &|j: &mut JobSpec| {
                j.loss_chunk = Some(7);
                j.activation_checkpointing = true;
            },
            "both",
        ),
    ] {
        let (l, p, _) = run(edit);
        for (a, b) in l.iter().zip(&losses) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: loss {a} vs {b}");
        }
        for (a, b) in p.iter().zip(&params) {
            assert!(a.allclose(b, 1e-4, 1e-6, false), "{what}: parameters moved apart");
        }
        assert!(p.iter().zip(&params).any(|(a, b)| !a.equal(b)) || what == "both", "{what}: not exercised");
    }
    // A reproducible job: the same bits with checkpointing as without (the content hash
    // covers the job too, which names the setting, so the parameters are compared).
    let (l, plain, _) = run(&|j| j.reproducible = true);
    let (lc, checkpointed, _) = run(&|j| {
        j.reproducible = true;
        j.activation_checkpointing = true;
    });
    assert_eq!(l, lc, "checkpointing changed a reproducible job's losses");
    assert!(
        plain.iter().zip(&checkpointed).all(|(a, b)| a.equal(b)),
        "checkpointing changed a reproducible job's parameters"
    );
    // Only for the LLaMA.
    let mut j = job(ModelKind::Gpt, &data, 8, 4);
    j.activation_checkpointing = true;
    let e = Trainer::try_new(j, clone_data(&data)).unwrap_err().to_string();
    assert!(e.contains("activation_checkpointing applies to model llama"), "{e}");
}

/// The device paths train the bits of the CPU path, where gradients are views of the host
/// buffer: gradients copied in parameter by parameter (the update taking each parameter's
/// part back), and gradients staged through a flat buffer of the device's (one copy each way,
/// the update reading the device's buffer): what a GPU host runs, on the CPU. The staged way
/// also over local ranks and with the reduction overlapping backward.
#[test]
fn the_device_paths_train_the_bits_of_the_bound_buffer() {
    let data = synthetic();
    let j = job(ModelKind::Mlp, &data, 24, 8);
    let mut bound = Trainer::try_new(j.clone(), data.shallow_clone()).unwrap();
    let mut copied = Trainer::try_new(j.clone(), data.shallow_clone()).unwrap();
    copied.grads = super::grads::GradBuffer::with_binding(copied.model.params(), Bind::Copied).unwrap();
    let mut staged = Trainer::try_new(j, data).unwrap();
    staged.grads =
        super::grads::GradBuffer::with_binding(staged.model.params(), Bind::Staged(tch::Device::Cpu))
            .unwrap();
    assert!(bound.grads.is_bound() && !copied.grads.is_bound() && !staged.grads.is_bound());
    for _ in 0..3 {
        let a = bound.train_step(0, 1, &mut NoReduce).unwrap();
        let b = copied.train_step(0, 1, &mut NoReduce).unwrap();
        let c = staged.train_step(0, 1, &mut NoReduce).unwrap();
        assert_eq!((a.loss.to_bits(), a.loss.to_bits()), (b.loss.to_bits(), c.loss.to_bits()));
    }
    assert_eq!(bound.content_hash().unwrap(), copied.content_hash().unwrap());
    assert_eq!(bound.content_hash().unwrap(), staged.content_hash().unwrap());
}

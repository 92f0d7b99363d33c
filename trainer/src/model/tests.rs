//! Model construction, block ranges and initialization.

use super::*;
use crate::data::DataInfo;
use crate::ModelKind;

fn specs() -> Vec<(ModelSpec, Tensor)> {
    let img = DataInfo::Classify { features: 64, classes: 10, image: Some((8, 8)) };
    let chars = DataInfo::Tokens { vocab: 30, context: 16 };
    let x = Tensor::rand([5, 64], (Kind::Float, Device::Cpu));
    let tok = Tensor::randint(30, [5, 16], (Kind::Int64, Device::Cpu));
    vec![
        (ModelSpec::for_data(ModelKind::Mlp, &img).unwrap(), x.shallow_clone()),
        (ModelSpec::for_data(ModelKind::Convnet, &img).unwrap(), x),
        (ModelSpec::for_data(ModelKind::Gpt, &chars).unwrap(), tok.shallow_clone()),
        (ModelSpec::for_data(ModelKind::Llama, &chars).unwrap(), tok),
    ]
}

#[test]
fn output_shapes() {
    for (spec, x) in specs() {
        let m = Model::new(&spec, 1).unwrap();
        let y = m.forward_t(&x, false);
        let want: Vec<i64> = if spec.is_sequence() { vec![5, 16, 30] } else { vec![5, 10] };
        assert_eq!(y.size(), want, "{spec:?}");
    }
}

#[test]
fn stages_compose_to_the_whole_model() {
    for (spec, x) in specs() {
        let whole = Model::new(&spec, 7).unwrap();
        let n = spec.num_blocks();
        for cut in 1..n {
            let a = Model::with_blocks(&spec, 0..cut, 7).unwrap();
            let b = Model::with_blocks(&spec, cut..n, 7).unwrap();
            let staged = b.forward_t(&a.forward_t(&x, false), false);
            assert!(staged.equal(&whole.forward_t(&x, false)), "{spec:?} cut at {cut}");
            assert_eq!(a.params().len() + b.params().len(), whole.params().len());
        }
    }
}

#[test]
fn init_depends_on_seed_only() {
    for (spec, _) in specs() {
        let (a, b, c) =
            (Model::new(&spec, 3).unwrap(), Model::new(&spec, 3).unwrap(), Model::new(&spec, 4).unwrap());
        for ((na, ta), ((_, tb), (_, tc))) in a.params().iter().zip(b.params().iter().zip(c.params())) {
            assert!(ta.equal(tb), "{na}");
            if na.ends_with("weight") && ta.dim() >= 2 {
                assert!(!ta.equal(tc), "{na} ignores the seed");
            }
        }
    }
}

#[test]
fn wrong_data_is_refused_with_a_reason() {
    let chars = DataInfo::Tokens { vocab: 30, context: 16 };
    let flat = DataInfo::Classify { features: 5, classes: 3, image: None };
    let e = ModelSpec::for_data(ModelKind::Gpt, &flat).unwrap_err().to_string();
    assert!(e.contains("needs token sequences"), "{e}");
    let e = ModelSpec::for_data(ModelKind::Convnet, &flat).unwrap_err().to_string();
    assert!(e.contains("needs image data"), "{e}");
    let e = ModelSpec::for_data(ModelKind::Mlp, &chars).unwrap_err().to_string();
    assert!(e.contains("needs model 'gpt' or 'llama'"), "{e}");
    let e = Model::with_blocks(&ModelSpec::for_data(ModelKind::Gpt, &chars).unwrap(), 2..9, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not within the model's 4 blocks"), "{e}");
}

#[test]
fn dropout_is_real_and_follows_its_seed() {
    let chars = DataInfo::Tokens { vocab: 30, context: 16 };
    let mut spec = ModelSpec::for_data(ModelKind::Gpt, &chars).unwrap();
    if let ModelSpec::Gpt { dropout, .. } = &mut spec {
        *dropout = 0.3;
    }
    let m = Model::new(&spec, 1).unwrap();
    assert!(m.is_stochastic());
    let x = Tensor::randint(30, [2, 16], (Kind::Int64, Device::Cpu));
    m.seed_dropout(5);
    let a = m.forward_t(&x, true);
    m.seed_dropout(5);
    let b = m.forward_t(&x, true);
    let c = m.forward_t(&x, true);
    assert!(a.equal(&b), "same seed, different masks");
    assert!(!a.equal(&c), "masks do not change between draws");
    assert!(!a.equal(&m.forward_t(&x, false)), "dropout had no effect in training mode");
}

fn tiny_llama(kv_heads: usize, tie: bool) -> ModelSpec {
    let mut l = LlamaSpec::preset("tiny", 30, 16).unwrap();
    l.kv_heads = kv_heads;
    l.tie_embeddings = tie;
    ModelSpec::Llama(l)
}

#[test]
fn llama_is_causal() {
    let m = Model::new(&tiny_llama(2, false), 5).unwrap();
    let a = Tensor::randint(30, [2, 16], (Kind::Int64, Device::Cpu));
    let b = a.copy();
    let _ = b.narrow(1, 10, 6).fill_(3);
    let (ya, yb) = (m.forward_t(&a, false), m.forward_t(&b, false));
    assert!(ya.narrow(1, 0, 10).allclose(&yb.narrow(1, 0, 10), 1e-6, 1e-6, false), "the past saw the future");
    assert!(!ya.narrow(1, 10, 6).allclose(&yb.narrow(1, 10, 6), 1e-6, 1e-6, false));
}

/// Grouped-query attention equals full multi-head attention whose key and value heads are
/// the shared ones repeated (query head j reads kv head j / (heads / kv_heads)).
#[test]
fn grouped_query_attention_shares_kv_heads() {
    let gqa = Model::new(&tiny_llama(2, false), 9).unwrap();
    let mha = Model::new(&tiny_llama(4, false), 9).unwrap();
    let src: BTreeMap<String, Tensor> = gqa.params().iter().map(|(n, t)| (n.clone(), t.detach())).collect();
    let mut weights: BTreeMap<String, Tensor> =
        src.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    for (name, t) in &src {
        if name.ends_with("wk.weight") || name.ends_with("wv.weight") {
            // [kv * hd, d] -> [kv, hd, d] -> each kv head twice -> [heads * hd, d]
            let (rows, d) = t.size2().unwrap();
            let hd = rows / 2;
            weights.insert(
                name.clone(),
                t.view([2, hd, d]).repeat_interleave_self_int(2, 0, None).view([4 * hd, d]),
            );
        }
    }
    mha.load_named(&weights).unwrap();
    let x = Tensor::randint(30, [3, 16], (Kind::Int64, Device::Cpu));
    let (a, b) = (gqa.forward_t(&x, false), mha.forward_t(&x, false));
    assert!(a.allclose(&b, 1e-5, 1e-5, false), "max diff {}", (a - b).abs().max().double_value(&[]));
}

#[test]
fn tied_embeddings_share_one_tensor_and_stay_in_one_stage() {
    let tied = Model::new(&tiny_llama(2, true), 1).unwrap();
    let untied = Model::new(&tiny_llama(2, false), 1).unwrap();
    assert_eq!(untied.num_elements() - tied.num_elements(), 30 * 64);
    let ModelSpec::Llama(l) = tied.spec() else { unreachable!() };
    assert_eq!(l.num_params() as usize, tied.num_elements());
    let n = tied.spec().num_blocks();
    let err = Model::with_blocks(tied.spec(), 2..n, 1).unwrap_err().to_string();
    assert!(err.contains("tie_embeddings"), "{err}");
    assert!(Model::with_blocks(tied.spec(), 0..2, 1).is_ok(), "a stage without the head is fine");
}

#[test]
fn bf16_computes_close_to_f32_with_f32_parameters() {
    let spec = tiny_llama(2, false);
    let f32m = Model::build(&spec, 0..spec.num_blocks(), 4, Device::Cpu, Precision::Fp32).unwrap();
    let bf16 = Model::build(&spec, 0..spec.num_blocks(), 4, Device::Cpu, Precision::Bf16).unwrap();
    let x = Tensor::randint(30, [2, 16], (Kind::Int64, Device::Cpu));
    let y = Tensor::randint(30, [2, 16], (Kind::Int64, Device::Cpu));
    let (a, b) = (f32m.forward_t(&x, true), bf16.forward_t(&x, true));
    assert_eq!(b.kind(), Kind::Float, "logits come back in f32");
    let (la, lb) = (f32m.loss_sum(&a, &y), bf16.loss_sum(&b, &y));
    let rel = ((la.double_value(&[]) - lb.double_value(&[])) / la.double_value(&[])).abs();
    assert!(rel < 2e-2, "bf16 loss {} vs f32 {}", lb.double_value(&[]), la.double_value(&[]));
    assert!(rel > 0.0, "bf16 computed exactly what f32 did: the cast is not applied");
    lb.backward();
    for (name, p) in bf16.params() {
        assert_eq!((p.kind(), p.grad().kind()), (Kind::Float, Kind::Float), "{name}");
    }
    let err = Model::build(&specs()[0].0, 0..3, 1, Device::Cpu, Precision::Bf16).unwrap_err().to_string();
    assert!(err.contains("bf16") && err.contains("llama"), "{err}");
}

#[test]
fn llama_sizes_are_checked_and_presets_have_their_size() {
    for (kv, want) in [(3, "kv_heads (3) must divide heads (4)"), (0, "kv_heads must be at least 1")] {
        let err = Model::new(&tiny_llama(kv, false), 1).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    let one_b = LlamaSpec::preset("1b", 128_256, 2048).unwrap();
    let b = one_b.num_params() as f64 / 1e9;
    assert!((1.0..1.6).contains(&b), "1b preset has {b:.2}B parameters");
    let err = LlamaSpec::preset("7b", 100, 16).unwrap_err().to_string();
    assert!(err.contains("tiny, small, 125m, 350m, 1b"), "{err}");
}

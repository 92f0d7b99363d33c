//! Model construction, block ranges and initialization.

use super::*;
use crate::data::DataInfo;

fn specs() -> Vec<(ModelSpec, Tensor)> {
    let img = DataInfo::Classify { features: 64, classes: 10, image: Some((8, 8)) };
    let chars = DataInfo::Chars { vocab: 30, context: 16 };
    let x = Tensor::rand([5, 64], (Kind::Float, Device::Cpu));
    let tok = Tensor::randint(30, [5, 16], (Kind::Int64, Device::Cpu));
    vec![
        (ModelSpec::for_data(ModelKind::Mlp, &img).unwrap(), x.shallow_clone()),
        (ModelSpec::for_data(ModelKind::Convnet, &img).unwrap(), x),
        (ModelSpec::for_data(ModelKind::Gpt, &chars).unwrap(), tok),
    ]
}

#[test]
fn output_shapes() {
    for (spec, x) in specs() {
        let m = Model::new(&spec, 1).unwrap();
        let y = m.forward_t(&x, false);
        let want: Vec<i64> =
            if matches!(spec, ModelSpec::Gpt { .. }) { vec![5, 16, 30] } else { vec![5, 10] };
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
    let chars = DataInfo::Chars { vocab: 30, context: 16 };
    let flat = DataInfo::Classify { features: 5, classes: 3, image: None };
    let e = ModelSpec::for_data(ModelKind::Gpt, &flat).unwrap_err().to_string();
    assert!(e.contains("needs a character corpus"), "{e}");
    let e = ModelSpec::for_data(ModelKind::Convnet, &flat).unwrap_err().to_string();
    assert!(e.contains("needs image data"), "{e}");
    let e = ModelSpec::for_data(ModelKind::Mlp, &chars).unwrap_err().to_string();
    assert!(e.contains("needs model 'gpt'"), "{e}");
    let e = Model::with_blocks(&ModelSpec::for_data(ModelKind::Gpt, &chars).unwrap(), 2..9, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not within the model's 4 blocks"), "{e}");
}

#[test]
fn dropout_is_real_and_follows_its_seed() {
    let chars = DataInfo::Chars { vocab: 30, context: 16 };
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

//! A stage's input from a peer: an activation of another shape than the model's fails the
//! step as the peer's fault, and never panics the trainer or sizes its allocations.

use super::super::tests::{char_data, job};
use crate::model::ModelSpec;
use crate::pipeline::{Activation, StageLink, StagePosition, StageReducers};
use crate::{ModelKind, NoReduce, Trainer, TrainerError};

/// The previous stage's side: sends activations of one shape (and takes gradients).
struct Sends(Vec<i64>);

impl StageLink for Sends {
    fn send_activation(&mut self, _: u64, _: usize, _: &Activation) -> Result<(), TrainerError> {
        Ok(())
    }
    fn recv_activation(&mut self, _: u64, _: usize) -> Result<Activation, TrainerError> {
        let n: i64 = self.0.iter().product();
        Ok(Activation { shape: self.0.clone(), values: vec![0.1; n as usize] })
    }
    fn send_gradient(&mut self, _: u64, _: usize, _: &Activation) -> Result<(), TrainerError> {
        Ok(())
    }
    fn recv_gradient(&mut self, _: u64, _: usize) -> Result<Activation, TrainerError> {
        Err(TrainerError::Config("the last stage receives no gradient".into()))
    }
}

fn step(t: &mut Trainer, shape: &[i64]) -> Result<(), TrainerError> {
    let pos = StagePosition { stage: 1, stages: 2, replica: 0, replicas: 1 };
    let (mut replicas, mut stages) = (NoReduce, NoReduce);
    let reduce = StageReducers { replicas: &mut replicas, stages: &mut stages };
    t.pipeline_step(pos, &mut Sends(shape.to_vec()), reduce).map(|_| ())
}

#[test]
fn an_activation_of_another_window_or_width_fails_the_step() {
    // Windows of 16 characters, micro-batches of 2.
    let data = char_data();
    let j = job(ModelKind::Gpt, &data, 4, 2);
    let ModelSpec::Gpt { width, .. } = j.model else { unreachable!("a GPT job") };
    let w = width as i64;
    let nb = j.model.num_blocks();
    let mut t = Trainer::on_device(j, data, 1..nb, tch::Device::Cpu).unwrap();
    // A shorter window reached the loss with fewer positions than targets (a panic); a longer
    // one sized attention by the peer's number; another width fails in the blocks.
    for shape in [vec![2, 15, w], vec![2, 4096, w], vec![2, 16, w + 1], vec![2, 16, w, 1]] {
        let e = step(&mut t, &shape).unwrap_err();
        assert!(matches!(e, TrainerError::Reduce { .. }), "{shape:?}: {e:?}");
        assert!(e.to_string().contains(&format!("(expected [2, 16, {w}])")), "{shape:?}: {e}");
        assert_eq!(t.step(), 0, "{shape:?}");
    }
    // The model's own shape trains.
    step(&mut t, &[2, 16, w]).unwrap();
    assert_eq!(t.step(), 1);
}

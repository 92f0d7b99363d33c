//! TorchScript modules as limpet models: the escape hatch for any PyTorch module.
//!
//! A job names its module by content (the blake3 of the `.pt` file), never by path: hosts
//! keep their copy wherever they like, and a state image can only be loaded into the module
//! it was trained from. Each host says where its copy is with [`register`] before building
//! the model; building reads the file once, checks it against the hash and loads it from
//! those same bytes (so the file cannot change between the check and the load).
//!
//! The module's own parameters (as it was saved) are the initial weights: limpet does not
//! draw them from the seed, so a module scripted in Python starts from exactly what Python
//! had. It is one block: TorchScript graphs cannot be cut into pipeline stages.

use crate::TrainerError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tch::nn::{self, ModuleT};
use tch::{IValue, Tensor};

/// What a TorchScript model minimizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScriptLoss {
    /// `forward(x)` returns logits; softmax cross-entropy against class labels (or tokens).
    CrossEntropy,
    /// `forward(x)` returns predictions; mean squared error against float targets.
    Mse,
    /// `forward(x, y)` returns the loss of each sample (shape `[batch]`); limpet sums them.
    Module,
}

impl ScriptLoss {
    /// Parses `cross_entropy`, `mse` or `module`.
    pub fn parse(s: &str) -> Result<Self, crate::NotOneOf> {
        match s {
            "cross_entropy" => Ok(ScriptLoss::CrossEntropy),
            "mse" => Ok(ScriptLoss::Mse),
            "module" => Ok(ScriptLoss::Module),
            other => Err(crate::NotOneOf { got: other.into(), choices: "cross_entropy, mse, module" }),
        }
    }
}

/// A TorchScript model: which module (by content) and what it minimizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptSpec {
    /// blake3 of the TorchScript file.
    pub blake3: String,
    /// The loss.
    pub loss: ScriptLoss,
}

/// Where this host keeps each module it was told of, by content hash. Process-wide because a
/// spec (which travels between hosts and into images) holds only the hash.
static REGISTRY: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());

/// Reads a module file, checking that TorchScript's loader accepts it. Errors name the file.
fn read(path: &Path) -> Result<(Vec<u8>, String), TrainerError> {
    let bytes = std::fs::read(path).map_err(|e| TrainerError::Key {
        key: "[model].path".into(),
        detail: format!("{}: {e}", path.display()),
    })?;
    let hash = blake3::hash(&bytes).to_hex().to_string();
    Ok((bytes, hash))
}

/// Records that this host's copy of a module is at `path`, after checking that TorchScript
/// can load it; returns its content hash (what the job names).
pub fn register(path: &Path) -> Result<String, TrainerError> {
    let (bytes, hash) = read(path)?;
    tch::CModule::load_data(&mut bytes.as_slice()).map_err(|e| TrainerError::Key {
        key: "[model].path".into(),
        detail: format!(
            "{}: not a TorchScript module this libtorch can load: {}",
            path.display(),
            first_line(&e.to_string())
        ),
    })?;
    REGISTRY.lock().expect("module registry lock").insert(hash.clone(), path.to_path_buf());
    Ok(hash)
}

/// [`register`]s `path` as the copy of the module `spec` names; an error (naming the file and
/// both hashes) when the file is another module.
pub fn register_as(path: &Path, spec: &ScriptSpec) -> Result<(), TrainerError> {
    let hash = register(path)?;
    if hash != spec.blake3 {
        return Err(TrainerError::Mismatch(format!(
            "{} is not the job's TorchScript module (its blake3 is {hash}, the job's is {})",
            path.display(),
            spec.blake3
        )));
    }
    Ok(())
}

fn first_line(s: &str) -> &str {
    s.lines().find(|l| !l.trim().is_empty()).unwrap_or(s).trim()
}

/// A loaded module whose parameters are registered under `root` (as `b00.<name>`, the dots
/// of PyTorch's names replaced by `_`). The module keeps its own train/eval flag, switched
/// when a call asks for the other mode.
pub(crate) struct Scripted {
    module: Mutex<(tch::CModule, bool)>,
    loss: ScriptLoss,
}

impl std::fmt::Debug for Scripted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scripted").field("loss", &self.loss).finish()
    }
}

impl Scripted {
    /// Loads the module `spec` names from this host's registered copy.
    pub(crate) fn load(spec: &ScriptSpec, root: &nn::Path) -> Result<Self, TrainerError> {
        let path = REGISTRY.lock().expect("module registry lock").get(&spec.blake3).cloned().ok_or_else(
            || {
                TrainerError::Config(format!(
                    "the job's TorchScript module (blake3 {}) is not known on this host: set [model].path to its file",
                    spec.blake3
                ))
            },
        )?;
        let (bytes, hash) = read(&path)?;
        if hash != spec.blake3 {
            return Err(TrainerError::Mismatch(format!(
                "{} changed: its blake3 is {hash}, the job's module is {}",
                path.display(),
                spec.blake3
            )));
        }
        let p = root / "b00";
        let module = tch::CModule::load_data_on_device(&mut bytes.as_slice(), p.device()).map_err(|e| {
            TrainerError::Config(format!("{}: {}", path.display(), first_line(&e.to_string())))
        })?;
        for (name, t) in module.named_parameters()? {
            // Shares storage with the module's own parameter: limpet's optimizer updates the
            // module in place.
            let trainable = t.requires_grad();
            let _ = p.add(&name.replace('.', "_"), t, trainable);
        }
        Ok(Scripted { module: Mutex::new((module, true)), loss: spec.loss })
    }

    /// Runs `forward` with `args` in training mode or not.
    fn call(&self, args: &[IValue], train: bool) -> Result<Tensor, TrainerError> {
        let mut m = self.module.lock().expect("module lock");
        if m.1 != train {
            if train {
                m.0.f_set_train()?;
            } else {
                m.0.f_set_eval()?;
            }
            m.1 = train;
        }
        match m.0.forward_is(args) {
            Ok(IValue::Tensor(t)) => Ok(t),
            Ok(other) => Err(TrainerError::Config(format!(
                "the TorchScript module's forward returned {}, not a tensor",
                ivalue_kind(&other)
            ))),
            Err(e) => Err(TrainerError::Config(format!(
                "the TorchScript module's forward failed: {}",
                first_line(&e.to_string())
            ))),
        }
    }

    /// The module's output for `x` (for the named losses).
    pub(crate) fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, TrainerError> {
        self.call(&[IValue::Tensor(x.shallow_clone())], train)
    }

    /// The module's per-sample losses for `(x, y)`, checked to be `[batch]`, summed.
    pub(crate) fn loss_sum(&self, x: &Tensor, y: &Tensor, train: bool) -> Result<Tensor, TrainerError> {
        let l = self.call(&[IValue::Tensor(x.shallow_clone()), IValue::Tensor(y.shallow_clone())], train)?;
        let batch = x.size()[0];
        if l.size() != [batch] {
            return Err(TrainerError::Config(format!(
                "with loss \"module\", forward(x, y) must return each sample's loss (shape [{batch}]), but it returned shape {:?}: a mean would make the gradient depend on how the batch is shared",
                l.size()
            )));
        }
        Ok(l.sum(tch::Kind::Float))
    }

    /// The loss it was loaded for.
    pub(crate) fn loss(&self) -> ScriptLoss {
        self.loss
    }
}

fn ivalue_kind(v: &IValue) -> &'static str {
    match v {
        IValue::Tuple(_) => "a tuple",
        IValue::GenericList(_) | IValue::TensorList(_) => "a list",
        IValue::GenericDict(_) => "a dict",
        IValue::None => "None",
        _ => "a scalar",
    }
}

/// A [`ModuleT`] for the block list: the named-loss forward (errors become panics here, so the
/// trainer checks a forward pass first; see [`crate::Trainer::on_device`]).
pub(crate) struct ScriptBlock(pub(crate) std::sync::Arc<Scripted>);

impl std::fmt::Debug for ScriptBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ModuleT for ScriptBlock {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self.0.forward(xs, train) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }
}

/// Writes the module `spec` names, with its parameters replaced by those of `image` (a
/// checkpoint of a job that trains it), to `out`: a TorchScript file PyTorch loads with
/// `torch.jit.load`.
pub fn export(
    spec: &ScriptSpec,
    image: &limpet_snapshot::StateImage,
    out: &Path,
) -> Result<(), TrainerError> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let m = Scripted::load(spec, &vs.root())?;
    for (name, p) in vs.variables() {
        let key = format!("param/{name}");
        let t = image.tensors().get(&key).ok_or_else(|| {
            TrainerError::Mismatch(format!("tensor '{key}' of the module is missing from the checkpoint"))
        })?;
        let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let values = t.to_f32().filter(|_| shape == p.size()).ok_or_else(|| {
            TrainerError::Mismatch(format!(
                "tensor '{key}' is {:?} {:?} in the checkpoint, the module's is f32 {:?}",
                t.dtype(),
                t.shape(),
                p.size()
            ))
        })?;
        tch::no_grad(|| p.shallow_clone().f_copy_(&Tensor::from_slice(&values).view(shape.as_slice())))?;
    }
    let module = m.module.lock().expect("module lock");
    module.0.save(out).map_err(|e| TrainerError::Config(format!("{}: {e}", out.display())))
}

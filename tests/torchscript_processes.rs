//! A user's own model as a TorchScript module, with real processes: a CNN scripted in
//! PyTorch trains elastically through a notice, a join and a `kill -9` and matches plain
//! PyTorch on the same sample order; bad modules and settings are refused naming what is wrong.

use std::path::PathBuf;
use std::process::Command;

#[path = "common.rs"]
mod common;
use common::{exe, max_rel_diff, notice_join_and_kill_were_survived, params, scenario_json, train_alone};

/// A small CNN defined in Python and scripted; its data as .npy arrays; and the reference
/// trainer: plain PyTorch on limpet's printed sample order with the same optimizer, loading
/// the same scripted file (so the same initial weights).
const TORCHSCRIPT_PY: &str = r#"
import json, sys, numpy as np, torch
import torch.nn.functional as F
from safetensors.torch import save_file
torch.set_num_threads(1)
mode, d = sys.argv[1], sys.argv[2]

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 8 * 8, 4)
    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = F.avg_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

class WithLoss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, reduction="none")

if mode == "make":
    torch.manual_seed(0)
    net = Net()
    torch.jit.script(net).save(d + "/cnn.pt")
    torch.jit.script(WithLoss(net)).save(d + "/cnn_loss.pt")
    # Four classes of 16x16 images: a smooth template each, shifted and noisy.
    rng = np.random.default_rng(1)
    g = np.linspace(-1, 1, 16)
    templates = [np.outer(g, np.ones(16)), np.outer(np.ones(16), g), np.outer(g, g), np.outer(np.abs(g), np.abs(g))]
    y = rng.integers(0, 4, size=2400)
    x = np.stack([np.roll(templates[c], rng.integers(-3, 4), axis=1) for c in y])
    x = (x + 0.8 * rng.normal(size=x.shape))[:, None].astype(np.float32)
    import os; os.makedirs(d + "/data", exist_ok=True)
    np.save(d + "/data/x.npy", x)
    np.save(d + "/data/y.npy", y.astype(np.int64))
else:
    optimizer, lr_peak, wd, clip = sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    m = torch.jit.load(d + "/cnn.pt")
    m.train()
    x = torch.from_numpy(np.load(d + "/data/x.npy"))
    y = torch.from_numpy(np.load(d + "/data/y.npy"))
    params = list(m.named_parameters())
    decay = [p for _, p in params if p.dim() >= 2]
    rest = [p for _, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=lr_peak, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(groups, lr=lr_peak, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for line in open(d + "/order.jsonl"):
        s = json.loads(line)
        rows = torch.tensor(s["samples"])
        loss = F.cross_entropy(m(x[rows]), y[rows], reduction="sum") / len(rows)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], clip)
        for g in opt.param_groups:
            g["lr"] = s["lr"]
        opt.step()
    save_file({n.replace(".", "_"): p.detach().contiguous() for n, p in params}, d + "/torch.safetensors")
    exported = torch.jit.load(d + "/exported.pt")
    worst = max(((a - b).norm() / b.norm()).item()
                for (_, a), (_, b) in zip(exported.named_parameters(), params))
    print(json.dumps({"exported_vs_torch": worst}))
"#;

#[test]
fn a_torchscript_cnn_trained_elastically_matches_plain_pytorch_on_the_same_order() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_str().unwrap();
    // From a file: torch.jit.script reads the classes' source.
    let script = tmp.path().join("cnn.py");
    std::fs::write(&script, TORCHSCRIPT_PY).unwrap();
    let py = |args: &[&str]| -> String {
        let out = Command::new(common::python()).arg(&script).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    py(&["make", d]);
    let (module, data) = (format!("{d}/cnn.pt"), format!("{d}/data"));
    let steps = 400;
    let job = [
        "--model",
        "torchscript",
        "--module",
        &module,
        "--data",
        "tensors",
        "--data-path",
        &data,
        "--batch",
        "64",
        "--lr",
        "0.001",
    ];
    let mut args = vec!["--nodes", "3"];
    args.extend_from_slice(&job);
    let summary = scenario_json(
        &tmp.path().join("elastic"),
        &args,
        steps,
        "0.2:notice:node-2:20,0.45:join,0.7:kill:node-3",
    );
    notice_join_and_kill_were_survived(&summary);
    let checkpoint = PathBuf::from(summary["checkpoint"].as_str().unwrap());
    let (img, elastic) = params(&checkpoint);
    let job_meta = &img.meta().job;
    assert_eq!(job_meta["model"]["kind"], "torchscript");
    assert_eq!(job_meta["model"]["loss"], "cross_entropy");

    // limpet's order, then plain PyTorch on it.
    let order = Command::new(exe())
        .arg("train")
        .args(job)
        .args(["--steps", &steps.to_string(), "--print-order"])
        .arg(format!("{d}/order.jsonl"))
        .output()
        .unwrap();
    assert!(order.status.success(), "{}", String::from_utf8_lossy(&order.stderr));
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(format!("{d}/order.jsonl")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    assert_eq!(first["samples"].as_array().unwrap().len(), 64, "{first}");
    let export = Command::new(exe())
        .args(["export", "--torchscript", &format!("{d}/exported.pt"), "--module", &module, "--checkpoint"])
        .arg(&checkpoint)
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    let opt = &job_meta["optimizer"];
    let said = py(&[
        "reference",
        d,
        opt["kind"].as_str().unwrap(),
        &opt["lr"].to_string(),
        &opt["weight_decay"].to_string(),
        &job_meta["clip_norm"].to_string(),
    ]);
    let bytes = std::fs::read(format!("{d}/torch.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, values) in &elastic {
        let key = name.trim_start_matches("param/b00.");
        let t = reference.tensor(key).unwrap_or_else(|e| panic!("PyTorch has no {key}: {e}"));
        let theirs: Vec<f32> =
            t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(theirs.len(), values.len(), "{key}");
        diff += values.iter().zip(&theirs).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>();
        norm += theirs.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>();
    }
    let rel = (diff / norm).sqrt();
    eprintln!("limpet (elastic) vs PyTorch: relative L2 difference of the weights {rel:e}");
    assert!(rel <= 1e-3, "limpet's weights differ from PyTorch's by {rel:e} (relative L2)");
    let exported: serde_json::Value = serde_json::from_str(said.trim()).unwrap();
    assert!(exported["exported_vs_torch"].as_f64().unwrap() <= 1e-3, "{exported}");
    // The training moved the weights far more than the two runs differ.
    let (_, init) = {
        let fresh = Command::new(exe())
            .arg("train")
            .args(job)
            .args(["--steps", "1", "--stop-at", "0", "--out"])
            .arg(tmp.path().join("init"))
            .output()
            .unwrap();
        assert!(fresh.status.success(), "{}", String::from_utf8_lossy(&fresh.stderr));
        params(&tmp.path().join("init").join("checkpoint.safetensors"))
    };
    assert!(max_rel_diff(&init, &elastic) > 100.0 * rel, "training barely moved the weights");

    // The module may compute its own loss: each sample's, which limpet sums.
    let module_loss = format!("{d}/cnn_loss.pt");
    let own = train_alone(
        &tmp.path().join("own-loss"),
        &[
            "--model",
            "torchscript",
            "--module",
            &module_loss,
            "--loss",
            "module",
            "--data",
            "tensors",
            "--data-path",
            &data,
            "--batch",
            "64",
            "--lr",
            "0.001",
        ],
        steps,
    );
    let named = train_alone(&tmp.path().join("named-loss"), &job, steps);
    let (a, b) = (own["test_loss"].as_f64().unwrap(), named["test_loss"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "module loss {a} vs named loss {b}");
}

#[test]
fn bad_torchscript_modules_and_settings_are_refused_naming_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_str().unwrap();
    let script = tmp.path().join("bad.py");
    std::fs::write(
        &script,
        r#"
import sys, numpy as np, torch
import torch.nn.functional as F
d = sys.argv[1]
class Mean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)
class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)
    def forward(self, x):
        return self.fc(x).squeeze(1)
torch.jit.script(Mean()).save(d + "/mean.pt")
torch.jit.script(Flat()).save(d + "/flat.pt")
import os; os.makedirs(d + "/data", exist_ok=True)
rng = np.random.default_rng(0)
np.save(d + "/data/x.npy", rng.normal(size=(200, 8)).astype(np.float32))
np.save(d + "/data/y.npy", rng.integers(0, 3, size=200).astype(np.int64))
"#,
    )
    .unwrap();
    let out = Command::new(common::python()).arg(&script).arg(d).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(tmp.path().join("junk.pt"), b"not a zip archive").unwrap();
    let data = format!("{d}/data");
    let train = |module: &str, extra: &[&str]| -> String {
        let run = Command::new(exe())
            .args([
                "train",
                "--model",
                "torchscript",
                "--module",
                &format!("{d}/{module}"),
                "--data-path",
                &data,
            ])
            .args(["--steps", "2", "--out", &format!("{d}/out")])
            .args(extra)
            .output()
            .unwrap();
        assert!(!run.status.success(), "{module} {extra:?} trained");
        String::from_utf8_lossy(&run.stderr).into_owned()
    };
    let junk = train("junk.pt", &[]);
    assert!(junk.contains("junk.pt") && junk.contains("not a TorchScript module"), "{junk}");
    let missing = train("absent.pt", &[]);
    assert!(missing.contains("absent.pt"), "{missing}");
    let mean = train("mean.pt", &["--loss", "module"]);
    assert!(mean.contains("each sample's loss (shape [64])"), "{mean}");
    let flat = train("flat.pt", &[]);
    assert!(flat.contains("returned shape [64]") && flat.contains("class dimension"), "{flat}");
    let wrong_loss = train("flat.pt", &["--loss", "mse"]);
    assert!(wrong_loss.contains("mse") && wrong_loss.contains("does not fit"), "{wrong_loss}");
    let llama_key = train("flat.pt", &["--preset", "tiny"]);
    assert!(llama_key.contains("--preset"), "{llama_key}");

    // limpetd: the module is required, a pipeline refused, and validate says it is one stage.
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef0123").unwrap();
    let good = format!(
        "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = \"{d}/state\"\nsecret_file = {:?}\n\n\
         [cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
         [job]\nmodel = \"torchscript\"\ndata = \"tensors\"\ndata_path = \"{data}\"\nsteps = 10\nglobal_batch = 8\n\n\
         [model]\npath = \"{d}/flat.pt\"\n\n[security]\ninsecure = true\n\n[revocation]\nsources = \"none\"\n",
        secret.display().to_string()
    );
    let validate = |text: &str| {
        let f = tmp.path().join("node.toml");
        std::fs::write(&f, text).unwrap();
        Command::new(env!("CARGO_BIN_EXE_limpetd")).args(["validate", "--config"]).arg(&f).output().unwrap()
    };
    let ok = validate(&good);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(
        String::from_utf8_lossy(&ok.stdout).contains("one stage"),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let piped = validate(&(good.clone() + "\n[pipeline]\nstages = 2\n"));
    assert!(
        String::from_utf8_lossy(&piped.stderr).contains("[pipeline]"),
        "{}",
        String::from_utf8_lossy(&piped.stderr)
    );
    let no_path = validate(&good.replace(&format!("path = \"{d}/flat.pt\"\n"), ""));
    assert!(
        String::from_utf8_lossy(&no_path.stderr).contains("[model].path"),
        "{}",
        String::from_utf8_lossy(&no_path.stderr)
    );
    let junk_path = validate(&good.replace("flat.pt", "junk.pt"));
    assert!(
        String::from_utf8_lossy(&junk_path.stderr).contains("junk.pt"),
        "{}",
        String::from_utf8_lossy(&junk_path.stderr)
    );
}

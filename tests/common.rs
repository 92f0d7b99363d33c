//! Helpers the multi-process test files share (each includes this file as a module).

#![allow(dead_code)]

use limpet_snapshot::StateImage;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The `limpet` binary under test.
pub fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_limpet"))
}

/// The uninterrupted reference: `limpet train` of the same job in one process, into `out`;
/// its JSON report.
pub fn train_alone(out: &Path, job: &[&str], steps: u64) -> Value {
    let run = Command::new(exe())
        .arg("train")
        .args(job)
        .args(["--json", "--steps", &steps.to_string(), "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    serde_json::from_slice(&run.stdout).unwrap()
}

pub fn params(path: &Path) -> (StateImage, Vec<(String, Vec<f32>)>) {
    let img = limpet_snapshot::read_file(path).unwrap();
    let p = img
        .tensors()
        .iter()
        .filter(|(k, _)| k.starts_with("param/"))
        .map(|(k, t)| (k.clone(), t.to_f32().unwrap()))
        .collect();
    (img, p)
}

/// The largest relative L2 difference over the parameter tensors.
pub fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            let d: f64 = x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum::<f64>().sqrt();
            let n: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>().sqrt();
            d / n.max(1e-12)
        })
        .fold(0.0, f64::max)
}

//! `limpet-lab` end to end, as a developer runs it: real processes, real files.

use std::process::Command;

fn ok_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_limpet-lab")).args(args).output().expect("limpet-lab runs");
    assert!(out.status.success(), "limpet-lab {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

#[test]
fn bench_pipeline_trains_each_layout_in_worker_processes() {
    let args =
        "bench pipeline --model gpt --layers 2 --batch 8 --micro-batch 4 --hosts 2 --train-steps 4 --json";
    let r = ok_json(&args.split(' ').collect::<Vec<_>>());
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows[0]["role"], "chosen", "{r}");
    // The chosen layout, two runners-up, and plain data parallelism among them.
    assert!(rows.len() >= 3, "{r}");
    assert!(rows.iter().any(|x| x["shape"] == "2x1"), "{r}");
    for x in rows {
        assert!(x["measured_ms"].as_f64().unwrap() > 0.0 && x["predicted_ms"].as_f64().unwrap() > 0.0, "{x}");
    }
}

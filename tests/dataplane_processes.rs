//! The data plane across real processes: `limpet-lab dp-worker`s on loopback. Allreduce equals
//! the exact sum for random world sizes, lengths and rank orders; killing one process
//! mid-collective makes every survivor fail within the timeout, never hang.

use limpet_lab::dp_cmd::spawn_workers;
use proptest::prelude::*;
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

#[path = "common.rs"]
mod common;
use common::lab_exe as exe;

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    #[test]
    fn allreduce_across_processes_equals_the_exact_sum(
        world in 1usize..=5,
        lens in proptest::collection::vec(0usize..300_000, 1..3),
        rotate in 0usize..5,
        seed in any::<u64>(),
    ) {
        let mut order: Vec<u64> = (1..=world as u64).map(|n| n * 3).collect();
        order.rotate_left(rotate % world);
        let plan = lens.iter().map(|l| format!("{l}:1")).collect::<Vec<_>>().join(",");
        let args = ["--mode", "check", "--plan", &plan, "--seed", &seed.to_string()].map(String::from);
        let mut workers = spawn_workers(&exe(), &order, &args).unwrap();
        let mut lines: Vec<Vec<serde_json::Value>> = Vec::new();
        for c in &mut workers.children {
            let out = BufReader::new(c.stdout.take().unwrap());
            lines.push(out.lines().map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect());
            prop_assert!(c.wait().unwrap().success());
        }
        for (i, len) in lens.iter().enumerate() {
            let first = &lines[0][i];
            prop_assert_eq!(first["len"].as_u64().unwrap() as usize, *len);
            for rank in &lines {
                // f32 sums of up to 5 terms: within 1e-5 of the magnitude, as documented.
                prop_assert!(rank[i]["max_rel_err"].as_f64().unwrap() <= 1e-5, "{}", rank[i]);
                // Every rank holds bit-identical results.
                prop_assert_eq!(&rank[i]["hash"], &first["hash"]);
            }
        }
    }
}

#[test]
fn killing_one_process_mid_collective_fails_every_survivor_within_the_bound() {
    let order = [1u64, 2, 3, 4];
    let args = ["--mode", "loop", "--plan", "16777216:1", "--timeout-ms", "2000"].map(String::from);
    let mut workers = spawn_workers(&exe(), &order, &args).unwrap();
    let mut readers: Vec<_> =
        workers.children.iter_mut().map(|c| BufReader::new(c.stdout.take().unwrap())).collect();
    for r in &mut readers {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.contains("ready"), "{line}");
    }
    std::thread::sleep(Duration::from_millis(500));
    // SIGKILL the third rank in the middle of its allreduces.
    workers.children[2].kill().unwrap();
    let killed = Instant::now();
    for (i, r) in readers.iter_mut().enumerate() {
        if i == 2 {
            continue;
        }
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let after = killed.elapsed();
        assert!(v["steps"].as_u64().unwrap() > 0, "rank {i} never completed a step: {v}");
        let err = v["error"].as_str().unwrap();
        eprintln!("rank {i} failed {after:?} after the kill: {err}");
        assert!(after < Duration::from_millis(3500), "rank {i} took {after:?} to fail");
        assert!(workers.children[i].wait().unwrap().success());
    }
}

/// `limpet-lab bench allreduce` reports which congestion control each side ran with: limpet's
/// reno by default, the host's with `--congestion system`; a malformed name is a usage error.
#[test]
fn the_allreduce_benchmark_reports_its_congestion_control() {
    let host = limpet_agent::dataplane::endpoint::host_congestion();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(exe())
            .args(["bench", "allreduce", "--world", "2", "--sizes", "4K", "--no-gloo", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["sizes"][0]["limpet"]["seconds"].as_f64().unwrap() > 0.0, "{v}");
        let cc = v["congestion"]["limpet"].as_str().unwrap().to_string();
        // On another algorithm than the host's, the ring is measured with the host's too.
        let with_host = v["sizes"][0]["limpet_host_congestion"]["seconds"].as_f64();
        assert_eq!(with_host.is_some_and(|s| s > 0.0), cc != host, "{v}");
        (cc, v["congestion"]["host_default"].clone())
    };
    assert_eq!(run(&[]), ("reno".to_string(), serde_json::json!(host)));
    assert_eq!(run(&["--congestion", "system"]).0, host);
    let bad = std::process::Command::new(exe())
        .args(["bench", "allreduce", "--no-gloo", "--congestion", "Reno!"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--congestion"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

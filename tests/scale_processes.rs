//! A fleet on one machine: more `limpetd` agents on one address than the control plane's
//! per-address share of a stranger (past the 33 where a cluster used to stop forming), a
//! zone's worth of revocations at one instant (notices and `kill -9`), then a wave of joins.
//! Checks what the fleet's cliffs broke: the cluster stays whole (no live agent marked
//! failed), the mass revocation is one epoch (two when the kills are found before the
//! notices are seen), and sixteen concurrent joiners enter in a wave (at most three epochs),
//! each on its first try, copying from several holders.

use serde_json::Value;

#[path = "common.rs"]
mod common;

/// Founders: past 33 on one address.
const FOUNDERS: usize = 36;
/// Revoked at once: a quarter of the fleet, a third of them without notice.
const NOTICED: std::ops::RangeInclusive<usize> = 28..=33;
const KILLED: std::ops::RangeInclusive<usize> = 34..=36;
/// Joiners booted at one instant.
const JOINERS: usize = 16;

fn causes(summary: &Value) -> Vec<(String, u64)> {
    summary["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["cause"].as_str().unwrap().to_string(), t["world"].as_u64().unwrap()))
        .collect()
}

#[test]
fn a_fleet_past_one_addresss_share_stays_whole_through_a_mass_revocation_and_a_wave_of_joins() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fleet");
    let mut script: Vec<String> = NOTICED.map(|i| format!("0.3:notice:node-{i}:60")).collect();
    script.extend(KILLED.map(|i| format!("0.3:kill:node-{i}")));
    script.extend((0..JOINERS).map(|_| "0.6:join".to_string()));
    let founders = FOUNDERS.to_string();
    let batch = (FOUNDERS * 8).to_string();
    // 52 agents on two cores (the founders, then the joiners booting, each loading libtorch)
    // can leave a live one unheard for over a second; a fleet's hosts have cores of their own.
    // The kills are still found at once, by the leader's probe of their ports.
    let args = [
        "--nodes",
        &founders,
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--batch",
        &batch,
        "--failure-timeout-ms",
        "3000",
    ];
    let summary = common::scenario_json(&dir, &args, 450, &script.join(","));
    let seen = causes(&summary);
    // The cluster formed whole, once.
    assert_eq!(seen[0], ("first epoch".to_string(), FOUNDERS as u64), "{seen:#?}");
    // Then the revocation: one epoch, or two when the kills are found dead (at once, their
    // ports refusing the leader's probe) before the notices are seen (their metadata
    // polled), the notices' then a planned change. Then the wave of joins in at most three
    // epochs (hosts boot over seconds on two busy cores: a wave settles once none became
    // ready for 300 ms, or 3 s after its first; an epoch scheduled and superseded before
    // any rank reached it is not one).
    // A live agent marked failed would have made another epoch, or a smaller world.
    let revoked = NOTICED.count() + KILLED.count();
    let mass: Vec<&(String, u64)> = seen[1..].iter().take_while(|(c, _)| !c.contains("join")).collect();
    assert!((1..=2).contains(&mass.len()), "{seen:#?}");
    assert!(mass.iter().all(|(c, _)| c.contains("notice") || c.contains("failure")), "{seen:#?}");
    assert_eq!(mass.last().unwrap().1, (FOUNDERS - revoked) as u64, "{seen:#?}");
    let joins = &seen[1 + mass.len()..];
    assert!((1..=3).contains(&joins.len()) && joins.iter().all(|(c, _)| c.contains("join")), "{seen:#?}");
    assert_eq!(joins.last().unwrap().1, (FOUNDERS - revoked + JOINERS) as u64, "{seen:#?}");
    // Each joiner entered on its first try, and they copied from several holders.
    let mut sources = std::collections::BTreeSet::new();
    for i in FOUNDERS + 1..=FOUNDERS + JOINERS {
        let log = std::fs::read_to_string(dir.join(format!("node-{i}.log"))).unwrap();
        assert!(!log.contains("could not enter the epoch"), "node-{i} failed an entry:\n{log}");
        for line in log.lines().filter(|l| l.contains("state copied from a peer")) {
            if let Some(from) = line.split("from=").nth(1).and_then(|s| s.split_whitespace().next()) {
                sources.insert(from.to_string());
            }
        }
    }
    assert!(sources.len() >= 4, "the joiners copied from {sources:?} only");
}

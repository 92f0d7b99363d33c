//! A fleet on one machine: more `limpetd` agents on one address than the control plane's
//! per-address share of a stranger (past the 33 where a cluster used to stop forming), a
//! zone's worth of revocations at one instant (notices and `kill -9`), then a wave of joins.
//! Checks what the fleet's cliffs broke: the cluster stays whole (no live agent marked
//! failed), the mass revocation is one epoch (two when the kills are found before the
//! notices are seen), and sixteen concurrent joiners enter in a wave (at most three epochs),
//! each epoch that trains on its first try, copying from several holders. The same harness with each agent in
//! a network namespace of its own, with its own address.

use serde_json::Value;

#[path = "common.rs"]
mod common;

/// The two fleets here never run at once: each boots its agents on the same two cores, and a
/// founder that beside the other fleet took too long to load libtorch missed its first epoch.
static ONE_FLEET: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_fleet() -> std::sync::MutexGuard<'static, ()> {
    ONE_FLEET.lock().unwrap_or_else(|e| e.into_inner())
}

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
    let _alone = one_fleet();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fleet");
    let mut script: Vec<String> = NOTICED.map(|i| format!("0.3:notice:node-{i}:60")).collect();
    script.extend(KILLED.map(|i| format!("0.3:kill:node-{i}")));
    script.extend((0..JOINERS).map(|_| "0.6:join".to_string()));
    let founders = FOUNDERS.to_string();
    let batch = (FOUNDERS * 8).to_string();
    // 52 agents on two cores (each loading libtorch) can leave a live one unheard for over a
    // second; a fleet's hosts have cores of their own. The kills are still found at once, by
    // the leader's probe of their ports (below). For the same reason the joiners boot with the
    // founders and wait, loaded, until the script's join: loading libtorch on cores that 33
    // agents keep busy took them 14-20 s, spread over 6 s, and the job could end first.
    let args = [
        "--joiners-booted",
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
    // The kills were found dead, not waited out: the lab kills them 160 ms apart, so the
    // last ones are named by no broken collective, only by the next epoch's connections
    // their ports refuse.
    assert!(mass.iter().all(|(c, _)| !c.contains("no heartbeat for")), "{seen:#?}");
    let joins = &seen[1 + mass.len()..];
    assert!((1..=3).contains(&joins.len()) && joins.iter().all(|(c, _)| c.contains("join")), "{seen:#?}");
    assert_eq!(joins.last().unwrap().1, (FOUNDERS - revoked + JOINERS) as u64, "{seen:#?}");
    // Each joiner entered every epoch that trained on its first try, and they copied from
    // several holders. An entry may fail into a wave's epoch that a larger wave replaced
    // before any rank trained in it (its peers left it before the newer epoch reached this
    // agent's log): that epoch has no step in any step log.
    let trained: std::collections::BTreeSet<u64> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".steps.jsonl"))
        .flat_map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            text.lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["epoch"].as_u64())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!trained.is_empty(), "no step log in {}", dir.display());
    let mut sources = std::collections::BTreeSet::new();
    for i in FOUNDERS + 1..=FOUNDERS + JOINERS {
        let log = std::fs::read_to_string(dir.join(format!("node-{i}.log"))).unwrap();
        for line in log.lines().filter(|l| l.contains("could not enter the epoch")) {
            let epoch =
                line.split("epoch=").nth(1).and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            assert!(
                epoch.is_some_and(|e| !trained.contains(&e)),
                "node-{i} failed to enter an epoch that trained:\n{log}"
            );
        }
        for line in log.lines().filter(|l| l.contains("state copied from a peer")) {
            if let Some(from) = line.split("from=").nth(1).and_then(|s| s.split_whitespace().next()) {
                sources.insert(from.to_string());
            }
        }
    }
    assert!(sources.len() >= 4, "the joiners copied from {sources:?} only");
}

/// The same harness with each agent in a network namespace of its own, with its own address
/// on one bridge (as on a fleet of hosts, where caps per address count one host each): the
/// cluster forms, takes a notice, a `kill -9` (found at once: the killed agent's kernel
/// refuses its port) and a join, and the namespaces and the bridge are gone after.
#[test]
fn agents_in_network_namespaces_of_their_own_train_through_a_notice_a_kill_and_a_join() {
    // Namespaces and links need CAP_SYS_ADMIN (bit 21) and CAP_NET_ADMIN (bit 12), which
    // root has on a machine of its own (CI) and not in a default container.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let caps = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    let caps = u64::from_str_radix(caps, 16).unwrap();
    if caps & (1 << 21) == 0 || caps & (1 << 12) == 0 {
        eprintln!(
            "skipped: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN (root on a machine of its own)"
        );
        return;
    }
    let _alone = one_fleet();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("spaces");
    let args = [
        "--nodes",
        "5",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--batch",
        "40",
        "--netns",
        "--failure-timeout-ms",
        "3000",
    ];
    let summary = common::scenario_json(&dir, &args, 1500, "0.3:notice:node-4:60,0.3:kill:node-5,0.6:join");
    let file: Value = serde_json::from_slice(&std::fs::read(dir.join("cluster.json")).unwrap()).unwrap();
    let hosts: Vec<String> = file["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["control"].as_str().unwrap().rsplit_once(':').unwrap().0.to_string())
        .collect();
    assert_eq!(hosts.len(), 6, "{hosts:?}");
    assert!(hosts.iter().all(|h| h.starts_with("10.")), "{hosts:?}");
    assert_eq!(hosts.iter().collect::<std::collections::BTreeSet<_>>().len(), hosts.len(), "{hosts:?}");
    let seen = causes(&summary);
    assert_eq!(seen[0], ("first epoch".to_string(), 5), "{seen:#?}");
    assert_eq!(seen.last().unwrap().1, 4, "{seen:#?}");
    let kill = common::transition(&summary, "failure of node 5");
    assert!(kill["idle_ms"].as_u64().unwrap() < 1500, "the kill waited for the 3 s timeout: {kill}");
    // The fleet's /16 is gone with its bridge, and its namespaces with it.
    let ip = |args: &[&str]| {
        let out = std::process::Command::new("ip").args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let net: String = hosts[0].split('.').take(2).collect::<Vec<_>>().join(".") + ".";
    let addrs = ip(&["-o", "-4", "addr", "show"]);
    assert!(!addrs.contains(&format!(" {net}")), "the fleet's bridge is still up:\n{addrs}");
    let spaces: Vec<&str> =
        file["nodes"].as_array().unwrap().iter().map(|n| n["netns"].as_str().unwrap()).collect();
    let left = ip(&["netns", "list"]);
    assert!(
        spaces.iter().all(|s| !left.lines().any(|l| l.split_whitespace().next() == Some(s))),
        "{spaces:?} left in:\n{left}"
    );
}

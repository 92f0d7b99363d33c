//! Running limpet as an operator would, with real processes: the systemd unit as shipped,
//! `limpetd` started the way systemd starts a `Type=notify` service (its notifications read
//! from a real datagram socket), its Prometheus endpoint scraped over HTTP, SIGTERM drains
//! and a second SIGTERM, JSON logs, and a panic anywhere taking it down by name. (Durable
//! checkpoints are `checkpoint_processes.rs`'s; what ships, `release_processes.rs`'s.)

use limpet_lab::local::{get_text, LocalJob, SystemdEnv};
use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "common.rs"]
mod common;
use common::{exe, node_logs as logs, scrape, step_records as steps_of, up, wait_or_show, wait_until};

const UNIT: &str = include_str!("../deploy/systemd/limpetd.service");

/// The unit's value of `key` (the last one set).
fn unit_value(key: &str) -> String {
    UNIT.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .next_back()
        .unwrap_or_else(|| panic!("the unit sets no {key}"))
        .to_string()
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify_and_outlasts_the_drain() {
    let dir = tempfile::tempdir().unwrap();
    // verify checks that the executables exist: point the unit at the binary under test.
    let unit = dir.path().join("limpetd.service");
    std::fs::write(&unit, UNIT.replace("/usr/local/bin/limpetd", env!("CARGO_BIN_EXE_limpetd"))).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze (Debian package systemd) is installed by deploy/setup.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Unknown keys are only warnings to verify, so any output fails the test.
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");

    assert_eq!(unit_value("Type"), "notify");
    assert!(unit_value("ExecStartPre").contains("limpetd validate --config"));
    assert!(!unit_value("StateDirectory").is_empty());
    // ProtectSystem=strict: the step log's and the documented checkpoint directory must be
    // writable under the unit.
    assert_eq!(unit_value("LogsDirectory"), "limpet");
    assert!(unit_value("ReadWritePaths").split_whitespace().any(|p| p.trim_start_matches('-') == "/mnt/efs"));
    assert_eq!(unit_value("Restart"), "always");
    // A config that is wrong (exit 64: a bad key, or a [job] not the cluster's) is not retried.
    assert_eq!(unit_value("RestartPreventExitStatus"), "64");
    for hardening in ["NoNewPrivileges", "ProtectSystem", "ProtectHome", "CapabilityBoundingSet"] {
        unit_value(hardening);
    }
    // systemd's SIGKILL must come after limpetd's own deadline, but not long after.
    let stop: u64 = unit_value("TimeoutStopSec").parse().unwrap();
    let grace = limpet_daemon::config::Timing::default().drain_grace_secs;
    assert!(stop > grace && stop <= grace + 30, "TimeoutStopSec={stop}, drain grace {grace} s");
    let watchdog: u64 = unit_value("WatchdogSec").parse().unwrap();
    assert!(watchdog >= 10, "a watchdog of {watchdog} s would kill an agent busy entering an epoch");
}

/// What systemd would have received: every notification's fields, in order.
struct NotifySocket {
    sock: UnixDatagram,
    path: PathBuf,
    seen: Vec<BTreeMap<String, String>>,
}

impl NotifySocket {
    fn bind(dir: &Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        NotifySocket { sock, path, seen: Vec::new() }
    }

    /// Reads every message that arrives for `d`.
    fn collect(&mut self, d: Duration) {
        let start = Instant::now();
        while start.elapsed() < d {
            self.recv_one();
        }
    }

    fn recv_one(&mut self) {
        let mut buf = [0u8; 4096];
        if let Ok(n) = self.sock.recv(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).to_string();
            let msg = text
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            self.seen.push(msg);
        }
    }

    /// Reads until a message has `key` (with `value`, if given); the time it took.
    fn wait_for(&mut self, key: &str, value: Option<&str>, within: Duration) -> Duration {
        let start = Instant::now();
        let has = |m: &BTreeMap<String, String>| m.get(key).is_some_and(|v| value.is_none_or(|w| v == w));
        loop {
            if self.seen.iter().any(has) {
                return start.elapsed();
            }
            assert!(start.elapsed() < within, "no {key}={value:?} within {within:?}; got {:?}", self.seen);
            self.recv_one();
        }
    }

    fn count(&self, key: &str) -> usize {
        self.seen.iter().filter(|m| m.contains_key(key)).count()
    }
}

fn sigterm(pid: u32) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
}

#[test]
fn a_service_node_tells_systemd_serves_metrics_and_drains_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let job = LocalJob { steps: 1_000_000, ..LocalJob::default() };
    let mut c = up(&dir, 3, job).unwrap();
    let founders_log = c.file.node("node-1").unwrap().step_log.clone();
    wait_until("the founders train", Duration::from_secs(120), || steps_of(&founders_log).len() > 50);
    let mut notify = NotifySocket::bind(tmp.path());
    let env = SystemdEnv {
        notify_socket: notify.path.clone(),
        watchdog: Duration::from_secs(2),
        args: vec!["--log-format".into(), "json".into()],
    };
    let node = c.add_as_service(env).unwrap();
    let me = c.file.node(&node).unwrap().clone();

    // READY=1 only once the node is a member in the log; then the watchdog pings (every
    // half period) and a status line while it trains.
    notify.wait_for("READY", Some("1"), Duration::from_secs(120));
    let status = Command::new(exe()).args(["status", "--json", "--dir"]).arg(&dir).output().unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(
        doc["nodes"].as_array().unwrap().iter().any(|n| n["name"] == node.as_str()),
        "READY before the log knew the node: {doc:#}"
    );
    notify.wait_for("STATUS", None, Duration::from_secs(60));
    let before = notify.count("WATCHDOG");
    notify.collect(Duration::from_secs(4));
    assert!(
        notify.count("WATCHDOG") >= before + 2,
        "watchdog pings in 4 s with WatchdogSec=2: {:?}",
        notify.seen
    );

    // Metrics: the newcomer trains with the others and copied its state from a peer.
    let mut m = BTreeMap::new();
    wait_until("4 ranks training, seen in /metrics", Duration::from_secs(120), || {
        m = scrape(&me.metrics);
        m.get("limpet_world_size").copied() == Some(4.0)
            && m.get("limpet_steps_total").is_some_and(|&s| s > 20.0)
    });
    for name in [
        "limpet_loss",
        "limpet_applied_step",
        "limpet_samples_per_second",
        "limpet_epoch",
        "limpet_step_seconds_count",
        "limpet_raft_term",
        "limpet_raft_commit_index",
        "limpet_raft_leader",
        "limpet_raft_is_leader",
        "limpet_transition_idle_seconds_count",
    ] {
        assert!(m.contains_key(name), "{name} missing from /metrics: {m:?}");
    }
    let positive = |k: &str| m.get(k).is_some_and(|&v| v > 0.0);
    assert!(positive("limpet_data_bytes_sent_total{kind=\"ring\"}"), "{m:?}");
    assert!(positive("limpet_data_bytes_received_total{kind=\"ring\"}"), "{m:?}");
    assert!(positive("limpet_data_bytes_received_total{kind=\"handoff\"}"), "a joiner copies state: {m:?}");
    assert!(positive("limpet_transitions_total{cause=\"join\"}"), "{m:?}");
    assert!(positive("limpet_raft_commit_index") && positive("limpet_raft_leader"), "{m:?}");
    assert_eq!(m.get("limpet_members{status=\"active\"}").copied(), Some(4.0), "{m:?}");
    let page = get_text(&me.metrics).unwrap();
    for line in [
        "# TYPE limpet_steps_total counter",
        "# TYPE limpet_step_seconds histogram",
        "# TYPE limpet_world_size gauge",
        "# HELP limpet_raft_commit_index",
    ] {
        assert!(page.contains(line), "{line:?} missing from /metrics:\n{page}");
    }
    // The step-time histogram has buckets a dashboard can take quantiles of.
    assert!(m.keys().any(|k| k.starts_with("limpet_step_seconds_bucket{le=\"0.005\"")), "{m:?}");

    // Its log is JSON, one object per line, with a level and a message.
    let log = std::fs::read_to_string(&me.log).unwrap();
    let first = log.lines().next().unwrap();
    let v: serde_json::Value = serde_json::from_str(first).unwrap_or_else(|e| panic!("{e}: {first}"));
    assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{v}");

    // SIGTERM: STOPPING=1, a drain (no step lost), exit 0.
    sigterm(me.pid);
    notify.wait_for("STOPPING", Some("1"), Duration::from_secs(10));
    let status = c.wait_exit(&node, Duration::from_secs(60)).expect("limpetd exits after its drain");
    assert!(status.success(), "after a drain limpetd exits 0, not {status:?}\n{}", logs(&dir));
    let others = c.file.node("node-1").unwrap().step_log.clone();
    let at_exit = steps_of(&others).last().map_or(0, |l| l.0);
    wait_until("node-1 trains on after the drain", Duration::from_secs(60), || {
        steps_of(&others).last().is_some_and(|l| l.0 > at_exit + 20 && l.2 == 3)
    });
    let text = Command::new(exe()).args(["status", "--json", "--dir"]).arg(&dir).output().unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&text.stdout).unwrap();
    let drain = doc["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["cause"].as_str().unwrap().starts_with("drain"))
        .unwrap_or_else(|| panic!("no drain transition: {doc:#}"));
    assert_eq!(drain["lost_steps"], 0, "{drain}");

    // An upgrade: the drained node starts again (same configuration and state directory, a
    // new binary in real life), joins again and trains, while the others never stopped.
    c.restart(&node).unwrap();
    let at_restart = steps_of(&others).last().map_or(0, |l| l.0);
    let mine = me.step_log.clone();
    let before = steps_of(&mine).len();
    wait_or_show(
        "the restarted node trains again",
        Duration::from_secs(120),
        || steps_of(&mine).len() > before + 20 && steps_of(&mine).last().is_some_and(|l| l.2 == 4),
        Some(&dir),
    );
    let gap = steps_of(&others).windows(2).filter(|w| w[0].0 >= at_restart).map(|w| w[1].0 - w[0].0).max();
    assert_eq!(gap, Some(1), "the others trained every step through the rejoin");

    // A second SIGTERM does not wait for the drain: limpetd stops at once, still with 0.
    // The cluster sees a failure and goes on with the three others (node-3 was one of three
    // voters; the other two are a majority).
    let third = c.file.node("node-3").unwrap().clone();
    sigterm(third.pid);
    std::thread::sleep(Duration::from_millis(50));
    sigterm(third.pid);
    let status = c.wait_exit("node-3", Duration::from_secs(10)).expect("a second SIGTERM stops at once");
    assert!(status.success(), "{status:?}");
    let at_exit = steps_of(&others).last().map_or(0, |l| l.0);
    wait_or_show(
        "node-1 trains on without node-3",
        Duration::from_secs(90),
        || steps_of(&others).last().is_some_and(|l| l.0 > at_exit + 20 && l.2 == 3),
        Some(&dir),
    );
    c.down();
}

/// A panic anywhere ends limpetd with a non-zero exit naming what panicked: an agent task (the
/// leader loop: before, the node stayed up as a leader that never scheduled an epoch again),
/// a consensus node's task (its gRPC server), an agent thread (the handoff server) and a
/// data-plane thread (its accept loop): one of each way `Tasks` runs work. (The node's join
/// and peer senders, a transfer's thread, a data-plane handshake and a metrics handshake go
/// the same ways, and need a second node, a fetch or a client.)
#[test]
fn a_task_that_panics_takes_limpetd_down_with_a_non_zero_exit() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["lead", "control-server", "handoff", "dp-accept"] {
        let dir = tmp.path().join(name);
        // The chaos hook makes the named task or thread panic half a second after it starts.
        let job = LocalJob {
            steps: 1_000_000,
            env: vec![("LIMPET_CHAOS_PANIC".into(), name.into())],
            ..LocalJob::default()
        };
        let mut c = up(&dir, 1, job).unwrap();
        let status = c.wait_exit("node-1", Duration::from_secs(60));
        let text = logs(&dir);
        let status = status.unwrap_or_else(|| panic!("limpetd still runs after {name} panicked:\n{text}"));
        assert!(!status.success(), "{name}: exit status {status:?}\n{text}");
        assert!(text.contains(&format!("task {name} failed: panicked: LIMPET_CHAOS_PANIC={name}")), "{text}");
        c.down();
    }
}

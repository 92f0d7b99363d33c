//! Running limpet as an operator would, with real processes: the systemd unit as shipped,
//! `limpetd` started the way systemd starts a `Type=notify` service (its notifications read
//! from a real datagram socket), its Prometheus endpoint scraped over HTTP, SIGTERM drains
//! and a second SIGTERM, JSON logs, and durable checkpoints that let a brand-new cluster
//! carry on after every host of the old one was killed.

use limpet_lab::local::{get_text, LocalCluster, LocalJob, SystemdEnv};
use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "common.rs"]
mod common;
use common::{exe, max_rel_diff, params, train_alone};

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
    let grace = limpet_daemon::config::TimingSection::default().drain_grace_secs;
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

/// The samples of a Prometheus text page: `name{labels}` to value.
fn scrape(url: &str) -> BTreeMap<String, f64> {
    samples(&get_text(url).unwrap())
}

fn samples(page: &str) -> BTreeMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn wait_until(what: &str, within: Duration, done: impl FnMut() -> bool) {
    wait_or_show(what, within, done, None);
}

/// Waits for `done`; on timeout the failure shows the logs of the cluster in `dir`.
fn wait_or_show(what: &str, within: Duration, mut done: impl FnMut() -> bool, dir: Option<&Path>) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < within,
            "{what}: not within {within:?}\n{}",
            dir.map(logs).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Steps a node logged: (step, epoch, world) per line.
fn steps_of(path: &Path) -> Vec<(u64, u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| (v["step"].as_u64().unwrap(), v["epoch"].as_u64().unwrap(), v["world"].as_u64().unwrap()))
        .collect()
}

fn logs(dir: &Path) -> String {
    let mut s = String::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            s += &format!("--- {}\n{}", e.path().display(), text);
        }
    }
    s
}

fn up(dir: &Path, n: usize, job: LocalJob) -> anyhow::Result<LocalCluster> {
    LocalCluster::up_with(dir, n, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
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

#[test]
fn a_new_cluster_resumes_from_the_newest_checkpoint_after_every_host_is_lost() {
    let job = LocalJob { steps: 2000, checkpoint_every: 100, ..LocalJob::default() };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        None,
        false,
    );
}

#[test]
fn with_resume_required_a_new_cluster_waits_for_a_missing_checkpoint_directory() {
    // The shared directory is not there when the new cluster starts (a mount not up yet):
    // "if-present" would start the job over at step 0 for good; "required" waits for it.
    // Long enough that the first cluster is still training when its hosts are killed (an MLP
    // step takes a few milliseconds; every check of the log starts a `limpet` process).
    let job = LocalJob {
        steps: 4000,
        checkpoint_every: 100,
        checkpoint_resume: Some("required".into()),
        ..LocalJob::default()
    };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        None,
        true,
    );
}

/// An S3 client for moto (which takes any credentials).
fn s3_client(url: &str) -> aws_sdk_s3::Client {
    let conf = aws_sdk_s3::Config::builder()
        .behavior_version_latest()
        .region(aws_sdk_s3::config::Region::new("us-east-1"))
        .endpoint_url(url)
        .force_path_style(true)
        .credentials_provider(aws_sdk_s3::config::Credentials::new("test", "test", None, None, "test"))
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

#[test]
fn a_new_cluster_resumes_from_s3_when_no_host_kept_a_checkpoint() {
    // Each host checkpoints into its own state directory (lost with it) and copies to an S3
    // API (moto's server, spoken to by the real SDK); the new cluster has only the bucket.
    let moto = common::Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let remote = limpet_agent::remote::RemoteSettings {
        bucket: "limpet-ckpt".into(),
        prefix: "runs/mlp".into(),
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
    };
    let client = s3_client(&moto.url);
    rt.block_on(client.create_bucket().bucket("limpet-ckpt").send()).unwrap();
    let job = LocalJob {
        steps: 1200,
        checkpoint_every: 100,
        checkpoint_s3: Some(("s3://limpet-ckpt/runs/mlp".into(), moto.url.clone())),
        env: vec![
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ],
        ..LocalJob::default()
    };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        Some((remote, client)),
        false,
    );
}

#[test]
fn a_pipelined_job_resumes_from_its_stage_parts_after_every_host_is_lost() {
    // Two hosts, two stages (1x2): each stage's host writes its own part of a checkpoint.
    let job = LocalJob {
        model: "gpt".into(),
        data: "chars".into(),
        steps: 240,
        global_batch: 32,
        micro_batch: Some(8),
        pipeline: Some("2".into()),
        layers: Some(2),
        checkpoint_every: 40,
        ..LocalJob::default()
    };
    let alone = ["--model", "gpt", "--data", "chars", "--layers", "2", "--batch", "32", "--micro-batch", "8"];
    resume_after_losing_every_host(job, 90, &alone, None, false);
}

/// Runs `job` on two hosts with checkpoints to a shared directory (or, with `remote`, each
/// host's own directory copied to S3) until `kill_after` steps, kills both, starts a
/// brand-new cluster (new name, new raft log, new directories) with the same job, and checks
/// that it starts at the newest checkpoint and ends with the parameters of one uninterrupted
/// `limpet train` with `alone`. With `hide_dir`, the shared directory is away when the new
/// cluster starts and only comes back once the cluster has waited for it without training.
fn resume_after_losing_every_host(
    mut job: LocalJob,
    kill_after: u64,
    alone: &[&str],
    remote: Option<(limpet_agent::remote::RemoteSettings, aws_sdk_s3::Client)>,
    hide_dir: bool,
) {
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("checkpoints");
    if remote.is_none() {
        job.checkpoint_dir = Some(shared.clone());
        // With "required", even a new job's directory must be there, and be one limpet wrote
        // to or a mount (an empty directory on the parent's disk is an unmounted mount
        // point): the marker says this empty one is meant for a new job.
        std::fs::create_dir_all(&shared).unwrap();
        if job.checkpoint_resume.as_deref() == Some("required") {
            std::fs::write(shared.join(limpet_agent::checkpoint::MARKER), b"").unwrap();
        }
    }
    let (steps, every, pipelined) = (job.steps, job.checkpoint_every, job.pipeline.is_some());
    let first_dir = tmp.path().join("first");
    let mut first = up(&first_dir, 2, job.clone()).unwrap();
    let log = first.file.node("node-1").unwrap().step_log.clone();
    let passed = || steps_of(&log).last().is_some_and(|l| l.0 >= kill_after);
    wait_or_show(
        "the first cluster passes the kill step",
        Duration::from_secs(180),
        passed,
        Some(&first_dir),
    );
    // A checkpoint is in the log before the hosts go. With a directory, its files say so
    // at once; asking `limpet status` (a process per look) let a fast job finish meanwhile,
    // leaving the new cluster nothing to resume.
    wait_until("a checkpoint recorded in the log", Duration::from_secs(60), || match &remote {
        None => limpet_agent::checkpoint::list(&shared).is_ok_and(|listed| {
            let blocks = listed.iter().flat_map(|l| l.parts.iter().map(|(_, r)| r.end)).max().unwrap_or(0);
            listed.iter().any(|l| l.step >= 2 * every && l.complete(blocks))
        }),
        Some(_) => {
            let out =
                Command::new(exe()).args(["status", "--json", "--dir"]).arg(&first_dir).output().unwrap();
            let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            doc["checkpoints"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["step"].as_u64() >= Some(2 * every)))
        }
    });
    assert!(
        steps_of(&log).last().is_some_and(|l| l.0 + 1 < steps),
        "the first cluster finished its job before its hosts were killed: lengthen it"
    );
    // Every host lost at once.
    first.kill("node-1").unwrap();
    first.kill("node-2").unwrap();
    first.down();
    let listed: Vec<limpet_agent::checkpoint::Listed> = match &remote {
        None => limpet_agent::checkpoint::list(&shared).unwrap(),
        Some((r, client)) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let by_step =
                rt.block_on(limpet_agent::remote::Remote::with_client(client.clone(), r).list()).unwrap();
            by_step
                .into_iter()
                .map(|(step, parts)| limpet_agent::checkpoint::Listed {
                    step,
                    parts: parts.into_iter().map(|b| (PathBuf::new(), b)).collect(),
                    shards: Vec::new(),
                })
                .collect()
        }
    };
    // The model's block count: where the parts end.
    let blocks = listed.iter().flat_map(|l| l.parts.iter().map(|(_, r)| r.end)).max().unwrap();
    let newest = listed.iter().rev().find(|l| l.complete(blocks)).unwrap().step;
    assert!(newest >= 2 * every && newest % every == 0, "newest checkpoint {newest}");
    assert!(listed.len() <= 3, "keep = 2 (and one being written): {} kept", listed.len());

    let away = tmp.path().join("checkpoints.away");
    if hide_dir {
        std::fs::rename(&shared, &away).unwrap();
    }
    let mount_point = tmp.path().join("unmounted");
    let second_dir = tmp.path().join("second");
    let mut second = up(&second_dir, 2, job).unwrap();
    let logs_of = |n: &str| second.file.node(n).unwrap().step_log.clone();
    let (log1, log2) = (logs_of("node-1"), logs_of("node-2"));
    // The resume is recorded as the new cluster's first checkpoint (asked for at once: a
    // long job's later checkpoints push the oldest records out of the log's list).
    let resume_recorded = |doc: &serde_json::Value| {
        doc["checkpoints"].as_array().is_some_and(|c| {
            c.iter().any(|c| c["step"].as_u64() == Some(newest) && c["epoch"].as_u64() == Some(0))
        })
    };
    if hide_dir {
        wait_or_show(
            "the new cluster says it waits for the directory",
            Duration::from_secs(60),
            || logs(&second_dir).contains("cannot resume yet"),
            Some(&second_dir),
        );
        std::thread::sleep(Duration::from_secs(3));
        assert!(steps_of(&log1).is_empty() && steps_of(&log2).is_empty(), "trained without its checkpoint");
        // The mount point appears, empty (the volume not mounted on it yet): still no start.
        std::fs::create_dir(&shared).unwrap();
        wait_or_show(
            "the new cluster says an empty directory is not its checkpoints",
            Duration::from_secs(60),
            || logs(&second_dir).contains("unmounted mount point"),
            Some(&second_dir),
        );
        assert!(
            steps_of(&log1).is_empty() && steps_of(&log2).is_empty(),
            "trained from an empty mount point"
        );
        std::fs::rename(&shared, &mount_point).unwrap();
        std::fs::rename(&away, &shared).unwrap();
    }
    wait_or_show(
        "the resume recorded in the new cluster's log",
        Duration::from_secs(120),
        || {
            let out =
                Command::new(exe()).args(["status", "--json", "--dir"]).arg(&second_dir).output().unwrap();
            resume_recorded(&serde_json::from_slice(&out.stdout).unwrap_or_default())
        },
        Some(&second_dir),
    );
    let finished = || [&log1, &log2].iter().all(|l| steps_of(l).last().is_some_and(|l| l.0 == steps - 1));
    wait_or_show("the new cluster finishes the job", Duration::from_secs(300), finished, Some(&second_dir));
    let logged = steps_of(&log1);
    assert_eq!(
        logged[0].0,
        newest,
        "the new cluster's first step is the checkpoint's\n{}",
        logs(&second_dir)
    );
    // The final state (both hosts' parts when pipelined) is the uninterrupted job's, within
    // the data-parallel rounding tolerance of the elastic tests.
    let finals: Vec<PathBuf> =
        ["node-1", "node-2"].iter().map(|n| second_dir.join(n).join("checkpoint.safetensors")).collect();
    wait_until("the final checkpoints", Duration::from_secs(30), || finals.iter().all(|p| p.exists()));
    second.down();
    let alone_dir = tmp.path().join("alone");
    let report = train_alone(&alone_dir, alone, steps);
    if pipelined {
        // Stages draw their own dropout masks, so a pipelined run's parameters drift from
        // one process's; the elastic pipeline test compares the test loss for that reason.
        let (loss, _) = limpet_lab::demo::evaluate(&finals, None).unwrap();
        let reference = report["test_loss"].as_f64().unwrap();
        assert!(
            (loss - reference).abs() <= 0.01 * reference,
            "test loss {loss} (resumed) vs {reference} (one process)"
        );
    } else {
        let (_, mine) = params(&finals[0]);
        let (_, reference) = params(&alone_dir.join("checkpoint.safetensors"));
        let diff = max_rel_diff(&mine, &reference);
        assert!(diff < 1e-2, "parameters differ from one uninterrupted process by {diff:.2e}");
    }
}

#[test]
fn a_task_that_panics_takes_limpetd_down_with_a_non_zero_exit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    // The chaos hook makes the leader loop panic half a second after it starts: before, the
    // node stayed up as a leader that never scheduled an epoch again.
    let job = LocalJob {
        steps: 1_000_000,
        env: vec![("LIMPET_CHAOS_PANIC".into(), "lead".into())],
        ..LocalJob::default()
    };
    let mut c = up(&dir, 1, job).unwrap();
    let status = c.wait_exit("node-1", Duration::from_secs(60));
    let text = logs(&dir);
    let status = status.unwrap_or_else(|| panic!("limpetd still runs with a dead leader loop:\n{text}"));
    assert!(!status.success(), "exit status {status:?}\n{text}");
    assert!(text.contains("task lead failed: panicked: LIMPET_CHAOS_PANIC=lead"), "{text}");
    c.down();
}

#[test]
fn s3_pruning_counts_only_verified_uploads_of_the_running_job() {
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    let moto = common::Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = s3_client(&moto.url);
    rt.block_on(client.create_bucket().bucket("ckpt").send()).unwrap();
    let settings = limpet_agent::remote::RemoteSettings {
        bucket: "ckpt".into(),
        prefix: "run".into(),
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
    };
    let remote = limpet_agent::remote::Remote::with_client(client.clone(), &settings);
    let tmp = tempfile::tempdir().unwrap();
    // Steps 10 and 20 of job 1, then 50 and 60 of another run's job 2 under the same prefix
    // (a reused bucket): parts written, verified and uploaded as the agent does.
    let fingerprint = |job: u64| limpet_snapshot::job_fingerprint(&serde_json::json!({ "job": job }));
    for (step, job) in [(10u64, 1u64), (20, 1), (50, 2), (60, 2)] {
        let tensors = (0..4)
            .map(|b| {
                let name = format!("param/blocks.{b}.w");
                (name.clone(), RawTensor::from_f32(&name, vec![2], &[b as f32, step as f32]).unwrap())
            })
            .collect();
        let image = StateImage::new(step, step, RngState::new(1), serde_json::json!({ "job": job }), tensors);
        let path = limpet_agent::checkpoint::write_part(tmp.path(), &image, &(0..4), 0).unwrap();
        limpet_agent::checkpoint::verify_part(&path, &image).unwrap();
        rt.block_on(remote.upload(step, &(0..4), &path, image.content_hash(), &fingerprint(job))).unwrap();
    }
    // Steps 30 and 40: objects with a checkpoint's names but not verified uploads (a stray
    // copy, a half-finished tool): going by names, they would be the two kept.
    for step in [30u64, 40] {
        let key = format!("run/step-{step:012}/blocks-0-4.limpet");
        rt.block_on(
            client.put_object().bucket("ckpt").key(key).body(b"not a checkpoint".to_vec().into()).send(),
        )
        .unwrap();
    }
    let steps = || rt.block_on(remote.list()).unwrap().into_keys().collect::<Vec<u64>>();
    assert_eq!(steps(), vec![10, 20, 30, 40, 50, 60]);
    assert_eq!(rt.block_on(remote.prune(2, 4, &fingerprint(1))).unwrap(), Vec::<u64>::new());
    assert_eq!(steps(), vec![10, 20, 30, 40, 50, 60]);
    // Job 1 keeps its newest; the other run's newer steps neither count nor go.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint(1))).unwrap(), vec![10]);
    assert_eq!(steps(), vec![20, 30, 40, 50, 60]);
    // Job 2 prunes its own older step only: not job 1's, not the unverified objects.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint(2))).unwrap(), vec![50]);
    assert_eq!(steps(), vec![20, 30, 40, 60]);
}

/// The bytes of the files under `dir`.
fn walk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk_bytes(&p)
            } else {
                e.metadata().map_or(0, |m| m.len())
            }
        })
        .sum()
}

/// A tmpfs of `size` mounted at `dir` for the test's lifetime.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "mounting a tmpfs: {}", String::from_utf8_lossy(&out.stderr));
        SmallDisk(dir.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_checkpoint_disk_is_a_warning_and_a_metric_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    // 48 KiB: a checkpoint of the MLP (about 75 KB per part) cannot fit.
    let disk = SmallDisk::mount(&tmp.path().join("small"), "48k");
    let job = LocalJob {
        steps: 100_000,
        checkpoint_every: 50,
        checkpoint_dir: Some(disk.0.clone()),
        // No reserve: the disk really fills (the next test keeps a reserve).
        checkpoint_min_free: Some("0".into()),
        ..LocalJob::default()
    };
    let dir = tmp.path().join("c");
    let mut c = up(&dir, 2, job).unwrap();
    let failures = || -> f64 {
        c.file
            .nodes
            .iter()
            // A node not serving its metrics yet counts no failures.
            .filter_map(|n| get_text(&n.metrics).ok())
            .filter_map(|page| samples(&page).get("limpet_checkpoint_failures_total").copied())
            .sum()
    };
    wait_or_show("a checkpoint failure counted", Duration::from_secs(120), || failures() >= 1.0, Some(&dir));
    let log = c.file.nodes[0].step_log.clone();
    let at = steps_of(&log).last().map_or(0, |s| s.0);
    wait_or_show(
        "training on past the full disk, through more checkpoint attempts",
        Duration::from_secs(120),
        || steps_of(&log).last().is_some_and(|s| s.0 > at + 120 && s.2 == 2),
        Some(&dir),
    );
    assert!(failures() >= 2.0, "every attempt fails and is counted");
    let all = logs(&dir);
    assert!(all.contains("writing a checkpoint failed") && all.contains("No space left on device"), "{all}");
    // And the operator sees it without reading logs.
    let out = Command::new(exe()).args(["status", "--dir"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("checkpoints failing on node-1") && text.contains("No space left on device"),
        "{text}"
    );
    for n in &c.file.nodes {
        assert!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(n.pid as i32), None).is_ok(),
            "{} exited",
            n.name
        );
    }
    c.down();
    drop(disk);
}

/// The raft log (sled), the step logs and the checkpoints on one small disk: with a reserve
/// (`[checkpoint].min_free`), checkpoints stop before they take the room the log needs; the
/// refusal is a warning, a metric and a status line, and the cluster keeps committing.
#[test]
fn checkpoints_leave_the_reserve_to_the_raft_log_on_a_shared_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&tmp.path().join("shared"), "64m");
    let dir = disk.0.join("c");
    let job = LocalJob {
        steps: 100_000,
        checkpoint_every: 50,
        checkpoint_dir: Some(disk.0.join("ck")),
        // Room for the nodes' state and a few checkpoints (about 0.3 MB each), no more.
        checkpoint_min_free: Some("63M".into()),
        ..LocalJob::default()
    };
    let mut c = up(&dir, 2, job).unwrap();
    let failures = || -> f64 {
        c.file
            .nodes
            .iter()
            .filter_map(|n| get_text(&n.metrics).ok())
            .filter_map(|page| samples(&page).get("limpet_checkpoint_failures_total").copied())
            .sum()
    };
    wait_or_show("a checkpoint refused", Duration::from_secs(120), || failures() >= 1.0, Some(&dir));
    let all = logs(&dir);
    assert!(all.contains("[checkpoint].min_free") && !all.contains("No space left"), "{all}");
    let out = Command::new(exe()).args(["status", "--dir"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("checkpoints failing on") && text.contains("min_free"), "{text}");
    // What was written left the reserve; what was refused left nothing behind. The
    // checkpoints hold at most the disk less the reserve; the raft log on the same disk goes
    // on growing after the refusal (sled takes room a segment at a time), so the free room
    // may dip under the reserve by what the log took since, not by a checkpoint's worth more.
    let ck_bytes: u64 = walk_bytes(&disk.0.join("ck"));
    assert!(ck_bytes <= (64 - 63) << 20, "{ck_bytes} bytes of checkpoints: the reserve was eaten");
    let st = nix::sys::statvfs::statvfs(&disk.0).unwrap();
    let free = st.blocks_available() as u64 * st.fragment_size() as u64;
    assert!(free >= 60 << 20, "{free} bytes free: the reserve was eaten");
    // (A directory may be empty for the instant between its making and its part's write:
    // one still empty a moment later was left behind.)
    let empty = || -> Vec<PathBuf> {
        let dirs = std::fs::read_dir(disk.0.join("ck")).unwrap().flatten().map(|d| d.path());
        dirs.filter(|d| d.read_dir().is_ok_and(|mut e| e.next().is_none())).collect()
    };
    let first = empty();
    if !first.is_empty() {
        std::thread::sleep(Duration::from_secs(2));
        let left: Vec<_> = empty().into_iter().filter(|d| first.contains(d)).collect();
        assert!(left.is_empty(), "empty checkpoints left behind: {left:?}");
    }
    // The log still takes entries: a node drained now leaves through a committed epoch, and
    // training goes on at world 1.
    let out = Command::new(exe()).args(["drain", "node-2", "--dir"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = c.file.nodes[0].step_log.clone();
    wait_or_show(
        "training on at world 1 after the drain",
        Duration::from_secs(120),
        || steps_of(&log).last().is_some_and(|s| s.2 == 1),
        Some(&dir),
    );
    c.down();
    drop(disk);
}

/// The build cache (libtorch's venv, the data): `$LIMPET_CACHE` as the Makefile exports it,
/// else the default.
fn build_cache() -> PathBuf {
    std::env::var_os("LIMPET_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
        std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or(home.join(".cache")).join("limpet")
    })
}

/// `make dist`'s tarball (packed here from this build's binaries) holds everything a host
/// needs: unpacked into an empty directory, with the build cache hidden under a tmpfs in a
/// private mount namespace and `LD_LIBRARY_PATH` pointing nowhere, its `limpetd` validates a
/// configuration and its `limpet` trains.
#[test]
fn the_release_tarball_runs_with_the_build_cache_hidden() {
    let tmp = tempfile::tempdir().unwrap();
    let bins = Path::new(env!("CARGO_BIN_EXE_limpetd")).parent().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dist.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("--bin-dir")
        .arg(bins)
        .arg("--out")
        .arg(tmp.path().join("dist"))
        .args(["--variant", "cpu"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tarball = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let name = tarball.file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("limpet-") && name.ends_with("-linux-x86_64-cpu.tar.gz"), "{name}");
    // The .sha256 beside it is what cloud-init checks.
    let check = Command::new("sha256sum")
        .arg("-c")
        .arg(format!("{name}.sha256"))
        .current_dir(tmp.path().join("dist"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    // Extracted at / on a host: no entry may stand for / itself.
    let list = Command::new("tar").arg("-tzf").arg(&tarball).output().unwrap();
    let entries = String::from_utf8_lossy(&list.stdout).to_string();
    assert!(entries.lines().all(|e| e.starts_with("usr/") || e.starts_with("etc/")), "{entries}");
    for want in [
        "usr/local/bin/limpetd",
        "usr/local/bin/limpet",
        "etc/systemd/system/limpetd.service",
        "usr/local/lib/limpet/libtorch_cpu.so",
        "usr/local/share/limpet/traces/aws-p3-preemptions.csv",
    ] {
        assert!(entries.lines().any(|e| e == want), "{want} missing: {entries}");
    }
    assert!(!entries.contains("libtorch_cuda"), "the CPU variant carries CUDA: {entries}");
    let root = tmp.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let untar = Command::new("tar").arg("-C").arg(&root).arg("-xzf").arg(&tarball).status().unwrap();
    assert!(untar.success());

    // What the host brings: a configuration, a secret, the data.
    let digits = tmp.path().join("digits.csv.gz");
    std::fs::copy(limpet_trainer::data::default_digits_path(), &digits).unwrap();
    std::fs::write(tmp.path().join("secret"), "0123456789abcdef").unwrap();
    let config = tmp.path().join("limpetd.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"host-1\"\ncontrol = \"127.0.0.1:0\"\ndata = \"127.0.0.1:0\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n[cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n[job]\nmodel = \"mlp\"\ndata = \"digits\"\ndata_path = {:?}\nsteps = 10\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n[revocation]\nsources = \"none\"\n",
            tmp.path().join("state").display().to_string(),
            tmp.path().join("secret").display().to_string(),
            digits.display().to_string(),
        ),
    )
    .unwrap();
    let bin = root.join("usr/local/bin");
    let script = r#"set -e
mount -t tmpfs tmpfs "$CACHE"
test -z "$(ls -A "$CACHE")"
ldd "$BIN/limpetd" | grep -E 'libtorch_cpu|libc10'
"$BIN/limpetd" validate --config "$CONFIG"
"$BIN/limpet" train --model mlp --data digits --data-path "$DIGITS" --steps 20 --out "$OUT"
"#;
    let cache = build_cache();
    let run = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .env("CACHE", &cache)
        .env("BIN", &bin)
        .env("CONFIG", &config)
        .env("DIGITS", &digits)
        .env("OUT", tmp.path().join("run"))
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("LIMPET_CACHE", "/nonexistent")
        .env_remove("LIMPET_DIGITS")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    // The libraries came from the tarball, not from the (hidden) build cache.
    let lib_dir = root.join("usr/local/lib/limpet").display().to_string();
    assert!(
        text.lines()
            .filter(|l| l.contains("libtorch_cpu"))
            .all(|l| l.contains(&lib_dir) || l.contains("bin/../lib/limpet")),
        "{text}"
    );
    assert!(text.contains("valid (node host-1") && text.contains("test accuracy"), "{text}");
    assert!(text.contains("libtorch: CPU only: this binary's libtorch has no CUDA backend"), "{text}");
    assert!(tmp.path().join("run/checkpoint.safetensors").exists());
    if Path::new(env!("LIMPET_LIBTORCH_LIB")).join("libtorch_cuda.so").exists() {
        let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dist.sh");
        cuda_variant_loads_its_backend(&dist, bins, tmp.path(), &config);
    }
}

/// The CUDA variant, staged rather than packed (gigabytes of CUDA libraries): with the build
/// cache hidden, its `limpetd` loads libtorch's CUDA backend and the CUDA runtime from the
/// variant's own directory. (Without a GPU here, libtorch then says there is no driver.)
fn cuda_variant_loads_its_backend(script: &Path, bins: &Path, tmp: &Path, config: &Path) {
    let out = Command::new("bash")
        .arg(script)
        .arg("--bin-dir")
        .arg(bins)
        .arg("--out")
        .arg(tmp.join("staged"))
        .args(["--variant", "cuda", "--stage-only"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(root.display().to_string().ends_with("-cuda"), "{}", root.display());
    let lib_dir = root.join("usr/local/lib/limpet");
    let script = r#"set -e
mount -t tmpfs tmpfs "$CACHE"
ldd "$BIN/limpetd" | grep -E 'libtorch_cuda|libcudart'
"$BIN/limpetd" validate --config "$CONFIG" --json
"#;
    let run = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .env("CACHE", build_cache())
        .env("BIN", root.join("usr/local/bin"))
        .env("CONFIG", config)
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("LIMPET_CACHE", "/nonexistent")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    let lib = lib_dir.display().to_string();
    for want in ["libtorch_cuda.so", "libcudart.so"] {
        let line = text.lines().find(|l| l.contains(want)).unwrap_or_else(|| panic!("{want}: {text}"));
        assert!(
            line.contains(&lib) || line.contains("bin/../lib/limpet"),
            "{want} not from the variant: {line}"
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(text.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("{text}")))
            .unwrap();
    assert_eq!(v["libtorch"]["cuda_backend"], true, "{v}");
    assert!(v["libtorch"]["cuda_runtime"].as_str().is_some_and(|r| r.starts_with("libcudart.so")), "{v}");
}

/// The product binaries hold none of the lab: `make unit` builds `limpet` and `limpetd`
/// without the `lab` feature (as `make dist` does) into `LIMPET_PRODUCT_BINS`, and they have
/// no local-cluster flags, no drill keys and none of the lab's code, where the binaries the
/// tests run (built with it) have each. Plain `cargo test` builds no such binaries: there it
/// says so and checks nothing.
#[test]
fn the_product_binaries_hold_none_of_the_lab() {
    let Some(product) = std::env::var_os("LIMPET_PRODUCT_BINS").map(PathBuf::from) else {
        eprintln!(
            "skipped: LIMPET_PRODUCT_BINS is unset (make unit builds the product binaries and sets it)"
        );
        return;
    };
    let (limpet, limpetd) = (product.join("limpet"), product.join("limpetd"));
    // What the lab adds, as it appears in a binary: a string literal, a serde key, a module's
    // mangled path. The first three are in the tests' binaries too, which shows the search
    // would find them.
    let markers: [(&str, bool); 6] = [
        ("LIMPET_CHAOS_PANIC", true),
        ("slowdown_factor", true),
        ("cluster.json", true),
        ("fake_metadata", false),
        ("limpet_consensus7harness", false),
        ("elastic_svg", false),
    ];
    let read = |bin: &Path| std::fs::read(bin).unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let product = [(&limpet, read(&limpet)), (&limpetd, read(&limpetd))];
    let lab = [read(Path::new(env!("CARGO_BIN_EXE_limpet"))), read(Path::new(env!("CARGO_BIN_EXE_limpetd")))];
    for (marker, in_lab) in markers {
        let finder = memchr::memmem::Finder::new(marker);
        for (bin, bytes) in &product {
            assert!(
                finder.find(bytes).is_none(),
                "{} holds {marker:?}: lab code in the product",
                bin.display()
            );
        }
        if in_lab {
            assert!(lab.iter().any(|b| finder.find(b).is_some()), "the lab build holds no {marker:?}");
        }
    }
    // And as a user meets them: no --dir, no --hard, no drill key.
    let out = Command::new(&limpet).args(["status", "--dir", "/tmp"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--dir'"));
    let out =
        Command::new(&limpet).args(["revoke", "n1", "--hard", "--addr", "127.0.0.1:1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--hard'"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("secret"), "0123456789abcdef0123").unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = {:?}\n\
             secret_file = {:?}\nslowdown_factor = 2.0\n\n[cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
             [job]\nmodel = \"mlp\"\ndata = \"synthetic\"\nsteps = 10\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n\
             [revocation]\nsources = \"none\"\n",
            dir.path().join("state"),
            dir.path().join("secret")
        ),
    )
    .unwrap();
    let validate =
        |bin: &Path| Command::new(bin).args(["validate", "--config"]).arg(&config).output().unwrap();
    let out = validate(&limpetd);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `slowdown_factor`"));
    let lab = validate(Path::new(env!("CARGO_BIN_EXE_limpetd")));
    assert!(lab.status.success(), "{}", String::from_utf8_lossy(&lab.stderr));
}

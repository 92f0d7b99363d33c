//! Helpers the multi-process test files share (each includes this file as a module).

#![allow(dead_code)]

use limpet_deploy::{Fleet, FleetConfig};
use limpet_snapshot::StateImage;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `limpet` binary under test.
pub fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_limpet"))
}

/// The `limpet-lab` binary (demo, scenarios, benchmarks, local clusters, workers): another
/// package's, built beside `limpet` by `cargo test --workspace` (what `make test` runs).
pub fn lab_exe() -> PathBuf {
    let lab = exe().with_file_name("limpet-lab");
    assert!(lab.exists(), "{} is not built: run `cargo build --workspace --bins` first", lab.display());
    lab
}

/// Runs `limpet-lab scenario` with `args` for `steps` through `script` in `dir`; its JSON summary,
/// after checking what holds for every run: each step logged once, none applied twice. On
/// failure it shows every node's log.
pub fn scenario_json(dir: &Path, args: &[&str], steps: u64, script: &str) -> Value {
    let out = Command::new(lab_exe())
        .args(["scenario", "--json"])
        .args(args)
        .arg("--dir")
        .arg(dir)
        .args(["--steps", &steps.to_string(), "--script", script, "--timeout", "300"])
        .output()
        .unwrap();
    let logs = || {
        let mut s = String::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                s += &format!(
                    "--- {}\n{}",
                    e.path().display(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                );
            }
        }
        s
    };
    assert!(out.status.success(), "scenario failed: {}\n{}", String::from_utf8_lossy(&out.stderr), logs());
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["steps_applied_twice"], 0, "{summary:#}");
    assert_eq!(summary["steps_logged"], steps, "{summary:#}");
    // Every transition from the first epoch on, however many there were (status shows the
    // newest only; the driver keeps what it saw).
    assert_eq!(summary["transitions"][0]["cause"], "first epoch", "{summary:#}");
    summary
}

/// Runs `limpet-lab chaos --json` with `args` in `dir`; its report, after checking what
/// holds for every replay: it succeeded (else every node's log is shown), no step applied
/// twice, and each of `events` fired (a prefix of an event's description).
pub fn chaos_json(dir: &Path, args: &[&str], events: &[&str]) -> Value {
    let out =
        Command::new(lab_exe()).args(["chaos", "--json"]).args(args).arg("--dir").arg(dir).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), node_logs(dir));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["steps_applied_twice"], 0, "{r:#}");
    let fired: Vec<&str> = r["events"].as_array().unwrap().iter().map(|e| e[1].as_str().unwrap()).collect();
    for what in events {
        assert!(fired.iter().any(|e| e.starts_with(what)), "{what}: {fired:?}");
    }
    r
}

/// The first transition whose cause mentions `cause`.
pub fn transition<'a>(summary: &'a Value, cause: &str) -> &'a Value {
    summary["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["cause"].as_str().unwrap().contains(cause))
        .unwrap_or_else(|| panic!("no transition caused by {cause:?} in {summary:#}"))
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

/// The Python that deploy/setup.sh installed (with torch, safetensors, transformers and
/// moto): `LIMPET_PYTHON`, else the clone's `.limpet/python` wrapper.
pub fn python() -> PathBuf {
    std::env::var_os("LIMPET_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.limpet/python"))
}

/// moto's server (its EC2 and S3 APIs) on a loopback port, stopped on drop.
pub struct Moto {
    child: Child,
    /// Its base URL.
    pub url: String,
}

/// Starts moto's threaded server on a port the kernel gives it, prints the port and serves
/// until its standard input closes (when the test drops it, or dies); it logs errors only.
const MOTO: &str = "import logging, sys\n\
logging.getLogger('werkzeug').setLevel(logging.ERROR)\n\
from moto.server import ThreadedMotoServer\n\
s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n\
s.start()\n\
print(s.get_host_and_port()[1], flush=True)\n\
sys.stdin.read()\n";

impl Moto {
    /// Starts one. The server binds port 0 itself: a port picked here and handed over could be
    /// taken by another test's process in between (a CI run once found its bucket refused).
    pub fn start() -> Moto {
        use std::io::BufRead;
        let mut child = Command::new(python())
            .args(["-c", MOTO])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("moto is installed by deploy/setup.sh (make setup)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port: u16 =
            line.trim().parse().unwrap_or_else(|_| panic!("moto's server did not start: {line:?}"));
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(60), "moto's server does not answer on {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Moto { child, url: format!("http://127.0.0.1:{port}") }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fleet configuration that reaches `moto`'s EC2 API.
pub fn config(moto: &Moto) -> FleetConfig {
    FleetConfig {
        region: Some("us-east-1".into()),
        endpoint: Some(moto.url.clone()),
        credentials: Some(("testing".into(), "testing".into())),
    }
}

/// A launch template as an operator would have made one.
pub async fn make_template(fleet: &Fleet, name: &str) {
    let c = fleet.client();
    let images = c.describe_images().send().await.unwrap();
    let ami = images.images()[0].image_id().unwrap().to_string();
    c.create_launch_template()
        .launch_template_name(name)
        .launch_template_data(
            aws_sdk_ec2::types::RequestLaunchTemplateData::builder()
                .image_id(ami)
                .instance_type(aws_sdk_ec2::types::InstanceType::G5Xlarge)
                .build(),
        )
        .send()
        .await
        .unwrap();
}

/// The CA, certificate and key files of `name` in a certificate directory.
pub fn tls_files(dir: &Path, name: &str) -> limpet_consensus::tls::TlsFiles {
    limpet_consensus::tls::TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
    }
}

/// Every node's log in a local cluster's directory, each under its path.
pub fn node_logs(dir: &Path) -> String {
    let mut logs = String::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            logs += &format!("--- {}\n{}", e.path().display(), text);
        }
    }
    logs
}

/// Waits until `done`, failing with every node's log in `dir` after `within`.
pub fn wait_showing_logs(what: &str, within: Duration, dir: &Path, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}\n{}", node_logs(dir));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// (step, world) of each line of a node's step log.
pub fn step_worlds(path: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| (v["step"].as_u64().unwrap(), v["world"].as_u64().unwrap()))
        .collect()
}

/// A `Join` for node `id` at an address nobody serves: what a rogue proposes to take over
/// a rank.
pub fn rogue_join(id: u64, name: &str) -> limpet_consensus::state::Command {
    limpet_consensus::state::Command::Join {
        member: limpet_consensus::state::MemberSpec {
            id,
            name: name.into(),
            control_addr: "127.0.0.1:1".into(),
            data_addr: "127.0.0.1:2".into(),
            hardware: Default::default(),
        },
    }
}

/// What the step logs in `dir` say about the transition into epoch `epoch`, which starts at
/// the first step its survivors (the nodes that logged a step of it) trained in it (the
/// epoch's recorded start is the leader's estimate from reports, which survivors that were
/// further along pass: they enter at the step they hold): 1 when a survivor ended the old
/// epochs at `start - 1`, so that, training on, it was computing `start` when the
/// collective broke and that computation was thrown away (a lost step, which no step log
/// ever shows); 0 when every survivor stopped earlier. The definition of docs/status.md.
pub fn lost_by_step_logs(dir: &Path, epoch: u64) -> u64 {
    let mut last_before = Vec::new();
    let mut start = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".steps.jsonl") {
            continue;
        }
        let lines: Vec<Value> = std::fs::read_to_string(e.path())
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if !lines.iter().any(|l| l["epoch"].as_u64() == Some(epoch)) {
            continue;
        }
        let before = lines
            .iter()
            .filter(|l| l["epoch"].as_u64().unwrap() < epoch)
            .map(|l| l["step"].as_u64().unwrap())
            .max();
        if let Some(b) = before {
            last_before.push(b);
        }
        let first = lines
            .iter()
            .filter(|l| l["epoch"].as_u64() == Some(epoch))
            .filter_map(|l| l["step"].as_u64())
            .min();
        start = start.max(first.unwrap_or(0));
    }
    assert!(
        !last_before.is_empty(),
        "no survivor of epoch {epoch} logged an earlier step in {}",
        dir.display()
    );
    u64::from(last_before.iter().any(|&b| b + 1 == start))
}

/// The samples of a Prometheus text page: `name{labels}` to value.
pub fn samples(page: &str) -> std::collections::BTreeMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The samples `url` serves.
pub fn scrape(url: &str) -> std::collections::BTreeMap<String, f64> {
    samples(&limpet_lab::local::get_text(url).unwrap())
}

/// Waits for `done`, failing after `within`.
pub fn wait_until(what: &str, within: Duration, done: impl FnMut() -> bool) {
    wait_or_show(what, within, done, None);
}

/// Waits for `done`; on timeout the failure shows the logs of the cluster in `dir`.
pub fn wait_or_show(what: &str, within: Duration, mut done: impl FnMut() -> bool, dir: Option<&Path>) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < within,
            "{what}: not within {within:?}\n{}",
            dir.map(node_logs).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Steps a node logged: (step, epoch, world) per line.
pub fn step_records(path: &Path) -> Vec<(u64, u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| (v["step"].as_u64().unwrap(), v["epoch"].as_u64().unwrap(), v["world"].as_u64().unwrap()))
        .collect()
}

/// A local cluster of `n` founders training `job` in `dir`, with the `limpetd` under test.
pub fn up(
    dir: &Path,
    n: usize,
    job: limpet_lab::local::LocalJob,
) -> limpet_daemon::Result<limpet_lab::local::LocalCluster> {
    limpet_lab::local::LocalCluster::up_with(
        dir,
        n,
        job,
        &lab_exe(),
        Path::new(env!("CARGO_BIN_EXE_limpetd")),
    )
}

/// A certificate valid from two days ago until yesterday.
pub fn issue_expired(dir: &Path, name: &str, kind: limpet_daemon::certs::Kind) {
    let now = time::OffsetDateTime::now_utc();
    limpet_daemon::certs::issue(
        dir,
        name,
        kind,
        now - time::Duration::days(2),
        now - time::Duration::days(1),
    )
    .unwrap();
}

/// What the scripts "notice node-2, join, kill node-3" must show: no step lost to the notice,
/// state copied to the newcomer, at most the step in flight redone after the kill.
pub fn notice_join_and_kill_were_survived(summary: &Value) {
    assert_eq!(transition(summary, "notice for node 2")["lost_steps"], 0, "{summary:#}");
    assert!(transition(summary, "join of node 4")["fetched_bytes"].as_u64().unwrap() > 0, "{summary:#}");
    assert!(transition(summary, "failure of node 3")["lost_steps"].as_u64().unwrap() <= 1, "{summary:#}");
}

/// A ClientHello's first bytes (a handshake record announcing 512 bytes), then filler:
/// dribbled a byte at a time, each read of it returns within any per-read timeout, but the
/// record never completes.
pub fn slow_hello() -> Vec<u8> {
    [0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]
        .into_iter()
        .chain(std::iter::repeat(7))
        .take(517)
        .collect()
}

/// Dribbles `hello` over `conns` a byte per `every` until each is closed or `within`
/// passes; how many were still open at the end.
pub fn dribble(
    conns: &mut [(std::net::TcpStream, usize)],
    hello: &[u8],
    every: Duration,
    within: Duration,
) -> usize {
    let started = Instant::now();
    loop {
        let mut open = 0;
        for (s, sent) in conns.iter_mut() {
            s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
            let closed = matches!(std::io::Read::read(s, &mut [0u8; 64]), Ok(0))
                || (*sent < hello.len() && std::io::Write::write(s, &hello[*sent..*sent + 1]).is_err());
            if !closed {
                *sent += 1;
                open += 1;
            }
        }
        if open == 0 || started.elapsed() >= within {
            return open;
        }
        std::thread::sleep(every);
    }
}

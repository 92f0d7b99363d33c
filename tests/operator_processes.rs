//! What a first operator meets, through the binaries: which revocation sources `limpetd`
//! watches (detected, listed or explicitly none), one job from a config file or from
//! `limpet train` flags, reads that learn the cluster from the node, and `--json` where a
//! script calls.

use limpet_lab::fake_metadata::{Cloud, FakeMetadata};
use limpet_lab::local::{LocalCluster, LocalJob};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

#[path = "common.rs"]
mod common;
use common::{exe, node_logs, step_worlds, wait_showing_logs};

fn base_config(dir: &Path) -> String {
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123").unwrap();
    format!(
        "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n\
         [cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
         [job]\nmodel = \"mlp\"\ndata = \"digits\"\nsteps = 10\nglobal_batch = 8\n\n\
         [security]\ninsecure = true\n",
        dir.join("state").display().to_string(),
        secret.display().to_string()
    )
}

fn validate(dir: &Path, text: &str, json: bool) -> Output {
    let f = dir.join("node.toml");
    std::fs::write(&f, text).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_limpetd"));
    c.args(["validate", "--config"]).arg(&f);
    if json {
        c.arg("--json");
    }
    c.output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Endpoints of all three clouds at `aws`, `gcp`, `azure`.
fn endpoints(aws: &str, gcp: &str, azure: &str) -> String {
    format!("\n[revocation]\naws_endpoint = {aws:?}\ngcp_endpoint = {gcp:?}\nazure_endpoint = {azure:?}\n")
}

#[test]
fn limpetd_validate_says_which_revocation_sources_it_would_watch() {
    let tmp = tempfile::tempdir().unwrap();
    let base = base_config(tmp.path());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    // Nothing listens here: every probe is refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    for (cloud, name) in [(Cloud::Aws, "aws"), (Cloud::Gcp, "gcp"), (Cloud::Azure, "azure")] {
        let fake = rt.block_on(FakeMetadata::start_as("127.0.0.1:0".parse().unwrap(), cloud)).unwrap();
        // The section left at its default: the one cloud that answers is detected.
        let at = |c: Cloud| if c == cloud { fake.url() } else { dead.clone() };
        let auto = base.clone() + &endpoints(&at(Cloud::Aws), &at(Cloud::Gcp), &at(Cloud::Azure));
        let out = validate(tmp.path(), &auto, false);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        let line =
            stdout.lines().find(|l| l.starts_with("revocation: ")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.starts_with(&format!("revocation: {name} at {}", fake.url())), "{line}");
        assert!(line.contains("detected"), "{line}");
        let v: Value = serde_json::from_slice(&validate(tmp.path(), &auto, true).stdout).unwrap();
        assert_eq!(v["revocation"]["mode"], "auto");
        assert_eq!(v["revocation"]["sources"][0]["cloud"], name, "{v}");
        assert_eq!(v["revocation"]["sources"].as_array().unwrap().len(), 1, "{v}");
        rt.block_on(async { fake.stop() });
    }
    // Nothing answers: valid, but said loudly.
    let blind = base.clone() + &endpoints(&dead, &dead, &dead);
    let out = validate(tmp.path(), &blind, false);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("revocation: none: no cloud metadata service answered"), "{stdout}");
    assert!(stderr.contains("warning: this node would watch no revocation notices"), "{stderr}");
    // "none" is a choice, said as one; an empty list is refused rather than guessed at.
    let none = base.clone() + "\n[revocation]\nsources = \"none\"\n";
    let (stdout, stderr) = text(&validate(tmp.path(), &none, false));
    assert!(stdout.contains("revocation: none ([revocation].sources = \"none\""), "{stdout}");
    assert!(!stderr.contains("revocation"), "{stderr}");
    let empty = validate(tmp.path(), &(base.clone() + "\n[revocation]\nsources = []\n"), true);
    assert_eq!(empty.status.code(), Some(64));
    let v: Value = serde_json::from_slice(&empty.stdout).unwrap();
    assert_eq!(v["valid"], false, "{v}");
    assert!(v["key"].as_str().unwrap().starts_with("[revocation].sources"), "{v}");
    assert!(v["error"].as_str().unwrap().contains("sources = \"none\""), "{v}");
    let listed = base + "\n[revocation]\nsources = [\"gcp\"]\ngcp_endpoint = \"http://127.0.0.1:9\"\n";
    let (stdout, _) = text(&validate(tmp.path(), &listed, false));
    assert!(
        stdout.contains("revocation: gcp at http://127.0.0.1:9 (listed in [revocation].sources)"),
        "{stdout}"
    );
}

/// The libtorch the binaries were built against (deploy/link_libtorch.rs says).
fn libtorch_lib() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("LIMPET_LIBTORCH_LIB"))
}

/// The built binaries keep libtorch's CUDA backend among their NEEDED libraries wherever
/// that libtorch has one (the linker's --as-needed would drop it: nothing references its
/// symbols, yet libtorch registers CUDA only when it is loaded), and `limpetd validate` says
/// which backend libtorch offers, and why no GPU when there is none.
#[test]
fn the_binaries_link_libtorchs_cuda_backend_and_validate_reports_it() {
    let has_cuda = libtorch_lib().join("libtorch_cuda.so").exists();
    for bin in [env!("CARGO_BIN_EXE_limpetd"), env!("CARGO_BIN_EXE_limpet")] {
        let out = Command::new("readelf").args(["-d", bin]).output().expect("readelf (binutils)");
        let dynamic = String::from_utf8_lossy(&out.stdout);
        let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
        assert!(needed.iter().any(|l| l.contains("libtorch_cpu.so")), "{bin}: {needed:?}");
        assert_eq!(
            needed.iter().any(|l| l.contains("libtorch_cuda.so")),
            has_cuda,
            "{bin}: libtorch_cuda.so among NEEDED {needed:?}, libtorch has one: {has_cuda}"
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let base = base_config(tmp.path())
        + "
[revocation]
sources = \"none\"
";
    let (stdout, stderr) = text(&validate(tmp.path(), &base, false));
    let line =
        stdout.lines().find(|l| l.starts_with("libtorch: ")).unwrap_or_else(|| panic!("{stdout}{stderr}"));
    let v: Value = serde_json::from_slice(&validate(tmp.path(), &base, true).stdout).unwrap();
    assert_eq!(v["libtorch"]["cuda_backend"], has_cuda, "{v}");
    let devices = v["libtorch"]["devices"].as_u64().unwrap();
    if devices == 0 {
        // No GPU here: said, with the reason.
        assert!(line.starts_with("libtorch: CPU only: "), "{line}");
        let why = if has_cuda { "no NVIDIA driver" } else { "no CUDA backend" };
        assert!(line.contains(why) || line.contains("sees no device"), "{line}");
    } else {
        assert!(line.starts_with("libtorch: CUDA ("), "{line}");
    }
}

fn limpet(args: &[&str]) -> Output {
    Command::new(exe()).args(args).output().unwrap()
}

fn json_of(o: &Output) -> Value {
    let (stdout, stderr) = text(o);
    assert!(o.status.success(), "{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// A local cluster as a first operator meets it: status by address alone learns the cluster
/// (and a wrong `--cluster` is refused naming both clusters), step logs name their node, and
/// draining the leader hands over without a refused proposal; drain and revoke speak JSON;
/// a node configured with another job stops, naming the difference.
#[test]
fn status_by_address_named_step_logs_and_a_quiet_drain_of_the_leader() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let job = LocalJob { steps: 1_000_000, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 3, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let ds = dir.to_str().unwrap();
    let n1 = c.file.node("node-1").unwrap().clone();
    wait_showing_logs("the founders train", Duration::from_secs(120), &dir, || {
        step_worlds(&n1.step_log).len() > 20
    });

    // The startup log says which revocation sources the node watches, and why.
    let log = std::fs::read_to_string(&n1.log).unwrap();
    let want = format!("revocation sources: aws at {} (listed in [revocation].sources)", n1.metadata);
    assert!(log.contains(&want), "{want:?} not in\n{log}");

    // Status from an address alone: the cluster is the node's.
    let doc = json_of(&limpet(&["status", "--json", "--addr", &n1.control]));
    assert_eq!(doc["cluster"], c.file.cluster.as_str(), "{doc:#}");
    let wrong = limpet(&["status", "--addr", &n1.control, "--cluster", "elsewhere"]);
    assert!(!wrong.status.success());
    let (_, stderr) = text(&wrong);
    let want = format!("request for cluster \"elsewhere\"; this node serves cluster {:?}", c.file.cluster);
    assert!(stderr.contains(&want), "{stderr}");

    // Step logs name the node as well as its Raft id.
    let first: Value =
        serde_json::from_str(std::fs::read_to_string(&n1.step_log).unwrap().lines().next().unwrap()).unwrap();
    assert_eq!((first["name"].as_str(), first["node"].as_u64()), (Some("node-1"), Some(n1.id)), "{first}");

    // Drain the leader: the cluster goes on with two, and no controller proposed twice.
    let leader = doc["leader"].as_str().unwrap_or_else(|| panic!("no leader in {doc:#}")).to_string();
    let drained = json_of(&limpet(&["drain", &leader, "--dir", ds, "--json"]));
    assert_eq!(
        (drained["action"].as_str(), drained["node"].as_str()),
        (Some("drain"), Some(leader.as_str())),
        "{drained}"
    );
    assert!(drained["log_index"].as_u64().unwrap() > 0, "{drained}");
    let survivor = c.file.nodes.iter().find(|n| n.name != leader).unwrap().clone();
    let at_drain = step_worlds(&survivor.step_log).len();
    wait_showing_logs("two nodes train on after the leader's drain", Duration::from_secs(120), &dir, || {
        let s = step_worlds(&survivor.step_log);
        s.len() > at_drain + 30 && s.last().is_some_and(|l| l.1 == 2)
    });
    let logs = node_logs(&dir);
    for refused in ["proposal failed", "is not above"] {
        assert!(
            !logs.contains(refused),
            "a refused proposal around the leader's drain ({refused:?}):\n{logs}"
        );
    }

    // Once the drained leader has left the cluster, a heartbeat in its name is refused: a
    // report from a gone node must not make it look alive.
    let gone = c.file.node(&leader).unwrap().id;
    let cid = limpet_consensus::state::cluster_id(&c.file.cluster);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refusal = rt.block_on(async {
        use limpet_consensus::transport::pb;
        let url = format!("http://{}", survivor.control);
        let mut client = pb::consensus_client::ConsensusClient::connect(url).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let beat = pb::HeartbeatRequest {
                cluster_id: cid,
                from: gone,
                report: vec![],
                cluster: String::new(),
                urgent: false,
            };
            match client.heartbeat(beat).await {
                Err(e) if e.message().contains("has left the cluster") => break e,
                _ if std::time::Instant::now() > deadline => {
                    panic!("node {gone}'s heartbeats still accepted")
                }
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    });
    assert_eq!(refusal.code(), tonic::Code::PermissionDenied, "{refusal:?}");

    // A notice through the node's metadata service, reported as JSON.
    let other = c.file.nodes.iter().find(|n| n.name != leader && n.name != survivor.name).unwrap();
    let notice = json_of(&limpet(&["revoke", &other.name, "--in", "30", "--dir", ds, "--json"]));
    assert_eq!(
        (notice["action"].as_str(), notice["in_secs"].as_u64()),
        (Some("notice"), Some(30)),
        "{notice}"
    );
    assert_eq!(notice["via"], other.metadata.as_str(), "{notice}");

    // A node whose [job] is not the one the cluster's log holds stops once it reads the
    // log, naming what differs, with the usage exit status; the others train on.
    c.job.steps += 1;
    let odd = c.add().unwrap();
    let exit = c
        .wait_exit(&odd, Duration::from_secs(90))
        .unwrap_or_else(|| panic!("{odd} still runs\n{}", node_logs(&dir)));
    assert_eq!(exit.code(), Some(64), "{exit:?}");
    let log = std::fs::read_to_string(&c.file.node(&odd).unwrap().log).unwrap();
    let want = "this node's [job] is not the cluster's: steps: 1000001 vs 1000000";
    assert!(log.contains(want), "{want:?} not in\n{log}");
    let at = step_worlds(&survivor.step_log).len();
    wait_showing_logs("the others train on", Duration::from_secs(60), &dir, || {
        step_worlds(&survivor.step_log).len() > at + 10
    });
}

#[test]
fn certs_print_what_they_wrote_as_json() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("certs");
    let ds = d.to_str().unwrap();
    let ca = json_of(&limpet(&["certs", "init", "--dir", ds, "--cluster", "prod", "--json"]));
    assert_eq!((ca["kind"].as_str(), ca["cluster"].as_str()), (Some("ca"), Some("prod")), "{ca}");
    assert!(
        Path::new(ca["cert"].as_str().unwrap()).exists() && Path::new(ca["key"].as_str().unwrap()).exists()
    );
    let node = json_of(&limpet(&["certs", "issue", "gpu-1", "--id", "7", "--dir", ds, "--json"]));
    assert_eq!((node["kind"].as_str(), node["node_id"].as_u64()), (Some("node"), Some(7)), "{node}");
    assert_eq!(node["cert"].as_str().unwrap(), d.join("gpu-1.pem").to_str().unwrap());
    let op = json_of(&limpet(&["certs", "issue", "alice", "--client", "--dir", ds, "--json"]));
    assert_eq!((op["kind"].as_str(), op["node_id"].is_null()), (Some("client"), true), "{op}");
}

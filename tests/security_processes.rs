//! Certificates and what they refuse, with real processes, real TLS and real TCP:
//! - a cluster with certificates trains, and its nodes refuse callers without the right
//!   certificate (plain text, no certificate, another CA, expired, an operator speaking as a
//!   node), while an operator's certificate drains a node;
//! - `limpet certs` and `limpetd validate` from the command line, status for clients without
//!   a certificate where allowed, a scripted scenario and metrics over TLS.
//!
//! The data plane's TLS is `dataplane_tls_processes.rs`'s.

mod common;

use common::exe;
use limpet_consensus::tls::Tls;
use limpet_consensus::transport::pb;
use limpet_daemon::certs::{self, Kind};
use limpet_lab::local::{LocalCluster, LocalJob};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command as Process;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tls_files as files;
use common::{dribble, issue_expired, slow_hello};

use common::wait_showing_logs as wait_until;

use common::step_worlds as steps_of;

fn limpet(args: &[&str]) -> (bool, String) {
    let out = Process::new(exe()).args(args).env_remove("LIMPET_CA").output().unwrap();
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// A raw gRPC client with exactly the given CA and (optional) identity, so the node's own
/// refusal is tested, not the command line's checks.
async fn raw_client(
    addr: &str,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<pb::consensus_client::ConsensusClient<tonic::transport::Channel>, String> {
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(ca).unwrap()))
        .domain_name(limpet_consensus::tls::NODE_NAME);
    if let Some((cert, key)) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(
            std::fs::read(cert).unwrap(),
            std::fs::read(key).unwrap(),
        ));
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(pb::consensus_client::ConsensusClient::new(channel))
}

/// A control-plane server that answers every proposal "not the leader: node `leader` leads,
/// at `addr`", as a node does, and serves nothing else.
struct Redirector {
    leader: u64,
    addr: String,
}

#[tonic::async_trait]
impl pb::consensus_server::Consensus for Redirector {
    async fn send(
        &self,
        _: tonic::Request<pb::RaftBatch>,
    ) -> Result<tonic::Response<pb::SendAck>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
    async fn send_snapshot_chunk(
        &self,
        _: tonic::Request<pb::SnapshotChunk>,
    ) -> Result<tonic::Response<pb::SendAck>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
    async fn propose(
        &self,
        _: tonic::Request<pb::ProposeRequest>,
    ) -> Result<tonic::Response<pb::ProposeReply>, tonic::Status> {
        let mut s = tonic::Status::aborted("not the leader");
        s.metadata_mut().insert("limpet-leader-id", self.leader.to_string().parse().unwrap());
        s.metadata_mut().insert("limpet-leader-addr", self.addr.parse().unwrap());
        Err(s)
    }
    async fn read(
        &self,
        _: tonic::Request<pb::ReadRequest>,
    ) -> Result<tonic::Response<pb::ReadReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
    async fn status(
        &self,
        _: tonic::Request<pb::StatusRequest>,
    ) -> Result<tonic::Response<pb::StatusReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
    async fn heartbeat(
        &self,
        _: tonic::Request<pb::HeartbeatRequest>,
    ) -> Result<tonic::Response<pb::HeartbeatReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
    async fn reports(
        &self,
        _: tonic::Request<pb::ReportsRequest>,
    ) -> Result<tonic::Response<pb::ReportsReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("redirects only"))
    }
}

/// Whether a status call with this CA and identity is served.
async fn status_served(
    addr: &str,
    cluster_id: u64,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<(), String> {
    let mut c = raw_client(addr, ca, identity).await?;
    c.status(pb::StatusRequest { cluster_id, cluster: String::new() })
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn a_cluster_with_certificates_trains_and_refuses_callers_without_the_right_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 100_000, tls: true, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 3, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let logs: Vec<_> = c.file.nodes.iter().map(|n| n.step_log.clone()).collect();
    // Training over TLS: every node logs steps of world 3.
    wait_until("three nodes training over TLS", Duration::from_secs(120), &dir, || {
        logs.iter().all(|l| steps_of(l).iter().any(|&(_, w)| w == 3))
    });
    let addr = c.file.nodes[0].control.clone();
    let cluster = c.file.cluster.clone();
    let cid = limpet_consensus::state::cluster_id(&cluster);
    let certs_dir = c.certs_dir();
    let ca = certs_dir.join("ca.pem");
    let d = dir.display().to_string();

    // The command line with the cluster's operator certificate (from cluster.json).
    let (ok, out) = limpet(&["status", "--dir", &d, "--json"]);
    assert!(ok, "{out}");
    assert!(out.contains("\"node-3\""), "{out}");

    // Plain text to a TLS node.
    let (ok, out) = limpet(&["status", "--addr", &addr, "--cluster", &cluster]);
    assert!(!ok && out.contains("does the cluster run with certificates"), "{out}");
    // The CA but no client certificate: status is not anonymous by default, drain never is.
    let (ok, out) =
        limpet(&["status", "--addr", &addr, "--cluster", &cluster, "--ca", &ca.display().to_string()]);
    assert!(!ok && out.contains("refused a client without a certificate"), "{out}");
    let (ok, out) = limpet(&[
        "drain",
        "node-3",
        "--addr",
        &addr,
        "--cluster",
        &cluster,
        "--ca",
        &ca.display().to_string(),
    ]);
    assert!(!ok, "{out}");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let operator = files(&certs_dir, "operator");
    rt.block_on(async {
        // The operator's certificate is served...
        status_served(&addr, cid, &ca, Some((&operator.cert, &operator.key))).await.unwrap();
        // ...another cluster's CA's is not,
        let other = tmp.path().join("other-ca");
        certs::init(&other, "other", 10).unwrap();
        certs::issue_for_days(&other, "mallory", Kind::Client, 10).unwrap();
        let m = files(&other, "mallory");
        let e = status_served(&addr, cid, &ca, Some((&m.cert, &m.key))).await.unwrap_err();
        assert!(!e.is_empty());
        // ...nor an expired one of the right CA,
        issue_expired(&certs_dir, "old-operator", Kind::Client);
        let o = files(&certs_dir, "old-operator");
        status_served(&addr, cid, &ca, Some((&o.cert, &o.key))).await.unwrap_err();
        // ...nor none at all.
        status_served(&addr, cid, &ca, None).await.unwrap_err();

        // An operator may not speak for a node: no raft traffic, no joining.
        let mut op = raw_client(&addr, &ca, Some((&operator.cert, &operator.key))).await.unwrap();
        let e = op
            .send(pb::RaftBatch {
                cluster_id: cid,
                from: 1,
                from_addr: String::new(),
                messages: vec![],
                snapshot_chunked: false,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let join = common::rogue_join(99, "intruder");
        let e = op
            .propose(pb::ProposeRequest {
                cluster_id: cid,
                command: serde_json::to_vec(&join).unwrap(),
                timeout_ms: 2000,
                cluster: String::new(),
            })
            .await
            .unwrap_err();
        assert!(e.message().contains("an operator may not propose join"), "{e:?}");
    });

    // The control port under a flood of connections from one address, each dribbling a
    // ClientHello: past the address's share of the slots they are closed at once, the rest
    // are cut at the TLS handshake's timeout, and the operator's established channel is
    // served throughout.
    {
        use limpet_consensus::tls::GRPC_HANDSHAKE_TIMEOUT;
        use limpet_consensus::{address_cap, MAX_CONTROL_CONNECTIONS};
        // The flood comes from the members' own address (loopback): its cap is the address's
        // share grown by the members there.
        let cap = address_cap(c.file.nodes.len());
        let mut op = rt.block_on(raw_client(&addr, &ca, Some((&operator.cert, &operator.key)))).unwrap();
        let hello = slow_hello();
        let mut conns: Vec<_> = (0..MAX_CONTROL_CONNECTIONS + 40)
            .map(|_| (std::net::TcpStream::connect(&addr).unwrap(), 0))
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let open = dribble(&mut conns, &hello, Duration::from_millis(500), Duration::ZERO);
        assert!(open <= cap, "{open} connections from one address open past its cap of {cap}");
        rt.block_on(op.status(pb::StatusRequest { cluster_id: cid, cluster: String::new() })).unwrap();
        let started = Instant::now();
        let open = dribble(&mut conns, &hello, Duration::from_millis(500), GRPC_HANDSHAKE_TIMEOUT * 2);
        assert_eq!(open, 0, "dribbled control-plane handshakes open after {:?}", started.elapsed());
        rt.block_on(op.status(pb::StatusRequest { cluster_id: cid, cluster: String::new() })).unwrap();
        rt.block_on(status_served(&addr, cid, &ca, Some((&operator.cert, &operator.key)))).unwrap();
    }

    // A node's raft sender checks that the server it reaches is the node it dials (every node
    // certificate holds the same name): node 1's address, dialled as node 2, is refused;
    // dialled as node 1, it takes the batch.
    {
        use limpet_consensus::transport::{PeerReport, PeerSender};
        use raft::prelude::{Message, MessageType};
        let me = Arc::new(Tls::load(&files(&certs_dir, "node-3")).unwrap());
        let node1 = c.file.nodes[0].control.clone();
        let stale = |to: u64| {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgHeartbeatResponse);
            (m.from, m.to, m.term) = (3, to, 1);
            m
        };
        rt.block_on(async {
            let (tx, mut reports) = tokio::sync::mpsc::unbounded_channel();
            let tasks = limpet_consensus::tasks::Tasks::new(tokio_util::sync::CancellationToken::new());
            let wrong = PeerSender::spawn(
                (cid, limpet_consensus::chunks::SNAPSHOT_CHUNK_BYTES),
                (3, String::new()),
                2,
                node1.clone(),
                Some(Arc::clone(&me)),
                tx.clone(),
                &tasks,
            );
            // (Addressed to node 1, which the server is and would accept: only the sender's own
            // check can refuse it, as it must refuse a hostile server that accepts anything.)
            assert!(wrong.send(stale(1)));
            let r = tokio::time::timeout(Duration::from_secs(10), reports.recv()).await.unwrap().unwrap();
            assert!(matches!(r, PeerReport::Unreachable(2)), "{r:?}");
            let right = PeerSender::spawn(
                (cid, limpet_consensus::chunks::SNAPSHOT_CHUNK_BYTES),
                (3, String::new()),
                1,
                node1.clone(),
                Some(Arc::clone(&me)),
                tx,
                &tasks,
            );
            assert!(right.send(stale(1)));
            let r = tokio::time::timeout(Duration::from_secs(4), reports.recv()).await;
            assert!(r.is_err(), "the sender to node 1 at node 1's address reported {r:?}");
        });
    }

    // A node answering a proposal with "the leader is node 3, at this address" while the
    // address is node 1's (a member answering for another, or a stale address): the client
    // follows it only to node 3's certificate. Unpinned, node 1 would take the proposal (or
    // pass it on to the leader).
    {
        let node2 = Tls::load(&files(&certs_dir, "node-2")).unwrap();
        let redirect = Redirector { leader: 3, addr: c.file.nodes[0].control.clone() };
        let op_tls = Tls::load(&operator).unwrap();
        rt.block_on(async {
            let incoming =
                tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let fake = incoming.local_addr().unwrap().to_string();
            let server = tonic::transport::Server::builder()
                .tls_config(node2.grpc_server())
                .unwrap()
                .add_service(pb::consensus_server::ConsensusServer::new(redirect))
                .serve_with_incoming(incoming);
            let served = tokio::spawn(server);
            let mut client =
                limpet_consensus::Client::connect_with(&fake, &cluster, Some(&op_tls)).await.unwrap();
            let drain = limpet_consensus::state::Command::Drain { id: 99, reason: "redirect test".into() };
            let e = client.propose(&drain, Duration::from_secs(2)).await.unwrap_err().to_string();
            assert!(e.contains("was to be node 3, but its certificate is node 1's"), "{e}");
            served.abort();
        });
    }

    // A second operator's certificate, revoked: refused by every node from then on (the
    // cluster's other certificates are not).
    certs::issue_for_days(&certs_dir, "op2", Kind::Client, 10).unwrap();
    let op2 = files(&certs_dir, "op2");
    rt.block_on(async {
        for n in &c.file.nodes {
            status_served(&n.control, cid, &ca, Some((&op2.cert, &op2.key))).await.unwrap();
        }
    });
    let (ok, out) = limpet(&["certs", "revoke", &op2.cert.display().to_string(), "--dir", &d]);
    assert!(ok && out.contains("revoked"), "{out}");
    rt.block_on(async {
        for n in &c.file.nodes {
            let deadline = Instant::now() + Duration::from_secs(10);
            let e = loop {
                match status_served(&n.control, cid, &ca, Some((&op2.cert, &op2.key))).await {
                    Err(e) => break e,
                    Ok(()) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    Ok(()) => panic!("{} still serves a revoked certificate", n.name),
                }
            };
            assert!(e.contains("is revoked"), "{e}");
            status_served(&n.control, cid, &ca, Some((&operator.cert, &operator.key))).await.unwrap();
        }
    });

    // An on-call certificate reads and drains, and may neither revoke nor remove: it drains
    // a node (through whichever node answers first: one that does not lead sends the
    // command line to the leader), and the others train on.
    certs::issue_for_days(&certs_dir, "pager", Kind::OnCall, 10).unwrap();
    let pager = files(&certs_dir, "pager");
    let (ca_s, cert_s, key_s) =
        (ca.display().to_string(), pager.cert.display().to_string(), pager.key.display().to_string());
    let as_pager = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend([
            "--addr",
            &addr,
            "--cluster",
            &cluster,
            "--ca",
            &ca_s,
            "--cert",
            &cert_s,
            "--key",
            &key_s,
        ]);
        limpet(&all)
    };
    let (ok, out) = as_pager(&["status"]);
    assert!(ok && out.contains("node-3"), "{out}");
    let (ok, out) = as_pager(&["revoke", "node-2", "--in", "60"]);
    assert!(!ok && out.contains("on-call certificate may not propose notice"), "{out}");
    rt.block_on(async {
        let tls = Tls::load(&pager).unwrap();
        let mut client = limpet_consensus::Client::connect_with(&addr, &cluster, Some(&tls)).await.unwrap();
        let remove = limpet_consensus::state::Command::Remove { id: 2, reason: "pager".into() };
        let e = client.propose(&remove, Duration::from_secs(5)).await.unwrap_err().to_string();
        assert!(e.contains("on-call certificate may not propose remove"), "{e}");
    });
    let (ok, out) = as_pager(&["drain", "node-3"]);
    assert!(ok, "{out}");
    wait_until("world 2 after the drain", Duration::from_secs(60), &dir, || {
        steps_of(&logs[0]).iter().any(|&(_, w)| w == 2)
    });
    // No member named intruder was ever admitted.
    let (ok, out) = limpet(&["status", "--dir", &d, "--json"]);
    assert!(ok && !out.contains("intruder"), "{out}");
    c.down();
}

// ---- the data plane ----------------------------------------------------------------------

#[test]
fn limpet_certs_and_limpetd_validate_from_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("certs");
    let ds = d.display().to_string();
    let (ok, out) = limpet(&["certs", "issue", "n1", "--dir", &ds]);
    assert!(!ok && out.contains("limpet certs init"), "{out}");
    for args in [
        vec!["certs", "init", "--dir", &ds, "--cluster", "t"],
        // Bound to the id a node named "a" gets (its configuration below sets no id)...
        vec!["certs", "issue", "a", "--dir", &ds],
        // ...and to node 5.
        vec!["certs", "issue", "n1", "--dir", &ds, "--id", "5"],
        vec!["certs", "issue", "alice", "--dir", &ds, "--client"],
    ] {
        let (ok, out) = limpet(&args);
        assert!(ok, "{args:?}: {out}");
    }
    // Nothing is overwritten; bad names are usage errors (exit 64).
    let again = Process::new(exe()).args(["certs", "init", "--dir", &ds]).output().unwrap();
    assert_eq!(again.status.code(), Some(64), "{}", String::from_utf8_lossy(&again.stderr));
    let bad = Process::new(exe()).args(["certs", "issue", "../x", "--dir", &ds]).output().unwrap();
    assert_eq!(bad.status.code(), Some(64));
    issue_expired(&d, "old", Kind::Node(1));

    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef0123").unwrap();
    let config = |name: &str| {
        format!(
            "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n\
             [cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
             [job]\nmodel = \"mlp\"\ndata = \"digits\"\nsteps = 10\nglobal_batch = 8\n\n\
             [security]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\n[revocation]\nsources = \"none\"\n",
            tmp.path().join("state").display().to_string(),
            secret.display().to_string(),
            d.join("ca.pem").display().to_string(),
            d.join(format!("{name}.pem")).display().to_string(),
            d.join(format!("{name}.key")).display().to_string(),
        )
    };
    let validate = |name: &str| {
        let f = tmp.path().join("node.toml");
        std::fs::write(&f, config(name)).unwrap();
        Process::new(env!("CARGO_BIN_EXE_limpetd")).args(["validate", "--config"]).arg(&f).output().unwrap()
    };
    let ok = validate("a");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    for (name, want) in [
        ("old", "expired"),
        ("alice", "operator certificate"),
        ("nobody", "nobody.pem"),
        ("n1", "node 5's certificate, but this node is node"),
    ] {
        let out = validate(name);
        let msg = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{name}: {msg}");
        assert!(msg.contains("[security].") && msg.contains(want), "{name}: {msg}");
    }
}

#[test]
fn anonymous_status_lets_a_client_without_a_certificate_read_but_never_drain() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 100_000, tls: true, anonymous_status: true, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 1, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let log = c.file.nodes[0].step_log.clone();
    wait_until("the node trains", Duration::from_secs(120), &dir, || !steps_of(&log).is_empty());
    let (addr, cluster) = (c.file.nodes[0].control.clone(), c.file.cluster.clone());
    let ca = c.certs_dir().join("ca.pem").display().to_string();
    let (ok, out) = limpet(&["status", "--addr", &addr, "--cluster", &cluster, "--ca", &ca, "--json"]);
    assert!(ok && out.contains("\"node-1\""), "{out}");
    let (ok, out) = limpet(&["drain", "node-1", "--addr", &addr, "--cluster", &cluster, "--ca", &ca]);
    assert!(!ok && out.contains("drain and revoke need one"), "{out}");
    let (ok, out) =
        limpet(&["revoke", "node-1", "--in", "60", "--addr", &addr, "--cluster", &cluster, "--ca", &ca]);
    assert!(!ok && out.contains("need"), "{out}");
    c.down();
}

/// The demo's scenario under certificates (what `make demo` runs): a spot notice, a join
/// (the newcomer gets its own node certificate and copies state over TLS), a `kill -9` and
/// an operator's drain, each one epoch change, with every step logged once.
/// Run by `make long-test` (about a minute and a half): the test above trains with
/// certificates in `make test`, and the same scenario without them runs there.
#[test]
#[ignore = "a long scenario: `make long-test` runs it"]
fn a_scripted_scenario_runs_end_to_end_with_certificates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let out = Process::new(common::lab_exe())
        .args(["scenario", "--json", "--tls", "--dir"])
        .arg(&dir)
        .args(["--nodes", "3", "--model", "gpt", "--data", "chars", "--steps", "800", "--batch", "32"])
        .args([
            "--script",
            "0.15:notice:node-2:20,0.35:join,0.55:kill:node-3,0.75:drain:node-4",
            "--timeout",
            "300",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "scenario failed: {}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["steps_logged"], 800, "{summary:#}");
    assert_eq!(summary["steps_applied_twice"], 0, "{summary:#}");
    let causes: Vec<String> = summary["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["cause"].as_str().unwrap().to_string())
        .collect();
    let want = ["first epoch", "notice for node 2", "join of node 4", "failure of node 3", "drain of node 4"];
    assert_eq!(causes.len(), want.len(), "{causes:?}");
    for (got, want) in causes.iter().zip(want) {
        assert!(got.starts_with(want), "{causes:?}");
    }
    let joined = &summary["transitions"][2];
    assert!(joined["fetched_bytes"].as_u64().unwrap() > 0, "the newcomer copied no state: {joined}");
    // Every node, the newcomer included, ran with its own certificate of the run's CA.
    for n in 1..=4 {
        let cfg = std::fs::read_to_string(dir.join(format!("node-{n}.toml"))).unwrap();
        assert!(cfg.contains("[security]"), "node-{n} ran without certificates:\n{cfg}");
        let tls = Tls::load(&files(&dir.join("certs"), &format!("node-{n}"))).unwrap();
        assert_eq!(tls.role(), Some(limpet_consensus::tls::Role::Node));
    }
}

/// GET /metrics over TLS with `client`, as Prometheus would with `server_name: limpet-node`:
/// the response, or why there is none.
fn https_metrics(addr: &str, client: Arc<rustls::ClientConfig>) -> Result<String, String> {
    let tcp = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let name = rustls::pki_types::ServerName::try_from(limpet_consensus::tls::NODE_NAME).unwrap();
    let conn = rustls::ClientConnection::new(client, name).map_err(|e| e.to_string())?;
    let mut s = rustls::StreamOwned::new(conn, tcp);
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: limpet-node\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    match s.read_to_end(&mut body) {
        Ok(_) => {}
        // The answer is whole once the server closes; a close without close_notify is not a
        // refusal.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !body.is_empty() => {}
        Err(e) => return Err(e.to_string()),
    }
    let text = String::from_utf8_lossy(&body).to_string();
    if text.is_empty() {
        return Err("closed without an answer".into());
    }
    Ok(text)
}

/// A client trusting `ca`, presenting `identity` (certificate and key files) if given: built
/// by hand, so that a certificate of another CA can be presented at all.
fn metrics_client(ca: &Path, identity: Option<(&Path, &Path)>) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert).unwrap().map(Result::unwrap).collect();
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap()).unwrap()
        }
    })
}

/// `[node].metrics_tls`: the metrics answer a client with a certificate of the cluster CA
/// over TLS, and nobody else: not plain HTTP, not a client without a certificate, not one
/// of another CA.
#[test]
fn metrics_over_tls_answer_only_clients_with_a_certificate_of_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 100_000, tls: true, metrics_tls: true, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 1, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let log = c.file.nodes[0].step_log.clone();
    wait_until("the node trains", Duration::from_secs(120), &dir, || !steps_of(&log).is_empty());
    let url = c.file.nodes[0].metrics.clone();
    let addr = url.strip_prefix("https://").and_then(|u| u.strip_suffix("/metrics")).expect(&url).to_string();
    let certs_dir = c.certs_dir();

    let operator = Tls::load(&files(&certs_dir, "operator")).unwrap();
    let page = https_metrics(&addr, operator.data_client().unwrap()).unwrap();
    assert!(page.starts_with("HTTP/1.1 200") && page.contains("limpet_steps_total"), "{page}");

    let plain = limpet_lab::local::get_text(&format!("http://{addr}/metrics"));
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");
    let ca = certs_dir.join("ca.pem");
    let anonymous = https_metrics(&addr, metrics_client(&ca, None));
    assert!(anonymous.is_err(), "a client without a certificate was answered: {anonymous:?}");
    // The same client code with the operator's certificate is answered: the refusals above
    // and below are the server's.
    let op = (certs_dir.join("operator.pem"), certs_dir.join("operator.key"));
    assert!(https_metrics(&addr, metrics_client(&ca, Some((&op.0, &op.1)))).is_ok());
    let other = tmp.path().join("other");
    certs::init(&other, "other", 10).unwrap();
    let (cert, key) = certs::issue_for_days(&other, "mallory", Kind::Client, 1).unwrap();
    let refused = https_metrics(&addr, metrics_client(&ca, Some((&cert, &key))));
    assert!(refused.is_err(), "another CA's certificate was answered: {refused:?}");
    // Still serving after the refusals.
    assert!(https_metrics(&addr, operator.data_client().unwrap()).unwrap().contains("limpet_steps_total"));
    c.down();
}

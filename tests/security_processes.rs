//! Certificates and what they refuse, with real processes, real TLS and real TCP:
//! - a cluster with certificates trains, and its nodes refuse callers without the right
//!   certificate (plain text, no certificate, another CA, expired, an operator speaking as a
//!   node), while an operator's certificate drains a node;
//! - data-plane collectives over TLS sum exactly; connections with a foreign, expired or
//!   operator certificate are refused; a replayed or spliced TLS record breaks the collective
//!   on every rank, and a replayed session is never accepted.

mod common;

use common::exe;
use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, DataPlaneError, DataTls, Endpoint};
use limpet_consensus::tls::Tls;
use limpet_consensus::transport::pb;
use limpet_daemon::certs::{self, Kind};
use limpet_lab::local::{LocalCluster, LocalJob};
use proptest::prelude::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command as Process;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use time::OffsetDateTime;

use common::tls_files as files;

/// A certificate valid from two days ago until yesterday.
fn issue_expired(dir: &Path, name: &str, kind: Kind) {
    let now = OffsetDateTime::now_utc();
    certs::issue(dir, name, kind, now - time::Duration::days(2), now - time::Duration::days(1)).unwrap();
}

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
            .send(pb::RaftBatch { cluster_id: cid, from: 1, from_addr: String::new(), messages: vec![] })
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
        use limpet_consensus::{MAX_CONNECTIONS_PER_ADDRESS, MAX_CONTROL_CONNECTIONS};
        let mut op = rt.block_on(raw_client(&addr, &ca, Some((&operator.cert, &operator.key)))).unwrap();
        let hello = slow_hello();
        let mut conns: Vec<_> = (0..MAX_CONTROL_CONNECTIONS + 40)
            .map(|_| (std::net::TcpStream::connect(&addr).unwrap(), 0))
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let open = dribble(&mut conns, &hello, Duration::from_millis(500), Duration::ZERO);
        assert!(
            open <= MAX_CONNECTIONS_PER_ADDRESS,
            "{open} connections from one address open past its cap of {MAX_CONNECTIONS_PER_ADDRESS}"
        );
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
            let wrong = PeerSender::spawn(
                cid,
                (3, String::new()),
                2,
                node1.clone(),
                Some(Arc::clone(&me)),
                tx.clone(),
            );
            // (Addressed to node 1, which the server is and would accept: only the sender's own
            // check can refuse it, as it must refuse a hostile server that accepts anything.)
            assert!(wrong.send(stale(1)));
            let r = tokio::time::timeout(Duration::from_secs(10), reports.recv()).await.unwrap().unwrap();
            assert!(matches!(r, PeerReport::Unreachable(2)), "{r:?}");
            let right =
                PeerSender::spawn(cid, (3, String::new()), 1, node1.clone(), Some(Arc::clone(&me)), tx);
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

    // The operator's certificate drains a node (through whichever node answers first: one
    // that does not lead sends the command line to the leader), and the others train on.
    let (ok, out) = limpet(&["drain", "node-3", "--dir", &d]);
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

const SECRET: &[u8] = b"0123456789abcdef-test-secret";

/// A CA in `dir` with node certificates for `nodes`.
fn node_certs(dir: &Path, nodes: &[u64]) {
    certs::init(dir, "dp", 10).unwrap();
    for n in nodes {
        certs::issue_for_days(dir, &format!("n{n}"), Kind::Node(*n), 10).unwrap();
    }
}

fn data_tls(dir: &Path, name: &str) -> DataTls {
    DataTls::from_tls(&Tls::load(&files(dir, name)).unwrap()).unwrap()
}

fn endpoint(node: u64, tls: Option<DataTls>, chunk_bytes: usize) -> Endpoint {
    let mut cfg = DataPlaneConfig::new(77, node, SECRET.to_vec());
    cfg.timeout = Duration::from_secs(3);
    cfg.chunk_bytes = chunk_bytes;
    cfg.tls = tls;
    Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

fn input(node: u64, len: usize) -> Vec<f32> {
    (0..len).map(|i| (node as f32) * 0.25 + (i % 89) as f32 * 0.5 - 7.0).collect()
}

/// Allreduces each node's input over `addrs` (the addresses the ranks dial), one thread per
/// rank; each rank's result or error.
fn allreduce(
    eps: &[Endpoint],
    nodes: &[u64],
    addrs: &[String],
    len: usize,
) -> Vec<Result<Vec<f32>, DataPlaneError>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .iter()
            .zip(nodes)
            .map(|(ep, &n)| {
                s.spawn(move || {
                    let mut g = ep.group(1, nodes, addrs)?;
                    let mut buf = input(n, len);
                    g.allreduce_sum(&mut buf, 3)?;
                    Ok(buf)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// The TLS ring sums exactly what the plain one does, for any world and length (small
    /// chunks: many frames, and records split across them).
    #[test]
    fn tls_allreduce_equals_the_elementwise_sum(world in 1usize..=4, len in 0usize..150_000) {
        let tmp = tempfile::tempdir().unwrap();
        let nodes: Vec<u64> = (1..=world as u64).collect();
        node_certs(tmp.path(), &nodes);
        let eps: Vec<Endpoint> =
            nodes.iter().map(|&n| endpoint(n, Some(data_tls(tmp.path(), &format!("n{n}"))), 4096)).collect();
        let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
        let inputs: Vec<Vec<f32>> = nodes.iter().map(|&n| input(n, len)).collect();
        let want: Vec<f32> = (0..len).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        for r in allreduce(&eps, &nodes, &addrs, len) {
            let got = r.unwrap();
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
            }
        }
    }
}

#[test]
fn connections_with_a_foreign_expired_or_operator_certificate_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (good, other) = (tmp.path().join("good"), tmp.path().join("other"));
    node_certs(&good, &[1]);
    node_certs(&other, &[2]);
    certs::issue_for_days(&good, "op", Kind::Client, 10).unwrap();
    issue_expired(&good, "old", Kind::Node(1));
    let server = endpoint(1, Some(data_tls(&good, "n1")), 1 << 20);
    let addr = server.addr().to_string();

    // Another CA's node: each side refuses the other.
    let foreign = endpoint(2, Some(data_tls(&other, "n2")), 1 << 20);
    let e = foreign.connect(&addr, 1, 1, Channel::Ring).unwrap_err();
    assert!(matches!(e, DataPlaneError::Refused(_)), "{e}");
    // An operator's certificate of the right CA is not a node's.
    let op = endpoint(3, Some(data_tls(&good, "op")), 1 << 20);
    let e = op.connect(&addr, 1, 1, Channel::Ring).unwrap_err();
    assert!(matches!(e, DataPlaneError::Refused(_)), "{e}");
    // An expired node certificate (loading refuses it, so build its rustls side by hand).
    let expired = {
        use rustls::pki_types::pem::PemObject;
        let f = files(&good, "old");
        let chain: Vec<_> =
            rustls::pki_types::CertificateDer::pem_file_iter(&f.cert).unwrap().map(Result::unwrap).collect();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&f.key).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(rustls::pki_types::CertificateDer::from_pem_file(&f.ca).unwrap()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        DataTls { client: Arc::new(client), server: data_tls(&good, "n1").server }
    };
    let old = endpoint(4, Some(expired), 1 << 20);
    let e = old.connect(&addr, 1, 1, Channel::Ring).unwrap_err();
    assert!(matches!(e, DataPlaneError::Refused(_)), "{e}");
    assert!(e.to_string().contains("CertificateExpired") || e.to_string().contains("expired"), "{e}");
    // A plain-text peer (secret only) cannot talk to a TLS endpoint either.
    let plain = endpoint(5, None, 1 << 20);
    plain.connect(&addr, 1, 1, Channel::Ring).unwrap_err();
    // None of them reached the inbox; a good node still does.
    for peer in [2, 3, 4, 5] {
        assert!(server.accept_until(peer, 1, Channel::Ring, Instant::now(), &|| false).is_err());
    }
    let good2 = {
        certs::issue_for_days(&good, "n6", Kind::Node(6), 10).unwrap();
        endpoint(6, Some(data_tls(&good, "n6")), 1 << 20)
    };
    good2.connect(&addr, 1, 1, Channel::Ring).unwrap();
    server.accept_from(6, 1, Channel::Ring).unwrap();
}

/// A ClientHello's first bytes (a handshake record announcing 512 bytes), then filler:
/// dribbled a byte at a time, each read of it returns within any per-read timeout, but the
/// record never completes.
fn slow_hello() -> Vec<u8> {
    [0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]
        .into_iter()
        .chain(std::iter::repeat(7))
        .take(517)
        .collect()
}

/// Dribbles `hello` over `conns` a byte per `every` until each is closed or `within`
/// passes; how many were still open at the end.
fn dribble(
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
            let closed = matches!(s.read(&mut [0u8; 64]), Ok(0))
                || (*sent < hello.len() && s.write(&hello[*sent..*sent + 1]).is_err());
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

/// More TLS connections than a data-plane endpoint has handshake slots, each dribbling a
/// ClientHello a byte every 300 ms (inside any per-read timeout): past the cap they are closed
/// at once, and every one is cut at the handshake's one deadline (3 s here), after which a
/// node with a certificate connects.
#[test]
fn dribbled_tls_handshakes_end_at_one_deadline_and_free_their_slots() {
    use limpet_agent::dataplane::endpoint::MAX_HANDSHAKES;
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    node_certs(&good, &[1, 2]);
    let server = endpoint(1, Some(data_tls(&good, "n1")), 1 << 20);
    let addr = server.addr().to_string();
    let hello = slow_hello();
    let mut conns: Vec<_> =
        (0..MAX_HANDSHAKES + 8).map(|_| (std::net::TcpStream::connect(&addr).unwrap(), 0)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let open = dribble(&mut conns, &hello, Duration::from_millis(300), Duration::ZERO);
    assert!(open <= MAX_HANDSHAKES, "{open} connections open past the cap of {MAX_HANDSHAKES}");
    let started = Instant::now();
    let open = dribble(&mut conns, &hello, Duration::from_millis(300), Duration::from_secs(15));
    assert_eq!(open, 0, "dribbled TLS handshakes still open after {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(6), "cut only after {:?}", started.elapsed());
    let peer = endpoint(2, Some(data_tls(&good, "n2")), 1 << 20);
    peer.connect(&addr, 1, 1, Channel::Ring).unwrap();
    server.accept_from(2, 1, Channel::Ring).unwrap();
}

/// A node certificate the cluster revoked is refused at the data plane's TLS handshake, by
/// the side it dials and by the side that dials it; lifting the revocation lets it in again.
#[test]
fn a_revoked_certificate_is_refused_at_the_data_plane_handshake() {
    use rustls::pki_types::pem::PemObject;
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    node_certs(&good, &[1, 2]);
    let (one, two) = (
        endpoint(1, Some(data_tls(&good, "n1")), 1 << 20),
        endpoint(2, Some(data_tls(&good, "n2")), 1 << 20),
    );
    let der = rustls::pki_types::CertificateDer::from_pem_file(files(&good, "n2").cert).unwrap();
    let revoked: std::collections::HashSet<String> =
        [limpet_consensus::tls::fingerprint(der.as_ref())].into();
    one.set_revoked(revoked.clone());
    assert!(two.connect(&one.addr().to_string(), 1, 1, Channel::Ring).is_err());
    let e = one.connect(&two.addr().to_string(), 2, 1, Channel::Ring).unwrap_err();
    assert!(e.to_string().contains("revoked certificate"), "{e}");
    one.set_revoked(Default::default());
    two.connect(&one.addr().to_string(), 1, 1, Channel::Ring).unwrap();
    one.accept_from(2, 1, Channel::Ring).unwrap();
}

/// What a relay does to the records it forwards from the dialling rank.
#[derive(Clone)]
enum Tamper {
    /// Forward untouched, recording every byte.
    Record,
    /// Send the first large application-data record twice.
    Duplicate,
    /// Send this record (from another connection) before the first large one.
    Splice(Vec<u8>),
}

struct Relay {
    addr: String,
    /// Every byte the dialling side sent, and the first large application record.
    seen: Arc<Mutex<(Vec<u8>, Vec<u8>)>>,
}

/// A TCP relay in front of `upstream` that parses the TLS records the dialler sends.
fn relay(upstream: String, tamper: Tamper) -> Relay {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let seen2 = Arc::clone(&seen);
    std::thread::spawn(move || {
        let Ok((mut down, _)) = l.accept() else { return };
        let mut up = TcpStream::connect(&upstream).unwrap();
        let (mut down_r, mut up_w) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut up, &mut down);
            let _ = down.shutdown(std::net::Shutdown::Both);
        });
        let mut done = false;
        loop {
            let mut head = [0u8; 5];
            if down_r.read_exact(&mut head).is_err() {
                break;
            }
            let len = u16::from_be_bytes([head[3], head[4]]) as usize;
            let mut record = head.to_vec();
            record.resize(5 + len, 0);
            if down_r.read_exact(&mut record[5..]).is_err() {
                break;
            }
            let big = head[0] == 23 && len > 8000 && !done;
            let mut s = seen2.lock().unwrap();
            s.0.extend_from_slice(&record);
            if big {
                s.1.clone_from(&record);
            }
            drop(s);
            let mut out = Vec::new();
            if let (Tamper::Splice(other), true) = (&tamper, big) {
                out.extend_from_slice(other);
            }
            out.extend_from_slice(&record);
            if matches!(tamper, Tamper::Duplicate) && big {
                out.extend_from_slice(&record);
            }
            done |= big;
            if up_w.write_all(&out).is_err() {
                break;
            }
        }
        let _ = up_w.shutdown(std::net::Shutdown::Both);
    });
    Relay { addr, seen }
}

/// Two TLS ranks; node 1 dials node 2 through a relay. Each rank's allreduce result and how
/// long it took.
/// Each rank's allreduce result and when it came.
type Outcomes = Vec<(Result<Vec<f32>, DataPlaneError>, Duration)>;

fn through_relay(tamper: Tamper) -> (Outcomes, Relay, Endpoint) {
    let tmp = tempfile::tempdir().unwrap();
    node_certs(tmp.path(), &[1, 2]);
    let eps = [
        endpoint(1, Some(data_tls(tmp.path(), "n1")), 1 << 20),
        endpoint(2, Some(data_tls(tmp.path(), "n2")), 1 << 20),
    ];
    let r = relay(eps[1].addr().to_string(), tamper);
    let addrs = vec![eps[0].addr().to_string(), r.addr.clone()];
    let nodes = [1u64, 2];
    let start = Instant::now();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .iter()
            .zip(nodes)
            .map(|(ep, n)| {
                let addrs = &addrs;
                s.spawn(move || {
                    let res = (|| {
                        let mut g = ep.group(1, &nodes, addrs)?;
                        let mut buf = input(n, 1 << 20);
                        g.allreduce_sum(&mut buf, 3)?;
                        Ok(buf)
                    })();
                    (res, start.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let [_, second] = eps;
    (results, r, second)
}

#[test]
fn a_replayed_or_spliced_record_breaks_the_collective_and_a_replayed_session_is_refused() {
    // Untouched, the relay changes nothing.
    let (ok, recorded, second) = through_relay(Tamper::Record);
    for (r, _) in &ok {
        r.as_ref().unwrap();
    }
    let (session, record) = recorded.seen.lock().unwrap().clone();
    assert!(record.len() > 8000, "no large application record seen");

    // A record sent twice: the receiver's TLS refuses it, and both ranks fail fast.
    let (dup, _, _) = through_relay(Tamper::Duplicate);
    let e = dup[1].0.as_ref().unwrap_err();
    assert!(e.to_string().contains("TLS"), "{e}");
    for (r, took) in &dup {
        assert!(r.is_err(), "a rank completed the collective over a replayed record");
        assert!(*took < Duration::from_secs(10), "{took:?}");
    }
    // A record of another connection spliced in.
    let (spliced, _, _) = through_relay(Tamper::Splice(record));
    let e = spliced[1].0.as_ref().unwrap_err();
    assert!(e.to_string().contains("TLS"), "{e}");
    assert!(spliced[0].0.is_err());

    // The whole recorded session, replayed to the node that accepted it: the handshake
    // cannot complete (fresh server randomness), so nothing reaches the inbox.
    let mut raw = TcpStream::connect(second.addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = raw.write_all(&session);
    let mut sink = Vec::new();
    let _ = raw.read_to_end(&mut sink);
    let e = second.accept_until(1, 1, Channel::Ring, Instant::now() + Duration::from_secs(1), &|| false);
    assert!(e.is_err(), "a replayed session was accepted");
}

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
#[test]
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

//! The data plane over TLS, with real TCP and real certificates: collectives sum exactly;
//! connections with a foreign, expired or operator certificate, or a revoked one, are refused;
//! dribbled handshakes end at one deadline and free their slots; a replayed or spliced TLS
//! record breaks the collective on every rank, and a replayed session is never accepted.

mod common;

use common::{dribble, issue_expired, slow_hello};
use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, DataPlaneError, DataTls, Endpoint};
use limpet_consensus::tls::Tls;
use limpet_daemon::certs::{self, Kind};
use proptest::prelude::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::tls_files as files;

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

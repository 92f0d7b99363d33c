//! A member that misbehaves, with real `limpetd` processes over real TLS and TCP. The caller
//! holds a valid node certificate of the cluster's CA (node-2's), so every refusal here is
//! the nodes' own checks, not the TLS handshake's:
//! - speaking as another node is refused everywhere a node speaks: a raft batch, a join, a
//!   heartbeat, the data plane's handshake;
//! - crafted but decodable raft messages (a commit past the log, an append that rewrites
//!   committed entries, a peer's proposal carrying a configuration change or speaking for
//!   another node, another cluster's snapshot) are refused before raft-rs sees them;
//! - afterwards every node is up, all agree on the log, no member's address changed, and
//!   training goes on at full world size.
//! - a flood of slow TLS handshakes on every data port (more than its handshake slots, each
//!   dribbling a ClientHello) neither grows the agent's threads without bound nor keeps the
//!   survivors of a `kill -9` from their next epoch.

mod common;

use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, DataPlaneError, DataTls, Endpoint};
use limpet_consensus::harness::{entry, message};
use limpet_consensus::state::{cluster_id, ClusterState, Proposal, ProposalId, SnapshotData, FORMAT_VERSION};
use limpet_consensus::tls::{Tls, TlsFiles};
use limpet_consensus::transport::{encode_batch, pb};
use limpet_consensus::NodeStatus;
use limpet_lab::local::{LocalCluster, LocalJob};
use raft::prelude::{ConfChangeSingle, ConfChangeType, ConfChangeV2, EntryType, Message, MessageType};
use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    node_logs as logs_of, step_worlds as steps_of, tls_files as files, wait_showing_logs as wait_until,
};

fn last_step(path: &Path) -> u64 {
    steps_of(path).iter().map(|s| s.0).max().unwrap_or(0)
}

fn alive(pid: u32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
}

async fn client(
    addr: &str,
    id: &TlsFiles,
) -> pb::consensus_client::ConsensusClient<tonic::transport::Channel> {
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(&id.ca).unwrap()))
        .domain_name(limpet_consensus::tls::NODE_NAME)
        .identity(tonic::transport::Identity::from_pem(
            std::fs::read(&id.cert).unwrap(),
            std::fs::read(&id.key).unwrap(),
        ));
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    pb::consensus_client::ConsensusClient::new(channel)
}

/// What a hostile member could send node `to` given its status: each message alone would
/// panic raft-rs or change the cluster behind the state machine's back.
fn crafted(to: u64, st: &NodeStatus, cid: u64) -> Vec<(&'static str, Message)> {
    // At a newer term, as a voter may claim one: at the current term only the leader speaks
    // as one, and a follower refuses anyone else's heartbeat before these checks.
    let (me, t) = (2, st.term + 1);
    let mut out = Vec::new();

    // raft-rs commits whatever index a heartbeat names and panics past its last index.
    let mut m = message(MessageType::MsgHeartbeat, me, to, t);
    m.commit = st.last_index + 1_000_000;
    out.push(("a heartbeat committing past the log", m));

    // An append that matches the log's end but carries an entry for index 1 with another
    // term: raft-rs finds a conflict at or below the commit index and panics.
    let mut m = message(MessageType::MsgAppend, me, to, t);
    (m.index, m.log_term, m.commit) = (st.last_index, t, st.last_index);
    m.entries = vec![entry(EntryType::EntryNormal, 1, t, vec![])];
    out.push(("an append rewriting committed entries", m));

    // A peer's proposal carrying a configuration change (removing node 1) would change the
    // voters without the membership controller.
    let mut cc = ConfChangeV2::default();
    let mut single = ConfChangeSingle::default();
    single.set_change_type(ConfChangeType::RemoveNode);
    single.node_id = 1;
    cc.changes = vec![single];
    let mut m = message(MessageType::MsgPropose, me, to, 0);
    m.entries = vec![entry(EntryType::EntryConfChangeV2, 0, 0, limpet_consensus::codec::encode(&cc))];
    out.push(("a proposal carrying a configuration change", m));

    // A proposal that claims node 1 proposed it: node 1 "rejoining" at the rogue's address.
    let join = common::rogue_join(1, "node-1");
    let p = Proposal { v: FORMAT_VERSION, origin: ProposalId { node: 1, seq: 1 }, command: join };
    let mut m = message(MessageType::MsgPropose, me, to, 0);
    m.entries = vec![entry(EntryType::EntryNormal, 0, 0, p.encode())];
    out.push(("a proposal speaking for node 1", m));

    // Another cluster's state as a snapshot.
    let foreign = ClusterState::bootstrap("elsewhere", &[]);
    let data = SnapshotData { v: FORMAT_VERSION, cluster_id: cid ^ 1, state: foreign }.encode();
    let mut m = message(MessageType::MsgSnapshot, me, to, t);
    let snap = m.mut_snapshot();
    snap.data = data;
    snap.mut_metadata().index = st.last_index + 10;
    snap.mut_metadata().term = t;
    out.push(("another cluster's snapshot", m));
    out
}

#[test]
fn a_member_cannot_speak_as_another_or_crash_the_others_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 1_000_000, tls: true, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 3, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let logs: Vec<_> = c.file.nodes.iter().map(|n| n.step_log.clone()).collect();
    wait_until("three nodes training over TLS", Duration::from_secs(120), &dir, || {
        logs.iter().all(|l| steps_of(l).iter().any(|&(_, w)| w == 3))
    });
    let cid = cluster_id(&c.file.cluster);
    let rogue = files(&c.certs_dir(), "node-2");
    let addrs: Vec<(u64, String)> = c.file.nodes.iter().map(|n| (n.id, n.control.clone())).collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        for (id, addr) in &addrs {
            let mut rc = client(addr, &rogue).await;
            // Speaking raft as node 3 (or 1) with node 2's certificate.
            let other = if *id == 3 { 1 } else { 3 };
            let batch = encode_batch(cid, other, &[message(MessageType::MsgHeartbeat, other, *id, 1)]);
            let e = rc.send(batch).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            assert!(e.message().contains("certificate is node 2's"), "{e:?}");
            // A heartbeat for node 3 (or 1): would keep a dead node alive.
            let e = rc
                .heartbeat(pb::HeartbeatRequest {
                    cluster_id: cid,
                    from: other,
                    report: vec![],
                    cluster: String::new(),
                    urgent: false,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            // What only the leader's controllers or an operator decide: an on-demand launch
            // (the leader would carry it out), removing node 1 (its instance terminated), and
            // another node's notice.
            use limpet_consensus::state::{CapacityAction, CapacityRecord, Command, Market, Pool};
            let launch = Command::RecordCapacity {
                record: CapacityRecord {
                    seq: 1,
                    at_ms: 1,
                    by: 2,
                    reason: "rogue".into(),
                    action: CapacityAction::Launch {
                        pool: Pool { instance_type: "p4d.24xlarge".into(), subnet: String::new() },
                        market: Market::OnDemand,
                        token: "rogue".into(),
                        node_name: None,
                    },
                },
            };
            let remove = Command::Remove { id: 1, reason: "rogue".into() };
            let notice = Command::Notice { id: 1, deadline_ms: 1, source: "rogue".into() };
            // Joining as node 1 would take over its rank and its traffic.
            let join = common::rogue_join(1, "node-1");
            for (cmd, want) in [
                (join, "node 2 may propose join only about itself, not node 1"),
                (launch, "may not propose record_capacity"),
                (remove, "may not propose remove"),
                (notice, "only about itself"),
            ] {
                let e = rc
                    .propose(pb::ProposeRequest {
                        cluster_id: cid,
                        command: serde_json::to_vec(&cmd).unwrap(),
                        timeout_ms: 2000,
                        cluster: String::new(),
                    })
                    .await
                    .unwrap_err();
                assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
                assert!(e.message().contains(want), "{cmd:?}: {e:?}");
            }
            if *id == 2 {
                continue;
            }
            // Crafted raft messages in batches that are node 2's own.
            let st: NodeStatus = serde_json::from_slice(
                &rc.status(pb::StatusRequest { cluster_id: cid, cluster: String::new() })
                    .await
                    .unwrap()
                    .into_inner()
                    .status,
            )
            .unwrap();
            for (what, m) in crafted(*id, &st, cid) {
                rc.send(encode_batch(cid, 2, &[m])).await.unwrap_or_else(|e| panic!("{what}: {e:?}"));
            }
        }
    });

    // A checkpoint report sent straight to the control service rather than forwarded by
    // raft: the leader checks it as a forwarded one (here its hash is no hash, and its
    // location would drive the terminal of whoever runs `limpet status`); the others send
    // the caller to the leader.
    rt.block_on(async {
        use limpet_consensus::state::{CheckpointRecord, Command};
        let record = CheckpointRecord {
            step: 1,
            epoch: 1,
            content_hash: "x".into(),
            location: "/x\u{1b}[2J".into(),
            node: 2,
        };
        let cmd = Command::RecordCheckpoint { record };
        let mut answers = Vec::new();
        for (_, addr) in &addrs {
            let mut rc = client(addr, &rogue).await;
            let request = pb::ProposeRequest {
                cluster_id: cid,
                command: serde_json::to_vec(&cmd).unwrap(),
                timeout_ms: 2000,
                cluster: String::new(),
            };
            if let Ok(r) = rc.propose(request).await {
                answers.push(r.into_inner());
            }
        }
        assert!(
            answers.len() == 1
                && !answers[0].accepted
                && answers[0].detail.contains("not 64 lowercase hex digits"),
            "{answers:?}"
        );
    });

    // The data plane: node 2's certificate claiming to be node 1 in the handshake.
    let secret = std::fs::read(dir.join("secret")).unwrap();
    let mut cfg = DataPlaneConfig::new(cid, 1, secret);
    cfg.timeout = Duration::from_secs(3);
    cfg.tls = Some(DataTls::from_tls(&Tls::load(&rogue).unwrap()).unwrap());
    let ep = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let target = &c.file.nodes[2];
    match ep.connect(&target.data, target.id, u64::MAX / 2, Channel::Ring) {
        Err(DataPlaneError::Refused(why)) => assert!(why.contains("refused"), "{why}"),
        other => panic!("a handshake speaking as node 1 with node 2's certificate: {other:?}"),
    }

    // Everyone is up, training goes on at world 3, and the nodes say why they refused.
    let before: Vec<u64> = logs.iter().map(|l| last_step(l)).collect();
    wait_until("training on after the attempts", Duration::from_secs(60), &dir, || {
        logs.iter().zip(&before).all(|(l, b)| steps_of(l).iter().any(|&(s, w)| s > b + 20 && w == 3))
    });
    for n in &c.file.nodes {
        assert!(alive(n.pid), "{} died\n{}", n.name, logs_of(&dir));
    }
    let all = logs_of(&dir);
    for needle in
        ["certificate is node 2's", "configuration change", "past its last index", "speaks for node 1"]
    {
        assert!(all.contains(needle), "no node logged {needle:?}\n{all}");
    }
    // One log: every node reports the same members at the same addresses, node 1 at its own.
    let states: Vec<ClusterState> = rt.block_on(async {
        let mut out = Vec::new();
        for (_, addr) in &addrs {
            let mut rc = client(addr, &rogue).await;
            let r = rc
                .read(pb::ReadRequest { cluster_id: cid, linearizable: true, cluster: String::new() })
                .await
                .unwrap()
                .into_inner();
            out.push(serde_json::from_slice(&r.state).unwrap());
        }
        out
    });
    for s in &states {
        assert_eq!(s.members, states[0].members);
        assert_eq!(s.members[&1].spec.control_addr, c.file.nodes[0].control);
    }
    c.down();
}

#[test]
fn a_flood_of_slow_handshakes_neither_stops_training_nor_grows_threads_without_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 1_000_000, tls: true, ..LocalJob::default() };
    let mut c =
        LocalCluster::up_with(&dir, 3, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let logs: Vec<_> = c.file.nodes.iter().map(|n| n.step_log.clone()).collect();
    wait_until("three nodes training over TLS", Duration::from_secs(120), &dir, || {
        logs.iter().all(|l| steps_of(l).iter().any(|&(_, w)| w == 3))
    });
    let victim = c.file.nodes[0].clone();
    let threads = || -> usize {
        let s = std::fs::read_to_string(format!("/proc/{}/status", victim.pid)).unwrap();
        s.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
    };
    let quiet = threads();
    // More connections to every data port than it has handshake slots, each dribbling a
    // TLS ClientHello (a record header announcing 512 bytes, then the hello's bytes) a byte
    // every 2 s: well inside any per-read timeout, so a handshake that waited per read for a
    // whole record would hold its slot for ever and the next epoch could not connect.
    let hello: Vec<u8> = [0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]
        .into_iter()
        .chain(std::iter::repeat(7))
        .take(517)
        .collect();
    let mut flood: Vec<(TcpStream, usize)> = Vec::new();
    for n in &c.file.nodes {
        for _ in 0..80 {
            if let Ok(s) = TcpStream::connect(&n.data) {
                flood.push((s, 0));
            }
        }
    }
    let dribble = |flood: &mut Vec<(TcpStream, usize)>| {
        for (s, sent) in flood.iter_mut() {
            if *sent < hello.len() && s.write(&hello[*sent..*sent + 1]).is_ok() {
                *sent += 1;
            }
        }
    };
    let mut most = 0;
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        dribble(&mut flood);
        most = most.max(threads());
        std::thread::sleep(Duration::from_secs(2));
    }
    // A node dies without notice while the flood goes on: the survivors' next epoch needs
    // new ring connections on the flooded ports.
    let dead = c.file.nodes[2].clone();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(dead.pid as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let killed = Instant::now();
    let before: Vec<u64> = logs.iter().map(|l| last_step(l)).collect();
    let mut recovered = None;
    while killed.elapsed() < Duration::from_secs(60) {
        dribble(&mut flood);
        most = most.max(threads());
        if logs[..2].iter().zip(&before).all(|(l, b)| steps_of(l).iter().any(|&(s, w)| s > *b && w == 2)) {
            recovered = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    assert!(alive(victim.pid), "the flooded node died\n{}", logs_of(&dir));
    assert!(most < quiet + 200, "{most} threads under the flood, {quiet} before it");
    let recovered =
        recovered.unwrap_or_else(|| panic!("no step at world 2 within 60 s of the kill\n{}", logs_of(&dir)));
    eprintln!("under the flood, the survivors trained at world 2 {recovered:?} after the kill");
    drop(flood);
    c.down();
}

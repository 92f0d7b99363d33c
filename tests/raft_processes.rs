//! Real processes: three `limpet-lab raft-node`s on loopback with sled state directories. The
//! leader is killed with SIGKILL; a new leader must commit within a few seconds, and the
//! killed node, restarted from its directory, must catch up with its log intact. A node down
//! while the others compacted their logs catches up by a snapshot sent in chunks.

#[path = "common.rs"]
mod common;
use limpet_consensus::state::{Command, Hardware};
use limpet_lab::raft_cmd::RaftCluster;
use std::time::{Duration, Instant};

fn bump(id: u64, n: u64) -> Command {
    Command::UpdateHardware { id, hardware: Hardware { samples_per_sec_milli: n, ..Hardware::default() } }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_elects_another_and_the_restarted_node_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let exe = &common::lab_exe();
    let mut cluster = RaftCluster::start(exe, 3, dir.path(), 50).unwrap();
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await.unwrap();

    let mut c = cluster.client(leader).await.unwrap();
    for n in 0..20 {
        c.propose(&bump(1 + n % 3, n), Duration::from_secs(5)).await.unwrap();
    }
    let before = c.status().await.unwrap().commit;

    cluster.kill(leader);
    let killed_at = Instant::now();
    let survivor = (1..=3).find(|&i| i != leader).unwrap();
    let mut s = cluster.client(survivor).await.unwrap();
    // Proposals through a survivor wait for the new leader and then commit.
    let (index, _) = loop {
        match s.propose(&bump(survivor, 1000), Duration::from_secs(2)).await {
            Ok(ok) => break ok,
            Err(e) if killed_at.elapsed() < Duration::from_secs(10) => eprintln!("waiting: {e}"),
            Err(e) => panic!("no commit {:?} after killing the leader: {e}", killed_at.elapsed()),
        }
    };
    let failover = killed_at.elapsed();
    assert!(index > before);
    assert!(failover < Duration::from_secs(5), "new leader committed only after {failover:?}");
    let new_leader = cluster.wait_for_leader(Duration::from_secs(5)).await.unwrap();
    assert_ne!(new_leader, leader);
    eprintln!("failover: {failover:?} (leader {leader} -> {new_leader})");

    // The killed node comes back from its sled directory and catches up.
    cluster.spawn(leader).unwrap();
    let mut back = loop {
        if let Ok(client) = cluster.client(leader).await {
            break client;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = back.status().await.unwrap();
        if st.applied >= index {
            // It restarted from disk, not from scratch: its log starts where it left off.
            assert!(st.term > 1);
            break;
        }
        assert!(Instant::now() < deadline, "restarted node stuck at {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let local = back.read(false).await.unwrap();
    assert!(!local.linearizable);
    assert_eq!(local.state.members[&survivor].spec.hardware.samples_per_sec_milli, 1000);
    let linear = back.read(true).await.unwrap();
    assert!(linear.linearizable);
    assert!(linear.applied_index >= index);
    let mut l = cluster.client(new_leader).await.unwrap();
    assert_eq!(l.read(true).await.unwrap().state, linear.state);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_requests_for_another_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let exe = &common::lab_exe();
    let cluster = RaftCluster::start(exe, 1, dir.path(), 50).unwrap();
    cluster.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let mut wrong = limpet_consensus::Client::connect(&cluster.addrs[0], "someone-else").await.unwrap();
    let err = wrong.status().await.unwrap_err();
    assert!(err.to_string().contains("this node serves cluster"), "{err}");
    let mut right = cluster.client(1).await.unwrap();
    let err = right.propose(&Command::Activate { id: 42 }, Duration::from_secs(5)).await.unwrap_err();
    assert!(err.to_string().contains("node 42 is not a member"), "{err}");
}

/// Polls the leader's status until `done` holds.
async fn wait_for_status(
    cluster: &RaftCluster,
    within: Duration,
    what: &str,
    done: impl Fn(&limpet_consensus::NodeStatus) -> bool,
) -> limpet_consensus::NodeStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(leader) = cluster.wait_for_leader(Duration::from_secs(5)).await {
            if let Ok(mut c) = cluster.client(leader).await {
                if let Ok(st) = c.status().await {
                    if done(&st) {
                        return st;
                    }
                    assert!(Instant::now() < deadline, "{what}: still {st:?}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_voter_is_replaced_by_a_joined_learner_and_a_revoked_leader_hands_over() {
    let dir = tempfile::tempdir().unwrap();
    let exe = &common::lab_exe();
    let mut cluster = RaftCluster::start(exe, 3, dir.path(), 50).unwrap();
    cluster.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let newcomer = cluster.add_joiner().unwrap();
    wait_for_status(&cluster, Duration::from_secs(10), "newcomer admitted as a learner", |s| {
        s.learners.contains(&newcomer)
    })
    .await;

    // A spot notice for a voter that does not lead: swapped for the learner in one change.
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await.unwrap();
    let victim = (1..=3).find(|&i| i != leader).unwrap();
    let mut c = cluster.client(newcomer).await.unwrap();
    let notice = Command::Notice { id: victim, deadline_ms: u64::MAX, source: "test".into() };
    c.propose(&notice, Duration::from_secs(5)).await.unwrap();
    let st = wait_for_status(&cluster, Duration::from_secs(10), "voter swap", |s| {
        s.voters.contains(&newcomer) && !s.voters.contains(&victim) && s.voters_outgoing.is_empty()
    })
    .await;
    assert_eq!(st.voters.len(), 3);
    assert!(st.last_decision.contains(&format!("voter {victim} is Leaving")), "{}", st.last_decision);
    cluster.kill(victim);

    // A notice for the leader: it hands leadership over, then leaves the voters.
    let notice = Command::Notice { id: leader, deadline_ms: u64::MAX, source: "test".into() };
    c.propose(&notice, Duration::from_secs(5)).await.unwrap();
    let st = wait_for_status(&cluster, Duration::from_secs(10), "leader handover", |s| {
        s.id != leader && !s.voters.contains(&leader) && s.voters_outgoing.is_empty()
    })
    .await;
    cluster.kill(leader);
    // Two voters remain and still commit.
    assert_eq!(st.voters.len(), 2, "{st:?}");
    let (index, _) = c.propose(&bump(newcomer, 7), Duration::from_secs(5)).await.unwrap();
    assert!(index > st.commit);
}

/// A node that was down while the others compacted their logs catches up by a snapshot, its
/// data sent in chunks (here of 512 bytes: this state's snapshot is several).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_behind_the_compacted_log_catches_up_by_a_snapshot_in_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let exe = &common::lab_exe();
    let args = ["--snapshot-interval", "10", "--snapshot-chunk-bytes", "512"].map(String::from).to_vec();
    let mut cluster = RaftCluster::start_with(exe, 3, dir.path(), 50, args).unwrap();
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let behind = (1..=3).find(|&i| i != leader).unwrap();
    cluster.kill(behind);
    let mut c = cluster.client(leader).await.unwrap();
    let mut index = 0;
    for n in 0..60 {
        index = c.propose(&bump(1 + n % 3, n), Duration::from_secs(5)).await.unwrap().0;
    }
    cluster.spawn(behind).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut back = loop {
        if let Ok(client) = cluster.client(behind).await {
            break client;
        }
        assert!(Instant::now() < deadline, "node {behind} did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    loop {
        let st = back.status().await.unwrap();
        if st.applied >= index {
            break;
        }
        assert!(Instant::now() < deadline, "node {behind} stuck at {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(dir.path().join(format!("node-{behind}/node.log"))).unwrap();
    assert!(
        log.contains("a snapshot received in chunks"),
        "no chunked snapshot in node {behind}'s log:\n{log}"
    );
    let mut l = cluster.client(leader).await.unwrap();
    let (mine, theirs) = (back.read(false).await.unwrap(), l.read(true).await.unwrap());
    assert!(mine.applied_index >= index);
    assert_eq!(mine.state.members, theirs.state.members);
}

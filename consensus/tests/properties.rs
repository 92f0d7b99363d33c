//! Property tests: random schedules of proposals, partitions, crashes and restarts on the
//! in-memory network must keep Raft's guarantees; and every decoder of untrusted bytes
//! refuses garbage without panicking.

use limpet_consensus::harness::Network;
use limpet_consensus::state::{
    Command, Epoch, EpochBatch, Hardware, Layout, Proposal, ProposalId, SnapshotData, FORMAT_VERSION,
};
use limpet_consensus::storage::decode_record;
use limpet_consensus::transport::{decode_batch, decode_batch_bytes, encode_batch};
use limpet_consensus::{ClusterState, CoreConfig, NodeId};
use proptest::prelude::*;
use prost::Message as _;
use raft::prelude::{Message, MessageType};
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Propose { via: NodeId, what: u8 },
    Partition { side: Vec<NodeId> },
    Isolate(NodeId),
    Heal,
    Crash(NodeId),
    Restart(NodeId),
    Tick(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1..=5u64, any::<u8>()).prop_map(|(via, what)| Op::Propose { via, what }),
        1 => proptest::sample::subsequence(vec![1u64, 2, 3, 4, 5], 1..=2).prop_map(|side| Op::Partition { side }),
        1 => (1..=5u64).prop_map(Op::Isolate),
        1 => Just(Op::Heal),
        1 => (1..=5u64).prop_map(Op::Crash),
        2 => (1..=5u64).prop_map(Op::Restart),
        4 => (1..30u8).prop_map(Op::Tick),
    ]
}

/// A command proposed through node `via`: mostly its own hardware update, sometimes epochs
/// (refused by the state machine now and then, and by the leader when `via` does not lead:
/// raft forwards only a node's own proposals).
fn command(what: u8, via: u64, next_epoch: &mut u64) -> Command {
    match what % 4 {
        0 => {
            *next_epoch += 1;
            Command::ScheduleEpoch {
                epoch: Epoch {
                    id: *next_epoch,
                    start_step: u64::from(what),
                    ranks: vec![1, 2, 3],
                    layout: Layout::data_parallel(3),
                    batch: EpochBatch { global_batch: 96, micro_batch: 32 },
                    lr_scale: 1.0,
                    // Sometimes with a state source, so the log carries that shape too.
                    sources: if what % 8 == 0 { BTreeMap::from([(3, 1)]) } else { BTreeMap::new() },
                    cause: "test".into(),
                    causes: Vec::new(),
                    shares: Vec::new(),
                    local_ranks: Vec::new(),
                },
            }
        }
        1 => Command::ActivateEpoch { id: *next_epoch },
        _ => Command::UpdateHardware {
            id: via,
            hardware: Hardware { samples_per_sec_milli: u64::from(what), ..Hardware::default() },
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn raft_guarantees_hold_under_partitions_crashes_and_restarts(
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut cfg = CoreConfig::new(1, "harness");
        cfg.snapshot_interval = 8;
        let mut net = Network::new(5, cfg, seed);
        prop_assert!(net.run_until(100, |n| n.leader().is_some()));
        net.set_drop_rate(0.05);
        let mut next_epoch = 0;
        for op in ops {
            match op {
                Op::Propose { via, what } => {
                    if net.live().contains(&via) {
                        let _ = net.propose(via, command(what, via, &mut next_epoch));
                    }
                }
                Op::Partition { side } => net.partition(&side),
                Op::Isolate(id) => net.isolate(id),
                Op::Heal => net.heal(),
                Op::Crash(id) => {
                    // Keep a majority able to come back; crashes beyond it just wait.
                    if net.crashed().len() < 2 {
                        net.crash(id);
                    }
                }
                Op::Restart(id) => net.restart(id),
                Op::Tick(n) => net.run(u64::from(n)),
            }
            prop_assert_eq!(net.violations(), &[] as &[String]);
            net.check_committed_prefixes().map_err(TestCaseError::fail)?;
        }
        net.heal();
        for id in net.crashed() {
            net.restart(id);
        }
        prop_assert!(net.run_until(600, Network::converged), "no convergence after healing");
        // One more write after healing must commit everywhere.
        let leader = net.leader().expect("leader after convergence");
        let _ = net.propose(leader, command(2, leader, &mut next_epoch));
        prop_assert!(net.run_until(200, Network::converged));
        net.check_states_match().map_err(TestCaseError::fail)?;
        net.check_committed_prefixes().map_err(TestCaseError::fail)?;
        prop_assert_eq!(net.violations(), &[] as &[String]);
    }

    #[test]
    fn proposal_decoding_round_trips_and_refuses_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Proposal::decode(&bytes);
        let _ = Command::decode(&bytes);
        let _ = SnapshotData::decode(&bytes, 1);
    }

    #[test]
    fn proposals_round_trip(what in any::<u8>(), seq in any::<u64>(), node in 1..100u64) {
        let mut e = 0;
        let p = Proposal { v: FORMAT_VERSION, origin: ProposalId { node, seq }, command: command(what, 1, &mut e) };
        prop_assert_eq!(Proposal::decode(&p.encode()).unwrap(), p);
    }

    #[test]
    fn damaged_proposals_are_refused_or_decode_to_a_valid_command(
        what in any::<u8>(), at in any::<prop::sample::Index>(), byte in any::<u8>(),
    ) {
        let mut e = 0;
        let p = Proposal { v: FORMAT_VERSION, origin: ProposalId { node: 1, seq: 1 }, command: command(what, 1, &mut e) };
        let mut bytes = p.encode();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok(q) = Proposal::decode(&bytes) {
            // Whatever decodes must re-encode to itself: no half-read commands.
            prop_assert_eq!(Proposal::decode(&q.encode()).unwrap(), q);
        }
    }

    #[test]
    fn snapshots_of_other_clusters_or_versions_are_refused(v in 0u32..4, cluster in 0u64..4) {
        let data = SnapshotData { v, cluster_id: cluster, state: ClusterState::bootstrap("c", &[]) };
        let ok = SnapshotData::decode(&data.encode(), 2).is_ok();
        prop_assert_eq!(ok, v == FORMAT_VERSION && cluster == 2);
    }

    #[test]
    fn raft_batches_of_garbage_are_refused_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch_bytes(&bytes, 7, 1);
    }

    #[test]
    fn raft_batches_round_trip_and_foreign_ones_are_refused(
        n in 0usize..8, term in any::<u64>(), index in any::<u64>(), cluster in 6u64..9, to in 1u64..3,
    ) {
        let msgs: Vec<Message> = (0..n)
            .map(|i| {
                let mut m = Message { from: 2, to, term, index: index.wrapping_add(i as u64), ..Default::default() };
                m.set_msg_type(MessageType::MsgHeartbeat);
                m
            })
            .collect();
        let bytes = encode_batch(cluster, 2, &msgs).encode_to_vec();
        let decoded = decode_batch_bytes(&bytes, 7, 1);
        if cluster == 7 && (to == 1 || n == 0) {
            prop_assert_eq!(&decoded.unwrap(), &msgs);
        } else {
            prop_assert!(decoded.is_err());
        }
        // A batch claiming another sender than its messages is refused too.
        let mut lying = encode_batch(7, 3, &msgs);
        lying.from = 3;
        prop_assert_eq!(decode_batch(&lying, 7, 1).is_ok(), n == 0);
    }

    #[test]
    fn stored_records_of_garbage_are_refused_without_panicking(
        key in proptest::collection::vec(any::<u8>(), 0..16),
        value in proptest::collection::vec(any::<u8>(), 0..256),
        known in 0usize..7,
    ) {
        let keys: [&[u8]; 6] = [b"meta/identity", b"meta/hard_state", b"meta/snapshot",
            b"meta/applied_index", b"meta/applied_conf", b"meta/applied_data"];
        let _ = decode_record(&key, &value);
        if known < 6 {
            let _ = decode_record(keys[known], &value);
        }
        let mut entry_key = b"log/".to_vec();
        entry_key.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 5]);
        if let Ok(limpet_consensus::storage::StoredRecord::Entry(i, e)) = decode_record(&entry_key, &value) {
            prop_assert_eq!(i, 5);
            prop_assert_eq!(e.index, 5);
        }
    }
}

//! Feeds arbitrary bytes, decoded as raft messages a peer sends (a `RaftBatch`, or one raw
//! message addressed by the first byte, which reaches far more of raft-rs than a fuzzer
//! guessing a batch's cluster id), through `Core::step` of a node in a settled three-node
//! cluster (real raft-rs on the in-memory network), then runs the network on. Whatever a
//! peer sends, no node may panic: what raft-rs would treat as a fatal bug must be refused
//! first.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_consensus::harness::Network;
use limpet_consensus::state::{cluster_id, Command, Hardware};
use limpet_consensus::transport::decode_batch_bytes;
use limpet_consensus::CoreConfig;
use raft::prelude::Message;

fn settled() -> Network {
    let mut net = Network::new(3, CoreConfig::new(1, "harness"), 5);
    net.run_until(100, |n| n.leader().is_some());
    let leader = net.leader().unwrap_or(1);
    let hw = Hardware { samples_per_sec_milli: 1, ..Hardware::default() };
    if let Some(id) = net.propose(leader, Command::UpdateHardware { id: 2, hardware: hw }) {
        net.run_until(50, |n| n.outcome(id).is_some());
    }
    net
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let to = u64::from(sel % 3) + 1;
    let msgs = match decode_batch_bytes(rest, cluster_id("harness"), to) {
        Ok(msgs) => msgs,
        // Decoded without the transport's enum check: `Core::step` must refuse what raft-rs
        // cannot read by itself.
        Err(_) => match limpet_consensus::codec::decode::<Message>(rest) {
            Ok(mut m) => {
                // From one of the other two nodes, to the chosen one.
                m.from = (to + u64::from(sel / 3 % 2)) % 3 + 1;
                m.to = to;
                vec![m]
            }
            Err(_) => return,
        },
    };
    let mut net = settled();
    for m in msgs {
        if m.from != to && (1..=3).contains(&m.from) {
            let _ = net.node_mut(to).step(m);
        }
    }
    net.run(30);
});

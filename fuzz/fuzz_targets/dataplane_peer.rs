//! Drives a node's ring collectives and pipeline receives with a member that passed the
//! handshake (it holds the secret) and then sends arbitrary bytes, raw or behind a frame
//! header for the exact collective awaited, over real loopback sockets. The node must answer
//! with an error or a result within its timeout, never panic, and refuse further use of a
//! group or link that failed. The harness is the one `agent/tests/collectives.rs`
//! property-tests in `make test`.
#![no_main]

#[path = "../../agent/tests/support/hostile_peer.rs"]
mod hostile_peer;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = hostile_peer::hostile_peer_case(data);
});

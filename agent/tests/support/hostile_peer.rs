// A member past a valid handshake that sends arbitrary bytes where a collective's or a
// pipeline's frames belong. A module (`#[path]`) of `agent/tests/collectives.rs`, whose
// proptests run in `make test`, and by `fuzz/fuzz_targets/dataplane_peer.rs`, which runs the
// same harness without end: one harness, so the two cannot drift apart.
//
// The input is `[op, mode, bytes...]`. `op` picks what the honest node does; `mode` picks
// whether the hostile peer's bytes go out raw or after one well-formed frame header for the
// exact collective the honest node waits on (epoch, step and sequence number right, so the
// bytes reach the payload checks), and whether that header tells the payload's length
// truthfully or takes it from the input.

use limpet_agent::dataplane::frame::{Channel, Header, Kind};
use limpet_agent::dataplane::PipeLink;
use limpet_agent::{DataPlaneConfig, DataPlaneError, Endpoint};
use std::io::Write;
use std::time::{Duration, Instant};

/// How long the honest node waits on a silent peer.
const PEER_TIMEOUT: Duration = Duration::from_millis(250);
const EPOCH: u64 = 1;
const STEP: u64 = 5;

fn hostile_endpoint(node: u64) -> Endpoint {
    let mut cfg = DataPlaneConfig::new(11, node, b"hostile-peer-harness-secret".to_vec());
    cfg.timeout = PEER_TIMEOUT;
    // The smallest chunk allowed (1024 values), so the larger buffers below span frames.
    cfg.chunk_bytes = 4096;
    Endpoint::bind("127.0.0.1:0".parse().expect("address"), cfg).expect("bind")
}

/// The honest node's operations, one per `op % OPS`: 0-5 and 8-9 ring collectives, 6-7
/// pipeline receives.
const OPS: u8 = 10;

/// Runs one case and returns what the honest node's operation returned, after checking
/// what holds whatever the peer sent: no panic (the caller sees one), an answer within a few
/// timeouts, and a failed operation leaving its group or link refusing the next one.
pub fn hostile_peer_case(input: &[u8]) -> Result<(), DataPlaneError> {
    let (op, mode, bytes) = match input {
        [op, mode, rest @ ..] => (op % OPS, *mode, rest),
        _ => return Ok(()),
    };
    let honest = hostile_endpoint(1);
    let peer = hostile_endpoint(2);
    let (honest_addr, peer_addr) = (honest.addr().to_string(), peer.addr().to_string());
    // 0 to 3007 values.
    let len = usize::from(mode >> 3) * 97;
    // Sequence numbers the honest node expects first: a ring collective's first frame is
    // 0; a pipeline activation of micro-batch 0 is 0, its gradient 1.
    let seq = if op == 7 { 1 } else { 0 };
    let mut wire = Vec::new();
    if mode & 1 == 1 {
        let declared = if mode & 2 == 2 && bytes.len() >= 4 {
            u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"))
        } else {
            bytes.len() as u32
        };
        let kind = if mode & 4 == 4 { Kind::Abort } else { Kind::Data };
        wire.extend_from_slice(&Header { kind, epoch: EPOCH, step: STEP, seq, len: declared }.encode());
    }
    wire.extend_from_slice(bytes);

    let started = Instant::now();
    let ring = op <= 5 || op >= 8;
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let result = std::thread::scope(|s| {
        let (peer, honest_addr_ref, wire) = (&peer, &honest_addr, &wire);
        let hostile = s.spawn(move || {
            // The hostile side: a member with the secret, so its handshakes pass; it sends
            // `wire` on the connection the honest node reads from, and keeps the others open
            // and unread until the honest side is done.
            let deadline = Instant::now() + Duration::from_secs(5);
            let never = || false;
            let mut held = Vec::new();
            let mut talk = match op {
                _ if ring => {
                    let c = peer.connect_until(honest_addr_ref, 1, EPOCH, Channel::Ring, deadline, &never);
                    held.push(peer.accept_until(1, EPOCH, Channel::Ring, deadline, &never));
                    c
                }
                6 => peer.connect_until(honest_addr_ref, 1, EPOCH, Channel::Pipe, deadline, &never),
                _ => peer.accept_until(1, EPOCH, Channel::Pipe, deadline, &never),
            }
            .expect("the hostile member's handshake");
            let _ = talk.write_all(wire);
            let _ = talk.flush();
            // Open until the honest side is done, so it meets the bytes, not a closed socket.
            let _ = finished.recv_timeout(Duration::from_secs(5));
            drop(held);
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let never = || false;
        let out = if ring {
            let mut g =
                honest.group(EPOCH, &[1, 2], &[honest_addr.clone(), peer_addr.clone()]).expect("ring");
            let mut buf: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let r = match op {
                0 => g.allreduce_sum(&mut buf, STEP),
                1 => {
                    let mut ints: Vec<i64> = (0..len as i64).collect();
                    g.allreduce_sum_i64(&mut ints, STEP)
                }
                2 => {
                    let mut ints: Vec<i32> = (0..len as i32).collect();
                    g.allreduce_max_i32(&mut ints, STEP)
                }
                3 => g.broadcast(&mut buf, 1, STEP),
                4 => {
                    let mut out = vec![0.0; 2 * len];
                    g.allgather(&buf, &mut out, STEP)
                }
                5 => g.barrier(STEP),
                // Sharded state's collectives, over two uneven blocks, one replica.
                8 => g.reduce_scatter_sum(&mut buf, &[0..len / 3, len / 3..len], 1, STEP),
                _ => g.allgather_blocks(&mut buf, &[0..len / 3, len / 3..len], STEP),
            };
            if r.is_err() {
                assert!(g.barrier(STEP + 1).is_err(), "a group that failed served another collective");
            }
            r
        } else if op == 6 {
            let mut link = PipeLink::connect(&honest, EPOCH, Some(2), None, deadline, &never).expect("link");
            let r = link.recv_activation(STEP, 0).map(|_| ());
            if r.is_err() {
                assert!(link.recv_activation(STEP, 1).is_err(), "a link that failed received again");
            }
            r
        } else {
            let mut link = PipeLink::connect(&honest, EPOCH, None, Some((2, &peer_addr)), deadline, &never)
                .expect("link");
            let r = link.recv_gradient(STEP, 0).map(|_| ());
            if r.is_err() {
                assert!(link.recv_gradient(STEP, 1).is_err(), "a link that failed received again");
            }
            r
        };
        let _ = done.send(());
        hostile.join().expect("hostile side");
        out
    });
    // Setup, the peer's timeout for the first operation and at most one more for the check.
    assert!(started.elapsed() < Duration::from_secs(4), "the honest node hung: {:?}", started.elapsed());
    result
}

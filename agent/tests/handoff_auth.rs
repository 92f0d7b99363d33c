//! State handoff through the data plane's handshake: a member fetches a peer's state; a node
//! that passes the handshake but is not a member, and a stranger without the cluster secret,
//! get nothing.

use limpet_agent::dataplane::handoff::{serve_handoff, HandoffDialer};
use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_snapshot::handoff::{fetch, FetchOptions, Offer, Server};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

const SECRET: &[u8] = b"handoff-test-secret-16+";

fn endpoint(node: u64, secret: &[u8]) -> Endpoint {
    Endpoint::bind("127.0.0.1:0".parse().unwrap(), DataPlaneConfig::new(9, node, secret.to_vec())).unwrap()
}

#[test]
fn members_fetch_state_and_strangers_are_refused() {
    let sender = Arc::new(endpoint(1, SECRET));
    let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let server = Server::new();
    server.offer(Offer::new(bytes.clone(), 256 << 10, [3; 32]));
    let stop = Arc::new(AtomicBool::new(false));
    // Node 2 is a member; node 4 knows the secret but is not (removed, or never admitted).
    let serving = serve_handoff(Arc::clone(&sender), server, Arc::clone(&stop), Arc::new(|peer| peer == 2));
    let source = format!("1@{}", sender.addr());

    let newcomer = endpoint(2, SECRET);
    let opts = FetchOptions { expect: Some([3; 32]), ..FetchOptions::default() };
    let (got, stats) =
        fetch(&HandoffDialer { endpoint: &newcomer, epoch: 4 }, std::slice::from_ref(&source), &opts)
            .unwrap();
    assert_eq!(got, bytes);
    assert_eq!(stats.source, source);

    let removed = endpoint(4, SECRET);
    let err = fetch(&HandoffDialer { endpoint: &removed, epoch: 4 }, std::slice::from_ref(&source), &opts);
    assert!(err.is_err(), "a node outside the membership fetched the state");

    let stranger = endpoint(3, b"not-the-cluster-secret!!");
    let err = fetch(&HandoffDialer { endpoint: &stranger, epoch: 4 }, &[source], &opts).unwrap_err();
    assert!(err.to_string().contains("secret"), "{err}");

    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    serving.join().unwrap();
}

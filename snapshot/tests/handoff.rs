//! State handoff over loopback TCP: a transferred state hashes equal to the source; damaged
//! chunks are repaired; a broken connection resumes; a vanished source is left for another.

use limpet_snapshot::handoff::{
    fetch, label_of, ChunkHook, FetchOptions, Manifest, Offer, Request, Server, TcpDialer,
};
use limpet_snapshot::{RawTensor, RngState, StateImage};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn image(floats: usize) -> StateImage {
    let mut tensors = BTreeMap::new();
    for (k, name) in ["b00.w", "b00.b", "b01.w"].iter().enumerate() {
        let data: Vec<f32> = (0..floats).map(|i| (i * (k + 1)) as f32 * 0.001).collect();
        tensors.insert(name.to_string(), RawTensor::from_f32(name, vec![floats], &data).unwrap());
    }
    StateImage::new(42, 42 * 64, RngState { seed: 1, draws: 9 }, serde_json::json!({"job": "test"}), tensors)
}

/// Serves `server` on a fresh port; each connection on its own thread with the hook.
fn listen(server: Server, hook: Option<Arc<ChunkHook>>) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (server, hook) = (server.clone(), hook.clone());
            std::thread::spawn(move || {
                let _ = server.serve(&mut conn, hook.as_deref());
            });
        }
    });
    addr
}

fn dialer() -> TcpDialer {
    TcpDialer { timeout: Duration::from_secs(2) }
}

fn opts() -> FetchOptions {
    FetchOptions { streams: 3, batch: 2, reconnects: 3, ..FetchOptions::default() }
}

#[test]
fn a_transferred_state_hashes_equal_to_the_source() {
    let img = image(50_000);
    let bytes = img.encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(bytes.clone(), 16 << 10, label_of(img.content_hash())));
    let addr = listen(server, None);
    let want = FetchOptions { expect: Some(label_of(img.content_hash())), ..opts() };
    let (got, stats) = fetch(&dialer(), &[addr], &want).unwrap();
    assert_eq!(got, bytes);
    assert_eq!(StateImage::decode(&got).unwrap().content_hash(), img.content_hash());
    assert_eq!((stats.repaired_chunks, stats.reconnects, stats.sources_failed), (0, 0, 0));
    assert_eq!(stats.bytes, bytes.len() as u64);
}

#[test]
fn a_state_larger_than_the_receiver_can_need_is_refused_before_it_is_allocated() {
    let img = image(50_000);
    let bytes = img.encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(bytes.clone(), 16 << 10, label_of(img.content_hash())));
    let addr = listen(server, None);
    let label = Some(label_of(img.content_hash()));
    let small = FetchOptions { expect: label, max_bytes: bytes.len() as u64 - 1, ..opts() };
    let e = fetch(&dialer(), std::slice::from_ref(&addr), &small).unwrap_err().to_string();
    // Refused by the manifest's reader, before its chunk hashes.
    assert!(
        e.contains(&format!("{} bytes is more than the {} this state can be", bytes.len(), bytes.len() - 1)),
        "{e}"
    );
    let enough = FetchOptions { expect: label, max_bytes: bytes.len() as u64, ..opts() };
    assert_eq!(fetch(&dialer(), &[addr], &enough).unwrap().0, bytes);
}

#[test]
fn damaged_chunks_are_fetched_again() {
    let bytes = image(30_000).encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(bytes.clone(), 8 << 10, [1; 32]));
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    // The first two times chunk 3 is sent, one byte is flipped on the way.
    let hook: Arc<ChunkHook> = Arc::new(move |i, data: &mut Vec<u8>| {
        if i == 3 && h.fetch_add(1, Ordering::SeqCst) < 2 {
            data[100] ^= 0x40;
        }
        true
    });
    let addr = listen(server, Some(hook));
    let (got, stats) = fetch(&dialer(), &[addr], &opts()).unwrap();
    assert_eq!(got, bytes);
    assert_eq!(stats.repaired_chunks, 2);
}

#[test]
fn a_broken_connection_resumes_where_it_stopped() {
    let bytes = image(30_000).encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(bytes.clone(), 8 << 10, [1; 32]));
    let drops = Arc::new(AtomicUsize::new(0));
    let d = Arc::clone(&drops);
    // The connection breaks the first time chunk 5 is due.
    let hook: Arc<ChunkHook> =
        Arc::new(move |i, _: &mut Vec<u8>| !(i == 5 && d.fetch_add(1, Ordering::SeqCst) == 0));
    let addr = listen(server, Some(hook));
    let (got, stats) = fetch(&dialer(), &[addr], &opts()).unwrap();
    assert_eq!(got, bytes);
    assert!(stats.reconnects >= 1, "{stats:?}");
}

#[test]
fn a_vanished_source_is_an_error_and_another_source_takes_over() {
    let bytes = image(20_000).encode().unwrap();
    let offer = || Offer::new(bytes.clone(), 8 << 10, [1; 32]);
    // A source that serves the manifest, then drops every chunk request.
    let flaky = Server::new();
    flaky.offer(offer());
    let flaky_addr = listen(flaky, Some(Arc::new(|_, _: &mut Vec<u8>| false)));
    let err = fetch(&dialer(), std::slice::from_ref(&flaky_addr), &opts()).unwrap_err();
    assert!(err.to_string().contains("no source could complete"), "{err}");

    let good = Server::new();
    good.offer(offer());
    let good_addr = listen(good, None);
    let (got, stats) = fetch(&dialer(), &[flaky_addr, good_addr], &opts()).unwrap();
    assert_eq!(got, bytes);
    assert_eq!(stats.sources_failed, 1);

    // Nobody listening at all.
    let dead = "127.0.0.1:1".to_string();
    let err = fetch(&dialer(), &[dead], &opts()).unwrap_err();
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
}

#[test]
fn a_source_offering_another_state_is_refused() {
    let server = Server::new();
    server.offer(Offer::new(image(1000).encode().unwrap(), 4096, [1; 32]));
    let addr = listen(server, None);
    let want = FetchOptions { expect: Some([7; 32]), ..opts() };
    let err = fetch(&dialer(), &[addr], &want).unwrap_err();
    assert!(err.to_string().contains("no such state"), "{err}");
}

/// A manifest announcing more than the receiver's state can be is refused from its head,
/// before its chunk hashes (2^27 of them here) are read.
#[test]
fn an_oversized_manifest_is_refused_before_its_hashes_are_read() {
    let m = Offer::new(vec![1; 8192], 4096, [2; 32]).manifest().clone();
    let mut head = m.encode();
    head.truncate(head.len() - 64);
    let total: u64 = 1 << 39;
    head[8..16].copy_from_slice(&total.to_le_bytes());
    head[20..24].copy_from_slice(&((total / 4096) as u32).to_le_bytes());
    let err = Manifest::read_at_most(&mut head.as_slice(), 1 << 30).unwrap_err().to_string();
    assert!(err.contains("more than the 1073741824 this state can be"), "{err}");
    // Unbounded, the same head would go on to read its hashes (and run out of bytes).
    let err = Manifest::read_from(&mut head.as_slice()).unwrap_err().to_string();
    assert!(err.contains("chunk hashes"), "{err}");
}

proptest! {
    #[test]
    fn handoff_records_of_garbage_are_refused_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = Request::decode(&bytes);
        let _ = Manifest::read_from(&mut bytes.as_slice());
        if let Ok(m) = Manifest::read_at_most(&mut bytes.as_slice(), 1 << 20) {
            prop_assert!(m.total <= 1 << 20);
        }
    }

    #[test]
    fn requests_and_manifests_round_trip(start in any::<u64>(), count in any::<u64>(), n in 1usize..20, h in any::<u8>()) {
        let r = Request::Chunks { offer: [h; 32], start, count };
        prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        let o = Offer::new(vec![h; n * 4096 - 1], 4096, [h; 32]);
        let m = o.manifest().clone();
        prop_assert_eq!(Manifest::read_from(&mut m.encode().as_slice()).unwrap(), m.clone());
        // A manifest whose chunk list was altered no longer matches its root.
        let mut bad = m.encode();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        prop_assert!(Manifest::read_from(&mut bad.as_slice()).is_err());
    }
}

#[test]
fn one_stage_of_a_state_travels_alone_and_verifies() {
    let img = image(10_000);
    let stage = img.select(|name| name.starts_with("b01."));
    assert_eq!(stage.tensors().keys().collect::<Vec<_>>(), ["b01.w"]);
    assert_eq!(stage.meta().step, img.meta().step);
    assert_ne!(stage.content_hash(), img.content_hash());
    let bytes = stage.encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(bytes, 4096, label_of(stage.content_hash())));
    let addr = listen(server, None);
    let want = FetchOptions { expect: Some(label_of(stage.content_hash())), ..opts() };
    let (got, _) = fetch(&dialer(), &[addr], &want).unwrap();
    let back = StateImage::decode(&got).unwrap();
    assert_eq!(back, stage);
    assert_eq!(back.tensors()["b01.w"], img.tensors()["b01.w"]);
}

#[test]
fn a_transfer_finishes_on_its_copy_while_the_sender_moves_on() {
    let old = image(20_000);
    let old_bytes = old.encode().unwrap();
    let server = Server::new();
    server.offer(Offer::new(old_bytes.clone(), 8 << 10, label_of(old.content_hash())));
    // While the first chunk is on its way, the sender trains on and offers a newer state.
    let newer = Server::clone(&server);
    let moved = Arc::new(AtomicUsize::new(0));
    let m = Arc::clone(&moved);
    let hook: Arc<ChunkHook> = Arc::new(move |_, _: &mut Vec<u8>| {
        if m.fetch_add(1, Ordering::SeqCst) == 0 {
            let next = StateImage::new(
                43,
                43 * 64,
                RngState { seed: 1, draws: 10 },
                serde_json::json!({}),
                BTreeMap::new(),
            );
            newer.offer(Offer::new(next.encode().unwrap(), 4096, label_of(next.content_hash())));
        }
        true
    });
    let addr = listen(server, Some(hook));
    let want = FetchOptions { expect: Some(label_of(old.content_hash())), ..opts() };
    let (got, _) = fetch(&dialer(), &[addr], &want).unwrap();
    assert_eq!(got, old_bytes, "the receiver got the consistent copy it started on");
}

#[test]
fn a_withdrawn_offer_is_refused_and_the_others_stay() {
    let (img, other) = (image(20_000), image(3_000));
    let (bytes, other_bytes) = (img.encode().unwrap(), other.encode().unwrap());
    let (label, other_label) = (label_of(img.content_hash()), label_of(other.content_hash()));
    let server = Server::new();
    server.offer(Offer::new(other_bytes.clone(), 8 << 10, other_label));
    server.offer(Offer::new(bytes.clone(), 8 << 10, label));
    let addr = listen(server.clone(), None);
    let want = FetchOptions { expect: Some(label), ..opts() };
    assert_eq!(fetch(&dialer(), std::slice::from_ref(&addr), &want).unwrap().0, bytes);
    server.withdraw(&label);
    let err = fetch(&dialer(), std::slice::from_ref(&addr), &want).unwrap_err();
    assert!(err.to_string().contains("no such state offered here"), "{err}");
    let kept = FetchOptions { expect: Some(other_label), ..opts() };
    assert_eq!(fetch(&dialer(), &[addr], &kept).unwrap().0, other_bytes);
}

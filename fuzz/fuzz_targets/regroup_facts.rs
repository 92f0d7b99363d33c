//! A member of a sharded job's group sums arbitrary words into a regroup's rows: the
//! decoder of every rank's row and the decision taken from them (`limpet_decide::regroup`)
//! must answer with a result, never a panic or an allocation a forged world or replica count
//! asks for; a plan they accept tiles the state from ranks that hold what they give.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_decide::regroup::{decode_all, plan, HeldLayout, KeptLayout, RegroupBounds, RegroupFacts, WORDS};

/// An honest holder of layout 3 (one rank a host, one replica) at step 3.
fn honest(rank: usize, world: usize) -> RegroupFacts {
    let layout = HeldLayout { tag: 3, world, replicas: 1, rank, per_host: 1, place: Some(rank), shards: world };
    RegroupFacts {
        layout: Some(layout),
        step: 3,
        pending: false,
        last_norm: Some((2, 1.0)),
        whole: false,
        cursor: 192,
        seed: 1,
        draws: 3,
        stale: false,
        digest: [3; 32],
        kept_sum: true,
        target: Some(KeptLayout { replicas: 1, per_host: 1, place: Some(rank), shards: world }),
    }
}

fuzz_target!(|data: &[u8]| {
    let (Some(&flags), Some(n)) = (data.first(), data.get(1..3)) else { return };
    let n = usize::from(u16::from_le_bytes(n.try_into().expect("2 bytes")));
    let world = 1 + usize::from(flags % 4);
    let fuzzed: Vec<i64> =
        data[3..].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    // Flag 32: honest rows with the fuzzed words added (as a peer's row is summed), so the
    // search starts past the decoder's checks; else the fuzzed words alone.
    let mut words: Vec<i64> = match flags & 32 {
        0 => vec![0; WORDS * world],
        _ => (0..world).flat_map(|j| honest(j, world).encode()).collect(),
    };
    for (w, f) in words.iter_mut().zip(fuzzed) {
        *w = w.wrapping_add(f);
    }
    let Ok(facts) = decode_all(&words, world) else { return };
    // Flag 8: a group of hosts, the claims bounded by what the log gave (flag 16: it knows tag 3).
    let bounds = RegroupBounds {
        hosts: (0..world as u64).collect(),
        known: if flags & 16 == 16 { vec![3] } else { Vec::new() },
        layouts: (0..world).map(|r| vec![honest(r, world).layout.expect("a layout")]).collect(),
    };
    let bounds = (flags & 8 == 8).then_some(&bounds);
    let Ok(Some(p)) = plan(n, &facts, bounds, flags & 4 == 4) else { return };
    let mut at = 0;
    for (j, r) in &p.pieces {
        assert_eq!(r.start, at, "the pieces tile the state");
        at = r.end;
        assert!(r.clone().all(|v| p.own[*j].iter().any(|o| o.contains(&v))), "rank {j} gives {r:?} it lacks");
    }
    assert_eq!(at, n);
    for m in p.slot_moves.iter().chain(&p.param_moves) {
        assert!(!m.to.contains(&m.giver) && m.to.iter().all(|&t| t < world));
    }
});

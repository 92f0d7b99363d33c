//! When an entry stops waiting (a newer epoch in the log, the agent stopping), and an entry
//! given up from outside: once a newer schedule replaces the epoch being entered,
//! the entry's group is closed, so ranks blocked in its collectives fail at once instead of
//! waiting out the data timeout on peers that moved on.

use crate::Group;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Whether waiting for `epoch_id`'s peers is pointless: a newer epoch is in the log, or the
/// agent is stopping (so SIGTERM during an entry ends within the shutdown limit).
pub(in crate::runtime) fn give_up(
    watch: &watch::Receiver<limpet_consensus::LocalState>,
    stop: &CancellationToken,
    epoch_id: u64,
) -> impl Fn() -> bool {
    let (watch, stop) = (watch.clone(), stop.clone());
    move || {
        let st = Arc::clone(&watch.borrow().state);
        stop.is_cancelled()
            || [st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten().any(|e| e.id > epoch_id)
    }
}

/// Whether epoch `epoch_id` can no longer train: neither current nor scheduled (a newer
/// schedule replaced it before it began), or the agent stops.
pub(in crate::runtime) fn replaced(
    watch: &watch::Receiver<limpet_consensus::LocalState>,
    stop: &CancellationToken,
    epoch_id: u64,
) -> impl Fn() -> bool + Send + 'static {
    let (watch, stop) = (watch.clone(), stop.clone());
    move || {
        let st = Arc::clone(&watch.borrow().state);
        stop.is_cancelled()
            || ![st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten().any(|e| e.id == epoch_id)
    }
}

/// Breaks an entry's group from a thread of its own once its epoch is replaced: ranks
/// blocked in the entry's collectives on peers that moved on to the newer epoch would
/// otherwise wait out the data timeout (3 s of a 32-host mass revocation's idle, seen when
/// three schedules followed each other as the failures were found). Disarmed by drop, once
/// the entry's last collective is done: the socket clones go at once (peers see the group
/// closed when the entry fails, not 20 ms later), and none is shut down after. A replaced
/// epoch never trains: an id is scheduled only above every id before it, and only the
/// scheduled one becomes current, so closing its group loses nothing.
pub(in crate::runtime) struct Abandon {
    sockets: Arc<Mutex<Option<Vec<TcpStream>>>>,
}

impl Abandon {
    pub(in crate::runtime) fn watch(group: &Group, replaced: impl Fn() -> bool + Send + 'static) -> Abandon {
        let sockets = Arc::new(Mutex::new(Some(group.sockets())));
        let held = Arc::clone(&sockets);
        let watcher = move || loop {
            {
                let mut held = held.lock().expect("entry sockets lock");
                let Some(socks) = held.as_ref() else { return };
                if replaced() {
                    for s in socks {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                    *held = None;
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Err(e) = std::thread::Builder::new().name("entry-abandon".into()).spawn(watcher) {
            tracing::warn!(%e, "could not watch the entry for a newer epoch");
        }
        Abandon { sockets }
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        self.sockets.lock().expect("entry sockets lock").take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DataPlaneConfig, Endpoint};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    fn pair() -> (Vec<Endpoint>, Vec<Group>) {
        let eps: Vec<Endpoint> = (1..=2)
            .map(|n| {
                let mut cfg = DataPlaneConfig::new(5, n, b"entry-abandon-test-secret".to_vec());
                cfg.timeout = Duration::from_secs(10);
                Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
            })
            .collect();
        let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
        let groups = std::thread::scope(|s| {
            let hs: Vec<_> = eps
                .iter()
                .map(|ep| {
                    let addrs = &addrs;
                    s.spawn(move || ep.group(1, &[1, 2], addrs).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (eps, groups)
    }

    /// A rank blocked in a collective whose peer moved on fails once its epoch is replaced,
    /// long before the 10 s data timeout; a watch disarmed first closes nothing.
    #[test]
    fn a_replaced_entry_breaks_its_blocked_collective_and_a_disarmed_one_does_not() {
        let (_eps, mut groups) = pair();
        let replaced = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&replaced);
        drop(Abandon::watch(&groups[0], move || flag.load(Ordering::SeqCst)));
        replaced.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(60));
        std::thread::scope(|s| {
            for g in groups.iter_mut() {
                s.spawn(move || {
                    let mut buf = vec![1.0f32; 1000];
                    g.allreduce_sum(&mut buf, 0).unwrap();
                    assert_eq!(buf[0], 2.0);
                });
            }
        });
        let (_eps, mut groups) = pair();
        let replaced = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&replaced);
        let _armed = Abandon::watch(&groups[0], move || flag.load(Ordering::SeqCst));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            replaced.store(true, Ordering::SeqCst);
        });
        let started = Instant::now();
        let mut buf = vec![1.0f32; 1000];
        // Rank 2 never takes part (nor closes): only the watch can end the wait.
        assert!(groups[0].allreduce_sum(&mut buf, 0).is_err());
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }
}

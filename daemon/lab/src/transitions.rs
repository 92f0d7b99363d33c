//! Every transition a driver sees in a local cluster's status, kept for its summary: status
//! shows the newest transitions only, and a run with many epoch changes (shares that follow
//! a busy host's speeds) would lose its early ones.

use limpet_consensus::tls::{Tls, TlsFiles};
use limpet_daemon::status::{gather, StatusDoc, TransitionDoc};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Adds `doc`'s transitions to `seen`. A rank's record of a change leaves with the rank, so a
/// later status may know less of an epoch than an earlier one did: what the ranks reported
/// (the worst idle time, lost and redone steps, bytes fetched) is the most either status
/// said.
pub fn remember(seen: &mut BTreeMap<u64, TransitionDoc>, doc: &StatusDoc) {
    for t in &doc.transitions {
        let mut t = t.clone();
        if let Some(old) = seen.get(&t.epoch) {
            t.idle_ms = t.idle_ms.max(old.idle_ms);
            t.lost_steps = t.lost_steps.max(old.lost_steps);
            t.redone_steps = t.redone_steps.max(old.redone_steps);
            t.redone_from = match (t.redone_from, old.redone_from) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            t.fetched_bytes = t.fetched_bytes.max(old.fetched_bytes);
            t.fetch_ms = t.fetch_ms.max(old.fetch_ms);
        }
        seen.insert(t.epoch, t);
    }
}

/// The steps trained again after a rank went back, as `(epoch, first, count)` for each
/// transition that redid any: they left the lineage, so they are not applied twice. A status
/// from an agent that does not say where it went back to counts back from the epoch's start.
pub fn redone(seen: &[TransitionDoc]) -> Vec<(u64, u64, u64)> {
    seen.iter()
        .filter(|t| t.redone_steps > 0)
        .map(|t| (t.epoch, t.redone_from.unwrap_or(t.step.saturating_sub(t.redone_steps)), t.redone_steps))
        .collect()
}

/// Reads a cluster's status every second on a thread of its own, so that a slow answer
/// (each address may take its 3 s timeout) never holds up the caller's schedule.
pub struct Watcher {
    stop: Arc<AtomicBool>,
    addrs: Arc<Mutex<Vec<String>>>,
    thread: std::thread::JoinHandle<BTreeMap<u64, TransitionDoc>>,
}

impl Watcher {
    /// Starts watching `cluster` at `addrs` (as an operator where `tls` is given).
    pub fn start(
        cluster: String,
        addrs: Vec<String>,
        tls: Option<TlsFiles>,
    ) -> limpet_daemon::Result<Watcher> {
        let tls = tls.map(|f| Tls::load(&f)).transpose()?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let stop = Arc::new(AtomicBool::new(false));
        let addrs = Arc::new(Mutex::new(addrs));
        let (s, a) = (Arc::clone(&stop), Arc::clone(&addrs));
        let thread = std::thread::Builder::new().name("status-watch".into()).spawn(move || {
            let mut seen = BTreeMap::new();
            loop {
                let now = a.lock().expect("addresses").clone();
                if let Ok(doc) = rt.block_on(gather(&cluster, &now, tls.as_ref())) {
                    remember(&mut seen, &doc);
                }
                // Checked after a read, so that the last read follows the caller's last event.
                if s.load(Ordering::Relaxed) {
                    return seen;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })?;
        Ok(Watcher { stop, addrs, thread })
    }

    /// The addresses to read from from now on (after a node joined).
    pub fn set_addrs(&self, addrs: Vec<String>) {
        *self.addrs.lock().expect("addresses") = addrs;
    }

    /// Stops after one more read; every transition seen, oldest first.
    pub fn finish(self) -> Vec<TransitionDoc> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map(|seen| seen.into_values().collect()).unwrap_or_default()
    }
}

//! Retention: which of the running job's checkpoints are deleted, judged by what loads and
//! whose they are, never by their names alone.

use super::{list, shards_agree, step_dir, verify_parts, CheckpointError, Listed};
use std::path::Path;

/// Deletes old checkpoints of the running job (`job`, the job its images carry), judged by
/// content, not by name: it keeps the newest `keep` of that job that load intact (every part
/// read and checked) and everything newer than the oldest of them (a newer incomplete one may
/// be a stage's part still being written). Corrupt newest checkpoints therefore never cost the
/// older intact ones, and with no intact checkpoint nothing is deleted. Another job's
/// checkpoints (a directory reused by a new run) are neither counted nor deleted, nor is one
/// whose parts do not say whose they are. The steps deleted.
pub fn prune(
    dir: &Path,
    keep: usize,
    blocks: usize,
    job: &serde_json::Value,
) -> Result<Vec<u64>, CheckpointError> {
    let all = list(dir)?;
    // Every part's header names this job (an empty step directory, a write that never got
    // its first part in, is nobody's checkpoint and goes with the old ones).
    let ours = |l: &Listed| l.files().all(|p| limpet_snapshot::read_meta(p).is_ok_and(|m| &m.job == job));
    let mut intact = Vec::new();
    for l in all.iter().rev() {
        if intact.len() >= keep.max(1) {
            break;
        }
        // The header first (cheap): another job's checkpoint is not read whole.
        if l.complete(blocks) && ours(l) && loads_intact(l, blocks, job) {
            intact.push(l.step);
        }
    }
    let Some(&oldest_kept) = intact.last() else { return Ok(Vec::new()) };
    let mut removed = Vec::new();
    for l in all.iter().filter(|l| l.step < oldest_kept && ours(l)) {
        let d = step_dir(dir, l.step);
        match std::fs::remove_dir_all(&d) {
            // Another stage's writer pruned it first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            r => r.map_err(|source| CheckpointError::Io { op: "removing", path: d, source })?,
        }
        removed.push(l.step);
    }
    Ok(removed)
}

/// Whether checkpoint `l` of `job` loads intact: its parts as [`super::load`] joins them, each read
/// back a buffer at a time ([`verify_parts`]: pruning runs beside the writer, which still
/// holds the state it wrote); a set of shards by their headers alone ([`shards_agree`]:
/// reading every shard would mean reading the whole state at each checkpoint; each writer
/// read its own back when it wrote it).
fn loads_intact(l: &Listed, blocks: usize, job: &serde_json::Value) -> bool {
    let sets = l.shard_sets();
    if sets.is_empty() {
        return verify_parts(l, blocks).is_ok_and(|meta| &meta.job == job);
    }
    sets.iter().any(|files| shards_agree(files).is_ok_and(|(step, j, _)| step == l.step && &j == job))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tests::{corrupt, image};
    use crate::checkpoint::{newest, write_part};

    fn job(n: u64) -> serde_json::Value {
        serde_json::json!({ "job": n })
    }

    /// A directory reused by a new run holds the previous run's newer checkpoints: the new
    /// run's pruning neither counts nor deletes them, and keeps its own newest.
    #[test]
    fn prune_counts_and_deletes_only_the_running_jobs_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for step in [100, 200, 300] {
            write_part(d, &image(step, 0..4, 1), &(0..4), 0).unwrap();
        }
        for step in [10, 20, 30] {
            write_part(d, &image(step, 0..4, 2), &(0..4), 0).unwrap();
        }
        assert_eq!(prune(d, 2, 4, &job(2)).unwrap(), vec![10]);
        let left: Vec<u64> = list(d).unwrap().iter().map(|l| l.step).collect();
        assert_eq!(left, vec![20, 30, 100, 200, 300]);
        // The old run's own pruning is as careful with the new run's.
        assert_eq!(prune(d, 1, 4, &job(1)).unwrap(), vec![100, 200]);
        let left: Vec<u64> = list(d).unwrap().iter().map(|l| l.step).collect();
        assert_eq!(left, vec![20, 30, 300]);
    }

    #[test]
    fn prune_keeps_the_newest_complete_ones() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for step in [10, 20, 30, 40] {
            write_part(d, &image(step, 0..4, 1), &(0..4), 0).unwrap();
        }
        write_part(d, &image(50, 0..2, 1), &(0..2), 0).unwrap();
        assert_eq!(prune(d, 2, 4, &job(1)).unwrap(), vec![10, 20]);
        let left: Vec<u64> = list(d).unwrap().iter().map(|l| l.step).collect();
        assert_eq!(left, vec![30, 40, 50]);
    }

    #[test]
    fn corrupt_newest_checkpoints_never_cost_the_older_intact_ones() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for step in [10, 20] {
            write_part(d, &image(step, 0..4, 1), &(0..4), 0).unwrap();
        }
        // The two newest complete by name, but corrupt: going by names, prune would keep
        // them and delete 10 and 20, the only checkpoints that load.
        for step in [30, 40] {
            corrupt(&write_part(d, &image(step, 0..4, 1), &(0..4), 0).unwrap());
        }
        assert_eq!(prune(d, 2, 4, &job(1)).unwrap(), Vec::<u64>::new());
        assert_eq!(list(d).unwrap().len(), 4);
        // One intact newer checkpoint: it and 20 are the two kept; only 10 goes.
        write_part(d, &image(50, 0..4, 1), &(0..4), 0).unwrap();
        assert_eq!(prune(d, 2, 4, &job(1)).unwrap(), vec![10]);
        assert_eq!(newest(d, 4, &serde_json::json!({ "job": 1 })).unwrap().0.unwrap().0.step, 50);
        // Nothing intact at all: nothing is deleted.
        let empty = tempfile::tempdir().unwrap();
        corrupt(&write_part(empty.path(), &image(10, 0..4, 1), &(0..4), 0).unwrap());
        assert_eq!(prune(empty.path(), 1, 4, &job(1)).unwrap(), Vec::<u64>::new());
    }
}

//! The agents' step logs (`*.steps.jsonl`, one line per step a rank completed): read, merged
//! into one loss curve with the steps applied twice counted, and the stall each epoch
//! change caused.

use anyhow::Context;
use limpet_agent::runtime::StepLine;
use limpet_daemon::plot::ElasticPoint;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every step line of the step logs (`*.steps.jsonl`) in a local cluster's directory.
pub fn step_logs_in(dir: &Path) -> limpet_daemon::Result<Vec<StepLine>> {
    let paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".steps.jsonl"))
        .collect();
    read_step_logs(&paths)
}

/// Every node's step log, parsed.
pub fn read_step_logs(paths: &[PathBuf]) -> limpet_daemon::Result<Vec<StepLine>> {
    let mut out = Vec::new();
    for p in paths {
        let Ok(text) = std::fs::read_to_string(p) else { continue };
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            // A node killed mid-write leaves a torn last line; anything else is an error.
            match serde_json::from_str::<StepLine>(line) {
                Ok(l) => out.push(l),
                Err(e) if i + 1 == text.lines().count() => tracing::debug!(%e, "torn last line"),
                Err(e) => limpet_daemon::fail!("{}: line {}: {e}", p.display(), i + 1),
            }
        }
    }
    Ok(out)
}

/// The JSON lines of a peer's step log that parse as `T` (none while it does not exist; a
/// line still being written is skipped).
pub(crate) fn json_lines<T: serde::de::DeserializeOwned>(path: &Path) -> Vec<T> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Merges step logs into one point per step and counts steps completed in two different
/// epochs by nodes that were not killed (a step applied, then redone, would show up here; a
/// killed node's last step may legitimately be redone by the survivors, who never got it, and
/// so may the last step of a node that left: no state of a rank outside an epoch enters it).
/// Steps
/// `[start, start + n)` for each `(epoch, start, n)` of `redone`, and of each line that says
/// its rank went back (`StepLine::went_back`), were trained again after a rollback: their
/// earlier application left the lineage, so it does not count as twice. A step is excused
/// once for each epoch that went back over it, however many ranks or reports say so.
pub fn merge(lines: &[StepLine], killed: &[u64], redone: &[(u64, u64, u64)]) -> (Vec<ElasticPoint>, u64) {
    let said = lines.iter().filter_map(|l| {
        let [from, to] = l.went_back?;
        Some((l.epoch, from, to.saturating_sub(from)))
    });
    let redone: Vec<(u64, u64, u64)> = redone.iter().copied().chain(said).collect();
    // Each node's last step, with its epoch: only that step of a node that left can be one
    // the survivors never got (every earlier one the whole group completed).
    let mut last: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for l in lines {
        let e = last.entry(l.node).or_insert((l.epoch, l.step));
        *e = (*e).max((l.epoch, l.step));
    }
    let newest = lines.iter().map(|l| l.epoch).max().unwrap_or(0);
    let gone =
        |l: &StepLine| killed.contains(&l.node) || (last[&l.node] == (l.epoch, l.step) && l.epoch < newest);
    let mut by_step: BTreeMap<u64, BTreeMap<u64, &StepLine>> = BTreeMap::new();
    for l in lines.iter().filter(|l| !gone(l)) {
        by_step.entry(l.step).or_default().insert(l.epoch, l);
    }
    for l in lines.iter().filter(|l| gone(l)) {
        by_step.entry(l.step).or_default().entry(l.epoch).or_insert(l);
    }
    let mut twice = 0;
    let points = by_step
        .iter()
        .map(|(step, epochs)| {
            let survivors = epochs.values().filter(|l| !gone(l)).count() as u64;
            let again: std::collections::BTreeSet<u64> =
                redone.iter().filter(|&&(_, s, n)| (s..s + n).contains(step)).map(|&(e, ..)| e).collect();
            let again = again.len() as u64;
            twice += survivors.saturating_sub(1 + again);
            let l = epochs.values().next_back().expect("non-empty");
            let eval_loss = epochs.values().find_map(|l| l.eval_loss);
            ElasticPoint { step: *step, loss: l.loss, world: l.world, eval_loss }
        })
        .collect();
    (points, twice)
}

/// For every epoch after the first, the time from the last step completed in an earlier
/// epoch to the first step completed in it, less one median step: how long the change
/// stopped training, measured from the ranks' own step logs rather than from reports.
pub fn stalls(lines: &[StepLine]) -> Vec<(u64, u64)> {
    let mut epochs: Vec<u64> = lines.iter().map(|l| l.epoch).collect();
    epochs.sort_unstable();
    epochs.dedup();
    // The median gap between consecutive completions of one rank in one epoch.
    let mut gaps = Vec::new();
    let mut by_rank: BTreeMap<(u64, u64), Vec<u64>> = BTreeMap::new();
    for l in lines {
        by_rank.entry((l.node, l.epoch)).or_default().push(l.wall_ms);
    }
    for times in by_rank.values_mut() {
        times.sort_unstable();
        gaps.extend(times.windows(2).map(|w| w[1] - w[0]));
    }
    gaps.sort_unstable();
    let step_ms = gaps.get(gaps.len() / 2).copied().unwrap_or(0);
    epochs
        .iter()
        .skip(1)
        .filter_map(|&e| {
            let first = lines.iter().filter(|l| l.epoch == e).map(|l| l.wall_ms).min()?;
            let before =
                lines.iter().filter(|l| l.epoch < e && l.wall_ms <= first).map(|l| l.wall_ms).max()?;
            Some((e, (first - before).saturating_sub(step_ms)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use limpet_daemon::status::TransitionDoc;

    fn line(node: u64, epoch: u64, step: u64, wall_ms: u64) -> StepLine {
        StepLine {
            wall_ms,
            step,
            epoch,
            world: 2,
            rank: 0,
            devices: 0,
            node,
            name: format!("node-{node}"),
            loss: 1.0,
            agreed: false,
            eval_loss: None,
            overlap: None,
            went_back: None,
        }
    }

    #[test]
    fn merge_counts_steps_trained_twice_unless_a_rollback_redid_them() {
        // Epoch 1 trains steps 0..5; epoch 2 goes back to step 3 (two steps redone).
        let mut lines: Vec<StepLine> = (0..5).map(|s| line(1, 1, s, 100 * s)).collect();
        lines.extend((3..8).map(|s| line(1, 2, s, 1000 + 100 * s)));
        let (points, twice) = merge(&lines, &[], &[]);
        assert_eq!((points.len(), twice), (8, 2));
        let (_, twice) = merge(&lines, &[], &[(2, 3, 2)]);
        assert_eq!(twice, 0);
        // A redone range that does not cover the repeats does not excuse them.
        let (_, twice) = merge(&lines, &[], &[(2, 4, 1)]);
        assert_eq!(twice, 1);
        // The rank's own first line of epoch 2 says it went back two steps: the same.
        let mut said = lines.clone();
        said.iter_mut().find(|l| l.epoch == 2).expect("epoch 2").went_back = Some([3, 5]);
        assert_eq!(merge(&said, &[], &[]).1, 0);
        // Said by the rank and by the status both, it is still one going back: a third
        // application of step 4 (epoch 3, no rank going back) counts.
        let mut third = said.clone();
        third.push(line(1, 3, 4, 5000));
        assert_eq!(merge(&third, &[], &[(2, 3, 2)]).1, 1);
        said.iter_mut().find(|l| l.epoch == 2).expect("epoch 2").went_back = Some([4, 5]);
        assert_eq!(merge(&said, &[], &[]).1, 1);
        // Node 2 left after its step 5 of epoch 1, which epoch 2 trained without it.
        lines.extend((0..6).map(|s| line(2, 1, s, 100 * s)));
        assert_eq!(merge(&lines, &[], &[(2, 3, 2)]).1, 0);
        // Node 2 trained on in epoch 2: its step 5 was applied in both epochs.
        lines.push(line(2, 2, 6, 2000));
        assert_eq!(merge(&lines, &[], &[(2, 3, 2)]).1, 1);
        // Node 3 trained steps 10-12 alone in epoch 3 and left; epoch 4 trained them again:
        // only its last step is excused.
        lines.extend((10..13).map(|s| line(3, 3, s, 3000 + s)));
        lines.extend((10..13).map(|s| line(1, 4, s, 4000 + s)));
        assert_eq!(merge(&lines, &[], &[(2, 3, 2)]).1, 1 + 2);
    }

    #[test]
    fn a_rank_that_alone_applied_the_step_in_flight_redoes_it_without_counting_twice() {
        // Nodes 1 and 2 stand at step 203 (steps 0..203 applied) when the epoch is planned;
        // node 2 then applies step 203 alone and goes back to 203 at the entry of epoch 2.
        let mut lines: Vec<StepLine> =
            (200..203).flat_map(|s| [line(1, 1, s, s), line(2, 1, s, s)]).collect();
        lines.push(line(2, 1, 203, 203));
        lines.extend((203..206).flat_map(|s| [line(1, 2, s, 1000 + s), line(2, 2, s, 1000 + s)]));
        // What two reads of the status said: node 1's transition alone, then both nodes'.
        let doc = |v: serde_json::Value| -> TransitionDoc { serde_json::from_value(v).unwrap() };
        let first = doc(serde_json::json!({
            "epoch": 2, "step": 203, "world": 2, "cause": "failure of node 3",
            "idle_ms": 5, "lost_steps": 1, "fetched_bytes": 0,
        }));
        let second = doc(serde_json::json!({
            "epoch": 2, "step": 203, "world": 2, "cause": "failure of node 3",
            "idle_ms": 9, "lost_steps": 1, "fetched_bytes": 0, "redone_steps": 1, "redone_from": 203,
        }));
        let mut seen = BTreeMap::new();
        for t in [&second, &first] {
            let status = serde_json::json!({
                "v": 1, "cluster": "c", "answered_by": "n", "leader": null, "term": 1, "epoch": null,
                "scheduled": null, "step": 0, "total_steps": null, "nodes": [], "transitions": [t],
            });
            crate::transitions::remember(&mut seen, &serde_json::from_value(status).unwrap());
        }
        let seen: Vec<TransitionDoc> = seen.into_values().collect();
        assert_eq!(crate::transitions::redone(&seen), vec![(2, 203, 1)]);
        assert_eq!(merge(&lines, &[], &crate::transitions::redone(&seen)).1, 0);
        // Counted back from the epoch's start (as before), the redone step was missed.
        assert_eq!(merge(&lines, &[], &[(2, 202, 1)]).1, 1);
    }

    #[test]
    fn stalls_are_measured_from_the_step_logs() {
        // 10 ms steps; epoch 2's first step completes 250 ms after epoch 1's last.
        let mut lines: Vec<StepLine> = (0..5).map(|s| line(1, 1, s, 10 * s)).collect();
        lines.extend((5..9).map(|s| line(1, 2, s, 40 + 250 + 10 * (s - 5))));
        assert_eq!(stalls(&lines), vec![(2, 240)]);
    }
}

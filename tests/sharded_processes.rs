//! Sharded optimizer state (`[job].shard_state = "optimizer"`, and `"optimizer+gradients"`)
//! with real `limpetd` processes: through a notice, a join and a `kill -9` of a shard holder
//! the state is re-cut at each
//! entry without ever being made whole, and the job trains like one uninterrupted process; with both holders of a shard killed at once it goes back to the
//! newest checkpoint, says so, and still finishes with one process's bits; killed after the job's end,
//! the survivors load their own final checkpoints and train nothing again; a host joining
//! after the end writes the same final checkpoint from the gathers.

use std::path::{Path, PathBuf};
use std::time::Duration;

#[path = "common.rs"]
mod common;
use common::{max_rel_diff, node_logs, params, train_alone, transition, wait_showing_logs};
use limpet_lab::local::{LocalCluster, LocalJob};

/// As in `elastic_processes.rs`: the ring sums the same gradients in another order.
const PARAM_TOLERANCE: f64 = 1e-2;

#[test]
fn a_sharded_run_through_a_notice_a_join_and_a_kill_matches_one_process() {
    notice_join_kill(false);
}

/// The same with the gradients sharded too (ZeRO-2), which is sharded optimizer state with
/// each rank keeping only its blocks' reduced gradients: the same collectives, entries and
/// re-cuts.
#[test]
fn sharded_gradients_through_a_notice_a_join_and_a_kill_match_one_process() {
    notice_join_kill(true);
}

fn notice_join_kill(gradients: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let steps = 3000;
    let dir = tmp.path().join("sharded");
    let mut args =
        vec!["--nodes", "3", "--model", "mlp", "--data", "digits", "--batch", "64", "--shard-replicas", "1"];
    if gradients {
        args.push("--shard-gradients");
    }
    let summary = common::scenario_json(&dir, &args, steps, "0.1:notice:node-2:20,0.3:join,0.7:kill:node-3");
    let logs = node_logs(&dir);
    // Each rank cut its own shard in the first epoch (all built the same state), and the
    // state was re-cut at every later entry, the newcomer's included, never made whole.
    assert!(logs.contains("every rank holds the same state: each keeps its own shard"), "{logs}");
    for epoch in 2..=4 {
        let recut = format!("optimizer state re-cut for the new group epoch={epoch}");
        assert!(logs.contains(&recut), "no re-cut entering epoch {epoch}:\n{logs}");
    }
    assert!(!logs.contains("gathered from its shards for the entry"), "{logs}");
    // The final checkpoint was written from the gathers a tensor at a time, the ranks keeping
    // their blocks (the state was never whole on a rank, nor in one rank's memory).
    assert!(
        logs.contains("the job's final checkpoint written from the gathered state, a tensor at a time; every rank keeps its blocks"),
        "{logs}"
    );
    assert!(!logs.contains("back to the newest checkpoint"), "a single kill lost a shard:\n{logs}");
    // The killed holder's shard came from its replica (no rank went back to a checkpoint,
    // and there is none to go back to).
    transition(&summary, "failure of node 3");
    let join = transition(&summary, "join of node 4");
    assert!(join["fetched_bytes"].as_u64().unwrap() > 0, "{join}");

    let single = tmp.path().join("single");
    train_alone(&single, &["--model", "mlp", "--data", "digits", "--batch", "64"], steps);
    let final_file = PathBuf::from(summary["checkpoint"].as_str().unwrap());
    // Written pending at the last step, moved into place when the job finished.
    assert!(
        !final_file.with_file_name("checkpoint.pending.safetensors").exists(),
        "{}",
        final_file.display()
    );
    let (sharded_img, sharded) = params(&final_file);
    let (single_img, one) = params(&single.join("checkpoint.safetensors"));
    assert_eq!(sharded_img.meta().step, steps);
    let mut job = sharded_img.meta().job.clone();
    let sharding = match gradients {
        true => serde_json::json!({ "replicas": 1, "gradients": true }),
        false => serde_json::json!({ "replicas": 1 }),
    };
    assert_eq!(job["shard_state"], sharding);
    // The runs train the same job but for the sharding key.
    job.as_object_mut().unwrap().remove("shard_state");
    assert_eq!(job, single_img.meta().job);
    let diff = max_rel_diff(&sharded, &one);
    eprintln!("largest relative parameter difference: {diff:.2e}");
    assert!(diff < PARAM_TOLERANCE, "parameters differ by {diff:.3e} (tolerance {PARAM_TOLERANCE:e})");
}

#[test]
fn both_holders_of_a_shard_killed_at_once_go_back_to_the_checkpoint() {
    both_holders_killed(false, 1);
}

/// The same with a checkpoint directory every host shares (`[checkpoint].shared`): each rank
/// writes its shard of every checkpoint, nobody gathers the state for one, and every survivor
/// joins the shards to go back.
#[test]
fn shards_of_a_shared_checkpoint_bring_back_a_lost_block() {
    both_holders_killed(true, 1);
}

/// The same over hosts of two devices (`[node].devices`): every device holds its block and
/// that of the same device on the host before, writes its part of each checkpoint (a host
/// writes two), and the survivors' devices go back to the checkpoint joined from them.
#[test]
fn shards_of_local_ranks_in_a_shared_checkpoint_bring_back_a_lost_block() {
    both_holders_killed(true, 2);
}

fn both_holders_killed(shared: bool, devices: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    // Long enough after the loss for checkpoints of three shards: the write in flight at the
    // kill may hold its rank's writer for a few seconds (its record went to a dead leader and
    // is sent again once another leads).
    let steps = 1200;
    let checkpoints = tmp.path().join("shared");
    // Reproducible, so that the end is compared with one process bit for bit: a step applied
    // twice, or skipped, around the way back would show.
    let job = LocalJob {
        steps,
        reproducible: true,
        checkpoint_every: 20,
        shard_state: Some(("optimizer".into(), 1)),
        checkpoint_dir: shared.then(|| checkpoints.clone()),
        checkpoint_shared: shared,
        devices,
        ..LocalJob::default()
    };
    let mut c =
        LocalCluster::up_with(&dir, 5, job, &common::lab_exe(), Path::new(env!("CARGO_BIN_EXE_limpetd")))
            .unwrap();
    let logs: Vec<PathBuf> = c.file.nodes.iter().map(|n| n.step_log.clone()).collect();
    wait_showing_logs("five ranks past a checkpoint", Duration::from_secs(180), &dir, || {
        logs.iter().all(|l| common::step_worlds(l).iter().any(|&(s, w)| w == 5 && s > 45))
    });
    // Hosts 1 and 2 hold host 1's blocks (their owners and their replicas): both go at once.
    c.kill("node-2").unwrap();
    c.kill("node-3").unwrap();
    wait_showing_logs("the survivors go back to the checkpoint", Duration::from_secs(120), &dir, || {
        node_logs(&dir).contains("back to the newest checkpoint")
    });
    let survivor = &logs[0];
    wait_showing_logs("the job finishes with three", Duration::from_secs(300), &dir, || {
        common::step_worlds(survivor).iter().any(|&(s, w)| w == 3 && s + 1 >= steps)
    });
    // The survivors went back and trained on: the job ends where one uninterrupted process
    // does, with its content hash (the job's sharding is outside the hash).
    let last = dir.join("node-1").join("checkpoint.safetensors");
    wait_showing_logs("the final checkpoint", Duration::from_secs(120), &dir, || last.exists());
    let one = train_alone(
        &tmp.path().join("one"),
        &["--model", "mlp", "--data", "digits", "--batch", "64", "--reproducible"],
        steps,
    );
    let (end, _) = params(&last);
    assert_eq!(end.meta().step, steps);
    assert_eq!(end.content_hash(), one["content_hash"].as_str().unwrap(), "{}", node_logs(&dir));
    let all = node_logs(&dir);
    assert!(all.contains("no live rank holds values"), "{all}");
    if shared {
        // Five ranks wrote their shards of the checkpoints, then three (the older ones are
        // pruned); each survivor read them back.
        let (five, three) = (5 * devices, 3 * devices);
        assert!(
            all.contains("checkpoint shard written")
                && all.contains(&format!("shard={} of={five}", five - 1)),
            "{all}"
        );
        let last = format!("shard-{}-of-{three}.limpet", three - 1);
        let three = std::fs::read_dir(&checkpoints)
            .unwrap()
            .flatten()
            .filter(|d| d.path().join(&last).exists())
            .count();
        if three == 0 {
            let listing: Vec<String> = walk(&checkpoints);
            let said: Vec<&str> = all.lines().filter(|l| l.contains("checkpoint")).collect();
            panic!(
                "no checkpoint of three shards in {}:\n{}\nwhat the logs say of checkpoints:\n{}",
                checkpoints.display(),
                listing.join("\n"),
                said.join("\n")
            );
        }
        assert!(!all.contains("cannot read the checkpoint to resume from here"), "{all}");
        assert!(all.matches("resumed from the checkpoint").count() >= 3, "{all}");
    }
    // World 3 trained from the checkpoint's step on: the steps after it again, none when the
    // kill came right after a checkpoint (the log names the step trained, so a checkpoint
    // after step `s` is at `s + 1`).
    let worlds = common::step_worlds(survivor);
    // (The job's first steps may be at world 3 too, before every host joined: only the
    // steps after the last at world 5 count.)
    let last_five = worlds.iter().rposition(|&(_, w)| w == 5).unwrap();
    let lost_at = worlds[last_five].0;
    let resumed = worlds[last_five + 1..].iter().filter(|&&(_, w)| w == 3).map(|&(s, _)| s).min().unwrap();
    assert!(resumed <= lost_at + 1 && resumed % 20 <= 1, "resumed at {resumed} after training to {lost_at}");
    // Status says so: the transition into world 3 counts the steps given up as redone.
    let status = status_of(&dir);
    // `limpet status` shows each survivor's host as the ranks it trains as.
    let active: Vec<&serde_json::Value> =
        status["nodes"].as_array().unwrap().iter().filter(|n| n["status"] == "Active").collect();
    assert_eq!(active.len(), 3, "{}", status["nodes"]);
    let ranks = format!(", {devices} ranks");
    assert!(
        active.iter().all(|n| n["host"].as_str().unwrap().contains(&ranks) == (devices > 1)),
        "{}",
        status["nodes"]
    );
    let into_three = status["transitions"].as_array().unwrap().iter().filter(|t| t["world"] == 3);
    let redone = into_three.filter_map(|t| t["redone_steps"].as_u64()).max();
    let given_up = lost_at + 1 - resumed;
    assert!(
        redone.is_some_and(|r| (given_up..=given_up + 1).contains(&r)),
        "{redone:?} redone, {given_up} given up: {}",
        status["transitions"]
    );
}

/// Past the job's end the ranks keep their blocks, so both holders of one can still be lost
/// at once: the survivors then load the final checkpoints their own processes wrote, train
/// nothing again, and leave those files as they were.
#[test]
fn both_holders_of_a_shard_killed_after_the_end_train_nothing_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    // The newest logged checkpoint (step 60) is before the end: going back to it would
    // train ten steps again.
    let steps = 70;
    let job = LocalJob {
        steps,
        checkpoint_every: 20,
        shard_state: Some(("optimizer".into(), 1)),
        ..LocalJob::default()
    };
    let mut c = finished_cluster(&dir, 5, job);
    let finals: Vec<PathBuf> =
        ["node-1", "node-4", "node-5"].iter().map(|n| dir.join(n).join("checkpoint.safetensors")).collect();
    let hash = |p: &PathBuf| limpet_snapshot::read_meta(p).unwrap().content_hash;
    let before: Vec<String> = finals.iter().map(hash).collect();
    assert!(before.iter().all(|h| *h == before[0]), "the hosts' final checkpoints differ: {before:?}");
    // Hosts 1 and 2 hold host 1's blocks (their owners and their replicas): both go at once.
    c.kill("node-2").unwrap();
    c.kill("node-3").unwrap();
    wait_showing_logs(
        "the survivors load their own final checkpoints",
        Duration::from_secs(120),
        &dir,
        || node_logs(&dir).matches("the job's final checkpoint loaded").count() >= 3,
    );
    let into_three = || {
        let s = status_of(&dir);
        s["transitions"].as_array().unwrap().iter().filter(|t| t["world"] == 3).cloned().collect::<Vec<_>>()
    };
    wait_showing_logs("the survivors enter a world of three", Duration::from_secs(60), &dir, || {
        !into_three().is_empty()
    });
    let all = node_logs(&dir);
    assert!(all.contains("back to the newest checkpoint"), "{all}");
    assert!(!all.contains("could not load the job's final checkpoint"), "{all}");
    for t in into_three() {
        assert_eq!(t["redone_steps"].as_u64(), Some(0), "{t}");
        assert_eq!(t["step"].as_u64(), Some(steps), "{t}");
    }
    // Nothing trained again: each survivor's step log names every step once, in order, to
    // the last. (The job's first steps may be at a smaller world, before every host joined.)
    for n in ["node-1", "node-4", "node-5"] {
        let worlds = common::step_worlds(&dir.join(format!("{n}.steps.jsonl")));
        let once = worlds.windows(2).all(|w| w[1].0 == w[0].0 + 1);
        assert!(once && worlds.last().map(|l| l.0) == Some(steps - 1), "{n} trained again: {worlds:?}");
    }
    // And every survivor's final checkpoint is the one it wrote.
    let after: Vec<String> = finals.iter().map(hash).collect();
    assert_eq!(before, after);
}

/// A host that joins after a sharded job's end is given the state by the re-cut and writes
/// the job's final checkpoint from the gathers, a tensor at a time, under the pending name
/// until it finishes: the same file the hosts that finished wrote, which only send their
/// blocks. It trains nothing.
#[test]
fn a_host_joining_after_the_end_writes_the_same_final_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let job = LocalJob { steps: 40, shard_state: Some(("optimizer".into(), 1)), ..LocalJob::default() };
    let mut c = finished_cluster(&dir, 3, job);
    let newcomer = c.add().unwrap();
    wait_showing_logs("the newcomer finishes", Duration::from_secs(180), &dir, || {
        node_logs(&dir).matches(FINISHED).count() >= 4
    });
    let hash = |n: &str| {
        let file = dir.join(n).join("checkpoint.safetensors");
        limpet_snapshot::verify_file(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())).content_hash
    };
    let want = hash("node-1");
    for n in ["node-2", "node-3", newcomer.as_str()] {
        assert_eq!(hash(n), want, "{n}'s final checkpoint");
        assert!(!dir.join(n).join("checkpoint.pending.safetensors").exists(), "{n}");
    }
    let all = node_logs(&dir);
    let wrote = "the job's final checkpoint written from the gathered state, a tensor at a time; every rank keeps its blocks epoch=";
    assert!(all.contains(wrote), "the newcomer's entry wrote no final checkpoint:\n{all}");
    let sent = "the whole state gathered for other hosts' final checkpoints; this host wrote its own";
    assert!(all.matches(sent).count() >= 3, "{all}");
    let worlds = common::step_worlds(&dir.join(format!("{newcomer}.steps.jsonl")));
    assert!(worlds.is_empty(), "the newcomer trained: {worlds:?}");
}

/// What each `limpetd` logs once it has written the job's final checkpoint.
const FINISHED: &str = "job finished; final checkpoint written";

/// A local cluster of `hosts` in `dir` that has trained `job` to its end on every host.
fn finished_cluster(dir: &Path, hosts: usize, job: LocalJob) -> LocalCluster {
    let limpetd = Path::new(env!("CARGO_BIN_EXE_limpetd"));
    let c = LocalCluster::up_with(dir, hosts, job, &common::lab_exe(), limpetd).unwrap();
    wait_showing_logs("every host finishes", Duration::from_secs(300), dir, || {
        node_logs(dir).matches(FINISHED).count() >= hosts
    });
    c
}

/// `limpet status --json` of the local cluster in `dir`.
fn status_of(dir: &Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_limpet"))
        .args(["status", "--json", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The files under `dir`, for a failure's message.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out.sort();
    out
}

//! Durable checkpoints with real processes: a brand-new cluster carries on from the newest
//! checkpoint after every host of the old one was killed (from a shared directory, from S3 on
//! moto's server, or waiting for a directory that is not mounted yet), a pipelined job from
//! its stages' parts, S3 pruning that counts only verified uploads of the running job (and a
//! set of shards only when whole and of one write), and a full disk that costs a checkpoint,
//! not the job or the raft log.

use limpet_lab::local::{get_text, LocalJob};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

#[path = "common.rs"]
mod common;
use common::{
    exe, max_rel_diff, node_logs as logs, params, samples, step_records as steps_of, train_alone, up,
    wait_or_show, wait_until,
};

#[test]
fn a_new_cluster_resumes_from_the_newest_checkpoint_after_every_host_is_lost() {
    let job = LocalJob { steps: 2000, checkpoint_every: 100, ..LocalJob::default() };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        None,
        false,
    );
}

#[test]
fn with_resume_required_a_new_cluster_waits_for_a_missing_checkpoint_directory() {
    // The shared directory is not there when the new cluster starts (a mount not up yet):
    // "if-present" would start the job over at step 0 for good; "required" waits for it.
    // Long enough that the first cluster is still training when its hosts are killed (an MLP
    // step takes a few milliseconds; every check of the log starts a `limpet` process).
    let job = LocalJob {
        steps: 4000,
        checkpoint_every: 100,
        checkpoint_resume: Some("required".into()),
        ..LocalJob::default()
    };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        None,
        true,
    );
}

/// An S3 client for moto (which takes any credentials).
fn s3_client(url: &str) -> aws_sdk_s3::Client {
    let conf = aws_sdk_s3::Config::builder()
        .behavior_version_latest()
        .region(aws_sdk_s3::config::Region::new("us-east-1"))
        .endpoint_url(url)
        .force_path_style(true)
        .credentials_provider(aws_sdk_s3::config::Credentials::new("test", "test", None, None, "test"))
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

#[test]
fn a_new_cluster_resumes_from_s3_when_no_host_kept_a_checkpoint() {
    // Each host checkpoints into its own state directory (lost with it) and copies to an S3
    // API (moto's server, spoken to by the real SDK); the new cluster has only the bucket.
    let (_moto, job, remote) = s3_job("limpet-ckpt", "runs/mlp");
    resume_after_losing_every_host(
        LocalJob { steps: 1200, checkpoint_every: 100, ..job },
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        Some(remote),
        false,
    );
}

/// A bucket in moto's S3 server, the job that copies its checkpoints there (with the
/// credentials moto takes) and what reads the bucket back; the server lives as long as the
/// first value.
fn s3_job(
    bucket: &str,
    prefix: &str,
) -> (common::Moto, LocalJob, (limpet_agent::remote::RemoteSettings, aws_sdk_s3::Client)) {
    let moto = common::Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let remote = limpet_agent::remote::RemoteSettings {
        bucket: bucket.into(),
        prefix: prefix.into(),
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
    };
    let client = s3_client(&moto.url);
    rt.block_on(client.create_bucket().bucket(bucket).send()).unwrap();
    let job = LocalJob {
        checkpoint_s3: Some((format!("s3://{bucket}/{prefix}"), moto.url.clone())),
        env: vec![
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ],
        ..LocalJob::default()
    };
    (moto, job, (remote, client))
}

/// A sharded job (ZeRO-1 over two hosts) writes its checkpoints as shards into a shared
/// directory, and each shard's owner copies its own to S3; the new cluster has a new, empty
/// directory and the bucket: it resumes from the shards in S3 (a step counts there only as a
/// whole set naming one state).
#[test]
fn a_sharded_job_resumes_from_its_shards_in_s3_when_every_host_and_the_directory_are_lost() {
    let (_moto, job, remote) = s3_job("limpet-shards", "runs/zero");
    let job = LocalJob {
        steps: 1200,
        checkpoint_every: 100,
        checkpoint_shared: true,
        shard_state: Some(("optimizer".into(), 1)),
        ..job
    };
    resume_after_losing_every_host(
        job,
        250,
        &["--model", "mlp", "--data", "digits", "--batch", "64"],
        Some(remote),
        false,
    );
}

#[test]
fn a_pipelined_job_resumes_from_its_stage_parts_after_every_host_is_lost() {
    // Two hosts, two stages (1x2): each stage's host writes its own part of a checkpoint.
    let job = LocalJob {
        model: "gpt".into(),
        data: "chars".into(),
        steps: 240,
        global_batch: 32,
        micro_batch: Some(8),
        pipeline: Some("2".into()),
        layers: Some(2),
        checkpoint_every: 40,
        ..LocalJob::default()
    };
    let alone = ["--model", "gpt", "--data", "chars", "--layers", "2", "--batch", "32", "--micro-batch", "8"];
    resume_after_losing_every_host(job, 90, &alone, None, false);
}

/// Runs `job` on two hosts with checkpoints to a shared directory (or, with `remote`, each
/// host's own directory copied to S3) until `kill_after` steps, kills both, starts a
/// brand-new cluster (new name, new raft log, new directories) with the same job, and checks
/// that it starts at the newest checkpoint and ends with the parameters of one uninterrupted
/// `limpet train` with `alone`. With `hide_dir`, the shared directory is away when the new
/// cluster starts and only comes back once the cluster has waited for it without training.
/// A sharded job with `remote` writes its shards into a shared directory (as sharded
/// checkpoints are written) and the new cluster gets a new, empty one: S3 is all it has.
fn resume_after_losing_every_host(
    mut job: LocalJob,
    kill_after: u64,
    alone: &[&str],
    remote: Option<(limpet_agent::remote::RemoteSettings, aws_sdk_s3::Client)>,
    hide_dir: bool,
) {
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("checkpoints");
    let shards_to_s3 = remote.is_some() && job.checkpoint_shared;
    if remote.is_none() || shards_to_s3 {
        job.checkpoint_dir = Some(shared.clone());
        // With "required", even a new job's directory must be there, and be one limpet wrote
        // to or a mount (an empty directory on the parent's disk is an unmounted mount
        // point): the marker says this empty one is meant for a new job.
        std::fs::create_dir_all(&shared).unwrap();
        if job.checkpoint_resume.as_deref() == Some("required") {
            std::fs::write(shared.join(limpet_agent::checkpoint::MARKER), b"").unwrap();
        }
    }
    let (steps, every, pipelined) = (job.steps, job.checkpoint_every, job.pipeline.is_some());
    let first_dir = tmp.path().join("first");
    let mut first = up(&first_dir, 2, job.clone()).unwrap();
    let log = first.file.node("node-1").unwrap().step_log.clone();
    let passed = || steps_of(&log).last().is_some_and(|l| l.0 >= kill_after);
    wait_or_show(
        "the first cluster passes the kill step",
        Duration::from_secs(180),
        passed,
        Some(&first_dir),
    );
    // A checkpoint is in the log before the hosts go. With a directory, its files say so
    // at once; asking `limpet status` (a process per look) let a fast job finish meanwhile,
    // leaving the new cluster nothing to resume.
    wait_until("a checkpoint recorded in the log", Duration::from_secs(60), || match &remote {
        None => limpet_agent::checkpoint::list(&shared).is_ok_and(|listed| {
            let blocks = listed.iter().flat_map(|l| l.parts.iter().map(|(_, r)| r.end)).max().unwrap_or(0);
            listed.iter().any(|l| l.step >= 2 * every && l.complete(blocks))
        }),
        Some(_) => {
            let out =
                Command::new(exe()).args(["status", "--json", "--dir"]).arg(&first_dir).output().unwrap();
            let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            doc["checkpoints"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["step"].as_u64() >= Some(2 * every)))
        }
    });
    assert!(
        steps_of(&log).last().is_some_and(|l| l.0 + 1 < steps),
        "the first cluster finished its job before its hosts were killed: lengthen it"
    );
    // Every host lost at once.
    first.kill("node-1").unwrap();
    first.kill("node-2").unwrap();
    first.down();
    // The ranks compare where they copy to S3 at each checkpoint: one bucket and prefix here.
    let said = common::node_logs(&first_dir);
    assert!(!said.contains("[checkpoint].s3 differ"), "{said}");
    let listed: Vec<limpet_agent::checkpoint::Listed> = match &remote {
        None => limpet_agent::checkpoint::list(&shared).unwrap(),
        Some((r, client)) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let by_step =
                rt.block_on(limpet_agent::remote::Remote::with_client(client.clone(), r).list()).unwrap();
            by_step.into_values().collect()
        }
    };
    // The model's block count: where the parts end (none for a set of shards, which is
    // complete by itself).
    let blocks = listed.iter().flat_map(|l| l.parts.iter().map(|(_, r)| r.end)).max().unwrap_or(0);
    if shards_to_s3 {
        assert!(listed.iter().all(|l| l.parts.is_empty()), "a sharded job copies shards, not gathered parts");
        let fresh = tmp.path().join("checkpoints-new");
        std::fs::create_dir_all(&fresh).unwrap();
        job.checkpoint_dir = Some(fresh);
    }
    // A set of shards is complete by itself; names alone (with no blocks to cover) are not.
    let complete = |l: &limpet_agent::checkpoint::Listed| {
        if shards_to_s3 {
            l.shard_set().is_some()
        } else {
            l.complete(blocks)
        }
    };
    let newest = listed.iter().rev().find(|l| complete(l)).unwrap().step;
    assert!(newest >= 2 * every && newest % every == 0, "newest checkpoint {newest}");
    assert!(listed.len() <= 3, "keep = 2 (and one being written): {} kept", listed.len());

    let away = tmp.path().join("checkpoints.away");
    if hide_dir {
        std::fs::rename(&shared, &away).unwrap();
    }
    let mount_point = tmp.path().join("unmounted");
    let second_dir = tmp.path().join("second");
    let mut second = up(&second_dir, 2, job).unwrap();
    let logs_of = |n: &str| second.file.node(n).unwrap().step_log.clone();
    let (log1, log2) = (logs_of("node-1"), logs_of("node-2"));
    // The resume is recorded as the new cluster's first checkpoint (asked for at once: a
    // long job's later checkpoints push the oldest records out of the log's list).
    let resume_recorded = |doc: &serde_json::Value| {
        doc["checkpoints"].as_array().is_some_and(|c| {
            c.iter().any(|c| c["step"].as_u64() == Some(newest) && c["epoch"].as_u64() == Some(0))
        })
    };
    if hide_dir {
        wait_or_show(
            "the new cluster says it waits for the directory",
            Duration::from_secs(60),
            || logs(&second_dir).contains("cannot resume yet"),
            Some(&second_dir),
        );
        std::thread::sleep(Duration::from_secs(3));
        assert!(steps_of(&log1).is_empty() && steps_of(&log2).is_empty(), "trained without its checkpoint");
        // The mount point appears, empty (the volume not mounted on it yet): still no start.
        std::fs::create_dir(&shared).unwrap();
        wait_or_show(
            "the new cluster says an empty directory is not its checkpoints",
            Duration::from_secs(60),
            || logs(&second_dir).contains("unmounted mount point"),
            Some(&second_dir),
        );
        assert!(
            steps_of(&log1).is_empty() && steps_of(&log2).is_empty(),
            "trained from an empty mount point"
        );
        std::fs::rename(&shared, &mount_point).unwrap();
        std::fs::rename(&away, &shared).unwrap();
    }
    wait_or_show(
        "the resume recorded in the new cluster's log",
        Duration::from_secs(120),
        || {
            let out =
                Command::new(exe()).args(["status", "--json", "--dir"]).arg(&second_dir).output().unwrap();
            resume_recorded(&serde_json::from_slice(&out.stdout).unwrap_or_default())
        },
        Some(&second_dir),
    );
    let finished = || [&log1, &log2].iter().all(|l| steps_of(l).last().is_some_and(|l| l.0 == steps - 1));
    wait_or_show("the new cluster finishes the job", Duration::from_secs(300), finished, Some(&second_dir));
    let logged = steps_of(&log1);
    assert_eq!(
        logged[0].0,
        newest,
        "the new cluster's first step is the checkpoint's\n{}",
        logs(&second_dir)
    );
    // The final state (both hosts' parts when pipelined) is the uninterrupted job's, within
    // the data-parallel rounding tolerance of the elastic tests.
    let finals: Vec<PathBuf> =
        ["node-1", "node-2"].iter().map(|n| second_dir.join(n).join("checkpoint.safetensors")).collect();
    wait_until("the final checkpoints", Duration::from_secs(30), || finals.iter().all(|p| p.exists()));
    second.down();
    let alone_dir = tmp.path().join("alone");
    let report = train_alone(&alone_dir, alone, steps);
    if pipelined {
        // Stages draw their own dropout masks, so a pipelined run's parameters drift from
        // one process's; the elastic pipeline test compares the test loss for that reason.
        let (loss, _) = limpet_lab::demo::evaluate(&finals, None).unwrap();
        let reference = report["test_loss"].as_f64().unwrap();
        assert!(
            (loss - reference).abs() <= 0.01 * reference,
            "test loss {loss} (resumed) vs {reference} (one process)"
        );
    } else {
        let (_, mine) = params(&finals[0]);
        let (_, reference) = params(&alone_dir.join("checkpoint.safetensors"));
        let diff = max_rel_diff(&mine, &reference);
        assert!(diff < 1e-2, "parameters differ from one uninterrupted process by {diff:.2e}");
    }
}

#[test]
fn s3_pruning_counts_only_verified_uploads_of_the_running_job() {
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    let moto = common::Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = s3_client(&moto.url);
    rt.block_on(client.create_bucket().bucket("ckpt").send()).unwrap();
    let settings = limpet_agent::remote::RemoteSettings {
        bucket: "ckpt".into(),
        prefix: "run".into(),
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
    };
    let remote = limpet_agent::remote::Remote::with_client(client.clone(), &settings);
    let tmp = tempfile::tempdir().unwrap();
    // Steps 10 and 20 of job 1, then 50 and 60 of another run's job 2 under the same prefix
    // (a reused bucket): parts written, verified and uploaded as the agent does.
    let fingerprint = |job: u64| limpet_snapshot::job_fingerprint(&serde_json::json!({ "job": job }));
    for (step, job) in [(10u64, 1u64), (20, 1), (50, 2), (60, 2)] {
        let tensors = (0..4)
            .map(|b| {
                let name = format!("param/blocks.{b}.w");
                (name.clone(), RawTensor::from_f32(&name, vec![2], &[b as f32, step as f32]).unwrap())
            })
            .collect();
        let image = StateImage::new(step, step, RngState::new(1), serde_json::json!({ "job": job }), tensors);
        let path = limpet_agent::checkpoint::write_part(tmp.path(), &image, &(0..4), 0).unwrap();
        limpet_agent::checkpoint::verify_part(&path, &image).unwrap();
        let blocks = limpet_agent::remote::PartName::Blocks(0..4);
        rt.block_on(remote.upload(step, &blocks, &path, image.content_hash(), &fingerprint(job), None))
            .unwrap();
    }
    // Steps 30 and 40: objects with a checkpoint's names but not verified uploads (a stray
    // copy, a half-finished tool): going by names, they would be the two kept.
    for step in [30u64, 40] {
        let key = format!("run/step-{step:012}/blocks-0-4.limpet");
        rt.block_on(
            client.put_object().bucket("ckpt").key(key).body(b"not a checkpoint".to_vec().into()).send(),
        )
        .unwrap();
    }
    let steps = || rt.block_on(remote.list()).unwrap().into_keys().collect::<Vec<u64>>();
    assert_eq!(steps(), vec![10, 20, 30, 40, 50, 60]);
    assert_eq!(rt.block_on(remote.prune(2, 4, &fingerprint(1), u64::MAX)).unwrap(), Vec::<u64>::new());
    assert_eq!(steps(), vec![10, 20, 30, 40, 50, 60]);
    // Job 1 keeps its newest; the other run's newer steps neither count nor go.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint(1), u64::MAX)).unwrap(), vec![10]);
    assert_eq!(steps(), vec![20, 30, 40, 50, 60]);
    // A writer of step 55 counts nothing past it: step 60 (an abandoned timeline's, another
    // run's) does not push the steps up to 55 out.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint(2), 55)).unwrap(), Vec::<u64>::new());
    assert_eq!(steps(), vec![20, 30, 40, 50, 60]);
    // Job 2 prunes its own older step only: not job 1's, not the unverified objects.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint(2), u64::MAX)).unwrap(), vec![50]);
    assert_eq!(steps(), vec![20, 30, 40, 60]);
}

/// A sharded job's owners each upload their shard, tagged with the whole state's hash: a
/// step counts in S3 (fetched, kept) only when its whole set is there, of the running job,
/// naming one whole state; then the local search joins the fetched shards.
#[test]
fn s3_counts_a_set_of_shards_only_when_it_is_whole_and_names_one_state() {
    use limpet_agent::checkpoint::{shard_path, verify_part, write_shard};
    use limpet_agent::remote::PartName;
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    let moto = common::Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = s3_client(&moto.url);
    rt.block_on(client.create_bucket().bucket("ckpt").send()).unwrap();
    let settings = limpet_agent::remote::RemoteSettings {
        bucket: "ckpt".into(),
        prefix: "run".into(),
        endpoint: Some(moto.url.clone()),
        region: Some("us-east-1".into()),
    };
    let remote = limpet_agent::remote::Remote::with_client(client.clone(), &settings);
    let job = serde_json::json!({ "job": 1 });
    let fingerprint = limpet_snapshot::job_fingerprint(&job);
    // The whole state of a step (`seed` tells two writes of one step apart), and its tensors
    // dealt round-robin over `n` shards, each marked with the whole state's hash.
    let whole = |step: u64, seed: f32| {
        let tensors = (0..4)
            .map(|b| {
                let name = format!("param/blocks.{b}.w");
                (name.clone(), RawTensor::from_f32(&name, vec![3], &[b as f32, step as f32, seed]).unwrap())
            })
            .collect();
        StateImage::new(step, step, RngState::new(1), job.clone(), tensors)
    };
    let shards_of = |w: &StateImage, n: usize| -> Vec<StateImage> {
        let m = w.meta();
        (0..n)
            .map(|i| {
                let t = w.tensors().iter().skip(i).step_by(n).map(|(k, v)| (k.clone(), v.clone())).collect();
                let meta = (m.step, m.cursor, m.rng, m.job.clone());
                limpet_snapshot::shards::shard_image(meta, t, w.content_hash()).unwrap()
            })
            .collect()
    };
    let shards = |w: &StateImage| shards_of(w, 3);
    // Shard `i` of `n` (`s`) written, verified and uploaded as its owner does.
    let src = tempfile::tempdir().unwrap();
    let upload_of = |s: &StateImage, (i, n): (usize, usize), w: &StateImage| {
        let step = s.meta().step;
        let path = write_shard(src.path(), s, (i, n), 0).unwrap();
        verify_part(&path, s).unwrap();
        let name = PartName::Shard { index: i, of: n };
        let tag = Some(w.content_hash());
        rt.block_on(remote.upload(step, &name, &path, s.content_hash(), &fingerprint, tag)).unwrap();
    };
    let upload = |s: &StateImage, i: usize, w: &StateImage| upload_of(s, (i, 3), w);
    // Steps 5 and 10: whole sets. Step 20: a whole set by its names, but shard 2 is of
    // another write of the step (another whole hash). Step 40: shard 1 never came.
    let (w5, w10, w20, other20, w40) =
        (whole(5, 0.0), whole(10, 0.0), whole(20, 0.0), whole(20, 1.0), whole(40, 0.0));
    for w in [&w5, &w10] {
        for (i, s) in shards(w).iter().enumerate() {
            upload(s, i, w);
        }
    }
    let (a, b) = (shards(&w20), shards(&other20));
    upload(&a[0], 0, &w20);
    upload(&a[1], 1, &w20);
    upload(&b[2], 2, &other20);
    let s40 = shards(&w40);
    upload(&s40[0], 0, &w40);
    upload(&s40[2], 2, &w40);
    let listed = rt.block_on(remote.list()).unwrap();
    assert_eq!(listed.keys().copied().collect::<Vec<u64>>(), vec![5, 10, 20, 40]);
    assert!(listed[&20].shard_set().is_some() && listed[&40].shard_set().is_none());
    // Only 5 and 10 count: keeping one keeps 10 (not 20 or 40, newer) and deletes every
    // object of 5.
    assert_eq!(rt.block_on(remote.prune(1, 4, &fingerprint, u64::MAX)).unwrap(), vec![5]);
    let left = rt.block_on(client.list_objects_v2().bucket("ckpt").prefix("run/step-000000000005/").send());
    assert!(left.unwrap().contents().is_empty(), "every shard of a pruned step is deleted");
    // Step 30, uploaded since: every shard tagged with one whole state, but shard 2 is of
    // another write (its tag a lie): tags make it a whole set, its headers do not.
    let (w30, other30) = (whole(30, 0.0), whole(30, 1.0));
    let (a30, b30) = (shards(&w30), shards(&other30));
    upload(&a30[0], 0, &w30);
    upload(&a30[1], 1, &w30);
    upload(&b30[2], 2, &w30);
    // Another job's new cluster fetches nothing; this job's passes 30 over once its headers
    // are here and fetches 10, into the shards' places, and the local search joins them into
    // the whole state.
    let dest = tempfile::tempdir().unwrap();
    let other_job = limpet_snapshot::job_fingerprint(&serde_json::json!({ "job": 2 }));
    assert_eq!(rt.block_on(remote.fetch_newest(dest.path(), 4, &other_job, 3)).unwrap(), Vec::<u64>::new());
    assert_eq!(rt.block_on(remote.fetch_newest(dest.path(), 4, &fingerprint, 3)).unwrap(), vec![10]);
    assert!((0..3).all(|i| shard_path(dest.path(), 10, i, 3).exists()));
    assert_eq!(limpet_agent::checkpoint::list(dest.path()).unwrap().len(), 1, "nothing of 20 or 40");
    let (found, _) = limpet_agent::checkpoint::newest(dest.path(), 4, &job).unwrap();
    let (l, image) = found.expect("the fetched set loads");
    assert_eq!((l.step, image.content_hash()), (10, w10.content_hash()));
    // Step 30 written again by a world of two (training came back to it): its set of three
    // is tried first (the largest) and passed over, and its set of two is fetched, with
    // nothing of the three left behind.
    for (i, s) in shards_of(&w30, 2).iter().enumerate() {
        upload_of(s, (i, 2), &w30);
    }
    let dest = tempfile::tempdir().unwrap();
    assert_eq!(rt.block_on(remote.fetch_newest(dest.path(), 4, &fingerprint, 1)).unwrap(), vec![30]);
    assert!((0..3).all(|i| !shard_path(dest.path(), 30, i, 3).exists()), "the set of three is not kept");
    let (found, _) = limpet_agent::checkpoint::newest(dest.path(), 4, &job).unwrap();
    let (l, image) = found.expect("the set of two loads");
    assert_eq!((l.step, image.content_hash()), (30, w30.content_hash()));
}

/// The bytes of the files under `dir`.
fn walk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk_bytes(&p)
            } else {
                e.metadata().map_or(0, |m| m.len())
            }
        })
        .sum()
}

/// A tmpfs of `size` mounted at `dir` for the test's lifetime.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "mounting a tmpfs: {}", String::from_utf8_lossy(&out.stderr));
        SmallDisk(dir.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_checkpoint_disk_is_a_warning_and_a_metric_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    // 48 KiB: a checkpoint of the MLP (about 75 KB per part) cannot fit.
    let disk = SmallDisk::mount(&tmp.path().join("small"), "48k");
    let job = LocalJob {
        steps: 100_000,
        checkpoint_every: 50,
        checkpoint_dir: Some(disk.0.clone()),
        // No reserve: the disk really fills (the next test keeps a reserve).
        checkpoint_min_free: Some("0".into()),
        ..LocalJob::default()
    };
    let dir = tmp.path().join("c");
    let mut c = up(&dir, 2, job).unwrap();
    let failures = || checkpoint_failures(&c);
    wait_or_show("a checkpoint failure counted", Duration::from_secs(120), || failures() >= 1.0, Some(&dir));
    let log = c.file.nodes[0].step_log.clone();
    let at = steps_of(&log).last().map_or(0, |s| s.0);
    wait_or_show(
        "training on past the full disk, through more checkpoint attempts",
        Duration::from_secs(120),
        || steps_of(&log).last().is_some_and(|s| s.0 > at + 120 && s.2 == 2),
        Some(&dir),
    );
    assert!(failures() >= 2.0, "every attempt fails and is counted");
    let all = logs(&dir);
    assert!(all.contains("writing a checkpoint failed") && all.contains("No space left on device"), "{all}");
    // And the operator sees it without reading logs.
    let out = Command::new(exe()).args(["status", "--dir"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("checkpoints failing on node-1") && text.contains("No space left on device"),
        "{text}"
    );
    for n in &c.file.nodes {
        assert!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(n.pid as i32), None).is_ok(),
            "{} exited",
            n.name
        );
    }
    c.down();
    drop(disk);
}

/// The checkpoint failures every node of `c` has counted in its metrics (a node not serving
/// them yet counts none).
fn checkpoint_failures(c: &limpet_lab::local::LocalCluster) -> f64 {
    c.file
        .nodes
        .iter()
        .filter_map(|n| get_text(&n.metrics).ok())
        .filter_map(|page| samples(&page).get("limpet_checkpoint_failures_total").copied())
        .sum()
}

/// The raft log (sled), the step logs and the checkpoints on one small disk: with a reserve
/// (`[checkpoint].min_free`), checkpoints stop before they take the room the log needs; the
/// refusal is a warning, a metric and a status line, and the cluster keeps committing.
#[test]
fn checkpoints_leave_the_reserve_to_the_raft_log_on_a_shared_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&tmp.path().join("shared"), "64m");
    let dir = disk.0.join("c");
    let job = LocalJob {
        steps: 100_000,
        checkpoint_every: 50,
        checkpoint_dir: Some(disk.0.join("ck")),
        // Room for the nodes' state and a few checkpoints (about 0.3 MB each), no more.
        checkpoint_min_free: Some("63M".into()),
        ..LocalJob::default()
    };
    let mut c = up(&dir, 2, job).unwrap();
    let failures = || checkpoint_failures(&c);
    wait_or_show("a checkpoint refused", Duration::from_secs(120), || failures() >= 1.0, Some(&dir));
    let all = logs(&dir);
    assert!(all.contains("[checkpoint].min_free") && !all.contains("No space left"), "{all}");
    let out = Command::new(exe()).args(["status", "--dir"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("checkpoints failing on") && text.contains("min_free"), "{text}");
    // What was written left the reserve; what was refused left nothing behind. The
    // checkpoints hold at most the disk less the reserve; the raft log on the same disk goes
    // on growing after the refusal (sled takes room a segment at a time), so the free room
    // may dip under the reserve by what the log took since, not by a checkpoint's worth more.
    let ck_bytes: u64 = walk_bytes(&disk.0.join("ck"));
    assert!(ck_bytes <= (64 - 63) << 20, "{ck_bytes} bytes of checkpoints: the reserve was eaten");
    let st = nix::sys::statvfs::statvfs(&disk.0).unwrap();
    let free = st.blocks_available() as u64 * st.fragment_size() as u64;
    assert!(free >= 60 << 20, "{free} bytes free: the reserve was eaten");
    // (A directory may be empty for the instant between its making and its part's write:
    // one still empty a moment later was left behind.)
    let empty = || -> Vec<PathBuf> {
        let dirs = std::fs::read_dir(disk.0.join("ck")).unwrap().flatten().map(|d| d.path());
        dirs.filter(|d| d.read_dir().is_ok_and(|mut e| e.next().is_none())).collect()
    };
    let first = empty();
    if !first.is_empty() {
        std::thread::sleep(Duration::from_secs(2));
        let left: Vec<_> = empty().into_iter().filter(|d| first.contains(d)).collect();
        assert!(left.is_empty(), "empty checkpoints left behind: {left:?}");
    }
    // The log still takes entries: a node drained now leaves through a committed epoch, and
    // training goes on at world 1.
    let out = Command::new(exe()).args(["drain", "node-2", "--dir"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = c.file.nodes[0].step_log.clone();
    wait_or_show(
        "training on at world 1 after the drain",
        Duration::from_secs(120),
        || steps_of(&log).last().is_some_and(|s| s.2 == 1),
        Some(&dir),
    );
    c.down();
    drop(disk);
}

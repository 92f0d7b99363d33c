//! Checkpoint files: parts, shards, listing, loading and their checks.

use super::*;
use limpet_snapshot::{RawTensor, RngState};

pub(super) fn image(step: u64, blocks: Range<usize>, job: u64) -> StateImage {
    let tensors = blocks
        .map(|b| {
            let name = format!("param/blocks.{b}.w");
            let t = RawTensor::from_f32(&name, vec![2], &[b as f32, step as f32]).unwrap();
            (name, t)
        })
        .collect();
    StateImage::new(step, step * 8, RngState::new(1), serde_json::json!({ "job": job }), tensors)
}

/// `whole`'s tensors dealt round-robin over `n` shards, each marked with its hash.
fn shards_of(whole: &StateImage, n: usize) -> Vec<StateImage> {
    let m = whole.meta();
    (0..n)
        .map(|i| {
            let t = whole.tensors().iter().skip(i).step_by(n).map(|(k, v)| (k.clone(), v.clone())).collect();
            let meta = (m.step, m.cursor, m.rng, m.job.clone());
            limpet_snapshot::shards::shard_image(meta, t, whole.content_hash()).unwrap()
        })
        .collect()
}

#[test]
fn the_shards_of_a_write_join_and_an_incomplete_set_is_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let job = serde_json::json!({ "job": 1 });
    let whole = image(40, 0..4, 1);
    for (i, s) in shards_of(&whole, 3).iter().enumerate() {
        let p = write_shard(dir.path(), s, (i, 3), 0).unwrap();
        assert_eq!(p, dir.path().join(format!("step-000000000040/shard-{i}-of-3.limpet")));
    }
    // A newer write that lost its middle shard (a rank killed while writing).
    let newer = shards_of(&image(60, 0..4, 1), 3);
    write_shard(dir.path(), &newer[0], (0, 3), 0).unwrap();
    write_shard(dir.path(), &newer[2], (2, 3), 0).unwrap();
    let at40 = listed_at(dir.path(), 40).unwrap();
    assert!(at40.complete(4) && at40.parts.is_empty());
    assert_eq!(load(&at40, 4).unwrap(), whole);
    assert!(!listed_at(dir.path(), 60).unwrap().complete(4));
    let (found, skipped) = newest(dir.path(), 4, &job).unwrap();
    assert_eq!(found.unwrap().1, whole);
    assert!(skipped[0].contains("incomplete"), "{skipped:?}");
    // A shard of another write in the set: the join refuses it, naming the file.
    let other = shards_of(&image(40, 0..4, 2), 3);
    write_shard(dir.path(), &other[1], (1, 3), 0).unwrap();
    let e = load(&listed_at(dir.path(), 40).unwrap(), 4).unwrap_err().to_string();
    assert!(e.contains("shard-1-of-3.limpet"), "{e}");
    // Beside it, a whole set of another world at the step (training came back to it in
    // another world, or a set fetched from S3): the join takes the set that loads.
    let two = shards_of(&whole, 2);
    write_shard(dir.path(), &two[0], (0, 2), 0).unwrap();
    assert!(load(&listed_at(dir.path(), 40).unwrap(), 4).is_err(), "one set broken, the other incomplete");
    write_shard(dir.path(), &two[1], (1, 2), 0).unwrap();
    assert_eq!(load(&listed_at(dir.path(), 40).unwrap(), 4).unwrap(), whole);
    // The writer of shard 0 waits for a whole set whose headers make its hash: the set
    // of another write is refused, a set still missing a shard times out.
    let short = std::time::Duration::from_millis(200);
    let never = || None;
    let e = await_shards(dir.path(), 40, 3, whole.content_hash(), short, &never).unwrap_err().to_string();
    assert!(e.contains("shard 1 holds another state"), "{e}");
    let e = await_shards(dir.path(), 60, 3, "h", short, &never).unwrap_err().to_string();
    assert!(e.contains("2 of its 3 shards, after 200ms"), "{e}");
    // A stopping agent, or a writer gone, does not wait out the time, and says why.
    let started = std::time::Instant::now();
    let long = std::time::Duration::from_secs(60);
    let gone = || Some("node 3, a writer, failed".to_string());
    let e = await_shards(dir.path(), 60, 3, "h", long, &gone).unwrap_err().to_string();
    assert!(e.contains("2 of its 3 shards, node 3, a writer, failed"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    write_shard(dir.path(), &newer[1], (1, 3), 0).unwrap();
    // A write of another world at the same step (before going back) is removed.
    write_shard(dir.path(), &shards_of(&image(60, 0..4, 1), 2)[0], (0, 2), 0).unwrap();
    let at = await_shards(dir.path(), 60, 3, image(60, 0..4, 1).content_hash(), short, &never).unwrap();
    assert_eq!(at, step_dir(dir.path(), 60));
    assert!(listed_at(dir.path(), 60).unwrap().shards.iter().all(|s| s.2 == 3));
    // Pruning keeps the newest that agree (by their headers) and deletes older ones of
    // the job (step 40, holding another job's shard, is not wholly the job's: kept).
    for (i, s) in shards_of(&image(20, 0..4, 1), 3).iter().enumerate() {
        write_shard(dir.path(), s, (i, 3), 0).unwrap();
    }
    assert_eq!(prune(dir.path(), 1, 4, &job).unwrap(), vec![20]);
    assert!(listed_at(dir.path(), 60).unwrap().complete(4));
    assert_eq!(parse_shard("shard-2-of-4.limpet"), Some((2, 4)));
    for bad in [
        "shard-3-of-3.limpet",
        "shard--of-3.limpet",
        "shard-1-of-3.tmp",
        "shard-1-of-1234567.limpet",
        "shard-01-of-3.limpet",
    ] {
        assert_eq!(parse_shard(bad), None, "{bad}");
    }
}

#[test]
fn names_round_trip_and_foreign_names_are_ignored() {
    let d = Path::new("/ck");
    let p = part_path(d, 1200, &(0..4));
    assert_eq!(p, Path::new("/ck/step-000000001200/blocks-0-4.limpet"));
    assert_eq!(parse_step_dir("step-000000001200"), Some(1200));
    assert_eq!(parse_part("blocks-0-4.limpet"), Some(0..4));
    for bad in ["step-12", "step-00000000120x", "steps-000000001200", "step-+00000001200"] {
        assert_eq!(parse_step_dir(bad), None, "{bad}");
    }
    for bad in ["blocks-4-0.limpet", "blocks-0-4.tmp", ".blocks-0-4.limpet.tmp-7", "blocks--4.limpet"] {
        assert_eq!(parse_part(bad), None, "{bad}");
    }
}

#[test]
fn stage_parts_join_into_the_whole_model_and_the_newest_usable_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Step 10: complete in two parts. Step 20: one part only (a stage died writing).
    write_part(d, &image(10, 0..2, 1), &(0..2), 0).unwrap();
    write_part(d, &image(10, 2..4, 1), &(2..4), 0).unwrap();
    write_part(d, &image(20, 0..2, 1), &(0..2), 0).unwrap();
    let (found, skipped) = newest(d, 4, &serde_json::json!({ "job": 1 })).unwrap();
    let (l, whole) = found.unwrap();
    assert_eq!((l.step, whole.tensors().len()), (10, 4));
    assert!(skipped[0].contains("incomplete"), "{skipped:?}");
    // Another job's checkpoints are never resumed.
    let (found, _) = newest(d, 4, &serde_json::json!({ "job": 2 })).unwrap();
    assert!(found.is_none());
}

#[test]
fn a_corrupt_newest_part_falls_back_to_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_part(d, &image(10, 0..4, 1), &(0..4), 0).unwrap();
    corrupt(&write_part(d, &image(20, 0..4, 1), &(0..4), 0).unwrap());
    let (found, skipped) = newest(d, 4, &serde_json::json!({ "job": 1 })).unwrap();
    assert_eq!(found.unwrap().0.step, 10);
    assert!(skipped[0].contains("blocks-0-4.limpet"), "the skip names the bad file: {skipped:?}");
}

/// "required" trusts a directory limpet wrote to or a mounted filesystem, not an empty
/// directory on its parent's filesystem (an unmounted mount point).
#[test]
fn only_a_written_or_mounted_directory_is_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("ckpt");
    assert!(trusted_dir(&d).unwrap_err().to_string().contains("missing"));
    std::fs::create_dir(&d).unwrap();
    // (The test's directory may sit on another filesystem than the root's: then it is
    // trusted as a mount, and only the other cases can be checked here.)
    let root = std::fs::metadata("/").map(|m| std::os::unix::fs::MetadataExt::dev(&m)).unwrap();
    let here = std::fs::metadata(&d).map(|m| std::os::unix::fs::MetadataExt::dev(&m)).unwrap();
    if root == here {
        assert!(trusted_dir(&d).unwrap_err().to_string().contains("unmounted mount point"));
    }
    write_part(&d, &image(10, 0..4, 1), &(0..4), 0).unwrap();
    trusted_dir(&d).unwrap();
    // A mount point of its own (procfs here), marker or not.
    trusted_dir(Path::new("/proc")).unwrap();
    // The marker is no checkpoint.
    assert_eq!(list(&d).unwrap().len(), 1);
}

/// Pruning's streamed check of a checkpoint of parts accepts exactly what loading it
/// accepts: two stages' parts of one state; not a corrupt part, a missing one, or one of
/// another job.
#[test]
fn the_streamed_check_of_parts_agrees_with_loading_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let agree = |step| {
        let l = listed_at(d, step).unwrap();
        let (loaded, checked) = (load(&l, 4), verify_parts(&l, 4));
        assert_eq!(loaded.is_ok(), checked.is_ok(), "step {step}: {loaded:?} {checked:?}");
        if let (Ok(image), Ok(meta)) = (&loaded, &checked) {
            assert_eq!(image.meta().job, meta.job);
            assert_eq!(image.meta().step, meta.step);
        }
        checked.is_ok()
    };
    let part = |step, blocks: Range<usize>, job| {
        write_part(d, &image(step, blocks.clone(), job), &blocks, 0).unwrap()
    };
    part(10, 0..2, 1);
    part(10, 2..4, 1);
    assert!(agree(10));
    part(20, 0..2, 1);
    corrupt(&part(20, 2..4, 1));
    assert!(!agree(20));
    part(30, 0..2, 1);
    assert!(!agree(30));
    part(40, 0..2, 1);
    part(40, 2..4, 2);
    assert!(!agree(40));
}

pub(super) fn corrupt(p: &Path) {
    let mut bytes = std::fs::read(p).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(p, bytes).unwrap();
}

#[test]
fn a_part_that_does_not_read_back_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(10, 0..4, 1);
    let p = write_part(dir.path(), &img, &(0..4), 0).unwrap();
    verify_part(&p, &img).unwrap();
    corrupt(&p);
    let e = verify_part(&p, &img).unwrap_err().to_string();
    assert!(e.contains("does not read back"), "{e}");
    let other = write_part(dir.path(), &image(10, 0..4, 2), &(0..4), 0).unwrap();
    assert!(verify_part(&other, &img).unwrap_err().to_string().contains("not the"));
}

#[test]
fn a_checkpoint_that_would_eat_the_reserve_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(10, 0..4, 1);
    // More than any disk has: refused, named, and nothing left behind.
    let e = write_part(dir.path(), &img, &(0..4), u64::MAX / 2).unwrap_err();
    assert!(matches!(e, CheckpointError::NoRoom { .. }) && e.to_string().contains("min_free"), "{e}");
    assert!(list(dir.path()).unwrap().is_empty());
    assert!(!step_dir(dir.path(), 10).exists(), "no empty checkpoint directory");
    // A reserve the disk has room for.
    write_part(dir.path(), &img, &(0..4), 1).unwrap();
    assert_eq!(list(dir.path()).unwrap().len(), 1);
}

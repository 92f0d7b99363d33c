//! A state written as shards: parts of one image, each a complete image of the tensors one
//! writer holds (a sharded job's ranks write their parts of a checkpoint at once), each
//! naming the content hash the whole state has, so that the parts join into that image and
//! nothing else: a part of another state, a missing tensor or a tensor twice is refused.

use crate::image::{content_hash_of, hash_forms, Dtype, RawTensor, StateImage};
use crate::SnapshotError;
use std::collections::BTreeMap;

/// The tensor a shard carries the whole state's content hash in (its 64 hex digits as
/// bytes): not part of the state, dropped when the shards join.
pub const WHOLE_HASH: &str = "shard/whole_hash";

/// A state file's tensors as its header lists them: dtype and shape by name.
pub type Header = BTreeMap<String, (Dtype, Vec<usize>)>;

/// Whether the headers of a set of shards (each file's metadata and [`Header`], see
/// [`crate::read_header`]) make one whole state: one step, position, RNG and job, no tensor
/// in two, and the content hash that their tensors' checksums, dtypes and shapes give is the
/// one every shard names (checked through the marker's checksum: no tensor bytes are read).
/// The reason when not. What pruning checks, where joining would hold the whole state.
pub fn headers_agree(shards: &[(crate::StateMeta, Header)]) -> Result<String, crate::SnapshotError> {
    let shards_err = crate::SnapshotError::Shards;
    let Some((m, _)) = shards.first() else { return Err(shards_err("no shards".into())) };
    let mut all = BTreeMap::new();
    for (i, (sm, header)) in shards.iter().enumerate() {
        if (sm.step, sm.cursor, sm.rng, &sm.job) != (m.step, m.cursor, m.rng, &m.job) {
            return Err(shards_err(format!("shard {i} holds another state than shard 0")));
        }
        for (name, (dtype, shape)) in header.iter().filter(|(n, _)| *n != WHOLE_HASH) {
            let sum = sm
                .checksums
                .get(name)
                .ok_or_else(|| shards_err(format!("shard {i}: {name} has no checksum")))?;
            if all.insert(name.clone(), (*dtype, shape.clone(), sum.clone())).is_some() {
                return Err(shards_err(format!("shard {i} holds {name}, which another shard holds too")));
            }
        }
    }
    let entries = all.iter().map(|(n, (d, s, c))| (n.as_str(), *d, s.as_slice(), c.as_str()));
    let (whole, earlier) = hash_forms((m.step, m.cursor, m.rng), &m.job, entries);
    let mark = |h: &str| blake3::hash(h.as_bytes()).to_hex().to_string();
    let off = |h: &str| {
        let mark = mark(h);
        shards.iter().position(|(sm, _)| sm.checksums.get(WHOLE_HASH) != Some(&mark))
    };
    let Some(i) = off(&whole) else { return Ok(whole) };
    // A set an earlier build wrote names the whole state's hash in that build's form.
    match earlier.filter(|h| off(h).is_none()) {
        Some(h) => Ok(h),
        None => Err(shards_err(format!("shard {i} names another whole state than its tensors make"))),
    }
}

/// One shard: `tensors` of a state at `meta`'s step, position, RNG and job, marked with
/// `whole`, the content hash of the state all shards join into.
pub fn shard_image(
    meta: (u64, u64, crate::RngState, serde_json::Value),
    mut tensors: BTreeMap<String, RawTensor>,
    whole: &str,
) -> Result<StateImage, SnapshotError> {
    if tensors.contains_key(WHOLE_HASH) {
        return Err(SnapshotError::Format(format!("a state tensor is named {WHOLE_HASH}")));
    }
    let mark = RawTensor::try_new(WHOLE_HASH, Dtype::U8, vec![whole.len()], whole.as_bytes().to_vec())?;
    tensors.insert(WHOLE_HASH.to_string(), mark);
    let (step, cursor, rng, job) = meta;
    Ok(StateImage::new(step, cursor, rng, job, tensors))
}

/// The whole-state hash a shard names, if it is one.
pub fn whole_hash_of(shard: &StateImage) -> Option<String> {
    let t = shard.tensors().get(WHOLE_HASH)?;
    (t.dtype() == Dtype::U8).then(|| String::from_utf8_lossy(t.data()).into_owned())
}

/// The content hash an image of these tensors has, from each tensor's dtype, shape and
/// checksum alone (hex, as [`crate::StateMeta::checksums`] holds them): what the writers of
/// shards compute for the whole state without any of them holding it.
pub fn whole_hash(
    meta: (u64, u64, crate::RngState, &serde_json::Value),
    tensors: &BTreeMap<String, (Dtype, Vec<usize>, String)>,
) -> String {
    let (step, cursor, rng, job) = meta;
    content_hash_of(
        step,
        cursor,
        rng,
        job,
        tensors.iter().map(|(n, (d, s, c))| (n.as_str(), *d, s.as_slice(), c.as_str())),
    )
}

/// Joins shards into the whole state: every shard at the same step, position, RNG and job,
/// naming the same whole hash, no tensor in two, and the joined image's content hash the
/// one they name. `what(i)` names shard `i` in errors (its file).
pub fn join(shards: Vec<StateImage>, what: impl Fn(usize) -> String) -> Result<StateImage, SnapshotError> {
    let bad = |i: usize, detail: String| SnapshotError::Format(format!("{}: {detail}", what(i)));
    let Some(first) = shards.first() else {
        return Err(SnapshotError::Format("no shards to join".into()));
    };
    let m = first.meta().clone();
    let whole = whole_hash_of(first).ok_or_else(|| bad(0, format!("no {WHOLE_HASH}: not a shard")))?;
    let mut tensors = BTreeMap::new();
    for (i, s) in shards.into_iter().enumerate() {
        let sm = s.meta();
        if (sm.step, sm.cursor, sm.rng, &sm.job) != (m.step, m.cursor, m.rng, &m.job) {
            return Err(bad(i, format!("holds step {} of another state than the first shard's", sm.step)));
        }
        if whole_hash_of(&s).as_deref() != Some(whole.as_str()) {
            return Err(bad(i, "names another whole state than the first shard".into()));
        }
        for (name, t) in s.tensors() {
            if name != WHOLE_HASH && tensors.insert(name.clone(), t.clone()).is_some() {
                return Err(bad(i, format!("holds tensor {name}, which another shard holds too")));
            }
        }
    }
    let joined = StateImage::new(m.step, m.cursor, m.rng, m.job, tensors);
    if !joined.has_hash(&whole) {
        return Err(SnapshotError::Format(format!(
            "the shards join into a state of content hash {}, not the {whole} they name (a shard missing \
             or from another write)",
            joined.content_hash()
        )));
    }
    // A set an earlier build wrote names its hash in that build's form; the records do too.
    Ok(joined.with_hash(whole))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RngState;

    fn image() -> StateImage {
        let mut t = BTreeMap::new();
        for (i, n) in ["a", "b", "c"].iter().enumerate() {
            let values: Vec<f32> = (0..5 + i).map(|v| v as f32 * 0.5 - i as f32).collect();
            t.insert(n.to_string(), RawTensor::from_f32(n, vec![values.len()], &values).unwrap());
        }
        StateImage::new(7, 70, RngState { seed: 3, draws: 9 }, serde_json::json!({"job": 1}), t)
    }

    fn shards_of(whole: &StateImage, cut: &[&[&str]]) -> Vec<StateImage> {
        let m = whole.meta();
        let entries = whole
            .tensors()
            .iter()
            .map(|(n, t)| (n.clone(), (t.dtype(), t.shape().to_vec(), m.checksums[n].clone())))
            .collect();
        let hash = whole_hash((m.step, m.cursor, m.rng, &m.job), &entries);
        assert_eq!(hash, whole.content_hash(), "the hash from checksums alone is the image's");
        cut.iter()
            .map(|names| {
                let t = names.iter().map(|n| (n.to_string(), whole.tensors()[*n].clone())).collect();
                shard_image((m.step, m.cursor, m.rng, m.job.clone()), t, &hash).unwrap()
            })
            .collect()
    }

    fn heads(shards: &[StateImage]) -> Vec<(crate::StateMeta, Header)> {
        shards
            .iter()
            .map(|s| {
                let h =
                    s.tensors().iter().map(|(n, t)| (n.clone(), (t.dtype(), t.shape().to_vec()))).collect();
                (s.meta().clone(), h)
            })
            .collect()
    }

    /// A set an earlier build wrote for a job with layout keys names the whole state's hash in
    /// that build's form (over the whole job): its headers agree and it joins, both keeping
    /// that form. A set whose tensors are not the state it names is refused in either form.
    #[test]
    fn a_set_an_earlier_build_wrote_still_joins() {
        let base = image();
        let m = base.meta().clone();
        let job = serde_json::json!({"job": 1, "shard_state": {"replicas": 1}});
        let whole = StateImage::new(m.step, m.cursor, m.rng, job.clone(), base.tensors().clone());
        let entries = crate::image::entries(whole.tensors(), &whole.meta().checksums);
        let (now, earlier) = hash_forms((m.step, m.cursor, m.rng), &job, entries);
        assert_eq!((now.as_str(), base.content_hash()), (whole.content_hash(), whole.content_hash()));
        let earlier = earlier.expect("a job with layout keys has an earlier form");
        let cut = |state: &BTreeMap<String, RawTensor>, hash: &str| -> Vec<StateImage> {
            [&["a", "c"][..], &["b"]]
                .iter()
                .map(|names| {
                    let t = names.iter().map(|n| (n.to_string(), state[*n].clone())).collect();
                    shard_image((m.step, m.cursor, m.rng, job.clone()), t, hash).unwrap()
                })
                .collect()
        };
        let set = cut(whole.tensors(), &earlier);
        assert_eq!(headers_agree(&heads(&set)).unwrap(), earlier);
        assert_eq!(join(set, |i| format!("shard {i}")).unwrap().content_hash(), earlier);
        let mut changed = whole.tensors().clone();
        changed.insert("b".into(), RawTensor::from_f32("b", vec![6], &[9.0; 6]).unwrap());
        for hash in [&earlier, &now] {
            let set = cut(&changed, hash);
            assert!(headers_agree(&heads(&set)).is_err());
            assert!(join(set, |i| format!("shard {i}")).is_err());
        }
    }

    #[test]
    fn shards_join_into_the_whole_state_and_nothing_else() {
        let whole = image();
        let joined = join(shards_of(&whole, &[&["a", "c"], &["b"], &[]]), |i| format!("shard {i}")).unwrap();
        assert_eq!(joined, whole);
        // A shard missing, a tensor twice, a shard of another step: refused, naming it.
        let e = join(shards_of(&whole, &[&["a"], &["b"]]), |i| format!("shard {i}")).unwrap_err();
        assert!(e.to_string().contains("a shard missing"), "{e}");
        let e = join(shards_of(&whole, &[&["a", "b"], &["b", "c"]]), |i| format!("shard {i}")).unwrap_err();
        assert!(e.to_string().contains("shard 1: holds tensor b"), "{e}");
        let mut other = shards_of(&whole, &[&["a", "b"], &["c"]]);
        let m = other[1].meta().clone();
        let state: BTreeMap<_, _> = other[1]
            .tensors()
            .iter()
            .filter(|(n, _)| *n != WHOLE_HASH)
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        other[1] = shard_image((m.step + 1, m.cursor, m.rng, m.job), state, whole.content_hash()).unwrap();
        let e = join(other, |i| format!("shard {i}")).unwrap_err();
        assert!(e.to_string().contains("shard 1: holds step 8"), "{e}");
        // The headers alone agree on a whole set, and refuse a forged mark or a missing
        // tensor, without the tensors' bytes.
        let set = shards_of(&whole, &[&["a", "c"], &["b"]]);
        assert_eq!(headers_agree(&heads(&set)).unwrap(), whole.content_hash());
        assert!(headers_agree(&heads(&set[..1])).unwrap_err().to_string().contains("another whole state"));
        let m = whole.meta();
        let forged = shard_image((m.step, m.cursor, m.rng, m.job.clone()), BTreeMap::new(), "0f").unwrap();
        let e = headers_agree(&heads(&[set[0].clone(), set[1].clone(), forged])).unwrap_err().to_string();
        assert!(e.contains("shard 2 names another whole state"), "{e}");
        // A header read from a file is the image's.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.limpet");
        crate::write_atomic(&path, &set[0].encode().unwrap()).unwrap();
        let (meta, header) = crate::read_header(&path).unwrap();
        assert_eq!((meta, header), heads(&set[..1]).remove(0));
        // An image that is no shard, and a state tensor by the marker's name.
        let e = join(vec![whole.clone()], |i| format!("shard {i}")).unwrap_err();
        assert!(e.to_string().contains("not a shard"), "{e}");
        let mut t = BTreeMap::new();
        t.insert(WHOLE_HASH.to_string(), RawTensor::from_f32(WHOLE_HASH, vec![1], &[1.0]).unwrap());
        assert!(shard_image((1, 1, RngState::new(1), serde_json::json!(1)), t, "h").is_err());
    }
}

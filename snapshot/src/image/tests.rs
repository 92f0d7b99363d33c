//! Round trips, tampering, and property tests of the decoder against arbitrary damage.

use super::*;
use proptest::prelude::*;

fn sample() -> StateImage {
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "param/w".to_string(),
        RawTensor::from_f32("w", vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap(),
    );
    tensors.insert("optim/m/w".to_string(), RawTensor::from_f32("m", vec![2, 3], &[0.; 6]).unwrap());
    StateImage::new(7, 448, RngState { seed: 1, draws: 7 }, serde_json::json!({"model": "mlp"}), tensors)
}

/// Re-encodes `img` with a hand-edited metadata JSON, as an attacker or a bad disk might.
fn with_meta(img: &StateImage, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut meta = serde_json::to_value(img.meta()).unwrap();
    edit(&mut meta);
    let views: Vec<_> = img
        .tensors()
        .iter()
        .map(|(n, t)| {
            (n.clone(), TensorView::new(t.dtype().to_safetensors(), t.shape().to_vec(), t.data()).unwrap())
        })
        .collect();
    safetensors::serialize(views, Some(HashMap::from([(META_KEY.to_string(), meta.to_string())]))).unwrap()
}

#[test]
fn round_trip_is_exact() {
    let img = sample();
    let back = StateImage::decode(&img.encode().unwrap()).unwrap();
    assert_eq!(back, img);
    assert_eq!(back.tensors()["param/w"].to_f32().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
}

#[test]
fn content_hash_sees_every_part() {
    let base = sample();
    let mut other = base.tensors().clone();
    other.insert("param/w".into(), RawTensor::from_f32("w", vec![2, 3], &[1., 2., 3., 4., 5., 6.5]).unwrap());
    let changed_tensor = StateImage::new(7, 448, base.meta().rng, base.meta().job.clone(), other);
    let changed_step =
        StateImage::new(8, 448, base.meta().rng, base.meta().job.clone(), base.tensors().clone());
    let changed_rng = StateImage::new(
        7,
        448,
        RngState { seed: 1, draws: 8 },
        base.meta().job.clone(),
        base.tensors().clone(),
    );
    let hashes = [
        base.content_hash(),
        changed_tensor.content_hash(),
        changed_step.content_hash(),
        changed_rng.content_hash(),
    ];
    for i in 0..hashes.len() {
        for j in i + 1..hashes.len() {
            assert_ne!(hashes[i], hashes[j], "{i} vs {j}");
        }
    }
}

/// A sharded run's state is an unsharded run's: the job's layout keys are outside the hash,
/// everything else in the job is inside.
#[test]
fn the_jobs_layout_keys_are_outside_the_content_hash() {
    let base = sample();
    let m = base.meta();
    let with_job =
        |job: serde_json::Value| StateImage::new(m.step, m.cursor, m.rng, job, base.tensors().clone());
    let sharded = with_job(serde_json::json!({"model": "mlp", "shard_state": {"replicas": 1}}));
    assert_eq!(sharded.content_hash(), base.content_hash());
    let other_job = with_job(serde_json::json!({"model": "mlp", "steps": 9}));
    assert_ne!(other_job.content_hash(), base.content_hash());
    assert_eq!(StateImage::decode(&sharded.encode().unwrap()).unwrap(), sharded);
}

/// An image written by a build that hashed the whole job, layout keys too, still reads; a
/// hash that is neither this build's nor that one is still refused.
#[test]
fn an_image_hashed_with_its_layout_keys_still_reads() {
    let base = sample();
    let m = base.meta();
    let job = serde_json::json!({"model": "mlp", "shard_state": {"replicas": 1}});
    let img = StateImage::new(m.step, m.cursor, m.rng, job.clone(), base.tensors().clone());
    let earlier = hash_over(m.step, m.cursor, m.rng, &job, entries(img.tensors(), &img.meta().checksums));
    assert_ne!(earlier, img.content_hash());
    let bytes = with_meta(&img, |v| v["content_hash"] = earlier.clone().into());
    let back = StateImage::decode(&bytes).unwrap();
    assert_eq!(back.content_hash(), earlier);
    assert!(back.has_hash(&earlier) && back.has_hash(img.content_hash()));
    // The file reader that checks a checkpoint without loading it takes it too.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("earlier.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(crate::verify_file(&path).unwrap().content_hash, earlier);
    // Content that is not the state the earlier hash names (another shard_state, or another
    // step) is refused in either form.
    for edit in [
        &(|v: &mut serde_json::Value| v["job"]["shard_state"]["replicas"] = 2.into())
            as &dyn Fn(&mut serde_json::Value),
        &|v: &mut serde_json::Value| v["step"] = 8.into(),
    ] {
        let bytes = with_meta(&img, |v| {
            v["content_hash"] = earlier.clone().into();
            edit(v);
        });
        assert!(matches!(StateImage::decode(&bytes).unwrap_err(), SnapshotError::ContentHash { .. }));
    }
}

#[test]
fn plain_safetensors_file_is_not_a_checkpoint() {
    let t = RawTensor::from_f32("x", vec![1], &[1.0]).unwrap();
    let bytes =
        safetensors::serialize([("x", TensorView::new(StDtype::F32, vec![1], t.data()).unwrap())], None)
            .unwrap();
    let err = StateImage::decode(&bytes).unwrap_err();
    assert!(matches!(err, SnapshotError::MissingMeta { .. }), "{err}");
}

#[test]
fn flipped_tensor_byte_names_the_tensor() {
    let img = sample();
    let mut bytes = img.encode().unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x40; // last byte belongs to the last tensor in the data section
    let err = StateImage::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("tensor 'param/w' is corrupted"), "{err}");
}

#[test]
fn edited_metadata_fails_the_content_hash() {
    let bytes = with_meta(&sample(), |m| m["step"] = 9.into());
    let err = StateImage::decode(&bytes).unwrap_err();
    assert!(matches!(err, SnapshotError::ContentHash { .. }), "{err}");
}

#[test]
fn newer_format_is_refused_by_version() {
    let bytes = with_meta(&sample(), |m| {
        m["format"] = 2.into();
        m["future_field"] = true.into();
    });
    let err = StateImage::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("format version 2 is not supported"), "{err}");
}

#[test]
fn missing_and_extra_tensors_are_named() {
    let img = sample();
    let bytes = with_meta(&img, |m| {
        m["checksums"].as_object_mut().unwrap().insert("param/gone".into(), "00".into());
    });
    let err = StateImage::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("'param/gone' is listed in the checkpoint metadata but missing"), "{err}");
    let bytes = with_meta(&img, |m| {
        m["checksums"].as_object_mut().unwrap().remove("optim/m/w");
    });
    let err = StateImage::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("'optim/m/w' is in the file but not listed"), "{err}");
}

#[test]
fn missing_field_is_named() {
    let bytes = with_meta(&sample(), |m| {
        m.as_object_mut().unwrap().remove("cursor");
    });
    let err = StateImage::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("cursor"), "{err}");
}

#[test]
fn size_mismatch_is_named() {
    let err = RawTensor::try_new("w", Dtype::F32, vec![2, 2], vec![0; 12]).unwrap_err().to_string();
    assert!(err.contains("tensor 'w' has 12 bytes") && err.contains("needs 16"), "{err}");
}

fn arb_tensor() -> impl Strategy<Value = RawTensor> {
    (
        prop_oneof![Just(Dtype::F32), Just(Dtype::I64), Just(Dtype::U8), Just(Dtype::BF16)],
        proptest::collection::vec(0usize..4, 0..3),
    )
        .prop_flat_map(|(dtype, shape)| {
            let n = shape.iter().product::<usize>() * dtype.size();
            proptest::collection::vec(any::<u8>(), n)
                .prop_map(move |data| RawTensor::try_new("t", dtype, shape.clone(), data).unwrap())
        })
}

fn arb_image() -> impl Strategy<Value = StateImage> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<(u64, u64)>(),
        proptest::collection::btree_map("[a-z][a-z0-9_./]{0,10}", arb_tensor(), 0..5),
        any::<i32>(),
    )
        .prop_map(|(step, cursor, (seed, draws), tensors, j)| {
            StateImage::new(step, cursor, RngState { seed, draws }, serde_json::json!({ "j": j }), tensors)
        })
}

proptest! {
    #[test]
    fn prop_round_trip(img in arb_image()) {
        prop_assert_eq!(StateImage::decode(&img.encode().unwrap()).unwrap(), img);
    }

    /// Any single damaged byte is either caught or harmless (a whitespace byte of the padded
    /// header, say): never a panic, never a different state.
    #[test]
    fn prop_damage_is_caught(img in arb_image(), pos in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let mut bytes = img.encode().unwrap();
        let i = pos.index(bytes.len());
        bytes[i] ^= xor;
        if let Ok(back) = StateImage::decode(&bytes) {
            prop_assert_eq!(back, img);
        }
    }

    #[test]
    fn prop_truncation_is_an_error(img in arb_image(), cut in any::<prop::sample::Index>()) {
        let bytes = img.encode().unwrap();
        let keep = cut.index(bytes.len());
        prop_assert!(StateImage::decode(&bytes[..keep]).is_err());
    }

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = StateImage::decode(&bytes);
        let _ = verify_bytes(&bytes);
    }

    /// A streamed write is the encoding, byte for byte, and reads back as the image.
    #[test]
    fn prop_streamed_file_is_the_encoding(img in arb_image()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.limpet");
        crate::write_image_atomic(&path, &img).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        prop_assert!(img.encoded_len() >= bytes.len() as u64, "{} < {}", img.encoded_len(), bytes.len());
        prop_assert_eq!(bytes, img.encode().unwrap());
        prop_assert_eq!(&crate::verify_file(&path).unwrap(), img.meta());
        // Readable by others, as files written whole are.
        use std::os::unix::fs::PermissionsExt;
        prop_assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
    }

    /// The streamed check agrees with the full decode on damaged and truncated files: it
    /// accepts exactly what the decode accepts, with the same metadata.
    #[test]
    fn prop_streamed_check_agrees_with_decode(
        img in arb_image(),
        pos in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = img.encode().unwrap();
        let i = pos.index(bytes.len());
        bytes[i] ^= xor;
        for b in [&bytes[..], &bytes[..cut.index(bytes.len())]] {
            let decoded = StateImage::decode(b).map(|d| d.meta().clone());
            let checked = verify_bytes(b);
            prop_assert_eq!(decoded.is_ok(), checked.is_ok(), "decode {:?}, streamed {:?}", decoded, checked);
            if let (Ok(a), Ok(b)) = (decoded, checked) {
                prop_assert_eq!(a, b);
            }
        }
    }
}

/// [`crate::verify_file`] on `bytes`, written to a file of their own.
fn verify_bytes(bytes: &[u8]) -> Result<crate::StateMeta, crate::SnapshotError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.limpet");
    std::fs::write(&path, bytes).unwrap();
    crate::verify_file(&path)
}

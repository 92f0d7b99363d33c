use super::*;
use proptest::prelude::*;

/// Writes `ids` as shards of `per_shard` tokens with a manifest, returning the directory.
fn shards(ids: &[u32], vocab: u64, per_shard: u64, val: Option<&[u32]>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), ids, val.unwrap_or(&[]), vocab, per_shard).unwrap();
    dir
}

#[test]
fn windows_stay_within_their_shard_and_shift_by_one() {
    // Two shards of 10 tokens: windows of 3+1 tokens at offsets 0, 3 (6 would need token 10).
    let ids: Vec<u32> = (0..20).collect();
    let dir = shards(&ids, 100, 10, Some(&[50, 51, 52, 53, 54]));
    let s = open(dir.path(), 3).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (6, 1));
    let (x, y, n) = s.train.read([0, 2, 3, 5].into_iter()).unwrap();
    assert_eq!(n, 4);
    assert_eq!(x, [0, 1, 2, 6, 7, 8, 10, 11, 12, 16, 17, 18]);
    assert_eq!(y, [1, 2, 3, 7, 8, 9, 11, 12, 13, 17, 18, 19]);
    let (x, y, _) = s.test.read([0].into_iter()).unwrap();
    assert_eq!((x, y), (vec![50, 51, 52], vec![51, 52, 53]));
}

#[test]
fn without_val_files_the_last_windows_are_held_out() {
    let ids: Vec<u32> = (0..1000).map(|i| i % 7).collect();
    let dir = shards(&ids, 7, 1000, None);
    let s = open(dir.path(), 9).unwrap();
    // 999 / 9 = 111 windows; a tenth (11) held out.
    assert_eq!((s.train.len(), s.test.len()), (100, 11));
    let (x, _, _) = s.test.read([0].into_iter()).unwrap();
    assert_eq!(x[0], (900 % 7) as i64);
}

#[test]
fn uint32_shards_hold_large_vocabularies() {
    let ids = [70_000u32, 1, 99_999, 5, 6];
    let dir = shards(&ids, 100_000, 100, Some(&[1, 2, 3]));
    assert_eq!(read_manifest(dir.path()).unwrap().dtype, TokenDtype::Uint32);
    let s = open(dir.path(), 2).unwrap();
    let (x, y, _) = s.train.read([0, 1].into_iter()).unwrap();
    assert_eq!((x, y), (vec![70_000, 1, 99_999, 5], vec![1, 99_999, 5, 6]));
}

#[test]
fn a_token_outside_the_vocabulary_names_file_and_offset() {
    let dir = shards(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 10, 100, None);
    // Rewrite the manifest with a smaller vocabulary than the ids written.
    let mut m = read_manifest(dir.path()).unwrap();
    m.vocab = 6;
    write_manifest(dir.path(), &m).unwrap();
    let s = open(dir.path(), 2).unwrap();
    let err = s.train.read([2].into_iter()).unwrap_err().to_string();
    assert!(err.contains("train-00000.bin") && err.contains("token 6 at byte offset 10"), "{err}");
}

#[test]
fn a_truncated_shard_is_refused_at_open_naming_the_file() {
    let dir = shards(&(0..50).collect::<Vec<_>>(), 64, 100, None);
    let f = dir.path().join("train-00000.bin");
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(77).unwrap();
    let err = open(dir.path(), 4).unwrap_err().to_string();
    assert!(
        err.contains("train-00000.bin") && err.contains("50 tokens (100 bytes) but the file has 77 bytes"),
        "{err}"
    );
}

#[test]
fn a_shard_that_is_a_directory_is_named_so() {
    let dir = shards(&(0..50).collect::<Vec<_>>(), 64, 100, None);
    let f = dir.path().join("train-00000.bin");
    std::fs::remove_file(&f).unwrap();
    std::fs::create_dir(&f).unwrap();
    let err = open(dir.path(), 4).unwrap_err().to_string();
    assert!(err.contains("train-00000.bin") && err.contains("is not a file (a directory?)"), "{err}");
}

#[test]
fn a_shard_truncated_while_open_gives_an_error_not_a_crash() {
    let dir = shards(&(0..50).collect::<Vec<_>>(), 64, 100, None);
    let s = open(dir.path(), 4).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("train-00000.bin")).unwrap();
    f.set_len(20).unwrap();
    let err = s.train.read([5].into_iter()).unwrap_err().to_string();
    assert!(err.contains("train-00000.bin") && err.contains("byte offset 40"), "{err}");
}

#[test]
fn manifests_that_disagree_or_escape_are_refused() {
    let dir = shards(&(0..50).collect::<Vec<_>>(), 64, 100, None);
    let good = read_manifest(dir.path()).unwrap();
    let cases: Vec<(Manifest, &str)> = vec![
        (Manifest { format: "other".into(), ..good.clone() }, "format is \"other\""),
        (Manifest { version: 2, ..good.clone() }, "version 2"),
        (Manifest { vocab: 70_000, ..good.clone() }, "vocab 70000 is not within 1..=65536"),
        (Manifest { train: vec![], ..good.clone() }, "train lists no files"),
        (
            Manifest {
                train: vec![ShardEntry { file: "../x.bin".into(), ..good.train[0].clone() }],
                ..good.clone()
            },
            "train[0] (\"../x.bin\"): must be a relative path",
        ),
        (
            Manifest {
                train: vec![ShardEntry { file: "/etc/passwd".into(), ..good.train[0].clone() }],
                ..good.clone()
            },
            "must be a relative path",
        ),
        (
            Manifest {
                train: vec![ShardEntry { blake3: "zz".into(), ..good.train[0].clone() }],
                ..good.clone()
            },
            "is not 64 hex digits",
        ),
    ];
    for (m, want) in cases {
        let err = Manifest::parse(&m.to_bytes()).unwrap_err().to_string();
        assert!(err.contains(want), "{err} (wanted {want})");
    }
    let err = Manifest::parse(b"{\"format\": 1}").unwrap_err().to_string();
    assert!(err.starts_with("not a token manifest"), "{err}");
    // A listed file missing from the directory.
    let mut m = good.clone();
    m.train.push(ShardEntry { file: "gone.bin".into(), ..good.train[0].clone() });
    write_manifest(dir.path(), &m).unwrap();
    let err = open(dir.path(), 4).unwrap_err().to_string();
    assert!(err.contains("gone.bin") && err.contains("cannot open a shard the manifest lists"), "{err}");
    // No manifest at all points at the tools that make one.
    let empty = tempfile::tempdir().unwrap();
    let err = open(empty.path(), 4).unwrap_err().to_string();
    assert!(err.contains("limpet-tokens.json") && err.contains("limpet data index"), "{err}");
}

#[test]
fn the_fingerprint_follows_the_manifest_not_the_open() {
    let a = shards(&(0..50).collect::<Vec<_>>(), 64, 20, None);
    let b = shards(&(0..50).collect::<Vec<_>>(), 64, 20, None);
    let c = shards(&(1..51).collect::<Vec<_>>(), 64, 20, None);
    let fp = |d: &tempfile::TempDir| read_manifest(d.path()).unwrap().fingerprint();
    assert_eq!(fp(&a), fp(&b));
    assert_ne!(fp(&a), fp(&c));
    let m = read_manifest(a.path()).unwrap();
    let f = a.path().join(&m.train[1].file);
    assert_eq!(hash_file(&f, |_| {}).unwrap(), m.train[1].blake3);
}

proptest! {
    /// Any bytes: parsing returns a manifest or an error, never panics.
    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::parse(&bytes);
    }

    /// A manifest that parses serializes back to one that parses the same.
    #[test]
    fn parsed_manifests_round_trip(
        vocab in 1u64..=65_536,
        tokens in proptest::collection::vec(0u64..1 << 40, 1..5),
        names in proptest::collection::vec("[a-z0-9_-]{1,12}(/[a-z0-9_.-]{1,12})?", 5),
        val in any::<bool>(),
    ) {
        let entry = |i: usize, t: u64| ShardEntry { file: format!("{}.bin", names[i]), tokens: t, blake3: "ab".repeat(32) };
        let train: Vec<ShardEntry> = tokens.iter().enumerate().map(|(i, &t)| entry(i, t)).collect();
        let m = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: 1,
            dtype: TokenDtype::Uint16,
            vocab,
            tokenizer: None,
            val: if val { vec![entry(4, 9)] } else { vec![] },
            train,
        };
        let back = Manifest::parse(&m.to_bytes()).unwrap();
        prop_assert_eq!(back.fingerprint(), m.fingerprint());
        prop_assert_eq!(back, m);
    }

    /// Windows read back exactly the tokens written, whatever the shard size.
    #[test]
    fn windows_read_what_was_written(
        ids in proptest::collection::vec(0u32..500, 8..200),
        per_shard in 4u64..64,
        context in 1usize..6,
    ) {
        let dir = shards(&ids, 500, per_shard, Some(&[1, 2, 3, 4, 5, 6, 7]));
        let c = context as u64;
        let mut expect = Vec::new();
        for chunk in ids.chunks(per_shard as usize) {
            let n = (chunk.len() as u64).saturating_sub(1) / c;
            for w in 0..n as usize {
                expect.push(chunk[w * context..w * context + context + 1].to_vec());
            }
        }
        if expect.is_empty() {
            prop_assert!(open(dir.path(), context).is_err());
            return Ok(());
        }
        let s = open(dir.path(), context).unwrap();
        prop_assert_eq!(s.train.len(), expect.len());
        for (j, want) in expect.iter().enumerate() {
            let (x, y, _) = s.train.read([j as u64].into_iter()).unwrap();
            let want: Vec<i64> = want.iter().map(|&t| i64::from(t)).collect();
            prop_assert_eq!(&x[..], &want[..context]);
            prop_assert_eq!(&y[..], &want[1..]);
        }
    }
}

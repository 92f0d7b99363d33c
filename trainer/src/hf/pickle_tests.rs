//! The `.bin` reader against real archives and hostile ones.
use super::*;
use proptest::prelude::*;

/// The pickle `torch.save({"w": tensor of shape [2, 3]})` writes (protocol 2), by hand.
fn state_dict_pickle() -> Vec<u8> {
    let mut p = vec![0x80, 2];
    p.extend(b"ccollections\nOrderedDict\nq\x00)Rq\x01");
    p.extend(b"X\x01\x00\x00\x00wq\x02");
    p.extend(b"ctorch._utils\n_rebuild_tensor_v2\nq\x03(");
    p.extend(b"(X\x07\x00\x00\x00storageq\x04ctorch\nFloatStorage\nq\x05X\x01\x00\x00\x000q\x06X\x03\x00\x00\x00cpuq\x07K\x06tq\x08Q");
    p.extend(b"K\x00K\x02K\x03\x86q\x09K\x03K\x01\x86q\x0a\x89");
    p.extend(b"ccollections\nOrderedDict\nq\x0b)Rq\x0ctq\x0dRq\x0e");
    p.extend(b"s.");
    p
}

#[test]
fn a_state_dict_pickle_names_its_tensors() {
    let refs = parse_state_dict(&state_dict_pickle()).unwrap();
    assert_eq!(refs.len(), 1);
    let (name, t) = &refs[0];
    assert_eq!((name.as_str(), t.key.as_str(), t.kind, t.storage_numel), ("w", "0", Kind::Float, 6));
    assert_eq!((t.shape.clone(), t.stride.clone(), t.offset), (vec![2, 3], vec![3, 1], 0));
}

#[test]
fn globals_beyond_a_state_dict_are_refused_by_name() {
    let p = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00idq\x00\x85R.".to_vec();
    let e = parse_state_dict(&p).unwrap_err().to_string();
    assert!(e.contains("posix.system") && e.contains("refused"), "{e}");
    // A tensor that reads past its storage.
    let p = state_dict_pickle();
    let at = p.windows(3).position(|w| w == b"K\x06t").unwrap();
    let mut short = p.clone();
    short[at + 1] = 5;
    assert!(parse_state_dict(&short).unwrap_err().to_string().contains("more elements than its storage's 5"));
}

/// A `torch.save`-shaped archive holding [`state_dict_pickle`] and its 6 floats.
fn archive() -> Vec<u8> {
    use std::io::Write;
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("archive/data.pkl", opts).unwrap();
    w.write_all(&state_dict_pickle()).unwrap();
    w.start_file("archive/byteorder", opts).unwrap();
    w.write_all(b"little").unwrap();
    w.start_file("archive/data/0", opts).unwrap();
    for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
        w.write_all(&v.to_le_bytes()).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn an_archive_reads_as_its_tensors() {
    let ts = read_archive(&archive()).unwrap();
    assert_eq!(ts.len(), 1);
    assert_eq!(ts[0].0, "w");
    let want = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]);
    assert!(ts[0].1.equal(&want));
}

/// What an attacker's archive tries, each refused with the reason and without the cost:
/// nesting a million deep (a stack overflow when dropped), memo copies that double 40
/// times, one float viewed as 2^32 of them, strides whose span overflows, one storage
/// described with two sizes, two `data.pkl` in one archive.
#[test]
fn hostile_pickles_and_archives_are_refused_cheaply() {
    let mut deep = vec![0x80, 2, b')'];
    deep.extend(std::iter::repeat_n(0x85u8, 1_000_000));
    deep.push(b'.');
    assert!(parse_state_dict(&deep).unwrap_err().to_string().contains("nested 17 deep"));
    let mut doubling = vec![0x80, 2, b')', b'q', 0];
    for i in 0..40u8 {
        doubling.extend([b'h', i, b'h', i, 0x86, b'q', i + 1]);
    }
    doubling.push(b'.');
    let e = parse_state_dict(&doubling).unwrap_err().to_string();
    assert!(e.contains("more values than its") || e.contains("nested"), "{e}");
    let layout = |shape: Vec<i64>, stride: Vec<i64>, numel: u64| {
        check_layout(&TensorRef {
            key: "0".into(),
            kind: Kind::Float,
            storage_numel: numel,
            offset: 0,
            shape,
            stride,
        })
    };
    assert!(layout(vec![65536, 65536], vec![0, 0], 1)
        .unwrap_err()
        .to_string()
        .contains("more elements than its storage's 1"));
    let m = i64::MAX;
    let e = layout(vec![m, m, m, m, (1 << 62) + 2, m], vec![m, m, m, m, 8, 8], 1).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
    assert!(layout(vec![2, 3], vec![3, 1], 6).is_ok());
    // One storage, two sizes: the second tensor's layout was checked against a lie.
    let two =
        pickle_of(&[("a", "0", 6, &[2, 3], &[3, 1]), ("b", "0", 1_000_000_000, &[1_000_000_000], &[1])]);
    assert_eq!(parse_state_dict(&two).unwrap().len(), 2);
    let e = read_archive(&archive_with(&two, &[])).unwrap_err().to_string();
    assert!(e.contains("described twice"), "{e}");
    assert_eq!(
        read_archive(&archive_with(&pickle_of(&[("a", "0", 6, &[3, 2], &[1, 3])]), &[])).unwrap().len(),
        1
    );
    let twice = archive_with(&state_dict_pickle(), &[("other/data.pkl", &state_dict_pickle())]);
    assert!(read_archive(&twice).unwrap_err().to_string().contains("2 data.pkl files"));
}

/// A state dict's pickle of float tensors `(name, storage key, storage elements, shape,
/// stride)`, as `torch.save` writes one.
type Described<'a> = (&'a str, &'a str, i32, &'a [i32], &'a [i32]);

fn pickle_of(tensors: &[Described]) -> Vec<u8> {
    let text = |p: &mut Vec<u8>, s: &str| {
        p.push(b'X');
        p.extend((s.len() as u32).to_le_bytes());
        p.extend(s.as_bytes());
    };
    let ints = |p: &mut Vec<u8>, v: &[i32]| {
        p.push(b'(');
        for i in v {
            p.push(b'J');
            p.extend(i.to_le_bytes());
        }
        p.push(b't');
    };
    let mut p = vec![0x80, 2];
    p.extend(b"ccollections\nOrderedDict\n)R(");
    for (name, key, numel, shape, stride) in tensors {
        text(&mut p, name);
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n((");
        text(&mut p, "storage");
        p.extend(b"ctorch\nFloatStorage\n");
        text(&mut p, key);
        text(&mut p, "cpu");
        p.push(b'J');
        p.extend(numel.to_le_bytes());
        p.extend(b"tQK\x00");
        ints(&mut p, shape);
        ints(&mut p, stride);
        p.extend(b"\x89ccollections\nOrderedDict\n)RtR");
    }
    p.extend(b"u.");
    p
}

/// [`archive`] with `pickle` as its data.pkl and `extra` entries.
fn archive_with(pickle: &[u8], extra: &[(&str, &[u8])]) -> Vec<u8> {
    use std::io::Write;
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("archive/data.pkl", opts).unwrap();
    w.write_all(pickle).unwrap();
    w.start_file("archive/data/0", opts).unwrap();
    for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
        w.write_all(&v.to_le_bytes()).unwrap();
    }
    for (name, bytes) in extra.iter().filter(|(_, b)| !b.is_empty()) {
        w.start_file(*name, opts).unwrap();
        w.write_all(bytes).unwrap();
    }
    w.finish().unwrap().into_inner()
}

proptest! {
    /// A real archive with bytes flipped or cut: tensors or an error, never a panic.
    #[test]
    fn damaged_archives_never_panic(cut in 0usize..2000, flips in proptest::collection::vec((0usize..2000, any::<u8>()), 0..6)) {
        let mut a = archive();
        for (i, b) in flips {
            let n = a.len();
            a[i % n] = b;
        }
        a.truncate(cut.max(1));
        let _ = read_archive(&a);
    }

    /// Any bytes: a list of tensors or an error, never a panic.
    #[test]
    fn arbitrary_pickles_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = parse_state_dict(&bytes);
    }

    /// A real state dict's pickle with bytes flipped or cut: an error or a tensor whose
    /// layout stays inside its storage.
    #[test]
    fn damaged_pickles_never_panic(cut in 0usize..200, flips in proptest::collection::vec((0usize..200, any::<u8>()), 0..6)) {
        let mut p = state_dict_pickle();
        for (i, b) in flips {
            let n = p.len();
            p[i % n] = b;
        }
        p.truncate(cut.max(1));
        if let Ok(refs) = parse_state_dict(&p) {
            for (_, t) in refs {
                prop_assert!(check_layout(&t).is_ok());
            }
        }
    }
}

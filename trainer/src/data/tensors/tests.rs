use super::*;
use proptest::prelude::*;

/// A `.npy` file's bytes as numpy writes them (version 1, header padded to 64 bytes).
fn npy(descr: &str, shape: &[usize], data: &[u8], fortran: bool) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut h = format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {tuple}, }}",
        if fortran { "True" } else { "False" }
    );
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A directory with x.npy (n rows of `width` values, row i = i, i + 0.5, ...) and labels i % 3.
fn npy_dir(n: usize, width: usize) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let x: Vec<f32> = (0..n).flat_map(|i| (0..width).map(move |k| i as f32 + k as f32 * 0.5)).collect();
    let y: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
    std::fs::write(d.path().join("x.npy"), npy("<f4", &[n, width], &f32s(&x), false)).unwrap();
    std::fs::write(d.path().join("y.npy"), npy("<i8", &[n], &i64s(&y), false)).unwrap();
    d
}

#[test]
fn npy_rows_are_read_where_the_permutation_puts_them() {
    let d = npy_dir(50, 4);
    let t = open(d.path()).unwrap();
    assert_eq!((t.features, t.outputs, t.regression, t.image), (4, 3, false, None));
    assert_eq!((t.train.len(), t.test.len()), (45, 5));
    // Every row lands in exactly one split, intact.
    let mut seen = Vec::new();
    for split in [&t.train, &t.test] {
        let b = split.read(0..split.len() as u64).unwrap();
        let (x, y, n) = (b.x, b.labels, b.n);
        assert_eq!(x.len(), n * 4);
        for (row, label) in x.chunks(4).zip(&y) {
            let i = row[0] as i64;
            assert_eq!(row, [i as f32, i as f32 + 0.5, i as f32 + 1.0, i as f32 + 1.5]);
            assert_eq!(*label, i % 3);
            seen.push(i);
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..50).collect::<Vec<_>>());
    assert_ne!(t.train.read(0..5).unwrap().labels, vec![0, 1, 2, 0, 1], "the split is not shuffled");
}

#[test]
fn safetensors_pairs_with_test_tensors_and_regression_targets() {
    let d = tempfile::tempdir().unwrap();
    let x = f32s(&(0..24).map(|v| v as f32).collect::<Vec<_>>());
    let y = f32s(&(0..12).map(|v| v as f32 * 2.0).collect::<Vec<_>>());
    let xt = f32s(&[9.0; 8]);
    let yt = f32s(&[1.0; 4]);
    use safetensors::tensor::TensorView;
    let views = vec![
        ("x", TensorView::new(StDtype::F32, vec![6, 2, 2], &x).unwrap()),
        ("y", TensorView::new(StDtype::F32, vec![6, 2], &y).unwrap()),
        ("x_test", TensorView::new(StDtype::F32, vec![2, 2, 2], &xt).unwrap()),
        ("y_test", TensorView::new(StDtype::F32, vec![2, 2], &yt).unwrap()),
    ];
    let f = d.path().join("data.safetensors");
    std::fs::write(&f, safetensors::serialize(views, None).unwrap()).unwrap();
    let t = open(&f).unwrap();
    assert_eq!((t.features, t.outputs, t.regression, t.image), (4, 2, true, Some((2, 2))));
    assert_eq!((t.train.len(), t.test.len()), (6, 2));
    let b = t.train.read([5].into_iter()).unwrap();
    assert_eq!((b.x, b.values), (vec![20.0, 21.0, 22.0, 23.0], vec![20.0, 22.0]));
    let b = t.test.read([1].into_iter()).unwrap();
    assert_eq!((b.x, b.values), (vec![9.0; 4], vec![1.0, 1.0]));
}

#[test]
fn bad_arrays_are_refused_naming_the_file() {
    let d = npy_dir(10, 2);
    let write = |name: &str, bytes: Vec<u8>| std::fs::write(d.path().join(name), bytes).unwrap();
    let err = |d: &tempfile::TempDir| open(d.path()).unwrap_err().to_string();
    write("y.npy", npy("<i8", &[9], &i64s(&[0; 9]), false));
    let e = err(&d);
    assert!(e.contains("y.npy") && e.contains("9 target rows for 10 input rows"), "{e}");
    write("y.npy", npy("<i8", &[10], &i64s(&[0, 1, 2, -4, 0, 0, 0, 0, 0, 0]), false));
    let e = err(&d);
    assert!(e.contains("y.npy") && e.contains("label -4 at row 3 is negative"), "{e}");
    write("y.npy", npy(">i8", &[10], &i64s(&[0; 10]), false));
    assert!(err(&d).contains("dtype \">i8\" is not one of"), "{}", err(&d));
    write("y.npy", npy("<i8", &[10], &i64s(&[0; 10]), false));
    write("x.npy", npy("<f4", &[10, 2], &f32s(&[0.0; 20]), true));
    assert!(err(&d).contains("fortran_order is True"), "{}", err(&d));
    let mut cut = npy("<f4", &[10, 2], &f32s(&[0.0; 20]), false);
    cut.truncate(cut.len() - 4);
    write("x.npy", cut);
    let e = err(&d);
    assert!(e.contains("x.npy") && e.contains("but the file has"), "{e}");
    std::fs::remove_file(d.path().join("x.npy")).unwrap();
    assert!(err(&d).contains("x.npy"), "{}", err(&d));
    let f = d.path().join("nothing.safetensors");
    std::fs::write(
        &f,
        safetensors::serialize(Vec::<(&str, safetensors::tensor::TensorView)>::new(), None).unwrap(),
    )
    .unwrap();
    let e = open(&f).unwrap_err().to_string();
    assert!(e.contains("no tensor 'x'"), "{e}");
}

proptest! {
    /// Any bytes: a header or an error, never a panic.
    #[test]
    fn npy_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), magic in any::<bool>()) {
        let mut b = if magic { b"\x93NUMPY\x01\x00".to_vec() } else { Vec::new() };
        b.extend(bytes);
        let _ = parse_npy_header(&b);
    }

    /// What numpy writes parses back to its dtype and shape.
    #[test]
    fn written_headers_parse(shape in proptest::collection::vec(1usize..100_000, 1..5), d in 0usize..5) {
        let (descr, elem) = [("<f4", Elem::F32), ("<f8", Elem::F64), ("|u1", Elem::U8), ("<i4", Elem::I32), ("<i8", Elem::I64)][d];
        let bytes = npy(descr, &shape, &[], false);
        let h = parse_npy_header(&bytes).unwrap();
        prop_assert_eq!((h.elem, h.shape, h.data_offset), (elem, shape, bytes.len() as u64));
    }
}

//! What ships, checked with real processes: `make dist`'s tarball holds everything a host
//! needs and runs with the build cache hidden, and the product binaries hold none of the lab.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The build cache (libtorch's venv, the data): `$LIMPET_CACHE` as the Makefile exports it,
/// else the default.
fn build_cache() -> PathBuf {
    std::env::var_os("LIMPET_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
        std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or(home.join(".cache")).join("limpet")
    })
}

/// `make dist`'s tarball (packed here from this build's binaries) holds everything a host
/// needs: unpacked into an empty directory, with the build cache hidden under a tmpfs in a
/// private mount namespace and `LD_LIBRARY_PATH` pointing nowhere, its `limpetd` validates a
/// configuration and its `limpet` trains.
#[test]
fn the_release_tarball_runs_with_the_build_cache_hidden() {
    let tmp = tempfile::tempdir().unwrap();
    let lab_bins = Path::new(env!("CARGO_BIN_EXE_limpetd")).parent().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dist.sh");
    let dist = |bins: &Path, out: &str, allow_lab: bool| {
        Command::new("bash")
            .arg(&script)
            .arg("--bin-dir")
            .arg(bins)
            .arg("--out")
            .arg(tmp.path().join(out))
            .args(["--variant", "cpu", "--fast"])
            .env("LIMPET_DIST_ALLOW_LAB", if allow_lab { "1" } else { "0" })
            .output()
            .unwrap()
    };
    // The tests' binaries are a lab build: dist.sh does not pack them unless told.
    let refused = dist(lab_bins, "refused", false);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("is a lab build"));
    // The product's binaries, as `make dist` builds them (`make unit` does so first), else the
    // lab build, allowed.
    let product = std::env::var_os("LIMPET_PRODUCT_BINS").map(PathBuf::from);
    let bins = product.as_deref().unwrap_or(lab_bins);
    let out = dist(bins, "dist", product.is_none());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tarball = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let name = tarball.file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("limpet-") && name.ends_with("-linux-x86_64-cpu.tar.gz"), "{name}");
    // The .sha256 beside it is what cloud-init checks.
    let check = Command::new("sha256sum")
        .arg("-c")
        .arg(format!("{name}.sha256"))
        .current_dir(tmp.path().join("dist"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    // Extracted at / on a host: no entry may stand for / itself.
    let list = Command::new("tar").arg("-tzf").arg(&tarball).output().unwrap();
    let entries = String::from_utf8_lossy(&list.stdout).to_string();
    assert!(entries.lines().all(|e| e.starts_with("usr/") || e.starts_with("etc/")), "{entries}");
    for want in [
        "usr/local/bin/limpetd",
        "usr/local/bin/limpet",
        "etc/systemd/system/limpetd.service",
        "usr/local/lib/limpet/libtorch_cpu.so",
        "usr/local/share/limpet/traces/aws-p3-preemptions.csv",
    ] {
        assert!(entries.lines().any(|e| e == want), "{want} missing: {entries}");
    }
    assert!(!entries.contains("libtorch_cuda"), "the CPU variant carries CUDA: {entries}");
    let root = tmp.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let untar = Command::new("tar").arg("-C").arg(&root).arg("-xzf").arg(&tarball).status().unwrap();
    assert!(untar.success());

    // What the host brings: a configuration, a secret, the data.
    let digits = tmp.path().join("digits.csv.gz");
    std::fs::copy(limpet_trainer::data::default_digits_path(), &digits).unwrap();
    std::fs::write(tmp.path().join("secret"), "0123456789abcdef").unwrap();
    let config = tmp.path().join("limpetd.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"host-1\"\ncontrol = \"127.0.0.1:0\"\ndata = \"127.0.0.1:0\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n[cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n[job]\nmodel = \"mlp\"\ndata = \"digits\"\ndata_path = {:?}\nsteps = 10\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n[revocation]\nsources = \"none\"\n",
            tmp.path().join("state").display().to_string(),
            tmp.path().join("secret").display().to_string(),
            digits.display().to_string(),
        ),
    )
    .unwrap();
    let bin = root.join("usr/local/bin");
    let script = r#"set -e
mount -t tmpfs tmpfs "$CACHE"
test -z "$(ls -A "$CACHE")"
ldd "$BIN/limpetd" | grep -E 'libtorch_cpu|libc10'
"$BIN/limpetd" --version
"$BIN/limpetd" validate --config "$CONFIG"
"$BIN/limpet" train --model mlp --data digits --data-path "$DIGITS" --steps 20 --out "$OUT"
"#;
    let cache = build_cache();
    let run = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .env("CACHE", &cache)
        .env("BIN", &bin)
        .env("CONFIG", &config)
        .env("DIGITS", &digits)
        .env("OUT", tmp.path().join("run"))
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("LIMPET_CACHE", "/nonexistent")
        .env_remove("LIMPET_DIGITS")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    // The libraries came from the tarball, not from the (hidden) build cache.
    let lib_dir = root.join("usr/local/lib/limpet").display().to_string();
    assert!(
        text.lines()
            .filter(|l| l.contains("libtorch_cpu"))
            .all(|l| l.contains(&lib_dir) || l.contains("bin/../lib/limpet")),
        "{text}"
    );
    assert!(text.contains("valid (node host-1") && text.contains("test accuracy"), "{text}");
    assert!(text.contains("libtorch: CPU only: this binary's libtorch has no CUDA backend"), "{text}");
    assert!(tmp.path().join("run/checkpoint.safetensors").exists());
    if product.is_some() {
        assert!(text.contains(&format!("limpetd {}", env!("CARGO_PKG_VERSION"))), "{text}");
        assert!(!text.contains("lab build"), "the release tarball holds a lab build: {text}");
    }
    if Path::new(env!("LIMPET_LIBTORCH_LIB")).join("libtorch_cuda.so").exists() {
        let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dist.sh");
        cuda_variant_loads_its_backend(&dist, lab_bins, tmp.path(), &config);
    }
}

/// The CUDA variant, staged rather than packed (gigabytes of CUDA libraries): with the build
/// cache hidden, its `limpetd` loads libtorch's CUDA backend and the CUDA runtime from the
/// variant's own directory. (Without a GPU here, libtorch then says there is no driver.)
fn cuda_variant_loads_its_backend(script: &Path, bins: &Path, tmp: &Path, config: &Path) {
    let out = Command::new("bash")
        .arg(script)
        .arg("--bin-dir")
        .arg(bins)
        .arg("--out")
        .arg(tmp.join("staged"))
        .args(["--variant", "cuda", "--stage-only"])
        .env("LIMPET_DIST_ALLOW_LAB", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(root.display().to_string().ends_with("-cuda"), "{}", root.display());
    let lib_dir = root.join("usr/local/lib/limpet");
    let script = r#"set -e
mount -t tmpfs tmpfs "$CACHE"
ldd "$BIN/limpetd" | grep -E 'libtorch_cuda|libcudart'
"$BIN/limpetd" validate --config "$CONFIG" --json
"#;
    let run = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .env("CACHE", build_cache())
        .env("BIN", root.join("usr/local/bin"))
        .env("CONFIG", config)
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("LIMPET_CACHE", "/nonexistent")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    let lib = lib_dir.display().to_string();
    for want in ["libtorch_cuda.so", "libcudart.so"] {
        let line = text.lines().find(|l| l.contains(want)).unwrap_or_else(|| panic!("{want}: {text}"));
        assert!(
            line.contains(&lib) || line.contains("bin/../lib/limpet"),
            "{want} not from the variant: {line}"
        );
    }
    let v: serde_json::Value =
        serde_json::from_str(text.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("{text}")))
            .unwrap();
    assert_eq!(v["libtorch"]["cuda_backend"], true, "{v}");
    assert!(v["libtorch"]["cuda_runtime"].as_str().is_some_and(|r| r.starts_with("libcudart.so")), "{v}");
}

/// The product binaries hold none of the lab: `make unit` builds `limpet` and `limpetd`
/// without the `lab` feature (as `make dist` does) into `LIMPET_PRODUCT_BINS`, and they have
/// no local-cluster flags, no drill keys and none of the lab's code, where the binaries the
/// tests run (built with it) have each. Plain `cargo test` builds no such binaries: there it
/// says so and checks nothing.
#[test]
fn the_product_binaries_hold_none_of_the_lab() {
    let Some(product) = std::env::var_os("LIMPET_PRODUCT_BINS").map(PathBuf::from) else {
        eprintln!(
            "skipped: LIMPET_PRODUCT_BINS is unset (make unit builds the product binaries and sets it)"
        );
        return;
    };
    let (limpet, limpetd) = (product.join("limpet"), product.join("limpetd"));
    // Each build says what it is.
    let version = |bin: &Path| {
        let out = Command::new(bin).arg("--version").output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    for bin in [&limpet, &limpetd] {
        assert!(!version(bin).contains("lab build"), "{}: {}", bin.display(), version(bin));
    }
    assert!(version(Path::new(env!("CARGO_BIN_EXE_limpetd"))).contains("lab build"));
    // What the lab adds, as it appears in a binary: the chaos hook's variable, a drill's key,
    // the local cluster's file. The tests' binaries have each, which shows the search would
    // find them. (The fake metadata service, the consensus harness and the demo's plot are in
    // no product binary either way: the lab's crate or a feature only it turns on holds them.)
    let markers = ["LIMPET_CHAOS_PANIC", "slowdown_factor", "cluster.json"];
    let read = |bin: &Path| std::fs::read(bin).unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let product = [(&limpet, read(&limpet)), (&limpetd, read(&limpetd))];
    let lab = [read(Path::new(env!("CARGO_BIN_EXE_limpet"))), read(Path::new(env!("CARGO_BIN_EXE_limpetd")))];
    for marker in markers {
        let finder = memchr::memmem::Finder::new(marker);
        for (bin, bytes) in &product {
            assert!(
                finder.find(bytes).is_none(),
                "{} holds {marker:?}: lab code in the product",
                bin.display()
            );
        }
        assert!(lab.iter().any(|b| finder.find(b).is_some()), "the lab build holds no {marker:?}");
    }
    // And as a user meets them: no --dir, no --hard, no drill key.
    let out = Command::new(&limpet).args(["status", "--dir", "/tmp"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--dir'"));
    let out =
        Command::new(&limpet).args(["revoke", "n1", "--hard", "--addr", "127.0.0.1:1"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--hard'"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("secret"), "0123456789abcdef0123").unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = {:?}\n\
             secret_file = {:?}\nslowdown_factor = 2.0\n\n[cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
             [job]\nmodel = \"mlp\"\ndata = \"synthetic\"\nsteps = 10\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n\
             [revocation]\nsources = \"none\"\n",
            dir.path().join("state"),
            dir.path().join("secret")
        ),
    )
    .unwrap();
    let validate =
        |bin: &Path| Command::new(bin).args(["validate", "--config"]).arg(&config).output().unwrap();
    let out = validate(&limpetd);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `slowdown_factor`"));
    let lab = validate(Path::new(env!("CARGO_BIN_EXE_limpetd")));
    assert!(lab.status.success(), "{}", String::from_utf8_lossy(&lab.stderr));
}

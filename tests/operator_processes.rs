//! What a first operator meets, through the binaries: which revocation sources `limpetd`
//! watches (detected, listed or explicitly none), one job from a config file or from
//! `limpet train` flags, reads that learn the cluster from the node, and `--json` where a
//! script calls.

use limpet_agent::fake_metadata::{Cloud, FakeMetadata};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

#[path = "common.rs"]
mod common;

fn base_config(dir: &Path) -> String {
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123").unwrap();
    format!(
        "[node]\nname = \"a\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:7401\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n\
         [cluster]\nname = \"c\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n\n\
         [job]\nmodel = \"mlp\"\ndata = \"digits\"\nsteps = 10\nglobal_batch = 8\n\n\
         [security]\ninsecure = true\n",
        dir.join("state").display().to_string(),
        secret.display().to_string()
    )
}

fn validate(dir: &Path, text: &str, json: bool) -> Output {
    let f = dir.join("node.toml");
    std::fs::write(&f, text).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_limpetd"));
    c.args(["validate", "--config"]).arg(&f);
    if json {
        c.arg("--json");
    }
    c.output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Endpoints of all three clouds at `aws`, `gcp`, `azure`.
fn endpoints(aws: &str, gcp: &str, azure: &str) -> String {
    format!("\n[revocation]\naws_endpoint = {aws:?}\ngcp_endpoint = {gcp:?}\nazure_endpoint = {azure:?}\n")
}

#[test]
fn limpetd_validate_says_which_revocation_sources_it_would_watch() {
    let tmp = tempfile::tempdir().unwrap();
    let base = base_config(tmp.path());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    // Nothing listens here: every probe is refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    for (cloud, name) in [(Cloud::Aws, "aws"), (Cloud::Gcp, "gcp"), (Cloud::Azure, "azure")] {
        let fake = rt.block_on(FakeMetadata::start_as("127.0.0.1:0".parse().unwrap(), cloud)).unwrap();
        // The section left at its default: the one cloud that answers is detected.
        let at = |c: Cloud| if c == cloud { fake.url() } else { dead.clone() };
        let auto = base.clone() + &endpoints(&at(Cloud::Aws), &at(Cloud::Gcp), &at(Cloud::Azure));
        let out = validate(tmp.path(), &auto, false);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        let line =
            stdout.lines().find(|l| l.starts_with("revocation: ")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.starts_with(&format!("revocation: {name} at {}", fake.url())), "{line}");
        assert!(line.contains("detected"), "{line}");
        let v: Value = serde_json::from_slice(&validate(tmp.path(), &auto, true).stdout).unwrap();
        assert_eq!(v["revocation"]["mode"], "auto");
        assert_eq!(v["revocation"]["sources"][0]["cloud"], name, "{v}");
        assert_eq!(v["revocation"]["sources"].as_array().unwrap().len(), 1, "{v}");
        rt.block_on(async { fake.stop() });
    }
    // Nothing answers: valid, but said loudly.
    let blind = base.clone() + &endpoints(&dead, &dead, &dead);
    let out = validate(tmp.path(), &blind, false);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("revocation: none: no cloud metadata service answered"), "{stdout}");
    assert!(stderr.contains("warning: this node would watch no revocation notices"), "{stderr}");
    // "none" is a choice, said as one; an empty list is refused rather than guessed at.
    let none = base.clone() + "\n[revocation]\nsources = \"none\"\n";
    let (stdout, stderr) = text(&validate(tmp.path(), &none, false));
    assert!(stdout.contains("revocation: none ([revocation].sources = \"none\""), "{stdout}");
    assert!(!stderr.contains("revocation"), "{stderr}");
    let empty = validate(tmp.path(), &(base.clone() + "\n[revocation]\nsources = []\n"), true);
    assert_eq!(empty.status.code(), Some(64));
    let v: Value = serde_json::from_slice(&empty.stdout).unwrap();
    assert_eq!(v["valid"], false, "{v}");
    assert!(v["key"].as_str().unwrap().starts_with("[revocation].sources"), "{v}");
    assert!(v["error"].as_str().unwrap().contains("sources = \"none\""), "{v}");
    let listed = base + "\n[revocation]\nsources = [\"gcp\"]\ngcp_endpoint = \"http://127.0.0.1:9\"\n";
    let (stdout, _) = text(&validate(tmp.path(), &listed, false));
    assert!(
        stdout.contains("revocation: gcp at http://127.0.0.1:9 (listed in [revocation].sources)"),
        "{stdout}"
    );
}

//! What `agent/src/config_value.rs` reads while the file is parsed and `values.rs` checks of
//! the host: values that do not read, all named at once; keys of the wrong shape; "auto"
//! where the GPUs are there but unusable.

use super::tests::{example, secret};
use super::Config;

/// Addresses, sizes, devices, stage counts and S3 URLs are read into their types as the file
/// is parsed, and a value that does not read does not stop the parse: each is named with its
/// key and line, beside the checks' own problems, in one run.
#[test]
fn values_that_do_not_read_are_all_named_at_once() {
    let s = secret();
    let text = example(s.path())
        .replace("control = \"127.0.0.1:7400\"", "control = \"localhost:7400\"\nmetrics = \"9100\"\ndevices = [\"cpu\", \"tpu:0\"]")
        .replace("steps = 400", "steps = 400\ndevice = \"gpu\"")
        .replace("bootstrap = [\"1=127.0.0.1:7400\"]", "bootstrap = [\"1=127.0.0.1:7400\"]\nseeds = [\"127.0.0.1:7500\", \"seed-b\"]\nmin_nodes = 0")
        + "\n[pipeline]\nstages = 0\nmemory = \"lots\"\n\n[checkpoint]\nevery_steps = 5\nmin_free = \"1Q\"\ns3 = \"http://bucket\"\n";
    let e = Config::parse(&text, "c.toml").unwrap_err();
    let line = |needle: &str| text.lines().position(|l| l.starts_with(needle)).map(|i| i + 1);
    let found: Vec<(&str, Option<usize>)> = e.all().iter().map(|e| (e.key.as_str(), e.line)).collect();
    for (key, at) in [
        ("[node].control", "control = "),
        ("[node].metrics", "metrics = "),
        ("[node].devices", "devices = "),
        ("[job].device", "device = "),
        ("[cluster].seeds", "seeds = "),
        ("[pipeline].stages", "stages = "),
        ("[pipeline].memory", "memory = "),
        ("[checkpoint].min_free", "min_free = "),
        ("[checkpoint].s3", "s3 = "),
        // A check's own problem, reported in the same run.
        ("[cluster].min_nodes", "min_nodes = "),
    ] {
        assert!(found.contains(&(key, line(at))), "{key} on line {:?} not in {e}", line(at));
    }
    assert_eq!(found.len(), 10, "{e}");
    let shown = e.to_string();
    for detail in [
        "\"localhost:7400\" is not IP:PORT",
        "\"9100\" is not IP:PORT",
        "entry 2: \"tpu:0\" is not one of",
        "\"gpu\" is not one of",
        "\"seed-b\" is not IP:PORT",
        "0 is not a positive number of stages",
        "\"lots\" has unknown unit",
        "\"1Q\" has unknown unit",
        "does not start with s3://",
    ] {
        assert!(shown.contains(detail), "{detail:?} not in {shown}");
    }
}

/// A value of the wrong shape for a typed key is named in the key's own words, not the
/// parser's.
#[test]
fn a_typed_key_of_the_wrong_shape_says_what_it_takes() {
    let s = secret();
    for (extra, key, want) in [
        (
            "[node]\ndevices = 5\n",
            "[node].devices",
            "5 is neither a device (\"auto\", \"cuda:0\") nor a list of them",
        ),
        ("[node]\ndevices = [\"cpu\", 1]\n", "[node].devices", "entry 2: 1 is not a device name"),
        (
            "[pipeline]\nstages = true\n",
            "[pipeline].stages",
            "true is neither a number of stages nor \"auto\"",
        ),
    ] {
        let (section, line) = extra.split_once('\n').unwrap();
        let text = example(s.path()).replacen(&format!("{section}\n"), &format!("{section}\n{line}"), 1);
        let text = if text.contains(line) { text } else { format!("{text}\n{extra}") };
        let e = Config::parse(&text, "c.toml").unwrap_err();
        let found = e.all().iter().find(|e| e.key == key).unwrap_or_else(|| panic!("{key} not in {e}"));
        assert!(found.detail.contains(want), "{key}: {}", found.detail);
        assert!(found.line.is_some(), "{key}: no line");
    }
}

/// "auto" on a host whose driver lists GPUs libtorch cannot use is refused under the key
/// that says it; "cpu" (or a host where "auto" finds its GPUs, or none at all) is not.
#[test]
fn auto_is_refused_where_the_gpus_are_there_but_unusable() {
    use limpet_trainer::device::Backend;
    let s = secret();
    let backend = |devices, driver_gpus| Backend {
        cuda_backend: true,
        cuda_runtime: Some("libcudart.so.13".into()),
        devices,
        driver_gpus,
        why_none: (devices == 0).then(|| "a driver older than the CUDA runtime".into()),
    };
    let with = |extra: &str, job_device: &str| {
        let text = example(s.path())
            .replace("secret_file", &format!("{extra}secret_file"))
            .replace("steps = 400", &format!("steps = 400\ndevice = {job_device:?}"));
        Config::parse_unchecked(&text, "c.toml").unwrap()
    };
    let (broken, fine, none) = (backend(0, 2), backend(2, 2), backend(0, 0));
    let job_auto = with("", "auto");
    let (key, why) = job_auto.auto_refusal(&broken).unwrap();
    assert_eq!(key, "[job].device");
    assert!(why.contains("lists 2 GPU(s) and libtorch can use none: a driver older"), "{why}");
    assert!(why.contains("set \"cpu\""), "{why}");
    assert_eq!(job_auto.auto_refusal(&fine), None);
    assert_eq!(job_auto.auto_refusal(&none), None);
    assert_eq!(with("", "cpu").auto_refusal(&broken), None);
    let node_auto = with("devices = \"auto\"\n", "cpu");
    assert_eq!(node_auto.auto_refusal(&broken).map(|(k, _)| k), Some("[node].devices"));
    assert_eq!(with("devices = [\"cpu\", \"cpu\"]\n", "auto").auto_refusal(&broken), None);
}

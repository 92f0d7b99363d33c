use super::*;
use limpet_agent::config_value::Bytes;
use limpet_agent::policy::BatchPolicy;

pub(super) fn example(secret: &Path) -> String {
    format!(
        r#"
[node]
name = "gpu-1"
control = "127.0.0.1:7400"
data = "127.0.0.1:7401"
state_dir = "/tmp/limpet"
secret_file = "{}"

[cluster]
name = "demo"
bootstrap = ["1=127.0.0.1:7400"]

[job]
model = "mlp"
data = "digits"
steps = 400
global_batch = 64

[revocation]
sources = ["aws"]
aws_endpoint = "http://127.0.0.1:9000"

[security]
insecure = true
"#,
        secret.display()
    )
}

pub(super) fn secret() -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), b"0123456789abcdef0123").unwrap();
    f
}

#[test]
fn a_pipeline_section_parses() {
    let s = secret();
    let text = format!("{}\n[pipeline]\nstages = \"auto\"\nshadow_every = 10\n", example(s.path()));
    let cfg = Config::parse(&text, "limpet.toml").unwrap();
    let p = cfg.pipeline.unwrap();
    assert_eq!((p.stages, p.shadow_every, p.memory), (Stages::Auto, 10, Bytes(16 << 30)));
}

#[test]
fn the_documented_example_is_valid() {
    let s = secret();
    let cfg = Config::parse(&example(s.path()), "limpet.toml").unwrap();
    assert_eq!(cfg.job.policy, BatchPolicy::FixedGlobal);
    assert_eq!(cfg.cluster.max_voters, 5);
    assert_ne!(cfg.node_id(), 0);
}

#[test]
fn a_llama_on_token_shards_is_configured_by_model_and_data() {
    let s = secret();
    let text = example(s.path())
        .replace("model = \"mlp\"", "model = \"llama\"\nprecision = \"bf16\"\ndevice = \"auto\"")
        .replace("data = \"digits\"", "data = \"tokens\"\ndata_path = \"/data/shards\"")
        + "\n[model]\npreset = \"small\"\nkv_heads = 2\n\n[data]\ncontext = 256\n";
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    let cfg = Config::load(f.path()).unwrap();
    assert_eq!(
        (cfg.model.preset.as_deref(), cfg.model.kv_heads, cfg.data.context),
        (Some("small"), Some(2), Some(256))
    );
    assert_eq!(
        (cfg.job.device, cfg.job.keys.precision.as_deref().unwrap_or("fp32")),
        (limpet_trainer::device::DeviceChoice::Auto, "bf16")
    );
}

#[test]
fn a_host_trains_with_every_device_it_lists() {
    let s = secret();
    let load = |devices: &str| {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            f.path(),
            example(s.path()).replace("secret_file", &format!("devices = {devices}\nsecret_file")),
        )
        .unwrap();
        Config::load(f.path()).unwrap()
    };
    let cpu = limpet_trainer::device::Device::Cpu;
    assert_eq!(load("[\"cpu\", \"cpu\", \"cpu\"]").node.local_devices().unwrap(), Some(vec![cpu; 3]));
    // `auto` on this host: every GPU libtorch sees, else one CPU rank.
    let gpus = limpet_trainer::device::gpu_count();
    assert_eq!(load("\"auto\"").node.local_devices().unwrap().unwrap().len(), gpus.max(1));
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), example(s.path())).unwrap();
    assert_eq!(Config::load(f.path()).unwrap().node.local_devices().unwrap(), None);
}

#[test]
fn errors_name_the_file_and_the_key() {
    let s = secret();
    let good = example(s.path());
    // A reproducible job may shard its state (it trains the same bits).
    let both = good
        .replace("global_batch = 64", "global_batch = 64\nreproducible = true\nshard_state = \"optimizer\"");
    Config::parse(&both, "limpet.toml").unwrap();
    // Sharded state is cut over a host's devices too.
    let devices = both.replace("secret_file", "devices = [\"cpu\", \"cpu\"]\nsecret_file");
    Config::parse(&devices, "limpet.toml").unwrap();
    // A pipeline stage is held on each device of a host.
    let piped = good.replace("secret_file", "devices = [\"cpu\", \"cpu\"]\nsecret_file");
    let piped = Config::parse(&format!("{piped}\n[pipeline]\nstages = 2\n"), "limpet.toml").unwrap();
    assert_eq!(piped.node.local_devices().unwrap().map(|d| d.len()), Some(2));
    // Sharded gradients (ZeRO-2) are the same job with its gradients given back too.
    let zero2 = good.replace("global_batch = 64", "global_batch = 64\nshard_state = \"optimizer+gradients\"");
    use limpet_trainer::data::{DataSpec, Dataset};
    let synthetic = DataSpec::Synthetic { samples: 60, features: 4, classes: 2, seed: 1 };
    let mut spec = limpet_trainer::JobSpec::defaults_for(
        limpet_trainer::ModelKind::Mlp,
        &Dataset::load(&synthetic, None).unwrap(),
    )
    .unwrap();
    Config::parse(&zero2, "limpet.toml").unwrap().job.keys.apply(&mut spec).unwrap();
    assert_eq!(spec.shard_state, Some(limpet_trainer::Sharding { replicas: 1, gradients: true }));
    let cases = [
        (good.replace("control = ", "contorl = "), "unknown field `contorl`"),
        (good.replace("127.0.0.1:7401", "127.0.0.1:99999"), "[node].data"),
        (good.replace("\"mlp\"", "\"resnet\""), "[job].model"),
        (good.replace("global_batch = 64", "global_batch = 64\noptimizer = \"lion\""), "[job].optimizer"),
        (good.replace("global_batch = 64", "global_batch = 64\nweight_decay = -1.0"), "[job].weight_decay"),
        (good.replace("sources = [\"aws\"]", "sources = [\"oracle\"]"), "[revocation].sources"),
        (good.replace("steps = 400", "steps = \"many\""), "limpet.toml:16: [job].steps: invalid type"),
        (good.replace("[\"1=127.0.0.1:7400\"]", "[\"one=127.0.0.1:7400\"]"), "[cluster].bootstrap"),
        (
            good.replace("global_batch = 64", "global_batch = 64\npolicy = \"cubic\""),
            "unknown variant `cubic`",
        ),
        (format!("{good}\n[pipeline]\nstages = 0\n"), "[pipeline].stages"),
        (format!("{good}\n[pipeline]\nstages = \"many\"\n"), "[pipeline].stages"),
        (format!("{good}\n[pipeline]\nstages = -2\n"), "-2 is not a positive number of stages (or \"auto\")"),
        (format!("{good}\n[pipeline]\nstages = 1.5\n"), "1.5 is not a positive number of stages (or \"auto\")"),
        (format!("{good}\n[pipeline]\nstages = 2\nmemory = \"lots\"\n"), "[pipeline].memory"),
        (format!("{good}\n[pipeline]\nstages = 2\ncuts = [2, 1]\n"), "[pipeline].cuts"),
        (format!("{good}\n[pipeline]\nstages = 3\ncuts = [2]\n"), "set stages = 2"),
        (format!("{good}\n[pipeline]\nstages = 2\nlink_gbps = 0.0\n"), "[pipeline].link_gbps"),
        (good.replace("global_batch = 64", "global_batch = 64\nlayers = 3"), "[job].layers"),
        (good.replace("global_batch = 64", "global_batch = 64\nwarmup = 401"), "[job].warmup: 401 exceeds"),
        (good.replace("global_batch = 64", "global_batch = 64\nclip = -1.0"), "[job].clip"),
        (good.replace("global_batch = 64", "global_batch = 64\nmin_lr_ratio = 1.5"), "[job].min_lr_ratio"),
        (good.replace("global_batch = 64", "global_batch = 64\nmicro_batch = 65"), "[job].micro_batch"),
        (
            good.replace("global_batch = 64", "global_batch = 64\nshards = 4"),
            "[job].shards: applies to a reproducible job",
        ),
        (
            good.replace("global_batch = 64", "global_batch = 64\nreproducible = true\nshards = 65"),
            "[job].shards: 65 is not within 1..=64",
        ),
        (
            good.replace("global_batch = 64", "global_batch = 64\nreproducible = true\npolicy = \"linear\""),
            "[job].reproducible: needs policy \"fixed-global\"",
        ),
        (
            format!(
                "{}\n[pipeline]\nstages = 2\n",
                good.replace("global_batch = 64", "global_batch = 64\nreproducible = true")
            ),
            "[job].reproducible: is for data parallelism only",
        ),
        (
            good.replace("global_batch = 64", "global_batch = 64\nshard_state = \"everything\""),
            "[job].shard_state: \"everything\" is not",
        ),
        (
            good.replace("global_batch = 64", "global_batch = 64\nshard_state = \"optimizer+gradient\""),
            "[job].shard_state: \"optimizer+gradient\" is not \"none\", \"optimizer\" or \"optimizer+gradients\"",
        ),
        (good.replace("global_batch = 64", "global_batch = 64\nshard_replicas = 2"), "[job].shard_replicas"),
        (
            format!(
                "{}\n[pipeline]\nstages = 2\n",
                good.replace("global_batch = 64", "global_batch = 64\nshard_state = \"optimizer\"")
            ),
            "[job].shard_state: is not supported by a pipelined job",
        ),
        (good.replace("sources = [\"aws\"]", "sources = []"), "sources = \"none\""),
        (good.replace("sources = [\"aws\"]", "sources = \"aws\""), "written as a list"),
        (good.replace("global_batch = 64", "global_batch = 64\ndevice = \"gpu\""), "[job].device"),
        (good.replace("global_batch = 64", "global_batch = 64\nprecision = \"fp16\""), "[job].precision"),
        (
            good.replace("global_batch = 64", "global_batch = 64\nprecision = \"bf16\""),
            "for model \"llama\" only",
        ),
        (good.replace("data = \"digits\"", "data = \"tokens\""), "[job].data_path"),
        (format!("{good}\n[model]\npreset = \"tiny\"\n"), "[model].preset: applies to model llama only"),
        (format!("{good}\n[model]\nlayers = 3\n"), "[model].layers: applies to models gpt and llama"),
        (format!("{good}\n[model]\nwidth = 3\n"), "unknown field `width`"),
        (format!("{good}\n[data]\ncontext = 8\n"), "[data].context"),
        (good.replace("secret_file", "metrics = \"localhost\"\nsecret_file"), "[node].metrics"),
        // A drill's key: checked in lab builds, unknown in a release.
        (
            good.replace("secret_file", "slowdown_factor = 0.5\nsecret_file"),
            if cfg!(feature = "lab") { "[node].slowdown_factor" } else { "unknown field `slowdown_factor`" },
        ),
        (
            good.replace("[\"1=127.0.0.1:7400\"]", "[\"1=127.0.0.1:7400\"]\nstraggler_ratio = 1.01"),
            "[cluster].straggler_ratio",
        ),
        (good.replace("secret_file", "log_format = \"xml\"\nsecret_file"), "[node].log_format"),
        (good.replace("secret_file", "devices = []\nsecret_file"), "[node].devices: lists no device"),
        (good.replace("secret_file", "devices = \"cuda:7\"\nsecret_file"), "[node].devices: entry 1: cuda:7"),
        (good.replace("secret_file", "devices = [\"cpu\", \"auto\"]\nsecret_file"), "stands alone"),
        (good.replace("secret_file", "devices = 2\nsecret_file"), "devices"),
        (good.replace("secret_file", "metrics_tls = true\nsecret_file"), "[node].metrics_tls"),
        (good.replace("secret_file", "data_congestion = \"BBR\"\nsecret_file"), "[node].data_congestion"),
        (
            good.replace("secret_file", "data_congestion = \"a_name_too_long_x\"\nsecret_file"),
            "1 to 15 characters",
        ),
        (format!("{good}\n[timing]\ndrain_grace_secs = 0\n"), "[timing].drain_grace_secs"),
        (format!("{good}\n[checkpoint]\nkeep = 2\n"), "set every_steps or every_minutes"),
        (format!("{good}\n[checkpoint]\nevery_steps = 5\nkeep = 0\n"), "[checkpoint].keep"),
        (format!("{good}\n[checkpoint]\nevery_minutes = -1.0\n"), "[checkpoint].every_minutes"),
        (format!("{good}\n[checkpoint]\nevery_minutes = 5.0\n[pipeline]\nstages = 2\n"), "every_steps only"),
        (
            format!(
                "{}\n[checkpoint]\nevery_minutes = 5.0\n",
                good.replace("global_batch = 64", "global_batch = 64\nshard_state = \"optimizer\"")
            ),
            "[checkpoint].every_minutes: a job with sharded state checkpoints by every_steps only",
        ),
        (
            good.replace(
                "global_batch = 64",
                "global_batch = 64\nshard_state = \"optimizer\"\nshard_replicas = 0",
            ),
            "[job].shard_replicas: must be at least 1",
        ),
        (
            format!(
                "{}\n[pipeline]\nstages = 2\n",
                good.replace("global_batch = 64", "global_batch = 64\nloss_chunk = 1024")
                    .replace("model = \"mlp\"", "model = \"llama\"")
            ),
            "[job].loss_chunk: is not supported by a pipelined job yet",
        ),
        (format!("{good}\n[checkpoint]\nevery_steps = 5\ns3 = \"gs://x/y\"\n"), "[checkpoint].s3"),
        (format!("{good}\n[checkpoint]\nevery_steps = 5\ns3 = \"s3://A_B/y\"\n"), "not a bucket name"),
        (
            format!(
                "{good}\n[checkpoint]\nevery_steps = 5\ns3 = \"s3://bkt/y\"\ns3_endpoint = \"minio:9000\"\n"
            ),
            "[checkpoint].s3_endpoint",
        ),
        (format!("{good}\n[checkpoint]\nevery_steps = 5\ns3_endpoint = \"http://m\"\n"), "set s3 too"),
        (format!("{good}\n[checkpoint]\nevery_steps = 5\nmin_free = \"lots\"\n"), "[checkpoint].min_free"),
        (format!("{good}\n[security.ssm]\nprefix = \"/limpet/demo\"\n"), "[security].insecure"),
        (
            format!(
                "{}\nca = \"/a\"\ncert = \"/b\"\nkey = \"/c\"\n[security.ssm]\nprefix = \"limpet/demo/\"\n",
                good.replace("insecure = true\n", "")
            ),
            "[security.ssm].prefix",
        ),
        (
            format!(
                "{}\nca = \"/nonexistent/ca.pem\"\ncert = \"/x.pem\"\nkey = \"/x.key\"\n",
                good.replace("insecure = true\n", "")
            ),
            "[security].ca",
        ),
        (
            format!(
                "{}\nca = \"/a\"\ncert = \"/b\"\nkey = \"/c\"\ndata_plane = \"none\"\n",
                good.replace("insecure = true\n", "")
            ),
            "[security].data_plane",
        ),
    ];
    for (text, want) in cases {
        let e = Config::parse(&text, "limpet.toml").unwrap_err().to_string();
        assert!(e.starts_with("limpet.toml:"), "{e}");
        assert!(e.contains(want), "expected {want:?} in {e}");
    }
}

/// A required key or section left out is named as `[section].key` (the parser itself names
/// only the table it was missing from, at its first line).
#[test]
fn a_missing_key_or_section_is_named() {
    let s = secret();
    let good = example(s.path());
    let secret_line = good.lines().find(|l| l.starts_with("secret_file")).unwrap().to_string();
    for (text, key) in [
        (good.replace(&secret_line, ""), "[node].secret_file"),
        (good.replace("name = \"demo\"\n", ""), "[cluster].name"),
        (good.replace("[cluster]\nname = \"demo\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n", ""), "[cluster]"),
        // The file's first line a table's header: still the section it lacks.
        (
            good.trim_start().replace("[cluster]\nname = \"demo\"\nbootstrap = [\"1=127.0.0.1:7400\"]\n", ""),
            "[cluster]",
        ),
        (good.trim_start().replace(&secret_line, ""), "[node].secret_file"),
    ] {
        let e = Config::parse(&text, "c.toml").unwrap_err().to_string();
        assert!(e.contains(&format!("{key}: missing: this")), "{key}: {e}");
    }
}

#[test]
fn security_takes_a_node_certificate_of_the_ca_only() {
    let s = secret();
    let d = tempfile::tempdir().unwrap();
    crate::certs::init(d.path(), "t", 5).unwrap();
    let gpu1 = limpet_consensus::state::node_id_of_name("gpu-1");
    crate::certs::issue_for_days(d.path(), "n1", crate::certs::Kind::Node(gpu1), 5).unwrap();
    crate::certs::issue_for_days(d.path(), "n2", crate::certs::Kind::Node(gpu1 + 1), 5).unwrap();
    crate::certs::issue_for_days(d.path(), "op", crate::certs::Kind::Client, 5).unwrap();
    let with = |name: &str| {
        let p = |f: String| d.path().join(f).display().to_string();
        format!(
            "{}\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
            example(s.path()).replace("insecure = true\n", ""),
            p("ca.pem".into()),
            p(format!("{name}.pem")),
            p(format!("{name}.key"))
        )
    };
    Config::parse(&with("n1"), "c.toml").unwrap();
    let e = Config::parse(&with("op"), "c.toml").unwrap_err().to_string();
    assert!(e.contains("[security].cert") && e.contains("operator certificate"), "{e}");
    // Another node's certificate: this node would speak as that one.
    let e = Config::parse(&with("n2"), "c.toml").unwrap_err().to_string();
    assert!(e.contains("[security].cert") && e.contains(&format!("node {}'s certificate", gpu1 + 1)), "{e}");
}

#[test]
fn a_short_or_missing_secret_is_refused() {
    let short = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(short.path(), b"short").unwrap();
    let e = Config::parse(&example(short.path()), "c.toml").unwrap_err().to_string();
    assert!(e.contains("[node].secret_file") && e.contains("5 bytes"), "{e}");
    let e = Config::parse(&example(Path::new("/nonexistent/secret")), "c.toml").unwrap_err().to_string();
    assert!(e.contains("/nonexistent/secret"), "{e}");
}

#[test]
fn validate_names_configured_directories_it_cannot_write() {
    let s = secret();
    let state = tempfile::tempdir().unwrap();
    let text = example(s.path()).replace("/tmp/limpet", &state.path().display().to_string())
        + "\n[checkpoint]\nevery_steps = 10\ndir = \"/sys/limpet-checkpoints\"\n";
    let cfg = Config::parse(&text, "c.toml").unwrap();
    let warnings = cfg.write_path_warnings();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].starts_with("[checkpoint].dir /sys/limpet-checkpoints: does not exist yet"),
        "{warnings:?}"
    );
    assert!(warnings[1].starts_with("[checkpoint].dir /sys: not writable here"), "{warnings:?}");
    assert!(warnings[1].contains("ReadWritePaths="), "{warnings:?}");
    // A writable configuration has nothing to say.
    let ok = example(s.path()).replace("/tmp/limpet", &state.path().display().to_string());
    assert_eq!(Config::parse(&ok, "c.toml").unwrap().write_path_warnings(), Vec::<String>::new());
}

#[test]
fn validate_says_when_a_reproducible_job_s_shards_do_not_divide_among_the_founders() {
    let s = secret();
    let three = example(s.path()).replace(
        r#"bootstrap = ["1=127.0.0.1:7400"]"#,
        r#"bootstrap = ["1=127.0.0.1:7400", "2=127.0.0.1:7410", "3=127.0.0.1:7420"]"#,
    );
    let warn = |extra: &str| {
        let text = three.replace("global_batch = 64", &format!("global_batch = 64\n{extra}"));
        Config::parse(&text, "c.toml").unwrap().shard_warning()
    };
    let w = warn("reproducible = true").unwrap();
    assert!(w.contains("[job].shards 8 (the default) with 3 founders") && w.contains("others 2"), "{w}");
    let w = warn("reproducible = true\nshards = 2").unwrap();
    assert!(w.contains("1 of them idle"), "{w}");
    for quiet in ["reproducible = true\nshards = 3", "reproducible = true\nshards = 6", ""] {
        assert_eq!(warn(quiet), None, "{quiet}");
    }
}

#[test]
fn no_security_section_is_refused_unless_insecure_is_said_in_so_many_words() {
    let s = secret();
    let without = example(s.path()).replace("[security]\ninsecure = true\n", "");
    let e = Config::parse(&without, "c.toml").unwrap_err().to_string();
    assert!(e.contains("[security]") && e.contains("insecure = true"), "{e}");
    let cfg = Config::parse(&example(s.path()), "c.toml").unwrap();
    assert!(cfg.tls().is_none());
    let both = example(s.path()).replace("insecure = true\n", "insecure = true\nca = \"/x/ca.pem\"\n");
    let e = Config::parse(&both, "c.toml").unwrap_err().to_string();
    assert!(e.contains("[security].insecure") && e.contains("choose one"), "{e}");
    let half = example(s.path()).replace("insecure = true\n", "ca = \"/x/ca.pem\"\n");
    let e = Config::parse(&half, "c.toml").unwrap_err().to_string();
    assert!(e.contains("[security].cert") && e.contains("missing"), "{e}");
}

#[test]
fn a_capacity_section_parses_and_bad_values_name_their_key() {
    let s = secret();
    let base = "[capacity]\ntarget = 4\nlaunch_template = \"limpet-gpu\"\n";
    let parse = |extra: &str| Config::parse(&format!("{}\n{base}{extra}", example(s.path())), "limpet.toml");
    let cfg =
        parse("instance_types = \"g5.xlarge, g6.xlarge\"\nsubnets = [\"subnet-a\", \"subnet-b\"]\n").unwrap();
    let c = cfg.capacity.unwrap();
    assert_eq!((c.min(), c.max()), (4, 5));
    let pools: Vec<String> = c.pools().iter().map(|p| p.to_string()).collect();
    assert_eq!(
        pools,
        ["g5.xlarge in subnet-a", "g5.xlarge in subnet-b", "g6.xlarge in subnet-a", "g6.xlarge in subnet-b"]
    );
    assert!(!c.policy(false).spares_required && c.policy(true).spares_required);
    let c = parse(
        "instance_types = [\"g5\", \"g6\"]\nmin_marginal_value = 2e6\nprices = { g5 = 0.5, g6 = 0.4 }\n",
    )
    .unwrap()
    .capacity
    .unwrap();
    assert_eq!((c.policy(false).min_marginal_value, c.static_price()), (Some(2e6), Some(0.4)));
    for (extra, key, words) in [
        ("instance_types = []\n", "[capacity].instance_types", "no instance type"),
        ("instance_types = \"g5\"\nmin = 5\n", "[capacity].min", "min <= target"),
        ("instance_types = \"g5\"\nsubnets = \"vpc-1\"\n", "[capacity].subnets", "not a subnet id"),
        ("instance_types = \"g5 x\"\n", "[capacity].instance_types", "not an instance type"),
        ("instance_types = \"g5\"\ninterval_secs = 0.0\n", "[capacity].interval_secs", "0.2"),
        ("instance_types = \"g5\"\nspares = true\n", "[capacity].spares", "[security.ssm]"),
        (
            "instance_types = \"g5\"\nmin_marginal_value = 1e6\n",
            "[capacity].min_marginal_value",
            "needs prices",
        ),
        (
            "instance_types = \"g5\"\nmin_marginal_value = -1.0\nprices = { g5 = 1.0 }\n",
            "[capacity].min_marginal_value",
            "positive",
        ),
        (
            "instance_types = \"g5\"\nprices = { g6 = 1.0 }\n",
            "[capacity].prices",
            "not one of instance_types",
        ),
        ("instance_types = \"g5\"\nprices = { g5 = 0.0 }\n", "[capacity].prices", "dollars per hour"),
        (
            "instance_types = \"g5\"\nreplace_slower_than = 0.5\n",
            "[capacity].replace_slower_than",
            "1.1..=100",
        ),
    ] {
        let e = parse(extra).unwrap_err();
        let e = e.first();
        assert!(e.key == key && e.detail.contains(words), "{extra}: {e}");
    }
    let e = parse("instance_types = \"g5\"\ntarrget = 3\n").unwrap_err().to_string();
    assert!(e.contains("tarrget"), "{e}");
}

/// One reading reports every problem of a file, each with its key and the line it is on,
/// and problems of keys the file leaves at their defaults without a line.
#[test]
fn every_problem_is_reported_at_once_with_its_line() {
    let s = secret();
    let text = example(s.path())
        .replace("control = \"127.0.0.1:7400\"", "control = \"nowhere\"")
        .replace("global_batch = 64", "global_batch = 0")
        + "\n[timing]\nheartbeat_ms = 1\n";
    let e = Config::parse(&text, "c.toml").unwrap_err();
    let found: Vec<(&str, Option<usize>)> = e.all().iter().map(|e| (e.key.as_str(), e.line)).collect();
    let line = |needle: &str| text.lines().position(|l| l.starts_with(needle)).map(|i| i + 1);
    assert_eq!(
        found,
        [
            ("[node].control", line("control = ")),
            ("[job].global_batch", line("global_batch = ")),
            ("[timing].heartbeat_ms", line("heartbeat_ms = ")),
        ],
        "{e}"
    );
    assert!(found.iter().all(|(_, l)| l.is_some()));
    let shown = e.to_string();
    assert_eq!(shown.lines().count(), 3, "{shown}");
    for (shown, (key, line)) in shown.lines().zip(&found) {
        assert!(shown.starts_with(&format!("c.toml:{}: {key}: ", line.unwrap())), "{shown}");
    }
    // A key at its default has no line to show: the failure-timeout check names the key alone.
    let e = Config::parse(&(example(s.path()) + "\n[timing]\nheartbeat_ms = 900\n"), "c.toml").unwrap_err();
    assert_eq!((e.first().key.as_str(), e.first().line), ("[timing].failure_timeout_ms", None));
}

/// Keys that would fail only once limpetd starts (two listeners on one port, a founder named
/// twice, an empty directory that would put state in the working directory) or overflow
/// (an hour-long heartbeat, twice over), each named.
#[test]
fn listeners_founders_directories_and_timings_are_checked_before_start() {
    let s = secret();
    let errors = |text: String| {
        let e = Config::parse(&text, "c.toml").unwrap_err();
        e.all().iter().map(|e| format!("{}: {}", e.key, e.detail)).collect::<Vec<_>>().join("\n")
    };
    let e = errors(example(s.path()).replace("data = \"127.0.0.1:7401\"", "data = \"127.0.0.1:7400\""));
    assert!(e.contains("[node].data: 127.0.0.1:7400 is [node].control's address too"), "{e}");
    let e = errors(example(s.path()).replace(
        "bootstrap = [\"1=127.0.0.1:7400\"]",
        "bootstrap = [\"1=127.0.0.1:7400\", \"1=127.0.0.1:7500\"]",
    ));
    assert!(e.contains("\"1=127.0.0.1:7400\" and \"1=127.0.0.1:7500\" name the same id 1"), "{e}");
    let e = errors(example(s.path()).replace("state_dir = \"/tmp/limpet\"", "state_dir = \"\""));
    assert!(e.contains("[node].state_dir: is empty"), "{e}");
    let e = errors(example(s.path()) + "\n[timing]\nheartbeat_ms = 18446744073709551615\n");
    assert!(e.contains("[timing].heartbeat_ms: 18446744073709551615 is above an hour"), "{e}");
    let e = errors(example(s.path()) + "\n[timing]\nlead_ms = 3600001\nnotice_margin_ms = 99999999999\n");
    assert!(e.contains("[timing].lead_ms: 3600001 is above an hour"), "{e}");
    assert!(e.contains("[timing].notice_margin_ms: 99999999999 is above an hour"), "{e}");
}

/// What only the built job can tell is refused by the same call start-up makes: pipeline
/// cuts past the model's blocks (the file's checks alone cannot know the block count), and a
/// data file that is not there.
#[test]
fn settling_refuses_what_only_the_built_job_can_tell() {
    let s = secret();
    let state = tempfile::tempdir().unwrap();
    let base = example(s.path())
        .replace("/tmp/limpet", &state.path().display().to_string())
        .replace("model = \"mlp\"", "model = \"gpt\"\nlayers = 4")
        .replace("data = \"digits\"", "data = \"chars\"");
    let with_cuts =
        |cuts: &str, stages: usize| format!("{base}\n[pipeline]\nstages = {stages}\ncuts = {cuts}\n");
    let ok = Config::parse(&with_cuts("[2]", 2), "c.toml").unwrap().settings().unwrap();
    assert_eq!(ok.agent.pipeline.as_ref().unwrap().cuts, Some(vec![2]));
    // The embedding, 4 layers and the head.
    assert_eq!(ok.agent.job.model.num_blocks(), 6);
    // The file's checks pass: only the model says 6 blocks.
    let past = Config::parse(&with_cuts("[2, 6]", 3), "c.toml").unwrap();
    let e = past.settings().err().expect("a cut past the last block is refused");
    assert_eq!(e.first().key, "[pipeline].cuts", "{e}");
    assert!(e.first().line.is_some() && e.to_string().contains("the model has 6 blocks"), "{e}");
    let missing = base.replace("data = \"chars\"", "data = \"tokens\"\ndata_path = \"/nonexistent/shards\"");
    let e = Config::parse(&missing, "c.toml").unwrap().settings().err().expect("missing data is refused");
    assert_eq!(e.first().key, "[job].data_path", "{e}");
    assert!(e.to_string().contains("/nonexistent/shards"), "{e}");
}

/// Every key a file sets lands in what limpetd runs: a key that is checked but never applied
/// (or applied from the wrong place) fails here.
#[test]
fn every_key_set_lands_where_the_agent_reads_it() {
    use std::time::Duration;
    let s = secret();
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().display().to_string();
    let text = format!(
        r#"
[node]
name = "gpu-1"
id = 7
control = "127.0.0.1:7400"
data = "127.0.0.1:7401"
advertise_control = "10.0.0.7:7400"
advertise_data = "10.0.0.7:7401"
state_dir = "{dir}"
step_log = "{dir}/steps.jsonl"
secret_file = "{secret}"
metrics = "127.0.0.1:9100"
data_congestion = "system"
devices = ["cpu", "cpu"]
zone = "us-east-1b"
zone_levels = false

[cluster]
name = "demo"
seeds = ["127.0.0.1:7500"]
bootstrap = ["7=127.0.0.1:7400", "8=127.0.0.1:7410"]
max_voters = 3
min_nodes = 2
straggler_ratio = 2.0
straggler_steps = 50

[job]
model = "mlp"
data = "synthetic"
steps = 400
global_batch = 64
policy = "linear"
base_world = 4

[revocation]
sources = "none"
poll_secs = 3.0

[timing]
heartbeat_ms = 150
failure_timeout_ms = 900
data_timeout_ms = 4000
raft_tick_ms = 40
lead_ms = 300
notice_margin_ms = 1500
drain_grace_secs = 30

[checkpoint]
every_steps = 10
every_minutes = 2.5
dir = "{dir}/ck"
keep = 5
resume = "never"
min_free = "1G"
s3 = "s3://bucket-a/runs/x"
s3_endpoint = "http://127.0.0.1:9000"
s3_region = "eu-west-1"

[security]
insecure = true
"#,
        secret = s.path().display()
    );
    let st = Config::parse(&text, "c.toml").unwrap().settings().unwrap();
    let a = &st.agent;
    assert_eq!((a.id, a.name.as_str(), a.cluster.as_str()), (7, "gpu-1", "demo"));
    assert_eq!(
        (a.control.to_string(), a.data.to_string()),
        ("127.0.0.1:7400".into(), "127.0.0.1:7401".into())
    );
    assert_eq!((a.advertise_control.as_str(), a.advertise_data.as_str()), ("10.0.0.7:7400", "10.0.0.7:7401"));
    assert_eq!(a.state_dir, state.path());
    assert_eq!(a.step_log, Some(state.path().join("steps.jsonl")));
    assert_eq!(&a.secret[..], b"0123456789abcdef0123");
    assert_eq!(st.metrics, Some("127.0.0.1:9100".parse().unwrap()));
    assert!(st.metrics_tls.is_none() && a.tls.is_none());
    assert_eq!(a.dp_congestion, None);
    assert_eq!((a.zone.as_str(), a.zone_levels), ("us-east-1b", false));
    assert_eq!(a.devices.len(), 2);
    assert_eq!(a.seeds, ["127.0.0.1:7500"]);
    let founders: Vec<u64> = a.bootstrap.as_ref().unwrap().iter().map(|m| m.id).collect();
    assert_eq!(founders, [7, 8]);
    assert_eq!(a.max_voters, 3);
    assert_eq!((a.base_world, a.policy, a.min_nodes), (4, BatchPolicy::Linear, 2));
    assert_eq!((a.straggler_ratio, a.straggler_steps), (2.0, 50));
    assert_eq!(a.poll, Duration::from_secs(3));
    let t = &a.timing;
    assert_eq!(
        (
            t.heartbeat_ms,
            t.failure_timeout_ms,
            t.data_timeout_ms,
            t.raft_tick_ms,
            t.lead_ms,
            t.notice_margin_ms
        ),
        (150, 900, 4000, 40, 300, 1500)
    );
    assert_eq!(st.grace, Duration::from_secs(30));
    assert_eq!(a.job.steps, 400);
    let ck = a.checkpoint.as_ref().unwrap();
    assert_eq!((ck.every_steps, ck.every(), ck.keep), (10, Some(Duration::from_secs(150)), 5));
    assert_eq!(
        (ck.dir(), ck.resume, ck.min_free.0),
        (state.path().join("ck").as_path(), limpet_agent::runtime::Resume::Never, 1 << 30)
    );
    let remote = ck.remote().unwrap();
    assert_eq!(
        (
            remote.bucket.as_str(),
            remote.prefix.as_str(),
            remote.endpoint.as_deref(),
            remote.region.as_deref()
        ),
        ("bucket-a", "runs/x", Some("http://127.0.0.1:9000"), Some("eu-west-1"))
    );
    // A pipeline's keys.
    let piped = format!(
        "{}\n[pipeline]\nstages = 2\nmemory = \"8G\"\nlink_gbps = 2.0\nlatency_ms = 0.5\nshadow_every = 5\n",
        text.replace("model = \"mlp\"", "model = \"gpt\"")
            .replace("data = \"synthetic\"", "data = \"chars\"")
            .replace("devices = [\"cpu\", \"cpu\"]\n", "")
            .replace("every_minutes = 2.5\n", "")
    );
    let st = Config::parse(&piped, "c.toml").unwrap().settings().unwrap();
    let p = st.agent.pipeline.unwrap();
    assert_eq!((p.depth(), p.memory.0, p.shadow_every, p.cuts.clone()), (Some(2), 8 << 30, 5, None));
    assert_eq!((p.link().bytes_per_s, p.link().latency_ms), (2e9, 0.5));
}

/// A GPU host whose file asks for no device trains on its CPU: validate and start-up say so,
/// and stop saying so once the file names a device either way.
#[test]
fn a_gpu_host_left_on_the_cpu_is_warned() {
    let s = secret();
    let cfg = Config::parse(&example(s.path()), "c.toml").unwrap();
    let warning = cfg.cpu_warning(2).expect("a warning on a host of 2 GPUs");
    assert!(warning.contains("[job].device") && warning.contains("2 GPU"), "{warning}");
    assert_eq!(cfg.cpu_warning(0), None);
    for set in ["model = \"mlp\"\ndevice = \"cpu\"", "model = \"mlp\"\ndevice = \"auto\""] {
        let text = example(s.path()).replace("model = \"mlp\"", set);
        assert_eq!(Config::parse(&text, "c.toml").unwrap().cpu_warning(2), None, "{set}");
    }
}

/// serde's paths to unknown keys as errors name them: optional sections (`?`) and nested
/// tables dropped into the section's name.
#[test]
fn unknown_paths_name_their_section() {
    assert_eq!(section_key("job.bogus"), "[job].bogus");
    assert_eq!(section_key("security.?.bogus"), "[security].bogus");
    assert_eq!(section_key("security.?.ssm.?.x"), "[security.ssm].x");
    assert_eq!(section_key("bogus"), "[bogus]");
}

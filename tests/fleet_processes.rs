//! Fleet tooling against a local EC2 API: moto's server (from PyPI, installed by
//! deploy/setup.sh) in its own process, spoken to by the real AWS SDK through
//! `limpet-deploy`, the `limpet fleet` command line and `limpetd`'s seed discovery by tag.
//! Also: EC2's "no spot capacity" answer is reported as such. The cloud-init template and
//! the credentials its hosts fetch are tested in `cloud_init_processes.rs`.

use limpet_deploy::{Fleet, FleetConfig, FleetError, LaunchSpec};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "common.rs"]
mod common;
use common::{config, exe, lab_exe, make_template, Moto};

fn spec(count: u32) -> LaunchSpec {
    LaunchSpec {
        launch_template: "limpet-gpu".into(),
        version: None,
        count,
        // moto launches min_count instances (EC2 as many as it can up to count).
        min_count: count,
        instance_type: None,
        user_data: Some("#cloud-config\n".into()),
        on_demand: false,
    }
}

#[test]
fn fleet_up_list_down_and_seeds_through_the_sdk() {
    let moto = Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut a = Fleet::connect("train-a", &config(&moto)).await.unwrap();
        let b = Fleet::connect("train-b", &config(&moto)).await.unwrap();
        make_template(&a, "limpet-gpu").await;

        let launched = a.up(&spec(3)).await.unwrap();
        assert_eq!(launched.len(), 3);
        assert!(
            launched.iter().all(|m| m.instance_type == "g5.xlarge" && m.lifecycle == "spot"),
            "{launched:?}"
        );
        b.up(&spec(1)).await.unwrap();

        // The tag separates clusters; pages are followed to the end (moto, like EC2, pages
        // by reservation: one per launch).
        for _ in 0..5 {
            a.up(&spec(1)).await.unwrap();
        }
        a.page_size = 5;
        let (members, pages) = a.list().await.unwrap();
        assert_eq!(members.len(), 8, "{members:?}");
        assert!(pages >= 2, "6 launches in pages of 5 took {pages} page(s)");
        assert_eq!(b.list().await.unwrap().0.len(), 1);

        let seeds = a.seeds(7400).await.unwrap();
        assert_eq!(seeds.len(), 8, "{seeds:?}");
        assert!(seeds
            .iter()
            .all(|s| s.ends_with(":7400")
                && s.split(':').next().unwrap().parse::<std::net::Ipv4Addr>().is_ok()));

        // Errors name what is wrong.
        let bad = LaunchSpec { launch_template: "no-such-template".into(), ..spec(1) };
        match a.up(&bad).await {
            Err(e @ FleetError::Api { .. }) => assert!(e.to_string().contains("RunInstances"), "{e}"),
            other => panic!("expected EC2 to refuse a missing template, got {other:?}"),
        }
        let e = a.up(&LaunchSpec { min_count: 3, ..spec(2) }).await.unwrap_err();
        assert!(matches!(e, FleetError::Usage(_)), "{e}");
        let foreign = b.list().await.unwrap().0[0].id.clone();
        let e = a.down(std::slice::from_ref(&foreign)).await.unwrap_err().to_string();
        assert!(e.contains(&foreign) && e.contains("train-a"), "another cluster's instance is refused: {e}");

        let done = a.down(&[]).await.unwrap();
        assert_eq!(done.len(), 8);
        assert!(a.list().await.unwrap().0.is_empty(), "terminated instances are not listed");
        assert_eq!(b.list().await.unwrap().0.len(), 1, "the other cluster is untouched");
    });

    // The command line: JSON listing, and `down` without ids needs --all.
    let run = |args: &[&str]| {
        Command::new(exe())
            .args(args)
            .args(["--region", "us-east-1", "--endpoint-url", &moto.url])
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .output()
            .unwrap()
    };
    let out = run(&["fleet", "list", "--cluster", "train-b", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    let out = run(&["fleet", "down", "--cluster", "train-b"]);
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--all"));
    let out = run(&["fleet", "down", "--cluster", "train-b", "--all", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let down: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(down["cluster"], "train-b", "{down}");
    let changes = down["terminated"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{down}");
    assert_eq!(changes[0]["instance"], listed[0]["id"], "{down}");
    assert!(
        changes[0]["now"].as_str().unwrap().contains("shutting") || changes[0]["now"] == "terminated",
        "{down}"
    );
    let out =
        run(&["fleet", "up", "--cluster", "train-b", "--launch-template", "limpet-gpu", "--set", "x=1"]);
    assert_eq!(out.status.code(), Some(64), "--set without a template is a usage error");
}

#[test]
fn limpetd_finds_its_seeds_by_the_cluster_tag() {
    let moto = Moto::start();
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let seeds = rt.block_on(async {
        let a = Fleet::connect("tagged", &config(&moto)).await.unwrap();
        make_template(&a, "limpet-gpu").await;
        a.up(&spec(2)).await.unwrap();
        a.seeds(7400).await.unwrap()
    });
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef").unwrap();
    let write = |cluster: &str| {
        let path = tmp.path().join(format!("{cluster}.toml"));
        let text = format!(
            "[node]\nname = \"joiner\"\ncontrol = \"127.0.0.1:7400\"\ndata = \"127.0.0.1:0\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n[cluster]\nname = {cluster:?}\nec2_seeds = true\nec2_region = \"us-east-1\"\nec2_endpoint = {:?}\n\n[job]\nmodel = \"mlp\"\ndata = \"digits\"\nsteps = 10\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n[revocation]\nsources = \"none\"\n",
            tmp.path().join(cluster).display().to_string(),
            secret.display().to_string(),
            moto.url
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let start = |path: &Path| {
        Command::new(env!("CARGO_BIN_EXE_limpetd"))
            .arg("--config")
            .arg(path)
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // A cluster with no running instance: limpetd stops and says why.
    let out = start(&write("empty")).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no running instance tagged limpet:cluster=empty"),
        "{stderr}"
    );
    // The tagged cluster: limpetd joins through its instances' private addresses (which do
    // not answer here; the log shows where it tried).
    let mut child = start(&write("tagged"));
    std::thread::sleep(Duration::from_secs(3));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    for s in &seeds {
        assert!(stderr.contains(s.as_str()), "seed {s} not used: {stderr}");
    }
}

/// EC2's answer when a spot pool is empty (moto never runs out): the error document EC2
/// sends, served to the real SDK.
const NO_CAPACITY: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>InsufficientInstanceCapacity</Code><Message>There is no Spot capacity available that matches your request.</Message></Error></Errors><RequestID>5c4b0b6a-41a4-4b2e-9d6c-8f0d6a1b2c3d</RequestID></Response>"#;

#[test]
fn no_spot_capacity_is_reported_as_such() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async {
        let app = axum::Router::new().fallback(|| async {
            (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                [("content-type", "text/xml;charset=UTF-8")],
                NO_CAPACITY,
            )
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let cfg = FleetConfig {
            region: Some("us-east-1".into()),
            endpoint: Some(url),
            credentials: Some(("testing".into(), "testing".into())),
        };
        let fleet = Fleet::connect("full", &cfg).await.unwrap();
        match fleet.up(&spec(4)).await {
            Err(e @ FleetError::Capacity { .. }) => {
                let text = e.to_string();
                assert!(text.contains("no capacity") && text.contains("limpet-gpu"), "{text}");
            }
            other => panic!("expected a capacity error, got {other:?}"),
        }
    });
}

/// `limpet simulate` over the shipped AWS p3 trace, through the binary: a table and JSON
/// with every policy over the same window (the trace's span), checkpoint-restart at its best
/// (a search of intervals) and at Young's interval, on-demand at the spot fleet's average size
/// and at its cheapest, a plot, and what the model must show: limpet loses less and pays less
/// per sample than checkpoint-restart at its best, spot costs less per sample than on-demand,
/// and limpet's figure is the product of its factors. `--sweep` varies one assumption at a
/// time. A bad trace is refused naming its line, a bad flag naming the flag.
#[test]
fn limpet_simulate_compares_the_policies_over_a_real_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let plot = tmp.path().join("sim.svg");
    // Without --trace: the trace shipped inside limpet.
    let out = Command::new(exe())
        .args(["simulate", "--json", "--checkpoint-minutes", "10"])
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["trace"]["events"], 344);
    assert!(doc["trace"]["file"].as_str().unwrap().contains("shipped with limpet"), "{doc}");
    let rows = doc["policies"].as_array().unwrap();
    let by_label = |n: &str| rows.iter().find(|p| p["label"].as_str().unwrap().contains(n)).unwrap().clone();
    let (limpet, best, young, given, on_demand) =
        (by_label("limpet"), by_label("best"), by_label("Young"), by_label("every 10m"), by_label("average"));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    // The same window for every policy: the trace's span.
    for r in rows {
        assert!((f(r, "hours") - f(&doc["trace"], "hours")).abs() < 1e-3, "{r}");
    }
    // The search's best is no worse than Young's interval or the 10 minutes asked for.
    assert!(f(&best, "usd_per_million") <= f(&young, "usd_per_million"), "{doc}");
    assert!(f(&best, "usd_per_million") <= f(&given, "usd_per_million"), "{doc}");
    let young_s = f(&doc, "young_interval_s");
    let mtbc = f(&doc, "mean_time_between_changes_s");
    assert!(
        (young_s - (2.0 * 10.0 * mtbc).sqrt()).abs() < 1e-6 && young_s > 30.0 && young_s < 300.0,
        "{doc}"
    );
    assert_eq!(young["setting"]["every_s"].as_f64().unwrap(), young_s);
    assert!(f(&limpet, "goodput") > f(&best, "goodput"), "{doc}");
    assert!(f(&limpet, "lost_s") < f(&best, "lost_s"), "{doc}");
    assert!(f(&limpet, "usd_per_million") < f(&best, "usd_per_million"), "{doc}");
    assert!(f(&limpet, "hours_to_train") < f(&best, "hours_to_train"), "{doc}");
    assert!(
        f(&limpet, "cost_vs_on_demand") < 1.0 && (f(&on_demand, "cost_vs_on_demand") - 1.0).abs() < 1e-9,
        "{doc}"
    );
    assert!((f(&on_demand, "goodput") - 1.0).abs() < 1e-9);
    assert_eq!(on_demand["hosts"], doc["trace"]["average_hosts"]);
    assert!(by_label("cheapest")["hosts"].as_u64().unwrap() < on_demand["hosts"].as_u64().unwrap());
    // The factors multiply to limpet's figure.
    let b = &doc["breakdown"];
    let product = f(b, "price") * f(b, "boot") * f(b, "scaling") * f(b, "transitions");
    assert!((product - f(&limpet, "cost_vs_on_demand")).abs() < 1e-6, "{b}");
    assert!(doc["search"].as_array().unwrap().len() > 20, "{doc}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("checkpoint-restart"), "not the plot");
    // The table names the rows, and the trace (a copy of the shipped one, named).
    let copy = tmp.path().join("p3.csv");
    std::fs::write(&copy, limpet_daemon::simulate::trace::AWS_P3).unwrap();
    let out = Command::new(exe()).args(["simulate", "--trace"]).arg(&copy).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        [
            "limpet",
            "checkpoint-restart, best",
            "Young",
            "on-demand",
            "VS ON-DEMAND",
            "HOURS TO TRAIN",
            "x boot",
            "p3.csv"
        ]
        .iter()
        .all(|w| text.contains(w)),
        "{text}"
    );
    // The sweep, over a short trace: one assumption at a time.
    let short = tmp.path().join("short.csv");
    std::fs::write(&short, "0,add,a\n0,add,b\n600000,remove,b\n1200000,add,b\n3600000,remove,a\n").unwrap();
    let out = Command::new(exe()).args(["simulate", "--sweep", "--trace"]).arg(&short).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for w in [
        "spot / on-demand price",
        "revocations without notice",
        "checkpoint-restart's restart (s)",
        "LIMPET VS CKPT-RESTART",
    ] {
        assert!(text.contains(w), "{w}: {text}");
    }
    // The job due within 10 h of the 11.4 h trace: the spot policies add on-demand hosts to
    // make it (the job is what the average on-demand fleet trains in 11.4 h).
    let out = Command::new(exe()).args(["simulate", "--json", "--deadline", "10"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let (limpet, od) = (&rows[0], &rows[2]);
    assert!(limpet["met"] == true && od["met"] == true, "{rows:?}");
    assert!(f(limpet, "fallback_host_hours") > 0.0 && f(limpet, "hours") <= 10.0, "{limpet}");
    assert!(f(limpet, "cost_vs_on_demand") < 1.0 && f(od, "fallback_host_hours") == 0.0, "{rows:?}");
    let out = Command::new(exe()).args(["simulate", "--deadline", "20"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(64) && err.contains("past the trace's end"), "{err}");
    // A trace that removes a host it never added.
    let bad = tmp.path().join("bad.csv");
    std::fs::write(&bad, "0,add,a\n10,remove,b\n").unwrap();
    let out = Command::new(exe()).args(["simulate", "--trace"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(64) && err.contains("bad.csv:2: b is removed while it is not live"),
        "{err}"
    );
    let out = Command::new(exe()).args(["simulate", "--async-pause-seconds=-1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(64) && err.contains("--async-pause-seconds -1"), "{err}");
}

/// With `ec2_seeds`, a new cluster founds itself: the oldest live instance (launch time,
/// then id), if it has no state, founds the cluster alone; every other host joins through
/// the running ones; the founder restarted with its state does not found again.
#[test]
fn the_oldest_instance_founds_the_cluster_and_the_others_join_it() {
    let moto = Moto::start();
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut ips: Vec<(String, String)> = rt.block_on(async {
        let a = Fleet::connect("fresh", &config(&moto)).await.unwrap();
        make_template(&a, "limpet-gpu").await;
        a.up(&spec(2)).await.unwrap();
        a.list().await.unwrap().0.into_iter().map(|m| (m.id, m.private_ip.unwrap())).collect()
    });
    // One launch: the same launch time, so the id decides.
    ips.sort();
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let write = |name: &str, ip: &str| {
        let path = tmp.path().join(format!("{name}.toml"));
        let text = format!(
            "[node]\nname = {name:?}\ncontrol = \"127.0.0.1:{port}\"\nadvertise_control = \"{ip}:{port}\"\ndata = \"127.0.0.1:0\"\nstate_dir = {:?}\nsecret_file = {:?}\n\n[cluster]\nname = \"fresh\"\nec2_seeds = true\nec2_region = \"us-east-1\"\nec2_endpoint = {:?}\n\n[job]\nmodel = \"mlp\"\ndata = \"digits\"\nsteps = 100000\nglobal_batch = 8\n\n[security]\ninsecure = true\n\n[revocation]\nsources = \"none\"\n",
            tmp.path().join(name).display().to_string(),
            secret.display().to_string(),
            moto.url
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let start = |path: &Path, log: &Path| {
        Command::new(env!("CARGO_BIN_EXE_limpetd"))
            .arg("--config")
            .arg(path)
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap()
    };
    let status = || {
        let out = Command::new(exe())
            .args(["status", "--json", "--addr", &format!("127.0.0.1:{port}"), "--cluster", "fresh"])
            .output()
            .unwrap();
        out.status.success().then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap())
    };
    let founder_config = write("founder", &ips[0].1);
    let log = tmp.path().join("founder.log");
    let mut child = start(&founder_config, &log);
    let started = std::time::Instant::now();
    while status().is_none_or(|s| s["leader"] != "founder") {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the oldest instance did not found the cluster: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(std::fs::read_to_string(&log).unwrap().contains("founding it"));
    let _ = child.kill();
    let _ = child.wait();
    // Restarted with its state: a member of its cluster again, not a second founding.
    let log2 = tmp.path().join("founder-again.log");
    let mut child = start(&founder_config, &log2);
    let started = std::time::Instant::now();
    while status().is_none_or(|s| s["leader"] != "founder") {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", std::fs::read_to_string(&log2).unwrap());
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&log2).unwrap();
    assert!(!text.contains("founding it"), "{text}");
    let _ = child.kill();
    let _ = child.wait();
    // The younger instance, without state, joins through the running ones instead.
    let log3 = tmp.path().join("younger.log");
    let mut child = start(&write("younger", &ips[1].1), &log3);
    std::thread::sleep(Duration::from_secs(3));
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log3).unwrap();
    assert!(!text.contains("founding it") && text.contains(&format!("{}:{port}", ips[0].1)), "{text}");
}

/// `limpet-lab chaos --ec2`: a trace's removals fired at a fleet through the real SDK against
/// moto's EC2 and FIS servers. The first removal is a FIS experiment whose template names
/// the spot interruption action, the (uncompressed, at least 2-minute) notice, the role and
/// the mapped instance's ARN; the second (`--kill-every 2`) terminates its instance; the
/// addition is left to `[capacity]`. Bad usage is refused naming the flag.
#[test]
fn chaos_on_ec2_interrupts_through_fis_and_terminates_without_notice() {
    let moto = Moto::start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let fleet = rt.block_on(Fleet::connect("chaos-ec2", &config(&moto))).unwrap();
    rt.block_on(make_template(&fleet, "limpet-gpu"));
    let launched = rt.block_on(fleet.up(&spec(3))).unwrap();
    let mut ids: Vec<String> = launched.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace.csv");
    std::fs::write(&trace, "0,add,a\n0,add,b\n0,add,c\n10000,remove,a\n20000,remove,b\n30000,add,d\n")
        .unwrap();
    let role = "arn:aws:iam::123456789012:role/limpet-fis";
    let run = |extra: &[&str]| {
        Command::new(lab_exe())
            .args(["chaos", "--ec2", "chaos-ec2", "--trace"])
            .arg(&trace)
            .args(["--speedup", "100", "--until-s", "35", "--kill-every", "2", "--json", "--dir"])
            .arg(tmp.path().join("run"))
            .args(["--region", "us-east-1", "--endpoint-url", &moto.url])
            .args(extra)
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fis-role"));
    let out = run(&["--fis-role", role]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mapped = &report["mapped"];
    let fired = report["fired"].as_array().unwrap();
    let kinds: Vec<&str> = fired.iter().map(|f| f["action"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["interrupt", "terminate", "add"], "{report:#}");
    assert_eq!(report["notice_s"], 120, "FIS's shortest notice, whatever the speedup");
    let (a, b) = (mapped["a"].as_str().unwrap().to_string(), mapped["b"].as_str().unwrap().to_string());
    assert_eq!(fired[0]["instance"], a.as_str());
    assert_eq!(fired[1]["instance"], b.as_str());

    // What FIS holds: one experiment, from a template that interrupts a's instance.
    let fis = rt.block_on(limpet_deploy::fis::Fis::connect(&config(&moto))).unwrap();
    let experiments = rt.block_on(fis.client().list_experiments().send()).unwrap();
    let all = experiments.experiments();
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].id(), fired[0]["answer"].as_str());
    let template_id = all[0].experiment_template_id().unwrap().to_string();
    let t = rt.block_on(fis.client().get_experiment_template().id(&template_id).send()).unwrap();
    let t = t.experiment_template().unwrap();
    assert_eq!(t.role_arn(), Some(role));
    let action = t.actions().unwrap().values().next().unwrap();
    assert_eq!(action.action_id(), Some(limpet_deploy::fis::SPOT_INTERRUPTION));
    assert_eq!(
        action.parameters().unwrap().get("durationBeforeInterruption").map(String::as_str),
        Some("PT120S")
    );
    let target = t.targets().unwrap().values().next().unwrap();
    assert_eq!(target.resource_type(), Some("aws:ec2:spot-instance"));
    assert_eq!(target.resource_arns(), [format!("arn:aws:ec2:us-east-1:123456789012:instance/{a}")]);
    // EC2: b's instance is terminated, a's and c's still run (FIS's action is simulated by moto).
    let left: Vec<String> = rt
        .block_on(fleet.list())
        .unwrap()
        .0
        .into_iter()
        .filter(|m| m.state == "running")
        .map(|m| m.id)
        .collect();
    assert!(!left.contains(&b) && left.contains(&a) && left.len() == 2, "{left:?}");
}

//! The shipped cloud-init template (`deploy/cloud-init.yaml`): it renders to YAML whose limpetd
//! configuration validates, `limpet fleet render` prints it, and a host launched with it by
//! `limpet fleet up --certs` gets its credentials through SSM Parameter Store at first boot
//! (moto's EC2 and SSM servers, the real SDK and binaries), never through user data.

use limpet_deploy::Fleet;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

#[path = "common.rs"]
mod common;
use common::{config, exe, make_template, python, Moto};

fn user_data_vars(checkpoint_dir: &Path) -> BTreeMap<String, String> {
    [
        ("cluster", "prod"),
        ("ssm_prefix", "/limpet/prod"),
        ("control_port", "7400"),
        ("data_port", "7401"),
        ("metrics_port", "9400"),
        ("region", "us-east-1"),
        ("model", "gpt"),
        // Model gpt takes no [model] size: empty values leave those keys out.
        ("model_preset", ""),
        ("model_init_from", ""),
        ("data", "chars"),
        ("data_path", "/usr/share/common-licenses"),
        ("context", "64"),
        ("precision", "fp32"),
        ("steps", "20000"),
        ("global_batch", "256"),
        ("micro_batch", "64"),
        ("checkpoint_every", "1000"),
        ("checkpoint_dir", &checkpoint_dir.display().to_string()),
        ("release_url", "https://example.invalid/limpet.tar.gz"),
        ("release_sha256", "0000"),
        ("capacity_target", "4"),
        ("launch_template", "limpet-gpu"),
        ("instance_types", "g5.xlarge,g6.xlarge"),
        ("subnets", "subnet-0a1,subnet-0b2"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn cloud_init_template() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/cloud-init.yaml")).unwrap()
}

/// The limpetd configuration in rendered user data, read as cloud-init reads it (YAML).
fn config_in_user_data(rendered: &str, tmp: &Path) -> String {
    let doc = tmp.join("user-data.yaml");
    std::fs::write(&doc, rendered).unwrap();
    let out = Command::new(python())
        .args(["-c", "import json,sys,yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"])
        .arg(&doc)
        .output()
        .unwrap();
    assert!(out.status.success(), "not YAML: {}", String::from_utf8_lossy(&out.stderr));
    let parsed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files = parsed["write_files"].as_array().unwrap();
    files.iter().find(|f| f["path"] == "/etc/limpet/limpetd.toml").unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn the_cloud_init_template_renders_to_yaml_and_names_a_forgotten_value() {
    let tmp = tempfile::tempdir().unwrap();
    let template = cloud_init_template();
    let vars = user_data_vars(&tmp.path().join("ck"));
    let rendered = limpet_deploy::render_user_data(&template, &vars).unwrap();
    assert!(rendered.starts_with("#cloud-config\n"));
    let config = config_in_user_data(&rendered, tmp.path());
    assert!(config.contains("[security.ssm]") && !config.contains("insecure"), "{config}");
    // A host trains with every GPU it has, one rank each.
    assert!(config.contains("devices = \"auto\""), "{config}");
    // A forgotten value is caught before anything launches.
    let mut missing = vars.clone();
    missing.remove("region");
    let e = limpet_deploy::render_user_data(&template, &missing).unwrap_err().to_string();
    assert!(e.contains("\"region\""), "{e}");
    // The hosts keep their fleet: [capacity] from the template's values.
    assert!(
        config.contains("[capacity]") && config.contains("instance_types = \"g5.xlarge,g6.xlarge\""),
        "{config}"
    );

    // `limpet fleet render` prints the same (a launch template's user data), and names a
    // forgotten value with the usage exit code.
    let path = tmp.path().join("cloud-init.yaml");
    std::fs::write(&path, &template).unwrap();
    let sets: Vec<String> =
        vars.iter().flat_map(|(k, v)| ["--set".to_string(), format!("{k}={v}")]).collect();
    let out =
        Command::new(exe()).args(["fleet", "render", "--user-data"]).arg(&path).args(&sets).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), rendered);
    let out = Command::new(exe())
        .args(["fleet", "render", "--user-data"])
        .arg(&path)
        .args(&sets[2..])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let first = vars.keys().next().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{first:?}")), "{out:?}");
}

/// `limpet fleet up --certs` with the shipped template: user data carries no key or secret;
/// each host's first boot (`limpetd fetch-credentials`, the real binary, against moto's SSM
/// API as the instance role would reach it) gets its own certificate, bound to its instance
/// id's node id, and deletes its key's parameter; `limpetd validate` accepts the result;
/// `fleet down` deletes the terminated hosts' credentials.
#[test]
fn fleet_up_delivers_credentials_through_ssm_never_in_user_data() {
    let moto = Moto::start();
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let fleet = rt.block_on(async {
        let f = Fleet::connect("prod", &config(&moto)).await.unwrap();
        make_template(&f, "limpet-gpu").await;
        f
    });
    let certs = tmp.path().join("certs");
    let out = Command::new(exe())
        .args(["certs", "init", "--cluster", "prod", "--dir"])
        .arg(&certs)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "s3cr3t-0123456789abcdef").unwrap();
    let template = tmp.path().join("cloud-init.yaml");
    std::fs::write(&template, cloud_init_template()).unwrap();
    let aws = |c: &mut Command| {
        c.env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env_remove("AWS_PROFILE");
    };
    let up = |extra: &[&str]| {
        let mut c = Command::new(exe());
        c.args([
            "fleet",
            "up",
            "--cluster",
            "prod",
            "--launch-template",
            "limpet-gpu",
            "--count",
            "2",
            "--json",
        ])
        .args(["--region", "us-east-1", "--endpoint-url", &moto.url, "--user-data"])
        .arg(&template);
        for (k, v) in user_data_vars(&tmp.path().join("ck")) {
            c.arg("--set").arg(format!("{k}={v}"));
        }
        aws(c.args(extra));
        c.output().unwrap()
    };
    // The template reads SSM: launching it without credentials to store is refused, before
    // anything is launched.
    let out = up(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(64) && stderr.contains("--certs"), "{stderr}");
    assert!(rt.block_on(fleet.list()).unwrap().0.is_empty(), "nothing launched");

    let out = up(&["--certs", certs.to_str().unwrap(), "--secret-file", secret.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let launched: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<String> = launched.iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 2);
    let ssm = rt.block_on(async {
        let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .endpoint_url(&moto.url)
            .credentials_provider(aws_sdk_ec2::config::Credentials::new(
                "testing", "testing", None, None, "t",
            ))
            .load()
            .await;
        aws_sdk_ssm::Client::new(&shared)
    });
    let param = |name: String| {
        rt.block_on(ssm.get_parameter().name(&name).send()).ok().and_then(|o| o.parameter().cloned())
    };
    for id in &ids {
        // What any process on the host can read: no key, no secret.
        let attr = rt
            .block_on(
                fleet
                    .client()
                    .describe_instance_attribute()
                    .instance_id(id)
                    .attribute("userData".into())
                    .send(),
            )
            .unwrap();
        let b64 = attr.user_data().and_then(|u| u.value()).unwrap();
        let user_data = String::from_utf8(
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64).unwrap(),
        )
        .unwrap();
        assert!(user_data.contains("fetch-credentials"), "the shipped template was launched");
        assert!(!user_data.contains("PRIVATE KEY") && !user_data.contains("s3cr3t"), "{user_data}");
        let key = param(format!("/limpet/prod/nodes/{id}/key")).expect("the key is stored");
        assert_eq!(key.r#type(), Some(&aws_sdk_ssm::types::ParameterType::SecureString));
    }
    assert_eq!(
        param("/limpet/prod/secret".into()).unwrap().r#type(),
        Some(&aws_sdk_ssm::types::ParameterType::SecureString)
    );

    // The first host boots: its configuration as cloud-init writes it, with the host's files
    // under a directory of the test instead of /etc/limpet.
    let host = tmp.path().join("host");
    std::fs::create_dir_all(&host).unwrap();
    let rendered =
        limpet_deploy::render_user_data(&cloud_init_template(), &user_data_vars(&tmp.path().join("ck")))
            .unwrap();
    let host_config = |id: &str| {
        let path = host.join(format!("{id}.toml"));
        let text = config_in_user_data(&rendered, tmp.path())
            .replace("@NODE_NAME@", id)
            .replace("@PRIVATE_IP@", "10.0.0.7")
            .replace("/etc/limpet/", &format!("{}/{id}/", host.display()))
            .replace("/var/lib/limpet", &host.join(id).join("state").display().to_string());
        std::fs::write(&path, text).unwrap();
        path
    };
    let limpetd = |args: &[&str], config: &Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_limpetd"));
        c.args(args).arg("--config").arg(config).env("AWS_ENDPOINT_URL", &moto.url);
        aws(&mut c);
        c.output().unwrap()
    };
    let first = host_config(&ids[0]);
    let out = limpetd(&["fetch-credentials"], &first);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = host.join(&ids[0]);
    assert_eq!(std::fs::read(dir.join("secret")).unwrap(), b"s3cr3t-0123456789abcdef");
    let mode = std::fs::metadata(dir.join("tls/node.key")).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    assert!(
        param(format!("/limpet/prod/nodes/{}/key", ids[0])).is_none(),
        "the key's parameter is deleted once fetched"
    );
    // `validate` loads the certificate: bound to this host's node id, signed by the CA.
    let out = limpetd(&["validate"], &first);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cert = limpet_consensus::tls::Tls::load(&limpet_consensus::tls::TlsFiles {
        ca: dir.join("tls/ca.pem"),
        cert: dir.join("tls/node.pem"),
        key: dir.join("tls/node.key"),
    })
    .unwrap();
    assert_eq!(cert.node_id(), Some(limpet_consensus::state::node_id_of_name(&ids[0])));
    // A reboot: the files are there, nothing is fetched (the key's parameter is gone).
    let out = limpetd(&["fetch-credentials"], &first);
    assert!(String::from_utf8_lossy(&out.stdout).contains("already in place"), "{out:?}");

    // A host nobody issued credentials for waits, then says which parameter is missing.
    let stranger = host_config("i-0stranger");
    let out = limpetd(&["fetch-credentials", "--wait", "1s"], &stranger);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(64) && stderr.contains("/limpet/prod/nodes/i-0stranger/cert"),
        "{stderr}"
    );

    // Terminated hosts' credentials are deleted with them.
    let mut c = Command::new(exe());
    c.args([
        "fleet",
        "down",
        "--cluster",
        "prod",
        "--all",
        "--region",
        "us-east-1",
        "--endpoint-url",
        &moto.url,
    ]);
    aws(&mut c);
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for id in &ids {
        assert!(param(format!("/limpet/prod/nodes/{id}/cert")).is_none(), "{id}'s certificate is deleted");
        assert!(param(format!("/limpet/prod/nodes/{id}/key")).is_none(), "{id}'s key is deleted");
    }
}

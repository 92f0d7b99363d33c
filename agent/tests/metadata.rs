//! The fake metadata service behaves like the real ones (token flow, status codes, headers,
//! JSON shapes), and the revocation watchers read it: AWS through aws-config's IMDS client,
//! GCP and Azure over HTTP.

use limpet_agent::fake_metadata::FakeMetadata;
use limpet_agent::revocation::{Source, Watcher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[tokio::test]
async fn the_fake_follows_the_imdsv2_token_flow_and_the_other_clouds_headers() {
    let fake = FakeMetadata::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let http = reqwest::Client::new();
    let url = fake.url();
    let action = format!("{url}/latest/meta-data/spot/instance-action");
    // No token: 401. A token request without a TTL: 400.
    assert_eq!(http.get(&action).send().await.unwrap().status(), 401);
    assert_eq!(http.put(format!("{url}/latest/api/token")).send().await.unwrap().status(), 400);
    let token = http
        .put(format!("{url}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "21600")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let with = |u: &str| http.get(u).header("X-aws-ec2-metadata-token", token.as_str());
    assert_eq!(with(&action).send().await.unwrap().status(), 404, "no notice yet");
    assert_eq!(
        http.get(&action).header("X-aws-ec2-metadata-token", "forged").send().await.unwrap().status(),
        401
    );
    // GCP and Azure refuse requests without their headers.
    let gcp = format!("{url}/computeMetadata/v1/instance/preempted");
    assert_eq!(http.get(&gcp).send().await.unwrap().status(), 403);
    let azure = format!("{url}/metadata/scheduledevents?api-version=2020-07-01");
    assert_eq!(http.get(&azure).send().await.unwrap().status(), 400);

    fake.notice_in(Duration::from_secs(120));
    let v: serde_json::Value = with(&action).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["action"], "terminate");
    assert!(v["time"].as_str().unwrap().ends_with('Z'), "{v}");
    let body = http.get(&gcp).header("Metadata-Flavor", "Google").send().await.unwrap().text().await.unwrap();
    assert_eq!(body, "TRUE");
    let v: serde_json::Value =
        http.get(&azure).header("Metadata", "true").send().await.unwrap().json().await.unwrap();
    assert_eq!(v["Events"][0]["EventType"], "Preempt");
    assert!(v["Events"][0]["NotBefore"].as_str().unwrap().ends_with("GMT"), "{v}");
    fake.stop();
}

#[tokio::test]
async fn every_watcher_sees_no_notice_then_the_deadline() {
    let fake = FakeMetadata::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let sources = [
        Source::Aws { endpoint: fake.url() },
        Source::Gcp { endpoint: fake.url() },
        Source::Azure { endpoint: fake.url() },
    ];
    let watchers: Vec<Watcher> = sources.iter().cloned().map(|s| Watcher::new(s).unwrap()).collect();
    for w in &watchers {
        assert_eq!(w.poll().await.unwrap(), None);
    }
    let before = now_ms();
    fake.notice_in(Duration::from_secs(120));
    for (w, name) in watchers.iter().zip(["aws", "gcp", "azure"]) {
        let n = w.poll().await.unwrap().unwrap_or_else(|| panic!("{name} saw no notice"));
        assert_eq!(n.source, name);
        // AWS and Azure carry the time (to the second); GCP gives its standard 30 s.
        let expect = if name == "gcp" { before + 30_000 } else { before + 120_000 };
        assert!(n.deadline_ms.abs_diff(expect) < 2_500, "{name}: deadline {} vs {expect}", n.deadline_ms);
    }
    fake.stop();
}

#[tokio::test]
async fn an_unreachable_metadata_service_is_an_error_not_a_notice() {
    let w = Watcher::new(Source::Gcp { endpoint: "http://127.0.0.1:1".into() }).unwrap();
    let err = w.poll().await.unwrap_err();
    assert!(err.to_string().contains("gcp metadata at http://127.0.0.1:1"), "{err}");
}

//! The fake metadata service behaves like the real ones (token flow, status codes, headers,
//! JSON shapes), and the revocation watchers read it: AWS through aws-config's IMDS client,
//! GCP and Azure over HTTP.

use limpet_agent::revocation::{azure_preemption, detect, Endpoints, Source, Watcher};
use limpet_lab::fake_metadata::{Cloud, FakeMetadata};
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

#[tokio::test]
async fn an_azure_event_for_another_vm_of_the_set_does_not_drain_this_one() {
    let fake = FakeMetadata::start_as("127.0.0.1:0".parse().unwrap(), Cloud::Azure).await.unwrap();
    let w = Watcher::new(Source::Azure { endpoint: fake.url() }).unwrap();
    fake.notice_for("limpet-vm-2", Duration::from_secs(60));
    fake.notice_for("other-set-member", Duration::from_secs(30));
    assert_eq!(w.poll().await.unwrap(), None, "the document names only other VMs");
    let before = now_ms();
    fake.notice_in(Duration::from_secs(90));
    let n = w.poll().await.unwrap().expect("this VM's own event");
    assert!(
        n.deadline_ms.abs_diff(before + 90_000) < 2_500,
        "{n:?}: the own event's NotBefore, not a neighbour's"
    );
    fake.stop();
}

#[test]
fn a_multi_vm_event_document_is_read_for_this_vm_only() {
    let doc = serde_json::json!({"DocumentIncarnation": 3, "Events": [
        {"EventId": "a", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["web_IN_0", "web_IN_1"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"},
        {"EventId": "b", "EventType": "Reboot", "ResourceType": "VirtualMachine",
         "Resources": ["trainer_IN_2"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:20:00 GMT"},
        {"EventId": "c", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["Trainer_IN_2", "web_IN_1"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:31:00 GMT"},
    ]});
    let t = |s: &str| httpdate::parse_http_date(s).unwrap();
    assert_eq!(azure_preemption(&doc, "web_IN_0").unwrap(), Some(t("Mon, 19 Sep 2016 18:29:47 GMT")));
    assert_eq!(azure_preemption(&doc, "web_IN_1").unwrap(), Some(t("Mon, 19 Sep 2016 18:29:47 GMT")));
    // Names compare without case; a Reboot is not a preemption.
    assert_eq!(azure_preemption(&doc, "trainer_in_2").unwrap(), Some(t("Mon, 19 Sep 2016 18:31:00 GMT")));
    assert_eq!(azure_preemption(&doc, "db_IN_0").unwrap(), None);
    let started =
        serde_json::json!({"Events": [{"EventType": "Preempt", "Resources": ["x"], "NotBefore": ""}]});
    let now = SystemTime::now();
    assert!(azure_preemption(&started, "x").unwrap().unwrap() >= now, "a started event is now");
    let broken = serde_json::json!({"Events": [{"EventType": "Preempt", "NotBefore": ""}]});
    assert!(azure_preemption(&broken, "x").unwrap_err().contains("without Resources"));
}

#[tokio::test]
async fn detection_finds_the_one_cloud_that_answers_and_not_a_plain_web_server() {
    // A web server that answers anything with 200 is none of the clouds.
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_url = format!("http://{}", plain.local_addr().unwrap());
    let app = axum::Router::new().fallback(|| async { "hello" });
    tokio::spawn(async move { axum::serve(plain, app).await.unwrap() });
    for cloud in [Cloud::Aws, Cloud::Gcp, Cloud::Azure] {
        let fake = FakeMetadata::start_as("127.0.0.1:0".parse().unwrap(), cloud).await.unwrap();
        let at = |c: Cloud| if c == cloud { fake.url() } else { plain_url.clone() };
        let ends = Endpoints { aws: at(Cloud::Aws), gcp: at(Cloud::Gcp), azure: at(Cloud::Azure) };
        let probes = detect(&ends, Duration::from_secs(1)).await;
        let found: Vec<&str> = probes.iter().filter(|p| p.source.is_some()).map(|p| p.cloud).collect();
        let want = match cloud {
            Cloud::Aws => "aws",
            Cloud::Gcp => "gcp",
            _ => "azure",
        };
        assert_eq!(found, [want], "{probes:?}");
        // The same fake at every endpoint: the other clouds' paths 404 there.
        let same = Endpoints { aws: fake.url(), gcp: fake.url(), azure: fake.url() };
        let found: Vec<&str> = detect(&same, Duration::from_secs(1))
            .await
            .into_iter()
            .filter(|p| p.source.is_some())
            .map(|p| p.cloud)
            .collect();
        assert_eq!(found, [want]);
        fake.stop();
    }
}

#[tokio::test]
async fn detection_is_bounded_when_nothing_answers() {
    // A listener that accepts and never answers: each probe gives up at the timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let ends = Endpoints { aws: url.clone(), gcp: url.clone(), azure: url };
    let probes = detect(&ends, Duration::from_millis(300)).await;
    assert!(probes.iter().all(|p| p.source.is_none()), "{probes:?}");
    assert_eq!(probes.len(), 3);
    drop(silent);
}

//! A fake cloud metadata service for local clusters and tests: one HTTP server that answers
//! like AWS's IMDSv2, GCP's metadata server and Azure's Scheduled Events, and lets a test or
//! `limpet revoke` post a revocation notice to it. Real clouds cannot run here; this one keeps
//! their status codes, token flow, headers and JSON shapes:
//!
//! | cloud | request | before a notice | after |
//! |---|---|---|---|
//! | AWS | `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` (1-21600) | token | token |
//! | AWS | `GET /latest/meta-data/spot/instance-action` with `X-aws-ec2-metadata-token` | 404 | `{"action":"terminate","time":"2026-11-22T08:22:00Z"}` |
//! | AWS | `GET /latest/meta-data/events/recommendations/rebalance` | 404 | `{"noticeTime":"..."}` |
//! | GCP | `GET /computeMetadata/v1/instance/id` with `Metadata-Flavor: Google` | the id | the id |
//! | GCP | `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` | `FALSE` | `TRUE` |
//! | Azure | `GET /metadata/instance/compute?api-version=...` with `Metadata: true` | `{"name":..,"azEnvironment":..}` | same |
//! | Azure | `GET /metadata/instance/compute/name?api-version=...&format=text` | the VM's name | same |
//! | Azure | `GET /metadata/scheduledevents?api-version=...` with `Metadata: true` | no events | one `Preempt` event |
//!
//! AWS answers 401 to a missing or unknown token and 400 to a token request without a TTL;
//! GCP answers 403 without its header; Azure 400 without its header. The control endpoint
//! `POST /_limpet/notice` with `{"in_secs": N}` schedules the notice on all three; with
//! `"resource": "vm"` it schedules a Scheduled Event for another VM of the availability set
//! (in the same document, as Azure lists every VM's events to each).
//!
//! `start` answers as all three clouds (local clusters name the source they use);
//! `start_as` answers as one, the others' paths 404 as on a real host of that cloud.

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

#[derive(Default)]
struct Inner {
    tokens: HashSet<String>,
    notice_at: Option<SystemTime>,
    /// Azure Scheduled Events for other VMs (name, NotBefore).
    others: Vec<(String, SystemTime)>,
    next_token: u64,
    incarnation: u64,
}

/// This VM's name in the fake Azure metadata.
pub const AZURE_VM_NAME: &str = "limpet-vm";

/// Which cloud the fake answers as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cloud {
    /// AWS's IMDSv2 only.
    Aws,
    /// GCP's metadata server only.
    Gcp,
    /// Azure's IMDS only.
    Azure,
    /// All three at once.
    All,
}

/// A running fake metadata service.
pub struct FakeMetadata {
    addr: SocketAddr,
    state: Arc<Mutex<Inner>>,
    stop: tokio::sync::oneshot::Sender<()>,
}

type Shared = Arc<Mutex<Inner>>;

impl FakeMetadata {
    /// Serves on `addr` (port 0 picks one) from the current tokio runtime.
    pub async fn start(addr: SocketAddr) -> std::io::Result<FakeMetadata> {
        FakeMetadata::start_as(addr, Cloud::All).await
    }

    /// Serves as `cloud` only on `addr`.
    pub async fn start_as(addr: SocketAddr, cloud: Cloud) -> std::io::Result<FakeMetadata> {
        let state: Shared = Arc::default();
        let mut app = Router::new().route("/_limpet/notice", post(post_notice));
        if matches!(cloud, Cloud::Aws | Cloud::All) {
            app = app
                .route("/latest/api/token", put(aws_token))
                .route("/latest/meta-data/spot/instance-action", get(aws_instance_action))
                .route("/latest/meta-data/events/recommendations/rebalance", get(aws_rebalance));
        }
        if matches!(cloud, Cloud::Gcp | Cloud::All) {
            app = app
                .route("/computeMetadata/v1/instance/id", get(gcp_id))
                .route("/computeMetadata/v1/instance/preempted", get(gcp_preempted));
        }
        if matches!(cloud, Cloud::Azure | Cloud::All) {
            app = app
                .route("/metadata/instance/compute", get(azure_compute))
                .route("/metadata/instance/compute/name", get(azure_name))
                .route("/metadata/scheduledevents", get(azure_events));
        }
        let app = app.with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(FakeMetadata { addr, state, stop })
    }

    /// The base URL (`http://host:port`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Schedules the revocation `after` from now (as the control endpoint does).
    pub fn notice_in(&self, after: Duration) {
        let mut s = self.state.lock().expect("fake metadata lock");
        s.notice_at = Some(SystemTime::now() + after);
        s.incarnation += 1;
    }

    /// Schedules an Azure Scheduled Event `Preempt` for another VM, `vm`, `after` from now.
    pub fn notice_for(&self, vm: &str, after: Duration) {
        let mut s = self.state.lock().expect("fake metadata lock");
        s.others.push((vm.to_string(), SystemTime::now() + after));
        s.incarnation += 1;
    }

    /// Stops serving.
    pub fn stop(self) {
        let _ = self.stop.send(());
    }
}

fn notice(state: &Shared) -> Option<SystemTime> {
    state.lock().expect("fake metadata lock").notice_at
}

async fn aws_token(State(state): State<Shared>, headers: HeaderMap) -> Response {
    let ttl = headers
        .get("x-aws-ec2-metadata-token-ttl-seconds")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match ttl {
        Some(1..=21600) => {
            let mut s = state.lock().expect("fake metadata lock");
            s.next_token += 1;
            let token = format!("fake-imds-token-{}", s.next_token);
            s.tokens.insert(token.clone());
            ([("x-aws-ec2-metadata-token-ttl-seconds", ttl.unwrap_or(0).to_string())], token).into_response()
        }
        _ => (StatusCode::BAD_REQUEST, "").into_response(),
    }
}

fn aws_authorized(state: &Shared, headers: &HeaderMap) -> bool {
    let token = headers.get("x-aws-ec2-metadata-token").and_then(|v| v.to_str().ok());
    token.is_some_and(|t| state.lock().expect("fake metadata lock").tokens.contains(t))
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

async fn aws_instance_action(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if !aws_authorized(&state, &headers) {
        return (StatusCode::UNAUTHORIZED, "").into_response();
    }
    match notice(&state) {
        Some(t) => Json(serde_json::json!({"action": "terminate", "time": rfc3339(t)})).into_response(),
        None => (StatusCode::NOT_FOUND, "").into_response(),
    }
}

async fn aws_rebalance(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if !aws_authorized(&state, &headers) {
        return (StatusCode::UNAUTHORIZED, "").into_response();
    }
    match notice(&state) {
        Some(_) => Json(serde_json::json!({"noticeTime": rfc3339(SystemTime::now())})).into_response(),
        None => (StatusCode::NOT_FOUND, "").into_response(),
    }
}

fn gcp_flavored(headers: &HeaderMap) -> bool {
    headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) == Some("Google")
}

async fn gcp_id(headers: HeaderMap) -> Response {
    if !gcp_flavored(&headers) {
        return (StatusCode::FORBIDDEN, "Missing Metadata-Flavor:Google header.").into_response();
    }
    ([("metadata-flavor", "Google")], "4520031799277581759").into_response()
}

async fn gcp_preempted(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if !gcp_flavored(&headers) {
        return (StatusCode::FORBIDDEN, "Missing Metadata-Flavor:Google header.").into_response();
    }
    let preempted = notice(&state).is_some();
    ([("metadata-flavor", "Google")], if preempted { "TRUE" } else { "FALSE" }).into_response()
}

/// Azure's refusals: 400 without the `Metadata: true` header or without an `api-version`.
fn azure_refusal(headers: &HeaderMap, q: &HashMap<String, String>) -> Option<Response> {
    let refuse = |why: &str| {
        Some(
            (StatusCode::BAD_REQUEST, Json(serde_json::json!({"error": format!("Bad request. {why}")})))
                .into_response(),
        )
    };
    if headers.get("metadata").and_then(|v| v.to_str().ok()) != Some("true") {
        return refuse("Required metadata header not specified");
    }
    if !q.contains_key("api-version") {
        return refuse("api-version was not specified");
    }
    None
}

async fn azure_compute(headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    if let Some(r) = azure_refusal(&headers, &q) {
        return r;
    }
    Json(serde_json::json!({
        "azEnvironment": "AzurePublicCloud",
        "location": "westeurope",
        "name": AZURE_VM_NAME,
        "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
        "vmSize": "Standard_NC24ads_A100_v4",
        "priority": "Spot",
    }))
    .into_response()
}

async fn azure_name(headers: HeaderMap, Query(q): Query<HashMap<String, String>>) -> Response {
    if let Some(r) = azure_refusal(&headers, &q) {
        return r;
    }
    if q.get("format").map(String::as_str) == Some("text") {
        AZURE_VM_NAME.into_response()
    } else {
        Json(AZURE_VM_NAME).into_response()
    }
}

fn azure_event(id: String, vm: &str, t: SystemTime) -> serde_json::Value {
    serde_json::json!({
        "EventId": id,
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": [vm],
        "EventStatus": "Scheduled",
        "NotBefore": httpdate::fmt_http_date(t),
        "Description": "Virtual machine is being preempted.",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    })
}

async fn azure_events(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Some(r) = azure_refusal(&headers, &q) {
        return r;
    }
    let s = state.lock().expect("fake metadata lock");
    let mut events: Vec<serde_json::Value> = s
        .others
        .iter()
        .enumerate()
        .map(|(i, (vm, t))| azure_event(format!("fake-other-{i}"), vm, *t))
        .collect();
    if let Some(t) = s.notice_at {
        events.push(azure_event(format!("fake-{}", s.incarnation), AZURE_VM_NAME, t));
    }
    Json(serde_json::json!({"DocumentIncarnation": s.incarnation, "Events": events})).into_response()
}

#[derive(serde::Deserialize)]
struct NoticeRequest {
    in_secs: u64,
    /// Another Azure VM the event is for (absent: this host).
    resource: Option<String>,
}

async fn post_notice(State(state): State<Shared>, Json(req): Json<NoticeRequest>) -> Response {
    let mut s = state.lock().expect("fake metadata lock");
    let at = SystemTime::now() + Duration::from_secs(req.in_secs);
    match req.resource {
        Some(vm) => s.others.push((vm, at)),
        None => s.notice_at = Some(at),
    }
    s.incarnation += 1;
    (StatusCode::OK, "").into_response()
}

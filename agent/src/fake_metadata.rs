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
//! | GCP | `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` | `FALSE` | `TRUE` |
//! | Azure | `GET /metadata/scheduledevents?api-version=...` with `Metadata: true` | no events | one `Preempt` event |
//!
//! AWS answers 401 to a missing or unknown token and 400 to a token request without a TTL;
//! GCP answers 403 without its header; Azure 400 without its header. The control endpoint
//! `POST /_limpet/notice` with `{"in_secs": N}` schedules the notice on all three.

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
    next_token: u64,
    incarnation: u64,
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
        let state: Shared = Arc::default();
        let app = Router::new()
            .route("/latest/api/token", put(aws_token))
            .route("/latest/meta-data/spot/instance-action", get(aws_instance_action))
            .route("/latest/meta-data/events/recommendations/rebalance", get(aws_rebalance))
            .route("/computeMetadata/v1/instance/preempted", get(gcp_preempted))
            .route("/metadata/scheduledevents", get(azure_events))
            .route("/_limpet/notice", post(post_notice))
            .with_state(Arc::clone(&state));
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

async fn gcp_preempted(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return (StatusCode::FORBIDDEN, "Missing Metadata-Flavor:Google header.").into_response();
    }
    let preempted = notice(&state).is_some();
    ([("metadata-flavor", "Google")], if preempted { "TRUE" } else { "FALSE" }).into_response()
}

async fn azure_events(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if headers.get("metadata").and_then(|v| v.to_str().ok()) != Some("true") {
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": "Bad request. Required metadata header not specified"})),
        )
            .into_response();
    }
    if !q.contains_key("api-version") {
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": "Bad request. api-version was not specified"})),
        )
            .into_response();
    }
    let s = state.lock().expect("fake metadata lock");
    let events = match s.notice_at {
        Some(t) => serde_json::json!([{
            "EventId": format!("fake-{}", s.incarnation),
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["limpet-vm"],
            "EventStatus": "Scheduled",
            "NotBefore": httpdate::fmt_http_date(t),
            "Description": "Virtual machine is being preempted.",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }]),
        None => serde_json::json!([]),
    };
    Json(serde_json::json!({"DocumentIncarnation": s.incarnation, "Events": events})).into_response()
}

#[derive(serde::Deserialize)]
struct NoticeRequest {
    in_secs: u64,
}

async fn post_notice(State(state): State<Shared>, Json(req): Json<NoticeRequest>) -> Response {
    let mut s = state.lock().expect("fake metadata lock");
    s.notice_at = Some(SystemTime::now() + Duration::from_secs(req.in_secs));
    s.incarnation += 1;
    (StatusCode::OK, "").into_response()
}

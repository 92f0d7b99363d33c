//! Revocation sources: ask a cloud's metadata service whether this host is being taken back,
//! and when. Every source gives the same answer, *this node leaves by deadline T*, which the
//! agent turns into a `Notice` command.
//!
//! - AWS: IMDSv2 through aws-config's IMDS client (it does the token PUT and retries);
//!   `spot/instance-action` (404 means no notice) and the rebalance recommendation, which
//!   carries no deadline (taken as the standard two minutes from now);
//! - GCP: `instance/preempted` (`TRUE` means preempted now: GCP gives 30 seconds);
//! - Azure: Scheduled Events with an `EventType` of `Preempt` and its `NotBefore` time.
//!
//! Endpoints are configurable so local clusters and tests point them at `FakeMetadata`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A revocation notice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// When the host goes away, unix milliseconds.
    pub deadline_ms: u64,
    /// Which source saw it (`aws`, `aws-rebalance`, `gcp`, `azure`).
    pub source: &'static str,
}

/// Where to look.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// AWS IMDSv2 at this endpoint (`http://169.254.169.254` on EC2).
    Aws {
        /// Base URL.
        endpoint: String,
    },
    /// GCP metadata server (`http://metadata.google.internal`).
    Gcp {
        /// Base URL.
        endpoint: String,
    },
    /// Azure Instance Metadata Service (`http://169.254.169.254`).
    Azure {
        /// Base URL.
        endpoint: String,
    },
}

/// Why a source could not be read (the agent logs it and tries again next poll).
#[derive(Debug, thiserror::Error)]
#[error("{source_name} metadata at {endpoint}: {detail}")]
pub struct WatchError {
    /// Which source.
    pub source_name: &'static str,
    /// Where.
    pub endpoint: String,
    /// What happened.
    pub detail: String,
}

/// AWS's warning time for spot interruptions, used when only a rebalance recommendation is seen.
pub const AWS_NOTICE: Duration = Duration::from_secs(120);
/// GCP's preemption warning.
pub const GCP_NOTICE: Duration = Duration::from_secs(30);

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A watcher that keeps its clients between polls.
pub struct Watcher {
    source: Source,
    http: reqwest::Client,
    imds: Option<aws_config::imds::Client>,
}

impl Watcher {
    /// Prepares a watcher for `source`.
    pub fn new(source: Source) -> Result<Watcher, WatchError> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().map_err(|e| {
            WatchError { source_name: "http", endpoint: String::new(), detail: e.to_string() }
        })?;
        let imds = match &source {
            Source::Aws { endpoint } => Some(
                aws_config::imds::Client::builder()
                    .endpoint(endpoint.as_str())
                    .map_err(|e| WatchError {
                        source_name: "aws",
                        endpoint: endpoint.clone(),
                        detail: e.to_string(),
                    })?
                    .connect_timeout(Duration::from_secs(1))
                    .read_timeout(Duration::from_secs(2))
                    .max_attempts(2)
                    .build(),
            ),
            _ => None,
        };
        Ok(Watcher { source, http, imds })
    }

    /// Asks once; `Ok(None)` means no notice.
    pub async fn poll(&self) -> Result<Option<Notice>, WatchError> {
        match &self.source {
            Source::Aws { endpoint } => self.poll_aws(endpoint).await,
            Source::Gcp { endpoint } => self.poll_gcp(endpoint).await,
            Source::Azure { endpoint } => self.poll_azure(endpoint).await,
        }
    }

    async fn imds_get(&self, endpoint: &str, path: &str) -> Result<Option<String>, WatchError> {
        let client = self.imds.as_ref().expect("aws watcher has an IMDS client");
        match client.get(path).await {
            Ok(body) => Ok(Some(body.as_ref().to_string())),
            Err(aws_config::imds::client::error::ImdsError::ErrorResponse(r))
                if r.response().status().as_u16() == 404 =>
            {
                Ok(None)
            }
            Err(e) => Err(WatchError {
                source_name: "aws",
                endpoint: endpoint.to_string(),
                detail: format!("{path}: {e}"),
            }),
        }
    }

    async fn poll_aws(&self, endpoint: &str) -> Result<Option<Notice>, WatchError> {
        let bad = |d: String| WatchError { source_name: "aws", endpoint: endpoint.to_string(), detail: d };
        if let Some(body) = self.imds_get(endpoint, "/latest/meta-data/spot/instance-action").await? {
            let v: serde_json::Value =
                serde_json::from_str(&body).map_err(|e| bad(format!("instance-action {body:?}: {e}")))?;
            let time =
                v["time"].as_str().ok_or_else(|| bad(format!("instance-action without a time: {body}")))?;
            let t = humantime::parse_rfc3339_weak(time).map_err(|e| bad(format!("time {time:?}: {e}")))?;
            return Ok(Some(Notice { deadline_ms: ms(t), source: "aws" }));
        }
        if self.imds_get(endpoint, "/latest/meta-data/events/recommendations/rebalance").await?.is_some() {
            return Ok(Some(Notice {
                deadline_ms: ms(SystemTime::now() + AWS_NOTICE),
                source: "aws-rebalance",
            }));
        }
        Ok(None)
    }

    async fn poll_gcp(&self, endpoint: &str) -> Result<Option<Notice>, WatchError> {
        let bad = |d: String| WatchError { source_name: "gcp", endpoint: endpoint.to_string(), detail: d };
        let url = format!("{endpoint}/computeMetadata/v1/instance/preempted");
        let r = self
            .http
            .get(&url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .map_err(|e| bad(e.to_string()))?;
        if !r.status().is_success() {
            return Err(bad(format!("status {}", r.status())));
        }
        let body = r.text().await.map_err(|e| bad(e.to_string()))?;
        match body.trim() {
            "TRUE" => Ok(Some(Notice { deadline_ms: ms(SystemTime::now() + GCP_NOTICE), source: "gcp" })),
            "FALSE" => Ok(None),
            other => Err(bad(format!("preempted is {other:?}, not TRUE or FALSE"))),
        }
    }

    async fn poll_azure(&self, endpoint: &str) -> Result<Option<Notice>, WatchError> {
        let bad = |d: String| WatchError { source_name: "azure", endpoint: endpoint.to_string(), detail: d };
        let url = format!("{endpoint}/metadata/scheduledevents?api-version=2020-07-01");
        let r =
            self.http.get(&url).header("Metadata", "true").send().await.map_err(|e| bad(e.to_string()))?;
        if !r.status().is_success() {
            return Err(bad(format!("status {}", r.status())));
        }
        let v: serde_json::Value = r.json().await.map_err(|e| bad(e.to_string()))?;
        let events = v["Events"].as_array().ok_or_else(|| bad("no Events array".into()))?;
        let soonest = events
            .iter()
            .filter(|e| e["EventType"] == "Preempt")
            .filter_map(|e| e["NotBefore"].as_str())
            .filter_map(|t| httpdate::parse_http_date(t).ok())
            .min();
        Ok(soonest.map(|t| Notice { deadline_ms: ms(t), source: "azure" }))
    }
}

//! Revocation sources: ask a cloud's metadata service whether this host is being taken back,
//! and when. Every source gives the same answer, *this node leaves by deadline T*, which the
//! agent turns into a `Notice` command.
//!
//! - AWS: IMDSv2 through aws-config's IMDS client (it does the token PUT and retries);
//!   `spot/instance-action` (404 means no notice) and the rebalance recommendation, which
//!   carries no deadline (taken as the standard two minutes from now);
//! - GCP: `instance/preempted` (`TRUE` means preempted now: GCP gives 30 seconds);
//! - Azure: Scheduled Events with an `EventType` of `Preempt` naming this VM among its
//!   `Resources` (the document lists every VM of the availability set or scale set, so an
//!   event for a neighbour must not drain this one), and its `NotBefore` time. The VM's own
//!   name comes from the instance metadata's `compute/name`, read once.
//!
//! `detect` finds which of the three answers here (the default, `sources = "auto"`).
//! Endpoints are configurable so local clusters and tests point them at `FakeMetadata`.

mod detect;
pub use detect::{detect, Endpoints, Probe};

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

impl Source {
    /// `aws`, `gcp` or `azure`.
    pub fn cloud(&self) -> &'static str {
        match self {
            Source::Aws { .. } => "aws",
            Source::Gcp { .. } => "gcp",
            Source::Azure { .. } => "azure",
        }
    }

    /// The metadata base URL.
    pub fn endpoint(&self) -> &str {
        match self {
            Source::Aws { endpoint } | Source::Gcp { endpoint } | Source::Azure { endpoint } => endpoint,
        }
    }
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
    /// This VM's name in Azure's metadata (learned on the first Azure poll).
    azure_name: tokio::sync::OnceCell<String>,
}

/// An HTTP client for a link-local metadata service: never through a proxy (a proxy from
/// the environment cannot reach this host's metadata, or worse, reaches another's).
pub(crate) fn metadata_http(timeout: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(timeout.min(Duration::from_secs(1)))
        .timeout(timeout)
        .build()
}

/// Azure's instance metadata API version (the one that has `compute/name`).
pub(crate) const AZURE_INSTANCE_API: &str = "2021-02-01";

impl Watcher {
    /// Prepares a watcher for `source`.
    pub fn new(source: Source) -> Result<Watcher, WatchError> {
        let http = metadata_http(Duration::from_secs(2)).map_err(|e| WatchError {
            source_name: "http",
            endpoint: String::new(),
            detail: e.to_string(),
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
        Ok(Watcher { source, http, imds, azure_name: tokio::sync::OnceCell::new() })
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
        let name = self.azure_name.get_or_try_init(|| self.azure_vm_name(endpoint)).await?;
        let url = format!("{endpoint}/metadata/scheduledevents?api-version=2020-07-01");
        let r =
            self.http.get(&url).header("Metadata", "true").send().await.map_err(|e| bad(e.to_string()))?;
        if !r.status().is_success() {
            return Err(bad(format!("status {}", r.status())));
        }
        let v: serde_json::Value = r.json().await.map_err(|e| bad(e.to_string()))?;
        let soonest = azure_preemption(&v, name).map_err(bad)?;
        Ok(soonest.map(|t| Notice { deadline_ms: ms(t), source: "azure" }))
    }

    async fn azure_vm_name(&self, endpoint: &str) -> Result<String, WatchError> {
        let bad = |d: String| WatchError { source_name: "azure", endpoint: endpoint.to_string(), detail: d };
        let url =
            format!("{endpoint}/metadata/instance/compute/name?api-version={AZURE_INSTANCE_API}&format=text");
        let r =
            self.http.get(&url).header("Metadata", "true").send().await.map_err(|e| bad(e.to_string()))?;
        if !r.status().is_success() {
            return Err(bad(format!("this VM's name (compute/name): status {}", r.status())));
        }
        let name = r.text().await.map_err(|e| bad(e.to_string()))?.trim().to_string();
        if name.is_empty() {
            return Err(bad("this VM's name (compute/name) is empty".into()));
        }
        Ok(name)
    }
}

/// The soonest `NotBefore` of the `Preempt` events in a Scheduled Events document that list
/// `vm` among their `Resources` (Azure names compare without regard to case). An event for
/// other VMs only is not this one's.
pub fn azure_preemption(doc: &serde_json::Value, vm: &str) -> Result<Option<SystemTime>, String> {
    let events = doc["Events"].as_array().ok_or("no Events array")?;
    let mut soonest: Option<SystemTime> = None;
    for e in events.iter().filter(|e| e["EventType"] == "Preempt") {
        let resources =
            e["Resources"].as_array().ok_or_else(|| format!("Preempt event without Resources: {e}"))?;
        if !resources.iter().filter_map(|r| r.as_str()).any(|r| r.eq_ignore_ascii_case(vm)) {
            continue;
        }
        let at = e["NotBefore"].as_str().ok_or_else(|| format!("Preempt event without NotBefore: {e}"))?;
        // Azure leaves NotBefore empty once the event has started: it is happening now.
        let t = if at.is_empty() {
            SystemTime::now()
        } else {
            httpdate::parse_http_date(at).map_err(|err| format!("NotBefore {at:?}: {err}"))?
        };
        soonest = Some(soonest.map_or(t, |s| s.min(t)));
    }
    Ok(soonest)
}

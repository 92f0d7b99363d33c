//! Which cloud is this? One short probe per cloud, all at once, each bounded by a timeout,
//! so `sources = "auto"` costs at most that long at startup and finds the metadata service
//! the host really has:
//!
//! - AWS: the IMDSv2 token `PUT` answers with a token and its TTL header;
//! - GCP: `instance/id` answers with the `Metadata-Flavor: Google` header;
//! - Azure: `instance/compute` answers JSON with an `azEnvironment`.
//!
//! Each probe checks what only that cloud's service says, so a web server that happens to
//! answer on the address (or the other cloud on the same link-local address) is not taken
//! for it.

use super::{metadata_http, Source, AZURE_INSTANCE_API};
use std::time::Duration;

/// The metadata endpoints to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    /// AWS IMDS base URL.
    pub aws: String,
    /// GCP metadata base URL.
    pub gcp: String,
    /// Azure IMDS base URL.
    pub azure: String,
}

/// What one probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `aws`, `gcp` or `azure`.
    pub cloud: &'static str,
    /// The source to watch, when this cloud answered.
    pub source: Option<Source>,
    /// What was seen (the answer, or why it is not this cloud).
    pub detail: String,
}

/// Probes the three clouds at once, each within `timeout`.
pub async fn detect(at: &Endpoints, timeout: Duration) -> Vec<Probe> {
    let http = match metadata_http(timeout) {
        Ok(h) => h,
        Err(e) => {
            return ["aws", "gcp", "azure"]
                .map(|cloud| Probe { cloud, source: None, detail: format!("no HTTP client: {e}") })
                .to_vec()
        }
    };
    let (aws, gcp, azure) =
        tokio::join!(probe_aws(&http, &at.aws), probe_gcp(&http, &at.gcp), probe_azure(&http, &at.azure));
    let probe = |cloud, r: Result<String, String>, source: Source| match r {
        Ok(detail) => Probe { cloud, source: Some(source), detail },
        Err(detail) => Probe { cloud, source: None, detail },
    };
    vec![
        probe("aws", aws, Source::Aws { endpoint: at.aws.clone() }),
        probe("gcp", gcp, Source::Gcp { endpoint: at.gcp.clone() }),
        probe("azure", azure, Source::Azure { endpoint: at.azure.clone() }),
    ]
}

async fn probe_aws(http: &reqwest::Client, endpoint: &str) -> Result<String, String> {
    let r = http
        .put(format!("{endpoint}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    // IMDS echoes the token's lifetime; a web server that answers anything does not.
    let ttl = r.headers().contains_key("x-aws-ec2-metadata-token-ttl-seconds");
    let token = r.text().await.map_err(|e| e.to_string())?;
    if !status.is_success() || !ttl || token.trim().is_empty() {
        return Err(format!("the IMDSv2 token request answered {status} without a token TTL"));
    }
    Ok(format!("IMDSv2 at {endpoint} issued a token"))
}

async fn probe_gcp(http: &reqwest::Client, endpoint: &str) -> Result<String, String> {
    let r = http
        .get(format!("{endpoint}/computeMetadata/v1/instance/id"))
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let flavor = r.headers().get("metadata-flavor").and_then(|v| v.to_str().ok()).map(str::to_string);
    if !r.status().is_success() || flavor.as_deref() != Some("Google") {
        return Err(format!("instance/id answered {} without Metadata-Flavor: Google", r.status()));
    }
    let id = r.text().await.map_err(|e| e.to_string())?;
    Ok(format!("metadata server at {endpoint}, instance {}", id.trim()))
}

async fn probe_azure(http: &reqwest::Client, endpoint: &str) -> Result<String, String> {
    let r = http
        .get(format!("{endpoint}/metadata/instance/compute?api-version={AZURE_INSTANCE_API}"))
        .header("Metadata", "true")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let v: serde_json::Value =
        r.json().await.map_err(|e| format!("instance/compute answered {status}: {e}"))?;
    match (status.is_success(), v["azEnvironment"].as_str(), v["name"].as_str()) {
        (true, Some(env), Some(name)) => Ok(format!("IMDS at {endpoint}, VM {name} in {env}")),
        _ => Err(format!("instance/compute answered {status} without azEnvironment")),
    }
}

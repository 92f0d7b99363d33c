//! `DIR/cluster.json`: the description of a local cluster on loopback (`limpet-lab local
//! up`, the demo, the multi-process tests) through which `limpet status/drain/revoke --dir
//! DIR` reach it, and the spot notice `limpet revoke` posts to a node's metadata service.

use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One node of a local cluster.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LocalNode {
    /// Name.
    pub name: String,
    /// Raft id.
    pub id: u64,
    /// Control (consensus) address.
    pub control: String,
    /// Data-plane address.
    pub data: String,
    /// Its fake metadata service's base URL.
    pub metadata: String,
    /// Its Prometheus endpoint (`http://ADDR/metrics`).
    #[serde(default)]
    pub metrics: String,
    /// Its configuration file.
    pub config: PathBuf,
    /// Its log file (stderr and stdout).
    pub log: PathBuf,
    /// Its step log.
    pub step_log: PathBuf,
    /// Process id of its limpetd.
    pub pid: u32,
    /// Process id of its fake metadata service.
    pub metadata_pid: u32,
    /// The network namespace it runs in, if not the machine's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
}

/// `DIR/cluster.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClusterFile {
    /// Cluster name.
    pub cluster: String,
    /// Every node ever started, in order.
    pub nodes: Vec<LocalNode>,
    /// The operator certificate `limpet status/drain/revoke --dir` use, when the cluster
    /// runs with certificates.
    #[serde(default)]
    pub operator_tls: Option<limpet_consensus::tls::TlsFiles>,
}

impl ClusterFile {
    /// Reads `dir/cluster.json`.
    pub fn load(dir: &Path) -> crate::Result<ClusterFile> {
        let path = dir.join("cluster.json");
        let text = std::fs::read(&path).map_err(|e| {
            crate::UsageError(format!("{}: {e} (is a local cluster up there?)", path.display()))
        })?;
        serde_json::from_slice(&text).map_err(|e| {
            crate::UsageError(format!("{} is not a cluster description: {e}", path.display())).into()
        })
    }

    /// Control addresses of every node, for clients.
    pub fn control_addrs(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.control.clone()).collect()
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> crate::Result<&LocalNode> {
        self.nodes.iter().find(|n| n.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
            crate::Failure::msg(format!("no node {name:?} in this cluster (nodes: {})", names.join(", ")))
        })
    }
}

/// Posts a spot notice to a fake metadata service: the node's own watcher sees it through
/// the real IMDSv2 flow.
pub fn post_notice(metadata_url: &str, in_secs: u64) -> crate::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{metadata_url}/_limpet/notice"))
            .json(&serde_json::json!({ "in_secs": in_secs }))
            .send()
            .await
            .with_context(|| format!("posting a notice to {metadata_url}"))?;
        if !r.status().is_success() {
            crate::fail!("{metadata_url} answered {}", r.status());
        }
        Ok(())
    })
}

//! `limpet status`: the cluster seen through any node's consensus
//! endpoint. The status document (`--json`) is versioned and documented in
//! `docs/status.md`; fields are only ever added.
//!
//! This module asks the cluster (where it is, connecting to a node, fetching its state and
//! reports); its child module `render` shapes the answer into the status document and shows
//! it.

#[cfg(feature = "lab")]
use crate::cluster_file::ClusterFile;
use crate::UsageError;
use clap::Args;
use limpet_consensus::tls::{Tls, TlsFiles};
use limpet_consensus::Client;
use std::path::PathBuf;
use std::time::Duration;

mod render;
use render::build;
pub use render::{
    render, transitions_table, CheckpointDoc, EpochDoc, NodeDoc, StatusDoc, TransitionDoc, STATUS_VERSION,
};

/// Where the cluster is.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// A local cluster's directory (from `limpet-lab local up`; lab builds only).
    #[cfg(feature = "lab")]
    #[arg(long, conflicts_with = "addr")]
    pub dir: Option<PathBuf>,
    /// Control address of a node (repeatable; the first that answers is used).
    #[arg(long)]
    pub addr: Vec<String>,
    /// Cluster name (with --addr; default: the one the first node that answers serves).
    #[arg(long)]
    pub cluster: Option<String>,
    /// The cluster CA's certificate, for a cluster that runs with certificates (with
    /// --cert and --key).
    /// Alone, it reads status without a certificate where the nodes allow that.
    #[arg(long, env = "LIMPET_CA")]
    pub ca: Option<PathBuf>,
    /// Your operator certificate (`limpet certs issue NAME --client`, or `--on-call` for one
    /// that reads and drains only).
    #[arg(long, env = "LIMPET_CERT", requires_all = ["ca", "key"])]
    pub cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, env = "LIMPET_KEY", requires_all = ["ca", "cert"])]
    pub key: Option<PathBuf>,
}

/// Where a cluster is and how to reach it.
pub struct Resolved {
    /// The cluster's name.
    pub cluster: String,
    /// Its nodes' control addresses.
    pub addrs: Vec<String>,
    /// A local cluster's file.
    #[cfg(feature = "lab")]
    pub local: Option<ClusterFile>,
    /// The operator's certificates, when the cluster runs with TLS.
    pub tls: Option<std::sync::Arc<Tls>>,
}

impl Target {
    pub(crate) fn resolve(&self) -> crate::Result<Resolved> {
        #[cfg(feature = "lab")]
        let local = self.dir.as_deref().map(ClusterFile::load).transpose()?;
        #[cfg(feature = "lab")]
        if let (Some(f), Some(named), Some(dir)) = (&local, &self.cluster, &self.dir) {
            if *named != f.cluster {
                return Err(UsageError(format!(
                    "--cluster {named:?}: the local cluster in {} is {:?}",
                    dir.display(),
                    f.cluster
                ))
                .into());
            }
        }
        #[cfg(feature = "lab")]
        let (cluster, addrs) = match &local {
            Some(f) => (f.cluster.clone(), f.control_addrs()),
            None => (self.cluster.clone().unwrap_or_default(), self.addr.clone()),
        };
        #[cfg(not(feature = "lab"))]
        let (cluster, addrs) = (self.cluster.clone().unwrap_or_default(), self.addr.clone());
        if addrs.is_empty() {
            let lab = if cfg!(feature = "lab") { "--dir DIR or " } else { "" };
            return Err(UsageError(format!("say where the cluster is: {lab}--addr HOST:PORT")).into());
        }
        let usage = |e: limpet_consensus::tls::TlsError| UsageError(e.to_string());
        let tls = match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(cert), Some(key)) => Some(
                Tls::load(&TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() })
                    .map_err(usage)?,
            ),
            (Some(ca), None, None) => Some(Tls::ca_only(ca).map_err(usage)?),
            #[cfg(feature = "lab")]
            _ => match local.as_ref().and_then(|f| f.operator_tls.as_ref()) {
                Some(f) => Some(Tls::load(f).map_err(usage)?),
                None => None,
            },
            #[cfg(not(feature = "lab"))]
            _ => None,
        };
        let tls = tls.map(std::sync::Arc::new);
        Ok(Resolved {
            cluster,
            addrs,
            #[cfg(feature = "lab")]
            local,
            tls,
        })
    }
}

/// Adds what a bare transport error usually means here.
pub(crate) fn explain(e: String, tls: Option<&Tls>) -> String {
    let closed = e.contains("connection closed") || e.contains("broken pipe") || e.contains("canceled");
    match tls.map(|t| t.role()) {
        None if e.contains("h2 protocol error") || e.contains("transport error") => {
            format!("{e} (does the cluster run with certificates? give --ca, --cert and --key)")
        }
        Some(None) if closed || e.contains("CertificateRequired") => format!(
            "{e} (the nodes refused a client without a certificate; they allow that only for status \
             with [security].anonymous_status = true: give --cert and --key)"
        ),
        Some(Some(_)) if closed => {
            format!("{e} (the nodes may have refused this certificate: another cluster's CA, or expired?)")
        }
        _ => e,
    }
}

pub(crate) async fn connect_any(
    cluster: &str,
    addrs: &[String],
    tls: Option<&Tls>,
) -> crate::Result<(Client, String)> {
    let mut last = String::from("no addresses");
    for a in addrs {
        match tokio::time::timeout(Duration::from_secs(2), Client::connect_with(a, cluster, tls)).await {
            Ok(Ok(c)) => return Ok((c, a.clone())),
            Ok(Err(e)) => last = explain(e.to_string(), tls),
            Err(_) => last = format!("{a}: no answer in 2 s"),
        }
    }
    crate::fail!("no node answered ({last})")
}

impl Resolved {
    /// The cluster's name: given, or (`--addr` without `--cluster`) the one the first node
    /// that answers serves, asked only now that the command line has been checked.
    pub(crate) async fn cluster(&mut self) -> crate::Result<String> {
        if self.cluster.is_empty() {
            self.cluster = learn_cluster(&self.addrs, self.tls.as_deref()).await?;
        }
        Ok(self.cluster.clone())
    }
}

/// The cluster the first node that answers serves.
async fn learn_cluster(addrs: &[String], tls: Option<&Tls>) -> crate::Result<String> {
    let mut errors = Vec::new();
    for a in addrs {
        match tokio::time::timeout(Duration::from_secs(3), Client::learn_cluster(a, tls)).await {
            Ok(Ok((_, name))) => return Ok(name),
            Ok(Err(e)) => errors.push(format!("{a}: {}", explain(e.to_string(), tls))),
            Err(_) => errors.push(format!("{a}: no answer in 3 s")),
        }
    }
    crate::fail!("no node answered: {}", errors.join("; "))
}

/// Gathers the status document from the first node that answers.
pub async fn gather(cluster: &str, addrs: &[String], tls: Option<&Tls>) -> crate::Result<StatusDoc> {
    let mut errors = Vec::new();
    for a in addrs {
        let attempt = async {
            let (mut c, at) = connect_any(cluster, std::slice::from_ref(a), tls).await?;
            let read = c.read(false).await?;
            // Members report to the leader and the voters only: a learner holds its own
            // report alone, so the reports come from the leader when another node answered.
            let leader = read.state.members.get(&read.leader).map(|m| m.spec.control_addr.clone());
            let reports = match leader.filter(|l| *l != at) {
                Some(l) => match leader_reports(cluster, &l, tls).await {
                    Some(r) => r,
                    None => c.reports().await?,
                },
                None => c.reports().await?,
            };
            Ok::<_, crate::Failure>((read, reports, at))
        };
        match tokio::time::timeout(Duration::from_secs(3), attempt).await {
            Ok(Ok((read, reports, at))) => {
                return Ok(build(cluster, &read.state, read.leader, read.term, &reports, &at))
            }
            Ok(Err(e)) => errors.push(format!("{a}: {}", explain(e.to_string(), tls))),
            Err(_) => errors.push(format!("{a}: no answer in 3 s")),
        }
    }
    crate::fail!("no node answered: {}", errors.join("; "))
}

/// The leader's reports, if it answers within a second.
async fn leader_reports(
    cluster: &str,
    addr: &str,
    tls: Option<&Tls>,
) -> Option<Vec<limpet_consensus::NodeReport>> {
    let ask = async { Client::connect_with(addr, cluster, tls).await?.reports().await };
    tokio::time::timeout(Duration::from_secs(1), ask).await.ok()?.ok()
}

/// `limpet status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The cluster.
    #[command(flatten)]
    pub target: Target,
    /// Print the versioned JSON document (docs/status.md) instead of tables.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn runtime() -> crate::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// Runs `limpet status`.
pub fn status(a: StatusArgs) -> crate::Result<()> {
    let mut r = a.target.resolve()?;
    let doc = runtime()?.block_on(async {
        let cluster = r.cluster().await?;
        gather(&cluster, &r.addrs, r.tls.as_deref()).await
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", render(&doc));
    }
    Ok(())
}

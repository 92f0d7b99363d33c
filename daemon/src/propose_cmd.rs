//! `limpet drain`, `limpet revoke` and `limpet certs revoke`: cluster actions proposed
//! through any node's consensus service (or, for a local cluster, through its fake metadata
//! service and its processes), each reported in words or, with `--json`, as one object.

use crate::status::{connect_any, explain, runtime, Target};
use crate::UsageError;
use clap::Args;
use limpet_consensus::state::{Command, NodeId};
use limpet_consensus::tls::Tls;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The furthest a notice's deadline may be (a week): a cloud's notice comes minutes ahead.
const MAX_NOTICE_SECS: u64 = 7 * 24 * 3600;

/// `limpet drain NODE`.
#[derive(Debug, Args)]
pub struct DrainArgs {
    /// The node's name.
    pub node: String,
    /// The cluster.
    #[command(flatten)]
    pub target: Target,
    /// Print what was done as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `limpet revoke NODE`.
#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// The node's name.
    pub node: String,
    /// A spot notice: the host goes away in SECS seconds.
    #[arg(long = "in", value_name = "SECS", value_parser = clap::value_parser!(u64).range(0..=MAX_NOTICE_SECS))]
    pub in_secs: Option<u64>,
    /// No notice: kill the node's limpetd with SIGKILL (local clusters of a lab build only).
    #[cfg(feature = "lab")]
    #[arg(long, conflicts_with = "in_secs")]
    pub hard: bool,
    /// Print what was done as JSON.
    #[arg(long)]
    pub json: bool,
    /// The cluster.
    #[command(flatten)]
    pub target: Target,
}

/// What a proposal did: the log index it was applied at and what the state machine said.
pub struct Proposed {
    /// The raft log index.
    pub index: u64,
    /// The state machine's words.
    pub detail: String,
}

/// Proposes `cmd` through the first node that answers.
pub async fn propose(
    cluster: &str,
    addrs: &[String],
    tls: Option<&Tls>,
    cmd: Command,
) -> crate::Result<Proposed> {
    let (mut c, _) = connect_any(cluster, addrs, tls).await?;
    let (index, detail) = c
        .propose(&cmd, Duration::from_secs(5))
        .await
        .map_err(|e| anyhow::anyhow!(explain(e.to_string(), tls)))?;
    Ok(Proposed { index, detail })
}

async fn member_id(cluster: &str, addrs: &[String], tls: Option<&Tls>, name: &str) -> crate::Result<NodeId> {
    let (mut c, _) = connect_any(cluster, addrs, tls).await?;
    let st = c.read(false).await.map_err(|e| anyhow::anyhow!(explain(e.to_string(), tls)))?.state;
    st.member_named(name).map(|m| m.spec.id).ok_or_else(|| {
        let names: Vec<&str> = st.members.values().map(|m| m.spec.name.as_str()).collect();
        UsageError(format!("no member {name:?} (members: {})", names.join(", "))).into()
    })
}

/// Prints one action's outcome: `NODE: WORDS` or, with `json`, the document.
fn report(json: bool, node: &str, doc: serde_json::Value, words: &str) {
    if json {
        let mut doc = doc;
        doc["node"] = node.into();
        println!("{doc}");
    } else {
        println!("{node}: {words}");
    }
}

/// `limpet certs revoke CERT`.
#[derive(Debug, Args)]
pub struct RevokeCertArgs {
    /// The certificate to revoke (a PEM file: DIR/NAME.pem as `limpet certs issue` wrote it).
    #[arg(value_name = "CERT")]
    pub certificate: std::path::PathBuf,
    /// The cluster.
    #[command(flatten)]
    pub target: Target,
    /// Print what was done as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `limpet certs revoke`: the certificate's fingerprint goes into the log, and every
/// node refuses the certificate from then on.
pub fn revoke_certificate(a: RevokeCertArgs) -> crate::Result<()> {
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_file(&a.certificate)
        .map_err(|e| UsageError(format!("{}: not a certificate ({e})", a.certificate.display())))?;
    let fingerprint = limpet_consensus::tls::fingerprint(cert.as_ref());
    let name = a.certificate.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut r = a.target.resolve()?;
    let (cluster, p) = runtime()?.block_on(async {
        let cluster = r.cluster().await?;
        let cmd = Command::RevokeCertificate { fingerprint: fingerprint.clone(), name: name.clone() };
        let p = propose(&cluster, &r.addrs, r.tls.as_deref(), cmd).await?;
        Ok::<_, crate::Failure>((cluster, p))
    })?;
    let doc = serde_json::json!({
        "action": "revoke_certificate", "cluster": cluster, "fingerprint": fingerprint,
        "log_index": p.index, "detail": p.detail,
    });
    report(a.json, &name, doc, &format!("{} (log index {})", p.detail, p.index));
    Ok(())
}

/// Runs `limpet drain`.
pub fn drain(a: DrainArgs) -> crate::Result<()> {
    let r = a.target.resolve()?;
    let tls = r.tls.as_deref();
    let (id, p) = runtime()?.block_on(async {
        let id = member_id(&r.cluster, &r.addrs, tls, &a.node).await?;
        let p =
            propose(&r.cluster, &r.addrs, tls, Command::Drain { id, reason: "limpet drain".into() }).await?;
        Ok::<_, crate::Failure>((id, p))
    })?;
    let doc = serde_json::json!({"action": "drain", "cluster": r.cluster, "id": id, "log_index": p.index, "detail": p.detail});
    report(a.json, &a.node, doc, &format!("{} (log index {})", p.detail, p.index));
    Ok(())
}

/// Runs `limpet revoke`.
pub fn revoke(a: RevokeArgs) -> crate::Result<()> {
    #[allow(unused_mut)]
    let mut r = a.target.resolve()?;
    #[cfg(feature = "lab")]
    match r.local.take() {
        Some(f) => return revoke_local(&a, &f),
        None if a.hard => {
            return Err(UsageError("--hard needs --dir (it kills a local process)".into()).into())
        }
        None => {}
    }
    let secs = a.in_secs.ok_or_else(|| UsageError("say --in SECS (a spot notice)".into()))?;
    let (cluster, id, deadline_ms, p) = runtime()?.block_on(async {
        let cluster = r.cluster().await?;
        let (addrs, tls) = (&r.addrs, r.tls.as_deref());
        let id = member_id(&cluster, addrs, tls, &a.node).await?;
        let deadline_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64 + secs * 1000;
        let p =
            propose(&cluster, addrs, tls, Command::Notice { id, deadline_ms, source: "cli".into() }).await?;
        Ok::<_, crate::Failure>((cluster, id, deadline_ms, p))
    })?;
    let doc = serde_json::json!({
        "action": "notice", "cluster": cluster, "id": id, "in_secs": secs, "deadline_ms": deadline_ms,
        "via": "log", "log_index": p.index, "detail": p.detail,
    });
    report(a.json, &a.node, doc, &format!("{} (log index {})", p.detail, p.index));
    Ok(())
}

/// `limpet revoke` on a local cluster (a lab build's `--dir`): a kill without notice, or a
/// spot notice through the node's own fake metadata service, as the cloud would post it.
#[cfg(feature = "lab")]
fn revoke_local(a: &RevokeArgs, f: &crate::cluster_file::ClusterFile) -> crate::Result<()> {
    use anyhow::Context;
    let n = f.node(&a.node)?;
    if a.hard {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(n.pid as i32), nix::sys::signal::Signal::SIGKILL)
            .with_context(|| format!("killing {} (pid {})", n.name, n.pid))?;
        let doc = serde_json::json!({"action": "kill", "cluster": f.cluster, "id": n.id, "pid": n.pid});
        report(a.json, &n.name, doc, &format!("killed (pid {}, no notice)", n.pid));
        return Ok(());
    }
    let secs = a.in_secs.ok_or_else(|| UsageError("say --in SECS (a spot notice) or --hard".into()))?;
    crate::cluster_file::post_notice(&n.metadata, secs)?;
    let doc = serde_json::json!({"action": "notice", "cluster": f.cluster, "id": n.id, "in_secs": secs, "via": n.metadata});
    report(a.json, &n.name, doc, &format!("spot notice posted to {} (revocation in {secs} s)", n.metadata));
    Ok(())
}

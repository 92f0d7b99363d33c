//! The synthetic agent's configuration: the file `limpetd` reads, of which this takes what
//! the agent's control part runs on (`[node]`, `[cluster]`, `[timing]`, `[revocation]`,
//! `[security]`, `[job]`'s batch policy and base world) and the job from a `[synthetic]`
//! section of its own, so a lab's local cluster writes one file for either binary. The
//! trainer's keys (`[job]`'s model and data, `[model]`, `[data]`, `[pipeline]`, `[checkpoint]`)
//! are not read here and so not checked: `limpetd validate` checks those. What is read is
//! read strictly, each error naming the file and the key.

use anyhow::{bail, Context};
use limpet_agent::policy::BatchPolicy;
use limpet_agent::revocation::Source;
use limpet_agent::runtime::synthetic::SyntheticJob;
use limpet_agent::runtime::{ControlConfig, Timing};
use limpet_consensus::state::{Hardware, MemberSpec};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What the file asks this binary to run.
pub struct Settings {
    /// The agent's control part.
    pub control: ControlConfig,
    /// The synthetic job.
    pub job: SyntheticJob,
    /// Where each step is logged.
    pub step_log: Option<PathBuf>,
    /// Where Prometheus metrics are served.
    pub metrics: Option<SocketAddr>,
    /// A host booted ahead of its time waits here until this file exists.
    pub start_gate: Option<PathBuf>,
}

#[derive(Deserialize)]
struct File {
    node: Node,
    cluster: Cluster,
    #[serde(default)]
    job: Job,
    #[serde(default)]
    timing: Timing,
    #[serde(default)]
    revocation: Revocation,
    security: Option<Security>,
    synthetic: Option<SyntheticJob>,
}

#[derive(Deserialize)]
struct Node {
    name: String,
    id: u64,
    control: SocketAddr,
    data: SocketAddr,
    #[serde(default)]
    advertise_control: Option<SocketAddr>,
    #[serde(default)]
    advertise_data: Option<SocketAddr>,
    #[serde(default)]
    zone: Option<String>,
    state_dir: PathBuf,
    secret_file: PathBuf,
    #[serde(default)]
    step_log: Option<PathBuf>,
    #[serde(default)]
    metrics: Option<SocketAddr>,
    #[serde(default)]
    start_gate: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Cluster {
    name: String,
    #[serde(default)]
    min_nodes: Option<usize>,
    #[serde(default)]
    straggler_ratio: Option<f64>,
    #[serde(default)]
    bootstrap: Vec<String>,
    #[serde(default)]
    seeds: Vec<String>,
    #[serde(default)]
    max_voters: Option<usize>,
}

#[derive(Default, Deserialize)]
struct Job {
    #[serde(default)]
    policy: Option<BatchPolicy>,
    #[serde(default)]
    base_world: Option<u64>,
}

#[derive(Deserialize)]
struct Revocation {
    #[serde(default)]
    sources: Vec<String>,
    #[serde(default)]
    poll_secs: Option<f64>,
    #[serde(default)]
    aws_endpoint: Option<String>,
    #[serde(default)]
    gcp_endpoint: Option<String>,
    #[serde(default)]
    azure_endpoint: Option<String>,
}

impl Default for Revocation {
    fn default() -> Revocation {
        Revocation { sources: Vec::new(), poll_secs: None, aws_endpoint: None, gcp_endpoint: None, azure_endpoint: None }
    }
}

#[derive(Deserialize)]
struct Security {
    #[serde(default)]
    insecure: bool,
    #[serde(default)]
    ca: Option<PathBuf>,
}

/// The fewest bytes of a cluster secret (as `limpetd` asks).
const MIN_SECRET_BYTES: usize = 16;

/// Reads `path`.
pub fn load(path: &Path) -> anyhow::Result<Settings> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text, &path.display().to_string())
}

/// Reads a file's `text`; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> anyhow::Result<Settings> {
    let f: File = toml::from_str(text).with_context(|| format!("{file}"))?;
    let Some(job) = f.synthetic else {
        bail!("{file}: no [synthetic] section (steps, step_ms, state_bytes, grad_bytes, seed, global_batch): the synthetic agent trains only the job it declares");
    };
    if job.steps == 0 || job.global_batch == 0 {
        bail!("{file}: [synthetic].steps and [synthetic].global_batch must be at least 1");
    }
    match &f.security {
        Some(s) if s.insecure && s.ca.is_none() => {}
        Some(s) if s.ca.is_some() => {
            bail!("{file}: [security].ca: the synthetic agent runs without TLS (its fleets measure the control plane's traffic, not its encryption); set insecure = true")
        }
        _ => bail!("{file}: [security]: set insecure = true (the synthetic agent runs without TLS)"),
    }
    if f.node.id == 0 {
        bail!("{file}: [node].id must not be 0");
    }
    let secret = std::fs::read(&f.node.secret_file)
        .with_context(|| format!("{file}: [node].secret_file {}", f.node.secret_file.display()))?;
    if secret.len() < MIN_SECRET_BYTES {
        bail!(
            "{file}: [node].secret_file {} holds {} bytes; the cluster secret needs at least {MIN_SECRET_BYTES}",
            f.node.secret_file.display(),
            secret.len()
        );
    }
    let founders = founders(&f.cluster.bootstrap).with_context(|| format!("{file}: [cluster].bootstrap"))?;
    if founders.is_empty() && f.cluster.seeds.is_empty() {
        bail!("{file}: [cluster]: neither bootstrap nor seeds: the agent can neither found a cluster nor join one");
    }
    let mut c = ControlConfig::new(f.node.id, &f.node.name, &f.cluster.name, f.node.state_dir, secret);
    let address = |a: Option<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
    c.control = f.node.control;
    c.data = f.node.data;
    c.advertise_control = address(f.node.advertise_control);
    c.advertise_data = address(f.node.advertise_data);
    c.zone = f.node.zone.unwrap_or_default();
    c.base_world = f.job.base_world.unwrap_or(founders.len().max(1) as u64);
    c.bootstrap = (!founders.is_empty()).then_some(founders);
    c.seeds = f.cluster.seeds;
    if let Some(p) = f.job.policy {
        c.policy = p;
    }
    if let Some(v) = f.cluster.max_voters {
        if v == 0 || v % 2 == 0 {
            bail!("{file}: [cluster].max_voters = {v}: must be odd and positive");
        }
        c.max_voters = v;
    }
    if let Some(m) = f.cluster.min_nodes {
        c.min_nodes = m;
    }
    if let Some(r) = f.cluster.straggler_ratio {
        c.straggler_ratio = r;
    }
    c.timing = f.timing;
    let r = f.revocation;
    if let Some(p) = r.poll_secs {
        if !(p.is_finite() && p > 0.0) {
            bail!("{file}: [revocation].poll_secs = {p}: must be a positive number of seconds");
        }
        c.poll = Duration::from_secs_f64(p);
    }
    for s in &r.sources {
        let at = |e: &Option<String>, default: &str| e.clone().unwrap_or_else(|| default.to_string());
        c.sources.push(match s.as_str() {
            "aws" => Source::Aws { endpoint: at(&r.aws_endpoint, "http://169.254.169.254") },
            "gcp" => Source::Gcp { endpoint: at(&r.gcp_endpoint, "http://metadata.google.internal") },
            "azure" => Source::Azure { endpoint: at(&r.azure_endpoint, "http://169.254.169.254") },
            other => bail!("{file}: [revocation].sources: {other:?} is not aws, gcp or azure"),
        });
    }
    Ok(Settings {
        control: c,
        job,
        step_log: f.node.step_log,
        metrics: f.node.metrics,
        start_gate: f.node.start_gate,
    })
}

/// `ID=ADDR` founder entries.
fn founders(entries: &[String]) -> anyhow::Result<Vec<MemberSpec>> {
    let mut out: Vec<MemberSpec> = Vec::new();
    for e in entries {
        let Some((id, addr)) = e.split_once('=') else { bail!("{e:?} is not ID=ADDR") };
        let Some(id) = id.parse::<u64>().ok().filter(|&i| i != 0) else { bail!("{e:?}: {id:?} is not a non-zero id") };
        addr.parse::<SocketAddr>().with_context(|| format!("{e:?}: address {addr:?}"))?;
        if out.iter().any(|f| f.id == id || f.control_addr == addr) {
            bail!("{e:?} names an id or address an earlier entry names");
        }
        out.push(MemberSpec {
            id,
            name: format!("node-{id}"),
            control_addr: addr.to_string(),
            data_addr: String::new(),
            hardware: Hardware::default(),
        });
    }
    Ok(out)
}

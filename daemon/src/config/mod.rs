//! `limpetd`'s configuration file (TOML): parsed strictly (an unknown or misspelt key is an
//! error), its values read into their types as it is parsed (addresses, sizes, devices, stage
//! counts: `limpet_agent::config_value`), then checked for meaning; every problem is reported
//! at once, each naming the file, the key and line, and what is wrong,
//! so `limpetd validate --config FILE` (systemd's `ExecStartPre`) stops a bad deployment
//! before it starts. The keys are documented in `docs/limpetd.md`.

mod check;
mod choices;
mod devices;
mod fleet_target;
mod job;
mod secret;
mod security;
mod settings;
mod values;
pub use check::{ConfigError, ConfigErrors};
pub use choices::{DataName, DataPlaneMode, LogFormat, ModelName, SourceName, Sources};
pub use devices::Devices;
pub use fleet_target::CapacitySection;
pub use job::JobSection;
use limpet_agent::config_value::{read, read_list, read_opt};
pub use limpet_agent::runtime::{CheckpointSettings, PipelineSettings, Stages, Timing};
pub use limpet_trainer::job_keys::OptimizerName;
pub use secret::{read_secret, MIN_SECRET_BYTES};
pub use security::{SecuritySection, SsmSection};
use serde::Deserialize;
pub use settings::Settings;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The whole file. No section denies unknown fields: serde would stop at the first, so the
/// parse collects every key nothing reads and the checks report them beside the others.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Config {
    /// This host.
    pub node: NodeSection,
    /// The cluster it belongs to.
    pub cluster: ClusterSection,
    /// The training job.
    pub job: JobSection,
    /// The model's sizes, or the Hugging Face checkpoint it starts from.
    #[serde(default)]
    pub model: limpet_trainer::workload::ModelSection,
    /// How samples are cut from the data.
    #[serde(default)]
    pub data: limpet_trainer::workload::DataSection,
    /// Where revocation notices come from.
    #[serde(default)]
    pub revocation: RevocationSection,
    /// Failure detection and transition timing.
    #[serde(default)]
    pub timing: Timing,
    /// Pipeline parallelism (absent: plain data parallelism).
    pub pipeline: Option<PipelineSettings>,
    /// Durable checkpoints (absent: only the final one).
    pub checkpoint: Option<CheckpointSettings>,
    /// Certificates, or `insecure = true` (required: limpetd does not run without one or
    /// the other).
    pub security: Option<SecuritySection>,
    /// The fleet the leader keeps on EC2 (absent: nobody launches hosts).
    pub capacity: Option<CapacitySection>,
    /// The file this was read from, for errors that name a key's line.
    #[serde(skip)]
    pub source: Source,
    /// Keys no section reads (`[section].key`, or `[section]`).
    #[serde(skip)]
    pub unknown: Vec<String>,
    /// Values that did not read as their type (an address, a size, a device), each under its
    /// key and line.
    #[serde(skip)]
    pub unread: Vec<ConfigError>,
}

/// A configuration's file name and text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Source {
    /// The file's name as errors show it.
    pub file: String,
    /// Its text.
    pub text: String,
}

/// `[node]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct NodeSection {
    /// Unique name in the cluster.
    pub name: String,
    /// Raft id (non-zero); derived from the name when absent.
    pub id: Option<u64>,
    /// Consensus (gRPC) listen address.
    #[serde(deserialize_with = "read")]
    pub control: SocketAddr,
    /// Data-plane listen address.
    #[serde(deserialize_with = "read")]
    pub data: SocketAddr,
    /// Control address peers use, if not the listen address.
    #[serde(default, deserialize_with = "read_opt")]
    pub advertise_control: Option<SocketAddr>,
    /// Data address peers use, if not the listen address.
    #[serde(default, deserialize_with = "read_opt")]
    pub advertise_data: Option<SocketAddr>,
    /// This host's failure domain: its availability zone, or a rack (absent: none said).
    /// The cluster spreads its raft voters over zones, so losing any one keeps a quorum.
    #[serde(default)]
    pub zone: Option<String>,
    /// Whether an epoch whose hosts span several zones may reduce in two levels, a ring
    /// inside each zone and one across (default true); false keeps every epoch this host is
    /// in on the flat ring.
    #[serde(default = "yes")]
    pub zone_levels: bool,
    /// State directory (raft log, checkpoints).
    pub state_dir: PathBuf,
    /// Append one JSON line per completed step here.
    pub step_log: Option<PathBuf>,
    /// File holding the cluster secret (at least 16 bytes).
    pub secret_file: PathBuf,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (absent: no metrics endpoint).
    #[serde(default, deserialize_with = "read_opt")]
    pub metrics: Option<SocketAddr>,
    /// Serve them over mutual TLS instead (`https://`): the node's certificate, and clients
    /// must present one of the cluster CA (`limpet certs issue prometheus --client`).
    #[serde(default)]
    pub metrics_tls: bool,
    /// Log lines as `text` (default) or `json` (one object per line, for journald/Loki).
    #[serde(default)]
    pub log_format: LogFormat,
    /// TCP congestion control of the data plane's sockets: a kernel algorithm's name
    /// (default `reno`: no pacing timers on bulk in-datacenter transfers), or `system` for the
    /// host's default.
    #[serde(default = "default_data_congestion")]
    pub data_congestion: String,
    /// The devices this host trains with, one local rank each: `"auto"` (every GPU libtorch
    /// sees, else one CPU rank) or a list (`["cuda:0", "cuda:1"]`; CPU entries may repeat, as
    /// tests run local ranks). Absent: one rank on `[job].device`.
    #[serde(default)]
    pub devices: Option<Devices>,
    /// Straggler drills: this node sleeps this many microseconds per sample it computes, as
    /// a slower host would take (0: off). Lab builds only.
    #[cfg(feature = "lab")]
    #[serde(default)]
    pub slowdown_us_per_sample: u64,
    /// Straggler drills: this node computes as a host this many times slower would (1: off).
    /// Lab builds only.
    #[cfg(feature = "lab")]
    #[serde(default = "default_slowdown_factor")]
    pub slowdown_factor: f64,
    /// A host booted ahead of its time waits, loaded, until this file exists (the lab opens
    /// it when its script says the host joins). Lab builds only.
    #[cfg(feature = "lab")]
    #[serde(default)]
    pub start_gate: Option<PathBuf>,
}

#[cfg(feature = "lab")]
fn default_slowdown_factor() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn default_data_congestion() -> String {
    limpet_agent::dataplane::endpoint::DEFAULT_CONGESTION.into()
}

/// `[cluster]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ClusterSection {
    /// Cluster name.
    pub name: String,
    /// Control addresses of members to join through.
    #[serde(default, deserialize_with = "read_list")]
    pub seeds: Vec<SocketAddr>,
    /// Founding members `ID=ADDR`, identical on every founder (empty: join through seeds).
    #[serde(default)]
    pub bootstrap: Vec<String>,
    /// Most voters in the Raft group (odd).
    #[serde(default = "default_voters")]
    pub max_voters: usize,
    /// Fewest nodes training may continue with.
    #[serde(default = "default_min_nodes")]
    pub min_nodes: usize,
    /// A host this many times slower per sample than the fastest computes a smaller share of
    /// each step (0: off; docs/elastic.md).
    #[serde(default = "default_straggler_ratio")]
    pub straggler_ratio: f64,
    /// Steps of an epoch before its measured speeds count.
    #[serde(default = "default_straggler_steps")]
    pub straggler_steps: u64,
    /// Also join through the running EC2 instances tagged `limpet:cluster = NAME` (their
    /// private address, this node's control port).
    #[serde(default)]
    pub ec2_seeds: bool,
    /// Region for `ec2_seeds` (default: the SDK's: environment, profile, instance metadata).
    pub ec2_region: Option<String>,
    /// EC2 endpoint for `ec2_seeds` (default: the region's).
    pub ec2_endpoint: Option<String>,
}

fn default_voters() -> usize {
    5
}

fn default_min_nodes() -> usize {
    1
}

fn default_straggler_ratio() -> f64 {
    limpet_agent::balance::DEFAULT_RATIO
}

fn default_straggler_steps() -> u64 {
    100
}

/// `[revocation]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RevocationSection {
    /// `"auto"` (default: the cloud that answers), `"none"`, or a list of `aws`, `gcp`,
    /// `azure` (SIGTERM is always a drain).
    #[serde(default)]
    pub sources: Sources,
    /// Seconds between polls.
    #[serde(default = "default_poll")]
    pub poll_secs: f64,
    /// AWS IMDS endpoint.
    #[serde(default = "default_aws")]
    pub aws_endpoint: String,
    /// GCP metadata endpoint.
    #[serde(default = "default_gcp")]
    pub gcp_endpoint: String,
    /// Azure IMDS endpoint.
    #[serde(default = "default_aws")]
    pub azure_endpoint: String,
}

impl Default for RevocationSection {
    fn default() -> RevocationSection {
        RevocationSection {
            sources: Sources::Auto,
            poll_secs: default_poll(),
            aws_endpoint: default_aws(),
            gcp_endpoint: default_gcp(),
            azure_endpoint: default_aws(),
        }
    }
}

fn default_poll() -> f64 {
    2.0
}

fn default_aws() -> String {
    "http://169.254.169.254".into()
}

fn default_gcp() -> String {
    "http://metadata.google.internal".into()
}

impl Config {
    /// Reads and checks `path` (every key, not yet the job's data: [`Config::settings`]).
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        Config::parse(&Config::read(path)?, &path.display().to_string())
    }

    /// The text of `path`.
    pub fn read(path: &Path) -> Result<String, ConfigError> {
        std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(&path.display().to_string(), "(file)", e.to_string()))
    }

    /// Parses and checks `text` (named `file` in errors).
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigErrors> {
        let cfg = Config::parse_unchecked(text, file)?;
        let mut c = check::Checks::new(file, text);
        cfg.values(&mut c);
        c.finish()?;
        Ok(cfg)
    }

    /// Parses `text` without the checks (for `limpetd fetch-credentials`, which writes the
    /// files those checks read, and for start-up and `limpetd validate`, whose
    /// [`Config::settings`] runs them): unknown keys are kept in `unknown` and reported by
    /// the checks, beside every other problem.
    pub fn parse_unchecked(text: &str, file: &str) -> Result<Config, ConfigErrors> {
        Config::parse_keys(text, file)
    }

    /// Every key nothing reads and every required key missing, for the checks.
    pub(super) fn keys_known(&self, c: &mut check::Checks) {
        for key in &self.unknown {
            c.push(unknown(&self.source.text, c.file(), key));
        }
        for e in &self.unread {
            c.push(e.clone());
        }
        let keys = &self.job.keys;
        for (key, set) in [("steps", keys.steps.is_some()), ("global_batch", keys.global_batch.is_some())] {
            if !set {
                let line = check::line_of(&self.source.text, "[job]");
                let detail = "missing: this key is required".to_string();
                c.push(ConfigError { file: c.file().into(), key: format!("[job].{key}"), line, detail });
            }
        }
    }

    /// The sections as the file sets them, and the keys nothing reads. A value of the wrong
    /// type (or a missing required one) stops the parse, named with its key and line beside
    /// the unknown keys met before it (a misspelt required key is both).
    fn parse_keys(text: &str, file: &str) -> Result<Config, ConfigErrors> {
        let mut ignored = Vec::new();
        let (parsed, unread) = limpet_agent::config_value::collect(|| {
            toml::Deserializer::parse(text)
                .and_then(|de| serde_ignored::deserialize(de, |p| ignored.push(p.to_string())))
        });
        // In the file's order (the parser visits tables in its own).
        let mut unread = unread;
        unread.sort_by_key(|u| u.span.start);
        let unread: Vec<ConfigError> = unread
            .into_iter()
            .map(|u| {
                let (key, line) = check::key_at(text, u.span.start);
                ConfigError { file: file.into(), key, line, detail: u.detail }
            })
            .collect();
        // Before `[job]`'s training keys are read, a key of `[job]` this parse skips may be one.
        let outside_job = |ignored: &[String]| -> Vec<String> {
            ignored.iter().filter(|p| !p.starts_with("job.")).cloned().collect()
        };
        let mut cfg: Config =
            parsed.map_err(|e| parse_error(text, file, e, &outside_job(&ignored), &unread))?;
        // `[job]`'s training keys, read from the same text (so their errors keep their line).
        #[derive(Deserialize)]
        struct Keys {
            #[serde(default)]
            job: limpet_trainer::job_keys::JobKeys,
        }
        let mut not_keys = Vec::new();
        let parsed: Result<Keys, _> = toml::Deserializer::parse(text)
            .and_then(|de| serde_ignored::deserialize(de, |p| not_keys.push(p.to_string())));
        cfg.job.keys = parsed.map_err(|e| parse_error(text, file, e, &outside_job(&ignored), &unread))?.job;
        ignored.retain(|p| !p.starts_with("job.") || not_keys.contains(p));
        cfg.unknown = ignored.iter().map(|p| section_key(p)).collect();
        cfg.unread = unread;
        cfg.source = Source { file: file.into(), text: text.into() };
        Ok(cfg)
    }

    /// The certificates, unless the configuration runs without them.
    pub fn tls(&self) -> Option<&SecuritySection> {
        self.security.as_ref().filter(|s| !s.insecure)
    }

    /// The node's Raft id: as configured, or derived from the name.
    pub fn node_id(&self) -> u64 {
        self.node.id.unwrap_or_else(|| limpet_consensus::state::node_id_of_name(&self.node.name))
    }
}

/// A parse error named by its key and line, after the keys nothing read before it.
fn parse_error(
    text: &str,
    file: &str,
    e: toml::de::Error,
    ignored: &[String],
    unread: &[ConfigError],
) -> ConfigErrors {
    let missing = e.message().strip_prefix("missing field `").and_then(|m| m.strip_suffix('`'));
    let (key, line, detail) = match missing {
        // The parser names the table the key is missing from, not the key.
        Some(field) => {
            let (key, line) = check::missing_key(text, e.span(), field);
            let what = if key.ends_with(']') { "section" } else { "key" };
            (key, line, format!("missing: this {what} is required"))
        }
        None => {
            let (key, line) = e.span().map_or(("(file)".into(), None), |s| check::key_at(text, s.start));
            (key, line, e.message().to_string())
        }
    };
    let mut c = check::Checks::new(file, text);
    for key in ignored.iter().map(|p| section_key(p)) {
        c.push(unknown(text, file, &key));
    }
    for e in unread {
        c.push(e.clone());
    }
    c.push(ConfigError { file: file.to_string(), key, line, detail });
    c.finish().expect_err("one error at least")
}

/// An unknown key (`[section].key`), or a path of one name (`[name]`): a section of that
/// name, or a key above the first section (`name`, on its line).
fn unknown(text: &str, file: &str, key: &str) -> ConfigError {
    let error = |key: &str, line, detail| ConfigError { file: file.into(), key: key.into(), line, detail };
    if let Some((section, name)) = key.split_once("].") {
        let detail =
            format!("unknown field `{name}`: {section}] has no such key (the keys are in docs/limpetd.md)");
        return error(key, check::line_of(text, key), detail);
    }
    if let Some(line) = check::line_of(text, key) {
        return error(key, Some(line), format!("unknown section {key}"));
    }
    let name = key.trim_start_matches('[').trim_end_matches(']');
    // Above the first section's header.
    let line = text
        .lines()
        .take_while(|l| !l.trim_start().starts_with('['))
        .position(|l| l.split_once('=').is_some_and(|(k, _)| k.trim().trim_matches(['"', '\'']) == name))
        .map(|i| i + 1);
    let detail =
        format!("unknown top-level key `{name}`: every key belongs in a section ([node], [job], ...)");
    error(name, line, detail)
}

/// A path serde names (`job.bogus`, `security.?.ssm.?.x` through optional sections, `bogus`)
/// as errors name keys: `[job].bogus`, `[security.ssm].x`, `[bogus]`.
fn section_key(path: &str) -> String {
    let parts: Vec<&str> = path.split('.').filter(|p| *p != "?").collect();
    match parts.split_last() {
        Some((key, section)) if !section.is_empty() => format!("[{}].{key}", section.join(".")),
        _ => format!("[{}]", parts.join(".")),
    }
}

/// Parses `ID=ADDR` founder entries.
pub fn parse_founders(
    entries: &[String],
) -> Result<Vec<limpet_consensus::state::MemberSpec>, crate::UsageError> {
    let founders = entries
        .iter()
        .map(|e| {
            let (id, addr) = e
                .split_once('=')
                .ok_or_else(|| crate::UsageError(format!("--bootstrap entry {e:?} is not ID=ADDR")))?;
            let id: u64 = id.parse().ok().filter(|&i| i != 0).ok_or_else(|| {
                crate::UsageError(format!("--bootstrap entry {e:?}: {id:?} is not a non-zero id"))
            })?;
            addr.parse::<std::net::SocketAddr>().map_err(|err| {
                crate::UsageError(format!("--bootstrap entry {e:?}: address {addr:?}: {err}"))
            })?;
            Ok(limpet_consensus::state::MemberSpec {
                id,
                name: format!("node-{id}"),
                control_addr: addr.to_string(),
                data_addr: String::new(),
                hardware: limpet_consensus::state::Hardware::default(),
            })
        })
        .collect::<Result<Vec<_>, crate::UsageError>>()?;
    // Raft refuses a configuration that names a voter twice; say which entries do.
    for (i, f) in founders.iter().enumerate() {
        for (j, g) in founders[..i].iter().enumerate() {
            let what = if g.id == f.id {
                format!("id {}", f.id)
            } else if g.control_addr == f.control_addr {
                format!("address {}", f.control_addr)
            } else {
                continue;
            };
            return Err(crate::UsageError(format!(
                "--bootstrap entries {:?} and {:?} name the same {what}",
                entries[j], entries[i]
            )));
        }
    }
    Ok(founders)
}

#[cfg(test)]
mod job_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod values_tests;

//! `limpetd`'s configuration file (TOML): parsed strictly (an unknown or misspelt key is an
//! error), then checked for meaning. Every error names the file, the key and what is wrong,
//! so `limpetd validate --config FILE` (systemd's `ExecStartPre`) stops a bad deployment
//! before it starts. The keys are documented in `docs/limpetd.md`.

mod devices;
mod fleet_target;
mod job;
mod names;
mod secret;
mod security;
pub use devices::Devices;
pub use fleet_target::CapacitySection;
pub use job::JobSection;
use limpet_agent::policy::BatchPolicy;
pub use limpet_trainer::job_keys::OptimizerName;
pub use names::{DataPlaneMode, LogFormat, ModelName, SourceName, Sources};
pub use secret::{read_secret, MIN_SECRET_BYTES};
pub use security::{SecuritySection, SsmSection};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// A configuration problem: which file and key, and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {detail}")]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// The key, as `[section].name` (or the parser's location).
    pub key: String,
    /// What is wrong.
    pub detail: String,
}

/// The whole file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
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
    pub timing: TimingSection,
    /// Pipeline parallelism (absent: plain data parallelism).
    pub pipeline: Option<PipelineSection>,
    /// Durable checkpoints (absent: only the final one).
    pub checkpoint: Option<CheckpointSection>,
    /// Certificates, or `insecure = true` (required: limpetd does not run without one or
    /// the other).
    pub security: Option<SecuritySection>,
    /// The fleet the leader keeps on EC2 (absent: nobody launches hosts).
    pub capacity: Option<CapacitySection>,
}

/// `[checkpoint]`: periodic checkpoints that outlive every host, and resuming from them.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Write one every this many steps (0: not by steps).
    #[serde(default)]
    pub every_steps: u64,
    /// Write one when this many minutes passed since the last (0: not by time).
    #[serde(default)]
    pub every_minutes: f64,
    /// Where (a shared mount survives losing every host); default `STATE_DIR/checkpoints`.
    pub dir: Option<PathBuf>,
    /// How many checkpoints to keep (older ones are deleted).
    #[serde(default = "default_keep")]
    pub keep: usize,
    /// Whether a new cluster starts from the newest checkpoint of the same job: "required"
    /// (waits for a missing directory), "if-present" (the default) or "never".
    #[serde(default)]
    pub resume: limpet_agent::runtime::Resume,
    /// Also copy every checkpoint to S3-compatible storage, `s3://BUCKET/PREFIX`; a new
    /// cluster resumes from there when `dir` has nothing newer.
    pub s3: Option<String>,
    /// An S3-compatible endpoint (`http://minio:9000`); default AWS's.
    pub s3_endpoint: Option<String>,
    /// The region (default: the SDK's: environment, profile, instance metadata).
    pub s3_region: Option<String>,
    /// What a checkpoint must leave free on its disk (`256M`, `2G`; `0` for no reserve): a
    /// checkpoint that would leave less is not written (a warning, a metric and a status
    /// line), so checkpoints never take the room the raft log needs when they share a disk.
    #[serde(default = "default_min_free")]
    pub min_free: String,
    /// Every host sees `dir` (a shared mount such as EFS): a job whose optimizer state is
    /// sharded then writes each checkpoint as shards, one per rank, at once, instead of
    /// gathering the whole state on every rank (not with `s3`, whose copies are whole parts).
    #[serde(default)]
    pub shared: bool,
}

fn default_keep() -> usize {
    3
}

impl CheckpointSection {
    /// `min_free` in bytes (`0` turns the reserve off).
    pub fn min_free_bytes(&self) -> Result<u64, String> {
        match self.min_free.trim() {
            "0" => Ok(0),
            s => crate::args::parse_bytes(s),
        }
    }
}

fn default_min_free() -> String {
    "256M".into()
}

/// How many stages: a number, or `"auto"` for the planner's choice.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Stages {
    /// Exactly this many stages per replica.
    Fixed(usize),
    /// `"auto"`.
    Named(String),
}

/// `[pipeline]`: split the model into stages across hosts, laid out by the planner.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PipelineSection {
    /// Stages per data-parallel replica, or `"auto"`.
    pub stages: Stages,
    /// Memory training may use on each host (`16G`, `512M`, ...).
    #[serde(default = "default_memory")]
    pub memory: String,
    /// Bandwidth between hosts, GB/s.
    #[serde(default = "default_link_gbps")]
    pub link_gbps: f64,
    /// One-way latency between hosts, ms.
    #[serde(default = "default_latency_ms")]
    pub latency_ms: f64,
    /// Mirror each stage's state to its neighbouring stage every this many steps (0: off).
    #[serde(default)]
    pub shadow_every: u64,
    /// Force the layout's block cuts (where each stage after the first starts) instead of
    /// the planner's; `stages` must then be their count plus one.
    pub cuts: Option<Vec<usize>>,
}

fn default_memory() -> String {
    "16G".into()
}

fn default_link_gbps() -> f64 {
    1.0
}

fn default_latency_ms() -> f64 {
    0.1
}

/// `[timing]`: how fast failures are detected and transitions planned.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TimingSection {
    /// Milliseconds between heartbeats.
    pub heartbeat_ms: u64,
    /// Silence after which a node has failed, milliseconds.
    pub failure_timeout_ms: u64,
    /// A collective with no progress for this long fails, milliseconds.
    pub data_timeout_ms: u64,
    /// Raft tick, milliseconds (elections take 10-20 ticks).
    pub raft_tick_ms: u64,
    /// How far ahead of the furthest rank a planned change is scheduled, milliseconds.
    pub lead_ms: u64,
    /// Margin kept before a revocation deadline, milliseconds.
    pub notice_margin_ms: u64,
    /// After SIGTERM, how long the drain may take before `limpetd` exits regardless, seconds
    /// (systemd's `TimeoutStopSec` should be a little longer).
    pub drain_grace_secs: u64,
}

impl Default for TimingSection {
    fn default() -> TimingSection {
        TimingSection {
            heartbeat_ms: 100,
            failure_timeout_ms: 1000,
            data_timeout_ms: 3000,
            raft_tick_ms: 50,
            lead_ms: 400,
            notice_margin_ms: 1000,
            drain_grace_secs: 90,
        }
    }
}

/// `[node]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Unique name in the cluster.
    pub name: String,
    /// Raft id (non-zero); derived from the name when absent.
    pub id: Option<u64>,
    /// Consensus (gRPC) listen address.
    pub control: String,
    /// Data-plane listen address.
    pub data: String,
    /// Control address peers use, if not the listen address.
    pub advertise_control: Option<String>,
    /// Data address peers use, if not the listen address.
    pub advertise_data: Option<String>,
    /// State directory (raft log, checkpoints).
    pub state_dir: PathBuf,
    /// Append one JSON line per completed step here.
    pub step_log: Option<PathBuf>,
    /// File holding the cluster secret (at least 16 bytes).
    pub secret_file: PathBuf,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (absent: no metrics endpoint).
    pub metrics: Option<String>,
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
    /// a slower host would take (0: off).
    #[serde(default)]
    pub slowdown_us_per_sample: u64,
    /// Straggler drills: this node computes as a host this many times slower would (1: off).
    #[serde(default = "default_slowdown_factor")]
    pub slowdown_factor: f64,
}

fn default_slowdown_factor() -> f64 {
    1.0
}

fn default_data_congestion() -> String {
    limpet_agent::dataplane::endpoint::DEFAULT_CONGESTION.into()
}

/// `[cluster]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Cluster name.
    pub name: String,
    /// Control addresses of members to join through.
    #[serde(default)]
    pub seeds: Vec<String>,
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
#[serde(deny_unknown_fields)]
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
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            key: "(file)".into(),
            detail: e.to_string(),
        })?;
        Config::parse(&text, &file)
    }

    /// Parses and checks `text` (named `file` in errors).
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let cfg = Config::parse_unchecked(text, file)?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Parses `text` without the checks that read files (for `limpetd fetch-credentials`,
    /// which writes the files those checks read).
    pub fn parse_unchecked(text: &str, file: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            key: e.span().map_or("(file)".into(), |s| key_at(text, s.start)),
            detail: e.message().to_string(),
        })
    }

    /// Checks what the parser cannot: addresses, ranges, files, combinations.
    pub fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let err = |key: &str, detail: String| Err(ConfigError { file: file.into(), key: key.into(), detail });
        let addr = |key: &str, v: &str| -> Result<(), ConfigError> {
            v.parse::<SocketAddr>().map(|_| ()).map_err(|e| ConfigError {
                file: file.into(),
                key: key.into(),
                detail: format!("{v:?} is not HOST:PORT ({e})"),
            })
        };
        if self.node.name.is_empty() {
            return err("[node].name", "is empty".into());
        }
        if self.node.id == Some(0) {
            return err("[node].id", "0 is reserved by raft".into());
        }
        addr("[node].control", &self.node.control)?;
        addr("[node].data", &self.node.data)?;
        if let Some(a) = &self.node.advertise_control {
            addr("[node].advertise_control", a)?;
        }
        if let Some(a) = &self.node.advertise_data {
            addr("[node].advertise_data", a)?;
        }
        if let Err(why) = read_secret(&self.node.secret_file) {
            return err("[node].secret_file", why);
        }
        if self.cluster.name.is_empty() {
            return err("[cluster].name", "is empty".into());
        }
        for s in &self.cluster.seeds {
            addr("[cluster].seeds", s)?;
        }
        parse_founders(&self.cluster.bootstrap).map_err(|e| ConfigError {
            file: file.into(),
            key: "[cluster].bootstrap".into(),
            detail: e.0,
        })?;
        if self.cluster.bootstrap.is_empty() && self.cluster.seeds.is_empty() && !self.cluster.ec2_seeds {
            return err(
                "[cluster]",
                "needs seeds to join through (or ec2_seeds = true), or bootstrap founders".into(),
            );
        }
        if let Some(url) = &self.cluster.ec2_endpoint {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return err("[cluster].ec2_endpoint", format!("{url:?} is not an http(s) URL"));
            }
        }
        if self.cluster.max_voters == 0 || self.cluster.max_voters % 2 == 0 {
            return err(
                "[cluster].max_voters",
                format!("{} is not an odd positive number", self.cluster.max_voters),
            );
        }
        if self.cluster.min_nodes == 0 {
            return err("[cluster].min_nodes", "must be at least 1".into());
        }
        let f = self.node.slowdown_factor;
        if !(f.is_finite() && (1.0..=100.0).contains(&f)) {
            return err("[node].slowdown_factor", format!("{f} is not within 1..=100"));
        }
        let r = self.cluster.straggler_ratio;
        if !(r == 0.0 || (r.is_finite() && (1.05..=100.0).contains(&r))) {
            return err("[cluster].straggler_ratio", format!("{r} is neither 0 (off) nor within 1.05..=100"));
        }
        if self.job.model == ModelName::Torchscript && self.pipeline.is_some() {
            return err(
                "[pipeline]",
                "model torchscript is one stage: a TorchScript graph cannot be cut into pipeline stages"
                    .into(),
            );
        }
        if !["digits", "chars", "tokens", "tensors", "synthetic"].contains(&self.job.data.as_str()) {
            return err(
                "[job].data",
                format!("{:?} is not one of digits, chars, tokens, tensors, synthetic", self.job.data),
            );
        }
        if ["tokens", "tensors"].contains(&self.job.data.as_str()) && self.job.data_path.is_none() {
            return err("[job].data_path", format!("data {:?} needs its files (data_path)", self.job.data));
        }
        if let Err(e) =
            limpet_trainer::device::DeviceChoice::parse(&self.job.device).and_then(|d| d.resolve())
        {
            return err("[job].device", e);
        }
        // `"auto"` on a host of several GPUs trains a pipelined job on the first (the
        // cloud-init default must not refuse such jobs); a list of several is refused.
        let listed = self.node.devices.as_ref().is_some_and(|d| d.entries() != ["auto"]);
        match self.node.local_devices() {
            Err(e) => return err("[node].devices", e),
            Ok(Some(_)) if !listed => {}
            Ok(Some(d)) if d.len() > 1 && self.pipeline.is_some() => {
                return err(
                    "[node].devices",
                    format!(
                        "{} devices: a pipeline stage trains on one device (list one, or drop [pipeline])",
                        d.len()
                    ),
                )
            }
            Ok(_) => {}
        }
        let precision = match limpet_trainer::model::Precision::parse(&self.job.precision) {
            Ok(p) => p,
            Err(e) => return err("[job].precision", e),
        };
        if precision == limpet_trainer::model::Precision::Bf16 && self.job.model != ModelName::Llama {
            return err("[job].precision", "\"bf16\" is available for model \"llama\" only".into());
        }
        if self.data.context == Some(0) {
            return err("[data].context", "must be at least 1".into());
        }
        if self.data.context.is_some() && !["chars", "tokens"].contains(&self.job.data.as_str()) {
            return err("[data].context", "applies to data \"chars\" and \"tokens\" only".into());
        }
        if let Err(e) = self.model.check_keys(self.job.model.as_str()) {
            let msg = e.to_string();
            let (key, why) =
                msg.trim_start_matches("invalid job: ").split_once(": ").unwrap_or(("[model]", &msg));
            return err(key, why.to_string());
        }
        if self.model.tie_embeddings == Some(true) && self.pipeline.is_some() {
            return err(
                "[model].tie_embeddings",
                "the head shares the embedding, so the model cannot be split into pipeline stages".into(),
            );
        }
        if let Err(e) = self.job.keys().check() {
            return err(&format!("[job].{}", e.key), e.detail);
        }
        if self.job.reproducible == Some(true) {
            if self.job.policy != BatchPolicy::FixedGlobal {
                return err(
                    "[job].reproducible",
                    "needs policy \"fixed-global\": the other policies change the batch or the learning rate with the world size".into(),
                );
            }
            if self.pipeline.is_some() {
                return err(
                    "[job].reproducible",
                    "is for data parallelism only: a pipelined step sums over its replicas' stages in f32"
                        .into(),
                );
            }
        }
        if self.pipeline.is_some() {
            // Stages run their own forward and backward: refused rather than silently ignored.
            let unsupported = [
                ("[job].activation_checkpointing", self.job.activation_checkpointing == Some(true)),
                ("[job].loss_chunk", self.job.loss_chunk.is_some()),
                ("[job].eval_every", self.job.eval_every.is_some()),
                ("[job].shard_state", self.job.shard_state.as_deref().is_some_and(|s| s != "none")),
            ];
            if let Some((key, _)) = unsupported.iter().find(|(_, set)| *set) {
                return err(key, "is not supported by a pipelined job yet ([pipeline] is set)".into());
            }
        }
        if self.job.base_world == Some(0) {
            return err("[job].base_world", "must be at least 1".into());
        }
        let t = &self.timing;
        for (key, v, lo) in [
            ("[timing].heartbeat_ms", t.heartbeat_ms, 10),
            ("[timing].failure_timeout_ms", t.failure_timeout_ms, 50),
            ("[timing].data_timeout_ms", t.data_timeout_ms, 50),
            ("[timing].raft_tick_ms", t.raft_tick_ms, 5),
            ("[timing].lead_ms", t.lead_ms, 0),
            ("[timing].notice_margin_ms", t.notice_margin_ms, 0),
        ] {
            if v < lo {
                return err(key, format!("{v} is below {lo}"));
            }
        }
        if t.failure_timeout_ms < 2 * t.heartbeat_ms {
            return err(
                "[timing].failure_timeout_ms",
                format!(
                    "{} must be at least two heartbeats ({} ms)",
                    t.failure_timeout_ms,
                    2 * t.heartbeat_ms
                ),
            );
        }
        if let Some(p) = &self.pipeline {
            match &p.stages {
                Stages::Fixed(0) => {
                    return err("[pipeline].stages", "must be at least 1 (or \"auto\")".into())
                }
                Stages::Named(s) if s != "auto" => {
                    return err("[pipeline].stages", format!("{s:?} is neither a number nor \"auto\""))
                }
                _ => {}
            }
            if let Some(cuts) = &p.cuts {
                if cuts.windows(2).any(|w| w[0] >= w[1]) || cuts.first() == Some(&0) {
                    return err("[pipeline].cuts", format!("{cuts:?} must increase and start after block 0"));
                }
                if p.stages != Stages::Fixed(cuts.len() + 1) {
                    return err(
                        "[pipeline].cuts",
                        format!(
                            "{} cut(s) make {} stages; set stages = {}",
                            cuts.len(),
                            cuts.len() + 1,
                            cuts.len() + 1
                        ),
                    );
                }
            }
            if let Err(e) = crate::args::parse_bytes(&p.memory) {
                return err("[pipeline].memory", e);
            }
            if !(p.link_gbps.is_finite() && p.link_gbps > 0.0) {
                return err("[pipeline].link_gbps", format!("{} is not a positive number", p.link_gbps));
            }
            if !(p.latency_ms.is_finite() && p.latency_ms >= 0.0) {
                return err(
                    "[pipeline].latency_ms",
                    format!("{} is not a non-negative number", p.latency_ms),
                );
            }
        }
        if let Some(a) = &self.node.metrics {
            addr("[node].metrics", a)?;
        }
        if self.node.metrics_tls && (self.node.metrics.is_none() || self.tls().is_none()) {
            return err(
                "[node].metrics_tls",
                "needs [node].metrics and [security] with certificates (ca, cert, key)".into(),
            );
        }
        if let Err(e) = limpet_agent::dataplane::endpoint::parse_congestion(&self.node.data_congestion) {
            return err("[node].data_congestion", e);
        }
        if !(1..=3600).contains(&t.drain_grace_secs) {
            return err(
                "[timing].drain_grace_secs",
                format!("{} is not within 1..=3600", t.drain_grace_secs),
            );
        }
        if let Some(c) = &self.checkpoint {
            if !(c.every_minutes.is_finite() && c.every_minutes >= 0.0) {
                return err(
                    "[checkpoint].every_minutes",
                    format!("{} is not a non-negative number", c.every_minutes),
                );
            }
            if c.every_steps == 0 && c.every_minutes == 0.0 {
                return err("[checkpoint]", "set every_steps or every_minutes (or drop the section)".into());
            }
            if c.keep == 0 {
                return err("[checkpoint].keep", "must be at least 1".into());
            }
            if let Err(e) = c.min_free_bytes() {
                return err("[checkpoint].min_free", e);
            }
            if let Some(url) = &c.s3 {
                if let Err(e) = limpet_agent::remote::parse_url(url) {
                    return err("[checkpoint].s3", e);
                }
            }
            if let Some(url) = &c.s3_endpoint {
                if c.s3.is_none() {
                    return err("[checkpoint].s3_endpoint", "set s3 too (the bucket and prefix)".into());
                }
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return err("[checkpoint].s3_endpoint", format!("{url:?} is not an http(s) URL"));
                }
            }
            let sharded = self.job.shard_state.as_deref().is_some_and(|s| s != "none");
            if (self.pipeline.is_some() || sharded) && c.every_minutes > 0.0 {
                // Each stage writes its own part; only a step count tells every stage the same
                // moment without another round of agreement.
                let which = if sharded { "a job with sharded state" } else { "a pipelined job" };
                return err("[checkpoint].every_minutes", format!("{which} checkpoints by every_steps only"));
            }
        }
        if self.job.layers == Some(0) || (self.job.layers.is_some() && self.job.model != ModelName::Gpt) {
            return err("[job].layers", "applies to model \"gpt\" only, and must be at least 1".into());
        }
        if !(self.revocation.poll_secs.is_finite() && self.revocation.poll_secs >= 0.1) {
            return err("[revocation].poll_secs", format!("{} is below 0.1 s", self.revocation.poll_secs));
        }
        match &self.security {
            None => {
                return err(
                    "[security]",
                    "missing: limpetd runs with certificates (ca, cert and key: limpet certs init / issue); \
                     on a network you trust, insecure = true runs without them"
                        .into(),
                )
            }
            Some(sec) if sec.insecure => {
                if sec.ca.is_some() || sec.cert.is_some() || sec.key.is_some() || sec.ssm.is_some() {
                    return err(
                        "[security].insecure",
                        "is true, but ca, cert, key or [security.ssm] is set too: choose one".into(),
                    );
                }
            }
            Some(sec) => {
                if let Some(ssm) = &sec.ssm {
                    limpet_deploy::ssm::check_prefix(&ssm.prefix).map_err(|e| ConfigError {
                        file: file.into(),
                        key: "[security.ssm].prefix".into(),
                        detail: e.to_string(),
                    })?;
                }
                sec.load(file, self.node_id())?;
            }
        }
        if let Some(c) = &self.capacity {
            c.validate(file)?;
            if c.spares == Some(true) && self.tls().and_then(|s| s.ssm.as_ref()).is_none() {
                return err(
                    "[capacity].spares",
                    "is true, but [security.ssm] says nowhere to find them".into(),
                );
            }
        }
        Ok(())
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

/// Parses `ID=ADDR` founder entries.
pub fn parse_founders(
    entries: &[String],
) -> Result<Vec<limpet_consensus::state::MemberSpec>, crate::UsageError> {
    entries
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
        .collect()
}

#[cfg(test)]
mod tests;

/// Where byte `offset` of a TOML file is, for a parse error: `[section].key (line N)`, or
/// `line N` outside a `key = value` line.
fn key_at(text: &str, offset: usize) -> String {
    let before = &text[..offset.min(text.len())];
    let line_no = before.lines().count().max(1);
    let line = text.lines().nth(line_no - 1).unwrap_or("");
    let section =
        before.lines().rev().map(str::trim).find(|l| l.starts_with('[') && l.ends_with(']')).unwrap_or("");
    match line.split_once('=') {
        Some((key, _)) if !key.trim().is_empty() && !line.trim_start().starts_with('[') => {
            format!("{section}.{} (line {line_no})", key.trim())
        }
        _ => format!("line {line_no}"),
    }
}

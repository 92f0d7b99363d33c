//! The agent's configuration: who it is, where it listens, the timings and policies its
//! tasks run by (`ControlConfig`, without libtorch), and the job it trains (`AgentConfig`).
//! Built by `limpetd` from its file (or by tools directly); read-only once the agent starts.

pub use crate::config_value::Stages;
use crate::config_value::{Bytes, Reserve, S3Url};
use crate::policy::{BaseBatch, BatchPolicy};
use crate::revocation::Source;
use limpet_consensus::state::{MemberSpec, NodeId};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The cluster secret: its bytes never appear in `{:?}` output (an agent's configuration is
/// logged and shown in errors).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, redacted>)", self.0.len())
    }
}

impl std::ops::Deref for Secret {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// What the agent's control part runs by (its consensus node, data plane, heartbeats,
/// revocation watchers and leader loop): everything but the job's training, so it builds
/// without libtorch (the lab's synthetic agents run it alone).
#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// Raft id.
    pub id: NodeId,
    /// Unique name.
    pub name: String,
    /// Cluster name.
    pub cluster: String,
    /// Consensus listen address.
    pub control: SocketAddr,
    /// Consensus address peers use (empty: the bound one).
    pub advertise_control: String,
    /// Data-plane listen address.
    pub data: SocketAddr,
    /// Data-plane address peers use (empty: the bound one).
    pub advertise_data: String,
    /// This host's failure domain (an availability zone, a rack; empty: not said), which
    /// the voters are spread over.
    pub zone: String,
    /// Whether this host's data plane takes reductions in two levels across zones (advertised
    /// in its record: an epoch takes them only when every host does).
    pub zone_levels: bool,
    /// State directory.
    pub state_dir: PathBuf,
    /// Cluster secret.
    pub secret: Secret,
    /// Founding members (identical on every founder), or `None` to join through `seeds`.
    pub bootstrap: Option<Vec<MemberSpec>>,
    /// Control addresses to join through.
    pub seeds: Vec<String>,
    /// Most raft voters (odd; `[cluster].max_voters`, identical on every founder: the first
    /// this many founders by id vote from the start).
    pub max_voters: usize,
    /// Batch / learning-rate policy.
    pub policy: BatchPolicy,
    /// World size the job's batch was declared for.
    pub base_world: u64,
    /// Fewest ranks training continues with.
    pub min_nodes: usize,
    /// A rank this many times slower per sample gets a smaller share (below 1: off).
    pub straggler_ratio: f64,
    /// Steps of an epoch before its measured speeds count.
    pub straggler_steps: u64,
    /// Revocation sources to poll.
    pub sources: Vec<Source>,
    /// Their poll interval.
    pub poll: Duration,
    /// Heartbeats, failure detection, the raft tick and how far ahead changes are planned
    /// (`[timing]`).
    pub timing: Timing,
    /// TCP congestion control of data-plane sockets (`None`: the host's default).
    pub dp_congestion: Option<String>,
    /// Durable checkpoints; `None` writes only the final one.
    pub checkpoint: Option<CheckpointSettings>,
    /// Mutual TLS on the control plane (and, with `tls_data`, the data plane); `None` runs
    /// in plain text with the cluster secret only.
    pub tls: Option<Arc<limpet_consensus::tls::Tls>>,
    /// Encrypt data-plane connections too (TLS 1.3) when `tls` is set; otherwise they are
    /// authenticated by the cluster secret only.
    pub tls_data: bool,
}

/// Everything an agent needs to run: its control part and the job it trains. Reads of the
/// control part's fields go through to it (`cfg.id`, `cfg.timing`).
#[cfg(feature = "trainer")]
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Who the agent is, where it listens, and how its control loops run (`ctl`, as
    /// `control` is where the consensus node listens).
    pub ctl: ControlConfig,
    /// The job.
    pub job: limpet_trainer::JobSpec,
    /// Where the job's data is (if not the default).
    pub data_path: Option<PathBuf>,
    /// Where this rank's parameters and optimizer state live.
    pub device: limpet_trainer::device::DeviceChoice,
    /// This host's local ranks' devices (`[node].devices`), one trainer thread each; empty:
    /// one rank on `device`.
    pub devices: Vec<limpet_trainer::device::Device>,
    /// The Hugging Face directory the job's weights start from (its fingerprint is in the job).
    pub init_from: Option<PathBuf>,
    /// Straggler drills (they sleep in `lab` builds only).
    pub slowdown: super::drill::Slowdown,
    /// Append one JSON line per completed step here.
    pub step_log: Option<PathBuf>,
    /// Pipeline parallelism; `None` trains plain data parallelism.
    pub pipeline: Option<PipelineSettings>,
}

#[cfg(feature = "trainer")]
impl std::ops::Deref for AgentConfig {
    type Target = ControlConfig;

    fn deref(&self) -> &ControlConfig {
        &self.ctl
    }
}

#[cfg(feature = "trainer")]
impl std::ops::DerefMut for AgentConfig {
    fn deref_mut(&mut self) -> &mut ControlConfig {
        &mut self.ctl
    }
}

/// `[pipeline]`: split the model into stages across hosts, laid out by the planner. The node
/// that sets the job profiles the model and records the profile with these in the job, so
/// every leader plans from the same numbers.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct PipelineSettings {
    /// Stages per data-parallel replica, or `"auto"` for the planner's choice.
    pub stages: Stages,
    /// Memory training may use on each device of a host (`16G`, `512M`, ...): a device of
    /// several holds a copy of the host's stage.
    #[serde(default = "default_memory")]
    pub memory: Bytes,
    /// Bandwidth between hosts, GB/s.
    #[serde(default = "default_link_gbps")]
    pub link_gbps: f64,
    /// One-way latency between hosts, ms.
    #[serde(default = "default_latency_ms")]
    pub latency_ms: f64,
    /// Mirror each stage's state to its neighbouring stage every this many steps (0: off),
    /// so a stage with no live replica costs at most this many steps, not the job.
    #[serde(default)]
    pub shadow_every: u64,
    /// Force the layout's block cuts (where each stage after the first starts) instead of
    /// the planner's; `stages` must then be their count plus one.
    pub cuts: Option<Vec<usize>>,
}

fn default_memory() -> Bytes {
    Bytes(16 << 30)
}

fn default_link_gbps() -> f64 {
    1.0
}

fn default_latency_ms() -> f64 {
    0.1
}

impl PipelineSettings {
    /// Stages per replica, or `None` for the planner's choice.
    pub fn depth(&self) -> Option<usize> {
        match self.stages {
            Stages::Fixed(n) => Some(n),
            Stages::Auto => None,
        }
    }

    /// The network between hosts.
    pub fn link(&self) -> crate::planner::Link {
        crate::planner::Link { bytes_per_s: self.link_gbps * 1e9, latency_ms: self.latency_ms }
    }
}

/// `[timing]`: how fast failures are detected and transitions planned.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct Timing {
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

impl Default for Timing {
    fn default() -> Timing {
        Timing {
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

impl Timing {
    /// Between heartbeats.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    /// Silence after which a node is failed.
    pub fn failure_timeout(&self) -> Duration {
        Duration::from_millis(self.failure_timeout_ms)
    }

    /// Data-plane timeout (a dead or silent peer is an error after this).
    pub fn data_timeout(&self) -> Duration {
        Duration::from_millis(self.data_timeout_ms)
    }

    /// The raft tick.
    pub fn raft_tick(&self) -> Duration {
        Duration::from_millis(self.raft_tick_ms)
    }

    /// How far ahead of the furthest rank a planned epoch change is scheduled.
    pub fn lead(&self) -> Duration {
        Duration::from_millis(self.lead_ms)
    }

    /// The margin kept before a revocation deadline.
    pub fn notice_margin(&self) -> Duration {
        Duration::from_millis(self.notice_margin_ms)
    }

    /// How long a SIGTERM drain may take.
    pub fn drain_grace(&self) -> Duration {
        Duration::from_secs(self.drain_grace_secs)
    }
}

impl ControlConfig {
    /// What the leader's decisions depend on, for a job of `global_batch` samples a step in
    /// micro-batches of `micro_batch`.
    pub fn leader_settings(&self, global_batch: u64, micro_batch: u64) -> crate::leader::LeaderSettings {
        crate::leader::LeaderSettings {
            heartbeat_ms: self.timing.heartbeat_ms,
            heartbeat_timeout_ms: self.timing.failure_timeout_ms,
            lead_ms: self.timing.lead_ms,
            notice_margin_ms: self.timing.notice_margin_ms,
            min_nodes: self.min_nodes,
            policy: self.policy,
            base: BaseBatch { global_batch, micro_batch, world: self.base_world.max(1) },
            straggler_ratio: self.straggler_ratio,
            straggler_steps: self.straggler_steps,
        }
    }

    /// A configuration with the defaults for everything but identity and addresses.
    pub fn new(id: NodeId, name: &str, cluster: &str, state_dir: PathBuf, secret: Vec<u8>) -> ControlConfig {
        ControlConfig {
            id,
            name: name.to_string(),
            cluster: cluster.to_string(),
            control: "127.0.0.1:0".parse().expect("address"),
            advertise_control: String::new(),
            data: "127.0.0.1:0".parse().expect("address"),
            advertise_data: String::new(),
            zone: String::new(),
            zone_levels: true,
            state_dir,
            secret: Secret(secret),
            bootstrap: None,
            seeds: Vec::new(),
            max_voters: limpet_consensus::membership::VoterPolicy::default().max_voters,
            policy: BatchPolicy::FixedGlobal,
            base_world: 1,
            min_nodes: 1,
            straggler_ratio: crate::balance::DEFAULT_RATIO,
            straggler_steps: 100,
            sources: Vec::new(),
            poll: Duration::from_secs(2),
            timing: Timing::default(),
            dp_congestion: Some(crate::dataplane::endpoint::DEFAULT_CONGESTION.to_string()),
            checkpoint: None,
            tls: None,
            tls_data: true,
        }
    }
}

#[cfg(feature = "trainer")]
impl AgentConfig {
    /// What the leader's decisions depend on.
    pub fn leader_settings(&self) -> crate::leader::LeaderSettings {
        self.ctl.leader_settings(self.job.global_batch as u64, self.job.micro_batch as u64)
    }

    /// The device this host's first rank trains on (`[node].devices`, else `[job].device` as
    /// it resolves here; the CPU where it does not): where the host's speed is measured.
    pub fn training_device(&self) -> limpet_trainer::device::Device {
        match self.devices.first() {
            Some(&d) => d,
            None => self.device.resolve().unwrap_or(limpet_trainer::device::Device::Cpu),
        }
    }

    /// A configuration with the defaults for everything but identity, addresses and job.
    pub fn new(
        id: NodeId,
        name: &str,
        cluster: &str,
        state_dir: PathBuf,
        secret: Vec<u8>,
        job: limpet_trainer::JobSpec,
    ) -> AgentConfig {
        AgentConfig {
            ctl: ControlConfig::new(id, name, cluster, state_dir, secret),
            job,
            data_path: None,
            device: limpet_trainer::device::DeviceChoice::Cpu,
            devices: Vec::new(),
            init_from: None,
            slowdown: Default::default(),
            step_log: None,
            pipeline: None,
        }
    }
}

/// `[checkpoint]`: periodic checkpoints that outlive every host, and resuming from them.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct CheckpointSettings {
    /// Write one every this many steps (0: not by steps).
    #[serde(default)]
    pub every_steps: u64,
    /// Write one when this many minutes passed since the last (0: not by time; data-parallel
    /// jobs only).
    #[serde(default)]
    pub every_minutes: f64,
    /// Where (a shared mount survives losing every host); `limpetd` fills in
    /// `STATE_DIR/checkpoints` when the file leaves it out.
    pub dir: Option<PathBuf>,
    /// How many checkpoints to keep (older ones are deleted).
    #[serde(default = "default_keep")]
    pub keep: usize,
    /// Whether a new cluster starts from the newest checkpoint of the same job: "required"
    /// (waits for a missing directory), "if-present" (the default) or "never".
    #[serde(default)]
    pub resume: Resume,
    /// Also copy every checkpoint to S3-compatible storage, `s3://BUCKET/PREFIX`; a new
    /// cluster resumes from there when `dir` has nothing newer.
    pub s3: Option<S3Url>,
    /// An S3-compatible endpoint (`http://minio:9000`); default AWS's.
    pub s3_endpoint: Option<String>,
    /// The region (default: the SDK's: environment, profile, instance metadata).
    pub s3_region: Option<String>,
    /// What a checkpoint must leave free on its disk (`256M`, `2G`; `0` for no reserve): a
    /// checkpoint that would leave less is not written (a warning, a metric and a status
    /// line), so checkpoints never take the room the raft log needs when they share a disk.
    #[serde(default = "default_min_free")]
    pub min_free: Reserve,
    /// Every host sees `dir` (a shared mount such as EFS): a job whose optimizer state is
    /// sharded then writes each checkpoint as shards, one per rank, at once, instead of
    /// gathering the whole state on every rank (with `s3`, each rank copies its own shard).
    #[serde(default)]
    pub shared: bool,
}

fn default_keep() -> usize {
    3
}

fn default_min_free() -> Reserve {
    Reserve(256 << 20)
}

impl CheckpointSettings {
    /// Checkpoints every `every_steps` steps and no other way (the rest as defaults).
    pub fn every_steps(every_steps: u64, dir: PathBuf) -> CheckpointSettings {
        CheckpointSettings {
            every_steps,
            every_minutes: 0.0,
            dir: Some(dir),
            keep: default_keep(),
            resume: Resume::default(),
            s3: None,
            s3_endpoint: None,
            s3_region: None,
            min_free: default_min_free(),
            shared: false,
        }
    }

    /// The time between checkpoints, if they are timed.
    pub fn every(&self) -> Option<Duration> {
        (self.every_minutes > 0.0).then(|| Duration::from_secs_f64(self.every_minutes * 60.0))
    }

    /// The directory (`checkpoints` in the working directory when nobody set one).
    pub fn dir(&self) -> &Path {
        self.dir.as_deref().unwrap_or(Path::new("checkpoints"))
    }

    /// Where copies go in S3-compatible storage, if anywhere.
    pub fn remote(&self) -> Option<crate::remote::RemoteSettings> {
        self.s3.as_ref().map(|url| crate::remote::RemoteSettings {
            bucket: url.bucket.clone(),
            prefix: url.prefix.clone(),
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
        })
    }
}

/// How a new cluster treats its checkpoints (`[checkpoint].resume`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Resume {
    /// Resume from the newest checkpoint of the job; a missing checkpoint directory (a shared
    /// mount not there yet) or a failed search is waited out and retried, never taken for
    /// "no checkpoint": starting at step 0 would throw the job's progress away for good.
    Required,
    /// Resume from the newest checkpoint if the directory holds one; a missing directory
    /// means a new job (step 0). A search that fails is still retried.
    #[default]
    IfPresent,
    /// Always start at step 0.
    Never,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration's `{:?}` (logged at start, shown in errors) names the secret's
    /// length, never its bytes.
    #[test]
    fn the_secret_stays_out_of_debug_output() {
        let secret = Secret(b"do-not-print-me-0123456789".to_vec());
        let shown = format!("{secret:?}");
        assert!(!shown.contains("do-not-print-me") && !shown.contains("100, 111"), "{shown}");
        assert!(shown.contains("26 bytes, redacted"), "{shown}");
        assert_eq!(&*secret, b"do-not-print-me-0123456789");
    }
}

//! The agent's configuration: who it is, where it listens, the job, and the timings and
//! policies its tasks run by. Built by `limpetd` from its file (or by tools directly);
//! read-only once the agent starts.

use crate::policy::{BaseBatch, BatchPolicy};
use crate::revocation::Source;
use limpet_consensus::state::{MemberSpec, NodeId};
use limpet_trainer::JobSpec;
use std::net::SocketAddr;
use std::path::PathBuf;
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

/// Everything an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
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
    /// State directory.
    pub state_dir: PathBuf,
    /// Cluster secret.
    pub secret: Secret,
    /// Founding members (identical on every founder), or `None` to join through `seeds`.
    pub bootstrap: Option<Vec<MemberSpec>>,
    /// Control addresses to join through.
    pub seeds: Vec<String>,
    /// The job.
    pub job: JobSpec,
    /// Where the job's data is (if not the default).
    pub data_path: Option<PathBuf>,
    /// Where this rank's parameters and optimizer state live.
    pub device: limpet_trainer::device::DeviceChoice,
    /// This host's local ranks' devices (`[node].devices`), one trainer thread each; empty:
    /// one rank on `device`.
    pub devices: Vec<limpet_trainer::device::Device>,
    /// The Hugging Face directory the job's weights start from (its fingerprint is in the job).
    pub init_from: Option<PathBuf>,
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
    /// Straggler drills (they sleep in `lab` builds only).
    pub slowdown: super::drill::Slowdown,
    /// Revocation sources to poll.
    pub sources: Vec<Source>,
    /// Their poll interval.
    pub poll: Duration,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Silence after which a node is failed.
    pub heartbeat_timeout: Duration,
    /// Data-plane timeout (a dead or silent peer is an error after this).
    pub dp_timeout: Duration,
    /// TCP congestion control of data-plane sockets (`None`: the host's default).
    pub dp_congestion: Option<String>,
    /// Raft tick.
    pub tick: Duration,
    /// Append one JSON line per completed step here.
    pub step_log: Option<PathBuf>,
    /// Time a planned epoch change is scheduled ahead of the furthest rank.
    pub lead: Duration,
    /// Margin kept before a revocation deadline.
    pub notice_margin: Duration,
    /// Pipeline parallelism; `None` trains plain data parallelism.
    pub pipeline: Option<PipelineSettings>,
    /// Durable checkpoints; `None` writes only the final one.
    pub checkpoint: Option<CheckpointSettings>,
    /// Mutual TLS on the control plane (and, with `tls_data`, the data plane); `None` runs
    /// in plain text with the cluster secret only.
    pub tls: Option<Arc<limpet_consensus::tls::Tls>>,
    /// Encrypt data-plane connections too (TLS 1.3) when `tls` is set; otherwise they are
    /// authenticated by the cluster secret only.
    pub tls_data: bool,
}

/// An agent's pipeline settings. The node that sets the job profiles the model and records
/// the profile with these in the job, so every leader plans from the same numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineSettings {
    /// Stages per replica, or `None` for the planner's choice.
    pub depth: Option<usize>,
    /// Forced block cuts instead of the planner's (the layout `--layout` names).
    pub cuts: Option<Vec<usize>>,
    /// Memory training may use on each host, bytes.
    pub mem_bytes: u64,
    /// The network between hosts.
    pub link: crate::planner::Link,
    /// Mirror each stage's state to its neighbouring stage every this many steps (0: off),
    /// so a stage with no live replica costs at most this many steps, not the job.
    pub shadow_every: u64,
}

impl AgentConfig {
    /// What the leader's decisions depend on.
    pub fn leader_settings(&self) -> crate::leader::LeaderSettings {
        crate::leader::LeaderSettings {
            heartbeat_ms: self.heartbeat.as_millis() as u64,
            heartbeat_timeout_ms: self.heartbeat_timeout.as_millis() as u64,
            lead_ms: self.lead.as_millis() as u64,
            notice_margin_ms: self.notice_margin.as_millis() as u64,
            min_nodes: self.min_nodes,
            policy: self.policy,
            base: BaseBatch {
                global_batch: self.job.global_batch as u64,
                micro_batch: self.job.micro_batch as u64,
                world: self.base_world.max(1),
            },
            straggler_ratio: self.straggler_ratio,
            straggler_steps: self.straggler_steps,
        }
    }

    /// A configuration with the defaults for everything but identity, addresses and job.
    pub fn new(
        id: NodeId,
        name: &str,
        cluster: &str,
        state_dir: PathBuf,
        secret: Vec<u8>,
        job: JobSpec,
    ) -> AgentConfig {
        AgentConfig {
            id,
            name: name.to_string(),
            cluster: cluster.to_string(),
            control: "127.0.0.1:0".parse().expect("address"),
            advertise_control: String::new(),
            data: "127.0.0.1:0".parse().expect("address"),
            advertise_data: String::new(),
            state_dir,
            secret: Secret(secret),
            bootstrap: None,
            seeds: Vec::new(),
            job,
            data_path: None,
            device: limpet_trainer::device::DeviceChoice::Cpu,
            devices: Vec::new(),
            init_from: None,
            policy: BatchPolicy::FixedGlobal,
            base_world: 1,
            min_nodes: 1,
            straggler_ratio: crate::balance::DEFAULT_RATIO,
            straggler_steps: 100,
            slowdown: Default::default(),
            sources: Vec::new(),
            poll: Duration::from_secs(2),
            heartbeat: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1000),
            dp_timeout: Duration::from_secs(3),
            dp_congestion: Some(crate::dataplane::endpoint::DEFAULT_CONGESTION.to_string()),
            tick: Duration::from_millis(50),
            step_log: None,
            lead: Duration::from_millis(400),
            notice_margin: Duration::from_millis(1000),
            pipeline: None,
            checkpoint: None,
            tls: None,
            tls_data: true,
        }
    }
}

/// When and where an agent writes checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointSettings {
    /// Every this many steps (0: not by steps).
    pub every_steps: u64,
    /// When this much time passed since the last (data-parallel jobs only).
    pub every: Option<Duration>,
    /// The directory (a shared mount survives losing every host).
    pub dir: PathBuf,
    /// How many checkpoints to keep.
    pub keep: usize,
    /// Whether (and how firmly) a new cluster resumes from the newest one found.
    pub resume: Resume,
    /// Also copy every part to S3-compatible storage (and resume from there).
    pub remote: Option<crate::remote::RemoteSettings>,
    /// Bytes a checkpoint must leave free on its disk (the raft log may share it).
    pub min_free: u64,
    /// Every host sees `dir` (a shared mount): a sharded job's ranks write their shards of
    /// a checkpoint there at once instead of gathering the state whole (and, with `remote`,
    /// each copies its own shard to S3).
    pub shared: bool,
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

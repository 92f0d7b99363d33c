//! The replicated state machine: `ClusterState` and the `Command`s that change it.
//!
//! Every agent applies the same committed commands in the same order, so `apply` is a pure
//! function of (state, command): it validates first and mutates only when the command is
//! accepted, and a rejected command leaves the state untouched on every node alike. Commands
//! reach the log as versioned JSON (`Proposal`), which keeps the log readable and lets a newer
//! agent refuse a record it does not understand instead of misreading it.

mod apply;
mod authority;
mod cause;
mod epoch_check;
mod fleet_log;
mod hardware;
mod revoked;
mod throughput;
pub use authority::{NotAllowed, Proposer};
pub use cause::{Cause, MAX_CAUSE_TEXT};
pub use fleet_log::{CapacityAction, CapacityLog, CapacityRecord, Market, Pool, MAX_CAPACITY_RECORDS};
pub use hardware::Hardware;
pub use revoked::{is_fingerprint, Revoked, MAX_REVOKED};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
pub use throughput::{Throughput, ThroughputLog, MAX_THROUGHPUT_WORLDS};

/// A node's id in the Raft group; never 0 (raft-rs reserves it).
pub type NodeId = u64;

/// Version of the `Proposal` and snapshot documents this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// How many checkpoint records the state keeps (the newest ones).
pub const MAX_CHECKPOINT_RECORDS: usize = 16;

/// How many started epochs the state remembers (the newest ones), for `limpet status`.
pub const MAX_EPOCH_HISTORY: usize = 32;

/// How many gone members' records the state keeps (the ones that left last): a fleet
/// that churns through spot hosts for months would otherwise carry every host it ever had
/// in every entry's state and every snapshot. A record still in the raft configuration or an
/// epoch is kept past the count until it leaves them.
pub const MAX_GONE_RECORDS: usize = 256;

/// Where a member is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemberStatus {
    /// Admitted, catching up (log, then training state); not yet training.
    Joining,
    /// Training in the current epoch (or ready to).
    Active,
    /// Asked to leave by an operator; leaves at the next epoch boundary.
    Draining,
    /// Received a revocation notice with a deadline.
    Leaving,
    /// Declared dead (collective error or missed heartbeats) without notice.
    Failed,
    /// Left the cluster; kept as a record.
    Gone,
}

impl MemberStatus {
    /// Whether the member is expected to stay: it can vote, train and serve state.
    pub fn is_staying(self) -> bool {
        matches!(self, MemberStatus::Joining | MemberStatus::Active)
    }
}

/// What a node says about itself when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSpec {
    /// Raft id.
    pub id: NodeId,
    /// Human name, unique among members that are not gone.
    pub name: String,
    /// Address of its consensus (gRPC) endpoint, `host:port`.
    pub control_addr: String,
    /// Address of its data-plane endpoint, `host:port`.
    pub data_addr: String,
    /// Its hardware.
    pub hardware: Hardware,
}

/// A member of the cluster as the log knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Identity and addresses.
    pub spec: MemberSpec,
    /// Where it is in its life.
    pub status: MemberStatus,
    /// Why it has this status (the command's reason), for `limpet status`.
    pub reason: String,
    /// For `Leaving`: when the cloud takes the host back, unix milliseconds.
    pub deadline_ms: Option<u64>,
}

/// How the ranks of an epoch are arranged: `data` replicas of a `pipeline`-stage pipeline,
/// rank `r * pipeline + s` being replica `r` of stage `s`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel replicas.
    pub data: u32,
    /// Pipeline stages per replica.
    pub pipeline: u32,
    /// The first block of every stage after the first (empty without a pipeline).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<u32>,
}

impl Layout {
    /// Plain data parallelism over `n` ranks.
    pub fn data_parallel(n: usize) -> Layout {
        Layout { data: n as u32, pipeline: 1, cuts: Vec::new() }
    }

    /// The block range of every stage of a model of `blocks` blocks, or why the cuts do not
    /// fit it.
    pub fn stage_blocks(&self, blocks: usize) -> Result<Vec<std::ops::Range<usize>>, Invalid> {
        let mut bounds = vec![0usize];
        bounds.extend(self.cuts.iter().map(|&c| c as usize));
        bounds.push(blocks);
        if bounds.len() != self.pipeline as usize + 1 || bounds.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Invalid(format!(
                "cuts {:?} do not split {blocks} blocks into {} stages",
                self.cuts, self.pipeline
            )));
        }
        Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
    }
}

/// How an epoch splits the global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochBatch {
    /// Samples per optimizer step over all ranks.
    pub global_batch: u64,
    /// Samples per forward/backward pass on one rank.
    pub micro_batch: u64,
}

/// The unit of consistency: who trains, from which step, and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Epoch {
    /// Strictly increasing over the life of the cluster.
    pub id: u64,
    /// The first step trained in this epoch.
    pub start_step: u64,
    /// Nodes in rank order.
    pub ranks: Vec<NodeId>,
    /// Data x pipeline arrangement of the ranks.
    pub layout: Layout,
    /// Batch plan of the epoch.
    pub batch: EpochBatch,
    /// Learning-rate multiplier chosen by the batch policy.
    pub lr_scale: f64,
    /// For each newcomer, the live peer it copies training state from. Written as a list of
    /// `[to, from]` pairs: a map with integer keys would not survive the tagged `Command`
    /// enum's decoding (JSON object keys are strings there).
    #[serde(with = "node_pairs")]
    pub sources: BTreeMap<NodeId, NodeId>,
    /// Why this epoch exists, as text for people: its `causes`, joined by ", ".
    pub cause: String,
    /// Why this epoch exists, as data (metric labels and tools read these, never the text).
    /// Empty in epochs logged before causes were recorded as data.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub causes: Vec<Cause>,
    /// Samples of each step's global batch each rank computes, in rank order, when a slower
    /// host gets a smaller share (data parallelism only); empty: equal shares.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<u64>,
    /// Each node's local ranks (its devices), in rank order, when some node has more than
    /// one; empty: one each. A node's share of the batch is its ranks' shares.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_ranks: Vec<u32>,
}

mod local_ranks;
pub use local_ranks::{MAX_LOCAL_RANKS, MAX_PIPELINE_LOCAL_RANKS};
mod node_pairs;

/// A durable checkpoint someone wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// Training step the checkpoint holds.
    pub step: u64,
    /// Epoch it was taken in.
    pub epoch: u64,
    /// The state's content hash (hex).
    pub content_hash: String,
    /// Where it was written (path or URL).
    pub location: String,
    /// Who wrote it.
    pub node: NodeId,
}

/// Every member's record by id. A record is shared between the copies of the state (the
/// one a node applies to and the one its readers still hold), so applying a batch copies
/// the map's spine and the records the batch changes, not every record of the fleet.
pub type Members = BTreeMap<NodeId, Arc<Member>>;

/// The replicated state every agent trusts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Cluster name; its hash is the cluster id on the wire.
    pub cluster: String,
    /// Every member admitted, and the newest [`MAX_GONE_RECORDS`] of those gone.
    pub members: Members,
    /// The gone members whose records are kept, in the order they left.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub gone: VecDeque<NodeId>,
    /// Raft voters, as of the last applied configuration change.
    pub voters: Vec<NodeId>,
    /// Raft learners, as of the last applied configuration change.
    pub learners: Vec<NodeId>,
    /// The job, as the trainer's JSON job spec; set once.
    pub job: Option<serde_json::Value>,
    /// The epoch being trained.
    pub current: Option<Epoch>,
    /// The next epoch, committed but not yet started.
    pub scheduled: Option<Epoch>,
    /// The newest checkpoint records, oldest first.
    pub checkpoints: Vec<CheckpointRecord>,
    /// The highest epoch id ever scheduled (withdrawn ones included): ids are never reused.
    #[serde(default)]
    pub last_epoch_id: u64,
    /// The newest started epochs, oldest first (the current one last); shared between the
    /// state's copies, as the members' records are.
    #[serde(default)]
    pub history: Vec<Arc<Epoch>>,
    /// The fleet reconciler's newest decisions.
    #[serde(default)]
    pub capacity: CapacityLog,
    /// Training throughput measured at each world size (what scaling by value fits).
    #[serde(default)]
    pub throughput: ThroughputLog,
    /// Certificates the cluster no longer accepts (`limpet certs revoke`).
    #[serde(default, skip_serializing_if = "Revoked::is_empty")]
    pub revoked: Revoked,
}

/// A change to the cluster state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Command {
    /// Admit a node (or re-admit a gone one, or refresh its addresses).
    Join {
        /// Who.
        member: MemberSpec,
    },
    /// A joining member caught up and trains.
    Activate {
        /// Who.
        id: NodeId,
    },
    /// The cloud will take the host back at `deadline_ms`.
    Notice {
        /// Who.
        id: NodeId,
        /// Unix milliseconds.
        deadline_ms: u64,
        /// Which watcher saw it (aws, gcp, azure, sigterm, cli).
        source: String,
    },
    /// An operator asked the node to leave.
    Drain {
        /// Who.
        id: NodeId,
        /// Why.
        reason: String,
    },
    /// The node died without notice.
    MarkFailed {
        /// Who.
        id: NodeId,
        /// What showed it.
        reason: String,
    },
    /// The node is out of the cluster.
    Remove {
        /// Who.
        id: NodeId,
        /// Why.
        reason: String,
    },
    /// New hardware facts, as the node reports them (e.g. measured throughput). The
    /// leader-measured `speed_milli` in them is ignored: see [`Command::RecordSpeed`].
    UpdateHardware {
        /// Who.
        id: NodeId,
        /// What it has now.
        hardware: Hardware,
    },
    /// The leader measured a host's compute speed against the cluster's typical host
    /// (`Hardware::speed_milli`, which the pipeline planner places blocks by). Only the
    /// leader's word sets it: a member's own record may not say it is faster than it is.
    RecordSpeed {
        /// Who.
        id: NodeId,
        /// Its speed relative to the typical host, x 1000.
        speed_milli: u64,
    },
    /// Set the job; refused once a different job is set.
    SetJob {
        /// The trainer's job spec.
        job: serde_json::Value,
    },
    /// Schedule the next epoch.
    ScheduleEpoch {
        /// The epoch.
        epoch: Epoch,
    },
    /// Withdraw the scheduled epoch before it starts (its nodes can no longer train).
    CancelEpoch {
        /// Its id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// The scheduled epoch started.
    ActivateEpoch {
        /// Its id.
        id: u64,
    },
    /// A checkpoint was written.
    RecordCheckpoint {
        /// What and where.
        record: CheckpointRecord,
    },
    /// The fleet reconciler decided or learned something.
    RecordCapacity {
        /// What and why.
        record: CapacityRecord,
    },
    /// The leader measured an epoch's throughput.
    RecordThroughput {
        /// At which world size, how fast.
        record: Throughput,
    },
    /// A leader's round of decisions as one entry (the failures of a mass event, removals
    /// and the epoch answering them), committed once and applied in order; a command the
    /// state refuses drops those after it, as if they had been proposed one by one.
    Round {
        /// The commands, in order (no round within a round).
        commands: Vec<Command>,
    },
    /// An operator revoked a certificate: no node accepts it from now on.
    RevokeCertificate {
        /// SHA-256 of the certificate's DER bytes, 64 lowercase hex digits.
        fingerprint: String,
        /// Whom it was issued to (for `limpet status` and the logs).
        name: String,
    },
}

/// Who proposed an entry: lets the proposer match the applied entry to its waiting caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProposalId {
    /// The node that accepted the request.
    pub node: NodeId,
    /// Its sequence number on that node.
    pub seq: u64,
}

/// A log entry's payload: a versioned command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Proposal {
    /// `FORMAT_VERSION` of the writer.
    pub v: u32,
    /// Who proposed it.
    pub origin: ProposalId,
    /// The change.
    pub command: Command,
}

/// Why a document could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {detail}")]
pub struct DecodeError {
    /// Which document.
    pub what: &'static str,
    /// What was wrong.
    pub detail: String,
}

impl Proposal {
    /// Encodes as the JSON stored in the log.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("proposals always serialize")
    }

    /// Decodes a log entry's payload, refusing other versions and malformed commands.
    pub fn decode(bytes: &[u8]) -> Result<Proposal, DecodeError> {
        decode_versioned("proposal", bytes, |p: &Proposal| p.v)
    }
}

impl Command {
    /// Decodes a command as the CLI and `Propose` RPC send it.
    pub fn decode(bytes: &[u8]) -> Result<Command, DecodeError> {
        serde_json::from_slice(bytes).map_err(|e| DecodeError { what: "command", detail: e.to_string() })
    }

    /// The member a command is about, if any.
    pub fn subject(&self) -> Option<NodeId> {
        match self {
            Command::Join { member } => Some(member.id),
            Command::Activate { id }
            | Command::Notice { id, .. }
            | Command::Drain { id, .. }
            | Command::MarkFailed { id, .. }
            | Command::Remove { id, .. }
            | Command::UpdateHardware { id, .. }
            | Command::RecordSpeed { id, .. } => Some(*id),
            _ => None,
        }
    }
}

/// A snapshot's payload: the state at the snapshot's index, tagged with its cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotData {
    /// `FORMAT_VERSION` of the writer.
    pub v: u32,
    /// The cluster id it belongs to.
    pub cluster_id: u64,
    /// The state.
    pub state: ClusterState,
}

impl SnapshotData {
    /// Encodes as the bytes carried in a raft snapshot.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("states always serialize")
    }

    /// The bytes [`SnapshotData::encode`] gives for `state` of this build's format, without
    /// a copy of the state.
    pub fn encode_state(cluster_id: u64, state: &ClusterState) -> Vec<u8> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            v: u32,
            cluster_id: u64,
            state: &'a ClusterState,
        }
        serde_json::to_vec(&Borrowed { v: FORMAT_VERSION, cluster_id, state })
            .expect("states always serialize")
    }

    /// Decodes and checks version, cluster and the state's own invariants.
    pub fn decode(bytes: &[u8], cluster_id: u64) -> Result<SnapshotData, DecodeError> {
        let d: SnapshotData = decode_versioned("snapshot", bytes, |d: &SnapshotData| d.v)?;
        if d.cluster_id != cluster_id {
            return Err(DecodeError {
                what: "snapshot",
                detail: format!("belongs to cluster {:#018x}, not {cluster_id:#018x}", d.cluster_id),
            });
        }
        d.state.validate().map_err(|e| DecodeError { what: "snapshot", detail: e.0 })?;
        Ok(d)
    }
}

/// Parses a JSON document of ours and refuses other format versions.
fn decode_versioned<T: serde::de::DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
    version: impl Fn(&T) -> u32,
) -> Result<T, DecodeError> {
    let doc: T = serde_json::from_slice(bytes).map_err(|e| DecodeError { what, detail: e.to_string() })?;
    let v = version(&doc);
    if v != FORMAT_VERSION {
        return Err(DecodeError {
            what,
            detail: format!("format version {v} (this build reads {FORMAT_VERSION})"),
        });
    }
    Ok(doc)
}

/// The id of a node named `name` whose configuration sets no `[node].id` (never 0).
pub fn node_id_of_name(name: &str) -> NodeId {
    let h = blake3::hash(name.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")).max(1)
}

/// The wire id of a cluster name.
pub fn cluster_id(name: &str) -> u64 {
    let h = blake3::hash(name.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// Why the state machine refused a command: the same on every node, and told to its proposer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A replicated state that breaks one of its invariants (what a corrupt or crafted snapshot
/// shows).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl From<Refused> for Invalid {
    /// What the log would refuse to add cannot be in a state it holds.
    fn from(r: Refused) -> Invalid {
        Invalid(r.0)
    }
}

/// What the state machine made of a command: what it did, or why it refused it.
pub type Outcome = Result<String, Refused>;

/// How many founders vote in a cluster's first configuration: a constant of the code, the
/// same on every founder whatever its configuration says (see [`ClusterState::founded`]).
pub const FOUNDING_VOTERS: usize = 5;

impl ClusterState {
    /// An empty cluster with the given bootstrap members (all Active) and voters.
    pub fn bootstrap(cluster: &str, members: &[MemberSpec]) -> ClusterState {
        let mut state = ClusterState {
            cluster: cluster.to_string(),
            members: BTreeMap::new(),
            gone: VecDeque::new(),
            voters: members.iter().map(|m| m.id).collect(),
            learners: Vec::new(),
            job: None,
            current: None,
            scheduled: None,
            checkpoints: Vec::new(),
            last_epoch_id: 0,
            history: Vec::new(),
            capacity: CapacityLog::default(),
            throughput: ThroughputLog::default(),
            revoked: Revoked::default(),
        };
        state.voters.sort_unstable();
        for m in members {
            state.members.insert(
                m.id,
                Arc::new(Member {
                    spec: m.clone(),
                    status: MemberStatus::Active,
                    reason: "bootstrap".into(),
                    deadline_ms: None,
                }),
            );
        }
        state
    }

    /// A cluster founded by `members` (identical on every founder), of which the first
    /// `max_voters` by id vote and the rest are learners from the start. Were every founder
    /// a voter until a leader demoted the extras, a fleet of 64 founders had no leader: 64
    /// candidates splitting the votes, each sending its reports to all 63 others, on cores
    /// that could not keep up with that. Nodes pass [`FOUNDING_VOTERS`], never a configured
    /// number: founders that disagreed on it would start from configurations whose
    /// majorities need not overlap (raft-rs grants a vote to a candidate its configuration
    /// holds as a learner), and two leaders could commit in one term. The leader's voter
    /// controller then moves to `[cluster].max_voters` through the log.
    pub fn founded(cluster: &str, members: &[MemberSpec], max_voters: usize) -> ClusterState {
        let mut state = ClusterState::bootstrap(cluster, members);
        if state.voters.len() > max_voters.max(1) {
            state.learners = state.voters.split_off(max_voters.max(1));
        }
        state
    }

    /// Checks the state's invariants; run after every change in debug builds and on every
    /// snapshot received.
    pub fn validate(&self) -> Result<(), Invalid> {
        for (id, m) in &self.members {
            if *id != m.spec.id || *id == 0 {
                return Err(Invalid(format!("member entry {id} holds node {}", m.spec.id)));
            }
        }
        if let Some(v) = self.voters.iter().find(|v| self.learners.contains(v)) {
            return Err(Invalid(format!("node {v} is both voter and learner")));
        }
        let mut seen = std::collections::BTreeSet::new();
        for id in &self.gone {
            if !seen.insert(*id) || self.members.get(id).is_none_or(|m| m.status != MemberStatus::Gone) {
                return Err(Invalid(format!("node {id} is listed as gone twice or is not a gone member")));
            }
        }
        if let (Some(c), Some(s)) = (&self.current, &self.scheduled) {
            if s.id <= c.id {
                return Err(Invalid(format!("scheduled epoch {} is not after current epoch {}", s.id, c.id)));
            }
        }
        if let Some(e) = self.scheduled.as_ref().or(self.current.as_ref()) {
            if e.id > self.last_epoch_id {
                return Err(Invalid(format!(
                    "epoch {} is above the highest id ever scheduled ({})",
                    e.id, self.last_epoch_id
                )));
            }
        }
        for w in self.checkpoints.windows(2) {
            if w[1].step < w[0].step {
                return Err(Invalid(format!("checkpoint records out of order at step {}", w[1].step)));
            }
        }
        if self.checkpoints.len() > MAX_CHECKPOINT_RECORDS {
            return Err(Invalid(format!("{} checkpoint records kept", self.checkpoints.len())));
        }
        self.capacity.validate()?;
        self.throughput.validate()?;
        self.revoked.validate()?;
        if let Some(e) = &self.current {
            if e.ranks.iter().any(|r| !self.members.contains_key(r)) {
                return Err(Invalid(format!("current epoch {} names a node that is not a member", e.id)));
            }
        }
        Ok(())
    }

    /// The member with this name, if any (gone members last).
    pub fn member_named(&self, name: &str) -> Option<&Member> {
        let mut found: Vec<_> = self.members.values().filter(|m| m.spec.name == name).collect();
        found.sort_by_key(|m| m.status == MemberStatus::Gone);
        found.first().map(|m| &***m)
    }
}

#[cfg(test)]
mod tests;

//! What a host has, as its agent reports it in its membership record.

use serde::{Deserialize, Serialize};

/// What a host has, as its agent reports it. Equal as the log reads it: `ranks` 0 (absent, as
/// a host of one rank writes it) and 1 are the same host.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Hardware {
    /// Cloud instance type or "local".
    pub instance_type: String,
    /// CPU cores.
    pub cpus: u32,
    /// Accelerators (0 on CPU hosts).
    pub gpus: u32,
    /// Their model names as the driver reports them, distinct ones joined by ", " (empty on
    /// CPU hosts; absent in records of older agents).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu_model: String,
    /// Host memory in MiB.
    pub memory_mib: u64,
    /// Measured training throughput, samples per second x 1000 (0 until measured); an
    /// integer so that every node applies exactly the same value.
    pub samples_per_sec_milli: u64,
    /// Its compute speed relative to the cluster's typical host, x 1000, as the leader
    /// measured it (what the pipeline planner places blocks by; 0: not measured, as 1000).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub speed_milli: u64,
    /// The ranks this host trains with (`[node].devices`: one per device), absent in records
    /// of agents that train with one (0 reads as 1).
    #[serde(default, skip_serializing_if = "one_or_none")]
    pub ranks: u32,
    /// What its ranks train on, `cuda` or `cpu` (empty in records of older agents): a GPU
    /// host training on its CPU is worth seeing in `limpet status`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub device: String,
    /// Its failure domain (`[node].zone`: an availability zone, a rack), empty when not
    /// said: the voters are spread over zones so that losing one keeps a quorum.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// Its data plane takes small collectives over a butterfly (absent in records of older
    /// agents): a group of many ranks connects one only when every rank's host does, so a
    /// cluster upgraded host by host keeps forming its groups.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub butterfly: bool,
    /// Its agent reads the peers a report says refused it (`refused`, absent in records of
    /// older agents, whose reports refuse unknown fields): a node names them only once every
    /// voter's record says so, so a cluster upgraded host by host drops no report.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refused_reports: bool,
    /// Its data plane takes large reductions in two levels, inside its zone and across
    /// zones (absent in records of older agents): an epoch whose hosts span several zones
    /// connects them only when every rank's host does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub zone_levels: bool,
}

fn one_or_none(v: &u32) -> bool {
    *v <= 1
}

impl Hardware {
    /// The ranks this host trains with (at least one).
    pub fn local_ranks(&self) -> u32 {
        self.ranks.max(1)
    }
}

impl PartialEq for Hardware {
    fn eq(&self, o: &Hardware) -> bool {
        // Every field, `ranks` as it reads: an agent's own record (one rank, `ranks: 1`)
        // comes back from the log without the field, and must still be the same record
        // (otherwise the agent announces itself again and again).
        let Hardware {
            instance_type,
            cpus,
            gpus,
            gpu_model,
            memory_mib,
            samples_per_sec_milli,
            speed_milli,
            ranks: _,
            device,
            zone,
            butterfly,
            refused_reports,
            zone_levels,
        } = self;
        (
            instance_type,
            cpus,
            gpus,
            gpu_model,
            memory_mib,
            samples_per_sec_milli,
            speed_milli,
            device,
            zone,
            butterfly,
            refused_reports,
            zone_levels,
        ) == (
            &o.instance_type,
            &o.cpus,
            &o.gpus,
            &o.gpu_model,
            &o.memory_mib,
            &o.samples_per_sec_milli,
            &o.speed_milli,
            &o.device,
            &o.zone,
            &o.butterfly,
            &o.refused_reports,
            &o.zone_levels,
        ) && self.local_ranks() == o.local_ranks()
    }
}

impl Eq for Hardware {}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

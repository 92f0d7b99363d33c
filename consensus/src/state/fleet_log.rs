//! The fleet's capacity decisions as the log records them: what the leader's reconciler
//! decided (launch, terminate, drain, hold), why, and what EC2 answered. They are in the log,
//! not in one leader's memory, so a new leader knows which pools just ran out of spot
//! capacity, since when spot has been unobtainable, and which launch was decided but not yet
//! confirmed (it looks for that launch's instances before it launches again).

use super::NodeId;
use super::{Invalid, Refused};
use serde::{Deserialize, Serialize};

/// How many capacity records the state keeps (the newest ones).
pub const MAX_CAPACITY_RECORDS: usize = 64;

/// Where a host can be launched: an instance type in a subnet (so, a zone).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Pool {
    /// EC2 instance type.
    pub instance_type: String,
    /// Subnet id (empty: the launch template's).
    pub subnet: String,
}

impl std::fmt::Display for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.subnet.is_empty() {
            write!(f, "{}", self.instance_type)
        } else {
            write!(f, "{} in {}", self.instance_type, self.subnet)
        }
    }
}

/// How a host is bought.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Market {
    /// Spot: cheap, revocable.
    Spot,
    /// On-demand: the fallback while spot is unobtainable.
    OnDemand,
}

impl Market {
    /// `spot` or `on-demand`, as EC2 spells an instance's lifecycle.
    pub fn as_str(self) -> &'static str {
        match self {
            Market::Spot => "spot",
            Market::OnDemand => "on-demand",
        }
    }
}

/// One thing the reconciler decided or learned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CapacityAction {
    /// Nothing to do (the reason says why).
    Hold,
    /// Launch one host. `token` is EC2's idempotency token and the instance's
    /// `limpet:launch` tag, so a leader that finds this record unconfirmed can tell whether
    /// the launch happened before it repeats it.
    Launch {
        /// Where.
        pool: Pool,
        /// Spot or on-demand.
        market: Market,
        /// Idempotency token and tag value.
        token: String,
        /// The node name the host takes (a spare credential), if credentials are issued so.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node_name: Option<String>,
    },
    /// EC2 launched what record `launch` decided.
    Launched {
        /// The `Launch` record's sequence number.
        launch: u64,
        /// The instances.
        instances: Vec<String>,
    },
    /// EC2 refused what record `launch` decided.
    Failed {
        /// The `Launch` record's sequence number.
        launch: u64,
        /// EC2's error code (or what failed before EC2 answered).
        code: String,
        /// True for a capacity error: that pool is skipped for a while.
        capacity: bool,
    },
    /// Terminate instances that hold no live member (never joined, or their member is gone).
    Terminate {
        /// The instances.
        instances: Vec<String>,
    },
    /// Drain a member (an on-demand host once spot capacity replaced it, a host scaling by
    /// value no longer pays for, a host that stays slow once its replacement trains).
    Drain {
        /// The member.
        node: NodeId,
        /// Its instance.
        instance: String,
    },
    /// Scaling by value chose another number of hosts (the reason carries the numbers).
    Scale {
        /// Hosts wanted from now on.
        target: u32,
    },
}

impl CapacityAction {
    /// A short name for metric labels and tables.
    pub fn label(&self) -> &'static str {
        match self {
            CapacityAction::Hold => "hold",
            CapacityAction::Launch { .. } => "launch",
            CapacityAction::Launched { .. } => "launched",
            CapacityAction::Failed { .. } => "failed",
            CapacityAction::Terminate { .. } => "terminate",
            CapacityAction::Drain { .. } => "drain",
            CapacityAction::Scale { .. } => "scale",
        }
    }
}

/// A capacity record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityRecord {
    /// Sequence number: the previous record's plus one, so two leaders cannot both record
    /// a decision taken from the same view.
    pub seq: u64,
    /// When (unix milliseconds, the proposer's clock).
    pub at_ms: u64,
    /// Which leader decided.
    pub by: NodeId,
    /// What.
    pub action: CapacityAction,
    /// Why, in words.
    pub reason: String,
}

/// The capacity records the state keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityLog {
    /// The newest records, oldest first.
    pub records: Vec<CapacityRecord>,
    /// The highest sequence number ever recorded.
    pub last_seq: u64,
    /// The number of hosts scaling by value chose last (kept when its record is pruned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<u32>,
}

impl CapacityLog {
    /// The `Launch` record `seq`, if kept.
    pub fn launch(&self, seq: u64) -> Option<&CapacityRecord> {
        self.records.iter().find(|r| r.seq == seq && matches!(r.action, CapacityAction::Launch { .. }))
    }

    /// Whether launch `seq` has an outcome recorded.
    pub fn resolved(&self, seq: u64) -> bool {
        self.records.iter().any(|r| match r.action {
            CapacityAction::Launched { launch, .. } | CapacityAction::Failed { launch, .. } => launch == seq,
            _ => false,
        })
    }

    /// The oldest launch decided but not confirmed or refused.
    pub fn unresolved(&self) -> Option<&CapacityRecord> {
        self.records
            .iter()
            .find(|r| matches!(r.action, CapacityAction::Launch { .. }) && !self.resolved(r.seq))
    }

    /// Records `r` if it follows the last record and names launches that exist.
    pub(super) fn apply(&mut self, r: &CapacityRecord) -> super::Outcome {
        if r.seq != self.last_seq + 1 {
            return Err(Refused(format!(
                "capacity record {} does not follow record {} (another leader decided first)",
                r.seq, self.last_seq
            )));
        }
        match &r.action {
            CapacityAction::Launched { launch, .. } | CapacityAction::Failed { launch, .. } => {
                if self.launch(*launch).is_none() {
                    return Err(Refused(format!(
                        "capacity record {}: launch {launch} is not recorded",
                        r.seq
                    )));
                }
                if self.resolved(*launch) {
                    return Err(Refused(format!(
                        "capacity record {}: launch {launch} already has an outcome",
                        r.seq
                    )));
                }
            }
            CapacityAction::Launch { token, .. } if token.is_empty() || token.len() > 64 => {
                return Err(Refused(format!(
                    "capacity record {}: a launch token is 1 to 64 characters",
                    r.seq
                )));
            }
            CapacityAction::Scale { target } if *target == 0 || *target > 100_000 => {
                return Err(Refused(format!("capacity record {}: a target of {target} hosts", r.seq)));
            }
            CapacityAction::Scale { target } => self.target = Some(*target),
            _ => {}
        }
        self.last_seq = r.seq;
        self.records.push(r.clone());
        if self.records.len() > MAX_CAPACITY_RECORDS {
            self.records.remove(0);
        }
        Ok(format!("capacity {} recorded: {}", r.action.label(), r.reason))
    }

    /// The log's invariants.
    pub(super) fn validate(&self) -> Result<(), super::Invalid> {
        if self.records.len() > MAX_CAPACITY_RECORDS {
            return Err(Invalid(format!("{} capacity records kept", self.records.len())));
        }
        for w in self.records.windows(2) {
            if w[1].seq != w[0].seq + 1 {
                return Err(Invalid(format!("capacity records out of sequence at {}", w[1].seq)));
            }
        }
        match self.records.last() {
            Some(r) if r.seq != self.last_seq => {
                Err(Invalid(format!("the last capacity record is {}, the log says {}", r.seq, self.last_seq)))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, action: CapacityAction) -> CapacityRecord {
        CapacityRecord { seq, at_ms: seq * 1000, by: 1, action, reason: "test".into() }
    }

    fn launch() -> CapacityAction {
        CapacityAction::Launch {
            pool: Pool { instance_type: "g5.xlarge".into(), subnet: "subnet-a".into() },
            market: Market::Spot,
            token: "t-1".into(),
            node_name: None,
        }
    }

    #[test]
    fn records_follow_each_other_and_outcomes_name_an_open_launch() {
        let mut log = CapacityLog::default();
        log.apply(&rec(1, launch())).unwrap();
        assert_eq!(log.unresolved().map(|r| r.seq), Some(1));
        // A second leader that decided from the same view is refused.
        assert!(log.apply(&rec(1, CapacityAction::Hold)).unwrap_err().0.contains("another leader"));
        assert!(log
            .apply(&rec(2, CapacityAction::Failed { launch: 7, code: "x".into(), capacity: true }))
            .is_err());
        log.apply(&rec(2, CapacityAction::Launched { launch: 1, instances: vec!["i-1".into()] })).unwrap();
        assert!(log.unresolved().is_none());
        let again = rec(3, CapacityAction::Failed { launch: 1, code: "x".into(), capacity: false });
        assert!(log.apply(&again).unwrap_err().0.contains("already"));
        for seq in 3..200 {
            log.apply(&rec(seq, CapacityAction::Hold)).unwrap();
        }
        assert_eq!(log.records.len(), MAX_CAPACITY_RECORDS);
        log.validate().unwrap();
    }
}

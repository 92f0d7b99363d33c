//! Why an epoch exists, as data: the events the controller answered with it. Metric labels
//! and tools read these; the epoch's `cause` text is only their display.

use super::{MemberStatus, NodeId};
use serde::{Deserialize, Serialize};

/// One event an epoch answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// The cluster's first epoch.
    Start,
    /// A rank of the current epoch failed (`why`: what the leader saw, when it marked it).
    Failure {
        /// The failed node.
        node: NodeId,
        /// What the leader saw.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        why: Option<String>,
    },
    /// A rank got a revocation notice.
    Notice {
        /// The revoked node.
        node: NodeId,
        /// The notice's source and deadline, as recorded.
        reason: String,
    },
    /// A rank is drained.
    Drain {
        /// The drained node.
        node: NodeId,
    },
    /// A rank can no longer train for another reason (its status says which).
    Unavailable {
        /// The node.
        node: NodeId,
        /// Its status in the log.
        status: MemberStatus,
    },
    /// A node joins training.
    Join {
        /// The newcomer.
        node: NodeId,
    },
    /// A collective failed while every rank stayed alive: the same ranks reconnect.
    Rebuild,
    /// A rank computes slower than the others: the samples of each step are shared out by
    /// measured speed.
    Balance {
        /// The slowest rank.
        node: NodeId,
        /// Its time per sample over the fastest rank's, in thousandths.
        slower_milli: u64,
    },
    /// The planner chose another layout for the same ranks.
    Replan {
        /// Data-parallel replicas.
        data: u32,
        /// Pipeline stages per replica.
        pipeline: u32,
    },
}

impl Cause {
    /// The kind of event, from a small fixed set (a metric label: node ids stay out).
    pub fn kind(&self) -> &'static str {
        match self {
            Cause::Start => "start",
            Cause::Failure { .. } => "failure",
            Cause::Notice { .. } => "notice",
            Cause::Drain { .. } => "drain",
            Cause::Unavailable { .. } => "other",
            Cause::Join { .. } => "join",
            Cause::Rebuild => "rebuild",
            Cause::Replan { .. } => "replan",
            Cause::Balance { .. } => "balance",
        }
    }

    /// The epoch's text for these causes.
    pub fn text(causes: &[Cause]) -> String {
        causes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Start => write!(f, "first epoch"),
            Cause::Failure { node, why: Some(why) } => write!(f, "failure of node {node} ({why})"),
            Cause::Failure { node, why: None } => write!(f, "failure of node {node}"),
            Cause::Notice { node, reason } => write!(f, "notice for node {node} ({reason})"),
            Cause::Drain { node } => write!(f, "drain of node {node}"),
            Cause::Unavailable { node, status } => write!(f, "node {node} is {status:?}"),
            Cause::Join { node } => write!(f, "join of node {node}"),
            Cause::Rebuild => write!(f, "collective failure with every rank alive"),
            Cause::Replan { data, pipeline } => write!(f, "re-plan to a {data}x{pipeline} layout"),
            Cause::Balance { node, slower_milli: 0 } => {
                write!(f, "equal shares again (node {node} keeps up)")
            }
            Cause::Balance { node, slower_milli } => {
                write!(f, "node {node} is {:.2}x slower: shares by speed", *slower_milli as f64 / 1000.0)
            }
        }
    }
}

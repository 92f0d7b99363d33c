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

    /// The epoch's text for these causes: each named while they fit in
    /// [`MAX_CAUSE_TEXT`] bytes; past that (a zone's worth of revocations, a wave of joins), a
    /// summary by kind with counts and the first few nodes, so the text every report and
    /// status carries stays small whatever the fleet.
    pub fn text(causes: &[Cause]) -> String {
        let whole = causes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        if whole.len() <= MAX_CAUSE_TEXT {
            return whole;
        }
        let mut kinds: Vec<(&'static str, Vec<NodeId>, usize)> = Vec::new();
        for c in causes {
            let kind = c.kind();
            let i = match kinds.iter().position(|(k, _, _)| *k == kind) {
                Some(i) => i,
                None => {
                    kinds.push((kind, Vec::new(), 0));
                    kinds.len() - 1
                }
            };
            kinds[i].2 += 1;
            if let Some(n) = c.node() {
                kinds[i].1.push(n);
            }
        }
        let part = |(kind, nodes, count): &(&str, Vec<NodeId>, usize)| {
            let shown: Vec<String> = nodes.iter().take(NODES_NAMED).map(ToString::to_string).collect();
            let more = nodes.len().saturating_sub(NODES_NAMED);
            let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
            if nodes.is_empty() {
                format!("{count} {kind}")
            } else {
                format!("{count} {kind} (nodes {}{tail})", shown.join(", "))
            }
        };
        kinds.iter().map(part).collect::<Vec<_>>().join(", ")
    }

    /// The node the event is about, if one.
    pub fn node(&self) -> Option<NodeId> {
        match self {
            Cause::Failure { node, .. }
            | Cause::Notice { node, .. }
            | Cause::Drain { node }
            | Cause::Unavailable { node, .. }
            | Cause::Join { node }
            | Cause::Balance { node, .. } => Some(*node),
            Cause::Start | Cause::Rebuild | Cause::Replan { .. } => None,
        }
    }
}

/// The longest cause text an epoch carries before it is summarised (reports copy it).
pub const MAX_CAUSE_TEXT: usize = 512;

/// Nodes a summarised cause names per kind.
const NODES_NAMED: usize = 8;

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

#[cfg(test)]
mod tests {
    use super::*;

    /// A few causes are named one by one; two hundred failures and fifty notices are counted
    /// by kind with their first nodes, in a text that stays small.
    #[test]
    fn a_mass_event_is_summarised_in_a_bounded_text() {
        let few = [Cause::Failure { node: 3, why: None }, Cause::Join { node: 9 }];
        assert_eq!(Cause::text(&few), "failure of node 3, join of node 9");
        let why = Some("silent for 400 ms (heartbeat timeout 300 ms)".to_string());
        let mut many: Vec<Cause> = (1..=200).map(|node| Cause::Failure { node, why: why.clone() }).collect();
        many.extend((300..350).map(|node| Cause::Notice { node, reason: "aws notice".into() }));
        let text = Cause::text(&many);
        assert_eq!(
            text,
            "200 failure (nodes 1, 2, 3, 4, 5, 6, 7, 8 and 192 more), 50 notice (nodes 300, 301, 302, 303, 304, 305, 306, 307 and 42 more)"
        );
        let all_kinds: Vec<Cause> = (0..2000u64)
            .map(|n| match n % 3 {
                0 => Cause::Join { node: u64::MAX - n },
                1 => Cause::Drain { node: u64::MAX - n },
                _ => Cause::Failure { node: u64::MAX - n, why: why.clone() },
            })
            .collect();
        assert!(Cause::text(&all_kinds).len() < 2 * MAX_CAUSE_TEXT, "{}", Cause::text(&all_kinds));
    }
}

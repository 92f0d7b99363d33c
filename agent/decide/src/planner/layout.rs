//! A planned layout: its stages, their blocks and hosts, and its text form (`--layout`).

use super::PlanError;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One pipeline stage of a layout: a block range and the host of each replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageLayout {
    /// First block.
    pub start: usize,
    /// One past the last block.
    pub end: usize,
    /// Host of replica `r` of this stage, for every replica.
    pub hosts: Vec<String>,
}

/// A data x pipeline layout with the host of every stage replica (the cluster state's
/// `Layout` is its shape only: replicas, stages, cuts).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLayout {
    /// Data-parallel replicas.
    pub data: usize,
    /// Samples per micro-batch (0: as large as the profile's micro-batch allows).
    pub micro_batch: usize,
    /// Stages in pipeline order.
    pub stages: Vec<StageLayout>,
}

impl HostLayout {
    /// Pipeline depth.
    pub fn pipeline(&self) -> usize {
        self.stages.len()
    }

    /// The block cuts: where each stage after the first starts.
    pub fn cuts(&self) -> Vec<usize> {
        self.stages.iter().skip(1).map(|s| s.start).collect()
    }
}

impl std::str::FromStr for HostLayout {
    type Err = PlanError;

    /// Parses `START..END@HOST[,HOST...]` stages joined by `|`, in pipeline order, optionally
    /// followed by `;micro=N`; every stage names one host per data-parallel replica, e.g.
    /// `0..2@a,b|2..4@c,d;micro=8` (2 x 2, micro-batches of 8).
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let bad = |m: String| PlanError::Layout(m);
        let (s, micro_batch) = match s.split_once(';') {
            Some((l, m)) => {
                let n = m
                    .trim()
                    .strip_prefix("micro=")
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| bad(format!("{m:?} is not micro=N with N at least 1")))?;
                (l, n)
            }
            None => (s, 0),
        };
        let mut stages = Vec::new();
        for (i, part) in s.split('|').enumerate() {
            let (range, hosts) = part
                .split_once('@')
                .ok_or_else(|| bad(format!("stage {i} ({part:?}) is not START..END@HOST[,HOST...]")))?;
            let (a, b) = range
                .split_once("..")
                .ok_or_else(|| bad(format!("stage {i}: block range {range:?} is not START..END")))?;
            let num = |v: &str| {
                v.trim().parse::<usize>().map_err(|_| bad(format!("stage {i}: {v:?} is not a block number")))
            };
            let hosts: Vec<String> = hosts.split(',').map(|h| h.trim().to_string()).collect();
            if hosts.iter().any(String::is_empty) {
                return Err(bad(format!("stage {i}: an empty host name in {part:?}")));
            }
            stages.push(StageLayout { start: num(a)?, end: num(b)?, hosts });
        }
        let data = stages[0].hosts.len();
        if let Some((i, s)) = stages.iter().enumerate().find(|(_, s)| s.hosts.len() != data) {
            return Err(bad(format!("stage {i} names {} hosts but stage 0 names {data}", s.hosts.len())));
        }
        Ok(HostLayout { data, micro_batch, stages })
    }
}

impl HostLayout {
    /// The `START..END@HOST,...|...` form [`HostLayout::from_str`] reads.
    pub fn spec(&self) -> String {
        let stages = self
            .stages
            .iter()
            .map(|s| format!("{}..{}@{}", s.start, s.end, s.hosts.join(",")))
            .collect::<Vec<_>>();
        match self.micro_batch {
            0 => stages.join("|"),
            n => format!("{};micro={n}", stages.join("|")),
        }
    }
}

impl fmt::Display for HostLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{} ", self.data, self.pipeline())?;
        if self.micro_batch > 0 {
            write!(f, "micro {}: ", self.micro_batch)?;
        }
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                write!(f, " | ")?;
            }
            write!(f, "blocks {}..{} on {}", s.start, s.end, s.hosts.join(","))?;
        }
        Ok(())
    }
}

//! `[capacity]`: how many hosts the cluster keeps and where the leader's reconciler may
//! launch them (see docs/capacity.md).

use limpet_agent::reconcile::CapacityPolicy;
use limpet_consensus::state::Pool;
use serde::Deserialize;
use std::collections::BTreeMap;

/// `[capacity]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct CapacitySection {
    /// Hosts wanted.
    pub target: u32,
    /// Fewest hosts (default: the target).
    pub min: Option<u32>,
    /// Most hosts, spot probes included (default: the target plus one).
    pub max: Option<u32>,
    /// The EC2 launch template new hosts start from (AMI, network, instance profile, user
    /// data: deploy/cloud-init.yaml).
    pub launch_template: String,
    /// Its version (default: the template's default version).
    pub template_version: Option<String>,
    /// Instance types to launch, in order of preference (a list, or one string separated
    /// by commas).
    #[serde(deserialize_with = "list")]
    pub instance_types: Vec<String>,
    /// Subnets (so, zones) to launch in (default: the template's; a list or one string).
    #[serde(default, deserialize_with = "list")]
    pub subnets: Vec<String>,
    /// Launch on-demand once spot has been unobtainable this long.
    #[serde(default = "default_on_demand_after")]
    pub on_demand_after_secs: u64,
    /// While on-demand hosts run, try spot again this often (and swap when it comes).
    #[serde(default = "default_spot_retry")]
    pub spot_retry_secs: u64,
    /// Skip a pool this long after EC2 had no capacity there.
    #[serde(default = "default_cooldown")]
    pub pool_cooldown_secs: u64,
    /// Terminate a launched host that has not joined after this long.
    #[serde(default = "default_join_timeout")]
    pub join_timeout_secs: u64,
    /// How often the leader reconciles.
    #[serde(default = "default_interval")]
    pub interval_secs: f64,
    /// EC2's region (default: `[cluster].ec2_region`, else the SDK's).
    pub region: Option<String>,
    /// Another EC2 endpoint (default: `[cluster].ec2_endpoint`).
    pub endpoint: Option<String>,
    /// New hosts take spare credentials (`limpet fleet spares`) from `[security.ssm]`'s
    /// prefix (default: when `[security.ssm]` is set).
    pub spares: Option<bool>,
    /// Scaling by value: add hosts (within min..=max) while one more adds at least this many
    /// samples that count per dollar; unset: the target is fixed.
    pub min_marginal_value: Option<f64>,
    /// Dollars per hour of a spot host of each instance type (what scaling by value pays,
    /// unless `spot_price_history` finds a price).
    #[serde(default)]
    pub prices: BTreeMap<String, f64>,
    /// Ask EC2 for the current spot prices of `instance_types` (DescribeSpotPriceHistory).
    #[serde(default)]
    pub spot_price_history: bool,
    /// Replace a host whose share of each step is this many times below the mean (it stayed
    /// slower than the others; 0: never).
    #[serde(default)]
    pub replace_slower_than: f64,
    /// ... once it has been so this long.
    #[serde(default = "default_replace_after")]
    pub replace_slow_after_secs: u64,
}

fn default_replace_after() -> u64 {
    600
}

/// A list of words, or one string of words separated by commas (what a template's single
/// placeholder can carry).
fn list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Words {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Words::deserialize(d)? {
        Words::One(s) => s.split(',').map(str::trim).filter(|w| !w.is_empty()).map(String::from).collect(),
        Words::Many(v) => v,
    })
}

fn default_on_demand_after() -> u64 {
    600
}
fn default_spot_retry() -> u64 {
    900
}
fn default_cooldown() -> u64 {
    300
}
fn default_join_timeout() -> u64 {
    900
}
fn default_interval() -> f64 {
    15.0
}

impl CapacitySection {
    /// Checks the section, reporting each problem under its key.
    pub fn check(&self, c: &mut super::check::Checks) {
        let mut err = |key: &str, detail: String| c.fail(&format!("[capacity].{key}"), detail);
        let (min, max) = (self.min(), self.max());
        if self.target == 0 || self.target > 1000 {
            err("target", format!("{} is not within 1..=1000", self.target));
        }
        if min > self.target || self.target > max || max > 1000 {
            err("min", format!("need min <= target <= max <= 1000; have {min} <= {} <= {max}", self.target));
        }
        if self.launch_template.trim().is_empty() {
            err("launch_template", "is empty".into());
        }
        if self.instance_types.is_empty() {
            err("instance_types", "lists no instance type".into());
        }
        let word =
            |s: &String| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
        if let Some(t) = self.instance_types.iter().find(|t| !word(t)) {
            err("instance_types", format!("{t:?} is not an instance type"));
        }
        if let Some(s) = self.subnets.iter().find(|s| !word(s) || !s.starts_with("subnet-")) {
            err("subnets", format!("{s:?} is not a subnet id (subnet-...)"));
        }
        if !(self.interval_secs.is_finite() && (0.2..=3600.0).contains(&self.interval_secs)) {
            err("interval_secs", format!("{} is not within 0.2..=3600", self.interval_secs));
        }
        if self.join_timeout_secs < 10 {
            err("join_timeout_secs", format!("{} s is too short for a host to boot", self.join_timeout_secs));
        }
        if let Some(v) = self.min_marginal_value {
            if !(v.is_finite() && v > 0.0) {
                err("min_marginal_value", format!("{v} is not a positive number of samples per dollar"));
            }
            if self.prices.is_empty() && !self.spot_price_history {
                err(
                    "min_marginal_value",
                    "needs prices: [capacity].prices (dollars per hour by instance type) or spot_price_history = true"
                        .into(),
                );
            }
        }
        for (t, p) in &self.prices {
            if !self.instance_types.contains(t) {
                err("prices", format!("{t:?} is not one of instance_types {:?}", self.instance_types));
            }
            if !(p.is_finite() && *p > 0.0 && *p < 10_000.0) {
                err("prices", format!("{t} = {p} is not a price in dollars per hour"));
            }
        }
        let r = self.replace_slower_than;
        if !(r == 0.0 || (r.is_finite() && (1.1..=100.0).contains(&r))) {
            err("replace_slower_than", format!("{r} is neither 0 (never) nor within 1.1..=100"));
        }
        if let Some(url) = &self.endpoint {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                err("endpoint", format!("{url:?} is not an http(s) URL"));
            }
        }
    }

    /// The floor.
    pub fn min(&self) -> u32 {
        self.min.unwrap_or(self.target)
    }

    /// The ceiling.
    pub fn max(&self) -> u32 {
        self.max.unwrap_or(self.target + 1)
    }

    /// The pools: every instance type in every subnet, types first.
    pub fn pools(&self) -> Vec<Pool> {
        let subnets = if self.subnets.is_empty() { vec![String::new()] } else { self.subnets.clone() };
        self.instance_types
            .iter()
            .flat_map(|t| subnets.iter().map(|s| Pool { instance_type: t.clone(), subnet: s.clone() }))
            .collect()
    }

    /// The cheapest configured spot price of the instance types, dollars per hour.
    pub fn static_price(&self) -> Option<f64> {
        self.prices.values().copied().reduce(f64::min)
    }

    /// The reconciler's policy.
    pub fn policy(&self, spares: bool) -> CapacityPolicy {
        CapacityPolicy {
            target: self.target,
            min: self.min(),
            max: self.max(),
            pools: self.pools(),
            on_demand_after_ms: self.on_demand_after_secs * 1000,
            spot_retry_ms: self.spot_retry_secs * 1000,
            pool_cooldown_ms: self.pool_cooldown_secs * 1000,
            join_timeout_ms: self.join_timeout_secs * 1000,
            spares_required: spares,
            min_marginal_value: self.min_marginal_value,
        }
    }
}

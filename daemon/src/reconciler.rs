//! The leader's fleet reconciler (`[capacity]`): on a timer, while this node leads, it
//! lists the cluster's EC2 instances, asks `limpet_decide::reconcile::decide` for the next
//! step, records that step in the log, and only then acts on it (launch one host, terminate,
//! drain). A launch is recorded with its idempotency token before EC2 is asked, and its
//! outcome after: a leader that takes over finds the launch unconfirmed, looks for instances
//! tagged with the token, and launches (with the same token) only if there are none. Also
//! what `limpet status` shows of it.

use crate::config::CapacitySection;
use limpet_agent::reconcile::{decide_with, record_of, scale, slow_members, CapacityPolicy, Instance, Next};
use limpet_consensus::state::{CapacityAction, CapacityRecord, ClusterState, Command, Market, NodeId, Pool};
use limpet_consensus::NodeHandle;
use limpet_deploy::ssm::Vault;
use limpet_deploy::{Fleet, FleetConfig, FleetError, LaunchOne, Member};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What the reconciler needs besides the consensus handle.
#[derive(Clone, Debug)]
pub struct Reconciler {
    /// `[capacity]`.
    pub section: CapacitySection,
    /// The cluster (the `limpet:cluster` tag).
    pub cluster: String,
    /// This node.
    pub me: NodeId,
    /// Where EC2 is.
    pub ec2: FleetConfig,
    /// Where spare credentials are (`[security.ssm]`), when new hosts take them.
    pub spares: Option<(String, FleetConfig)>,
}

/// The EC2 and SSM clients, made on first use.
#[derive(Default)]
struct Clients {
    fleet: Option<Fleet>,
    vault: Option<Vault>,
}

/// Since when each slow member has been slow (this leader's view: a new leader starts the
/// window again).
type SlowSince = std::collections::BTreeMap<NodeId, u64>;

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Runs the reconciler until `stop`; it acts only while this node leads.
pub async fn run(r: Reconciler, handle: NodeHandle, stop: CancellationToken) {
    let interval = Duration::from_secs_f64(r.section.interval_secs);
    let policy = r.section.policy(r.spares.is_some());
    let mut clients = Clients::default();
    let mut slow_since = SlowSince::new();
    let mut last_error = String::new();
    tracing::info!(target = policy.target, pools = policy.pools.len(), "capacity reconciler on");
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        // Like the controller: a new leader acts once it has applied its term's first entry.
        if !handle.watch().borrow().leader_caught_up {
            continue;
        }
        match r.round(&policy, &handle, &mut clients, &mut slow_since).await {
            Ok(()) => last_error.clear(),
            Err(e) => {
                metrics::counter!("limpet_capacity_errors_total", "code" => "reconcile").increment(1);
                let text = format!("{e:#}");
                if text != last_error {
                    tracing::warn!(error = %text, "capacity: reconcile round failed; trying again");
                    last_error = text;
                }
            }
        }
    }
}

impl Reconciler {
    async fn clients<'a>(&self, c: &'a mut Clients) -> crate::Result<(&'a Fleet, Option<&'a Vault>)> {
        if c.fleet.is_none() {
            c.fleet = Some(Fleet::connect(&self.cluster, &self.ec2).await?);
        }
        if let (None, Some((prefix, cfg))) = (&c.vault, &self.spares) {
            c.vault = Some(Vault::connect(prefix, cfg).await?);
        }
        Ok((c.fleet.as_ref().expect("set above"), c.vault.as_ref()))
    }

    async fn round(
        &self,
        policy: &CapacityPolicy,
        handle: &NodeHandle,
        c: &mut Clients,
        slow_since: &mut SlowSince,
    ) -> crate::Result<()> {
        let (fleet, vault) = self.clients(c).await?;
        let (listed, _) = fleet.list().await?;
        let instances: Vec<Instance> = listed.iter().map(instance_of).collect();
        let spares = match vault {
            Some(v) => v.spares().await?,
            None => Vec::new(),
        };
        let state = handle.watch().borrow().state.clone();
        let now = now_ms();
        if policy.min_marginal_value.is_some() {
            let price = self.price(fleet).await;
            if let Some(d) = scale(policy, &state, price) {
                let record = record_of(&d, &state.capacity, self.me, now).expect("a scale record");
                return self.record(handle, &record).await;
            }
        }
        let slow = self.slow(&state, slow_since, now);
        let d = decide_with(policy, &state, &instances, &spares, &slow, now);
        metrics::gauge!("limpet_capacity_target").set(policy.target_now(&state.capacity) as f64);
        metrics::gauge!("limpet_capacity_hosts").set(d.have as f64);
        if let Next::Resume(seq) = d.next {
            return self.launch(seq, &state, handle, fleet, vault).await;
        }
        let Some(record) = record_of(&d, &state.capacity, self.me, now) else { return Ok(()) };
        self.record(handle, &record).await?;
        match &record.action {
            CapacityAction::Launch { .. } => {
                let state = handle.watch().borrow().state.clone();
                self.launch(record.seq, &state, handle, fleet, vault).await?;
            }
            CapacityAction::Terminate { instances } => {
                let done = fleet.down(instances).await?;
                tracing::info!(?done, "capacity: terminated");
            }
            CapacityAction::Drain { node, instance } => {
                let why = format!("capacity: {instance} goes: {}", record.reason);
                handle
                    .propose(Command::Drain { id: *node, reason: why }, Some(Duration::from_secs(5)))
                    .await?;
            }
            CapacityAction::Hold
            | CapacityAction::Scale { .. }
            | CapacityAction::Launched { .. }
            | CapacityAction::Failed { .. } => {}
        }
        Ok(())
    }

    /// What one more host costs, dollars per hour: the cheapest current spot price of the
    /// instance types when `spot_price_history` is on and EC2 answers, else the cheapest
    /// configured price.
    async fn price(&self, fleet: &Fleet) -> Option<f64> {
        if self.section.spot_price_history {
            match fleet.spot_prices(&self.section.instance_types).await {
                Ok(prices) => {
                    let cheapest = prices.iter().map(|p| p.2).reduce(f64::min);
                    if let Some(p) = cheapest {
                        metrics::gauge!("limpet_capacity_price_per_hour").set(p);
                        return Some(p);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "capacity: no spot prices; using [capacity].prices"),
            }
        }
        self.section.static_price()
    }

    /// Members that have been slow (their share below the mean by `replace_slower_than`)
    /// for `replace_slow_after_secs` in this leader's view.
    fn slow(&self, state: &ClusterState, since: &mut SlowSince, now: u64) -> Vec<NodeId> {
        let now_slow = slow_members(state, self.section.replace_slower_than);
        since.retain(|id, _| now_slow.contains(id));
        for id in &now_slow {
            since.entry(*id).or_insert(now);
        }
        let window = self.section.replace_slow_after_secs * 1000;
        since.iter().filter(|(_, &t)| now.saturating_sub(t) >= window).map(|(&id, _)| id).collect()
    }

    /// Proposes a record; counted and logged once committed.
    async fn record(&self, handle: &NodeHandle, r: &CapacityRecord) -> crate::Result<()> {
        handle.propose(Command::RecordCapacity { record: r.clone() }, Some(Duration::from_secs(5))).await?;
        metrics::counter!("limpet_capacity_decisions_total", "action" => r.action.label()).increment(1);
        tracing::info!(seq = r.seq, action = r.action.label(), reason = %r.reason, "capacity");
        Ok(())
    }

    /// Carries out launch record `seq` unless its instances exist, and records the outcome.
    async fn launch(
        &self,
        seq: u64,
        state: &ClusterState,
        handle: &NodeHandle,
        fleet: &Fleet,
        vault: Option<&Vault>,
    ) -> crate::Result<()> {
        let Some(CapacityRecord {
            action: CapacityAction::Launch { pool, market, token, node_name }, ..
        }) = state.capacity.launch(seq).cloned()
        else {
            crate::fail!("launch record {seq} is no longer kept");
        };
        let found = fleet.launched_by(&token).await?;
        let (action, reason) = if !found.is_empty() {
            let ids: Vec<String> = found.into_iter().map(|m| m.id).collect();
            let why = format!("launch {seq} had already happened: {}", ids.join(" "));
            (CapacityAction::Launched { launch: seq, instances: ids }, why)
        } else {
            let req = LaunchOne {
                launch_template: self.section.launch_template.clone(),
                version: self.section.template_version.clone(),
                instance_type: pool.instance_type.clone(),
                subnet: pool.subnet.clone(),
                on_demand: market == Market::OnDemand,
                token: token.clone(),
                node_name: node_name.clone(),
            };
            match fleet.launch_one(&req).await {
                Ok(launched) => {
                    metrics::counter!("limpet_capacity_launches_total", "market" => market.as_str())
                        .increment(1);
                    let ids: Vec<String> = launched.into_iter().map(|m| m.id).collect();
                    let why = format!("EC2 launched {} ({} {pool})", ids.join(" "), market.as_str());
                    (CapacityAction::Launched { launch: seq, instances: ids }, why)
                }
                Err(e @ (FleetError::Capacity { .. } | FleetError::Api { .. })) => {
                    let (code, capacity) = match &e {
                        FleetError::Capacity { code, .. } => (code.clone(), true),
                        FleetError::Api { code, .. } => (code.clone(), false),
                        _ => unreachable!("matched above"),
                    };
                    metrics::counter!("limpet_capacity_errors_total", "code" => code.clone()).increment(1);
                    (CapacityAction::Failed { launch: seq, code, capacity }, e.to_string())
                }
                // No answer: the launch may or may not have happened; the next round looks.
                Err(e) => return Err(e.into()),
            }
        };
        let last = handle.watch().borrow().state.capacity.last_seq;
        let record = CapacityRecord { seq: last + 1, at_ms: now_ms(), by: self.me, action, reason };
        self.record(handle, &record).await?;
        if let (Some(v), Some(name), CapacityAction::Launched { .. }) = (vault, &node_name, &record.action) {
            v.take_spare(name).await?;
        }
        Ok(())
    }
}

fn instance_of(m: &Member) -> Instance {
    Instance {
        id: m.id.clone(),
        state: m.state.clone(),
        market: if m.lifecycle == "spot" { Market::Spot } else { Market::OnDemand },
        pool: Pool { instance_type: m.instance_type.clone(), subnet: m.subnet.clone().unwrap_or_default() },
        launched_ms: m.launched_ms,
        launch_token: m.launch.clone(),
        node_name: m.node.clone(),
    }
}

/// A capacity record as `limpet status` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CapacityDoc {
    /// Sequence number.
    pub seq: u64,
    /// When (RFC 3339, UTC).
    pub at: String,
    /// Which leader.
    pub by: String,
    /// `hold`, `launch`, `launched`, `failed`, `terminate`, `drain`.
    pub action: String,
    /// What exactly (pool and market, instances, error code).
    pub what: String,
    /// Why.
    pub reason: String,
    /// The record's action as data (pool, market, token, instances, error code).
    pub data: CapacityAction,
}

/// The newest `n` capacity records of `st`, oldest first.
pub fn docs(st: &ClusterState, n: usize, name_of: impl Fn(NodeId) -> String) -> Vec<CapacityDoc> {
    let skip = st.capacity.records.len().saturating_sub(n);
    st.capacity
        .records
        .iter()
        .skip(skip)
        .map(|r| CapacityDoc {
            seq: r.seq,
            at: humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(r.at_ms))
                .to_string(),
            by: name_of(r.by),
            action: r.action.label().to_string(),
            what: match &r.action {
                CapacityAction::Hold => String::new(),
                CapacityAction::Launch { pool, market, node_name, .. } => format!(
                    "{} {pool}{}",
                    market.as_str(),
                    node_name.as_ref().map_or(String::new(), |n| format!(" as {n}"))
                ),
                CapacityAction::Launched { launch, instances } => {
                    format!("#{launch}: {}", instances.join(" "))
                }
                CapacityAction::Failed { launch, code, .. } => format!("#{launch}: {code}"),
                CapacityAction::Terminate { instances } => instances.join(" "),
                CapacityAction::Drain { instance, .. } => instance.clone(),
                CapacityAction::Scale { target } => format!("{target} hosts"),
            },
            reason: r.reason.clone(),
            data: r.action.clone(),
        })
        .collect()
}

/// Throughput per world size, with one host's marginal gain over the world below, as a
/// table; and the number of hosts scaling by value chose.
pub fn render_throughput(points: &[limpet_consensus::state::Throughput], target: Option<u32>) -> String {
    let mut t = crate::text::table(&["HOSTS", "SAMPLES/S", "THAT COUNT", "PER HOST", "EPOCH"], 0..5);
    for p in points {
        t.add_row(vec![
            p.world.to_string(),
            format!("{:.0}", p.samples_per_s()),
            format!("{:.0}", p.useful_per_s()),
            format!("{:.0}", p.useful_per_s() / p.world as f64),
            p.epoch.to_string(),
        ]);
    }
    let chosen = target.map_or(String::new(), |n| format!(" (scaling by value: {n} hosts)"));
    format!("throughput by world size{chosen}:\n{t}\n")
}

/// The newest eight records as a table.
pub fn render(docs: &[CapacityDoc]) -> String {
    let mut t = crate::text::table(&["#", "AT", "BY", "ACTION", "WHAT", "REASON"], 0..1);
    for d in &docs[docs.len().saturating_sub(8)..] {
        t.add_row(vec![
            d.seq.to_string(),
            d.at.clone(),
            d.by.clone(),
            d.action.clone(),
            d.what.clone(),
            d.reason.clone(),
        ]);
    }
    format!("capacity:\n{}\n", crate::text::lines(&t))
}

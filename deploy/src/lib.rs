//! limpet's fleet tooling on EC2: launch spot capacity for a cluster from a launch template,
//! list the cluster's instances, terminate them, and find a cluster's running members so a
//! new `limpetd` can join through them instead of a static seed list. Every instance carries
//! the tag [`CLUSTER_TAG`]` = NAME`; that tag is the only state the tooling keeps.
//!
//! It talks to EC2 through the official SDK (`aws-sdk-ec2`); the tests run it against moto's
//! EC2 server. [`render_user_data`] fills the cloud-init template `deploy/cloud-init.yaml`
//! that installs `limpetd` on a new host and joins it to the cluster. [`fis`] revokes spot
//! instances on purpose, through AWS Fault Injection Service.

use aws_sdk_ec2::error::ProvideErrorMetadata;
use aws_sdk_ec2::types::{
    Filter, InstanceInterruptionBehavior, InstanceMarketOptionsRequest, InstanceStateName,
    LaunchTemplateSpecification, MarketType, ResourceType, SpotInstanceType, SpotMarketOptions, Tag,
    TagSpecification,
};
use base64::Engine;
use std::collections::BTreeMap;

pub mod fis;
pub mod ssm;

/// The tag naming the cluster an instance belongs to.
pub const CLUSTER_TAG: &str = "limpet:cluster";

/// The tag naming the reconciler's launch that made an instance (its idempotency token).
pub const LAUNCH_TAG: &str = "limpet:launch";

/// The tag naming the node an instance becomes (a spare credential's name); cloud-init reads
/// it through the instance metadata service.
pub const NODE_TAG: &str = "limpet:node";

/// EC2's answers that mean "no capacity of this kind here right now": the next pool is tried.
pub const CAPACITY_CODES: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
    "InsufficientFreeAddressesInSubnet",
    "Unsupported",
];

/// What went wrong talking to EC2, named so an operator knows what to change.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The region has no spare capacity of the requested kind right now.
    #[error("EC2 has no capacity for {what} right now ({code}: {message}); try another instance type, zone or later")]
    Capacity {
        /// What was asked for.
        what: String,
        /// EC2's error code.
        code: String,
        /// EC2's message.
        message: String,
    },
    /// EC2 refused the request.
    #[error("EC2 refused {op}: {code}: {message}")]
    Api {
        /// The operation.
        op: &'static str,
        /// EC2's error code.
        code: String,
        /// EC2's message.
        message: String,
    },
    /// The request did not reach EC2 or its answer was unreadable.
    #[error("{op}: {detail}")]
    Transport {
        /// The operation.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// A bad argument or template.
    #[error("{0}")]
    Usage(String),
}

fn api_error<E: ProvideErrorMetadata + std::error::Error + 'static>(
    op: &'static str,
    e: aws_sdk_ec2::error::SdkError<E>,
) -> FleetError {
    match e.code() {
        Some(code) => FleetError::Api {
            op,
            code: code.to_string(),
            message: e.message().unwrap_or_default().to_string(),
        },
        None => FleetError::Transport { op, detail: aws_sdk_ec2::error::DisplayErrorContext(&e).to_string() },
    }
}

/// Where the EC2 API is and who calls it.
#[derive(Clone, Debug, Default)]
pub struct FleetConfig {
    /// Region (default: the SDK's resolution: environment, profile, instance metadata).
    pub region: Option<String>,
    /// Another EC2 endpoint (a local EC2 API server in tests).
    pub endpoint: Option<String>,
    /// Static credentials `(key id, secret)` instead of the SDK's default chain.
    pub credentials: Option<(String, String)>,
}

/// The SDK's shared configuration for `cfg` (region, endpoint and credentials; the rest from
/// the SDK's default chain: environment, profile, instance role).
async fn sdk_config(cfg: &FleetConfig) -> Result<aws_config::SdkConfig, FleetError> {
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(r) = &cfg.region {
        loader = loader.region(aws_config::Region::new(r.clone()));
    }
    if let Some(url) = &cfg.endpoint {
        loader = loader.endpoint_url(url);
    }
    if let Some((key, secret)) = &cfg.credentials {
        loader = loader
            .credentials_provider(aws_sdk_ec2::config::Credentials::new(key, secret, None, None, "limpet"));
    }
    let shared = loader.load().await;
    if shared.region().is_none() {
        return Err(FleetError::Usage(
            "no AWS region: pass --region or set AWS_REGION (or a profile's region)".into(),
        ));
    }
    Ok(shared)
}

/// What `fleet up` launches.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// Launch template name (`lt-...` ids work too).
    pub launch_template: String,
    /// Its version (default: the template's default version).
    pub version: Option<String>,
    /// Instances wanted.
    pub count: u32,
    /// Fewest instances worth launching (EC2 launches none if it cannot give this many).
    pub min_count: u32,
    /// Override the template's instance type.
    pub instance_type: Option<String>,
    /// cloud-init user data (plain text; encoded here).
    pub user_data: Option<String>,
    /// On-demand instead of spot.
    pub on_demand: bool,
}

/// One instance of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Member {
    /// Instance id.
    pub id: String,
    /// `pending`, `running`, `shutting-down`, `terminated`, `stopping`, `stopped`.
    pub state: String,
    /// Instance type.
    pub instance_type: String,
    /// `spot` or `on-demand`.
    pub lifecycle: String,
    /// Private IPv4 address.
    pub private_ip: Option<String>,
    /// Availability zone.
    pub zone: Option<String>,
    /// Launch time (RFC 3339).
    pub launched: Option<String>,
    /// Launch time (unix milliseconds).
    #[serde(skip)]
    pub launched_ms: Option<u64>,
    /// Subnet.
    pub subnet: Option<String>,
    /// The reconciler's launch that made it ([`LAUNCH_TAG`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch: Option<String>,
    /// The node name it takes ([`NODE_TAG`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// One host the reconciler launches.
#[derive(Clone, Debug)]
pub struct LaunchOne {
    /// Launch template name or id.
    pub launch_template: String,
    /// Its version (default: the template's default).
    pub version: Option<String>,
    /// Instance type.
    pub instance_type: String,
    /// Subnet (empty: the template's).
    pub subnet: String,
    /// On-demand instead of spot.
    pub on_demand: bool,
    /// EC2's idempotency token, also the instance's [`LAUNCH_TAG`].
    pub token: String,
    /// The node name the host takes ([`NODE_TAG`]), readable through instance metadata.
    pub node_name: Option<String>,
}

/// A cluster's fleet.
pub struct Fleet {
    client: aws_sdk_ec2::Client,
    cluster: String,
    /// Results per DescribeInstances page.
    pub page_size: i32,
}

impl Fleet {
    /// A fleet client for `cluster`.
    pub async fn connect(cluster: &str, cfg: &FleetConfig) -> Result<Fleet, FleetError> {
        if cluster.is_empty() {
            return Err(FleetError::Usage("the cluster name is empty".into()));
        }
        let shared = sdk_config(cfg).await?;
        Ok(Fleet { client: aws_sdk_ec2::Client::new(&shared), cluster: cluster.to_string(), page_size: 100 })
    }

    /// The SDK client (for setup in tests and tools).
    pub fn client(&self) -> &aws_sdk_ec2::Client {
        &self.client
    }

    /// Launches `spec.count` instances tagged with the cluster (spot unless `on_demand`).
    pub async fn up(&self, spec: &LaunchSpec) -> Result<Vec<Member>, FleetError> {
        if spec.count == 0 || spec.min_count == 0 || spec.min_count > spec.count {
            return Err(FleetError::Usage(format!(
                "--count {} with --min-count {}: need 1 <= min-count <= count",
                spec.count, spec.min_count
            )));
        }
        let mut req = self
            .client
            .run_instances()
            .launch_template(template(&spec.launch_template, spec.version.clone()))
            .min_count(spec.min_count as i32)
            .max_count(spec.count as i32)
            .tag_specifications(self.tags(ResourceType::Instance, &[]))
            .tag_specifications(self.tags(ResourceType::Volume, &[]));
        if !spec.on_demand {
            req = req.instance_market_options(spot_options());
        }
        if let Some(t) = &spec.instance_type {
            req = req.instance_type(t.as_str().into());
        }
        if let Some(u) = &spec.user_data {
            if u.len() > 16 * 1024 {
                return Err(FleetError::Usage(format!(
                    "user data is {} bytes; EC2 takes at most 16 KiB",
                    u.len()
                )));
            }
            req = req.user_data(base64::engine::general_purpose::STANDARD.encode(u));
        }
        let out = req.send().await.map_err(|e| {
            let what = format!(
                "{} x {} from template {}",
                spec.count,
                spec.instance_type.as_deref().unwrap_or("(template's type)"),
                spec.launch_template
            );
            launch_error(what, e)
        })?;
        Ok(out.instances().iter().map(member_of).collect())
    }

    /// The cluster's tags, and `extra`, for a new instance or volume.
    fn tags(&self, kind: ResourceType, extra: &[(&str, &str)]) -> TagSpecification {
        let mut t = TagSpecification::builder()
            .resource_type(kind)
            .tags(Tag::builder().key(CLUSTER_TAG).value(&self.cluster).build())
            .tags(Tag::builder().key("Name").value(format!("limpet-{}", self.cluster)).build());
        for (k, v) in extra {
            t = t.tags(Tag::builder().key(*k).value(*v).build());
        }
        t.build()
    }

    /// Launches one host for the reconciler: in the given pool, tagged with its launch
    /// token (and node name), with the token as EC2's idempotency token, so repeating a
    /// launch whose answer was lost launches nothing new.
    pub async fn launch_one(&self, l: &LaunchOne) -> Result<Vec<Member>, FleetError> {
        let mut extra = vec![(LAUNCH_TAG, l.token.as_str())];
        if let Some(n) = &l.node_name {
            extra.push((NODE_TAG, n.as_str()));
        }
        let mut req = self
            .client
            .run_instances()
            .launch_template(template(&l.launch_template, l.version.clone()))
            .instance_type(l.instance_type.as_str().into())
            .min_count(1)
            .max_count(1)
            .client_token(&l.token)
            .tag_specifications(self.tags(ResourceType::Instance, &extra))
            .tag_specifications(self.tags(ResourceType::Volume, &[]));
        if !l.subnet.is_empty() {
            req = req.subnet_id(&l.subnet);
        }
        if l.node_name.is_some() {
            // The host learns its node name from its tag, through instance metadata.
            req = req.metadata_options(
                aws_sdk_ec2::types::InstanceMetadataOptionsRequest::builder()
                    .instance_metadata_tags(aws_sdk_ec2::types::InstanceMetadataTagsState::Enabled)
                    .build(),
            );
        }
        if !l.on_demand {
            req = req.instance_market_options(spot_options());
        }
        let out = req.send().await.map_err(|e| {
            let market = if l.on_demand { "on-demand" } else { "spot" };
            launch_error(format!("1 {market} {} in {:?}", l.instance_type, l.subnet), e)
        })?;
        Ok(out.instances().iter().map(member_of).collect())
    }

    /// The newest spot price (dollars per hour) of each of `types` in each zone that offers
    /// it, for Linux: `(instance type, zone, price)`. What scaling by value pays for a host.
    pub async fn spot_prices(&self, types: &[String]) -> Result<Vec<(String, String, f64)>, FleetError> {
        let mut req = self
            .client
            .describe_spot_price_history()
            .product_descriptions("Linux/UNIX")
            .product_descriptions("Linux/UNIX (Amazon VPC)")
            .start_time(aws_sdk_ec2::primitives::DateTime::from(std::time::SystemTime::now()));
        for t in types {
            req = req.instance_types(aws_sdk_ec2::types::InstanceType::from(t.as_str()));
        }
        let mut pages = req.into_paginator().send();
        // The newest per (type, zone): the history lists older prices too.
        let mut newest: BTreeMap<(String, String), (i64, f64)> = BTreeMap::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| api_error("DescribeSpotPriceHistory", e))?;
            for p in page.spot_price_history() {
                let (Some(t), Some(price)) = (p.instance_type(), p.spot_price()) else { continue };
                let Ok(price) = price.parse::<f64>() else { continue };
                if !(price.is_finite() && price > 0.0) {
                    continue;
                }
                let zone = p.availability_zone().unwrap_or_default().to_string();
                let at = p.timestamp().map_or(0, |t| t.secs());
                let e = newest.entry((t.as_str().to_string(), zone)).or_insert((at, price));
                if at > e.0 {
                    *e = (at, price);
                }
            }
        }
        Ok(newest.into_iter().map(|((t, z), (_, p))| (t, z, p)).collect())
    }

    /// The ARNs of the cluster's instances `ids` (what FIS targets), in the order given;
    /// an id that is not the cluster's is an error naming it.
    pub async fn instance_arns(&self, ids: &[String]) -> Result<Vec<String>, FleetError> {
        let region = self.client.config().region().map(|r| r.to_string()).unwrap_or_default();
        let out = self
            .client
            .describe_instances()
            .filters(Filter::builder().name(format!("tag:{CLUSTER_TAG}")).values(&self.cluster).build())
            .set_instance_ids(Some(ids.to_vec()))
            .send()
            .await
            .map_err(|e| api_error("DescribeInstances", e))?;
        let mut owners: BTreeMap<String, String> = BTreeMap::new();
        for r in out.reservations() {
            for i in r.instances() {
                if let (Some(id), Some(owner)) = (i.instance_id(), r.owner_id()) {
                    owners.insert(id.to_string(), owner.to_string());
                }
            }
        }
        ids.iter()
            .map(|id| match owners.get(id) {
                Some(owner) => Ok(format!("arn:aws:ec2:{region}:{owner}:instance/{id}")),
                None => {
                    Err(FleetError::Usage(format!("{id} is not an instance of cluster {}", self.cluster)))
                }
            })
            .collect()
    }

    /// The cluster's live instances that launch `token` made.
    pub async fn launched_by(&self, token: &str) -> Result<Vec<Member>, FleetError> {
        let (members, _) = self.list().await?;
        Ok(members.into_iter().filter(|m| m.launch.as_deref() == Some(token)).collect())
    }

    /// The cluster's instances that are not terminated, oldest launch first, read page by
    /// page; the number of pages read.
    pub async fn list(&self) -> Result<(Vec<Member>, usize), FleetError> {
        let mut pages = self
            .client
            .describe_instances()
            .filters(Filter::builder().name(format!("tag:{CLUSTER_TAG}")).values(&self.cluster).build())
            .filters(
                Filter::builder()
                    .name("instance-state-name")
                    .values("pending")
                    .values("running")
                    .values("stopping")
                    .values("stopped")
                    .values("shutting-down")
                    .build(),
            )
            .max_results(self.page_size)
            .into_paginator()
            .send();
        let (mut members, mut n) = (Vec::new(), 0);
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| api_error("DescribeInstances", e))?;
            n += 1;
            for r in page.reservations() {
                members.extend(r.instances().iter().map(member_of));
            }
        }
        members.sort_by(|a, b| (&a.launched, &a.id).cmp(&(&b.launched, &b.id)));
        Ok((members, n))
    }

    /// Control addresses (`PRIVATE_IP:port`) of the cluster's running instances: seeds for
    /// a joining `limpetd`.
    pub async fn seeds(&self, port: u16) -> Result<Vec<String>, FleetError> {
        let (members, _) = self.list().await?;
        Ok(members
            .into_iter()
            .filter(|m| m.state == "running")
            .filter_map(|m| m.private_ip.map(|ip| format!("{ip}:{port}")))
            .collect())
    }

    /// Terminates the given instances, or every instance of the cluster; (id, state before,
    /// state now). Instances of other clusters are refused, not touched.
    pub async fn down(&self, ids: &[String]) -> Result<Vec<(String, String, String)>, FleetError> {
        let (members, _) = self.list().await?;
        let targets: Vec<String> = if ids.is_empty() {
            members.iter().map(|m| m.id.clone()).collect()
        } else {
            for id in ids {
                if !members.iter().any(|m| &m.id == id) {
                    return Err(FleetError::Usage(format!(
                        "{id} is not a live instance of cluster {:?} (see `limpet fleet list`)",
                        self.cluster
                    )));
                }
            }
            ids.to_vec()
        };
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let out = self
            .client
            .terminate_instances()
            .set_instance_ids(Some(targets))
            .send()
            .await
            .map_err(|e| api_error("TerminateInstances", e))?;
        let name = |s: Option<&aws_sdk_ec2::types::InstanceState>| {
            s.and_then(|s| s.name()).map_or("unknown".to_string(), |n| n.as_str().to_string())
        };
        Ok(out
            .terminating_instances()
            .iter()
            .map(|c| {
                (
                    c.instance_id().unwrap_or_default().to_string(),
                    name(c.previous_state()),
                    name(c.current_state()),
                )
            })
            .collect())
    }
}

fn template(name: &str, version: Option<String>) -> LaunchTemplateSpecification {
    let lt = if name.starts_with("lt-") {
        LaunchTemplateSpecification::builder().launch_template_id(name)
    } else {
        LaunchTemplateSpecification::builder().launch_template_name(name)
    };
    lt.set_version(version).build()
}

/// One-time spot requests: a revoked host is gone, and limpet's reconciler replaces it.
fn spot_options() -> InstanceMarketOptionsRequest {
    InstanceMarketOptionsRequest::builder()
        .market_type(MarketType::Spot)
        .spot_options(
            SpotMarketOptions::builder()
                .spot_instance_type(SpotInstanceType::OneTime)
                .instance_interruption_behavior(InstanceInterruptionBehavior::Terminate)
                .build(),
        )
        .build()
}

fn launch_error(
    what: String,
    e: aws_sdk_ec2::error::SdkError<aws_sdk_ec2::operation::run_instances::RunInstancesError>,
) -> FleetError {
    match e.code() {
        Some(code) if CAPACITY_CODES.contains(&code) => FleetError::Capacity {
            what,
            code: code.to_string(),
            message: e.message().unwrap_or_default().to_string(),
        },
        _ => api_error("RunInstances", e),
    }
}

fn member_of(i: &aws_sdk_ec2::types::Instance) -> Member {
    let tag =
        |key: &str| i.tags().iter().find(|t| t.key() == Some(key)).and_then(|t| t.value()).map(String::from);
    Member {
        id: i.instance_id().unwrap_or_default().to_string(),
        state: i
            .state()
            .and_then(|s| s.name())
            .map_or_else(|| "unknown".into(), |n: &InstanceStateName| n.as_str().to_string()),
        instance_type: i.instance_type().map_or_else(String::new, |t| t.as_str().to_string()),
        lifecycle: i.instance_lifecycle().map_or_else(|| "on-demand".into(), |l| l.as_str().to_string()),
        private_ip: i.private_ip_address().map(String::from),
        zone: i.placement().and_then(|p| p.availability_zone()).map(String::from),
        launched: i.launch_time().map(|t| t.to_string()),
        launched_ms: i.launch_time().and_then(|t| u64::try_from(t.to_millis().ok()?).ok()),
        subnet: i.subnet_id().map(String::from),
        launch: tag(LAUNCH_TAG),
        node: tag(NODE_TAG),
    }
}

/// Renders a user-data template (minijinja, strict): every placeholder must have a value and
/// every value a placeholder, so a typo fails here, not on a booting host; a value that could
/// break out of the YAML, TOML or shell around it is refused.
pub fn render_user_data(template: &str, vars: &BTreeMap<String, String>) -> Result<String, FleetError> {
    use minijinja::{Environment, UndefinedBehavior};
    let usage = |e: minijinja::Error| {
        let line = e.line().map_or(String::new(), |l| format!(" line {l}"));
        FleetError::Usage(format!(
            "user data template{line}: {}",
            e.detail().unwrap_or(&e.kind().to_string())
        ))
    };
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    // The values land in YAML, in TOML strings inside it, and in shell words: a quote, a
    // backslash, a `$`, a backtick or a line break in one would change what the host runs, so
    // such a value is refused instead of being written.
    env.set_formatter(|out, _state, value| {
        let text = value.to_string();
        if let Some(c) = text.chars().find(|c| matches!(c, '"' | '\'' | '\\' | '$' | '`') || c.is_control()) {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("the value {text:?} holds {c:?}, which the template cannot carry safely"),
            ));
        }
        out.write_str(&text).map_err(minijinja::Error::from)
    });
    env.add_template("user-data", template).map_err(usage)?;
    let tmpl = env.get_template("user-data").map_err(usage)?;
    let needed = tmpl.undeclared_variables(false);
    if let Some(key) = needed.iter().find(|k| !vars.contains_key(*k)) {
        return Err(FleetError::Usage(format!(
            "user data template needs a value for {key:?} (--set {key}=...)"
        )));
    }
    if let Some(unused) = vars.keys().find(|k| !needed.contains(*k)) {
        return Err(FleetError::Usage(format!(
            "--set {unused}: the user data template has no {{{{{unused}}}}}"
        )));
    }
    let mut out = tmpl.render(vars).map_err(usage)?;
    // Like the template's own last line break (minijinja drops it by default).
    if template.ends_with('\n') && !out.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}

/// Parses `KEY=VALUE` (the `--set` flag).
pub fn parse_set(s: &str) -> Result<(String, String), FleetError> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(FleetError::Usage(format!("--set {s:?} is not KEY=VALUE"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn templates_fill_every_placeholder_and_name_what_is_missing_or_extra() {
        let t = "cluster = \"{{ cluster }}\"\nport = {{port}}\n";
        let out = render_user_data(t, &vars(&[("cluster", "prod"), ("port", "7400")])).unwrap();
        assert_eq!(out, "cluster = \"prod\"\nport = 7400\n");
        let e = render_user_data(t, &vars(&[("cluster", "prod")])).unwrap_err().to_string();
        assert!(e.contains("\"port\""), "{e}");
        let e = render_user_data(t, &vars(&[("cluster", "a"), ("port", "1"), ("prot", "2")])).unwrap_err();
        assert!(e.to_string().contains("--set prot"), "{e}");
        let e = render_user_data("a\n{{ open", &vars(&[])).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        // A value that would break out of its TOML string or shell word is refused.
        let e = render_user_data(t, &vars(&[("cluster", "a\" evil=\""), ("port", "1")])).unwrap_err();
        assert!(e.to_string().contains("cannot carry safely"), "{e}");
        let e = render_user_data(t, &vars(&[("cluster", "$(reboot)"), ("port", "1")])).unwrap_err();
        assert!(e.to_string().contains("'$'"), "{e}");
    }

    #[test]
    fn set_flags_parse() {
        assert_eq!(parse_set("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert!(parse_set("=x").is_err() && parse_set("novalue").is_err());
    }

    proptest::proptest! {
        #[test]
        fn rendering_arbitrary_templates_never_panics(t in ".{0,80}", v in "[a-z]{0,5}") {
            let _ = render_user_data(&t, &vars(&[("x", &v)]));
        }
    }
}

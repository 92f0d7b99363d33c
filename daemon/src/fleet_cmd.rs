//! `limpet fleet up|list|down`: a cluster's spot capacity on EC2, through `limpet-deploy`, and
//! the launched hosts' credentials in SSM Parameter Store.

use crate::certs::Kind;
use crate::UsageError;
use crate::Within;
use clap::{Args, Subcommand};
use limpet_consensus::state::node_id_of_name;
use limpet_deploy::ssm::Vault;
use limpet_deploy::{Fleet, FleetConfig, LaunchSpec, Member};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `limpet fleet ...`.
#[derive(Debug, Subcommand)]
pub enum FleetCommand {
    /// Launch spot instances for the cluster from a launch template, tagged limpet:cluster.
    Up(UpArgs),
    /// List the cluster's instances that are not terminated.
    List(ListArgs),
    /// Terminate the cluster's instances (all of them, or those named).
    Down(DownArgs),
    /// Print a user data template filled with --set values (what `fleet up --user-data`
    /// sends), for a launch template's user data.
    Render(RenderArgs),
    /// Issue spare credentials for the hosts the leader's reconciler launches ([capacity]),
    /// or list those not yet taken.
    Spares(SparesArgs),
}

/// `limpet fleet render`.
#[derive(Debug, Args)]
pub struct RenderArgs {
    /// cloud-init user data template (deploy/cloud-init.yaml).
    #[arg(long)]
    user_data: PathBuf,
    /// A value for the template (repeatable); every placeholder needs one.
    #[arg(long = "set", value_parser = parse_set)]
    set: Vec<(String, String)>,
}

/// `limpet fleet spares`.
#[derive(Debug, Args)]
pub struct SparesArgs {
    #[command(flatten)]
    ec2: Ec2Args,
    /// Issue this many (0: only list the spares not yet taken).
    #[arg(long, default_value_t = 0)]
    count: u32,
    /// The cluster CA's directory (`limpet certs init`); needed to issue.
    #[arg(long)]
    certs: Option<PathBuf>,
    /// The cluster secret, stored with them; needed to issue.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// The parameters' prefix (default: /limpet/CLUSTER).
    #[arg(long)]
    ssm_prefix: Option<String>,
    /// How long the issued certificates are valid.
    #[arg(long, default_value_t = crate::certs::DEFAULT_DAYS)]
    cert_days: u32,
    /// Print the spares as JSON.
    #[arg(long)]
    json: bool,
}

/// Where the EC2 API is.
#[derive(Debug, Args)]
pub struct Ec2Args {
    /// The cluster (the value of the limpet:cluster tag).
    #[arg(long)]
    pub cluster: String,
    /// AWS region (default: AWS_REGION or the profile's).
    #[arg(long)]
    pub region: Option<String>,
    /// Another EC2 endpoint (a local EC2 API server).
    #[arg(long)]
    pub endpoint_url: Option<String>,
}

/// `limpet fleet up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    ec2: Ec2Args,
    /// Launch template name or id (AMI, instance type, network, IAM profile).
    #[arg(long)]
    launch_template: String,
    /// Launch template version (default: its default version).
    #[arg(long)]
    template_version: Option<String>,
    /// Instances wanted.
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// Launch nothing unless at least this many can be had (default: --count).
    #[arg(long)]
    min_count: Option<u32>,
    /// Override the template's instance type.
    #[arg(long)]
    instance_type: Option<String>,
    /// cloud-init user data template (deploy/cloud-init.yaml); `--set KEY=VALUE` fills it.
    #[arg(long)]
    user_data: Option<PathBuf>,
    /// A value for the user data template (repeatable).
    #[arg(long = "set", value_parser = parse_set)]
    set: Vec<(String, String)>,
    /// On-demand instead of spot.
    #[arg(long)]
    on_demand: bool,
    #[command(flatten)]
    credentials: CredentialArgs,
    /// Print the launched instances as JSON.
    #[arg(long)]
    json: bool,
}

/// Credentials for the launched hosts, through SSM Parameter Store.
#[derive(Debug, Args)]
pub struct CredentialArgs {
    /// The cluster CA's directory (`limpet certs init`): issue each launched instance a node
    /// certificate named after its instance id and store it, its key, the CA's certificate
    /// and the cluster secret under --ssm-prefix, where the host's first boot reads them
    /// (`limpetd fetch-credentials`). Keys never travel in user data.
    #[arg(long, requires = "secret_file")]
    certs: Option<PathBuf>,
    /// The cluster secret (at least 16 bytes) stored with the certificates.
    #[arg(long, requires = "certs")]
    secret_file: Option<PathBuf>,
    /// The parameters' prefix (default: /limpet/CLUSTER).
    #[arg(long)]
    ssm_prefix: Option<String>,
    /// How long the issued node certificates are valid.
    #[arg(long, default_value_t = crate::certs::DEFAULT_DAYS)]
    cert_days: u32,
}

fn parse_set(s: &str) -> Result<(String, String), String> {
    limpet_deploy::parse_set(s).map_err(|e| e.to_string())
}

/// `limpet fleet list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    ec2: Ec2Args,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `limpet fleet down`.
#[derive(Debug, Args)]
pub struct DownArgs {
    #[command(flatten)]
    ec2: Ec2Args,
    /// Only these instance ids (default: every instance of the cluster).
    ids: Vec<String>,
    /// Required to terminate every instance of the cluster.
    #[arg(long)]
    all: bool,
    /// Where `fleet up --certs` stored the hosts' credentials (default: /limpet/CLUSTER);
    /// the terminated instances' certificates and keys are deleted there.
    #[arg(long)]
    ssm_prefix: Option<String>,
    /// Print the instances' state changes as JSON.
    #[arg(long)]
    json: bool,
}

async fn connect(a: &Ec2Args) -> crate::Result<Fleet> {
    let cfg = FleetConfig { region: a.region.clone(), endpoint: a.endpoint_url.clone(), credentials: None };
    Fleet::connect(&a.cluster, &cfg).await.map_err(crate::Failure::from)
}

fn table(members: &[Member]) -> String {
    let mut s = format!(
        "{:<20} {:<14} {:<12} {:<10} {:<16} {:<12} {}\n",
        "INSTANCE", "STATE", "TYPE", "MARKET", "PRIVATE IP", "ZONE", "LAUNCHED"
    );
    for m in members {
        s += &format!(
            "{:<20} {:<14} {:<12} {:<10} {:<16} {:<12} {}\n",
            m.id,
            m.state,
            m.instance_type,
            m.lifecycle,
            m.private_ip.as_deref().unwrap_or("-"),
            m.zone.as_deref().unwrap_or("-"),
            m.launched.as_deref().unwrap_or("-")
        );
    }
    s
}

/// Runs `limpet fleet ...`.
pub fn run(cmd: FleetCommand) -> crate::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        match cmd {
            FleetCommand::Up(a) => {
                let user_data = match &a.user_data {
                    Some(path) => Some(render(path, &a.set)?),
                    None if !a.set.is_empty() => {
                        return Err(UsageError("--set fills a --user-data template; none given".into()).into())
                    }
                    None => None,
                };
                let spec = LaunchSpec {
                    launch_template: a.launch_template.clone(),
                    version: a.template_version.clone(),
                    count: a.count,
                    min_count: a.min_count.unwrap_or(a.count),
                    instance_type: a.instance_type.clone(),
                    user_data,
                    on_demand: a.on_demand,
                };
                let credentials = prepare_credentials(&a, spec.user_data.as_deref()).await?;
                let fleet = connect(&a.ec2).await?;
                let launched = fleet.up(&spec).await.map_err(crate::Failure::from)?;
                if let Some((vault, dir)) = &credentials {
                    store_credentials(vault, dir, &launched, a.credentials.cert_days).await?;
                    eprintln!(
                        "stored the credentials of {} instance(s) under {}",
                        launched.len(),
                        vault.name("").trim_end_matches('/')
                    );
                }
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&launched)?);
                } else {
                    println!("launched {} instance(s) for cluster {}:", launched.len(), a.ec2.cluster);
                    print!("{}", table(&launched));
                }
            }
            FleetCommand::List(a) => {
                let (members, _) = connect(&a.ec2).await?.list().await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&members)?);
                } else {
                    print!("{}", table(&members));
                }
            }
            FleetCommand::Down(a) => {
                if a.ids.is_empty() && !a.all {
                    return Err(UsageError(format!(
                        "name the instances to terminate, or pass --all for every instance of cluster {}",
                        a.ec2.cluster
                    ))
                    .into());
                }
                let fleet = connect(&a.ec2).await?;
                let done = fleet.down(&a.ids).await.map_err(crate::Failure::from)?;
                if a.json {
                    let changes: Vec<_> = done
                        .iter()
                        .map(|(id, before, now)| {
                            serde_json::json!({"instance": id, "before": before.to_string(), "now": now.to_string()})
                        })
                        .collect();
                    let doc = serde_json::json!({"cluster": a.ec2.cluster, "terminated": changes});
                    println!("{}", serde_json::to_string_pretty(&doc)?);
                } else {
                    for (id, before, now) in &done {
                        println!("{id}: {before} -> {now}");
                    }
                    if done.is_empty() {
                        println!("cluster {} has no live instances", a.ec2.cluster);
                    }
                }
                forget_credentials(&a, &done).await;
            }
            FleetCommand::Spares(a) => spares(a).await?,
            FleetCommand::Render(a) => print!("{}", render(&a.user_data, &a.set)?),
        }
        Ok::<(), crate::Failure>(())
    })
}

/// The template at `path` filled with `set`.
fn render(path: &Path, set: &[(String, String)]) -> crate::Result<String> {
    let t = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("--user-data {}: {e}", path.display())))?;
    let vars: BTreeMap<String, String> = set.iter().cloned().collect();
    Ok(limpet_deploy::render_user_data(&t, &vars)
        .map_err(|e| UsageError(format!("--user-data {}: {e}", path.display())))?)
}

/// Checks the credential flags before anything is launched (an instance that boots without
/// its credentials waits, then fails) and stores what every host shares: the CA's certificate
/// and the secret.
async fn prepare_credentials(a: &UpArgs, user_data: Option<&str>) -> crate::Result<Option<(Vault, PathBuf)>> {
    let c = &a.credentials;
    let (Some(dir), Some(secret_file)) = (&c.certs, &c.secret_file) else {
        if user_data.is_some_and(|u| u.contains("[security.ssm]")) {
            return Err(UsageError(
                "the user data reads its credentials from SSM ([security.ssm]): pass --certs DIR and \
                 --secret-file FILE so that fleet up stores them"
                    .into(),
            )
            .into());
        }
        return Ok(None);
    };
    let secret =
        crate::config::read_secret(secret_file).map_err(|why| UsageError(format!("--secret-file {why}")))?;
    // The CA must be able to sign before hosts are launched that need its signature.
    crate::certs::issue_pem_for_days(dir, "preflight", Kind::Node(1), 1)
        .map_err(|e| UsageError(format!("--certs {}: {e:#}", dir.display())))?;
    let ca_pem = std::fs::read_to_string(dir.join("ca.pem"))
        .map_err(|e| UsageError(format!("--certs {}: ca.pem: {e}", dir.display())))?;
    let vault = vault(&a.ec2, c.ssm_prefix.as_deref()).await?;
    vault.put_cluster(&ca_pem, &secret).await?;
    Ok(Some((vault, dir.clone())))
}

async fn vault(a: &Ec2Args, prefix: Option<&str>) -> crate::Result<Vault> {
    let cfg = FleetConfig { region: a.region.clone(), endpoint: a.endpoint_url.clone(), credentials: None };
    let prefix = prefix.map_or_else(|| limpet_deploy::ssm::default_prefix(&a.cluster), String::from);
    Vault::connect(&prefix, &cfg).await.map_err(crate::Failure::from)
}

/// Issues and stores each launched instance's certificate (named and bound after its
/// instance id, the name its `limpetd` takes).
async fn store_credentials(vault: &Vault, dir: &Path, launched: &[Member], days: u32) -> crate::Result<()> {
    for m in launched {
        let stored = async {
            let (cert, key) =
                crate::certs::issue_pem_for_days(dir, &m.id, Kind::Node(node_id_of_name(&m.id)), days)?;
            vault.put_node(&m.id, &cert, &key).await?;
            Ok::<(), crate::Failure>(())
        };
        stored.await.within(|| {
            let ids: Vec<&str> = launched.iter().map(|m| m.id.as_str()).collect();
            format!(
                "instances {} are launched, but {}'s credentials could not be stored: they will wait \
                 for them and fail; terminate them with `limpet fleet down`",
                ids.join(" "),
                m.id
            )
        })?;
    }
    Ok(())
}

/// `limpet fleet spares`: issues `--count` credentials named `node-XXXXXXXX` (random), each
/// bound to its name's node id, and stores them as spares; then lists the spares.
async fn spares(a: SparesArgs) -> crate::Result<()> {
    if a.count > 100 {
        return Err(UsageError(format!("--count {}: at most 100 at a time", a.count)).into());
    }
    let vault = vault(&a.ec2, a.ssm_prefix.as_deref()).await?;
    if a.count > 0 {
        let (Some(dir), Some(secret_file)) = (&a.certs, &a.secret_file) else {
            return Err(UsageError("--count needs --certs DIR and --secret-file FILE to issue".into()).into());
        };
        let secret = crate::config::read_secret(secret_file)
            .map_err(|why| UsageError(format!("--secret-file {why}")))?;
        let ca_pem = std::fs::read_to_string(dir.join("ca.pem"))
            .map_err(|e| UsageError(format!("--certs {}: ca.pem: {e}", dir.display())))?;
        vault.put_cluster(&ca_pem, &secret).await?;
        for _ in 0..a.count {
            let name = format!("node-{:08x}", rand::random::<u32>());
            let (cert, key) =
                crate::certs::issue_pem_for_days(dir, &name, Kind::Node(node_id_of_name(&name)), a.cert_days)
                    .map_err(|e| UsageError(format!("--certs {}: {e:#}", dir.display())))?;
            vault.put_spare(&name, &cert, &key).await?;
        }
        eprintln!("issued {} spare credential(s) under {}", a.count, vault.name("spares"));
    }
    let names = vault.spares().await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&names)?);
    } else if names.is_empty() {
        println!("no spare credentials under {}", vault.name("spares"));
    } else {
        for n in &names {
            println!("{n}");
        }
    }
    Ok(())
}

/// Deletes the terminated instances' credentials (a warning, not an error: the instances are
/// terminated either way).
async fn forget_credentials(a: &DownArgs, done: &[(String, String, String)]) {
    if done.is_empty() {
        return;
    }
    let ids: Vec<String> = done.iter().map(|(id, ..)| id.clone()).collect();
    let result = async {
        vault(&a.ec2, a.ssm_prefix.as_deref()).await?.remove_nodes(&ids).await.map_err(crate::Failure::from)
    };
    if let Err(e) = result.await {
        eprintln!("warning: the terminated instances' credentials in SSM were not deleted: {e:#}");
    }
}

/// What `[cluster].ec2_seeds` finds for a starting node.
#[derive(Debug, PartialEq, Eq)]
pub enum Discovery {
    /// Join through these control addresses (the cluster's other running instances).
    Seeds(Vec<String>),
    /// Found the cluster alone: this host is the oldest live instance of the cluster and has
    /// no state, so no cluster can exist that it should join (every other instance, older
    /// hosts' replacements included, waits for it).
    Found,
}

/// Seeds for `[cluster].ec2_seeds`: the control addresses of the cluster's running
/// instances, without this node's own (`me`, `PRIVATE_IP:port`); or, for a node without
/// state (`fresh`) on the cluster's oldest live instance (launch time, then id, pending
/// ones included so two hosts booting together agree), founding it.
pub async fn ec2_seeds(
    cluster: &str,
    region: Option<String>,
    endpoint: Option<String>,
    port: u16,
    me: &str,
    fresh: bool,
) -> crate::Result<Discovery> {
    let cfg = FleetConfig { region, endpoint, credentials: None };
    // At boot EC2 is the environment's (a metadata service not answering yet, no region
    // found), not the file's: the failure is one systemd retries, never a usage error.
    let retried = |e: limpet_deploy::FleetError| crate::Failure::Other(anyhow::Error::from(e));
    let fleet = Fleet::connect(cluster, &cfg).await.map_err(retried)?;
    let (mut members, _) = fleet.list().await.map_err(retried)?;
    members.retain(|m| m.state == "pending" || m.state == "running");
    let addr = |m: &Member| m.private_ip.as_ref().map(|ip| format!("{ip}:{port}"));
    let oldest = members.iter().min_by(|a, b| (&a.launched_ms, &a.id).cmp(&(&b.launched_ms, &b.id)));
    if fresh && oldest.is_some_and(|m| addr(m).as_deref() == Some(me)) {
        return Ok(Discovery::Found);
    }
    let seeds: Vec<String> =
        members.iter().filter(|m| m.state == "running").filter_map(addr).filter(|s| s != me).collect();
    if seeds.is_empty() {
        let why = match oldest {
            Some(m) if addr(m).as_deref() != Some(me) => {
                format!("the oldest instance, {}, founds the cluster and is not running yet", m.id)
            }
            Some(_) => "this host is the oldest instance but has state: it is not a new cluster's founder"
                .to_string(),
            None => "none is running or pending".to_string(),
        };
        crate::fail!(
            "[cluster].ec2_seeds: no running instance tagged {}={cluster} to join through ({why})",
            limpet_deploy::CLUSTER_TAG
        );
    }
    Ok(Discovery::Seeds(seeds))
}

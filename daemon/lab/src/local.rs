//! Local clusters on loopback: `limpetd` processes with generated configurations, each with
//! its own fake cloud metadata service (a `limpet-lab fake-metadata` process), described in
//! `DIR/cluster.json` (`limpet_daemon::cluster_file`) so that `limpet status/drain/revoke
//! --dir DIR` find them. The demo and
//! the multi-process tests drive clusters through this module.

use crate::raft_cmd::free_port;
use anyhow::Context;
pub use limpet_daemon::cluster_file::{post_notice, ClusterFile, LocalNode};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The job a local cluster trains.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LocalJob {
    /// `mlp`, `convnet` or `gpt`.
    pub model: String,
    /// `digits`, `chars` or `synthetic`.
    pub data: String,
    /// Optimizer steps.
    pub steps: u64,
    /// Global batch.
    pub global_batch: u64,
    /// Micro-batch (default: the global batch).
    pub micro_batch: Option<u64>,
    /// Peak learning rate (default: the model's).
    pub lr: Option<f64>,
    /// `adamw` or `sgd` (default: the model's).
    pub optimizer: Option<String>,
    /// `fixed-global`, `linear`, `sqrt` or `adascale`.
    pub policy: String,
    /// Seed.
    pub seed: u64,
    /// Fewest nodes training continues with (fewer: it pauses until enough are back).
    pub min_nodes: usize,
    /// Pipeline stages per replica (`2`, `auto`); `None` trains plain data parallelism.
    pub pipeline: Option<String>,
    /// Memory per host for the pipeline planner (`16G`, ...).
    pub pipeline_memory: Option<String>,
    /// Transformer blocks of the `gpt` model.
    pub layers: Option<usize>,
    /// Shadow each pipeline stage to its neighbour every this many steps (0: off).
    pub shadow_every: u64,
    /// Write a durable checkpoint every this many steps (0: off).
    pub checkpoint_every: u64,
    /// Where checkpoints go (default: each node's state directory). A directory shared by
    /// every node (and by a later cluster) lets a new cluster resume from it.
    pub checkpoint_dir: Option<PathBuf>,
    /// Run with certificates: a CA in `DIR/certs`, a node certificate per node, mutual TLS
    /// on the control and data planes, and an operator certificate the CLI uses.
    #[serde(default)]
    pub tls: bool,
    /// With `tls`: clients without a certificate may read status.
    #[serde(default)]
    pub anonymous_status: bool,
    /// With `tls`: serve metrics over mutual TLS (`[node].metrics_tls`).
    #[serde(default)]
    pub metrics_tls: bool,
    /// Copy checkpoints to S3: (`s3://BUCKET/PREFIX`, an S3-compatible endpoint URL).
    #[serde(default)]
    pub checkpoint_s3: Option<(String, String)>,
    /// `[checkpoint].resume` ("required", "if-present", "never"); unset: the default.
    #[serde(default)]
    pub checkpoint_resume: Option<String>,
    /// `[checkpoint].min_free` (`256M`, `0`); unset: the default.
    #[serde(default)]
    pub checkpoint_min_free: Option<String>,
    /// `[checkpoint].shared`: every node writes into `checkpoint_dir`, one directory.
    #[serde(default)]
    pub checkpoint_shared: bool,
    /// Extra environment for every `limpetd` (credentials for an S3-compatible store).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// The data file or directory (default: the dataset's own).
    #[serde(default)]
    pub data_path: Option<PathBuf>,
    /// `[data]` of every node's configuration.
    #[serde(default)]
    pub data_section: limpet_trainer::workload::DataSection,
    /// `[model]` of every node's configuration.
    #[serde(default)]
    pub model_section: limpet_trainer::workload::ModelSection,
    /// More sections for every node's configuration, as TOML (`[capacity]`, ...).
    #[serde(default)]
    pub extra_config: Option<String>,
    /// A scenario's joiners boot with the cluster and wait, loaded, at start gates until the
    /// script's join opens them ([`LocalCluster::add_booted`]).
    #[serde(default)]
    pub joiners_booted: bool,
    /// `[cluster].straggler_ratio` (0: off, the default here: processes sharing a few cores
    /// are noisy, not stragglers).
    #[serde(default)]
    pub straggler_ratio: f64,
    /// A straggler drill: this node sleeps this many microseconds per sample it computes.
    #[serde(default)]
    pub slow: Option<(String, u64)>,
    /// A straggler drill: this node computes as a host this many times slower would.
    #[serde(default)]
    pub slow_factor: Option<(String, f64)>,
    /// `[job].reproducible`.
    #[serde(default)]
    pub reproducible: bool,
    /// `[job].shards`.
    #[serde(default)]
    pub shards: Option<usize>,
    /// `[job].eval_every`.
    #[serde(default)]
    pub eval_every: Option<u64>,
    /// `[job].shard_state` (and `shard_replicas`, the number).
    #[serde(default)]
    pub shard_state: Option<(String, usize)>,
    /// `[node].devices` of every node: this many CPU local ranks (0 or 1: the key is left out).
    #[serde(default)]
    pub devices: usize,
    /// The same for the nodes named, in place of `devices` (hosts of unequal devices).
    #[serde(default)]
    pub node_devices: Vec<(String, usize)>,
    /// `[node].zone` of every node: node N in `zone-((N-1) mod zones)` (0: the key is left
    /// out).
    #[serde(default)]
    pub zones: usize,
    /// `[job].overlap` (absent: the default, overlapping).
    #[serde(default)]
    pub overlap: Option<bool>,
    /// Each node in a network namespace of its own with its own address (`netns.rs`; root
    /// only), rather than every node on 127.0.0.1.
    #[serde(default)]
    pub netns: bool,
    /// A synthetic job: the agents are `limpet-synthetic` (limpetd's control part with a
    /// training loop that needs no libtorch, built by `make synthetic`), and so are their
    /// fake metadata services; `model`, `data` and the trainer's keys are written but unread.
    #[serde(default)]
    pub synthetic: Option<limpet_agent::runtime::synthetic::SyntheticJob>,
    /// Seconds between an agent's polls of its metadata service (default 0.2: a notice seen
    /// at once; a fleet of hundreds on two cores polls less often).
    #[serde(default)]
    pub revocation_poll_s: Option<f64>,
}

impl Default for LocalJob {
    fn default() -> LocalJob {
        LocalJob {
            model: "mlp".into(),
            data: "digits".into(),
            steps: 400,
            global_batch: 64,
            micro_batch: None,
            lr: None,
            optimizer: None,
            policy: "fixed-global".into(),
            seed: 0,
            min_nodes: 1,
            pipeline: None,
            pipeline_memory: None,
            layers: None,
            shadow_every: 0,
            checkpoint_every: 0,
            checkpoint_dir: None,
            tls: false,
            anonymous_status: false,
            metrics_tls: false,
            checkpoint_s3: None,
            checkpoint_resume: None,
            checkpoint_min_free: None,
            checkpoint_shared: false,
            env: Vec::new(),
            data_path: None,
            data_section: Default::default(),
            model_section: Default::default(),
            extra_config: None,
            joiners_booted: false,
            straggler_ratio: 0.0,
            slow: None,
            slow_factor: None,
            reproducible: false,
            shards: None,
            eval_every: None,
            shard_state: None,
            devices: 0,
            node_devices: Vec::new(),
            zones: 0,
            overlap: None,
            netns: false,
            synthetic: None,
            revocation_poll_s: None,
        }
    }
}

/// A local cluster this process started and owns.
pub struct LocalCluster {
    /// Where everything lives.
    pub dir: PathBuf,
    /// The description (also in `dir/cluster.json`).
    pub file: ClusterFile,
    /// The job it trains.
    pub job: LocalJob,
    exe: PathBuf,
    limpetd: PathBuf,
    children: HashMap<String, Child>,
    metadata: HashMap<String, Child>,
    founders: Vec<String>,
    /// How the next node added is started: as systemd starts a `Type=notify` service.
    systemd: Option<SystemdEnv>,
    /// The start gate of the next node added, if it boots ahead of its time.
    gate: Option<PathBuf>,
    /// Each node's network namespace, with `LocalJob::netns`.
    spaces: HashMap<String, String>,
    /// The namespaces' bridge (last: dropped after `down` stopped every process in them).
    fleet: Option<crate::netns::Fleet>,
}

/// The ports of a node in a namespace of its own (every node has the whole range there).
const NS_CONTROL_PORT: u16 = 7400;

/// The environment systemd gives a `Type=notify` service with a watchdog.
#[derive(Clone, Debug)]
pub struct SystemdEnv {
    /// The datagram socket `sd_notify` messages go to.
    pub notify_socket: PathBuf,
    /// `WatchdogSec`.
    pub watchdog: Duration,
    /// Extra `limpetd` arguments.
    pub args: Vec<String>,
}

/// `limpetd`'s path: beside the running `limpet`.
pub fn limpetd_path() -> limpet_daemon::Result<PathBuf> {
    product_path("limpetd")
}

/// The operator's `limpet` beside this executable (the lab drives it as an operator would).
pub fn limpet_path() -> limpet_daemon::Result<PathBuf> {
    product_path("limpet")
}

/// `limpet-synthetic` beside this executable: built outside the workspace (no workspace
/// build may turn libtorch on in it) into the same target directory by `make synthetic`.
pub fn synthetic_path() -> limpet_daemon::Result<PathBuf> {
    let p = std::env::current_exe()?.with_file_name("limpet-synthetic");
    if !p.exists() {
        limpet_daemon::fail!(
            "{} not found: build it with `make synthetic` (a crate of its own, bench/synthetic)",
            p.display()
        );
    }
    Ok(p)
}

fn product_path(name: &str) -> limpet_daemon::Result<PathBuf> {
    let p = std::env::current_exe()?.with_file_name(name);
    if !p.exists() {
        limpet_daemon::fail!("{} not found (build it with `cargo build --bin {name}`)", p.display());
    }
    Ok(p)
}

impl LocalCluster {
    /// Starts `n` founding nodes under `dir` training `job`, with this `limpet-lab` (for the
    /// fake metadata services) and the `limpetd` beside it.
    /// A synthetic job's agents and metadata services are both `limpet-synthetic`.
    pub fn up(dir: &Path, n: usize, job: LocalJob) -> limpet_daemon::Result<LocalCluster> {
        if job.synthetic.is_some() {
            let synthetic = synthetic_path()?;
            return LocalCluster::up_with(dir, n, job, &synthetic, &synthetic);
        }
        LocalCluster::up_with(dir, n, job, &std::env::current_exe()?, &limpetd_path()?)
    }

    /// Starts `n` founding nodes with the given binaries (tests run from their own).
    pub fn up_with(
        dir: &Path,
        n: usize,
        job: LocalJob,
        limpet: &Path,
        limpetd: &Path,
    ) -> limpet_daemon::Result<LocalCluster> {
        if n == 0 {
            return Err(limpet_daemon::UsageError("--nodes must be at least 1".into()).into());
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if dir.join("cluster.json").exists() {
            return Err(limpet_daemon::UsageError(format!(
                "{} already holds a cluster; use an empty directory",
                dir.display()
            ))
            .into());
        }
        let secret: String = (0..32).map(|_| format!("{:x}", rand::random::<u8>() & 15)).collect();
        std::fs::write(dir.join("secret"), secret).context("writing the cluster secret")?;
        let mut c = LocalCluster {
            dir: dir.to_path_buf(),
            // A name of its own: two local clusters on one machine (parallel tests) must never
            // take each other's raft traffic for their own if a port is reused.
            file: ClusterFile {
                cluster: format!("local-{:08x}", rand::random::<u32>()),
                nodes: Vec::new(),
                operator_tls: None,
            },
            job,
            exe: limpet.to_path_buf(),
            limpetd: limpetd.to_path_buf(),
            children: HashMap::new(),
            metadata: HashMap::new(),
            founders: Vec::new(),
            systemd: None,
            gate: None,
            spaces: HashMap::new(),
            fleet: None,
        };
        if c.job.netns {
            c.fleet = Some(crate::netns::Fleet::new()?);
        }
        if c.job.tls {
            let certs = c.certs_dir();
            limpet_daemon::certs::init(&certs, &c.file.cluster, 30)?;
            let (cert, key) = limpet_daemon::certs::issue_for_days(
                &certs,
                "operator",
                limpet_daemon::certs::Kind::Client,
                30,
            )?;
            c.file.operator_tls =
                Some(limpet_consensus::tls::TlsFiles { ca: certs.join("ca.pem"), cert, key });
        }
        let controls: Vec<String> =
            (1..=n as u64).map(|id| c.control_for(id)).collect::<limpet_daemon::Result<_>>()?;
        c.founders = controls.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect();
        for (i, control) in controls.iter().enumerate() {
            c.start_node(&format!("node-{}", i + 1), (i + 1) as u64, control, true)?;
        }
        Ok(c)
    }

    /// Adds a node that joins through the founders, started the way systemd starts a
    /// `Type=notify` service (`NOTIFY_SOCKET`, `WATCHDOG_USEC`, `WATCHDOG_PID`).
    pub fn add_as_service(&mut self, env: SystemdEnv) -> limpet_daemon::Result<String> {
        if self.fleet.is_some() {
            return Err(limpet_daemon::UsageError(
                "a node started as a service runs outside any network namespace; this cluster's nodes each have one".into(),
            )
            .into());
        }
        self.systemd = Some(env);
        let r = self.add();
        self.systemd = None;
        r
    }

    /// Adds a node that boots now and waits, loaded, at a start gate of its own until
    /// [`LocalCluster::open_gate`]: a scripted join then costs the join, not libtorch's load on
    /// cores the running agents share (a host of a fleet boots on cores of its own).
    pub fn add_booted(&mut self) -> limpet_daemon::Result<String> {
        let id = self.file.nodes.iter().map(|n| n.id).max().unwrap_or(0) + 1;
        self.gate = Some(self.gate_of(&format!("node-{id}")));
        let r = self.add();
        self.gate = None;
        r
    }

    fn gate_of(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.gate"))
    }

    /// Lets a node added by [`LocalCluster::add_booted`] go on and join, once it waits at its
    /// gate (its log says so; it may still be loading when its time comes), within `within`.
    pub fn open_gate(&mut self, name: &str, within: Duration) -> limpet_daemon::Result<()> {
        let log = self.file.node(name)?.log.clone();
        let until = Instant::now() + within;
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("waiting at the start gate") {
            if let Some((who, why)) = self.failed_to_start().filter(|(who, _)| who == name) {
                limpet_daemon::fail!("{who}'s limpetd exited while it booted: {why}");
            }
            if Instant::now() > until {
                limpet_daemon::fail!(
                    "{name} did not boot within {} s (see {})",
                    within.as_secs(),
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let gate = self.gate_of(name);
        std::fs::write(&gate, b"").with_context(|| format!("opening {}", gate.display()))?;
        Ok(())
    }

    /// Adds a node that joins through the founders.
    pub fn add(&mut self) -> limpet_daemon::Result<String> {
        let id = self.file.nodes.iter().map(|n| n.id).max().unwrap_or(0) + 1;
        self.add_named(&format!("node-{id}"))
    }

    /// Adds a node named `name` (an instance id, say) that joins through the founders.
    pub fn add_named(&mut self, name: &str) -> limpet_daemon::Result<String> {
        let id = self.file.nodes.iter().map(|n| n.id).max().unwrap_or(0) + 1;
        let control = self.control_for(id)?;
        self.start_node(name, id, &control, false)?;
        Ok(name.to_string())
    }

    /// Where a cluster with certificates keeps them.
    pub fn certs_dir(&self) -> PathBuf {
        self.dir.join("certs")
    }

    /// Node `id`'s control address: a free port of loopback, or its namespace's address.
    fn control_for(&self, id: u64) -> limpet_daemon::Result<String> {
        Ok(match &self.fleet {
            Some(f) => format!("{}:{NS_CONTROL_PORT}", f.address(id)),
            None => format!("127.0.0.1:{}", free_port()?),
        })
    }

    /// `program` started in node `name`'s namespace, if it has one.
    fn in_space(&self, name: &str, program: &Path) -> Command {
        match self.spaces.get(name) {
            Some(ns) => crate::netns::Fleet::command(ns, program),
            None => Command::new(program),
        }
    }

    fn start_node(&mut self, name: &str, id: u64, control: &str, founder: bool) -> limpet_daemon::Result<()> {
        let (data, md_addr, metrics) = match self.fleet.as_mut() {
            Some(f) => {
                let (ns, addr) = f.add(id)?;
                self.spaces.insert(name.to_string(), ns);
                let at = |p: u16| format!("{addr}:{p}");
                (at(NS_CONTROL_PORT + 1), at(NS_CONTROL_PORT + 2), at(NS_CONTROL_PORT + 3))
            }
            None => {
                let port = || free_port().map(|p| format!("127.0.0.1:{p}"));
                (port()?, port()?, port()?)
            }
        };
        let log = self.dir.join(format!("{name}.log"));
        let md_child = self
            .in_space(name, &self.exe)
            .args(["fake-metadata", "--listen", &md_addr])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a fake metadata service")?;
        let step_log = self.dir.join(format!("{name}.steps.jsonl"));
        let config = self.dir.join(format!("{name}.toml"));
        let seeds: Vec<String> = self.file.nodes.iter().map(|n| format!("{:?}", n.control)).collect();
        let j = &self.job;
        let mut text = format!(
            "[node]\nname = {name:?}\nid = {id}\ncontrol = {control:?}\ndata = {data:?}\nmetrics = {metrics:?}\nstate_dir = {:?}\nsecret_file = {:?}\nstep_log = {:?}\n\n",
            self.dir.join(name).display().to_string(),
            self.dir.join("secret").display().to_string(),
            step_log.display().to_string(),
        );
        if j.metrics_tls {
            text += "metrics_tls = true\n\n";
        }
        let devices = j.node_devices.iter().find(|(n, _)| n == name).map_or(j.devices, |(_, d)| *d);
        if devices > 1 {
            text += &format!("devices = [{}]\n\n", vec!["\"cpu\""; devices].join(", "));
        }
        if j.zones > 0 {
            text += &format!("zone = \"zone-{}\"\n\n", (id - 1) % j.zones as u64);
        }
        if let Some((_, us)) = j.slow.as_ref().filter(|(n, _)| n == name) {
            text += &format!("slowdown_us_per_sample = {us}\n\n");
        }
        if let Some((_, f)) = j.slow_factor.as_ref().filter(|(n, _)| n == name) {
            text += &format!("slowdown_factor = {f:?}\n\n");
        }
        if let Some(gate) = &self.gate {
            text += &format!("start_gate = {:?}\n\n", gate.display().to_string());
        }
        text += &format!(
            "[cluster]\nname = {:?}\nmin_nodes = {}\nstraggler_ratio = {:?}\n",
            self.file.cluster, self.job.min_nodes, self.job.straggler_ratio
        );
        if founder {
            text += &format!(
                "bootstrap = [{}]\n",
                self.founders.iter().map(|f| format!("{f:?}")).collect::<Vec<_>>().join(", ")
            );
        } else {
            text += &format!("seeds = [{}]\n", seeds.join(", "));
        }
        text += &self.job_sections()?;
        if j.tls {
            text += &self.security_section(name, id)?;
        } else {
            text += "\n[security]\ninsecure = true\n";
        }
        text += &format!(
            "\n[revocation]\nsources = [\"aws\"]\npoll_secs = {:?}\naws_endpoint = \"http://{md_addr}\"\n",
            j.revocation_poll_s.unwrap_or(0.2)
        );
        if let Some(job) = &j.synthetic {
            text += &format!("\n[synthetic]\n{}", toml::to_string(job)?);
        }
        if let Some(extra) = &j.extra_config {
            text += &format!("\n{extra}\n");
        }
        std::fs::write(&config, text).with_context(|| format!("writing {}", config.display()))?;
        let out = std::fs::File::create(&log)?;
        let child = spawn_logged(self.limpetd_command(name, &config), out)?;
        self.file.nodes.push(LocalNode {
            name: name.to_string(),
            id,
            control: control.to_string(),
            data,
            metadata: format!("http://{md_addr}"),
            metrics: format!("{}://{metrics}/metrics", if j.metrics_tls { "https" } else { "http" }),
            config,
            log,
            step_log,
            pid: child.id(),
            metadata_pid: md_child.id(),
            netns: self.spaces.get(name).cloned(),
        });
        self.children.insert(name.to_string(), child);
        self.metadata.insert(name.to_string(), md_child);
        self.save()
    }

    /// `[job]`, `[model]`, `[data]`, `[pipeline]` and `[checkpoint]` of a node's file.
    fn job_sections(&self) -> limpet_daemon::Result<String> {
        let j = &self.job;
        let mut text = String::new();
        text += &format!(
            "\n[job]\nmodel = {:?}\ndata = {:?}\nsteps = {}\nglobal_batch = {}\npolicy = {:?}\nseed = {}\nbase_world = {}\n",
            j.model,
            j.data,
            j.steps,
            j.global_batch,
            j.policy,
            j.seed,
            self.founders.len()
        );
        if let Some(m) = j.micro_batch {
            text += &format!("micro_batch = {m}\n");
        }
        if j.reproducible {
            text += "reproducible = true\n";
        }
        if let Some(k) = j.shards {
            text += &format!("shards = {k}\n");
        }
        if let Some(e) = j.eval_every {
            text += &format!("eval_every = {e}\n");
        }
        if let Some((mode, replicas)) = &j.shard_state {
            text += &format!("shard_state = {mode:?}\nshard_replicas = {replicas}\n");
        }
        if let Some(o) = j.overlap {
            text += &format!("overlap = {o}\n");
        }
        if let Some(lr) = j.lr {
            text += &format!("lr = {lr:?}\n");
        }
        if let Some(o) = &j.optimizer {
            text += &format!("optimizer = {o:?}\n");
        }
        if let Some(l) = j.layers {
            text += &format!("layers = {l}\n");
        }
        if let Some(p) = &j.data_path {
            text += &format!("data_path = {:?}\n", p.display().to_string());
        }
        for (name, section) in
            [("model", toml::to_string(&j.model_section)?), ("data", toml::to_string(&j.data_section)?)]
        {
            if !section.is_empty() {
                text += &format!("\n[{name}]\n{section}");
            }
        }
        if let Some(p) = &j.pipeline {
            let stages = if p == "auto" { "\"auto\"".to_string() } else { p.clone() };
            text += &format!("\n[pipeline]\nstages = {stages}\n");
            if let Some(m) = &j.pipeline_memory {
                text += &format!("memory = {m:?}\n");
            }
            text += &format!("shadow_every = {}\n", j.shadow_every);
        }
        if j.checkpoint_every > 0 {
            text += &format!("\n[checkpoint]\nevery_steps = {}\nkeep = 2\n", j.checkpoint_every);
            if let Some(d) = &j.checkpoint_dir {
                text += &format!("dir = {:?}\n", d.display().to_string());
            }
            if let Some((url, endpoint)) = &j.checkpoint_s3 {
                text += &format!("s3 = {url:?}\ns3_endpoint = {endpoint:?}\ns3_region = \"us-east-1\"\n");
            }
            if let Some(r) = &j.checkpoint_resume {
                text += &format!("resume = {r:?}\n");
            }
            if j.checkpoint_shared {
                text += "shared = true\n";
            }
            if let Some(m) = &j.checkpoint_min_free {
                text += &format!("min_free = {m:?}\n");
            }
        }
        Ok(text)
    }

    /// `[security]` of node `name`'s file, issuing its certificate on its first start.
    fn security_section(&self, name: &str, id: u64) -> limpet_daemon::Result<String> {
        let certs = self.certs_dir();
        let (cert, key) = (certs.join(format!("{name}.pem")), certs.join(format!("{name}.key")));
        // A restarted node keeps its certificate.
        if !cert.exists() {
            limpet_daemon::certs::issue_for_days(&certs, name, limpet_daemon::certs::Kind::Node(id), 30)?;
        }
        Ok(format!(
            "\n[security]\nca = {:?}\ncert = {:?}\nkey = {:?}\nanonymous_status = {}\n",
            certs.join("ca.pem").display().to_string(),
            cert.display().to_string(),
            key.display().to_string(),
            self.job.anonymous_status
        ))
    }

    /// The command that starts `limpetd` on `config`, under the fake systemd if there is one,
    /// in node `name`'s namespace if it has one.
    fn limpetd_command(&self, name: &str, config: &Path) -> Command {
        let cmd = match &self.systemd {
            // systemd sets WATCHDOG_PID to the service's own pid: the shell's, which exec
            // hands to limpetd.
            Some(sd) => {
                let mut c = Command::new("sh");
                c.args(["-c", "export WATCHDOG_PID=$$; exec \"$0\" \"$@\""])
                    .arg(&self.limpetd)
                    .args(["--config", &config.display().to_string()])
                    .args(&sd.args)
                    .env("NOTIFY_SOCKET", &sd.notify_socket)
                    .env("WATCHDOG_USEC", sd.watchdog.as_micros().to_string());
                c
            }
            None => {
                let mut c = self.in_space(name, &self.limpetd);
                c.args(["--config", &config.display().to_string()]).env_remove("NOTIFY_SOCKET");
                c
            }
        };
        let mut cmd = cmd;
        if self.job.synthetic.is_some() {
            // Hundreds of agents on one machine: glibc gives each thread that allocates an
            // arena of its own (an agent runs about 50), which held 60-80 MB an idle agent.
            cmd.env("MALLOC_ARENA_MAX", "2");
        }
        cmd.envs(self.job.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    fn save(&self) -> limpet_daemon::Result<()> {
        let tmp = self.dir.join("cluster.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&self.file)?)?;
        std::fs::rename(&tmp, self.dir.join("cluster.json"))?;
        Ok(())
    }

    /// Starts a stopped node's limpetd again with its configuration and state directory
    /// (an upgrade: stop, replace the binary, start).
    pub fn restart(&mut self, name: &str) -> limpet_daemon::Result<()> {
        if self.running(name) {
            limpet_daemon::fail!("{name} is still running");
        }
        let node = self.file.node(name)?.clone();
        let out = std::fs::OpenOptions::new().append(true).create(true).open(&node.log)?;
        let mut cmd = self.in_space(name, &self.limpetd);
        cmd.args(["--config", &node.config.display().to_string()]).env_remove("NOTIFY_SOCKET");
        cmd.envs(self.job.env.iter().map(|(k, v)| (k, v)));
        let child = spawn_logged(cmd, out)?;
        if let Some(n) = self.file.nodes.iter_mut().find(|n| n.name == name) {
            n.pid = child.id();
        }
        self.children.insert(name.to_string(), child);
        self.save()
    }

    /// `kill -9` of a node's limpetd.
    pub fn kill(&mut self, name: &str) -> limpet_daemon::Result<()> {
        let child = self.children.get_mut(name).ok_or_else(|| anyhow::anyhow!("no running node {name:?}"))?;
        child.kill().with_context(|| format!("killing {name}"))?;
        let _ = child.wait();
        Ok(())
    }

    /// Whether a node's limpetd still runs (and reaps it if it ended).
    pub fn running(&mut self, name: &str) -> bool {
        self.children.get_mut(name).is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// A node whose limpetd exited in failure before it started (a port taken, a bad file):
    /// its name and the last line of its log, so that a driver stops at once and says why
    /// instead of waiting out its timeout for a node that will never come.
    pub fn failed_to_start(&mut self) -> Option<(String, String)> {
        for (name, child) in self.children.iter_mut() {
            if !matches!(child.try_wait(), Ok(Some(s)) if !s.success()) {
                continue;
            }
            let log = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
            if !log.contains("limpetd started") {
                let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(empty log)");
                return Some((name.clone(), last.to_string()));
            }
        }
        None
    }

    /// Waits up to `wait` for a node's limpetd to exit; its exit status.
    pub fn wait_exit(&mut self, name: &str, wait: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + wait;
        let child = self.children.get_mut(name)?;
        loop {
            if let Ok(Some(s)) = child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops everything: SIGINT to every limpetd (then SIGKILL), and the metadata services.
    pub fn down(&mut self) {
        for c in self.children.values_mut() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in self.children.values_mut() {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        for c in self.metadata.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        self.metadata.clear();
    }
}

/// Starts a limpetd command with its output in `log` and the cluster's log filter.
fn spawn_logged(mut cmd: Command, log: std::fs::File) -> limpet_daemon::Result<Child> {
    cmd.env("LIMPET_LOG", std::env::var("LIMPET_LOG").unwrap_or_else(|_| "info,raft=warn".into()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting limpetd")
        .map_err(Into::into)
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.down();
    }
}

/// The body of a GET (a node's `/metrics`, for tests and the demo).
pub fn get_text(url: &str) -> limpet_daemon::Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let r = reqwest::Client::new()
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        if !r.status().is_success() {
            limpet_daemon::fail!("{url} answered {}", r.status());
        }
        Ok(r.text().await?)
    })
}

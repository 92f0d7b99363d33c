//! From a configuration file to what `limpetd` runs: the agent's configuration, the job it
//! trains (its data read, its model built), and the service's own settings. Start-up and
//! `limpetd validate` both call [`Config::settings`], so validate refuses exactly what start-up
//! would, short of binding ports and joining.

use super::check::Checks;
use super::{Config, ConfigErrors};
use limpet_agent::runtime::AgentConfig;
use limpet_trainer::data::Dataset;
use limpet_trainer::{workload, JobSpec, TrainerError};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a configuration file asks `limpetd` to run.
pub struct Settings {
    /// The agent.
    pub agent: AgentConfig,
    /// Where to serve Prometheus metrics.
    pub metrics: Option<SocketAddr>,
    /// Serve them over mutual TLS with this configuration (the node's certificate).
    pub metrics_tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    /// How long a SIGTERM drain may take.
    pub grace: Duration,
    /// The fleet reconciler (`[capacity]`), run while this node leads.
    pub capacity: Option<crate::reconciler::Reconciler>,
    /// What the file allows but probably does not mean (unwritable paths, uneven shards).
    pub warnings: Vec<String>,
}

impl Config {
    /// Reads every key into its value, builds the job from its data and model, and checks
    /// what only the built job can tell (pipeline cuts within the model's blocks): every
    /// problem of the file, or what it runs.
    pub fn settings(&self) -> Result<Settings, ConfigErrors> {
        let mut c = Checks::new(&self.source.file, &self.source.text);
        let f = self.values(&mut c);
        // The job is built from the keys above: with any of them wrong, its errors would be
        // echoes of the same problems.
        c.so_far()?;
        let job = match self.job_spec() {
            Ok(job) => job,
            Err(e) => return Err(job_error(c, self, e)),
        };
        let blocks = job.model.num_blocks();
        if let Some(cuts) = self.pipeline.as_ref().and_then(|p| p.cuts.as_ref()) {
            if cuts.last().is_some_and(|&cut| cut >= blocks) {
                c.fail(
                    "[pipeline].cuts",
                    format!("{cuts:?}: the model has {blocks} blocks, so every cut must be below {blocks}"),
                );
            }
        }
        c.so_far()?;
        let mut a = AgentConfig::new(
            self.node_id(),
            &self.node.name,
            &self.cluster.name,
            self.node.state_dir.clone(),
            f.secret,
            job,
        );
        let node = &self.node;
        let address = |a: Option<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
        a.control = node.control;
        a.data = node.data;
        a.advertise_control = address(node.advertise_control);
        a.advertise_data = address(node.advertise_data);
        a.zone = node.zone.clone().unwrap_or_default();
        a.zone_levels = node.zone_levels;
        a.base_world = self.job.base_world.unwrap_or(f.founders.len().max(1) as u64);
        a.bootstrap = (!f.founders.is_empty()).then_some(f.founders);
        a.seeds = self.cluster.seeds.iter().map(SocketAddr::to_string).collect();
        a.max_voters = self.cluster.max_voters;
        a.data_path = self.job.data_path.clone();
        a.device = f.device;
        a.devices = f.devices;
        a.init_from = self.model.init_from.clone();
        a.policy = self.job.policy;
        a.min_nodes = self.cluster.min_nodes;
        a.straggler_ratio = self.cluster.straggler_ratio;
        a.straggler_steps = self.cluster.straggler_steps;
        #[cfg(feature = "lab")]
        {
            a.slowdown = limpet_agent::runtime::Slowdown {
                us_per_sample: node.slowdown_us_per_sample,
                factor: node.slowdown_factor,
            };
        }
        a.poll = Duration::from_secs_f64(self.revocation.poll_secs);
        a.timing = self.timing.clone();
        a.dp_congestion = f.congestion;
        a.step_log = node.step_log.clone();
        let mut metrics_tls = None;
        if let Some(tls) = f.tls {
            if self.node.metrics_tls {
                match tls.data_server() {
                    Ok(server) => metrics_tls = Some(server),
                    Err(e) => {
                        c.fail("[node].metrics_tls", format!("the node's certificate cannot serve: {e}"));
                        c.so_far()?;
                    }
                }
            }
            a.tls = Some(std::sync::Arc::new(tls));
            a.tls_data = self.tls().is_some_and(|s| s.data_plane == super::DataPlaneMode::Tls);
        }
        a.pipeline = self.pipeline.clone();
        a.checkpoint = self.checkpoint.clone().map(|mut ck| {
            ck.dir = self.checkpoint_dir();
            ck
        });
        let mut warnings = f.warnings;
        warnings.extend(self.write_path_warnings());
        warnings.extend(self.shard_warning());
        warnings.extend(self.cpu_warning(limpet_trainer::device::gpu_count()));
        Ok(Settings {
            agent: a,
            metrics: self.node.metrics,
            metrics_tls,
            grace: self.timing.drain_grace(),
            capacity: self.reconciler(),
            warnings,
        })
    }

    /// The trainer's job from `[job]`, `[model]` and `[data]`: the model's defaults,
    /// overridden by what the file sets. Reads the data.
    pub fn job_spec(&self) -> Result<JobSpec, TrainerError> {
        let j = &self.job;
        let spec = workload::data_spec(j.data.as_str(), &self.data, j.keys.seed.unwrap_or(0))?;
        let data = Dataset::load(&spec, j.data_path.as_deref())?;
        let mut model = self.model.clone();
        if j.layers.is_some() {
            model.layers = j.layers;
        }
        let mut job = workload::job_for(j.model.kind(), &data, &model)?;
        j.keys
            .apply(&mut job)
            .map_err(|e| TrainerError::Key { key: format!("[job].{}", e.key), detail: e.detail })?;
        job.validate(&data)?;
        Ok(job)
    }

    /// `[checkpoint].dir`, defaulting to the state directory's `checkpoints`.
    fn checkpoint_dir(&self) -> Option<PathBuf> {
        let ck = self.checkpoint.as_ref()?;
        Some(ck.dir.clone().unwrap_or_else(|| self.node.state_dir.join("checkpoints")))
    }

    /// The reconciler `[capacity]` asks for: EC2 where `[cluster]` finds it unless the section
    /// says otherwise; spare credentials from `[security.ssm]` unless `spares = false`.
    fn reconciler(&self) -> Option<crate::reconciler::Reconciler> {
        let section = self.capacity.clone()?;
        let ec2 = limpet_deploy::FleetConfig {
            region: section.region.clone().or_else(|| self.cluster.ec2_region.clone()),
            endpoint: section.endpoint.clone().or_else(|| self.cluster.ec2_endpoint.clone()),
            credentials: None,
        };
        let ssm = self.tls().and_then(|s| s.ssm.as_ref());
        // `spares = true` without [security.ssm] is refused by the checks.
        let spares = ssm.filter(|_| section.spares != Some(false)).map(|ssm| {
            let at = limpet_deploy::FleetConfig {
                region: ssm.region.clone().or_else(|| ec2.region.clone()),
                endpoint: ec2.endpoint.clone(),
                credentials: None,
            };
            (ssm.prefix.clone(), at)
        });
        Some(crate::reconciler::Reconciler {
            section,
            cluster: self.cluster.name.clone(),
            me: self.node_id(),
            ec2,
            spares,
        })
    }

    /// A host with GPUs that would train on its CPU because nothing asked for the GPUs:
    /// `[job].device` defaults to `"cpu"` and `[node].devices` is absent. Said at validate
    /// and start-up rather than refused (a CPU job on a GPU host is legitimate, but rarely
    /// meant).
    pub fn cpu_warning(&self, gpus: usize) -> Option<String> {
        let text = &self.source.text;
        let said = super::check::line_of(text, "[job].device").is_some();
        (gpus > 0 && self.node.devices.is_none() && !said).then(|| {
            format!(
                "[job].device: this host has {gpus} GPU(s) libtorch can use, and the job trains on its CPU (device defaults to \"cpu\"); set [node].devices = \"auto\" (every GPU, one rank each) or [job].device = \"auto\", or device = \"cpu\" to mean it"
            )
        })
    }

    /// A reproducible job whose canonical shards do not divide evenly among the founders:
    /// every step, some hosts then run one shard's passes more than others, or sit idle (see
    /// docs/design.md, reproducible jobs). A later world may differ; the founders are the
    /// world the job is set up for.
    pub fn shard_warning(&self) -> Option<String> {
        let founders = self.cluster.bootstrap.len();
        let keys = &self.job.keys;
        if keys.reproducible != Some(true) || founders == 0 {
            return None;
        }
        let k = keys.shards.unwrap_or(limpet_trainer::SHARDS).min(self.job.global_batch() as usize);
        let said = if keys.shards.is_some() { "" } else { " (the default)" };
        if k < founders {
            return Some(format!(
                "[job].shards {k}{said} with {founders} founders: {} of them idle every step; shards = {founders} keeps each busy",
                founders - k
            ));
        }
        (k % founders != 0).then(|| {
            let most = k.div_ceil(founders);
            format!(
                "[job].shards {k}{said} with {founders} founders: some run {most} shards' passes a step, others {}; shards = {founders} (one pass each, the fastest) or a multiple of it evens them",
                most - 1
            )
        })
    }

    /// The directories limpetd writes to that it cannot write here, each naming its key. Run
    /// as the unit's `ExecStartPre`, this sees the unit's sandbox: with
    /// `ProtectSystem=strict`, every path outside the state, log and temporary directories
    /// must be in `ReadWritePaths=`, else checkpoints and step logs fail only once training
    /// runs. A path that does not exist yet (a mount not up) is named too, but may be fine
    /// later.
    pub fn write_path_warnings(&self) -> Vec<String> {
        let mut dirs: Vec<(&str, PathBuf)> = vec![("[node].state_dir", self.node.state_dir.clone())];
        if let Some(dir) = self.checkpoint_dir() {
            dirs.push(("[checkpoint].dir", dir));
        }
        if let Some(parent) = self.node.step_log.as_deref().and_then(std::path::Path::parent) {
            dirs.push(("[node].step_log", parent.to_path_buf()));
        }
        let mut out = Vec::new();
        for (key, dir) in dirs {
            // The nearest existing ancestor is where a write (or the directory's creation) lands.
            let Some(existing) = dir.ancestors().find(|a| a.exists()) else { continue };
            if existing != dir {
                out.push(format!("{key} {}: does not exist yet (a mount not up?)", dir.display()));
            }
            let probe = existing.join(format!(".limpetd-validate-{}", std::process::id()));
            match std::fs::File::create(&probe) {
                Ok(_) => {
                    let _ = std::fs::remove_file(&probe);
                }
                Err(e) => out.push(format!(
                    "{key} {}: not writable here ({e}); under the systemd unit, add it to ReadWritePaths=",
                    existing.display()
                )),
            }
        }
        out
    }
}

/// Why the job could not be built, under the key that caused it (a file's error under the
/// key that names the file), with what was found before.
fn job_error(mut c: Checks, cfg: &Config, e: TrainerError) -> ConfigErrors {
    match e {
        TrainerError::Key { key, detail } => c.fail(&key, detail),
        TrainerError::Data { path, detail } => {
            let under = |p: Option<&std::path::Path>| p.is_some_and(|p| path.starts_with(p));
            let key = if under(cfg.model.init_from.as_deref()) {
                "[model].init_from"
            } else if under(cfg.job.data_path.as_deref()) {
                "[job].data_path"
            } else {
                "[job].data"
            };
            c.fail(key, format!("{}: {detail}", path.display()))
        }
        // The model's own sizes (rope_theta, context, vocab) are `[model]`'s keys.
        TrainerError::Config(m) if m.starts_with("model: ") || m.starts_with("model.") => {
            c.fail("[model]", m.trim_start_matches("model: "))
        }
        other => c.fail("[job]", other.to_string()),
    }
    c.finish().expect_err("a problem was just recorded")
}

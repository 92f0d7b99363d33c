//! What the parser cannot check: ranges and combinations of keys, and the values that need
//! the host or other files (the secret, certificates, devices resolved against this host's
//! GPUs, the founders' list). Addresses, sizes, devices and stage counts are read into their
//! types while the file is parsed (`limpet_agent::config_value`), and their errors reported
//! here with the others; start-up and `limpetd validate` both take their values from here,
//! and every problem is reported, not just the first.

use super::check::Checks;
use super::{parse_founders, read_secret, Config, ModelName, Stages};

use limpet_agent::policy::BatchPolicy;
use limpet_consensus::state::MemberSpec;
use limpet_trainer::device::{Device, DeviceChoice};

/// The values of a configuration's keys, read once. Where a key was wrong, its value here is
/// a stand-in: the checks' errors say so, and nothing is built from a file with errors.
pub(super) struct Values {
    pub secret: Vec<u8>,
    pub founders: Vec<MemberSpec>,
    pub device: DeviceChoice,
    /// `[node].devices`, resolved on this host (empty: absent).
    pub devices: Vec<Device>,
    pub congestion: Option<String>,
    pub tls: Option<limpet_consensus::tls::Tls>,
    /// What the keys allow but may not mean.
    pub warnings: Vec<String>,
}

fn http_url(url: &str) -> Result<(), String> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(())
    } else {
        Err(format!("{url:?} is not an http(s) URL"))
    }
}

impl Config {
    /// Reads and checks every key, reporting each problem into `c`.
    pub(super) fn values(&self, c: &mut Checks) -> Values {
        self.keys_known(c);
        let node = &self.node;
        if node.name.is_empty() {
            c.fail("[node].name", "is empty");
        }
        if node.id == Some(0) {
            c.fail("[node].id", "0 is reserved by raft");
        }
        if let Some(zone) = &node.zone {
            let word = |ch: char| ch.is_ascii_alphanumeric() || "-_.".contains(ch);
            if zone.is_empty() || zone.len() > 64 || !zone.chars().all(word) {
                c.fail(
                    "[node].zone",
                    format!("{zone:?} is not a zone name (1 to 64 letters, digits, '-', '_' or '.')"),
                );
            }
        }
        let secret = c.take("[node].secret_file", read_secret(&node.secret_file)).unwrap_or_default();
        #[cfg(feature = "lab")]
        if !(node.slowdown_factor.is_finite() && (1.0..=100.0).contains(&node.slowdown_factor)) {
            c.fail("[node].slowdown_factor", format!("{} is not within 1..=100", node.slowdown_factor));
        }
        // Two listeners on one address: the second would fail to bind only at start.
        let listeners = [
            ("[node].control", Some(node.control)),
            ("[node].data", Some(node.data)),
            ("[node].metrics", node.metrics),
        ];
        for (i, (key, a)) in listeners.iter().enumerate() {
            let same = listeners[..i].iter().find(|(_, b)| a.is_some_and(|a| a.port() != 0 && Some(a) == *b));
            if let (Some((other, _)), Some(a)) = (same, a) {
                c.fail(key, format!("{a} is {other}'s address too"));
            }
        }
        let empty = |p: &std::path::Path| p.as_os_str().is_empty();
        if empty(&node.state_dir) {
            c.fail("[node].state_dir", "is empty");
        }
        if node.step_log.as_deref().is_some_and(empty) {
            c.fail("[node].step_log", "is empty");
        } else if let Some(log) = node.step_log.as_deref().filter(|p| p.is_dir()) {
            c.fail(
                "[node].step_log",
                format!("{} is a directory; name the file to append to", log.display()),
            );
        }
        if self.checkpoint.as_ref().and_then(|k| k.dir.as_deref()).is_some_and(empty) {
            c.fail("[checkpoint].dir", "is empty");
        }
        if node.metrics_tls && (node.metrics.is_none() || self.tls().is_none()) {
            c.fail(
                "[node].metrics_tls",
                "needs [node].metrics and [security] with certificates (ca, cert, key)",
            );
        }
        let congestion = c
            .take(
                "[node].data_congestion",
                limpet_agent::dataplane::endpoint::parse_congestion(&node.data_congestion),
            )
            .flatten();
        let founders = self.check_cluster(c);
        let mut warnings = Vec::new();
        let (device, devices) = self.check_devices(c, &mut warnings);
        self.check_job(c);
        self.check_timing(c);
        self.check_pipeline(c);
        self.check_checkpoint(c);
        let r = self.revocation.poll_secs;
        if !(r.is_finite() && (0.1..=3600.0).contains(&r)) {
            c.fail("[revocation].poll_secs", format!("{r} is not within 0.1..=3600 s"));
        }
        let tls = self.check_security(c);
        if let Some(cap) = &self.capacity {
            cap.check(c);
            if cap.spares == Some(true) && self.tls().and_then(|s| s.ssm.as_ref()).is_none() {
                c.fail("[capacity].spares", "is true, but [security.ssm] says nowhere to find them");
            }
        }
        Values { secret, founders, device, devices, congestion, tls, warnings }
    }

    fn check_cluster(&self, c: &mut Checks) -> Vec<MemberSpec> {
        let cl = &self.cluster;
        if cl.name.is_empty() {
            c.fail("[cluster].name", "is empty");
        }
        let founders =
            c.take("[cluster].bootstrap", parse_founders(&cl.bootstrap).map_err(|e| e.0)).unwrap_or_default();
        if cl.bootstrap.is_empty() && cl.seeds.is_empty() && !cl.ec2_seeds {
            c.fail("[cluster]", "needs seeds to join through (or ec2_seeds = true), or bootstrap founders");
        }
        if let Some(url) = &cl.ec2_endpoint {
            c.take("[cluster].ec2_endpoint", http_url(url));
        }
        if cl.max_voters == 0 || cl.max_voters % 2 == 0 {
            c.fail("[cluster].max_voters", format!("{} is not an odd positive number", cl.max_voters));
        }
        if cl.min_nodes == 0 {
            c.fail("[cluster].min_nodes", "must be at least 1");
        }
        let r = cl.straggler_ratio;
        if !(r == 0.0 || (r.is_finite() && (1.05..=100.0).contains(&r))) {
            c.fail("[cluster].straggler_ratio", format!("{r} is neither 0 (off) nor within 1.05..=100"));
        }
        founders
    }

    /// `[job].device`, and `[node].devices` on this host.
    fn check_devices(&self, c: &mut Checks, warnings: &mut Vec<String>) -> (DeviceChoice, Vec<Device>) {
        let device = self.job.device;
        c.take("[job].device", device.resolve());
        if let Some((key, why)) = self.auto_refusal(&limpet_trainer::device::backend()) {
            c.fail(key, why);
        }
        let devices = c.take("[node].devices", self.node.local_devices()).flatten().unwrap_or_default();
        // A pipelined epoch gives each host as many local ranks as its host with the fewest
        // has, and a pipe lane each, of which there are at most MAX_PIPELINE_LOCAL_RANKS.
        let most = limpet_consensus::state::MAX_PIPELINE_LOCAL_RANKS as usize;
        if self.pipeline.is_some() && devices.len() > most {
            warnings.push(format!(
                "[node].devices: {} devices, but a pipelined job trains on at most {most} a host",
                devices.len()
            ));
        }
        (device, devices)
    }

    /// `"auto"` (`[node].devices`, or `[job].device` without it) on a host whose GPUs
    /// libtorch cannot use: refused, since it would quietly train on the CPU; `"cpu"` says the
    /// CPU is meant. The key and why.
    pub fn auto_refusal(&self, backend: &limpet_trainer::device::Backend) -> Option<(&'static str, String)> {
        let (key, auto) = match &self.node.devices {
            Some(d) => ("[node].devices", d.0 == [DeviceChoice::Auto]),
            None => ("[job].device", self.job.device == DeviceChoice::Auto),
        };
        let why = backend.gpus_unusable().filter(|_| auto)?;
        Some((
            key,
            format!("\"auto\" would train on the CPU: {why}; fix that, or set \"cpu\" to train on the CPU"),
        ))
    }

    /// `[job]`, `[model]` and `[data]` as far as they can be checked without the data.
    fn check_job(&self, c: &mut Checks) {
        let job = &self.job;
        let pipelined = self.pipeline.is_some();
        if job.model == ModelName::Torchscript && pipelined {
            c.fail(
                "[pipeline]",
                "model torchscript is one stage: a TorchScript graph cannot be cut into pipeline stages",
            );
        }
        let data = job.data.as_str();
        if ["tokens", "tensors"].contains(&data) && job.data_path.is_none() {
            c.fail("[job].data_path", format!("data {data:?} needs its files (data_path)"));
        }
        let keys = &job.keys;
        let precision = keys.precision.as_deref().map(limpet_trainer::model::Precision::parse);
        let precision = precision.and_then(|p| c.take("[job].precision", p));
        if precision == Some(limpet_trainer::model::Precision::Bf16) && job.model != ModelName::Llama {
            c.fail("[job].precision", "\"bf16\" is available for model \"llama\" only");
        }
        if self.data.context == Some(0) {
            c.fail("[data].context", "must be at least 1");
        }
        if self.data.context.is_some() && !["chars", "tokens"].contains(&data) {
            c.fail("[data].context", "applies to data \"chars\" and \"tokens\" only");
        }
        match self.model.check_keys(job.model.as_str()) {
            Err(limpet_trainer::TrainerError::Key { key, detail }) => c.fail(&key, detail),
            Err(e) => c.fail("[model]", e.to_string()),
            Ok(()) => {}
        }
        if self.model.tie_embeddings == Some(true) && pipelined {
            c.fail(
                "[model].tie_embeddings",
                "the head shares the embedding, so the model cannot be split into pipeline stages",
            );
        }
        if let Err(e) = keys.check() {
            c.fail(&format!("[job].{}", e.key), e.detail);
        }
        if keys.reproducible == Some(true) {
            if job.policy != BatchPolicy::FixedGlobal {
                c.fail(
                    "[job].reproducible",
                    "needs policy \"fixed-global\": the other policies change the batch or the learning rate with the world size",
                );
            }
            if pipelined {
                c.fail(
                    "[job].reproducible",
                    "is for data parallelism only: a pipelined step sums over its replicas' stages in f32",
                );
            }
        }
        if pipelined {
            // Stages run their own forward and backward: refused rather than silently ignored.
            let unsupported = [
                ("[job].activation_checkpointing", keys.activation_checkpointing == Some(true)),
                ("[job].loss_chunk", keys.loss_chunk.is_some()),
                ("[job].eval_every", keys.eval_every.is_some()),
                ("[job].shard_state", self.sharded()),
            ];
            for (key, _) in unsupported.iter().filter(|(_, set)| *set) {
                c.fail(key, "is not supported by a pipelined job yet ([pipeline] is set)");
            }
        }
        if job.base_world == Some(0) {
            c.fail("[job].base_world", "must be at least 1");
        }
        if job.layers == Some(0) || (job.layers.is_some() && job.model != ModelName::Gpt) {
            c.fail("[job].layers", "applies to model \"gpt\" only, and must be at least 1");
        }
    }

    /// Whether `[job].shard_state` shards anything.
    pub(super) fn sharded(&self) -> bool {
        self.job.keys.shard_state.as_deref().is_some_and(|s| s != "none")
    }

    fn check_timing(&self, c: &mut Checks) {
        let t = &self.timing;
        // An hour at most: longer leaves a dead host unnoticed for longer than any job waits,
        // and the sums below must not overflow.
        const HOUR_MS: u64 = 3_600_000;
        for (key, v, lo) in [
            ("[timing].heartbeat_ms", t.heartbeat_ms, 10),
            ("[timing].failure_timeout_ms", t.failure_timeout_ms, 50),
            ("[timing].data_timeout_ms", t.data_timeout_ms, 50),
            ("[timing].raft_tick_ms", t.raft_tick_ms, 5),
            ("[timing].lead_ms", t.lead_ms, 0),
            ("[timing].notice_margin_ms", t.notice_margin_ms, 0),
        ] {
            if v < lo {
                c.fail(key, format!("{v} is below {lo}"));
            } else if v > HOUR_MS {
                c.fail(key, format!("{v} is above an hour ({HOUR_MS})"));
            }
        }
        if t.failure_timeout_ms < t.heartbeat_ms.saturating_mul(2) {
            c.fail(
                "[timing].failure_timeout_ms",
                format!(
                    "{} must be at least two heartbeats ({} ms)",
                    t.failure_timeout_ms,
                    t.heartbeat_ms.saturating_mul(2)
                ),
            );
        }
        if !(1..=3600).contains(&t.drain_grace_secs) {
            c.fail("[timing].drain_grace_secs", format!("{} is not within 1..=3600", t.drain_grace_secs));
        }
    }

    /// `[pipeline]`.
    fn check_pipeline(&self, c: &mut Checks) {
        let Some(p) = &self.pipeline else { return };
        if let Some(cuts) = &p.cuts {
            if cuts.windows(2).any(|w| w[0] >= w[1]) || cuts.first() == Some(&0) {
                c.fail("[pipeline].cuts", format!("{cuts:?} must increase and start after block 0"));
            } else if p.stages != Stages::Fixed(cuts.len() + 1) {
                let n = cuts.len() + 1;
                c.fail("[pipeline].cuts", format!("{} cut(s) make {n} stages; set stages = {n}", cuts.len()));
            }
        }
        if !(p.link_gbps.is_finite() && p.link_gbps > 0.0) {
            c.fail("[pipeline].link_gbps", format!("{} is not a positive number", p.link_gbps));
        }
        if !(p.latency_ms.is_finite() && p.latency_ms >= 0.0) {
            c.fail("[pipeline].latency_ms", format!("{} is not a non-negative number", p.latency_ms));
        }
    }

    /// `[checkpoint]`.
    fn check_checkpoint(&self, c: &mut Checks) {
        let Some(ck) = &self.checkpoint else { return };
        // A year at most: beyond, it is no schedule (and no Duration).
        if !(ck.every_minutes.is_finite() && (0.0..=525_600.0).contains(&ck.every_minutes)) {
            c.fail(
                "[checkpoint].every_minutes",
                format!("{} is not within 0..=525600 (a year)", ck.every_minutes),
            );
        }
        if ck.every_steps == 0 && ck.every_minutes == 0.0 {
            c.fail("[checkpoint]", "set every_steps or every_minutes (or drop the section)");
        }
        if ck.keep == 0 {
            c.fail("[checkpoint].keep", "must be at least 1");
        }
        if let Some(url) = &ck.s3_endpoint {
            if ck.s3.is_none() {
                c.fail("[checkpoint].s3_endpoint", "set s3 too (the bucket and prefix)");
            }
            c.take("[checkpoint].s3_endpoint", http_url(url));
        }
        if (self.pipeline.is_some() || self.sharded()) && ck.every_minutes > 0.0 {
            // Each stage writes its own part; only a step count tells every stage the same
            // moment without another round of agreement.
            let which = if self.sharded() { "a job with sharded state" } else { "a pipelined job" };
            c.fail("[checkpoint].every_minutes", format!("{which} checkpoints by every_steps only"));
        }
    }

    /// `[security]`: the node's certificates, loaded and checked (`None`: insecure, or wrong).
    fn check_security(&self, c: &mut Checks) -> Option<limpet_consensus::tls::Tls> {
        let Some(sec) = &self.security else {
            c.fail(
                "[security]",
                "missing: limpetd runs with certificates (ca, cert and key: limpet certs init / issue); \
                 on a network you trust, insecure = true runs without them",
            );
            return None;
        };
        if sec.insecure {
            if sec.ca.is_some() || sec.cert.is_some() || sec.key.is_some() || sec.ssm.is_some() {
                c.fail(
                    "[security].insecure",
                    "is true, but ca, cert, key or [security.ssm] is set too: choose one",
                );
            }
            return None;
        }
        if let Some(ssm) = &sec.ssm {
            c.take(
                "[security.ssm].prefix",
                limpet_deploy::ssm::check_prefix(&ssm.prefix).map_err(|e| e.to_string()),
            );
        }
        sec.load(c.file(), self.node_id()).map_err(|e| c.push(e)).ok()
    }
}

//! The leader loop: while this node leads, it sets the job (profiled for the pipeline
//! planner, resumed from the newest durable checkpoint of a new cluster, as
//! [`limpet_decide::bootstrap`] decides), gathers the members' reports and proposes what
//! [`crate::leader::plan_round`] decides. The decisions themselves are pure and live in
//! limpet-decide; this room only does the I/O.

use super::config::{ControlConfig, Resume};
use super::{AgentError, Fatal};
use crate::report::AgentReport;
use limpet_consensus::state::{Command, NodeId};
use limpet_consensus::tasks::TaskFailed;
use limpet_consensus::NodeHandle;
use limpet_decide::bootstrap::{BootStep, Bootstrap};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// What the leader loop needs of the job this node runs: the trainer's job (`AgentConfig`)
/// or a synthetic one (the lab's agents without libtorch).
pub trait LeadJob: Send + Sync + 'static {
    /// The job as the log records it, before what the leader adds (a pipeline's profile): its
    /// fingerprint names the job's checkpoints.
    fn spec(&self) -> Result<serde_json::Value, AgentError>;
    /// Blocks of the job's model (what a checkpoint of it holds).
    fn blocks(&self) -> usize;
    /// Samples a step, and a micro-batch's.
    fn batch(&self) -> (u64, u64);
    /// The document the leader sets: the spec, with what this node measured of the job (a
    /// pipelined job's profile, a reproducible job's class of device).
    fn document(&self) -> Pin<Box<dyn Future<Output = Result<serde_json::Value, AgentError>> + Send + '_>>;
}

/// While this node leads: sets the job, runs the controller on the reports, activates
/// epochs that ranks entered and members that trained.
pub(super) async fn lead(
    cfg: Arc<ControlConfig>,
    spec: Arc<dyn LeadJob>,
    handle: NodeHandle,
    stop: CancellationToken,
) {
    let mut job = None;
    let mut boot = Bootstrap::default();
    let booted = Instant::now();
    let mut last_reason = String::new();
    let mut last_stuck = None;
    let (global_batch, micro_batch) = spec.batch();
    let settings = cfg.leader_settings(global_batch, micro_batch);
    let mut evidence = crate::leader::Evidence::default();
    // The term this node leads in, and since when.
    let mut led_since: Option<(u64, Instant)> = None;
    let mut round_at = Instant::now();
    let inbox = handle.reports().clone();
    // Suspects whose port accepted the leader's probe, and when.
    let mut answered_at: BTreeMap<NodeId, Instant> = BTreeMap::new();
    loop {
        // A round every 50 ms (5 ms at least after the last one ended), and at once when a
        // report comes at once (a collective broke): a dead peer is then failed without
        // waiting for the next round. Urgent reports never make rounds start closer than
        // 5 ms.
        let next = (round_at + ROUND_EVERY).max(Instant::now() + ROUND_AT_MOST_EVERY);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(next.into()) => {}
            _ = inbox.urgent() => {
                tokio::time::sleep_until((round_at + ROUND_AT_MOST_EVERY).into()).await;
            }
        }
        round_at = Instant::now();
        let local = handle.watch().borrow().clone();
        if !local.is_leader && last_stuck.take().is_some() {
            // Said by whoever leads now.
            metrics::gauge!("limpet_job_stuck").set(0.0);
        }
        // A new leader decides only once it has applied its own term's first entry: before,
        // its state may lack what the previous leader committed (the epoch it just started).
        if !(local.is_leader && local.leader_caught_up) {
            continue;
        }
        let term = local.term;
        let st = &local.state;
        if st.job.is_none() {
            let now = booted.elapsed().as_millis() as u64;
            match boot.next(now, job.is_some(), !st.checkpoints.is_empty()) {
                BootStep::Profile => match spec.document().await {
                    Ok(doc) => job = Some(doc),
                    Err(e) => tracing::error!(%e, "could not profile the model for the pipeline planner"),
                },
                BootStep::Wait => {}
                // A new cluster: start from the newest durable checkpoint of this job, if there
                // is one. Recorded before the job, so the first epoch starts there.
                BootStep::FindResume => match find_resume_point(&cfg, spec.as_ref()).await {
                    Ok(Some(record)) => {
                        match handle.propose_leading(Command::RecordCheckpoint { record }, term, None).await {
                            Ok(_) => boot.resume_settled(),
                            Err(e) => tracing::warn!(%e, "could not record the checkpoint to resume from"),
                        }
                    }
                    Ok(None) => boot.resume_settled(),
                    Err(e) => {
                        // No job is set meanwhile, so nothing trains from step 0.
                        tracing::warn!(%e, "cannot resume yet; looking again in 5 s");
                        metrics::counter!("limpet_resume_retries_total").increment(1);
                        boot.resume_failed(now);
                    }
                },
                BootStep::SetJob => {
                    let doc = job.clone().expect("the bootstrap sets the job only once profiled");
                    match handle.propose_leading(Command::SetJob { job: doc }, term, None).await {
                        Ok(_) | Err(limpet_consensus::ConsensusError::Deposed { .. }) => {}
                        Err(e) => tracing::warn!(%e, "could not set the job"),
                    }
                }
            }
            continue;
        }
        let now = super::now_ms();
        let st = Arc::clone(&local.state);
        let (held, timeout_ms) = (handle.reports().all(), settings.heartbeat_timeout_ms);
        let reports: BTreeMap<NodeId, (u64, AgentReport)> =
            match tokio::task::spawn_blocking(move || decode_reports(held)).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(%e, "decoding the reports failed");
                    continue;
                }
            };
        // Reports reach the voters only: a voter promoted lately, or one that was leaving the
        // voters when it won, may hold old reports or none. Silence counts from this node's
        // leadership at the earliest (as the voter controller counts it), and while a rank of
        // the current epoch has sent it nothing yet, it decides nothing. A voter that did not
        // lead got reports once a second (heartbeats.rs): for three intervals it waits for
        // every rank's first report to it as leader, so it does not plan a boundary from
        // steps a second old.
        let leading =
            led_since.filter(|(t, _)| *t == term).map_or(0, |(_, at)| at.elapsed().as_millis() as u64);
        if led_since.is_none_or(|(t, _)| t != term) {
            led_since = Some((term, Instant::now()));
        }
        let old_news = st
            .current
            .as_ref()
            .is_some_and(|e| e.ranks.iter().any(|r| reports.get(r).is_none_or(|(age, _)| *age > leading)));
        if old_news && leading < 3 * settings.heartbeat_ms {
            continue;
        }
        let mut reports = reports;
        for (age, _) in reports.values_mut() {
            *age = (*age).min(leading);
        }
        let unheard = st.current.as_ref().is_some_and(|e| e.ranks.iter().any(|r| !reports.contains_key(r)));
        if unheard && leading < timeout_ms {
            continue;
        }
        let suspects = crate::leader::suspects(&st, &reports, timeout_ms);
        // A suspect whose port answered is alive to the leader until it reports again or is
        // no longer suspected, and is not probed again meanwhile: a stalled process accepts
        // nothing, and probes would fill its queue until one went unanswered.
        // Once a second it is asked again: a process that has died since refuses then.
        let reported = |id: &NodeId| reports.get(id).is_some_and(|(age, _)| *age <= settings.heartbeat_ms);
        answered_at.retain(|id, at: &mut Instant| {
            suspects.contains(id) && !reported(id) && at.elapsed() < REPROBE_ANSWERED
        });
        let fresh: Vec<NodeId> =
            suspects.iter().copied().filter(|id| !answered_at.contains_key(id)).collect();
        let (refused, answered) = probe(&st, &fresh).await;
        evidence.refused = refused;
        answered_at.extend(answered.into_iter().map(|id| (id, Instant::now())));
        evidence.answered = answered_at.keys().copied().collect();
        evidence.track_ready(&st, &reports, timeout_ms, now);
        // The round (every report read, the controller, for a pipelined job the planner)
        // runs off the async workers, which the heartbeats and raft share.
        let (s, ev) = (settings.clone(), std::mem::take(&mut evidence));
        let planned = tokio::task::spawn_blocking(move || {
            let round = crate::leader::plan_round_with(&s, &st, &reports, now, &ev);
            (round, ev)
        })
        .await;
        let round = match planned {
            Ok((round, ev)) => {
                evidence = ev;
                round
            }
            Err(e) => {
                tracing::error!(%e, "the leader's round failed");
                continue;
            }
        };
        if round.stuck != last_stuck {
            match &round.stuck {
                Some(s) => tracing::error!(
                    step = s.step,
                    rebuilds = s.rebuilds,
                    node = s.node,
                    violation = s.violation,
                    error = %s.error,
                    "job {s}"
                ),
                None => tracing::info!("the job is no longer stuck"),
            }
            metrics::gauge!("limpet_job_stuck").set(if round.stuck.is_some() { 1.0 } else { 0.0 });
            last_stuck = round.stuck.clone();
        }
        if round.reason != last_reason {
            tracing::info!(reason = %round.reason, "controller");
            last_reason = round.reason;
        }
        // A round of several decisions (a mass event's failures and the epoch answering them)
        // is one entry: committed once, however many nodes it names.
        let commands = match round.commands.len() {
            0 | 1 => round.commands,
            _ => vec![Command::Round { commands: round.commands }],
        };
        for cmd in commands {
            match handle.propose_leading(cmd.clone(), term, Some(Duration::from_secs(2))).await {
                Ok(_) => {}
                // Leadership moved on mid-round: the new leader decides from the whole log.
                Err(limpet_consensus::ConsensusError::Deposed { .. }) => {
                    tracing::info!(term, "leadership passed on; this round's remaining proposals dropped");
                    break;
                }
                Err(e) => {
                    tracing::warn!(%e, ?cmd, "proposal failed");
                    break;
                }
            }
        }
    }
}

/// The reports held, decoded (one that does not decode is left out: its sender's fault).
fn decode_reports(held: Vec<limpet_consensus::NodeReport>) -> BTreeMap<NodeId, (u64, AgentReport)> {
    held.into_iter()
        .filter_map(|r| {
            let rep = AgentReport::decode(&r.report, r.node).ok()?;
            Some((r.node, (r.age.as_millis() as u64, rep)))
        })
        .collect()
}

/// Of `suspects` (peers a rank's collective broke on), those whose control port refuses a
/// connection now (nothing listens there, so the process is gone), and those whose port
/// accepts (the process lives, stalled or not). Each is asked at once; one that does not
/// answer within the probe's time (a host that is down, a network that drops) is in
/// neither.
async fn probe(
    st: &limpet_consensus::ClusterState,
    suspects: &[NodeId],
) -> (BTreeSet<NodeId>, BTreeSet<NodeId>) {
    let mut probes = tokio::task::JoinSet::new();
    for &id in suspects {
        let Some(m) = st.members.get(&id) else { continue };
        let addr = m.spec.control_addr.clone();
        probes.spawn(async move {
            let probe = tokio::net::TcpStream::connect(addr);
            match tokio::time::timeout(PROBE_TIME, probe).await {
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Some((id, false)),
                Ok(Ok(_)) => Some((id, true)),
                _ => None,
            }
        });
    }
    let (mut refused, mut answered) = (BTreeSet::new(), BTreeSet::new());
    for (id, alive) in probes.join_all().await.into_iter().flatten() {
        if alive {
            answered.insert(id)
        } else {
            refused.insert(id)
        };
    }
    (refused, answered)
}

/// The leader's round: every this often, when nothing urgent comes.
const ROUND_EVERY: Duration = Duration::from_millis(50);
/// A suspect whose port answered is probed again after this long.
const REPROBE_ANSWERED: Duration = Duration::from_secs(1);

/// Rounds woken by urgent reports come no closer than this.
const ROUND_AT_MOST_EVERY: Duration = Duration::from_millis(5);

/// How long the leader waits for a suspect's control port to answer.
const PROBE_TIME: Duration = Duration::from_millis(50);

/// The newest durable checkpoint of this agent's job in the configured directory, as the
/// record a new cluster starts from (epoch 0: it predates every epoch of this cluster).
async fn find_resume_point(
    cfg: &ControlConfig,
    spec: &dyn LeadJob,
) -> Result<Option<limpet_consensus::state::CheckpointRecord>, AgentError> {
    let Some(settings) = cfg.checkpoint.as_ref().filter(|c| c.resume != Resume::Never) else {
        return Ok(None);
    };
    let dir = settings.dir().to_path_buf();
    let required = settings.resume == Resume::Required;
    if required {
        // A shared mount that is not there yet (a missing directory, or the empty mount point
        // it is mounted on) must not read as "no checkpoint".
        crate::checkpoint::trusted_dir(&dir).map_err(|source| {
            AgentError::from(Fatal::Resume {
                during: "the checkpoint directory ([checkpoint].resume = \"required\" waits)",
                source,
            })
        })?;
    }
    let job = spec.spec()?;
    let blocks = spec.blocks();
    if let Some(r) = settings.remote() {
        // Bring the newest copies home; the search below checks them like local files.
        let remote = crate::remote::Remote::connect(&r).await;
        let fingerprint = limpet_snapshot::job_fingerprint(&job);
        match remote.fetch_newest(&dir, blocks, &fingerprint, settings.keep.max(1)).await {
            Ok(steps) if !steps.is_empty() => tracing::info!(?steps, "checkpoints fetched from S3"),
            Ok(_) => {}
            Err(source) if required => {
                return Err(AgentError::from(Fatal::Resume {
                    during: "could not fetch checkpoints from S3",
                    source,
                }))
            }
            Err(e) => {
                tracing::warn!(%e, "could not fetch checkpoints from S3; searching the local directory only")
            }
        }
    }
    let search = dir.clone();
    let (found, skipped) =
        tokio::task::spawn_blocking(move || crate::checkpoint::newest(&search, blocks, &job))
            .await
            .map_err(|e| {
                AgentError::from(TaskFailed { task: "resume-search".into(), what: e.to_string() })
            })??;
    for why in &skipped {
        tracing::warn!(why, "not resuming from this checkpoint");
    }
    Ok(found.map(|(listed, image)| {
        let location = crate::checkpoint::step_dir(&dir, listed.step);
        tracing::info!(step = listed.step, location = %location.display(), "a new cluster: resuming from the newest checkpoint");
        limpet_consensus::state::CheckpointRecord {
            step: listed.step,
            epoch: 0,
            content_hash: image.content_hash().to_string(),
            location: location.display().to_string(),
            node: cfg.id,
        }
    }))
}

/// The job document's key for a reproducible job's class of device.
#[cfg(any(test, feature = "trainer"))]
pub(crate) const DEVICE_CLASS: &str = "device_class";

/// Why this node may not train the job the log holds, when the job is reproducible and was
/// set on another class of device than `mine`: its bits are that class's (other kernels
/// round otherwise), so a member of another class would diverge, silently, from the rest.
#[cfg(any(test, feature = "trainer"))]
pub(crate) fn device_class_refusal(logged: &serde_json::Value, mine: &str) -> Option<String> {
    let theirs = logged.get(DEVICE_CLASS)?.as_str()?;
    (theirs != mine).then(|| {
        format!(
            "this reproducible job trains on {theirs}, and this host on {mine}: its bits differ between classes of device, so this host cannot join it (run it on hosts of one class, or without reproducible)"
        )
    })
}

/// The trainer's job: its spec as the log records it; for a pipelined job, the pipeline
/// settings with this node's profile of the model's blocks; for a reproducible one, the class
/// of device this node trains on (its bits are that class's: `device_class_refusal`).
#[cfg(feature = "trainer")]
impl LeadJob for super::AgentConfig {
    fn spec(&self) -> Result<serde_json::Value, AgentError> {
        serde_json::to_value(&self.job)
            .map_err(|source| AgentError::from(Fatal::Encode { what: "the job spec", source }))
    }

    fn blocks(&self) -> usize {
        self.job.model.num_blocks()
    }

    fn batch(&self) -> (u64, u64) {
        (self.job.global_batch as u64, self.job.micro_batch as u64)
    }

    fn document(&self) -> Pin<Box<dyn Future<Output = Result<serde_json::Value, AgentError>> + Send + '_>> {
        Box::pin(async move {
            let mut doc = self.spec()?;
            if let Some(p) = &self.pipeline {
                let (job, path, device) = (self.job.clone(), self.data_path.clone(), self.training_device());
                let profile = tokio::task::spawn_blocking(move || {
                    let data = limpet_trainer::data::Dataset::load(&job.data, path.as_deref())?;
                    crate::stage::profile_model(&job, &data, 5, device)
                })
                .await
                .map_err(|e| {
                    AgentError::from(TaskFailed { task: "profile".into(), what: e.to_string() })
                })??;
                let pj = crate::planner::PipelineJob {
                    profile,
                    link: p.link(),
                    depth: p.depth(),
                    cuts: p.cuts.clone(),
                    mem_bytes: p.memory.0,
                };
                doc["pipeline"] = serde_json::to_value(pj).map_err(|source| {
                    AgentError::from(Fatal::Encode { what: "the pipeline settings", source })
                })?;
            }
            if self.job.reproducible {
                doc[DEVICE_CLASS] = limpet_trainer::device::device_class(self.training_device()).into();
            }
            Ok(doc)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::device_class_refusal;

    /// A reproducible job set on one class of device refuses a host of another, naming
    /// both; a job without a class (not reproducible, or set before classes were recorded)
    /// refuses nobody.
    #[test]
    fn a_reproducible_job_refuses_a_host_of_another_class_of_device() {
        let logged = serde_json::json!({"reproducible": true, "device_class": "cuda/NVIDIA H100 80GB HBM3"});
        let why = device_class_refusal(&logged, "cpu/x86_64+avx2").unwrap();
        assert!(
            why.contains("trains on cuda/NVIDIA H100 80GB HBM3, and this host on cpu/x86_64+avx2"),
            "{why}"
        );
        assert_eq!(device_class_refusal(&logged, "cuda/NVIDIA H100 80GB HBM3"), None);
        assert_eq!(device_class_refusal(&serde_json::json!({"reproducible": true}), "cpu/x86_64"), None);
    }
}

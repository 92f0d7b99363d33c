//! `limpet-lab chaos --ec2 CLUSTER`: a preemption trace segment replayed against a real
//! fleet on EC2, compressed in time. The segment's hosts live at its start are mapped onto
//! the cluster's running instances, oldest first; a removal is a spot interruption through
//! AWS Fault Injection Service (the same two-minute notice through the metadata service a
//! real revocation gives, then the interruption; FIS's notice is 2 to 15 minutes, so it is
//! not compressed), or, for every k-th removal, `TerminateInstances` at once (no notice); an
//! addition is left to the leader's `[capacity]` reconciler, which replaces what the cluster
//! lost. What happened to training is `limpet status` on the fleet; this prints and writes
//! (`chaos.json`) what was fired, when, and EC2's and FIS's answers.

use limpet_daemon::simulate::trace::Trace;
use limpet_daemon::UsageError;
use limpet_deploy::fis::Fis;
use limpet_deploy::{Fleet, FleetConfig};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Where the fleet is and how to revoke its hosts (from `limpet-lab chaos`'s flags).
#[derive(Clone, Debug)]
pub struct Ec2Chaos {
    /// The IAM role FIS assumes.
    pub fis_role: Option<String>,
    /// AWS region (default: the SDK's).
    pub region: Option<String>,
    /// Another EC2 and FIS endpoint.
    pub endpoint_url: Option<String>,
    /// The notice a revoked host gets, seconds (clamped to FIS's 2 to 15 minutes).
    pub notice_s: f64,
    /// Every k-th removal is a termination without notice (0: none).
    pub kill_every: u32,
}

/// One thing fired at the fleet.
#[derive(Clone, Debug, Serialize)]
pub struct Fired {
    /// Seconds into the replay.
    pub at_s: f64,
    /// The trace's host.
    pub host: String,
    /// Its instance.
    pub instance: String,
    /// `interrupt` (FIS, with notice), `terminate` (no notice) or `add` (left to `[capacity]`).
    pub action: String,
    /// FIS's experiment id, or EC2's new state.
    pub answer: String,
}

/// What the replay fired.
#[derive(Debug, Serialize)]
pub struct Ec2ChaosReport {
    /// The cluster.
    pub cluster: String,
    /// Trace host -> instance, for the hosts live at the segment's start.
    pub mapped: BTreeMap<String, String>,
    /// The notice FIS gives, seconds.
    pub notice_s: u64,
    /// In order.
    pub fired: Vec<Fired>,
}

/// Replays `seg` (compressed seconds; `founders` live at its start) against `cluster`'s
/// instances.
pub fn replay(
    a: &Ec2Chaos,
    cluster: &str,
    founders: &[String],
    seg: &Trace,
) -> limpet_daemon::Result<Ec2ChaosReport> {
    let role = a
        .fis_role
        .clone()
        .ok_or_else(|| UsageError("--ec2 needs --fis-role ARN (an IAM role FIS assumes)".into()))?;
    let cfg = FleetConfig { region: a.region.clone(), endpoint: a.endpoint_url.clone(), credentials: None };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let fleet = rt.block_on(Fleet::connect(cluster, &cfg))?;
    let fis = rt.block_on(Fis::connect(&cfg))?;
    let (members, _) = rt.block_on(fleet.list())?;
    let running: Vec<_> = members.into_iter().filter(|m| m.state == "running").collect();
    if running.len() < founders.len() {
        return Err(UsageError(format!(
            "the segment starts with {} hosts; cluster {cluster} has {} running instances",
            founders.len(),
            running.len()
        ))
        .into());
    }
    let mapped: BTreeMap<String, String> =
        founders.iter().zip(&running).map(|(h, m)| (h.clone(), m.id.clone())).collect();
    let mut live = mapped.clone();
    let notice = Duration::from_secs_f64(a.notice_s.max(0.0));
    let notice_s =
        notice.as_secs().clamp(limpet_deploy::fis::NOTICE_RANGE_S.0, limpet_deploy::fis::NOTICE_RANGE_S.1);
    let start = Instant::now();
    let mut fired = Vec::new();
    let mut removals = 0u32;
    for e in seg.events.iter().filter(|e| e.at_ms > 0) {
        let at = Duration::from_millis(e.at_ms);
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let at_s = start.elapsed().as_secs_f64();
        let host = e.node.clone();
        if e.add {
            let f = Fired {
                at_s,
                host,
                instance: String::new(),
                action: "add".into(),
                answer: "left to [capacity]".into(),
            };
            eprintln!("{:>8.1}s  add {} (the leader's [capacity] replaces what was lost)", f.at_s, f.host);
            fired.push(f);
            continue;
        }
        let Some(instance) = live.remove(&host) else {
            eprintln!("{at_s:>8.1}s  remove {host}: no instance of the cluster stands for it (added during the replay)");
            continue;
        };
        removals += 1;
        let kill = a.kill_every > 0 && removals % a.kill_every == 0;
        let f = if kill {
            let done = rt.block_on(fleet.down(std::slice::from_ref(&instance)))?;
            let state = done.first().map_or_else(String::new, |d| d.2.clone());
            Fired { at_s, host, instance, action: "terminate".into(), answer: state }
        } else {
            let arns = rt.block_on(fleet.instance_arns(std::slice::from_ref(&instance)))?;
            let token = format!("limpet-chaos-{}-{}", instance, e.at_ms);
            let started =
                rt.block_on(fis.interrupt(cluster, &arns, Duration::from_secs(notice_s), &role, &token))?;
            Fired { at_s, host, instance, action: "interrupt".into(), answer: started.experiment }
        };
        eprintln!("{:>8.1}s  {} {} ({}): {}", f.at_s, f.action, f.host, f.instance, f.answer);
        fired.push(f);
    }
    Ok(Ec2ChaosReport { cluster: cluster.to_string(), mapped, notice_s, fired })
}

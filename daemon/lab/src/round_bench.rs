//! `limpet-lab bench round`: what one of the leader's controller rounds costs against the
//! fleet size, in one process with no network: a real `ClusterState` of `N` members in
//! their first epoch, every one reporting in time, and the controller asked again and
//! again with nothing changed, as the leader asks it every 50 ms. A pipelined job is timed
//! with its layout kept between rounds (as the leader keeps it) and worked out afresh each
//! round (as before), in the same run; a data-parallel job beside it has no layout to keep.

use clap::Args;
use limpet_agent::controller::{decide, ControllerConfig, LayoutMemo, NodeProgress, View};
use limpet_agent::planner::{BlockCost, Link, ModelProfile, PipelineJob};
use limpet_agent::policy::{BaseBatch, BatchPolicy};
use limpet_consensus::state::{ClusterState, Command, Hardware, MemberSpec, NodeId};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

/// `limpet-lab bench round`.
#[derive(Debug, Args)]
pub struct BenchRoundArgs {
    /// Fleet sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    pub hosts: Vec<u64>,
    /// Timed rounds of each kind at each size.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// One JSON object per fleet size, one a line, instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One fleet size's figures: the median round, milliseconds.
#[derive(Debug, Serialize)]
pub struct RoundRow {
    /// Members, all in the epoch.
    pub hosts: u64,
    /// A data-parallel job's steady round.
    pub data_parallel_ms: f64,
    /// A pipelined job's steady round, its layout kept between rounds.
    pub pipelined_kept_ms: f64,
    /// The same round with the layout worked out afresh (the planner's search and the
    /// hosts' placement every round).
    pub pipelined_afresh_ms: f64,
    /// The epoch's layout, data x pipeline.
    pub layout: String,
}

/// A fleet of `n` hosts in the first epoch of a job (pipelined when `pipeline`), steady.
struct Fleet {
    state: ClusterState,
    progress: BTreeMap<NodeId, NodeProgress>,
    empty_f: BTreeMap<NodeId, f64>,
    empty_n: BTreeMap<NodeId, limpet_agent::report::PendingNotice>,
    empty_u: BTreeMap<NodeId, u64>,
}

fn config(n: u64) -> ControllerConfig {
    ControllerConfig {
        min_nodes: 2,
        heartbeat_timeout_ms: 3000,
        lead_steps: 2,
        notice_margin_ms: 1000,
        policy: BatchPolicy::FixedGlobal,
        base: BaseBatch { global_batch: 16 * n, micro_batch: 16, world: n },
        straggler_ratio: 1.5,
        straggler_steps: 10,
    }
}

impl Fleet {
    fn new(n: u64, pipeline: bool) -> limpet_daemon::Result<Fleet> {
        let members: Vec<MemberSpec> = (1..=n)
            .map(|id| MemberSpec {
                id,
                name: format!("host-{id}"),
                control_addr: format!("10.0.{}.{}:7000", id / 250, id % 250),
                data_addr: format!("10.0.{}.{}:7001", id / 250, id % 250),
                hardware: Hardware { zone: format!("zone-{}", id % 3), ..Hardware::default() },
            })
            .collect();
        let mut state = ClusterState::bootstrap("bench", &members);
        // Every fourth host measured a fifth slower: the planner places by speed.
        for id in (4..=n).step_by(4) {
            state
                .apply(&Command::RecordSpeed { id, speed_milli: 800 })
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let mut job = serde_json::json!({"model": "mlp"});
        if pipeline {
            // Eight blocks of 8 MB of state on hosts of 20 MB: at most two blocks a host.
            let block = BlockCost {
                fwd_ms: 1.0,
                bwd_ms: 2.0,
                fixed_fwd_ms: 0.0,
                fixed_bwd_ms: 0.0,
                apply_ms: 0.1,
                out_bytes: 4096,
                saved_bytes: 4096,
                param_bytes: 2 << 20,
                optim_bytes: 4 << 20,
            };
            let p = PipelineJob {
                profile: ModelProfile {
                    model: "bench".into(),
                    micro_batch: 16,
                    blocks: vec![block; 8],
                    overhead_ms: 0.0,
                },
                link: Link { bytes_per_s: 1e9, latency_ms: 0.05 },
                depth: None,
                cuts: None,
                mem_bytes: 20 << 20,
            };
            job["pipeline"] = serde_json::to_value(p)?;
        }
        state.apply(&Command::SetJob { job }).map_err(|e| anyhow::anyhow!("{e}"))?;
        let progress = (1..=n).map(|i| (i, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 })).collect();
        let mut f = Fleet {
            state,
            progress,
            empty_f: BTreeMap::new(),
            empty_n: BTreeMap::new(),
            empty_u: BTreeMap::new(),
        };
        // The first epoch, planned and started.
        let d = decide(&f.view(None), &config(n));
        for c in &d.commands {
            f.state.apply(c).map_err(|e| anyhow::anyhow!("{c:?}: {e}"))?;
        }
        let e = f.state.scheduled.clone().ok_or_else(|| anyhow::anyhow!("no first epoch: {}", d.reason))?;
        f.state.apply(&Command::ActivateEpoch { id: e.id }).map_err(|e| anyhow::anyhow!("{e}"))?;
        for p in f.progress.values_mut() {
            p.applied_step = e.start_step + 5;
        }
        Ok(f)
    }

    fn view<'a>(&'a self, layouts: Option<&'a LayoutMemo>) -> View<'a> {
        View {
            state: &self.state,
            now_ms: 1_000_000,
            progress: &self.progress,
            step_time_ms: 100.0,
            grad_stats: None,
            rebuild: false,
            ms_per_sample: &self.empty_f,
            notices: &self.empty_n,
            ready_since: &self.empty_u,
            layouts,
        }
    }

    /// The median of `rounds` steady rounds, ms; each must decide nothing.
    fn time(&self, n: u64, rounds: usize, layouts: Option<&LayoutMemo>) -> limpet_daemon::Result<f64> {
        let mut ms = Vec::with_capacity(rounds);
        for _ in 0..rounds + 1 {
            let t = Instant::now();
            let d = decide(&self.view(layouts), &config(n));
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            if !d.commands.is_empty() {
                limpet_daemon::fail!("a steady round of {n} hosts decided {:?} ({})", d.commands, d.reason);
            }
        }
        // The first round with a fresh memo works the layout out: not a steady one.
        Ok(crate::stats::percentiles(&ms[1..]).p50)
    }
}

/// Runs the benchmark.
pub fn run(a: BenchRoundArgs) -> limpet_daemon::Result<()> {
    let mut rows = Vec::new();
    for &n in &a.hosts {
        let dp = Fleet::new(n, false)?;
        let pp = Fleet::new(n, true)?;
        let memo = LayoutMemo::default();
        let e = pp.state.current.as_ref().expect("started");
        let row = RoundRow {
            hosts: n,
            data_parallel_ms: dp.time(n, a.rounds, None)?,
            pipelined_kept_ms: pp.time(n, a.rounds, Some(&memo))?,
            pipelined_afresh_ms: pp.time(n, a.rounds, None)?,
            layout: format!("{}x{}", e.layout.data, e.layout.pipeline),
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            eprintln!("{n} hosts done");
        }
        rows.push(row);
    }
    if !a.json {
        println!("| hosts | layout | data-parallel round (ms) | pipelined, layout kept (ms) | pipelined, worked out afresh (ms) |");
        println!("|---:|---:|---:|---:|---:|");
        for r in &rows {
            println!(
                "| {} | {} | {:.3} | {:.3} | {:.3} |",
                r.hosts, r.layout, r.data_parallel_ms, r.pipelined_kept_ms, r.pipelined_afresh_ms
            );
        }
    }
    Ok(())
}

//! The reconfiguration controller, called directly: the decisions it takes for notices, joins,
//! failures and drains, with their reasons; and, over random event sequences applied to a
//! real `ClusterState`, that epochs only grow, every epoch has the minimum of nodes, and no
//! epoch includes a node that is leaving or past its deadline.

use limpet_consensus::state::{
    ClusterState, Command, Hardware, MemberSpec, MemberStatus, NodeId, MAX_PIPELINE_LOCAL_RANKS,
};
use limpet_decide::controller::{decide, ControllerConfig, LayoutMemo, NodeProgress, View};
use limpet_decide::planner::{BlockCost, Link, ModelProfile, PipelineJob, StepBatch};
use limpet_decide::policy::{BaseBatch, BatchPolicy};
use limpet_decide::report::PendingNotice;
use proptest::prelude::*;
use std::collections::BTreeMap;

mod common;
use common::spec;

fn config() -> ControllerConfig {
    ControllerConfig {
        min_nodes: 2,
        heartbeat_timeout_ms: 3000,
        lead_steps: 2,
        notice_margin_ms: 1000,
        policy: BatchPolicy::FixedGlobal,
        base: BaseBatch { global_batch: 64, micro_batch: 16, world: 3 },
        straggler_ratio: 1.5,
        straggler_steps: 10,
    }
}

struct Sim {
    state: ClusterState,
    progress: BTreeMap<NodeId, NodeProgress>,
    now: u64,
    /// What the ranks measure of their speed, ms per sample.
    speeds: BTreeMap<NodeId, f64>,
    /// Notices the nodes report, not yet in the log.
    notices: BTreeMap<NodeId, PendingNotice>,
    /// When the leader first heard each node outside the epoch ready.
    ready_since: BTreeMap<NodeId, u64>,
    /// A pipelined job's layout, kept between rounds as the leader keeps it.
    layouts: LayoutMemo,
}

impl Sim {
    fn new(n: u64) -> Sim {
        let members: Vec<MemberSpec> = (1..=n).map(spec).collect();
        let mut state = ClusterState::bootstrap("c", &members);
        state.apply(&Command::SetJob { job: serde_json::json!({"model": "mlp"}) }).unwrap();
        let progress = (1..=n).map(|i| (i, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 })).collect();
        Sim {
            state,
            progress,
            now: 1_000_000,
            speeds: BTreeMap::new(),
            notices: BTreeMap::new(),
            ready_since: BTreeMap::new(),
            layouts: LayoutMemo::default(),
        }
    }

    /// `n` nodes in their first epoch, `steps` steps in.
    fn training(n: u64, steps: u64) -> Sim {
        let mut sim = Sim::new(n);
        sim.control();
        sim.start_scheduled();
        sim.train(steps);
        sim
    }

    /// What the controller sees now, with steps of `step_time_ms`.
    fn view(&self, step_time_ms: f64) -> View<'_> {
        View {
            state: &self.state,
            now_ms: self.now,
            progress: &self.progress,
            step_time_ms,
            grad_stats: None,
            rebuild: false,
            ms_per_sample: &self.speeds,
            notices: &self.notices,
            ready_since: &self.ready_since,
            layouts: Some(&self.layouts),
        }
    }

    /// Runs the controller and applies what it proposes; every command must be accepted.
    fn control(&mut self) -> String {
        let view = self.view(100.0);
        let d = decide(&view, &config());
        for c in &d.commands {
            if let Err(e) = self.state.apply(c) {
                panic!("controller proposed {c:?}, refused: {e}");
            }
        }
        d.reason
    }

    /// Every rank of the scheduled epoch reaches its start: it becomes current.
    fn start_scheduled(&mut self) {
        if let Some(e) = self.state.scheduled.clone() {
            for r in &e.ranks {
                self.progress.insert(*r, NodeProgress { applied_step: e.start_step, heartbeat_age_ms: 0 });
            }
            self.state.apply(&Command::ActivateEpoch { id: e.id }).unwrap();
        }
    }

    fn train(&mut self, steps: u64) {
        if let Some(e) = &self.state.current {
            for r in &e.ranks {
                if let Some(p) = self.progress.get_mut(r) {
                    if p.heartbeat_age_ms == 0 {
                        p.applied_step += steps;
                    }
                }
            }
        }
        self.now += steps * 100;
    }
}

#[test]
fn the_first_epoch_takes_every_healthy_node() {
    let mut sim = Sim::new(3);
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.id, e.start_step, e.ranks.clone()), (1, 0, vec![1, 2, 3]));
    assert!(why.contains("first epoch"), "{why}");
    sim.start_scheduled();
    assert_eq!(sim.control(), "steady");
}

#[test]
fn a_notice_schedules_an_epoch_without_the_node_before_its_deadline() {
    let mut sim = Sim::training(3, 10);
    // The cloud takes node 2 back in 120 s: plenty of time, so the planned lead applies.
    let deadline = sim.now + 120_000;
    sim.state.apply(&Command::Notice { id: 2, deadline_ms: deadline, source: "aws".into() }).unwrap();
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!(e.ranks, vec![1, 3]);
    assert_eq!(e.start_step, 12, "two steps after the furthest rank");
    assert!(why.contains("notice for node 2"), "{why}");
    assert!(e.sources.is_empty(), "survivors keep their state: {:?}", e.sources);
    // With the deadline 1.5 s away and 100 ms steps (1 s margin), node 2 has time for 5 steps only.
    let mut sim2 = Sim::training(3, 10);
    let deadline = sim2.now + 1_500;
    sim2.state.apply(&Command::Notice { id: 2, deadline_ms: deadline, source: "aws".into() }).unwrap();
    let mut cfg_lead = config();
    cfg_lead.lead_steps = 50;
    let view = sim2.view(100.0);
    let d = decide(&view, &cfg_lead);
    let Some(Command::ScheduleEpoch { epoch }) = d.commands.last() else { panic!("{d:?}") };
    assert_eq!(epoch.start_step, 15, "{}", d.reason);
}

#[test]
fn a_failure_restarts_from_the_furthest_survivor_and_laggards_copy_from_it() {
    let mut sim = Sim::training(4, 7);
    // Node 3 dies mid-step; node 1 had applied one step more than node 4.
    sim.progress.get_mut(&3).unwrap().heartbeat_age_ms = 5000;
    sim.progress.get_mut(&1).unwrap().applied_step = 8;
    let why = sim.control();
    assert_eq!(sim.state.members[&3].status, MemberStatus::Failed);
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!(e.ranks, vec![1, 2, 4]);
    assert_eq!(e.start_step, 8, "the highest applied step");
    assert_eq!(e.sources, BTreeMap::from([(2, 1), (4, 1)]));
    assert!(why.contains("failure of node 3 (no heartbeat for 5.0 s)"), "{why}");
}

/// A survivor reporting a step far past the others' (the job's last, say) moves neither a
/// rebuild's start nor a boundary further than one step past the next furthest survivor:
/// one rank's report is one rank's word.
#[test]
fn a_rank_reporting_an_unplanned_step_moves_no_boundary() {
    let mut sim = Sim::training(4, 7);
    sim.progress.get_mut(&3).unwrap().heartbeat_age_ms = 5000;
    sim.progress.get_mut(&1).unwrap().applied_step = 1_000_000;
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.ranks.clone(), e.start_step), (vec![1, 2, 4], 8));
    let mut sim = Sim::training(3, 10);
    sim.progress.get_mut(&1).unwrap().applied_step = 1_000_000;
    let deadline = sim.now + 120_000;
    sim.state.apply(&Command::Notice { id: 2, deadline_ms: deadline, source: "aws".into() }).unwrap();
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!(e.start_step, 13, "two steps past one step after the next furthest rank");
}

/// A drained node, or one under a notice, that goes silent before its last epoch ends (its
/// host shut down a little early) is left out like a failure, but removed, not kept as
/// failed.
#[test]
fn a_drained_node_that_goes_silent_early_is_removed_not_failed() {
    let mut sim = Sim::training(3, 7);
    sim.state.apply(&Command::Drain { id: 3, reason: "operator".into() }).unwrap();
    sim.progress.get_mut(&3).unwrap().heartbeat_age_ms = 5000;
    sim.control();
    assert_eq!(sim.state.members[&3].status, MemberStatus::Draining);
    assert_eq!(sim.state.scheduled.clone().unwrap().ranks, vec![1, 2]);
    sim.start_scheduled();
    sim.control();
    assert_eq!(sim.state.members[&3].status, MemberStatus::Gone);

    // The same for a node under a notice that dies before its deadline, and the cause says
    // why it was left out.
    let mut sim = Sim::training(3, 7);
    let deadline = sim.now + 120_000;
    sim.state.apply(&Command::Notice { id: 2, deadline_ms: deadline, source: "aws".into() }).unwrap();
    sim.progress.get_mut(&2).unwrap().heartbeat_age_ms = 5000;
    let why = sim.control();
    assert_eq!(sim.state.members[&2].status, MemberStatus::Leaving);
    assert!(why.contains("no heartbeat for 5.0 s"), "{why}");
    sim.start_scheduled();
    sim.control();
    assert_eq!(sim.state.members[&2].status, MemberStatus::Gone);
}

#[test]
fn a_hosts_devices_are_counted_as_ranks_and_counted_again_when_they_change() {
    let mut sim = Sim::new(3);
    let set = |sim: &mut Sim, id: NodeId, ranks: u32, gpus: u32| {
        let hardware = Hardware { ranks, gpus, cpus: 2, ..Hardware::default() };
        sim.state.apply(&Command::UpdateHardware { id, hardware }).unwrap();
    };
    set(&mut sim, 1, 4, 4);
    // Node 3 claims 64 ranks with two cores and no GPU: it is counted as two.
    set(&mut sim, 3, 64, 0);
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.local_ranks.clone(), e.total_ranks()), (vec![4, 1, 2], 7));
    sim.start_scheduled();
    assert_eq!(sim.control(), "steady");
    // Node 1 comes back with one GPU: the same ranks, counted again.
    set(&mut sim, 1, 1, 1);
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.ranks.clone(), e.local_ranks.clone()), (vec![1, 2, 3], vec![1, 1, 2]), "{why}");
    sim.start_scheduled();
    assert_eq!(sim.control(), "steady");
}

/// In a pipeline every host trains with as many local ranks as the one with the fewest
/// (each device a replica of its host's stage, linked to the same device of the other
/// stages' hosts), and with no more than the data plane's pipe lanes.
#[test]
fn a_pipelined_epoch_gives_every_host_the_fewest_devices_any_has() {
    let mut sim = pipelined(4, Some(2));
    for (id, ranks) in [(1, 4), (2, 2), (3, 4), (4, 8)] {
        let hardware = Hardware { ranks, gpus: ranks, cpus: 2, ..Hardware::default() };
        sim.state.apply(&Command::UpdateHardware { id, hardware }).unwrap();
    }
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.layout.data, e.layout.pipeline), (2, 2), "{e:?}");
    assert_eq!((e.local_ranks.clone(), e.total_ranks()), (vec![2; 4], 8), "{e:?}");
    sim.start_scheduled();
    sim.train(3);
    assert_eq!(sim.control(), "steady");
    // The host with the fewest comes back with one device: every host is counted again.
    let hardware = Hardware { ranks: 1, gpus: 1, cpus: 2, ..Hardware::default() };
    sim.state.apply(&Command::UpdateHardware { id: 2, hardware }).unwrap();
    let why = sim.control();
    let next = sim.state.scheduled.clone().unwrap();
    assert_eq!((next.ranks.clone(), next.local_ranks.clone()), (e.ranks.clone(), Vec::new()), "{why}");
    sim.start_scheduled();
    sim.train(3);
    assert_eq!(sim.control(), "steady");
    // Hosts of sixteen devices: at most MAX_PIPELINE_LOCAL_RANKS each.
    let mut wide = pipelined(2, Some(2));
    for id in [1, 2] {
        let hardware = Hardware { ranks: 16, gpus: 16, cpus: 2, ..Hardware::default() };
        wide.state.apply(&Command::UpdateHardware { id, hardware }).unwrap();
    }
    wide.control();
    let e = wide.state.scheduled.clone().unwrap();
    assert_eq!(e.local_ranks, vec![MAX_PIPELINE_LOCAL_RANKS; 2], "{e:?}");
}

/// The micro-batch the planner picks for `hosts` hosts of one device each, 1x2, training
/// `batch` samples a step (the job of `pipelined`).
fn planned_micro(hosts: &[NodeId], batch: usize) -> u64 {
    let sim = pipelined(hosts.len() as u64, Some(2));
    let job = limpet_decide::controller::pipeline_job(&sim.state).unwrap();
    let (_, plan) = limpet_decide::planner::arrange(
        &job,
        hosts,
        StepBatch { global: batch, per_replica: None, local: 1 },
        &BTreeMap::new(),
    )
    .unwrap();
    plan.layout.micro_batch as u64
}

/// A pipeline's micro-batch is planned for a device: a host's devices split its share of the
/// batch, so hosts of four devices get the micro-batch hosts of one get for a quarter of the
/// batch (64 samples: 4 a micro-batch for one device, 2 for a device of four; planned as
/// one device a host, each device of four would have run four micro-batches of 4 where
/// eight of 2 are predicted faster).
#[test]
fn a_pipelines_micro_batch_is_planned_for_a_device() {
    let micro = |devices: u32| {
        let mut sim = pipelined(2, Some(2));
        for id in [1, 2] {
            let hardware = Hardware { ranks: devices, gpus: devices, cpus: 2, ..Hardware::default() };
            sim.state.apply(&Command::UpdateHardware { id, hardware }).unwrap();
        }
        sim.control();
        let e = sim.state.scheduled.clone().unwrap();
        assert_eq!(
            (e.layout.data, e.layout.pipeline, e.total_ranks()),
            (1, 2, 2 * devices as usize),
            "{e:?}"
        );
        e.batch.micro_batch
    };
    let (whole, quarter) = (planned_micro(&[1, 2], 64), planned_micro(&[1, 2], 16));
    assert_ne!(whole, quarter, "the test's profile must tell the two apart");
    assert_eq!((micro(1), micro(4)), (whole, quarter));
}

/// Under a policy whose batch grows with the replicas, a pipeline's micro-batch is planned for
/// the replica's share the policy gives (64 over a base world of 3: 22 samples), not for the
/// base global batch shared over the layout's replicas (64 on one replica).
#[test]
fn a_scaling_policys_pipeline_is_planned_for_its_replicas_batch() {
    let sim = pipelined(2, Some(2));
    let cfg = ControllerConfig { policy: BatchPolicy::Linear, ..config() };
    let d = decide(&sim.view(100.0), &cfg);
    let e = d
        .commands
        .iter()
        .find_map(|c| match c {
            Command::ScheduleEpoch { epoch } => Some(epoch.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no epoch: {}", d.reason));
    assert_eq!((e.layout.data, e.layout.pipeline, e.batch.global_batch), (1, 2, 22), "{e:?}");
    let (per_replica, base) = (planned_micro(&[1, 2], 22), planned_micro(&[1, 2], 64));
    assert_ne!(per_replica, base, "the test's profile must tell the two apart");
    assert_eq!(e.batch.micro_batch, per_replica, "{e:?}");
}

/// A spare of one device among hosts of four: the plan is made for one device a host (the
/// fewest any candidate has), but the hosts placed have four each, so the micro-batch is
/// picked again for theirs.
#[test]
fn a_spare_with_fewer_devices_does_not_set_the_placed_hosts_micro_batch() {
    let mut sim = pipelined(3, Some(2));
    for (id, devices) in [(1, 4), (2, 4), (3, 1)] {
        let hardware = Hardware { ranks: devices, gpus: devices, cpus: 2, ..Hardware::default() };
        sim.state.apply(&Command::UpdateHardware { id, hardware }).unwrap();
    }
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.ranks.clone(), e.local_ranks.clone()), (vec![1, 2], vec![4, 4]), "{e:?}");
    assert_eq!(e.batch.micro_batch, planned_micro(&[1, 2], 16), "{e:?}");
}

#[test]
fn a_joining_node_is_added_with_a_live_source() {
    let mut sim = Sim::training(2, 5);
    sim.state.apply(&Command::Join { member: spec(7) }).unwrap();
    sim.progress.insert(7, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!(e.ranks, vec![1, 2, 7]);
    assert_eq!(e.sources.get(&7), Some(&1));
    assert!(why.contains("join of node 7"), "{why}");
}

#[test]
fn an_epoch_planned_after_the_job_s_end_starts_at_its_end() {
    // Two ranks `trained` steps into a 40-step job, then a node joins: the epoch planned.
    let join_after = |trained: u64| {
        let mut sim = Sim::new(2);
        sim.state.job = Some(serde_json::json!({"model": "mlp", "steps": 40}));
        sim.control();
        sim.start_scheduled();
        sim.train(trained);
        sim.state.apply(&Command::Join { member: spec(7) }).unwrap();
        sim.progress.insert(7, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
        sim.control();
        sim.state.scheduled.clone().unwrap()
    };
    // Both ranks are at the end: the epoch starts there, where they stand, not `lead_steps`
    // further on, where they would never go.
    let e = join_after(40);
    assert_eq!((e.ranks.as_slice(), e.start_step), (&[1, 2, 7][..], 40));
    // Before the end the boundary still leads the ranks.
    assert_eq!(join_after(10).start_step, 12);
}

#[test]
fn too_few_nodes_pause_instead_of_failing() {
    let mut sim = Sim::training(2, 3);
    sim.progress.get_mut(&2).unwrap().heartbeat_age_ms = 10_000;
    let why = sim.control();
    assert!(why.starts_with("paused: 1 healthy node(s), at least 2 needed"), "{why}");
    assert!(sim.state.scheduled.is_none());
    assert_eq!(sim.state.members[&2].status, MemberStatus::Failed);
}

#[test]
fn the_leader_host_itself_can_be_revoked() {
    // The controller does not know who leads: the leaving node is handled like any other,
    // and a new leader running the same function on the same state decides the same.
    let mut sim = Sim::training(3, 4);
    sim.state.apply(&Command::Drain { id: 1, reason: "maintenance".into() }).unwrap();
    let first = sim.control();
    assert!(first.contains("drain of node 1"), "{first}");
    assert_eq!(sim.state.scheduled.as_ref().unwrap().ranks, vec![2, 3]);
    sim.start_scheduled();
    sim.control();
    assert_eq!(sim.state.members[&1].status, MemberStatus::Gone, "removed once out of the epoch");
}

/// A pipelined job: four equal blocks that each need 8 MB of weights, gradients and optimizer
/// state, on hosts of 20 MB, so no host holds more than two blocks.
#[test]
fn a_straggler_gets_a_smaller_share_after_the_window_and_equal_shares_return() {
    let mut sim = Sim::training(3, 5);
    // Node 3 takes four times as long per sample.
    sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.4)].into_iter().collect();
    assert_eq!(sim.control(), "steady", "not before straggler_steps of the epoch");
    sim.train(5);
    let why = sim.control();
    assert!(why.contains("node 3 is 4.00x slower"), "{why}");
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.ranks.clone(), e.shares.clone()), (vec![1, 2, 3], vec![28, 28, 8]));
    assert!(e.sources.is_empty(), "the same ranks keep their state: {:?}", e.sources);
    // Its ranks reach its start before the leader activates it: it is not withdrawn.
    sim.train(5);
    sim.control();
    assert_eq!(sim.state.scheduled.as_ref().map(|s| s.id), Some(e.id), "the balance epoch stands");
    sim.start_scheduled();
    sim.train(20);
    assert_eq!(sim.control(), "steady", "measured speeds match the shares: nothing to change");
    // A join keeps sharing by speed (the newcomer counts as the median).
    sim.state.apply(&Command::Join { member: spec(4) }).unwrap();
    sim.progress.insert(4, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!(e.shares.len(), 4);
    assert_eq!(e.shares.iter().sum::<u64>(), 64);
    sim.start_scheduled();
    sim.train(20);
    // Node 3 keeps up again: equal shares.
    sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.11), (4, 0.1)].into_iter().collect();
    let why = sim.control();
    assert!(why.contains("equal shares again"), "{why}");
    assert!(sim.state.scheduled.clone().unwrap().shares.is_empty());
    // Under AdaScale, never.
    let mut sim = Sim::training(3, 20);
    sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.4)].into_iter().collect();
    let view = sim.view(100.0);
    let cfg = ControllerConfig { policy: BatchPolicy::Adascale, ..config() };
    assert_eq!(decide(&view, &cfg).reason, "steady");
}

fn pipelined(n: u64, depth: Option<usize>) -> Sim {
    let mut sim = Sim::new(0);
    let members: Vec<MemberSpec> = (1..=n).map(spec).collect();
    sim.state = ClusterState::bootstrap("c", &members);
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
    let job = PipelineJob {
        profile: ModelProfile {
            model: "test".into(),
            micro_batch: 16,
            blocks: vec![block; 4],
            overhead_ms: 0.0,
        },
        link: Link { bytes_per_s: 1e9, latency_ms: 0.05 },
        depth,
        cuts: None,
        mem_bytes: 20 << 20,
    };
    let doc = serde_json::json!({"model": "mlp", "pipeline": job});
    sim.state.apply(&Command::SetJob { job: doc }).unwrap();
    sim.progress = (1..=n).map(|i| (i, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 })).collect();
    sim
}

/// The planner runs when what a layout depends on changed (a host's measured speed, a
/// candidate gone or come, a new epoch), not every round, and what it reuses is what it
/// would work out afresh.
#[test]
fn a_pipelined_layout_is_worked_out_again_only_when_its_inputs_change() {
    let mut sim = pipelined(4, Some(2));
    sim.control();
    sim.start_scheduled();
    sim.train(5);
    // The epoch started: its first round works the layout out again.
    let before = sim.layouts.runs();
    decide(&sim.view(100.0), &config());
    let runs = sim.layouts.runs();
    assert_eq!(runs, before + 1);
    let afresh = |sim: &Sim| decide(&View { layouts: None, ..sim.view(100.0) }, &config());
    for _ in 0..20 {
        let d = decide(&sim.view(100.0), &config());
        assert_eq!(d, afresh(&sim));
    }
    assert_eq!(sim.layouts.runs(), runs, "steady rounds reuse the layout");
    // The lead in steps follows the measured step time; no layout reads it.
    let led = ControllerConfig { lead_steps: 7, ..config() };
    assert_eq!(decide(&sim.view(30.0), &led), decide(&View { layouts: None, ..sim.view(30.0) }, &led));
    assert_eq!(sim.layouts.runs(), runs, "another lead reuses the layout");
    // A host's devices are what a pipeline's hosts train with: worked out again.
    let hardware = Hardware { ranks: 2, gpus: 2, cpus: 2, ..Hardware::default() };
    sim.state.apply(&Command::UpdateHardware { id: 2, hardware }).unwrap();
    assert_eq!(decide(&sim.view(100.0), &config()), afresh(&sim));
    let runs = runs + 1;
    assert_eq!(sim.layouts.runs(), runs, "another host's devices");
    // A measured speed changes the inputs: worked out again, once.
    sim.state.apply(&Command::RecordSpeed { id: 3, speed_milli: 400 }).unwrap();
    for _ in 0..3 {
        assert_eq!(decide(&sim.view(100.0), &config()), afresh(&sim));
    }
    assert_eq!(sim.layouts.runs(), runs + 1);
    // A host gone quiet leaves the candidates: again.
    sim.progress.get_mut(&4).unwrap().heartbeat_age_ms = 10_000;
    let d = decide(&sim.view(100.0), &config());
    assert_eq!(d, afresh(&sim));
    assert_eq!(sim.layouts.runs(), runs + 2, "{}", d.reason);
}

#[test]
fn a_pipelined_job_is_laid_out_by_the_planner_and_re_planned_when_a_stage_host_leaves() {
    let mut sim = pipelined(4, Some(2));
    sim.control();
    let e = sim.state.scheduled.clone().unwrap();
    assert_eq!((e.layout.data, e.layout.pipeline, e.layout.cuts.clone()), (2, 2, vec![2]), "{e:?}");
    assert_eq!(e.ranks.len(), 4);
    sim.start_scheduled();
    sim.train(10);
    assert_eq!(sim.control(), "steady");
    // The first rank's host gets a notice: three hosts left, so one 2-stage pipeline and
    // a spare. Its stage's other replica takes the stage: its blocks stay live.
    let leaving = e.ranks[0];
    let partner = e.ranks[2];
    sim.state
        .apply(&Command::Notice { id: leaving, deadline_ms: sim.now + 120_000, source: "aws".into() })
        .unwrap();
    let why = sim.control();
    let next = sim.state.scheduled.clone().unwrap();
    assert!(why.contains(&format!("notice for node {leaving}")), "{why}");
    assert_eq!((next.layout.data, next.layout.pipeline, next.ranks.len()), (1, 2, 2), "{next:?}");
    assert!(!next.ranks.contains(&leaving));
    assert_eq!(next.ranks[0], partner, "stage 0 goes to the replica that holds it: {next:?}");
    assert_eq!(next.ranks[1], e.ranks[1], "stage 1 stays where it was: {next:?}");
    sim.start_scheduled();
    sim.train(5);
    assert_eq!(sim.control(), "steady", "the spare does not trigger a re-plan");
    // A stage host dies: the spare takes its place.
    let dead = next.ranks[1];
    sim.progress.get_mut(&dead).unwrap().heartbeat_age_ms = 10_000;
    let why = sim.control();
    let last = sim.state.scheduled.clone().unwrap();
    assert!(why.contains(&format!("failure of node {dead}")), "{why}");
    assert_eq!((last.layout.data, last.layout.pipeline, last.ranks.len()), (1, 2, 2), "{last:?}");
    assert!(!last.ranks.contains(&dead) && !last.ranks.contains(&leaving));
    // Without a forced depth, two hosts that cannot each hold the model still pipeline.
    let mut free = pipelined(2, None);
    free.control();
    let e = free.state.scheduled.clone().unwrap();
    assert_eq!((e.layout.data, e.layout.pipeline), (1, 2), "{e:?}");
    // Two hosts join: the planner predicts a faster step using them, so the join re-plans;
    // the survivors keep the blocks they hold.
    free.start_scheduled();
    free.train(5);
    for id in [5, 6] {
        free.state.apply(&Command::Join { member: spec(id) }).unwrap();
        free.progress.insert(id, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    }
    let why = free.control();
    let grown = free.state.scheduled.clone().unwrap();
    assert!(why.contains("join of node 5") && why.contains("join of node 6"), "{why}");
    assert_eq!(grown.ranks.len(), 4, "{grown:?}");
    let blocks_of = |ep: &limpet_consensus::state::Epoch, id: NodeId| {
        let i = ep.ranks.iter().position(|&r| r == id).unwrap();
        ep.layout.stage_blocks(4).unwrap()[i % ep.layout.pipeline as usize].clone()
    };
    for &old in &e.ranks {
        let (before, after) = (blocks_of(&e, old), blocks_of(&grown, old));
        assert!(
            after.start >= before.start && after.end <= before.end,
            "node {old}: {before:?} -> {after:?}"
        );
    }
    // A forced layout: the user's cuts, as many replicas as the hosts allow.
    let mut forced = pipelined(5, Some(2));
    let mut doc = forced.state.job.clone().unwrap();
    doc["pipeline"]["cuts"] = serde_json::json!([1]);
    doc["pipeline"]["mem_bytes"] = serde_json::json!(64 << 20);
    forced.state = ClusterState::bootstrap("c", &(1..=5).map(spec).collect::<Vec<_>>());
    forced.state.apply(&Command::SetJob { job: doc }).unwrap();
    forced.control();
    let e = forced.state.scheduled.clone().unwrap();
    assert_eq!(
        (e.layout.data, e.layout.pipeline, e.layout.cuts.clone(), e.ranks.len()),
        (2, 2, vec![1], 4),
        "{e:?}"
    );
    // One host cannot hold the model: training pauses and says why.
    let mut alone = pipelined(1, None);
    let mut cfg_one = config();
    cfg_one.min_nodes = 1;
    let view = alone.view(0.0);
    let d = decide(&view, &cfg_one);
    assert!(d.reason.starts_with("paused: no layout for 1 node(s)"), "{}", d.reason);
    alone.now += 1;
}

#[derive(Clone, Debug)]
enum Event {
    Notice(u64, u64),
    Drain(u64),
    Join,
    Kill(u64),
    Train(u64),
    Start,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        1 => (1u64..8, 0u64..60_000).prop_map(|(n, ms)| Event::Notice(n, ms)),
        1 => (1u64..8).prop_map(Event::Drain),
        2 => Just(Event::Join),
        1 => (1u64..8).prop_map(Event::Kill),
        4 => (1u64..20).prop_map(Event::Train),
        3 => Just(Event::Start),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn epochs_grow_keep_the_minimum_and_never_include_a_leaving_node(
        events in proptest::collection::vec(event(), 1..40),
    ) {
        let mut sim = Sim::new(3);
        let mut next_id = 4;
        let (mut last_epoch, mut last_current, mut last_scheduled) = (0, 0, None);
        sim.control();
        for ev in events {
            match ev {
                Event::Notice(n, ms) => {
                    let _ = sim.state.apply(&Command::Notice { id: n, deadline_ms: sim.now + ms, source: "test".into() });
                }
                Event::Drain(n) => {
                    let _ = sim.state.apply(&Command::Drain { id: n, reason: "test".into() });
                }
                Event::Join => {
                    sim.state.apply(&Command::Join { member: spec(next_id) }).unwrap();
                    sim.progress.insert(next_id, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
                    next_id += 1;
                }
                Event::Kill(n) => {
                    if let Some(p) = sim.progress.get_mut(&n) {
                        p.heartbeat_age_ms = 60_000;
                    }
                }
                Event::Train(s) => sim.train(s),
                Event::Start => sim.start_scheduled(),
            }
            sim.control();
            for e in sim.state.current.iter().chain(sim.state.scheduled.iter()) {
                prop_assert!(e.ranks.len() >= config().min_nodes, "epoch {} has {:?}", e.id, e.ranks);
            }
            if let Some(e) = &sim.state.scheduled {
                // A newly scheduled epoch has an id above every id seen before.
                if Some(e.id) != last_scheduled {
                    prop_assert!(e.id > last_epoch, "epoch {} after {}", e.id, last_epoch);
                    last_epoch = e.id;
                    last_scheduled = Some(e.id);
                }
                for r in &e.ranks {
                    let m = &sim.state.members[r];
                    prop_assert!(m.status.is_staying(), "epoch {} includes node {r}, which is {:?}", e.id, m.status);
                    prop_assert!(m.deadline_ms.is_none_or(|d| d > sim.now), "node {r} is past its deadline");
                }
            }
            if let Some(c) = &sim.state.current {
                prop_assert!(c.id >= last_current, "current epoch went from {} to {}", last_current, c.id);
                last_current = c.id;
            }
        }
    }
}

/// A host measured three times slower (`Hardware::speed_milli`) is placed by the planner:
/// its stage gets fewer blocks, or it is left out, instead of every host being the profiled
/// one.
#[test]
fn a_host_measured_slower_holds_fewer_blocks_of_a_pipeline() {
    let mut sim = pipelined(4, Some(2));
    sim.control();
    sim.start_scheduled();
    sim.train(20);
    let before = sim.state.current.clone().unwrap();
    assert_eq!(before.layout.cuts, vec![2], "equal hosts: equal stages");
    assert_eq!(sim.control(), "steady");
    let slow = before.ranks[0];
    sim.state.apply(&Command::RecordSpeed { id: slow, speed_milli: 330 }).unwrap();
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap_or_else(|| panic!("no re-plan: {why}"));
    let stages = e.layout.stage_blocks(4).unwrap();
    let held =
        |id: NodeId| e.ranks.iter().position(|&r| r == id).map_or(0, |i| stages[i % stages.len()].len());
    let others: Vec<usize> = e.ranks.iter().filter(|&&r| r != slow).map(|&r| held(r)).collect();
    assert!(
        others.iter().all(|&b| held(slow) < b),
        "node {slow} holds {} blocks, the others {others:?}: {e:?}",
        held(slow)
    );
    // Measured again at the same speed: nothing more to change.
    sim.start_scheduled();
    sim.train(20);
    assert_eq!(sim.control(), "steady");
    // A measurement that wobbles (0.33 -> 0.40) does not move blocks back and forth: a
    // re-plan must be predicted clearly faster than the layout it replaces.
    sim.state.apply(&Command::RecordSpeed { id: slow, speed_milli: 400 }).unwrap();
    assert_eq!(sim.control(), "steady");
}

/// A busy host's speed wobbling around the straggler ratio (1.53x, then 1.47x, over and
/// over): it gets a smaller share once, and then nothing moves, neither back to equal
/// shares at 1.47x (predicted slower than the shares it has) nor to new shares at 1.53x.
#[test]
fn a_speed_wobbling_around_the_ratio_moves_nothing() {
    let mut sim = Sim::training(5, 20);
    let mut changes = Vec::new();
    for i in 0..40 {
        let slow = if i % 2 == 0 { 0.153 } else { 0.147 };
        sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.1), (5, slow)].into_iter().collect();
        let why = sim.control();
        if sim.state.scheduled.is_some() {
            changes.push(why);
            sim.start_scheduled();
        }
        sim.train(20);
    }
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert!(changes[0].contains("node 5 is 1.53x slower"), "{changes:?}");
}

/// A kill and a spot notice at the same instant, with a join and a slow host pending: the
/// notice its node reports (its `Notice` command still on its way to a leader) goes into
/// the very next epoch together with the failure, at once; the join rides along, and no
/// change of shares goes first.
#[test]
fn a_reported_notice_goes_into_the_very_next_epoch_with_the_failure() {
    let mut sim = Sim::training(4, 20);
    // Node 4 is twice as slow: a change of shares is due.
    sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.2)].into_iter().collect();
    // A newcomer waits to join.
    sim.state.apply(&Command::Join { member: spec(5) }).unwrap();
    sim.progress.insert(5, NodeProgress { applied_step: 0, heartbeat_age_ms: 0 });
    // Node 1 is killed; node 2 reports a notice the log does not have yet (4.4 s away).
    sim.progress.get_mut(&1).unwrap().heartbeat_age_ms = u64::MAX;
    sim.notices.insert(2, PendingNotice { deadline_ms: sim.now + 4_400, source: "gcp".into() });
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap_or_else(|| panic!("nothing scheduled: {why}"));
    assert_eq!(e.ranks, vec![3, 4, 5], "{why}");
    assert!(e.cause.contains("failure of node 1") && e.cause.contains("notice for node 2"), "{}", e.cause);
    assert!(!e.cause.contains("slower"), "{}", e.cause);
    // Alone, a reported notice is planned like a logged one: before its deadline.
    let mut sim = Sim::training(3, 20);
    sim.speeds = [(1, 0.1), (2, 0.1), (3, 0.3)].into_iter().collect();
    sim.notices.insert(2, PendingNotice { deadline_ms: sim.now + 120_000, source: "aws".into() });
    let why = sim.control();
    let e = sim.state.scheduled.clone().unwrap_or_else(|| panic!("nothing scheduled: {why}"));
    assert_eq!(e.ranks, vec![1, 3], "{why}");
    assert!(e.cause.starts_with("notice for node 2 (reported: aws notice"), "{}", e.cause);
}

#[path = "controller/waves.rs"]
mod waves;

//! An agent's life inside a test process: started, trained, stopped (its ports free again);
//! stopped while it waits in an epoch entry for a peer that never comes, within the shutdown
//! limit; a task that panics stops the whole agent with an error instead of silently; and a
//! control port still held elsewhere is a retried failure, an address not here a usage one.
//! Synthetic agents (the control part with a training loop that needs no libtorch) live the
//! same way: three found a cluster and train, a fourth joins and copies the state from a
//! holder, one stops mid-run and the rest train through to the job's last step, every
//! transition recorded as the trainer loop records it.

use limpet_agent::report::{AgentReport, Phase};
use limpet_agent::runtime::synthetic::{SyntheticAgent, SyntheticJob};
use limpet_agent::runtime::tasks::SHUTDOWN_LIMIT;
use limpet_agent::runtime::{Agent, AgentConfig, ControlConfig, Exit, Tasks};
use limpet_consensus::state::{Command, Hardware, MemberSpec};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::{JobSpec, ModelKind};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn free_addr() -> std::net::SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

fn spec(id: u64, control: &str, data: &str) -> MemberSpec {
    MemberSpec {
        id,
        name: format!("n{id}"),
        control_addr: control.into(),
        data_addr: data.into(),
        hardware: Hardware::default(),
    }
}

/// A one-founder cluster's agent training a small MLP for many steps.
fn config(dir: &std::path::Path) -> AgentConfig {
    static THREADS: std::sync::Once = std::sync::Once::new();
    THREADS.call_once(|| limpet_trainer::set_threads(1));
    let data = DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 5 };
    let mut job = JobSpec::defaults_for(ModelKind::Mlp, &Dataset::load(&data, None).unwrap()).unwrap();
    job.steps = 1_000_000;
    let mut cfg =
        AgentConfig::new(1, "n1", "lifecycle", dir.to_path_buf(), b"a lifecycle test secret".to_vec(), job);
    cfg.control = free_addr();
    cfg.data = free_addr();
    cfg.bootstrap = Some(vec![spec(1, &cfg.control.to_string(), &cfg.data.to_string())]);
    cfg
}

fn report_of(agent: &Agent, node: u64) -> Option<AgentReport> {
    let r = agent.handle().reports().all().into_iter().find(|r| r.node == node)?;
    AgentReport::decode(&r.report, node).ok()
}

async fn until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let by = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < by, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_starts_trains_and_stops_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let agent = Agent::start(cfg).await.unwrap();
    let (control, data) = (agent.control_addr(), agent.data_addr());
    until("it trains", Duration::from_secs(60), || report_of(&agent, 1).is_some_and(|r| r.applied_step >= 5))
        .await;
    let stop = agent.shutdown_token();
    stop.cancel();
    let t = Instant::now();
    assert_eq!(agent.wait().await.unwrap(), Exit::Stopped);
    assert!(t.elapsed() < SHUTDOWN_LIMIT, "stopping took {:?}", t.elapsed());
    // Nothing of it is left listening.
    TcpListener::bind(control).expect("the control port is free again");
    TcpListener::bind(data).expect("the data port is free again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_waiting_in_an_epoch_entry_stops_within_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    // The next epoch starts a step ahead: each step until then also tries (for up to 200 ms)
    // to connect the ghost's ring early.
    cfg.timing.lead_ms = 1;
    let agent = Agent::start(cfg).await.unwrap();
    until("it trains", Duration::from_secs(60), || report_of(&agent, 1).is_some_and(|r| r.applied_step >= 5))
        .await;
    // A member that reports as healthy but whose data port nobody serves: the next epoch
    // includes it, and this agent waits at the entry for a peer that never connects.
    let ghost = spec(99, &free_addr().to_string(), &free_addr().to_string());
    agent.handle().propose(Command::Join { member: ghost }, Some(Duration::from_secs(5))).await.unwrap();
    let handle = agent.handle();
    let beat = tokio::spawn(async move {
        loop {
            let r = AgentReport::new(99, 0, Phase::Waiting);
            handle.reports().put(99, r.encode());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    until("it waits in the entry", Duration::from_secs(60), || {
        report_of(&agent, 1).is_some_and(|r| r.phase == Phase::Entering)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(report_of(&agent, 1).unwrap().phase, Phase::Entering, "the entry waits for the ghost");
    agent.shutdown_token().cancel();
    let t = Instant::now();
    assert_eq!(agent.wait().await.unwrap(), Exit::Stopped);
    assert!(t.elapsed() < SHUTDOWN_LIMIT, "stopping from an entry took {:?}", t.elapsed());
    beat.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_panics_stops_the_agent_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = Tasks::new(CancellationToken::new());
    let agent = Agent::start_with(config(dir.path()), tasks.clone()).await.unwrap();
    until("it trains", Duration::from_secs(60), || report_of(&agent, 1).is_some_and(|r| r.applied_step >= 2))
        .await;
    tasks.spawn("buggy", async { panic!("a bug in a task") });
    let t = Instant::now();
    let e = agent.wait().await.expect_err("a panicking task is fatal");
    assert!(e.to_string().contains("task buggy failed: panicked: a bug in a task"), "{e}");
    assert!(t.elapsed() < SHUTDOWN_LIMIT + Duration::from_secs(1), "took {:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracked_threads_count_in_the_shutdown_and_their_panics_are_fatal() {
    let tasks = Tasks::new(CancellationToken::new());
    let stop = tasks.token();
    tasks
        .spawn_thread("slow", move || {
            while !stop.is_cancelled() {
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .unwrap();
    tasks.spawn_thread("bad", || panic!("thread bug")).unwrap();
    until("the panic cancels the root", Duration::from_secs(5), || tasks.token().is_cancelled()).await;
    tasks.shutdown(tokio::time::Instant::now() + Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        tasks.fatal().map(|f| f.to_string()).as_deref(),
        Some("task bad failed: panicked: thread bug")
    );
    // A thread that ignores the token is reported at the limit, not waited for forever.
    let stuck = Tasks::new(CancellationToken::new());
    stuck.spawn_thread("stuck", || std::thread::sleep(Duration::from_secs(3))).unwrap();
    let e = stuck.shutdown(tokio::time::Instant::now() + Duration::from_millis(200)).await.unwrap_err();
    assert_eq!(e.0, 1, "{e}");
}

/// A control port another process still holds (the node's previous run ending) fails as a
/// retried error, which systemd restarts; an address this host does not have is the
/// configuration's (exit 64, not restarted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_port_is_retried_and_an_address_not_here_is_the_configuration() {
    use limpet_consensus::{ConsensusError, Node, NodeConfig};
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tasks = Tasks::new(CancellationToken::new());
    let cfg = NodeConfig::new(1, "c", "n1", held.local_addr().unwrap(), dir.path().join("a"));
    let e = Node::start(cfg, &tasks).await.err().expect("the port is held");
    assert!(matches!(e, ConsensusError::Transport(_)) && e.is_retryable(), "{e}");
    // TEST-NET-1 (RFC 5737): no host has it.
    let cfg = NodeConfig::new(1, "c", "n1", "192.0.2.1:7400".parse().unwrap(), dir.path().join("b"));
    let e = Node::start(cfg, &tasks).await.err().expect("the address is not this host's");
    assert!(matches!(e, ConsensusError::Config(_)), "{e}");
}

/// Steps of the synthetic agents' job.
const SYNTHETIC_STEPS: u64 = 150;

fn synthetic_job() -> SyntheticJob {
    SyntheticJob {
        steps: SYNTHETIC_STEPS,
        step_ms: 10,
        state_bytes: 256 << 10,
        grad_bytes: 4096,
        seed: 7,
        global_batch: 32,
    }
}

fn control_config(id: u64, dir: &Path) -> ControlConfig {
    let mut cfg = ControlConfig::new(
        id,
        &format!("n{id}"),
        "synthetic",
        dir.join(format!("n{id}")),
        b"a synthetic test secret".to_vec(),
    );
    cfg.control = free_addr();
    cfg.data = free_addr();
    cfg
}

async fn start_synthetic(cfg: ControlConfig, dir: &Path) -> SyntheticAgent {
    let log = dir.join(format!("{}.steps.jsonl", cfg.name));
    SyntheticAgent::start(cfg, synthetic_job(), Some(log), Tasks::new(CancellationToken::new()))
        .await
        .unwrap()
}

fn causes(r: &AgentReport) -> Vec<String> {
    r.transitions.iter().map(|t| t.cause.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_agents_form_take_a_join_and_a_stop_and_train_to_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let cfgs: Vec<ControlConfig> = (1..=3).map(|id| control_config(id, dir.path())).collect();
    let founders: Vec<MemberSpec> = cfgs
        .iter()
        .map(|c| MemberSpec {
            id: c.id,
            name: c.name.clone(),
            control_addr: c.control.to_string(),
            data_addr: c.data.to_string(),
            hardware: Hardware::default(),
        })
        .collect();
    let mut agents = Vec::new();
    for mut c in cfgs {
        c.bootstrap = Some(founders.clone());
        agents.push(start_synthetic(c, dir.path()).await);
    }
    until("the founders train", Duration::from_secs(60), || {
        agents.iter().all(|a| a.report().applied_step >= 20)
    })
    .await;
    let mut joiner = control_config(4, dir.path());
    joiner.seeds = founders.iter().map(|f| f.control_addr.clone()).collect();
    agents.push(start_synthetic(joiner, dir.path()).await);
    until("the newcomer trains", Duration::from_secs(60), || {
        agents[3].report().phase == Phase::Training && agents[3].report().applied_step > 0
    })
    .await;
    let entered = agents[3].report().transitions[0].clone();
    assert!(entered.cause.contains("join of node 4"), "{entered:?}");
    // It entered where the founders stood, not at step 0: its state came from them.
    assert!(entered.step >= 20, "{entered:?}");
    // It copied the state (a quarter of a MiB and its manifest) from a holder, checked.
    assert!(entered.fetched_bytes >= 256 << 10, "{entered:?}");
    // A founder stops mid-run; the others go on without it.
    let stopped = agents.remove(2);
    stopped.shutdown_token().cancel();
    assert_eq!(stopped.wait().await.unwrap(), Exit::Stopped);
    until("the job ends", Duration::from_secs(90), || {
        agents
            .iter()
            .all(|a| a.report().phase == Phase::Finished && a.report().applied_step == SYNTHETIC_STEPS)
    })
    .await;
    let seen = causes(&agents[0].report());
    assert!(seen.iter().any(|c| c.contains("failure of node 3")), "{seen:?}");
    // No survivor logged a step twice, each logged to the job's last step, and together they
    // logged every step of it (a rank that copied a peer's step at an entry did not).
    let mut every = std::collections::BTreeSet::new();
    for name in ["n1", "n2", "n4"] {
        let log = std::fs::read_to_string(dir.path().join(format!("{name}.steps.jsonl"))).unwrap();
        let steps: Vec<u64> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "{name}: {steps:?}");
        assert_eq!(steps.last(), Some(&(SYNTHETIC_STEPS - 1)), "{name}");
        every.extend(steps);
    }
    assert_eq!(every, (0..SYNTHETIC_STEPS).collect(), "steps no survivor logged");
    for a in agents {
        a.shutdown_token().cancel();
        assert_eq!(a.wait().await.unwrap(), Exit::Stopped);
    }
}

/// The state is a function of (seed, step): the same bytes for the same step, other bytes
/// for another step or seed, of the configured size.
#[test]
fn the_synthetic_state_is_a_function_of_seed_and_step() {
    let j = synthetic_job();
    let (a, b) = (j.state(5).unwrap(), j.state(5).unwrap());
    assert_eq!(a.content_hash(), b.content_hash());
    assert_ne!(a.content_hash(), j.state(6).unwrap().content_hash());
    let other = SyntheticJob { seed: 8, ..synthetic_job() };
    assert_ne!(a.content_hash(), other.state(5).unwrap().content_hash());
    let bytes: usize = a.tensors().values().map(|t| t.data().len()).sum();
    assert_eq!(bytes, 256 << 10);
    assert_eq!(a.meta().step, 5);
}

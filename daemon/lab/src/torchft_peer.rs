//! torchft beside limpet in `limpet-lab bench elastic`: its lighthouse and replica groups of
//! one process each (`bench/torchft_elastic.py`, gloo), one group killed with `kill -9` at 60%
//! of the job; measured: the time from the kill to the survivors' first step committed by a
//! quorum without it, and the step attempts they threw away meanwhile.

use crate::demo::now_ms;
use anyhow::Context;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(serde::Deserialize)]
struct Line {
    wall_ms: u64,
    committed: bool,
    participants: usize,
}

fn lines(path: &Path) -> Vec<Line> {
    crate::steplog::json_lines(path)
}

/// The processes of one run, killed when it ends however it ends.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(dir: &Path, script: &Path, args: &[String], log: &str) -> limpet_daemon::Result<Child> {
    let log = std::fs::File::create(dir.join(log))?;
    Command::new(crate::dp_cmd::python())
        .arg(script)
        .args(args)
        .env("DIGITS", limpet_trainer::data::default_digits_path())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting python for torchft")
        .map_err(Into::into)
}

/// Waits up to `limit` for `ready`, failing with `what` (and the log to read) if it never is
/// or if one of `procs` exits first.
fn wait_for(
    procs: &mut Procs,
    limit: Duration,
    what: &str,
    log: &Path,
    mut ready: impl FnMut() -> bool,
) -> limpet_daemon::Result<()> {
    let deadline = Instant::now() + limit;
    while !ready() {
        if let Some((i, status)) =
            procs.0.iter_mut().enumerate().find_map(|(i, c)| Some((i, c.try_wait().ok()??)))
        {
            limpet_daemon::fail!("torchft: {what}: process {i} exited ({status}); see {}", log.display());
        }
        if Instant::now() > deadline {
            limpet_daemon::fail!("torchft: {what} within {limit:?}; see {}", log.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// What one run measured.
pub struct Recovery {
    /// From the kill to the survivors' first step committed without the killed group, ms
    /// (none within the wait).
    pub recovery_ms: Option<u64>,
    /// Step attempts a survivor threw away meanwhile.
    pub lost_steps: Option<u64>,
}

/// One run: `replicas` groups train `steps` steps; the last group is killed at 60%.
/// `join_ms`: the lighthouse's join timeout (the rest of its settings are
/// `torchft_lighthouse`'s defaults).
pub fn run(dir: &Path, replicas: usize, steps: u64, join_ms: u64) -> limpet_daemon::Result<Recovery> {
    if replicas < 2 {
        return Err(limpet_daemon::UsageError("--torchft-replicas must be at least 2".into()).into());
    }
    let python = crate::dp_cmd::python();
    let found = Command::new(&python).args(["-c", "import torchft"]).stderr(Stdio::null()).status();
    if !found.is_ok_and(|s| s.success()) {
        limpet_daemon::fail!(
            "torchft is not installed beside {}: `bash deploy/setup.sh --bench` installs it (`make bench` runs that), or pass --no-torchft",
            python.display()
        );
    }
    std::fs::create_dir_all(dir)?;
    let script = dir.join("torchft_elastic.py");
    std::fs::write(&script, include_str!("../../../bench/torchft_elastic.py"))?;
    let out = dir.display().to_string();
    let join = join_ms.to_string();
    let lighthouse_args = ["lighthouse".into(), out.clone(), (replicas - 1).to_string(), join];
    let mut procs = Procs(vec![spawn(dir, &script, &lighthouse_args, "lighthouse.log")?]);
    let address_file = dir.join("lighthouse");
    wait_for(
        &mut procs,
        Duration::from_secs(60),
        "the lighthouse did not start",
        &dir.join("lighthouse.log"),
        || address_file.exists(),
    )?;
    let address = std::fs::read_to_string(&address_file)?;
    for r in 0..replicas {
        let args = ["replica".into(), out.clone(), r.to_string(), address.clone(), steps.to_string()];
        procs.0.push(spawn(dir, &script, &args, &format!("replica-{r}.log"))?);
    }
    let (first, victim) = (dir.join("steps-0.jsonl"), replicas - 1);
    let kill_step = (steps * 6 / 10) as usize;
    // The kill point, with every group in the quorum (one that joined late trains with the
    // others only from a later quorum on).
    let at_kill_point = || {
        let l = lines(&first);
        l.iter().filter(|l| l.committed).count() >= kill_step
            && l.last().is_some_and(|l| l.participants == replicas)
    };
    let log0 = dir.join("replica-0.log");
    wait_for(
        &mut procs,
        Duration::from_secs(600),
        "replica 0 did not reach the kill point",
        &log0,
        at_kill_point,
    )?;
    // Out of the processes watched for an early exit: this one exits now.
    // (Reaped when `killed` drops.)
    let mut killed = Procs(vec![procs.0.remove(1 + victim)]);
    let kill_at = now_ms();
    killed.0[0].kill().context("kill -9 of a torchft replica group")?;
    // The first step any survivor commits with a quorum that no longer counts the victim.
    let recovered = || {
        (0..victim).find_map(|r| {
            lines(&dir.join(format!("steps-{r}.jsonl")))
                .into_iter()
                .find(|l| l.wall_ms > kill_at && l.committed && l.participants < replicas)
                .map(|l| l.wall_ms)
        })
    };
    let waited = wait_for(
        &mut procs,
        Duration::from_secs(120),
        "no step without the killed group",
        &dir.join("replica-0.log"),
        || recovered().is_some(),
    );
    if let Err(e) = &waited {
        eprintln!("{e}");
    }
    let recovery_ms = recovered().map(|at| at - kill_at);
    // Attempts a survivor made between the kill and that step and did not commit.
    let lost = recovery_ms.map(|r| {
        lines(&first)
            .iter()
            .filter(|l| l.wall_ms > kill_at && l.wall_ms < kill_at + r && !l.committed)
            .count() as u64
    });
    Ok(Recovery { recovery_ms, lost_steps: lost })
}

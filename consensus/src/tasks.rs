//! The one shutdown path. The tasks and threads the agent, its consensus node and `limpetd`
//! around them start are spawned here: under one root cancellation token, tracked so
//! shutdown can wait for them with a limit (all but a peer's state transfers, which the
//! process's end ends), and watched so a panic stops the whole process with an error instead
//! of leaving, say, a leader that never schedules an epoch again. What runs outside it, and
//! how its end is watched instead, is listed in docs/architecture.md (`tasks.rs`).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The environment variable that makes a named task panic half a second after it starts:
/// the chaos test of this path (`limpet` injects revocations; this injects bugs). Only in
/// builds with the `lab` feature (the lab's and the tests'), never in a release.
#[cfg(feature = "lab")]
pub const CHAOS_PANIC_ENV: &str = "LIMPET_CHAOS_PANIC";

/// How long shutdown waits, after the root token is cancelled, for everything to end. Below
/// the systemd unit's `TimeoutStopSec` less the drain grace, so `limpetd` exits on its own
/// terms rather than by SIGKILL.
pub const SHUTDOWN_LIMIT: Duration = Duration::from_secs(8);

/// The agent's tasks and threads.
#[derive(Clone)]
pub struct Tasks {
    root: CancellationToken,
    tracker: TaskTracker,
    fatal: Arc<Mutex<Option<TaskFailed>>>,
}

impl Tasks {
    /// A new set under `root`: cancelling it stops everything spawned here.
    pub fn new(root: CancellationToken) -> Tasks {
        Tasks { root, tracker: TaskTracker::new(), fatal: Arc::default() }
    }

    /// The root token.
    pub fn token(&self) -> CancellationToken {
        self.root.clone()
    }

    /// Runs `fut` as the task `name`. If it panics, the process's work is over: the failure
    /// is recorded (see [`Tasks::fatal`]) and the root token cancelled.
    pub fn spawn<F>(&self, name: &'static str, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        #[cfg(feature = "lab")]
        let fut = {
            let chaos = std::env::var(CHAOS_PANIC_ENV).is_ok_and(|v| v == name);
            async move {
                if chaos {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    panic!("{CHAOS_PANIC_ENV}={name}");
                }
                fut.await
            }
        };
        let inner = tokio::spawn(fut);
        let me = self.clone();
        self.tracker.spawn(async move {
            if let Err(e) = inner.await {
                if e.is_panic() {
                    me.fail(name, &format!("panicked: {}", panic_text(e.into_panic())));
                }
            }
        });
    }

    /// Runs `f` on a thread named `limpet-<name>`, tracked like a task; a panic is fatal.
    pub fn spawn_thread<F>(&self, name: &'static str, f: F) -> std::io::Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        self.thread(name, Some(self.tracker.token()), f).map(drop)
    }

    /// [`Tasks::spawn_thread`], with the thread's handle for an owner that joins it (a
    /// listener's accept loop, joined so its port is free once the owner is gone).
    pub fn spawn_joinable_thread<F>(
        &self,
        name: &'static str,
        f: F,
    ) -> std::io::Result<std::thread::JoinHandle<()>>
    where
        F: FnOnce() + Send + 'static,
    {
        self.thread(name, Some(self.tracker.token()), f)
    }

    /// Runs `f` on a thread named `limpet-<name>` that shutdown does not wait for: work for a
    /// peer that may outlast the stop (a state transfer a slow reader draws out), which the
    /// process's end ends. A panic is still fatal.
    pub fn spawn_detached_thread<F>(&self, name: &'static str, f: F) -> std::io::Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        self.thread(name, None, f).map(drop)
    }

    fn thread<F>(
        &self,
        name: &'static str,
        token: Option<tokio_util::task::task_tracker::TaskTrackerToken>,
        f: F,
    ) -> std::io::Result<std::thread::JoinHandle<()>>
    where
        F: FnOnce() + Send + 'static,
    {
        let me = self.clone();
        #[cfg(feature = "lab")]
        let chaos = std::env::var(CHAOS_PANIC_ENV).is_ok_and(|v| v == name);
        std::thread::Builder::new().name(format!("limpet-{name}")).spawn(move || {
            let _running = token;
            #[cfg(feature = "lab")]
            let f = move || {
                if chaos {
                    std::thread::sleep(Duration::from_millis(500));
                    panic!("{CHAOS_PANIC_ENV}={name}");
                }
                f()
            };
            if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(f)) {
                me.fail(name, &format!("panicked: {}", panic_text(p)));
            }
        })
    }

    /// Records that `name` failed beyond repair and stops everything.
    pub fn fail(&self, name: &str, what: &str) {
        tracing::error!(task = name, what, "a task failed; stopping");
        self.fatal
            .lock()
            .expect("fatal lock")
            .get_or_insert_with(|| TaskFailed { task: name.to_string(), what: what.to_string() });
        self.root.cancel();
    }

    /// The first fatal failure, if any.
    pub fn fatal(&self) -> Option<TaskFailed> {
        self.fatal.lock().expect("fatal lock").clone()
    }

    /// Cancels the root token and waits until `deadline` for every task and thread to end;
    /// the error names how many did not.
    pub async fn shutdown(&self, deadline: tokio::time::Instant) -> Result<(), Lingering> {
        self.root.cancel();
        self.tracker.close();
        match tokio::time::timeout_at(deadline, self.tracker.wait()).await {
            Ok(()) => Ok(()),
            Err(_) => Err(Lingering(self.tracker.len())),
        }
    }
}

/// A task or thread that failed beyond repair (it panicked, or reported a fatal error): the
/// first one stops everything, and is the process's error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("task {task} failed: {what}")]
pub struct TaskFailed {
    /// The task's name.
    pub task: String,
    /// What happened to it.
    pub what: String,
}

/// Tasks and threads still running when the shutdown's time was up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0} task(s) still running at the shutdown limit")]
pub struct Lingering(pub usize);

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p.downcast::<&str>().map_or_else(|_| "(no message)".to_string(), |s| s.to_string()),
    }
}

//! What a new leader does before the job is set: profile the job (the pipeline planner
//! needs the model's blocks measured), then, for a new cluster (a log without checkpoints),
//! look once for the newest durable checkpoint to resume from, looking again every
//! [`RESUME_RETRY_MS`] while the search cannot answer (a shared mount not there yet, S3 out
//! of reach) so that nothing trains from step 0 meanwhile; then set the job. The leader loop
//! (`runtime::lead`) asks before each round and does the I/O.

/// How long a new cluster waits before searching for its checkpoint again.
pub const RESUME_RETRY_MS: u64 = 5000;

/// What the leader does next, before the job is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BootStep {
    /// Build the job's document (profiling the model for a pipelined job).
    Profile,
    /// Nothing yet: the last search failed and its retry is not due.
    Wait,
    /// Search for the checkpoint to resume from, and record it if there is one.
    FindResume,
    /// Propose the job.
    SetJob,
}

/// Where the leader's bootstrap stands: whether the resume search has answered, and when it
/// may be tried again after a failure (milliseconds on the caller's monotonic clock).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bootstrap {
    resume_settled: bool,
    retry_at_ms: u64,
}

impl Bootstrap {
    /// The next step at `now_ms`, once the job's document is `profiled` or not, with the log
    /// holding checkpoints or not (a cluster whose log records one is not new: the log says
    /// where it is).
    pub fn next(&self, now_ms: u64, profiled: bool, log_has_checkpoints: bool) -> BootStep {
        if !profiled {
            BootStep::Profile
        } else if self.resume_settled || log_has_checkpoints {
            BootStep::SetJob
        } else if now_ms < self.retry_at_ms {
            BootStep::Wait
        } else {
            BootStep::FindResume
        }
    }

    /// The search answered: no checkpoint, or one that is now recorded. (One found but not
    /// recorded is searched for again at once.)
    pub fn resume_settled(&mut self) {
        self.resume_settled = true;
    }

    /// The search could not answer at `now_ms`: it is tried again [`RESUME_RETRY_MS`] later.
    pub fn resume_failed(&mut self, now_ms: u64) {
        self.retry_at_ms = now_ms.saturating_add(RESUME_RETRY_MS);
    }
}

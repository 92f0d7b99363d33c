//! Straggler drills: a host made slower on purpose, so the lab and the tests can watch the
//! balancer shrink its share. Only builds with the `lab` feature sleep; in a release these
//! are no-ops and `limpetd`'s configuration has no key that sets them.

use std::time::Duration;

/// How much slower this host computes than it does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slowdown {
    /// Sleep this many microseconds per sample computed (0: off).
    pub us_per_sample: u64,
    /// Compute as a host this many times slower would: sleep the extra time after each
    /// step's own work (1: off).
    pub factor: f64,
}

impl Default for Slowdown {
    fn default() -> Slowdown {
        Slowdown { us_per_sample: 0, factor: 1.0 }
    }
}

impl Slowdown {
    /// Sleeps the per-sample drill for `samples` samples; how long it slept.
    pub fn per_samples(&self, samples: usize) -> Duration {
        let slept = Duration::from_micros(self.us_per_sample.saturating_mul(samples as u64));
        #[cfg(feature = "lab")]
        if !slept.is_zero() {
            std::thread::sleep(slept);
        }
        if cfg!(feature = "lab") {
            slept
        } else {
            Duration::ZERO
        }
    }

    /// After `own` of this step's own work, sleeps what a host `factor` times slower would
    /// have taken more; the work's time with it.
    pub fn stretch(&self, own: Duration) -> Duration {
        #[cfg(feature = "lab")]
        if self.factor > 1.0 {
            let extra = own.mul_f64(self.factor - 1.0);
            std::thread::sleep(extra);
            return own + extra;
        }
        own
    }
}

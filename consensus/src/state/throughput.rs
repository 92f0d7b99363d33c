//! Training throughput at each world size, as the leader measured it from the ranks' step
//! reports and recorded it in the log: the points scaling by value fits its curve to
//! (`limpet_decide::scaling`). In the log, not in one leader's memory, so a new leader (and
//! `limpet status`) knows what every world size the job has run at gave.
//!
//! Values are integers (thousandths of a sample per second) so that every node applies
//! exactly the same record.

use super::{Invalid, Refused};
use serde::{Deserialize, Serialize};

/// The most world sizes the log keeps a measurement for.
pub const MAX_THROUGHPUT_WORLDS: usize = 4096;

/// Above this (a billion samples per second), a measurement is a bug or a lie.
const MAX_MILLI: u64 = 1_000_000_000_000;

/// One world size's measurement: the newest epoch of that size that ran long enough.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Throughput {
    /// Hosts that trained.
    pub world: u32,
    /// The epoch measured.
    pub epoch: u64,
    /// Samples per second x 1000, as trained.
    pub samples_milli: u64,
    /// Samples per second x 1000 that count: under `linear`, `sqrt` and `adascale` a step of
    /// a larger batch counts as `lr_scale` steps of the declared batch, not as its size.
    pub useful_milli: u64,
    /// When (unix milliseconds, the leader's clock).
    pub at_ms: u64,
}

impl Throughput {
    /// Samples per second that count.
    pub fn useful_per_s(&self) -> f64 {
        self.useful_milli as f64 / 1000.0
    }

    /// Samples per second as trained.
    pub fn samples_per_s(&self) -> f64 {
        self.samples_milli as f64 / 1000.0
    }
}

/// The newest measurement of each world size, by world.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThroughputLog {
    /// One per world size, smallest world first.
    pub by_world: Vec<Throughput>,
}

impl ThroughputLog {
    /// The measurement at `world`.
    pub fn at(&self, world: u32) -> Option<&Throughput> {
        self.by_world.iter().find(|t| t.world == world)
    }

    /// `(world, useful samples per second)` of every measurement, smallest world first.
    pub fn points(&self) -> Vec<(u32, f64)> {
        self.by_world.iter().map(|t| (t.world, t.useful_per_s())).collect()
    }

    /// Records `t` (replacing the older measurement of its world) if it is plausible and
    /// names an epoch the log has scheduled.
    pub(super) fn apply(&mut self, t: &Throughput, last_epoch_id: u64) -> super::Outcome {
        if t.world == 0 || t.epoch == 0 || t.epoch > last_epoch_id {
            return Err(Refused(format!(
                "throughput record: world {} of epoch {} (epochs so far: {last_epoch_id})",
                t.world, t.epoch
            )));
        }
        if t.samples_milli == 0 || t.samples_milli > MAX_MILLI || t.useful_milli > MAX_MILLI {
            return Err(Refused(format!(
                "throughput record for world {}: {} samples/s ({} that count) is not plausible",
                t.world,
                t.samples_per_s(),
                t.useful_per_s()
            )));
        }
        match self.by_world.binary_search_by_key(&t.world, |x| x.world) {
            Ok(i) if self.by_world[i].epoch > t.epoch => {
                return Err(Refused(format!(
                    "throughput record for world {}: epoch {} is older than the one recorded ({})",
                    t.world, t.epoch, self.by_world[i].epoch
                )));
            }
            Ok(i) => self.by_world[i] = *t,
            Err(_) if self.by_world.len() >= MAX_THROUGHPUT_WORLDS => {
                return Err(Refused(format!(
                    "throughput record for world {}: {MAX_THROUGHPUT_WORLDS} worlds kept",
                    t.world
                )))
            }
            Err(i) => self.by_world.insert(i, *t),
        }
        Ok(format!(
            "throughput at world {}: {:.1} samples/s ({:.1} that count), epoch {}",
            t.world,
            t.samples_per_s(),
            t.useful_per_s(),
            t.epoch
        ))
    }

    /// The log's invariants: one record per world, in order, within bounds.
    pub(super) fn validate(&self) -> Result<(), super::Invalid> {
        if self.by_world.len() > MAX_THROUGHPUT_WORLDS {
            return Err(Invalid(format!("{} throughput records kept", self.by_world.len())));
        }
        if self.by_world.windows(2).any(|w| w[0].world >= w[1].world) {
            return Err(Invalid("throughput records out of world order".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(world: u32, epoch: u64, per_s: u64) -> Throughput {
        Throughput { world, epoch, samples_milli: per_s * 1000, useful_milli: per_s * 1000, at_ms: 1 }
    }

    #[test]
    fn one_measurement_per_world_the_newest_epoch_wins() {
        let mut log = ThroughputLog::default();
        log.apply(&t(3, 2, 300), 5).unwrap();
        log.apply(&t(2, 1, 250), 5).unwrap();
        log.apply(&t(3, 4, 310), 5).unwrap();
        assert_eq!(log.points(), vec![(2, 250.0), (3, 310.0)]);
        assert!(log.apply(&t(3, 3, 1), 5).unwrap_err().0.contains("older"));
        assert!(log.apply(&t(4, 6, 1), 5).unwrap_err().0.contains("epochs so far"));
        assert!(log.apply(&t(0, 1, 1), 5).is_err());
        assert!(log.apply(&t(4, 1, 0), 5).unwrap_err().0.contains("plausible"));
        assert!(log.apply(&t(4, 1, u64::MAX / 1000), 5).unwrap_err().0.contains("plausible"));
        log.validate().unwrap();
    }
}

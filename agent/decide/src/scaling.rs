//! Scaling by value: how many hosts are worth paying for. The leader records the throughput
//! of every world size the job has trained at (`ClusterState::throughput`, samples per
//! second that count under the batch policy); this fits a scaling curve to those points and
//! adds hosts while one more host's throughput per dollar stays above the configured
//! `min_marginal_value`, stopping at the knee instead of filling the maximum.
//!
//! The curve is Amdahl's: the time per sample falls as `alpha + beta / n` (a part that
//! parallelises and one that does not: the allreduce, the slowest host). A measured world
//! size counts as measured; others are predicted. With one point the curve is a straight
//! line through it (nothing shows a knee yet), so the leader tries one host more and learns
//! where the curve bends. Growing takes the full threshold, shrinking a value below 80% of
//! it, so a measurement near the threshold does not make the fleet flap.

/// What scaling by value is told.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValuePolicy {
    /// A host is added while it adds at least this many samples (that count) per dollar.
    pub min_marginal_value: f64,
    /// Fewest hosts.
    pub min: u32,
    /// Most hosts.
    pub max: u32,
}

/// A shrink needs the marginal value below this share of the threshold.
const SHRINK_BELOW: f64 = 0.8;

/// A fitted scaling curve.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// Seconds per sample that no number of hosts removes.
    pub alpha: f64,
    /// Seconds per sample one host spends on what more hosts share.
    pub beta: f64,
    /// The measured points, `(world, samples per second)`.
    pub measured: Vec<(u32, f64)>,
}

/// Fits the curve to `(world, samples per second)` points; `None` without a usable point.
/// Points that are not finite and positive (a peer's words, a bug) are left out.
pub fn fit(points: &[(u32, f64)]) -> Option<Curve> {
    let measured: Vec<(u32, f64)> =
        points.iter().copied().filter(|&(n, t)| n > 0 && t.is_finite() && t > 0.0).collect();
    let (alpha, beta) = match measured.as_slice() {
        [] => return None,
        // A line through the one point: no knee shows yet.
        [(n, t)] => (0.0, *n as f64 / t),
        _ => least_squares(&measured),
    };
    Some(Curve { alpha, beta, measured })
}

/// `1/T = alpha + beta/n` by least squares, both kept non-negative: a curve that would fall
/// with more hosts is flat at the mean, one that would rise faster than linearly is linear.
fn least_squares(points: &[(u32, f64)]) -> (f64, f64) {
    let xy: Vec<(f64, f64)> = points.iter().map(|&(n, t)| (1.0 / n as f64, 1.0 / t)).collect();
    let k = xy.len() as f64;
    let (mx, my) = (xy.iter().map(|p| p.0).sum::<f64>() / k, xy.iter().map(|p| p.1).sum::<f64>() / k);
    let sxx: f64 = xy.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let beta = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    if beta <= 0.0 {
        return (my, 0.0);
    }
    let alpha = my - beta * mx;
    if alpha < 0.0 {
        let through_origin =
            xy.iter().map(|p| p.0 * p.1).sum::<f64>() / xy.iter().map(|p| p.0 * p.0).sum::<f64>();
        return (0.0, through_origin);
    }
    (alpha, beta)
}

impl Curve {
    /// Samples per second at `n` hosts: measured if it was, else predicted. Below the
    /// smallest world measured the prediction is perfect scaling down from it (a curve fitted
    /// to larger worlds says nothing of smaller ones, and a flat one would claim that fewer
    /// hosts lose nothing).
    pub fn at(&self, n: u32) -> f64 {
        if let Some(&(_, t)) = self.measured.iter().find(|p| p.0 == n) {
            return t;
        }
        if let Some(&(s, t)) = self.measured.iter().min_by_key(|p| p.0).filter(|p| n < p.0) {
            return t * n as f64 / s as f64;
        }
        let y = self.alpha + self.beta / n.max(1) as f64;
        if y > 0.0 {
            1.0 / y
        } else {
            0.0
        }
    }

    fn is_measured(&self, n: u32) -> bool {
        self.measured.iter().any(|p| p.0 == n)
    }
}

/// What one more host is worth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Marginal {
    /// Hosts before it.
    pub from: u32,
    /// Samples per second (that count) it adds; negative when it slows the job.
    pub gain_per_s: f64,
    /// Those samples per dollar of its price.
    pub per_dollar: f64,
    /// Whether both ends of the step were measured (else predicted).
    pub measured: bool,
}

/// The number of hosts chosen, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueChoice {
    /// Hosts wanted.
    pub target: u32,
    /// Why, with the numbers.
    pub reason: String,
    /// The marginal values looked at, from `min` up.
    pub steps: Vec<Marginal>,
}

/// One more host's value after `n` hosts, at `price` dollars per host-hour.
pub fn marginal(curve: &Curve, n: u32, price: f64) -> Marginal {
    let gain = curve.at(n + 1) - curve.at(n);
    Marginal {
        from: n,
        gain_per_s: gain,
        per_dollar: gain * 3600.0 / price,
        measured: curve.is_measured(n) && curve.is_measured(n + 1),
    }
}

/// The number of hosts worth paying for, given the measured `points`, the price of one more
/// host (`price`, dollars per hour) and the number wanted so far (`current`). `None` when
/// nothing is measured yet or the price is not a positive number: the target stays.
pub fn choose(points: &[(u32, f64)], price: f64, p: &ValuePolicy, current: u32) -> Option<ValueChoice> {
    let curve = fit(points)?;
    if !(price.is_finite() && price > 0.0 && p.min_marginal_value.is_finite()) {
        return None;
    }
    let (lo, hi) = (p.min.max(1), p.max.max(p.min.max(1)));
    let steps: Vec<Marginal> = (lo..hi).map(|n| marginal(&curve, n, price)).collect();
    // The knee for a threshold: the first step worth less.
    let knee = |threshold: f64| steps.iter().find(|m| m.per_dollar < threshold).map_or(hi, |m| m.from);
    let current = current.clamp(lo, hi);
    // A prediction past the largest world measured is a guess: grow one host past it, then
    // measure.
    let largest = curve.measured.iter().map(|m| m.0).max().unwrap_or(lo);
    let reach = largest.saturating_add(1).max(current);
    let knee_up = knee(p.min_marginal_value);
    let up = knee_up.min(reach);
    let down = knee(p.min_marginal_value * SHRINK_BELOW);
    let target = if up > current {
        up
    } else if down < current {
        down
    } else {
        current
    };
    let mut reason = explain(&steps, target, hi, price, p.min_marginal_value);
    if target == up && knee_up > up {
        reason += &format!(" (more may pay: one host past the largest world measured, {largest}, at a time)");
    }
    Some(ValueChoice { target, reason, steps })
}

fn explain(steps: &[Marginal], target: u32, hi: u32, price: f64, threshold: f64) -> String {
    let words = |m: &Marginal| {
        format!(
            "host {} adds {:.0} samples/s ({}) at ${price}/h: {} samples/$",
            m.from + 1,
            m.gain_per_s,
            if m.measured { "measured" } else { "predicted" },
            per_dollar(m.per_dollar)
        )
    };
    match steps.iter().find(|m| m.from == target) {
        _ if target >= hi => match steps.last() {
            Some(m) => format!("{target} hosts (the maximum): {}", words(m)),
            None => format!("{target} hosts (the maximum)"),
        },
        Some(m) => format!("{target} hosts, the knee: {}, below {}", words(m), per_dollar(threshold)),
        None => format!("{target} hosts"),
    }
}

/// Samples per dollar in a few digits.
fn per_dollar(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: ValuePolicy = ValuePolicy { min_marginal_value: 1e6, min: 1, max: 8 };

    #[test]
    fn one_point_is_a_line_and_two_find_the_knee() {
        // 1000 samples/s at 2 hosts: a third looks worth 500 samples/s until measured.
        let c = fit(&[(2, 1000.0)]).unwrap();
        assert!((c.at(3) - 1500.0).abs() < 1e-6);
        // Amdahl with alpha = 0.25 ms, beta = 2 ms: T(n) = 1 / (0.00025 + 0.002 / n).
        let t = |n: u32| 1.0 / (0.00025 + 0.002 / n as f64);
        let c = fit(&[(1, t(1)), (2, t(2)), (4, t(4))]).unwrap();
        assert!((c.alpha - 0.00025).abs() < 1e-9 && (c.beta - 0.002).abs() < 1e-9, "{c:?}");
        assert!((c.at(8) - t(8)).abs() < 1e-6);
        // More hosts that slow the job: flat, not falling below zero.
        let c = fit(&[(2, 1000.0), (3, 900.0)]).unwrap();
        assert_eq!((c.beta, c.at(5)), (0.0, 1.0 / c.alpha));
        assert!(fit(&[(2, f64::NAN), (0, 5.0), (3, -1.0)]).is_none());
    }

    #[test]
    fn hosts_are_added_while_they_pay_and_the_knee_stops_it() {
        let t = |n: u32| 1.0 / (0.00025 + 0.002 / n as f64);
        let points: Vec<(u32, f64)> = [1, 2, 4].iter().map(|&n| (n, t(n))).collect();
        // $1/h: host n+1 adds (T(n+1)-T(n)) * 3600 samples per dollar.
        let c = choose(&points, 1.0, &P, 2).unwrap();
        let want = (1..8).find(|&n| (t(n + 1) - t(n)) * 3600.0 < 1e6).unwrap();
        assert_eq!(c.target, want, "{}", c.reason);
        assert!(c.reason.contains("the knee") && c.reason.contains("samples/$"), "{}", c.reason);
        // Cheaper hosts are worth more of them.
        let cheap = choose(&points, 0.1, &P, 2).unwrap();
        assert_eq!(cheap.target, 5, "one past the largest world measured: {}", cheap.reason);
        // One point: try one host more (a line never bends), then measure.
        let c = choose(&[(2, 1000.0)], 1.0, &P, 2).unwrap();
        assert_eq!(c.target, 3, "{}", c.reason);
        assert!(c.reason.contains("more may pay"), "{}", c.reason);
        // Measured: the third host made it slower; back to two.
        let c = choose(&[(2, 1000.0), (3, 950.0)], 1.0, &P, 3).unwrap();
        assert_eq!(c.target, 2, "{}", c.reason);
        assert!(c.reason.contains("measured"), "{}", c.reason);
        // Nothing measured, or no price: no opinion.
        assert!(choose(&[], 1.0, &P, 2).is_none());
        assert!(choose(&[(2, 1000.0)], 0.0, &P, 2).is_none());
    }

    #[test]
    fn a_value_between_the_bands_keeps_the_current_target() {
        // Host 3 adds 300 samples/s at $1/h = 1.08M samples/$: above 0.8M, below 1.2M.
        let points = [(2, 1000.0), (3, 1300.0), (4, 1310.0)];
        let p = ValuePolicy { min_marginal_value: 1.2e6, ..P };
        assert_eq!(choose(&points, 1.0, &p, 3).unwrap().target, 3, "stays");
        assert_eq!(choose(&points, 1.0, &p, 2).unwrap().target, 2, "does not grow");
        assert_eq!(choose(&points, 1.0, &p, 4).unwrap().target, 3, "shrinks past the band");
    }

    proptest! {
        /// Whatever the points (peers' measurements), the target stays within min..=max and
        /// nothing panics.
        #[test]
        fn the_target_stays_within_bounds(
            points in proptest::collection::vec((0u32..20, prop_oneof![Just(f64::NAN), Just(-1.0), Just(0.0), 1e-3f64..1e9]), 0..6),
            price in prop_oneof![Just(0.0), Just(f64::INFINITY), 1e-4f64..100.0],
            min in 1u32..5, extra in 0u32..5, current in 0u32..12,
        ) {
            let p = ValuePolicy { min_marginal_value: 1e5, min, max: min + extra };
            if let Some(c) = choose(&points, price, &p, current) {
                prop_assert!(c.target >= min && c.target <= min + extra, "{:?}", c);
            }
        }
    }
}

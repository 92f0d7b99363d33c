//! The statistics the benchmarks report: medians of repeated runs, latency percentiles
//! (hdrhistogram, microsecond resolution to three significant figures).

use serde::Serialize;

/// The median of `xs` (the upper one of an even count); `NaN` for none.
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Slowest.
    pub max: f64,
}

/// The percentiles of latencies given in milliseconds.
pub fn percentiles(ms: &[f64]) -> Percentiles {
    // 1 µs to an hour; slower values count as an hour.
    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds");
    for &x in ms {
        h.saturating_record((x * 1e3).round().max(1.0) as u64);
    }
    let at = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), max: h.max() as f64 / 1e3 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians_of_known_samples() {
        let ms: Vec<f64> = (1..=1000).map(f64::from).collect();
        let p = percentiles(&ms);
        assert!((p.p50 - 500.0).abs() <= 1.0 && (p.p99 - 990.0).abs() <= 1.0, "{p:?}");
        assert!((p.max - 1000.0).abs() <= 1.0, "{p:?}");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert!(median(Vec::new()).is_nan());
    }
}

//! Measured speeds, smoothed: each new measurement weighs a tenth, so one slow step (an
//! entry's first, a page fault, a collective that waited) moves what the balance and the
//! leader plan with by a tenth of its excess, and fades geometrically after it.

/// What a smoothed value keeps of itself at each measurement.
pub const KEEP: f64 = 0.9;
/// What it takes of the new measurement.
pub const TAKE: f64 = 0.1;

/// `old` moved a tenth of the way to `new`.
pub fn blend(old: f64, new: f64) -> f64 {
    KEEP * old + TAKE * new
}

/// A smoothed measurement: the first (`old` is zero: nothing measured yet) taken whole, every
/// later one blended in.
pub fn smooth(old: f64, new: f64) -> f64 {
    if old == 0.0 {
        new
    } else {
        blend(old, new)
    }
}

/// The weight the first of `steps` measurements still has in their smoothed value.
pub fn first_weight(steps: u64) -> f64 {
    KEEP.powi(steps.saturating_sub(1).min(i32::MAX as u64) as i32)
}

//! The leader's bootstrap (profile, resume search, job) and the smoothing of measured speeds.

use limpet_decide::bootstrap::{BootStep, Bootstrap, RESUME_RETRY_MS};
use limpet_decide::speed::{first_weight, smooth};

/// A new cluster profiles, searches for its checkpoint, and sets the job once the search
/// answered (found and recorded, or nothing found).
#[test]
fn a_new_cluster_profiles_then_searches_then_sets_the_job() {
    for found in [true, false] {
        let mut b = Bootstrap::default();
        assert_eq!(b.next(0, false, false), BootStep::Profile);
        assert_eq!(b.next(10, true, false), BootStep::FindResume);
        b.resume_settled();
        // A recorded checkpoint is in the log by the next round; none found is settled too.
        assert_eq!(b.next(20, true, found), BootStep::SetJob, "found: {found}");
    }
}

/// A search that cannot answer waits out the retry and tries again (nothing is set
/// meanwhile, so nothing trains from step 0); a found checkpoint whose record failed is
/// searched for again at once.
#[test]
fn a_failed_search_is_retried_after_five_seconds_and_a_lost_record_at_once() {
    let mut b = Bootstrap::default();
    b.resume_failed(1_000);
    assert_eq!(b.next(1_000, true, false), BootStep::Wait);
    assert_eq!(b.next(1_000 + RESUME_RETRY_MS - 1, true, false), BootStep::Wait);
    assert_eq!(b.next(1_000 + RESUME_RETRY_MS, true, false), BootStep::FindResume);
    // Found, but the record was not committed: the state is unchanged, search again.
    assert_eq!(b.next(1_000 + RESUME_RETRY_MS + 50, true, false), BootStep::FindResume);
    // A clock at its end does not wrap into "due".
    b.resume_failed(u64::MAX - 1);
    assert_eq!(b.next(u64::MAX - 1, true, false), BootStep::Wait);
}

/// A cluster whose log already records a checkpoint (a leader change, or a restart of every
/// host with the log on disk) sets the job without searching; the job is never set before
/// its document is built.
#[test]
fn a_log_with_checkpoints_skips_the_search_and_nothing_is_set_unprofiled() {
    let b = Bootstrap::default();
    assert_eq!(b.next(0, true, true), BootStep::SetJob);
    let mut settled = Bootstrap::default();
    settled.resume_settled();
    assert_eq!(settled.next(0, false, true), BootStep::Profile);
}

/// The first measurement is taken whole, each later one weighs a tenth, and after the steps
/// the leader waits before recording throughput the first weighs under 1%.
#[test]
fn speeds_take_the_first_measurement_whole_and_a_tenth_of_each_later_one() {
    assert_eq!(smooth(0.0, 42.0), 42.0);
    assert_eq!(smooth(10.0, 20.0), 11.0);
    let mut v = 0.0;
    let mut first = 0.0;
    for k in 0..limpet_decide::leader::MEASURE_STEPS {
        // A slow first step, then steady ones.
        let m = if k == 0 { 1000.0 } else { 10.0 };
        v = smooth(v, m);
        if k == 0 {
            first = v;
        }
    }
    assert_eq!(first, 1000.0);
    let weight = (v - 10.0) / (1000.0 - 10.0);
    assert!((weight - first_weight(limpet_decide::leader::MEASURE_STEPS)).abs() < 1e-12, "{weight}");
    assert!(weight < 0.01, "the entry's slow first step still weighs {weight}");
}

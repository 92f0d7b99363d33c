//! The simulation model's unit tests.

use super::*;

fn params(samples: f64) -> Params {
    test_params(samples)
}

fn trace(text: &str) -> Trace {
    Trace::parse(text, "t").unwrap()
}

#[test]
fn a_steady_fleet_trains_at_its_rate_and_pays_for_its_hours() {
    let t = trace("0,add,a\n0,add,b\n");
    let p = params(20.0 * 3600.0);
    for policy in [Policy::Limpet, Policy::OnDemand] {
        let o = simulate(&t, &p, policy).unwrap();
        assert!((o.hours - 1.0).abs() < 1e-3, "{policy:?}: {}", o.hours);
        assert!((o.goodput - 1.0).abs() < 1e-3);
    }
    let spot = simulate(&t, &p, Policy::Limpet).unwrap();
    let od = simulate(&t, &p, Policy::OnDemand).unwrap();
    assert!((spot.cost - 2.0).abs() < 1e-2 && (od.cost - 6.0).abs() < 1e-2, "{} {}", spot.cost, od.cost);
    // Checkpoints cost their writes: an hour of training holds five 10 s pauses (the
    // sixth checkpoint would come as the job ends).
    let ckpt = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
    assert!((ckpt.goodput - 3600.0 / 3650.0).abs() < 1e-3, "{}", ckpt.goodput);
}

#[test]
fn a_revocation_costs_limpet_its_idle_and_checkpoint_restart_its_lost_work() {
    // Two hosts; one leaves at 30 min (5 min after a checkpoint at ~25 min of training).
    let t = trace("0,add,a\n0,add,b\n1800000,remove,b\n");
    let p = params(20.0 * 3600.0);
    let limpet = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!((limpet.paused_s - 0.01).abs() < 1e-6, "{}", limpet.paused_s);
    assert_eq!(limpet.transitions, 1);
    // Half the job is left at 30 min on one host: 1 h more, plus the idle.
    assert!((limpet.hours - 1.5).abs() < 1e-3, "{}", limpet.hours);
    let ckpt = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
    assert!(
        ckpt.lost_s > 100.0 && ckpt.hours > limpet.hours + 0.05,
        "{:?}",
        (ckpt.hours, ckpt.trained, ckpt.lost_s, ckpt.paused_s, ckpt.transitions)
    );
    // Without a notice, limpet loses the step in flight and the recovery.
    let kill = simulate(&t, &Params { no_notice: 1.0, ..p }, Policy::Limpet).unwrap();
    assert!(
        (kill.paused_s - 2.3).abs() < 1e-6 && (kill.lost_s - 1.0).abs() < 1e-9,
        "{:?}",
        (kill.hours, kill.trained, kill.lost_s, kill.paused_s, kill.transitions)
    );
}

#[test]
fn booting_hosts_are_paid_for_but_do_not_train() {
    let t = trace("0,add,a\n");
    let p = Params { boot_s: 1800.0, ..params(10.0 * 3600.0) };
    let o = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!((o.hours - 1.5).abs() < 1e-3, "{}", o.hours);
    assert!((o.cost - 1.5).abs() < 1e-2, "{}", o.cost);
    // Goodput counts what the paid hours could have trained: the boot is a third of them.
    assert!((o.goodput - 1.0 / 1.5).abs() < 1e-3, "{}", o.goodput);
    assert!(
        (o.billed_host_hours - 1.5).abs() < 1e-3 && (o.ready_host_hours - 1.0).abs() < 1e-3,
        "{:?}",
        (o.hours, o.trained, o.lost_s, o.paused_s, o.transitions)
    );
    // A host removed while booting was never a transition.
    let t = trace("0,add,a\n0,add,b\n60000,remove,b\n");
    assert_eq!(simulate(&t, &p, Policy::Limpet).unwrap().transitions, 0, "a's join starts the job");
}

#[test]
fn changes_at_one_instant_make_one_restart() {
    // Two of three hosts go at once, and one comes back during the restart.
    let t = trace("0,add,a\n0,add,b\n0,add,c\n1800000,remove,b\n1800000,remove,c\n1830000,add,b\n");
    let p = Params { until_s: Some(7200.0), checkpoint_every_s: 1e9, ..params(1e12) };
    let o = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
    assert_eq!(o.transitions, 2, "one restart for the two removals, one for the add");
    // The add came 30 s into the 60 s restart: it starts over, 90 s in all, not 180.
    assert!(
        (o.paused_s - 90.0).abs() < 0.2,
        "{:?}",
        (o.hours, o.trained, o.lost_s, o.paused_s, o.transitions)
    );
    // Without restarts on additions, only the removals restart it.
    let o = simulate(&t, &Params { restart_on_add: false, ..p.clone() }, Policy::CheckpointRestart).unwrap();
    assert_eq!(o.transitions, 1);
    // limpet: three transitions, each its own idle.
    assert_eq!(simulate(&t, &p, Policy::Limpet).unwrap().transitions, 3);
}

#[test]
fn without_restarts_on_additions_a_new_host_waits_idle_for_the_next_restart() {
    // a trains alone; b comes at 30 min, c comes at 60 min and goes at 70 (an idle host:
    // no restart), d comes at 90 min. No host that trains is lost, so nothing restarts.
    let t = trace("0,add,a\n1800000,add,b\n3600000,add,c\n4200000,remove,c\n5400000,add,d\n");
    let p = Params { until_s: Some(7200.0), checkpoint_every_s: 1e9, ..params(1e12) };
    let waiting =
        simulate(&t, &Params { restart_on_add: false, ..p.clone() }, Policy::CheckpointRestart).unwrap();
    // No restart at all: a trained alone for the two hours, paying for the idle hosts.
    assert_eq!(
        waiting.transitions,
        0,
        "{:?}",
        (waiting.hours, waiting.trained, waiting.lost_s, waiting.paused_s, waiting.transitions)
    );
    assert!(
        (waiting.trained - 10.0 * 7200.0).abs() < 1.0,
        "{:?}",
        (waiting.hours, waiting.trained, waiting.lost_s, waiting.paused_s, waiting.transitions)
    );
    assert!((waiting.ready_host_hours - 2.0).abs() < 1e-3 && waiting.billed_host_hours > 3.4, "{waiting:?}");
    // Restarting on additions takes them in: four restarts (b, c, c's loss, d), each losing
    // the work since the last checkpoint (here all of it: no checkpoint is ever due).
    let restarting = simulate(&t, &p, Policy::CheckpointRestart).unwrap();
    assert_eq!(restarting.transitions, 4);
    // limpet takes each in at once.
    let limpet = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!(
        limpet.trained > 1.5 * waiting.trained,
        "{:?}",
        (limpet.hours, limpet.trained, limpet.lost_s, limpet.paused_s, limpet.transitions)
    );
}

#[test]
fn an_asynchronous_checkpoint_pauses_briefly_and_counts_once_written() {
    let t = trace("0,add,a\n0,add,b\n");
    let window = Params { until_s: Some(3600.0), ..params(1e12) };
    let sync = simulate(&t, &window, Policy::CheckpointRestart).unwrap();
    let async_p = Params { async_pause_s: Some(0.5), ..window.clone() };
    let fast = simulate(&t, &async_p, Policy::CheckpointRestart).unwrap();
    // Five checkpoints in the hour (the sixth is due just past it): 10 s pauses, or
    // half-second ones.
    assert!((sync.paused_s - 50.0).abs() < 0.2 && (fast.paused_s - 2.5).abs() < 0.2, "{sync:?} {fast:?}");
    assert!(fast.trained > sync.trained);
    // Either counts only once written (at about 610 s): a host lost during the write loses
    // the ten minutes before it too; lost after, only the seconds since.
    for (at, lost) in [("605500", 590.0), ("615000", 0.0)] {
        let t = trace(&format!("0,add,a\n0,add,b\n{at},remove,b\n"));
        for p in [&window, &async_p] {
            let o = simulate(&t, p, Policy::CheckpointRestart).unwrap();
            assert!(o.lost_s >= lost && o.lost_s <= lost + 20.0, "{at} {:?}: {}", p.async_pause_s, o.lost_s);
        }
    }
    // Saving before a planned restart loses nothing, and pays the write.
    let t = trace("0,add,a\n0,add,b\n900000,remove,b\n");
    let saving = Params { checkpoint_on_notice: true, ..window.clone() };
    let o = simulate(&t, &saving, Policy::CheckpointRestart).unwrap();
    assert!(o.lost_s < 1e-9, "{:?}", (o.hours, o.trained, o.lost_s, o.paused_s, o.transitions));
    // A save longer than the notice cannot be made: the minute since the last checkpoint
    // was written (at about 840 s: a 240 s write) is lost.
    let slow = Params { checkpoint_write_s: 2.0 * NOTICE_S, ..saving.clone() };
    let lost = simulate(&t, &slow, Policy::CheckpointRestart).unwrap().lost_s;
    assert!((lost - 60.0).abs() < 5.0, "{lost}");
    let kill = simulate(&t, &Params { no_notice: 1.0, ..saving }, Policy::CheckpointRestart).unwrap();
    assert!(kill.lost_s > 250.0, "a kill without notice cannot save: {kill:?}");
}

#[test]
fn a_window_runs_every_policy_its_whole_length() {
    let t = trace("0,add,a\n");
    let p = Params { until_s: Some(3600.0), ..params(100.0) };
    for policy in [Policy::Limpet, Policy::CheckpointRestart, Policy::OnDemand] {
        let o = simulate(&t, &p, policy).unwrap();
        assert!((o.hours - 1.0).abs() < 1e-3 && o.trained > 100.0, "{policy:?}: {o:?}");
        assert!((o.usd_per_million - o.cost / o.trained * 1e6).abs() < 1e-9);
    }
}

#[test]
fn a_replays_founders_train_from_its_first_instant() {
    // A host at 0 and one at 10 min; boots take a minute.
    let t = trace("0,add,a\n600000,add,b\n");
    let p = Params { boot_s: 60.0, until_s: Some(1200.0), ..params(1e12) };
    let fleet = simulate(&t, &p, Policy::Limpet).unwrap();
    let replay = simulate(&t, &Params { founders_booted: true, ..p }, Policy::Limpet).unwrap();
    // The founder trains one more minute; the host added later boots all the same.
    let minute = 60.0 * params(1.0).host_rate;
    assert!(
        (replay.possible_ready - fleet.possible_ready - minute).abs() < 0.02 * minute,
        "{:?}",
        (replay.possible_ready, fleet.possible_ready, replay.trained, fleet.trained)
    );
    assert!(
        (replay.trained - fleet.trained - minute).abs() < 0.05 * minute,
        "{:?}",
        (replay.possible_ready, fleet.possible_ready, replay.trained, fleet.trained)
    );
}

#[test]
fn a_deadline_adds_on_demand_hosts_only_when_the_fleet_would_miss_it() {
    // Two spot hosts, one lost at 30 min: 20 samples/s, then 10. The job needs 1.5 h of
    // two hosts (108,000 samples).
    let t = trace("0,add,a\n0,add,b\n1800000,remove,b\n");
    let p = Params { boot_s: 60.0, ..params(108_000.0) };
    // No deadline: one host trains the rest, 2.53 h in all (the first minute boots).
    let free = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!(
        (free.hours - 2.533).abs() < 0.01 && free.fallback_host_hours == 0.0,
        "{:?}",
        (free.hours, free.trained, free.lost_s, free.paused_s, free.transitions)
    );
    // By 2 h: after the loss the fleet would miss it, and one on-demand host makes it.
    let due = Params { deadline_s: Some(2.0 * 3600.0), ..p.clone() };
    let o = simulate(&t, &due, Policy::Limpet).unwrap();
    assert!(
        o.hours <= 2.0 && o.fallback_host_hours > 0.5,
        "{:?}",
        (o.hours, o.trained, o.lost_s, o.paused_s, o.transitions)
    );
    let spot_hours = (o.billed_host_hours - o.fallback_host_hours) * p.spot_price;
    assert!(
        (o.cost - spot_hours - o.fallback_host_hours * p.on_demand_price).abs() < 1e-6,
        "{:?}",
        (o.hours, o.trained, o.lost_s, o.paused_s, o.transitions)
    );
    // A deadline the spot fleet meets alone adds nothing.
    let easy = Params { deadline_s: Some(3.0 * 3600.0), ..p.clone() };
    assert_eq!(simulate(&t, &easy, Policy::Limpet).unwrap().fallback_host_hours, 0.0);
    // Checkpoint-restart restarts for the on-demand host it adds, and still makes it.
    let c = simulate(&t, &due, Policy::CheckpointRestart).unwrap();
    assert!(
        c.hours <= 2.0 && c.fallback_host_hours >= o.fallback_host_hours,
        "{:?}",
        (c.hours, c.trained, c.lost_s, c.paused_s, c.transitions)
    );
}

#[test]
fn joins_at_one_instant_cost_limpet_one_idle_and_a_total_loss_its_unwritten_work() {
    let t = trace("0,add,a\n600000,add,b\n600000,add,c\n600000,add,d\n");
    let p = Params { until_s: Some(1200.0), state_bytes: 1e9, link_bytes_per_s: 1e9, ..params(1e12) };
    let o = simulate(&t, &p, Policy::Limpet).unwrap();
    // One epoch for the three: one fixed idle and one copy (1 s), not three.
    assert!((o.paused_s - 1.02).abs() < 1e-6 && o.transitions == 1, "{} {}", o.paused_s, o.transitions);
    // Every host lost 5 s after limpet's checkpoint at 10 min began: it was not yet
    // written (10 s), so the job goes back to the start.
    let t = trace("0,add,a\n605000,remove,a\n606000,add,b\n");
    let p = Params { until_s: Some(1200.0), checkpoint_every_s: 600.0, ..params(1e12) };
    let o = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!(o.lost_s > 600.0, "{}", o.lost_s);
    // Lost after it was written, only the seconds since.
    let t = trace("0,add,a\n620000,remove,a\n621000,add,b\n");
    let o = simulate(&t, &p, Policy::Limpet).unwrap();
    assert!(o.lost_s < 25.0, "{}", o.lost_s);
}

#[test]
fn an_empty_fleet_for_good_never_finishes() {
    let t = trace("0,add,a\n10,remove,a\n");
    assert!(simulate(&t, &Params { tick_s: 3600.0, ..params(1e9) }, Policy::Limpet).is_none());
}

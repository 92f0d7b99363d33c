//! `limpet simulate --sweep`: how the comparison moves when one assumption changes at a time
//! (the spot price ratio, scaling, the state's size, the link, revocations without notice,
//! limpet's own idle, checkpoint-restart's restart time), each row against checkpoint-restart
//! at its best for that row's assumptions and on-demand at the same fleet size.

use super::compare::{self, Breakdown};
use super::model::{simulate, Params, Policy};
use super::trace::Trace;
use crate::UsageError;
use serde::Serialize;

/// One assumption changed.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What was changed.
    pub parameter: &'static str,
    /// Its value in this row.
    pub value: String,
    /// Whether it is the assumption the plain table uses.
    pub default: bool,
    /// limpet's cost per sample over on-demand's.
    pub limpet_vs_on_demand: f64,
    /// Checkpoint-restart's (at its best for this row) over on-demand's.
    pub checkpoint_restart_vs_on_demand: f64,
    /// limpet's cost per sample over checkpoint-restart's at its best.
    pub limpet_vs_checkpoint_restart: f64,
    /// limpet's time to train over checkpoint-restart's at its best.
    pub time_vs_checkpoint_restart: f64,
    /// Checkpoint-restart's best setting.
    pub best: String,
    /// limpet against on-demand, factored.
    pub breakdown: Breakdown,
}

/// A change of one assumption: what, shown how, and the parameters with it.
type Variant = (&'static str, String, Params);

fn variants(base: &Params) -> Vec<Variant> {
    let mut v: Vec<Variant> = Vec::new();
    for r in [0.2, 0.3, 0.4, 0.5, 0.6] {
        v.push((
            "spot / on-demand price",
            format!("{r:.1}"),
            Params { spot_price: r * base.on_demand_price, ..base.clone() },
        ));
    }
    // The formula's scaling, so measured rates make way for it.
    for s in [0.8, 0.9, 0.95, 1.0] {
        v.push((
            "scaling per doubling",
            format!("{s:.2}"),
            Params { scaling: s, rates: Vec::new(), ..base.clone() },
        ));
    }
    // The state's size sets what a newcomer copies and what a checkpoint takes to write, at
    // the plain table's pace for its state.
    // (A state of no size sets no pace: the write stays.)
    let gb_now = base.state_bytes / 1e9;
    for gb in [1.0, 10.0, 100.0] {
        let write =
            if gb_now > 0.0 { base.checkpoint_write_s * gb / gb_now } else { base.checkpoint_write_s };
        v.push((
            "state (GB): copied, checkpointed",
            format!("{gb:.0}"),
            Params { state_bytes: gb * 1e9, checkpoint_write_s: write, ..base.clone() },
        ));
    }
    for s in [5.0, 10.0, 30.0, 120.0] {
        v.push(("checkpoint write (s)", format!("{s:.0}"), Params { checkpoint_write_s: s, ..base.clone() }));
    }
    for s in [0.0, 60.0, 300.0] {
        v.push(("boot of a new host (s)", format!("{s:.0}"), Params { boot_s: s, ..base.clone() }));
    }
    for gbps in [1.0, 10.0, 100.0] {
        v.push((
            "link (Gbit/s)",
            format!("{gbps:.0}"),
            Params { link_bytes_per_s: gbps * 1e9 / 8.0, ..base.clone() },
        ));
    }
    for share in [0.0, 0.05, 0.25, 1.0] {
        v.push((
            "revocations without notice",
            format!("{:.0}%", share * 100.0),
            Params { no_notice: share, ..base.clone() },
        ));
    }
    for k in [1.0, 10.0] {
        v.push((
            "limpet's idle per transition",
            format!("x{k:.0}"),
            Params {
                notice_idle_s: base.notice_idle_s * k,
                kill_recovery_s: base.kill_recovery_s * k,
                join_idle_s: base.join_idle_s * k,
                ..base.clone()
            },
        ));
    }
    for s in [30.0, 60.0, 180.0, 600.0] {
        v.push((
            "checkpoint-restart's restart (s)",
            format!("{s:.0}"),
            Params { restart_s: s, ..base.clone() },
        ));
    }
    v
}

/// Whether a variant's parameters are `base`'s in what the sweep changes.
fn same(a: &Params, b: &Params) -> bool {
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0);
    close(a.spot_price, b.spot_price)
        && close(a.checkpoint_write_s, b.checkpoint_write_s)
        && a.boot_s == b.boot_s
        && a.scaling == b.scaling
        && a.rates == b.rates
        && a.state_bytes == b.state_bytes
        && a.link_bytes_per_s == b.link_bytes_per_s
        && a.no_notice == b.no_notice
        && a.notice_idle_s == b.notice_idle_s
        && a.kill_recovery_s == b.kill_recovery_s
        && a.join_idle_s == b.join_idle_s
        && a.restart_s == b.restart_s
}

/// How many simulations [`sweep`] runs (for a progress bar).
pub fn runs(trace: &Trace, base: &Params) -> u64 {
    variants(base).iter().map(|(_, _, p)| compare::search_runs(trace, p) + 2).sum()
}

/// Every row of the sweep over `trace` around `base`; `progress` is called after each run.
pub fn sweep(
    trace: &Trace,
    base: &Params,
    async_pause_s: f64,
    progress: &dyn Fn(),
) -> Result<Vec<Row>, UsageError> {
    let never = || UsageError("the fleet never trains: the trace has no host live".into());
    let mut rows = Vec::new();
    for (parameter, value, p) in variants(base) {
        let search =
            compare::best_checkpoint_restart(trace, &p, async_pause_s, progress).ok_or_else(never)?;
        // As often as checkpoint-restart at its best, as in the plain table.
        let every = search.best.0.every_s;
        let limpet = simulate(trace, &Params { checkpoint_every_s: every, ..p.clone() }, Policy::Limpet)
            .ok_or_else(never)?;
        progress();
        let od = simulate(trace, &p, Policy::OnDemand).ok_or_else(never)?;
        progress();
        let best = &search.best.1;
        rows.push(Row {
            parameter,
            default: same(&p, base),
            value,
            limpet_vs_on_demand: limpet.usd_per_million / od.usd_per_million,
            checkpoint_restart_vs_on_demand: best.usd_per_million / od.usd_per_million,
            limpet_vs_checkpoint_restart: limpet.usd_per_million / best.usd_per_million,
            // Both ran the same window: time to train goes as one over samples trained.
            time_vs_checkpoint_restart: best.trained / limpet.trained,
            best: search.best.0.describe(),
            breakdown: compare::breakdown(&limpet, &od, &p),
        });
    }
    Ok(rows)
}

/// The sweep as a table.
pub fn render(file: &str, base: &Params, rows: &[Row]) -> String {
    let mut s = format!(
        "trace {file}: one assumption changed at a time (* the plain table's); on-demand {} hosts; \
         checkpoint-restart at its best for each row\n\n",
        base.on_demand_hosts
    );
    let mut table = crate::text::table(
        &[
            "ASSUMPTION",
            "VALUE",
            "LIMPET VS ON-DEMAND",
            "CKPT-RESTART VS ON-DEMAND",
            "LIMPET VS CKPT-RESTART",
            "TIME VS CKPT-RESTART",
            "PRICE x BOOT x SCALING x TRANSITIONS",
            "CKPT-RESTART'S BEST",
        ],
        2..6,
    );
    for r in rows {
        let b = &r.breakdown;
        table.add_row(vec![
            r.parameter.to_string(),
            format!("{}{}", r.value, if r.default { " *" } else { "" }),
            format!("{:.2}x", r.limpet_vs_on_demand),
            format!("{:.2}x", r.checkpoint_restart_vs_on_demand),
            format!("{:.2}x", r.limpet_vs_checkpoint_restart),
            format!("{:.2}x", r.time_vs_checkpoint_restart),
            format!("{:.2} x {:.3} x {:.3} x {:.4}", b.price, b.boot, b.scaling, b.transitions),
            r.best.clone(),
        ]);
    }
    s += &crate::text::lines(&table);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::test_params;

    #[test]
    fn each_row_changes_one_assumption_and_moves_the_figures_the_right_way() {
        let mut text = String::from("0,add,a\n0,add,b\n0,add,c\n");
        for (i, t) in (600..4 * 3600).step_by(600).enumerate() {
            text += &format!("{},{},c\n", t * 1000, if i % 2 == 0 { "remove" } else { "add" });
        }
        let trace = Trace::parse(&text, "t").unwrap();
        let base = Params {
            scaling: 0.95,
            kill_recovery_s: 1.343,
            no_notice: 0.05,
            join_idle_s: 0.021,
            state_bytes: 1e9,
            link_bytes_per_s: 10e9 / 8.0,
            boot_s: 60.0,
            spot_price: 0.918,
            on_demand_price: 3.06,
            on_demand_hosts: 3,
            tick_s: 1.0,
            until_s: Some(4.0 * 3600.0),
            ..test_params(1e6)
        };
        let count = std::cell::Cell::new(0u64);
        let rows = sweep(&trace, &base, 1.0, &|| count.set(count.get() + 1)).unwrap();
        assert_eq!(count.get(), runs(&trace, &base));
        assert_eq!(rows.len(), variants(&base).len());
        let of = |param: &str| rows.iter().filter(|r| r.parameter == param).collect::<Vec<_>>();
        // The price ratio carries straight through to limpet's figure.
        let price = of("spot / on-demand price");
        for r in &price {
            assert!((r.breakdown.total - r.limpet_vs_on_demand).abs() < 1e-9, "{r:?}");
        }
        assert!(price.windows(2).all(|w| w[1].limpet_vs_on_demand > w[0].limpet_vs_on_demand));
        // A slower restart only hurts checkpoint-restart; limpet's figure stays.
        let restart = of("checkpoint-restart's restart (s)");
        assert!(restart
            .windows(2)
            .all(|w| w[1].checkpoint_restart_vs_on_demand >= w[0].checkpoint_restart_vs_on_demand));
        assert!(restart
            .windows(2)
            .all(|w| (w[1].limpet_vs_on_demand - w[0].limpet_vs_on_demand).abs() < 1e-12));
        // A bigger state costs limpet's joins; more kills without notice cost its recoveries.
        let state = of("state (GB): copied, checkpointed");
        assert!(state[2].breakdown.transitions > state[0].breakdown.transitions);
        let kills = of("revocations without notice");
        assert!(kills[3].breakdown.transitions > kills[0].breakdown.transitions);
        // Exactly one row of each assumption is the plain table's.
        for param in [
            "spot / on-demand price",
            "scaling per doubling",
            "state (GB): copied, checkpointed",
            "checkpoint write (s)",
            "boot of a new host (s)",
            "link (Gbit/s)",
            "revocations without notice",
            "limpet's idle per transition",
            "checkpoint-restart's restart (s)",
        ] {
            assert_eq!(of(param).iter().filter(|r| r.default).count(), 1, "{param}");
        }
        let plain = render("t", &base, &rows);
        assert!(plain.contains("LIMPET VS CKPT-RESTART") && plain.contains("60 *"), "{plain}");
    }
}

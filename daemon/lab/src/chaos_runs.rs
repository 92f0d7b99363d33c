//! `limpet-lab chaos --runs N`: the replay's agreement with the simulation as a distribution,
//! not one run. The segments `chaos_pick` picks from the trace are each replayed as
//! `limpet-lab chaos` replays one (into `run-K-KIND/` of `--dir`), and the summary gives every
//! run's difference between replay and simulation, the worst and the median: a table,
//! `chaos-runs.json` and a plot, `chaos-runs.svg`.

use crate::chaos::{ChaosArgs, ChaosReport};
use crate::chaos_pick::{pick, Picked, RunsArgs};
use limpet_daemon::UsageError;
use serde::Serialize;
use std::path::Path;

/// One run's figures, for the summary.
#[derive(Debug, Serialize)]
pub struct RunSummary {
    /// The segment.
    pub segment: Picked,
    /// Where its replay is (`chaos.json`, `chaos.svg`, the logs).
    pub dir: String,
    /// Transitions the replay went through.
    pub transitions: usize,
    /// Steps applied twice (must be 0).
    pub steps_applied_twice: u64,
    /// The replay's goodput (trained over what the same hosts could have trained).
    pub replay_goodput: f64,
    /// The simulation's, of the same segment.
    pub simulated_goodput: f64,
    /// |replay - simulated| / simulated goodput.
    pub difference: f64,
    /// The simulation's goodput with the replay's own transition costs.
    pub simulated_goodput_measured_costs: f64,
    /// |replay - that| / that.
    pub difference_measured_costs: f64,
    /// Those costs.
    pub measured_costs: crate::chaos_measured::MeasuredCosts,
}

/// Every run and what they say together.
#[derive(Debug, Serialize)]
pub struct RunsReport {
    /// Each run, in order.
    pub runs: Vec<RunSummary>,
    /// Kinds the trace had no segment of.
    pub not_found: Vec<String>,
    /// The largest difference.
    pub worst_difference: f64,
    /// The median difference.
    pub median_difference: f64,
    /// The largest difference with each replay's own transition costs.
    pub worst_difference_measured_costs: f64,
    /// The median of those.
    pub median_difference_measured_costs: f64,
}

/// Runs `limpet-lab chaos --runs N`.
pub fn run(a: &ChaosArgs) -> limpet_daemon::Result<()> {
    let trace = &crate::chaos::prepare(a)?;
    let (segments, not_found) = pick(trace, &a.runs).map_err(UsageError)?;
    std::fs::create_dir_all(&a.dir)?;
    let mut runs = Vec::new();
    let total = segments.len();
    for (k, seg) in segments.into_iter().enumerate() {
        let dir = a.dir.join(format!("run-{}-{}", k + 1, seg.kind.name()));
        if !a.json {
            println!(
                "run {} of {}: {} ({} instants, {} hosts), trace seconds {:.0} to {:.0}",
                k + 1,
                total,
                seg.kind.name(),
                seg.instants,
                seg.hosts.len(),
                seg.from_s,
                seg.until_s
            );
        }
        let one = ChaosArgs {
            from_s: seg.from_s,
            until_s: Some(seg.until_s),
            hosts: seg.hosts.clone(),
            kill_every: seg.kind.kill_every(),
            dir: dir.clone(),
            runs: RunsArgs::default(),
            ..a.clone()
        };
        let (founders, replayed, window) = crate::chaos::segment(trace, &one)?;
        let r: ChaosReport = crate::chaos::replay(&one, &founders, &replayed, window)?;
        std::fs::write(dir.join("chaos.json"), serde_json::to_vec_pretty(&r)?)?;
        if !a.json {
            println!(
                "  {} transitions; goodput: replay {:.1}%, simulation {:.1}% ({:.1}% apart), with the replay's own transition costs {:.1}% ({:.1}% apart)",
                r.transitions.len(),
                r.replay_goodput * 100.0,
                r.simulated_goodput * 100.0,
                r.difference * 100.0,
                r.simulated_goodput_measured_costs * 100.0,
                r.difference_measured_costs * 100.0
            );
        }
        runs.push(RunSummary {
            segment: seg,
            dir: dir.display().to_string(),
            transitions: r.transitions.len(),
            steps_applied_twice: r.steps_applied_twice,
            replay_goodput: r.replay_goodput,
            simulated_goodput: r.simulated_goodput,
            difference: r.difference,
            simulated_goodput_measured_costs: r.simulated_goodput_measured_costs,
            difference_measured_costs: r.difference_measured_costs,
            measured_costs: r.measured_costs,
        });
    }
    let (worst_difference, median_difference) = spread(runs.iter().map(|r| r.difference));
    let (worst_difference_measured_costs, median_difference_measured_costs) =
        spread(runs.iter().map(|r| r.difference_measured_costs));
    let report = RunsReport {
        worst_difference,
        median_difference,
        worst_difference_measured_costs,
        median_difference_measured_costs,
        runs,
        not_found,
    };
    std::fs::write(a.dir.join("chaos-runs.json"), serde_json::to_vec_pretty(&report)?)?;
    plot(&a.dir.join("chaos-runs.svg"), &report)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
        println!("plot: {}", a.dir.join("chaos-runs.svg").display());
    }
    let twice: u64 = report.runs.iter().map(|r| r.steps_applied_twice).sum();
    if twice > 0 {
        limpet_daemon::fail!("{twice} step(s) were applied twice");
    }
    Ok(())
}

/// The largest and the median of `v` (0 for none).
fn spread(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let mut d: Vec<f64> = v.collect();
    d.sort_by(f64::total_cmp);
    (d.last().copied().unwrap_or(0.0), d.get(d.len() / 2).copied().unwrap_or(0.0))
}

fn table(r: &RunsReport) -> String {
    let mut s = format!(
        "\n{:<4} {:<8} {:>13} {:>5} {:>8} {:>11} {:>7} | {:>10} {:>6} | {:>10} {:>6}\n",
        "run",
        "kind",
        "trace s",
        "hosts",
        "instants",
        "transitions",
        "replay",
        "simulation",
        "apart",
        "own costs",
        "apart"
    );
    for (k, x) in r.runs.iter().enumerate() {
        s += &format!(
            "{:<4} {:<8} {:>13} {:>5} {:>8} {:>11} {:>6.1}% | {:>9.1}% {:>5.1}% | {:>9.1}% {:>5.1}%\n",
            k + 1,
            x.segment.kind.name(),
            format!("{:.0}-{:.0}", x.segment.from_s, x.segment.until_s),
            x.segment.hosts.len(),
            x.segment.instants,
            x.transitions,
            x.replay_goodput * 100.0,
            x.simulated_goodput * 100.0,
            x.difference * 100.0,
            x.simulated_goodput_measured_costs * 100.0,
            x.difference_measured_costs * 100.0
        );
    }
    s += &format!(
        "goodput, replay against simulation over {} runs: at most {:.1}% apart (median {:.1}%) with the cost \
         figure's transition costs, at most {:.1}% (median {:.1}%) with each replay's own\n",
        r.runs.len(),
        r.worst_difference * 100.0,
        r.median_difference * 100.0,
        r.worst_difference_measured_costs * 100.0,
        r.median_difference_measured_costs * 100.0
    );
    for m in &r.not_found {
        s += &format!("not run: {m}\n");
    }
    s
}

/// Each run's goodput, replayed and simulated, side by side.
fn plot(path: &Path, r: &RunsReport) -> limpet_daemon::Result<()> {
    use limpet_daemon::plot::{chart_on, draw_legend, draw_svg};
    use plotters::prelude::*;
    draw_svg(path, (900, 420), |root| {
        let n = r.runs.len();
        let low = r
            .runs
            .iter()
            .flat_map(|x| [x.replay_goodput, x.simulated_goodput, x.simulated_goodput_measured_costs])
            .fold(1.0, f64::min);
        let high = r
            .runs
            .iter()
            .flat_map(|x| [x.replay_goodput, x.simulated_goodput, x.simulated_goodput_measured_costs])
            .fold(1.0, f64::max);
        let floor = ((low * 10.0).floor() / 10.0).clamp(0.0, 0.9);
        let title = format!(
            "limpet-lab chaos --runs {n}: goodput at most {:.1}% apart ({:.1}% with the replays' own costs)",
            r.worst_difference * 100.0,
            r.worst_difference_measured_costs * 100.0
        );
        let mut c = chart_on(root, Some(title.as_str()), 40)
            .margin(14)
            .build_cartesian_2d(0f64..n as f64, floor..high * 1.02)?;
        let names: Vec<String> =
            r.runs.iter().enumerate().map(|(k, x)| format!("{} {}", k + 1, x.segment.kind.name())).collect();
        c.configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                let k = x.floor() as usize;
                if (x - k as f64 - 0.5).abs() < 0.01 && k < names.len() {
                    names[k].clone()
                } else {
                    String::new()
                }
            })
            .y_desc("goodput")
            .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
            .draw()?;
        let bars = |off: f64, color: RGBColor, pick: fn(&RunSummary) -> f64| {
            r.runs
                .iter()
                .enumerate()
                .map(move |(k, x)| {
                    let x0 = k as f64 + off;
                    Rectangle::new([(x0, floor), (x0 + 0.25, pick(x))], color.filled())
                })
                .collect::<Vec<_>>()
        };
        c.draw_series(bars(0.1, RED, |x| x.replay_goodput))?
            .label("replay")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], RED.filled()));
        c.draw_series(bars(0.375, GREEN, |x| x.simulated_goodput))?
            .label("simulation, the cost figure's transition costs")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], GREEN.filled()));
        c.draw_series(bars(0.65, BLUE, |x| x.simulated_goodput_measured_costs))?
            .label("simulation, the replay's own transition costs")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], BLUE.filled()));
        draw_legend(&mut c, SeriesLabelPosition::LowerRight)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos_pick::Kind;
    use clap::Parser;
    use limpet_daemon::simulate::trace::{load_as, Format, Trace};
    use std::collections::BTreeSet;

    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        chaos: ChaosArgs,
    }

    /// What `chaos` replays of a picked segment (uncompressed).
    fn replayed(trace: &Trace, p: &Picked) -> (Vec<String>, Trace) {
        let (from, until) = (p.from_s.to_string(), p.until_s.to_string());
        let (hosts, every) = (p.hosts.join(","), p.kind.kill_every().to_string());
        let args = ["x", "--dir", "d", "--speedup", "1", "--from-s", &from, "--until-s", &until];
        let line = Line::try_parse_from(args.into_iter().chain(["--hosts", &hosts, "--kill-every", &every]))
            .unwrap();
        let (founders, seg, _) = crate::chaos::segment(trace, &line.chaos).unwrap();
        (founders, seg)
    }

    #[test]
    fn what_is_replayed_of_a_picked_segment_is_what_it_was_picked_for() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
        let bamboo = dir.join("bamboo-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530.csv");
        let traces = [
            limpet_daemon::simulate::trace::load(None).unwrap().0,
            load_as(Some(&bamboo), Format::CountsHours).unwrap().0,
        ];
        for trace in &traces {
            let (picked, _) = pick(trace, &RunsArgs { runs: Some(8), ..RunsArgs::default() }).unwrap();
            assert!(picked.len() >= 4, "{picked:?}");
            for p in &picked {
                let (founders, seg) = replayed(trace, p);
                // The hosts live throughout found the cluster.
                assert!(p.hosts[..3].iter().all(|h| founders.contains(h)), "{p:?}: {founders:?}");
                let events: Vec<_> = seg.events.iter().filter(|e| e.at_ms > 0).collect();
                let instants: BTreeSet<u64> = events.iter().map(|e| e.at_ms).collect();
                assert_eq!(instants.len(), p.instants, "{p:?}");
                let (adds, removes) = (events.iter().any(|e| e.add), events.iter().any(|e| !e.add));
                match p.kind {
                    Kind::Notices | Kind::Kills => assert!(removes && !adds, "{p:?}"),
                    Kind::Joins => assert!(adds && !removes, "{p:?}"),
                    Kind::Many | Kind::Mixed => assert!(!events.is_empty(), "{p:?}"),
                }
                // Nothing in the lead: the cluster trains a minute first.
                assert!(events.iter().all(|e| e.at_ms >= 60_000), "{p:?}");
            }
        }
    }
}

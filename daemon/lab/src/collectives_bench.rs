//! `limpet-lab bench collectives`: the data plane's collectives against the world size, up
//! to a thousand ranks in one process (one thread and one endpoint per rank, real TCP on
//! loopback). Each size is timed twice on the same ranks in the same run: as the group picks
//! (the butterfly's log2(W) rounds for small buffers in groups of 8 or more, the ring
//! otherwise) and on the ring alone, so what the butterfly buys is measured, not argued.
//!
//! All ranks share this machine's cores, where a fleet's hosts each have their own: the
//! figures count every rank's CPU and copies on the same cores, so they bound a fleet's from
//! above, and more so for large buffers, whose bytes one machine copies for every rank.
//!
//! With `--zones Z` the ranks lie in Z zones (contiguous in rank order) and every link
//! between two zones goes through a relay that delays it by `--zone-delay-ms` each way
//! and caps it at `--zone-mbit` (`delay_relay.rs`): as picked, large reductions then take the two levels (a ring inside
//! each zone, one across), against the flat ring whose every step waits on a slow link.

use anyhow::Context;
use clap::Args;
use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, Endpoint, Group};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `limpet-lab bench collectives`.
#[derive(Debug, Args)]
pub struct BenchCollectivesArgs {
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256,1024")]
    pub ranks: Vec<usize>,
    /// Allreduce sizes per rank (K, M and G suffixes), comma-separated; a barrier is always
    /// timed.
    #[arg(long, value_delimiter = ',', default_value = "4K,1M,64M")]
    pub sizes: Vec<String>,
    /// Skip a size at a world whose buffers would take more than this many GiB in all.
    #[arg(long, default_value_t = 6)]
    pub memory_gib: u64,
    /// Timed repetitions of a collective moving at most 64 KiB up to 64 ranks (fewer for
    /// larger buffers and worlds, in proportion past 64 ranks).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// One JSON object per (world, size, algorithm), one a line, instead of the table.
    #[arg(long)]
    pub json: bool,
    /// An SVG of each figure against the world size.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Zones the ranks lie in (contiguous in rank order): 1 for one network, 2 or more for
    /// the two levels against the flat ring.
    #[arg(long, default_value_t = 1)]
    pub zones: usize,
    /// One-way delay of every link between two zones, in milliseconds (with `--zones`).
    #[arg(long, default_value_t = 1.0)]
    pub zone_delay_ms: f64,
    /// Each connection's rate between two zones, Mbit/s each way (0: unlimited; with
    /// `--zones`).
    #[arg(long, default_value_t = 0)]
    pub zone_mbit: u64,
}

/// One timed collective (`--json` prints one a line).
#[derive(Clone, Debug, Serialize)]
pub struct CollectiveRow {
    /// Ranks.
    pub ranks: usize,
    /// `barrier` or `allreduce`.
    pub op: &'static str,
    /// Bytes per rank.
    pub bytes: usize,
    /// `auto` (what the group picks) or `ring` (the ring alone).
    pub mode: &'static str,
    /// What ran: `tree`, `levels` (inside and across zones) or `ring`.
    pub algorithm: &'static str,
    /// Zones the ranks lay in.
    pub zones: usize,
    /// One-way delay between zones, ms (0 within one zone).
    pub zone_delay_ms: f64,
    /// Each connection's rate between zones, Mbit/s (0: unlimited).
    pub zone_mbit: u64,
    /// Mean milliseconds per collective over the timed repetitions.
    pub ms: f64,
    /// Repetitions timed.
    pub iters: usize,
}

/// Runs the benchmark.
pub fn run(a: BenchCollectivesArgs) -> limpet_daemon::Result<()> {
    let mut sizes = Vec::new();
    for s in &a.sizes {
        sizes.push(crate::dp_cmd::parse_size(s)?);
    }
    if a.ranks.iter().any(|&w| !(2..=4096).contains(&w)) {
        return Err(limpet_daemon::UsageError(format!("--ranks {:?}: each from 2 to 4096", a.ranks)).into());
    }
    if a.zones == 0 || a.ranks.iter().any(|&w| w < a.zones) {
        return Err(limpet_daemon::UsageError(format!(
            "--zones {}: from 1 to the smallest world of --ranks {:?}",
            a.zones, a.ranks
        ))
        .into());
    }
    if !(0.0..=1000.0).contains(&a.zone_delay_ms) {
        return Err(limpet_daemon::UsageError(format!(
            "--zone-delay-ms {}: from 0 to 1000",
            a.zone_delay_ms
        ))
        .into());
    }
    let delay = if a.zones > 1 { Duration::from_secs_f64(a.zone_delay_ms / 1e3) } else { Duration::ZERO };
    let link = (delay, if a.zones > 1 { a.zone_mbit } else { 0 });
    check_fd_limit(&a.ranks, a.zones)?;
    let mut rows = Vec::new();
    for &w in &a.ranks {
        let keep: Vec<usize> =
            sizes.iter().copied().filter(|&b| (w as u64) * (b as u64) * 3 <= a.memory_gib << 30).collect();
        for &b in sizes.iter().filter(|b| !keep.contains(b)) {
            eprintln!(
                "bench collectives: {w} ranks x {b} bytes skipped (past --memory-gib {})",
                a.memory_gib
            );
        }
        eprintln!("bench collectives: {w} ranks ...");
        let started = Instant::now();
        let got = world(w, &keep, a.iters, (a.zones, link)).with_context(|| format!("{w} ranks"))?;
        eprintln!("bench collectives: {w} ranks done in {:.1} s", started.elapsed().as_secs_f64());
        if !a.json {
            for r in &got {
                eprintln!(
                    "  {:>9} {:>9} B {:>5} ({:>6}) {:>10.3} ms",
                    r.op, r.bytes, r.mode, r.algorithm, r.ms
                );
            }
        }
        rows.extend(got);
    }
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r).context("encoding a row")?);
        }
    } else {
        print_table(&rows);
    }
    if let Some(path) = &a.plot {
        plot(path, &rows)?;
        eprintln!("bench collectives: plot in {}", path.display());
    }
    Ok(())
}

/// The collectives of one world size: every rank's thread forms the group (ring, butterfly
/// and, across zones, two levels) and a ring-only group beside it, then times each
/// collective in both.
fn world(
    w: usize,
    sizes: &[usize],
    iters: usize,
    (zones, (delay, mbit)): (usize, (Duration, u64)),
) -> anyhow::Result<Vec<CollectiveRow>> {
    let secret = b"bench-collectives-secret-0123456".to_vec();
    let eps = (0..w as u64)
        .map(|n| {
            let mut cfg = DataPlaneConfig::new(0xc011, n + 1, secret.clone());
            // Every rank's work shares two cores: a rank may wait long on the others.
            cfg.timeout = Duration::from_secs(300);
            Endpoint::bind("127.0.0.1:0".parse().expect("an address"), cfg).context("binding an endpoint")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ranks: Vec<u64> = (1..=w as u64).collect();
    let zone_of: Vec<String> = (0..w).map(|i| format!("zone-{}", i * zones / w)).collect();
    // Each zone's view of the others' addresses: a relay of the delay per rank of another
    // zone, the rank itself within its own.
    let mut views: Vec<Vec<String>> = Vec::new();
    // Kept until the world's ranks are done, then stopped.
    let mut relays = Vec::new();
    for z in 0..zones {
        let mut view = Vec::with_capacity(w);
        for (i, ep) in eps.iter().enumerate() {
            if i * zones / w == z || zones == 1 {
                view.push(ep.addr().to_string());
            } else {
                let relay = crate::delay_relay::DelayRelay::start(ep.addr(), delay, mbit * 125_000)
                    .context("starting a relay")?;
                view.push(relay.addr().to_string());
                relays.push(relay);
            }
        }
        views.push(view);
    }
    let results = std::thread::scope(|s| {
        let handles = eps
            .iter()
            .enumerate()
            .map(|(rank, ep)| {
                let (ranks, addrs, zone_of) = (&ranks, &views[rank * zones / w], &zone_of);
                std::thread::Builder::new().stack_size(512 << 10).spawn_scoped(s, move || {
                    rank_work(ep, rank, (ranks, addrs, zone_of), sizes, iters, (delay, mbit))
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .context("spawning a rank's thread")?;
        let mut out = Vec::new();
        for h in handles {
            out.push(h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??);
        }
        anyhow::Ok(out)
    })?;
    Ok(results.into_iter().next().unwrap_or_default())
}

/// One rank's part; rank 0's timings are the figures (a collective ends at about the same
/// time on every rank, as none can end before the last rank's values reached it).
fn rank_work(
    ep: &Endpoint,
    rank: usize,
    (ranks, addrs, zone_of): (&[u64], &[String], &[String]),
    sizes: &[usize],
    iters: usize,
    (delay, zone_mbit): (Duration, u64),
) -> anyhow::Result<Vec<CollectiveRow>> {
    let w = ranks.len();
    let by = Instant::now() + Duration::from_secs(300);
    let mut auto = ep.group_until(1, ranks, addrs, by, &|| false)?;
    auto.connect_levels(ep, addrs, zone_of, (by, &|| false))?;
    let zones = limpet_agent::dataplane::ring::zone_members(zone_of).len();
    let (right, left) = Group::neighbours(ep, ranks, addrs)?;
    let (right, left) = (right.expect("a world of two or more"), left.expect("a world of two or more"));
    let out = ep.connect_until(&addrs[right], ranks[right], 2, Channel::Ring, by, &|| false)?;
    let inc = ep.accept_until(ranks[left], 2, Channel::Ring, by, &|| false)?;
    let mut ring = Group::assemble(ep, 2, ranks, Some(out), Some(inc))?;
    let mut rows = Vec::new();
    let mut ops: Vec<(&'static str, usize)> = vec![("barrier", 4)];
    ops.extend(sizes.iter().map(|&b| ("allreduce", b)));
    let mut step = 0;
    for (op, bytes) in ops {
        let n = (bytes / 4).max(1);
        // Fewer repetitions as the world grows: the ring alone takes seconds a collective at
        // a thousand ranks in one process.
        let reps = if bytes <= 64 << 10 { iters } else { (iters / 4).clamp(1, 5) };
        let reps = (reps * 64 / w.max(64)).max(1);
        let mut buf = vec![1.0f32; n];
        for (mode, g) in [("auto", &mut auto), ("ring", &mut ring)] {
            let algorithm = match (g.picks_tree(bytes), g.has_levels()) {
                (true, _) => "tree",
                (false, true) => "levels",
                (false, false) => "ring",
            };
            let mut once = |g: &mut Group, step: u64| match op {
                "barrier" => g.barrier(step),
                _ => g.allreduce_sum(&mut buf, step),
            };
            // One untimed, so every rank starts the timed ones together.
            once(g, step)?;
            step += 1;
            let t = Instant::now();
            for _ in 0..reps {
                once(g, step)?;
                step += 1;
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            if rank == 0 {
                let zone_delay_ms = delay.as_secs_f64() * 1e3;
                rows.push(CollectiveRow {
                    ranks: w,
                    op,
                    bytes,
                    mode,
                    algorithm,
                    zones,
                    zone_delay_ms,
                    zone_mbit,
                    ms,
                    iters: reps,
                });
            }
        }
    }
    Ok(rows)
}

/// A thousand ranks hold about 14 sockets each, and across zones four more for the levels and
/// about as many again in the relays (a listener per rank and other zone, two sockets per
/// connection through one): a soft limit below what the worlds need is named before anything
/// starts.
fn check_fd_limit(ranks: &[usize], zones: usize) -> limpet_daemon::Result<()> {
    let most = ranks.iter().max().copied().unwrap_or(0);
    let need = most * 16 + 256 + if zones > 1 { most * (zones - 1 + 24) } else { 0 };
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<usize>().ok());
    match soft {
        Some(have) if have < need => Err(limpet_daemon::UsageError(format!(
            "--ranks {}: about {need} open files are needed and the limit is {have} (raise it with `ulimit -n {need}`)",
            ranks.iter().max().unwrap_or(&0)
        ))
        .into()),
        _ => Ok(()),
    }
}

fn print_table(rows: &[CollectiveRow]) {
    println!(
        "{:>6} {:>5} {:>9} {:>10} {:>5} {:>6} {:>11}",
        "RANKS", "ZONES", "OP", "BYTES", "MODE", "ALG", "MS"
    );
    for r in rows {
        println!(
            "{:>6} {:>5} {:>9} {:>10} {:>5} {:>6} {:>11.3}",
            r.ranks, r.zones, r.op, r.bytes, r.mode, r.algorithm, r.ms
        );
    }
}

/// Milliseconds per collective against the world size, both axes logarithmic: one line per
/// collective as the group picks (thick) and on the ring alone (thin).
fn plot(path: &Path, rows: &[CollectiveRow]) -> limpet_daemon::Result<()> {
    use limpet_daemon::plot::{chart_on, draw_legend, draw_svg, legend_line};
    use plotters::prelude::*;
    // A line's name, points, colour and whether it is the ring alone's (drawn thin).
    type Line = (String, Vec<(f64, f64)>, RGBColor, bool);
    let mut series: Vec<Line> = Vec::new();
    let palette = [BLUE, RED, GREEN, MAGENTA, BLACK, CYAN];
    let mut kinds: Vec<(&str, usize)> = rows.iter().map(|r| (r.op, r.bytes)).collect();
    kinds.dedup();
    kinds.sort();
    kinds.dedup();
    for (i, (op, bytes)) in kinds.iter().enumerate() {
        for (mode, thin) in [("auto", false), ("ring", true)] {
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.op == *op && r.bytes == *bytes && r.mode == mode)
                .map(|r| (r.ranks as f64, r.ms.max(1e-3)))
                .collect();
            let what =
                if *op == "barrier" { "barrier".to_string() } else { format!("{} allreduce", human(*bytes)) };
            let name = if thin { format!("{what}, ring alone") } else { format!("{what}, as picked") };
            series.push((name, pts, palette[i % palette.len()], thin));
        }
    }
    let x_max = rows.iter().map(|r| r.ranks).max().unwrap_or(2) as f64 * 1.3;
    let y_max = rows.iter().map(|r| r.ms).fold(1.0, f64::max) * 2.0;
    let y_min = rows.iter().map(|r| r.ms.max(1e-3)).fold(f64::INFINITY, f64::min).min(1.0) / 2.0;
    draw_svg(path, (900, 520), |root| {
        let mut chart =
            chart_on(root, Some("collectives against the world size (one process, loopback)"), 40)
                .build_cartesian_2d((1.5..x_max).log_scale(), (y_min..y_max).log_scale())?;
        chart.configure_mesh().x_desc("ranks").y_desc("ms per collective").draw()?;
        for (name, pts, colour, thin) in series {
            let style = if thin { colour.stroke_width(1) } else { colour.stroke_width(3) };
            chart.draw_series(LineSeries::new(pts.clone(), style))?.label(name).legend(legend_line(colour));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        Ok(())
    })
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

//! `limpet-lab bench allreduce`: the ring's allreduce timed in `dp-worker` processes on loopback,
//! next to the same sizes through torch.distributed's gloo backend, and the report.

use super::{congestion_arg, spawn_workers, Workers};
use crate::raft_cmd::free_port;
use crate::stats::median;
use anyhow::Context;
use clap::Args;
use limpet_daemon::UsageError;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `limpet-lab bench allreduce`.
#[derive(Debug, Args)]
pub struct BenchAllreduceArgs {
    /// Ranks (processes).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub world: u64,
    /// Buffer sizes in bytes (K, M, G suffixes are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "4K,256K,4M,16M,64M")]
    pub sizes: Vec<String>,
    /// Skip the gloo comparison.
    #[arg(long)]
    pub no_gloo: bool,
    /// Rounds of (limpet, gloo), alternating; each size reports the median round.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also measure the ring over TLS 1.3 (certificates made for the run), in the same
    /// rounds: what encrypting the data plane costs.
    #[arg(long)]
    pub tls: bool,
    /// TCP congestion control of limpet's sockets, or `system` for the host's default (gloo
    /// always runs with the host's default).
    #[arg(long, default_value = limpet_agent::dataplane::endpoint::DEFAULT_CONGESTION)]
    pub congestion: String,
    /// Also measure the ring sending bfloat16 (`[job].reduce_dtype = "bf16"`), in the same
    /// rounds: half the bytes, a conversion at each hop.
    #[arg(long)]
    pub bf16: bool,
}

/// Per size, the median of several rounds' timings.
fn median_times(rounds: &[Vec<(usize, f64)>]) -> Vec<(usize, f64)> {
    (0..rounds[0].len()).map(|i| (rounds[0][i].0, median(rounds.iter().map(|r| r[i].1).collect()))).collect()
}

/// Parses `4K`, `16M`, `1G` or plain byte counts.
pub fn parse_size(s: &str) -> Result<usize, UsageError> {
    let bytes = limpet_daemon::args::parse_bytes(s).map_err(|e| UsageError(format!("size {e}")))? as usize;
    if bytes % 4 != 0 {
        return Err(UsageError(format!("size {s:?} is not a positive multiple of 4 bytes (f32)")));
    }
    Ok(bytes)
}

fn iterations(bytes: usize) -> u64 {
    ((256usize << 20) / bytes).clamp(5, 400) as u64
}

/// One size's measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Measurement {
    /// Seconds per allreduce.
    pub seconds: f64,
    /// Bytes / seconds, GB/s.
    pub algbw_gbps: f64,
    /// algbw x 2(N-1)/N, GB/s.
    pub busbw_gbps: f64,
}

/// One row of the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizeReport {
    /// Buffer bytes.
    pub bytes: usize,
    /// limpet's ring.
    pub limpet: Measurement,
    /// gloo, when measured.
    pub gloo: Option<Measurement>,
    /// limpet busbw / gloo busbw (for 4 KB, compare times: gloo time / limpet time is the same number).
    pub ratio: Option<f64>,
    /// limpet's ring over TLS, when measured.
    pub limpet_tls: Option<Measurement>,
    /// limpet's ring with the host's default congestion control (gloo's), when that differs
    /// from limpet's: the comparison with gloo on equal TCP settings.
    pub limpet_host_congestion: Option<Measurement>,
    /// gloo time / that ring's time.
    pub ratio_host_congestion: Option<f64>,
    /// limpet's ring sending bfloat16, when measured (the f32 buffer's size and bandwidths).
    pub limpet_bf16: Option<Measurement>,
}

fn measurement(bytes: usize, seconds: f64, world: u64) -> Measurement {
    let algbw = bytes as f64 / seconds / 1e9;
    let busbw = if world > 1 { algbw * 2.0 * (world - 1) as f64 / world as f64 } else { algbw };
    Measurement { seconds, algbw_gbps: algbw, busbw_gbps: busbw }
}

fn rank0_times(workers: Workers) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let mut workers = workers;
    let mut out = None;
    for (i, c) in workers.children.iter_mut().enumerate() {
        let mut stdout = String::new();
        std::io::Read::read_to_string(c.stdout.as_mut().expect("piped"), &mut stdout)?;
        let status = c.wait()?;
        if !status.success() {
            limpet_daemon::fail!("worker {i} failed ({status})");
        }
        if i == 0 {
            out = Some(stdout);
        }
    }
    parse_times(&out.unwrap_or_default())
}

fn parse_times(json: &str) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).with_context(|| format!("timing output {json:?}"))?;
    let sizes = v["sizes"].as_array().context("timing output without sizes")?;
    sizes
        .iter()
        .map(|s| {
            Ok((s["bytes"].as_u64().context("bytes")? as usize, s["seconds"].as_f64().context("seconds")?))
        })
        .collect()
}

/// The Python interpreter of the setup's venv: `LIMPET_PYTHON`, else the clone's
/// `.limpet/python` wrapper (found from the working directory or from this executable in
/// `target/<profile>/`).
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("LIMPET_PYTHON") {
        return PathBuf::from(p);
    }
    let mut bases = vec![PathBuf::from(".")];
    if let Ok(exe) = std::env::current_exe() {
        bases.extend(exe.ancestors().skip(1).take(4).map(std::path::Path::to_path_buf));
    }
    bases
        .iter()
        .map(|b| b.join(".limpet/python"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

fn gloo_times(world: u64, plan: &[(usize, u64)]) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("gloo_allreduce.py");
    std::fs::write(&script, include_str!("../../../../bench/gloo_allreduce.py"))?;
    let py = python();
    let out = Command::new(&py)
        .arg(&script)
        .arg(world.to_string())
        .arg(free_port()?.to_string())
        .args(plan.iter().map(|(b, i)| format!("{b}:{i}")))
        .env("OMP_NUM_THREADS", "1")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} (set LIMPET_PYTHON, or run `make setup`)", py.display()))?;
    if !out.status.success() {
        limpet_daemon::fail!("the gloo benchmark failed ({})", out.status);
    }
    parse_times(&String::from_utf8_lossy(&out.stdout))
}

/// Runs the benchmark.
pub fn bench_allreduce(args: BenchAllreduceArgs) -> limpet_daemon::Result<()> {
    let sizes: Vec<usize> = args.sizes.iter().map(|s| parse_size(s)).collect::<Result<_, _>>()?;
    let host_cc = limpet_agent::dataplane::endpoint::host_congestion();
    let ours_cc = congestion_arg(&args.congestion)?.unwrap_or_else(|| host_cc.clone());
    let plan: Vec<(usize, u64)> = sizes.iter().map(|&b| (b, iterations(b))).collect();
    let plan_arg = plan.iter().map(|(b, i)| format!("{b}:{i}")).collect::<Vec<_>>().join(",");
    let exe = std::env::current_exe()?;
    let order: Vec<u64> = (1..=args.world).collect();
    let spinner = indicatif::ProgressBar::new_spinner();
    if args.json {
        spinner.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner.set_message(format!("limpet ring allreduce, {} processes", args.world));
    // Alternate the two so that drift in the machine's state affects both alike.
    let (mut ours_rounds, mut theirs_rounds, mut tls_rounds) = (Vec::new(), Vec::new(), Vec::new());
    let mut bf16_rounds = Vec::new();
    // When limpet's sockets use another algorithm than the host's default (which gloo
    // gets), the ring also runs with the host's default in the same rounds, so the report
    // shows the comparison on equal TCP settings too.
    let also_host = ours_cc != host_cc;
    let mut host_rounds = Vec::new();
    let certs = tempfile::tempdir()?;
    if args.tls {
        bench_certs(certs.path(), &order)?;
    }
    for round in 1..=args.rounds {
        spinner.set_message(format!(
            "round {round}/{}: limpet ring allreduce, {} processes",
            args.rounds, args.world
        ));
        let base =
            ["--mode", "bench", "--plan", plan_arg.as_str(), "--timeout-ms", "30000"].map(String::from);
        let with_cc = |cc: &str| [&base[..], &["--congestion".to_string(), cc.to_string()]].concat();
        let worker_args = with_cc(&args.congestion);
        ours_rounds.push(rank0_times(spawn_workers(&exe, &order, &worker_args)?)?);
        if also_host {
            spinner.set_message(format!(
                "round {round}/{}: limpet ring allreduce with the host's congestion control ({host_cc}), {} processes",
                args.rounds, args.world
            ));
            host_rounds.push(rank0_times(spawn_workers(&exe, &order, &with_cc("system"))?)?);
        }
        if args.tls {
            spinner.set_message(format!(
                "round {round}/{}: limpet ring allreduce over TLS, {} processes",
                args.rounds, args.world
            ));
            let mut with_tls = worker_args.to_vec();
            with_tls.extend(["--tls-dir".to_string(), certs.path().display().to_string()]);
            tls_rounds.push(rank0_times(spawn_workers(&exe, &order, &with_tls)?)?);
        }
        if args.bf16 {
            spinner.set_message(format!(
                "round {round}/{}: limpet ring allreduce in bfloat16, {} processes",
                args.rounds, args.world
            ));
            let mut with_bf16 = worker_args.to_vec();
            with_bf16.push("--bf16".to_string());
            bf16_rounds.push(rank0_times(spawn_workers(&exe, &order, &with_bf16)?)?);
        }
        if !args.no_gloo {
            spinner.set_message(format!(
                "round {round}/{}: gloo allreduce (torch.distributed), {} processes",
                args.rounds, args.world
            ));
            theirs_rounds.push(gloo_times(args.world, &plan)?);
        }
    }
    let ours = median_times(&ours_rounds);
    let theirs = (!args.no_gloo).then(|| median_times(&theirs_rounds));
    let tls = args.tls.then(|| median_times(&tls_rounds));
    let host = also_host.then(|| median_times(&host_rounds));
    let bf16 = args.bf16.then(|| median_times(&bf16_rounds));
    spinner.finish_and_clear();
    let mut rows = size_rows(args.world, &ours, theirs.as_deref(), tls.as_deref(), host.as_deref());
    if let Some(b) = &bf16 {
        for (row, &(_, secs)) in rows.iter_mut().zip(b) {
            row.limpet_bf16 = Some(measurement(row.bytes, secs, args.world));
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "world": args.world, "sizes": rows,
                "congestion": {"limpet": ours_cc, "host_default": host_cc},
            }))?
        );
        return Ok(());
    }
    print_allreduce(&args, &rows, (&ours_cc, &host_cc))
}

/// A one-day CA and a certificate for each worker `n<id>`.
fn bench_certs(dir: &std::path::Path, order: &[u64]) -> limpet_daemon::Result<()> {
    limpet_daemon::certs::init(dir, "bench", 1)?;
    for n in order {
        limpet_daemon::certs::issue_for_days(dir, &format!("n{n}"), limpet_daemon::certs::Kind::Node(*n), 1)?;
    }
    Ok(())
}

/// One row per size: limpet's median time against gloo's, over TLS and with the host's
/// congestion control where those were measured.
fn size_rows(
    world: u64,
    ours: &[(usize, f64)],
    theirs: Option<&[(usize, f64)]>,
    tls: Option<&[(usize, f64)]>,
    host: Option<&[(usize, f64)]>,
) -> Vec<SizeReport> {
    ours.iter()
        .enumerate()
        .map(|(i, &(bytes, secs))| {
            let limpet = measurement(bytes, secs, world);
            let gloo = theirs.map(|t| measurement(bytes, t[i].1, world));
            let ratio = gloo.as_ref().map(|g| g.seconds / limpet.seconds);
            let limpet_tls = tls.map(|t| measurement(bytes, t[i].1, world));
            let limpet_host_congestion = host.map(|t| measurement(bytes, t[i].1, world));
            let ratio_host_congestion =
                gloo.as_ref().zip(limpet_host_congestion.as_ref()).map(|(g, h)| g.seconds / h.seconds);
            SizeReport {
                bytes,
                limpet,
                gloo,
                ratio,
                limpet_tls,
                limpet_host_congestion,
                ratio_host_congestion,
                limpet_bf16: None,
            }
        })
        .collect()
}

/// The allreduce table, then limpet with the host's congestion control and over TLS where
/// those were measured.
fn print_allreduce(
    args: &BenchAllreduceArgs,
    rows: &[SizeReport],
    (ours_cc, host_cc): (&str, &str),
) -> limpet_daemon::Result<()> {
    let also_host = ours_cc != host_cc;
    println!(
        "allreduce (sum, f32), world {}, loopback; busbw = algbw x 2(N-1)/N; median of {} round(s)",
        args.world, args.rounds
    );
    println!(
        "TCP congestion control: limpet {ours_cc}, gloo the host's default ({host_cc}){}",
        if also_host { "; limpet with the host's default is measured too, below" } else { "" }
    );
    println!(
        "{:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>6}",
        "size", "limpet", "algbw", "busbw", "gloo", "algbw", "busbw", "ratio"
    );
    for r in rows {
        let g = r.gloo.as_ref();
        println!(
            "{:>8} | {:>10} {:>8.3} {:>8.3} | {:>10} {:>8} {:>8} | {:>6}",
            human(r.bytes),
            time(r.limpet.seconds),
            r.limpet.algbw_gbps,
            r.limpet.busbw_gbps,
            g.map_or("-".into(), |g| time(g.seconds)),
            g.map_or("-".into(), |g| format!("{:.3}", g.algbw_gbps)),
            g.map_or("-".into(), |g| format!("{:.3}", g.busbw_gbps)),
            r.ratio.map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
    println!("bandwidths in GB/s; ratio = gloo time / limpet time (above 1: limpet is faster)");
    if also_host {
        println!("\nlimpet's ring with the host's congestion control ({host_cc}, as gloo), same rounds:");
        println!(
            "{:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>6}",
            "size", "limpet", "busbw", "gloo", "busbw", "ratio"
        );
        for r in rows {
            let Some(h) = &r.limpet_host_congestion else { continue };
            let g = r.gloo.as_ref();
            println!(
                "{:>8} | {:>10} {:>8.3} | {:>10} {:>8} | {:>6}",
                human(r.bytes),
                time(h.seconds),
                h.busbw_gbps,
                g.map_or("-".into(), |g| time(g.seconds)),
                g.map_or("-".into(), |g| format!("{:.3}", g.busbw_gbps)),
                r.ratio_host_congestion.map_or("-".into(), |x| format!("{x:.2}x")),
            );
        }
    }
    if args.bf16 {
        println!("\nthe same ring sending bfloat16 (summed in f32 at each rank), same rounds; sizes are the f32 buffer's:");
        println!(
            "{:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>9}",
            "size", "f32", "busbw", "bf16", "busbw", "f32/bf16"
        );
        for r in rows {
            let Some(b) = &r.limpet_bf16 else { continue };
            println!(
                "{:>8} | {:>10} {:>8.3} | {:>10} {:>8.3} | {:>8.2}x",
                human(r.bytes),
                time(r.limpet.seconds),
                r.limpet.busbw_gbps,
                time(b.seconds),
                b.busbw_gbps,
                r.limpet.seconds / b.seconds
            );
        }
    }
    if args.tls {
        println!("\nthe same ring over TLS 1.3 (node certificates both ways), same rounds:");
        println!(
            "{:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>9}",
            "size", "plain", "busbw", "TLS", "busbw", "TLS/plain"
        );
        for r in rows {
            let Some(t) = &r.limpet_tls else { continue };
            println!(
                "{:>8} | {:>10} {:>8.3} | {:>10} {:>8.3} | {:>8.0}%",
                human(r.bytes),
                time(r.limpet.seconds),
                r.limpet.busbw_gbps,
                time(t.seconds),
                t.busbw_gbps,
                100.0 * t.busbw_gbps / r.limpet.busbw_gbps
            );
        }
    }
    Ok(())
}

pub(super) fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

fn time(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

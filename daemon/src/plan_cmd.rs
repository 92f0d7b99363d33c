//! `limpet plan`: profiles the model's blocks on this host, measures the loopback link, and
//! prints the data x pipeline layout the planner chooses for the given hosts, with its
//! predicted step time and the runners-up.

use crate::args::{parse_bytes, JobArgs};
use crate::UsageError;
use anyhow::Context;
use clap::Args;
use limpet_agent::planner::{self, HostLayout, HostSpec, Link, ModelProfile, Plan, PlanInput};
use limpet_trainer::JobSpec;
use serde::Serialize;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Instant;

/// `limpet plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The job (model, data, batch).
    #[command(flatten)]
    pub job: JobArgs,
    /// Hosts: a count of hosts like this one, or comma-separated `[COUNTx]SPEED[:MEMORY]`
    /// groups, e.g. `2x1.0:8G,2x0.5:4G` (speed relative to this host; memory with K, M, G or
    /// T; default memory 16G).
    #[arg(long, default_value = "4")]
    pub hosts: String,
    /// Link bandwidth in GB/s [default: measured on loopback].
    #[arg(long)]
    pub link_gbps: Option<f64>,
    /// One-way link latency in ms [default: measured on loopback].
    #[arg(long)]
    pub latency_ms: Option<f64>,
    /// Deepest pipeline to consider.
    #[arg(long)]
    pub max_depth: Option<usize>,
    /// Devices (local ranks) on every host, each a replica of its host's stage, as `limpetd`
    /// trains a pipeline with `[node].devices` (at most 8 a host): the micro-batch, memory and
    /// times are one device's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    pub devices: u16,
    /// Predict this layout instead of searching: `START..END@HOST,...|...`.
    #[arg(long)]
    pub layout: Option<String>,
    /// Read the block profile from this file instead of measuring.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Write the measured block profile to this file.
    #[arg(long, value_name = "FILE")]
    pub save_profile: Option<PathBuf>,
    /// Repetitions of each block measurement (the median is kept).
    #[arg(long, default_value_t = 7)]
    pub reps: usize,
    /// How many runner-up layouts to print.
    #[arg(long, default_value_t = 4)]
    pub runners_up: usize,
    /// Print the input and the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

fn usage(msg: impl Into<String>) -> crate::Failure {
    UsageError(msg.into()).into()
}

/// The most hosts `--hosts` describes (the planner searches at most a few dozen groups).
const MAX_HOSTS: usize = 4096;

/// Parses `--hosts`: `N`, or `[COUNTx]SPEED[:MEMORY]` groups joined by commas. Hosts are
/// named `h0`, `h1`, ... in the order given.
pub fn parse_hosts(spec: &str) -> Result<Vec<HostSpec>, String> {
    const DEFAULT_MEM: u64 = 16 << 30;
    if let Ok(n) = spec.trim().parse::<usize>() {
        if n == 0 {
            return Err("--hosts 0: at least one host is needed".into());
        }
        if n > MAX_HOSTS {
            return Err(format!("--hosts {n}: at most {MAX_HOSTS}"));
        }
        return Ok((0..n)
            .map(|i| HostSpec { name: format!("h{i}"), speed: 1.0, mem_bytes: DEFAULT_MEM })
            .collect());
    }
    let mut hosts = Vec::new();
    for item in spec.split(',') {
        let item = item.trim();
        let (count, rest) = match item.split_once('x') {
            Some((c, r)) => {
                (c.parse::<usize>().map_err(|_| format!("--hosts item {item:?}: {c:?} is not a count"))?, r)
            }
            None => (1, item),
        };
        let (speed, mem) = match rest.split_once(':') {
            Some((s, m)) => (s, parse_bytes(m).map_err(|e| format!("--hosts item {item:?}: {e}"))?),
            None => (rest, DEFAULT_MEM),
        };
        let speed: f64 =
            speed.parse().map_err(|_| format!("--hosts item {item:?}: speed {speed:?} is not a number"))?;
        if !(speed.is_finite() && speed > 0.0) || count == 0 {
            return Err(format!("--hosts item {item:?}: count and speed must be positive"));
        }
        if hosts.len() + count > MAX_HOSTS {
            return Err(format!("--hosts {spec:?}: more than {MAX_HOSTS} hosts"));
        }
        for _ in 0..count {
            hosts.push(HostSpec { name: format!("h{}", hosts.len()), speed, mem_bytes: mem });
        }
    }
    Ok(hosts)
}

/// Measures one TCP connection on loopback: bandwidth of a 32 MB copy and the one-way
/// latency from 200 round trips of one byte.
pub fn measure_loopback() -> std::io::Result<Link> {
    const BYTES: usize = 32 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        for _ in 0..200 {
            s.read_exact(&mut b)?;
            s.write_all(&b)?;
        }
        let mut buf = vec![0u8; 1 << 20];
        let mut left = BYTES;
        while left > 0 {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left -= n.min(left);
        }
        s.write_all(&[1])
    });
    let mut c = std::net::TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut b = [0u8; 1];
    let t = Instant::now();
    for _ in 0..200 {
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
    }
    let latency_ms = t.elapsed().as_secs_f64() * 1e3 / 400.0;
    let data = vec![7u8; 1 << 20];
    let t = Instant::now();
    for _ in 0..BYTES / data.len() {
        c.write_all(&data)?;
    }
    c.read_exact(&mut b)?;
    let secs = t.elapsed().as_secs_f64();
    server.join().map_err(|_| std::io::Error::other("loopback server panicked"))??;
    Ok(Link { bytes_per_s: BYTES as f64 / secs, latency_ms })
}

/// Profiles `job`'s blocks on this host's CPU (`limpet plan` runs where the operator is; a
/// host's agent profiles on its own device).
pub fn profile(
    job: &JobSpec,
    data: &limpet_trainer::data::Dataset,
    reps: usize,
) -> crate::Result<ModelProfile> {
    Ok(limpet_agent::stage::profile_model(job, data, reps, limpet_trainer::device::Device::Cpu)?)
}

#[derive(Serialize)]
struct PlanOutput<'a> {
    input: &'a PlanInput,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<&'a planner::PlanReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    forced: Option<&'a Plan>,
}

/// Runs `limpet plan`.
pub fn run(args: PlanArgs) -> crate::Result<()> {
    limpet_trainer::set_threads(1);
    let hosts = parse_hosts(&args.hosts).map_err(usage)?;
    let layout: Option<HostLayout> = args
        .layout
        .as_deref()
        .map(|l| l.parse::<HostLayout>().map_err(|e| usage(format!("--layout: {e}"))))
        .transpose()?;
    let (job, data) = crate::train_cmd::job_from_flags(&args.job)?;
    let profile = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --profile {}", path.display()))?;
            serde_json::from_str::<ModelProfile>(&text)
                .map_err(|e| usage(format!("--profile {}: {e}", path.display())))?
        }
        None => profile(&job, &data, args.reps)?,
    };
    if let Some(path) = &args.save_profile {
        std::fs::write(path, serde_json::to_string_pretty(&profile)?)
            .with_context(|| format!("writing --save-profile {}", path.display()))?;
    }
    let mut link = if args.link_gbps.is_none() || args.latency_ms.is_none() {
        measure_loopback().context("measuring the loopback link")?
    } else {
        Link { bytes_per_s: 0.0, latency_ms: 0.0 }
    };
    if let Some(g) = args.link_gbps {
        link.bytes_per_s = g * 1e9;
    }
    if let Some(l) = args.latency_ms {
        link.latency_ms = l;
    }
    let input = PlanInput {
        profile,
        hosts,
        link,
        global_batch: job.global_batch,
        max_depth: args.max_depth,
        local_ranks: usize::from(args.devices),
        replica_batch: None,
    };
    let (report, forced) = match &layout {
        Some(l) => (None, Some(planner::predict(&input, l).map_err(|e| usage(format!("--layout: {e}")))?)),
        None => (Some(planner::plan(&input)?), None),
    };
    if args.json {
        let out = PlanOutput { input: &input, report: report.as_ref(), forced: forced.as_ref() };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_input(&input);
    if let Some(p) = &forced {
        println!("\nforced layout: {}", p.layout);
        print_plan(p, input.local_ranks);
    }
    if let Some(r) = &report {
        println!("\nchosen: {}", r.best.layout);
        print_plan(&r.best, input.local_ranks);
        println!("  why: {}", r.reason);
        if !r.runners_up.is_empty() {
            println!("\nrunners-up:");
            println!("  {:>6} {:>12}  layout", "shape", "step ms");
            for p in r.runners_up.iter().take(args.runners_up) {
                println!(
                    "  {:>6} {:>12.2}  {}",
                    format!("{}x{}", p.layout.data, p.layout.pipeline()),
                    p.step_ms,
                    p.layout.spec()
                );
            }
        }
        println!("\nforce it with: --layout '{}'", r.best.layout.spec());
    }
    Ok(())
}

fn mb(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

fn print_input(input: &PlanInput) {
    let p = &input.profile;
    println!(
        "limpet plan: {} in {} blocks, global batch {}, micro-batch {}; link {:.2} GB/s, {:.3} ms",
        p.model,
        p.blocks.len(),
        input.global_batch,
        p.micro_batch,
        input.link.bytes_per_s / 1e9,
        input.link.latency_ms
    );
    if input.local_ranks > 1 {
        println!(
            "{} devices a host, each a replica of its host's stage: micro-batches, memory and times are a device's",
            input.local_ranks
        );
    }
    println!("\nprofile (this host, one micro-batch; {:.3} ms outside the blocks):", p.overhead_ms);
    println!(
        "  {:>5} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11}",
        "block", "fwd ms", "bwd ms", "apply ms", "output", "saved", "params"
    );
    for (i, b) in p.blocks.iter().enumerate() {
        println!(
            "  {:>5} {:>9.3} {:>9.3} {:>9.3} {:>11} {:>11} {:>11}",
            i,
            b.fwd_ms,
            b.bwd_ms,
            b.apply_ms,
            mb(b.out_bytes),
            mb(b.saved_bytes),
            mb(b.param_bytes)
        );
    }
    let hosts: Vec<String> = input
        .hosts
        .iter()
        .map(|h| {
            format!("{} (speed {}, {:.1} GB)", h.name, h.speed, h.mem_bytes as f64 / (1u64 << 30) as f64)
        })
        .collect();
    println!("hosts: {}", hosts.join(", "));
}

fn print_plan(p: &Plan, local_ranks: usize) {
    let per = if local_ranks > 1 { "device" } else { "replica" };
    println!("  predicted step: {:.2} ms ({} micro-batches per {per})", p.step_ms, p.micro_batches);
    println!(
        "  {:>5} {:>8} {:>16} {:>10} {:>10} {:>11}",
        "stage", "blocks", "hosts", "micro ms", "tail ms", "memory"
    );
    for (s, (st, pr)) in p.layout.stages.iter().zip(&p.stages).enumerate() {
        println!(
            "  {:>5} {:>8} {:>16} {:>10.3} {:>10.3} {:>11}",
            s,
            format!("{}..{}", st.start, st.end),
            st.hosts.join(","),
            pr.micro_ms,
            pr.tail_ms,
            mb(pr.mem_bytes)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_specs_parse_and_errors_name_the_item() {
        let h = parse_hosts("2x1.5:8G,0.5:512M").unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!((h[0].name.as_str(), h[0].speed, h[0].mem_bytes), ("h0", 1.5, 8 << 30));
        assert_eq!((h[2].name.as_str(), h[2].speed, h[2].mem_bytes), ("h2", 0.5, 512 << 20));
        assert_eq!(parse_hosts("3").unwrap().len(), 3);
        for (spec, says) in [
            ("0", "at least one host"),
            ("zx1", "\"z\" is not a count"),
            ("2xfast", "speed \"fast\""),
            ("1.0:8Q", "unknown unit"),
            ("2x-1", "must be positive"),
            ("999999999", "at most 4096"),
            ("4000x1.0,999999999x1.0", "more than 4096 hosts"),
        ] {
            let e = parse_hosts(spec).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
        assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
        assert!(parse_bytes("-5G").unwrap_err().contains("is negative"));
        assert!(parse_bytes("99999999999T").unwrap_err().contains("more than 1024 PiB"));
    }
}

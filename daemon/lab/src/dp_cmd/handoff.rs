//! `limpet-lab bench handoff`: a verified state transfer over loopback, next to a plain TCP copy
//! of the same bytes.

use super::allreduce::{human, parse_size};
use crate::stats::median;
use clap::Args;
use limpet_daemon::UsageError;
use std::time::{Duration, Instant};

/// `limpet-lab bench handoff`.
#[derive(Debug, Args)]
pub struct BenchHandoffArgs {
    /// Size of the state to transfer (K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "256M")]
    pub bytes: String,
    /// Parallel streams.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 4096)]
    pub chunk_kb: u32,
    /// Runs of each transfer (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn synthetic_image(bytes: usize) -> limpet_daemon::Result<limpet_snapshot::StateImage> {
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    let tensors_n = 16usize;
    let per = (bytes / 4 / tensors_n).max(1);
    let mut tensors = std::collections::BTreeMap::new();
    for t in 0..tensors_n {
        let name = format!("b{t:02}.w");
        let values: Vec<f32> = (0..per).map(|i| ((i * 31 + t * 7) % 1009) as f32 * 1e-3).collect();
        tensors.insert(name.clone(), RawTensor::from_f32(&name, vec![per], &values)?);
    }
    Ok(StateImage::new(1, 0, RngState::new(0), serde_json::json!({"bench": "handoff"}), tensors))
}

/// Serves `server`'s offers on a loopback port for the rest of the process, one thread
/// per connection as the agent's handoff server does.
fn serve_loopback(server: &limpet_snapshot::handoff::Server) -> limpet_daemon::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let serving = server.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let server = serving.clone();
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(true);
                let _ = server.serve(&mut conn, None);
            });
        }
    });
    Ok(addr)
}

/// Runs the handoff benchmark: a verified state transfer over loopback next to a plain TCP
/// copy of the same bytes.
pub fn bench_handoff(args: BenchHandoffArgs) -> limpet_daemon::Result<()> {
    use limpet_snapshot::handoff::{
        fetch, label_of, plain_copy_seconds, FetchOptions, Offer, Server, TcpDialer,
    };
    let size = parse_size(&args.bytes)?;
    if args.runs == 0 || args.streams == 0 {
        return Err(UsageError("--runs and --streams must be positive".into()).into());
    }
    let image = synthetic_image(size)?;
    let bytes = image.encode()?;
    let prepared = Instant::now();
    let label = label_of(image.content_hash());
    let offer = Offer::new(bytes.clone(), args.chunk_kb.saturating_mul(1024), label);
    let prepare_s = prepared.elapsed().as_secs_f64();
    let server = Server::new();
    server.offer(offer);
    let addr = serve_loopback(&server)?;
    let dialer = TcpDialer { timeout: Duration::from_secs(10) };
    let opts = FetchOptions {
        streams: args.streams,
        batch: 2,
        reconnects: 3,
        expect: Some(label),
        ..FetchOptions::default()
    };
    let bar = indicatif::ProgressBar::new(2 * args.runs as u64);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let (mut verified, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        bar.set_message("verified handoff");
        let t = Instant::now();
        let (got, _) = fetch(&dialer, std::slice::from_ref(&addr), &opts)?;
        verified.push(t.elapsed().as_secs_f64());
        if got != bytes {
            limpet_daemon::fail!("the transferred state differs from the source's");
        }
        bar.inc(1);
        bar.set_message("plain TCP copy");
        plain.push(plain_copy_seconds(&bytes)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let (v, p) = (median(verified), median(plain));
    let gbps = |s: f64| bytes.len() as f64 / s / 1e9;
    let report = serde_json::json!({
        "bytes": bytes.len(), "streams": args.streams, "chunk_bytes": args.chunk_kb as usize * 1024,
        "prepare_seconds": prepare_s,
        "verified_seconds": v, "verified_gbps": gbps(v),
        "plain_seconds": p, "plain_gbps": gbps(p),
        "ratio": p / v,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "state handoff over loopback, {} in {} streams (median of {} runs)",
            human(bytes.len()),
            args.streams,
            args.runs
        );
        println!(
            "  verified transfer (every chunk checked against the manifest): {:.3} GB/s ({:.1} ms)",
            gbps(v),
            v * 1e3
        );
        println!(
            "  plain TCP copy of the same bytes, one stream:                 {:.3} GB/s ({:.1} ms)",
            gbps(p),
            p * 1e3
        );
        println!(
            "  verified / plain: {:.0}%   (offer prepared once in {:.1} ms, while training continues)",
            100.0 * p / v,
            prepare_s * 1e3
        );
    }
    Ok(())
}

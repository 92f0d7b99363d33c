//! `limpet train`: one-process training with a progress bar, a step log, a loss plot and a
//! final report; `--resume` continues a checkpointed job bit-exactly.

use crate::args::{DataName, JobArgs, ModelName, TrainArgs};
use crate::UsageError;
use crate::Within;
use anyhow::Context;
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use limpet_trainer::data::Dataset;
use limpet_trainer::device::DeviceChoice;
use limpet_trainer::workload;
use limpet_trainer::{JobSpec, ModelKind, Progress, RunOptions, RunReport, Trainer, CHECKPOINT_FILE};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// File of one JSON line per applied step, in the run directory.
pub const STEP_LOG: &str = "steps.jsonl";
/// The loss plot, in the run directory.
pub const LOSS_PLOT: &str = "loss.svg";

/// One line of the step log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepRecord {
    /// Steps applied after this one (1-based count).
    pub step: u64,
    /// Mean training loss of the step (NaN once training diverged: written as `null`, which
    /// JSON has for it, and read back as NaN).
    #[serde(deserialize_with = "nan_for_null")]
    pub loss: f64,
    /// Learning rate used.
    #[serde(deserialize_with = "nan_for_null")]
    pub lr: f64,
    /// Seconds since this process started training.
    pub t: f64,
    /// Test loss, when the step was followed by an evaluation.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub test_loss: Option<f64>,
    /// Test accuracy, likewise.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub test_accuracy: Option<f64>,
}

/// A number of the step log, `null` (how serde_json writes NaN and infinities) read as NaN:
/// a run whose loss diverged must still resume and plot.
fn nan_for_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn usage(msg: impl Into<String>) -> crate::Failure {
    UsageError(msg.into()).into()
}

/// Runs `limpet train`.
pub fn run(args: TrainArgs) -> crate::Result<()> {
    limpet_trainer::set_threads(usize::from(args.threads));
    if let Some(to) = &args.print_order {
        return print_order(&args, to);
    }
    let (mut trainer, out) = match &args.resume {
        Some(dir) => resume(&args, dir)?,
        None => fresh(&args)?,
    };
    if let Some(stop) = args.stop_at {
        if stop > trainer.job().steps {
            return Err(usage(format!("--stop-at {stop} is beyond the job's {} steps", trainer.job().steps)));
        }
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating --out {}", out.display()))?;
    let mut log = keep_log_before(&out.join(STEP_LOG), trainer.step())?;
    let end = args.stop_at.unwrap_or(trainer.job().steps);
    let bar = step_bar(end.saturating_sub(trainer.step()));
    let opts = RunOptions {
        out: out.clone(),
        stop_at: args.stop_at,
        checkpoint_every: args.checkpoint_every,
        eval_every: args.job.keys.eval_every,
    };
    let started = Instant::now();
    let mut pending: Option<StepRecord> = None;
    let mut log_error = None;
    let report = limpet_trainer::run_local(&mut trainer, &opts, |p| match p {
        Progress::Step(s) => {
            if let Some(r) = pending.take() {
                log_error = log_error.take().or(write_record(&mut log, &r).err());
            }
            pending = Some(StepRecord {
                step: s.step + 1,
                loss: s.loss,
                lr: s.lr,
                t: started.elapsed().as_secs_f64(),
                test_loss: None,
                test_accuracy: None,
            });
            bar.inc(1);
            bar.set_message(format!("loss {:.4}", s.loss));
        }
        Progress::Eval { step, eval } => {
            if let Some(r) = pending.as_mut().filter(|r| r.step == *step) {
                r.test_loss = Some(eval.loss);
                r.test_accuracy = Some(eval.accuracy);
            }
            let line =
                format!("step {step}: test loss {:.4}, accuracy {:.2}%", eval.loss, 100.0 * eval.accuracy);
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
        Progress::Checkpoint { .. } => {}
    });
    bar.finish_and_clear();
    let report = report?;
    if let Some(r) = pending.take() {
        write_record(&mut log, &r)?;
    }
    if let Some(e) = log_error {
        return Err(e);
    }
    drop(log);
    let plot = plot_losses(&out, &report)?;
    print_report(&report, &plot, args.json)
}

fn step_bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps ({per_sec}) {msg}",
        )
        .expect("valid template"),
    );
    bar
}

/// Plots the whole step log of `out` (earlier runs of a resumed job included).
fn plot_losses(out: &Path, report: &RunReport) -> crate::Result<std::path::PathBuf> {
    let plot = out.join(LOSS_PLOT);
    let records = read_log(&out.join(STEP_LOG))?;
    let points: Vec<crate::plot::LossPoint> = records
        .iter()
        .map(|r| crate::plot::LossPoint { step: r.step, loss: r.loss, test_loss: r.test_loss })
        .collect();
    crate::plot::loss_svg(
        &plot,
        &points,
        &format!("{} on {}", kind_name(&report.model), kind_name(&report.data)),
    )?;
    Ok(plot)
}

fn kind_name(v: &serde_json::Value) -> String {
    v.get("kind").and_then(|k| k.as_str()).unwrap_or("?").to_string()
}

fn write_record(log: &mut std::fs::File, r: &StepRecord) -> crate::Result<()> {
    Ok(writeln!(log, "{}", serde_json::to_string(r)?).context("writing the step log")?)
}

/// Reads a step log, naming the line that does not parse.
pub fn read_log(path: &Path) -> crate::Result<Vec<StepRecord>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1)))
        .collect::<anyhow::Result<_>>()
        .map_err(Into::into)
}

/// Opens the step log for appending after dropping records of steps past `step`: those were
/// logged after the checkpoint being resumed and will be run again.
fn keep_log_before(path: &Path, step: u64) -> crate::Result<std::fs::File> {
    let kept: Vec<StepRecord> = if step > 0 && path.exists() {
        read_log(path)?.into_iter().filter(|r| r.step <= step).collect()
    } else {
        Vec::new()
    };
    let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    for r in &kept {
        write_record(&mut f, r)?;
    }
    Ok(f)
}

/// Writes the job's sample order, step by step, without training.
fn print_order(args: &TrainArgs, to: &Path) -> crate::Result<()> {
    if args.resume.is_some() || args.out.is_some() {
        return Err(usage("--print-order trains nothing: it takes the job's flags, not --out or --resume"));
    }
    let (job, data) = job_from_flags(&args.job)?;
    let steps = job.steps;
    let blocks = 0..job.model.num_blocks();
    let mut trainer = Trainer::on_device(job, data, blocks, limpet_trainer::device::Device::Cpu)?;
    let mut out: Box<dyn Write> = if to == Path::new("-") {
        Box::new(std::io::BufWriter::new(std::io::stdout().lock()))
    } else {
        let f =
            std::fs::File::create(to).with_context(|| format!("creating --print-order {}", to.display()))?;
        Box::new(std::io::BufWriter::new(f))
    };
    for step in 0..steps {
        writeln!(out, "{}", serde_json::to_string(&trainer.order(step))?)
            .with_context(|| format!("writing --print-order {}", to.display()))?;
    }
    out.flush().with_context(|| format!("writing --print-order {}", to.display()))?;
    Ok(())
}

fn fresh(args: &TrainArgs) -> crate::Result<(Trainer, PathBuf)> {
    let out = args.out.clone().ok_or_else(|| usage("--out DIR is required (or --resume DIR)"))?;
    refuse_to_overwrite(args, &out, None)?;
    let (job, data) = job_from_flags(&args.job)?;
    let blocks = 0..job.model.num_blocks();
    let mut trainer = Trainer::on_device(job, data, blocks, device_from_flags(&args.job)?)?;
    if let Some(dir) = &args.job.model_keys.init_from {
        trainer.init_from_hf(dir)?;
    }
    Ok((trainer, out))
}

/// The device `--device` names, checked against this host.
pub(crate) fn device_from_flags(args: &JobArgs) -> crate::Result<limpet_trainer::device::Device> {
    let choice = DeviceChoice::parse(args.device.as_deref().unwrap_or("cpu"))
        .map_err(|e| usage(format!("--device: {e}")))?;
    let device = choice.resolve().map_err(|e| usage(format!("--device: {e}")))?;
    if choice == DeviceChoice::Auto {
        eprintln!("limpet train: --device auto chose {device:?}");
    }
    Ok(device)
}

/// The job the flags describe, on its loaded data.
pub fn job_from_flags(args: &JobArgs) -> crate::Result<(JobSpec, Dataset)> {
    let model = args.model.unwrap_or(ModelName::Mlp);
    let kind = match model {
        ModelName::Mlp => ModelKind::Mlp,
        ModelName::Convnet => ModelKind::Convnet,
        ModelName::Gpt => ModelKind::Gpt,
        ModelName::Llama => ModelKind::Llama,
        ModelName::Torchscript => ModelKind::Torchscript,
    };
    let data_arg = args.data.unwrap_or(match model {
        ModelName::Gpt => DataName::Chars,
        ModelName::Llama => DataName::Tokens,
        ModelName::Torchscript => DataName::Tensors,
        _ => DataName::Digits,
    });
    if args.context.is_some() && !matches!(data_arg, DataName::Chars | DataName::Tokens) {
        return Err(usage("--context applies only to --data chars and tokens"));
    }
    if args.context == Some(0) {
        return Err(usage("--context must be at least 1"));
    }
    let name = data_arg.to_possible_value().expect("every dataset has a name");
    let section = workload::DataSection { context: args.context };
    let spec = workload::data_spec(name.get_name(), &section, args.keys.seed.unwrap_or(0))?;
    let data = Dataset::load(&spec, args.data_path.as_deref())?;
    let mut job = workload::job_for(kind, &data, &args.model_keys.with_layers(args.layers))
        .map_err(|e| usage(flag_names(&e.to_string())))?;
    apply_flags(&mut job, args)?;
    Ok((job, data))
}

/// Speaks of `[model].d_model` as `--d-model`, and of `[model].path` as `--module` (the
/// flags and the file share one check).
fn flag_names(msg: &str) -> String {
    let mut out = msg.to_string();
    while let Some(i) = out.find("[model].") {
        let rest = &out[i + 8..];
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let flag = match &rest[..end] {
            "path" => "--module".to_string(),
            key => format!("--{}", key.replace('_', "-")),
        };
        out = format!("{}{flag}{}", &out[..i], &rest[end..]);
    }
    out
}

fn resume(args: &TrainArgs, dir: &Path) -> crate::Result<(Trainer, PathBuf)> {
    let path = dir.join(CHECKPOINT_FILE);
    let image = limpet_snapshot::read_file(&path).within(|| format!("checkpoint {}", path.display()))?;
    let job: JobSpec = serde_json::from_value(image.meta().job.clone()).map_err(|e| {
        limpet_trainer::TrainerError::Mismatch(format!("job spec in {} is unreadable: {e}", path.display()))
    })?;
    let mut wanted = job.clone();
    apply_flags(&mut wanted, &args.job)?;
    if let Some(d) = job.diff(&wanted) {
        return Err(usage(format!(
            "flags change the checkpointed job ({d}, checkpoint vs flags); a resumed job keeps its spec"
        )));
    }
    if let limpet_trainer::model::ModelSpec::Torchscript(s) = &job.model {
        let module = args.job.model_keys.path.as_deref().ok_or_else(|| {
            usage(format!("{} trains a TorchScript module: give its file with --module", path.display()))
        })?;
        limpet_trainer::model::script::register_as(module, s).map_err(|e| usage(format!("--module: {e}")))?;
    }
    let data = Dataset::load(&job.data, args.job.data_path.as_deref())?;
    let blocks = 0..job.model.num_blocks();
    let mut trainer = Trainer::on_device(job, data, blocks, device_from_flags(&args.job)?)?;
    trainer.load_image(&image).within(|| format!("checkpoint {}", path.display()))?;
    let out = args.out.clone().unwrap_or_else(|| dir.to_path_buf());
    refuse_to_overwrite(args, &out, Some(dir))?;
    Ok((trainer, out))
}

/// A run's `out` directory that holds a checkpoint of another run (anything but the one
/// `resumed`) is refused unless `--overwrite`: training there would replace that run's only
/// checkpoint and its step log.
fn refuse_to_overwrite(args: &TrainArgs, out: &Path, resumed: Option<&Path>) -> crate::Result<()> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if args.overwrite || !out.join(CHECKPOINT_FILE).exists() || resumed.is_some_and(|r| same(r, out)) {
        return Ok(());
    }
    Err(usage(format!(
        "--out {}: it holds another run's {CHECKPOINT_FILE}; continue that run with --resume {}, train into another directory, or pass --overwrite to replace it",
        out.display(),
        out.display()
    )))
}

/// Overlays the job flags that were given on `job`: the model must be the job's; the
/// training keys go through the same builder as `[job]` in `limpetd`'s file.
fn apply_flags(job: &mut JobSpec, a: &JobArgs) -> crate::Result<()> {
    if let Some(m) = a.model {
        let want = m.to_possible_value().expect("every model has a name");
        let have = kind_name(&serde_json::to_value(&job.model)?);
        if have != want.get_name() {
            return Err(usage(format!(
                "--model {} differs from the checkpoint's model {have}",
                want.get_name()
            )));
        }
    }
    a.keys.apply(job).map_err(|e| usage(e.as_flag()))?;
    apply_model_flags(job, a)
}

/// The model's depth.
fn apply_model_flags(job: &mut JobSpec, a: &JobArgs) -> crate::Result<()> {
    if let Some(l) = a.layers {
        match &mut job.model {
            limpet_trainer::model::ModelSpec::Gpt { layers, .. } if l > 0 => *layers = l,
            limpet_trainer::model::ModelSpec::Llama(s) if l > 0 => s.layers = l,
            limpet_trainer::model::ModelSpec::Gpt { .. } | limpet_trainer::model::ModelSpec::Llama(_) => {
                return Err(usage("--layers must be at least 1"))
            }
            _ => return Err(usage("--layers applies only to --model gpt and llama")),
        }
    }
    Ok(())
}

fn print_report(r: &RunReport, plot: &Path, json: bool) -> crate::Result<()> {
    if json {
        let mut v = serde_json::to_value(r)?;
        v["plot"] = serde_json::Value::String(plot.display().to_string());
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "limpet train: {} on {}, steps {} -> {} of {} in {:.1} s ({:.0} samples/s)",
        kind_name(&r.model),
        kind_name(&r.data),
        r.start_step,
        r.final_step,
        r.total_steps,
        r.elapsed_s,
        r.samples_per_s
    );
    if let Some(l) = r.train_loss {
        println!("  train loss    {l:.4}");
    }
    println!("  test loss     {:.4}", r.test_loss);
    println!("  test accuracy {:.2}%", 100.0 * r.test_accuracy);
    println!("  checkpoint    {} (state {})", r.checkpoint.display(), &r.content_hash[..16]);
    println!("  loss plot     {}", plot.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The model's keys, as the flags spell them: a TorchScript module's file is `--module`.
    #[test]
    fn model_keys_are_named_as_their_flags() {
        assert_eq!(super::flag_names("[model].path: x.pt: not a module"), "--module: x.pt: not a module");
        assert_eq!(super::flag_names("[model].d_model (3) and [model].heads"), "--d-model (3) and --heads");
    }
}

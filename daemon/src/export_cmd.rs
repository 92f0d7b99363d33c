//! `limpet export`: a checkpoint as a Hugging Face directory (`--hf`, model llama) that
//! `transformers` loads, or as the TorchScript module it was trained from (`--torchscript`).

use crate::UsageError;
use crate::Within;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

/// `limpet export`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("format").required(true).args(["hf", "torchscript"])))]
pub struct ExportArgs {
    /// Write a Hugging Face LlamaForCausalLM directory here (model llama).
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    /// Write the TorchScript module with the trained weights to this file (model
    /// torchscript; PyTorch loads it with torch.jit.load).
    #[arg(long, value_name = "FILE", requires = "module")]
    pub torchscript: Option<PathBuf>,
    /// The job's TorchScript module file (what it was trained from).
    #[arg(long, value_name = "FILE")]
    pub module: Option<PathBuf>,
    /// The checkpoint: a checkpoint.safetensors file, or the directory holding one.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// A tokenizer.json to copy beside the weights (with --hf), with the
    /// tokenizer_config.json and special_tokens_map.json found beside it.
    #[arg(long, requires = "hf")]
    pub tokenizer: Option<PathBuf>,
    /// The weights' dtype with --hf: f32, bf16 or f16 (default: the dtype of the checkpoint
    /// the job started from, f32 for a model trained from scratch).
    #[arg(long, requires = "hf", value_parser = parse_dtype)]
    pub dtype: Option<limpet_trainer::hf::ExportDtype>,
    /// Replace a model already in --hf's directory (its config.json and weights), or the
    /// --torchscript file (without this, both are refused).
    #[arg(long)]
    pub overwrite: bool,
}

/// An export that would replace a model (a Hugging Face directory's config or weights, a
/// TorchScript file) is refused without `--overwrite`: it may be the checkpoint a job was
/// fine-tuned from.
fn refuse_to_replace(a: &ExportArgs) -> crate::Result<()> {
    if let Some(dir) = a.hf.as_ref().filter(|d| d.exists() && !d.is_dir()) {
        return Err(UsageError(format!(
            "--hf {}: is a file; name a directory to write the model into",
            dir.display()
        ))
        .into());
    }
    if a.overwrite {
        return Ok(());
    }
    let held = |dir: &std::path::Path| -> Option<String> {
        let names = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()?.file_name().into_string().ok());
        names.into_iter().find(|n| {
            n == "config.json"
                || (n.ends_with(".safetensors") || n.ends_with(".bin"))
                    && (n.starts_with("model") || n.starts_with("pytorch_model"))
        })
    };
    let (flag, path, what) = match (&a.hf, &a.torchscript) {
        (Some(dir), _) => match held(dir) {
            Some(name) => ("--hf", dir, format!("holds a model ({name})")),
            None => return Ok(()),
        },
        (None, Some(file)) if file.exists() => ("--torchscript", file, "exists".to_string()),
        _ => return Ok(()),
    };
    Err(UsageError(format!(
        "{flag} {}: it {what}; export to another path, or pass --overwrite to replace it",
        path.display()
    ))
    .into())
}

fn parse_dtype(s: &str) -> Result<limpet_trainer::hf::ExportDtype, limpet_trainer::NotOneOf> {
    limpet_trainer::hf::ExportDtype::parse(s)
}

/// Runs `limpet export`.
pub fn export(a: ExportArgs) -> crate::Result<()> {
    refuse_to_replace(&a)?;
    let file = if a.checkpoint.is_dir() {
        a.checkpoint.join(limpet_trainer::CHECKPOINT_FILE)
    } else {
        a.checkpoint.clone()
    };
    let image = limpet_snapshot::read_file(&file).within(|| format!("checkpoint {}", file.display()))?;
    if let (Some(out), Some(module)) = (&a.torchscript, &a.module) {
        let job: limpet_trainer::JobSpec = serde_json::from_value(image.meta().job.clone())
            .with_context(|| format!("the job in {}", file.display()))?;
        let limpet_trainer::model::ModelSpec::Torchscript(spec) = &job.model else {
            return Err(UsageError(format!(
                "--torchscript: {} holds a {} model, not a TorchScript module",
                file.display(),
                serde_json::to_value(&job.model)?["kind"].as_str().unwrap_or("?")
            ))
            .into());
        };
        limpet_trainer::model::script::register_as(module, spec)
            .map_err(|e| UsageError(format!("--module: {e}")))?;
        limpet_trainer::model::script::export(spec, &image, out)?;
        println!(
            "limpet export: step {} of {} written to {} (TorchScript)",
            image.meta().step,
            file.display(),
            out.display()
        );
        return Ok(());
    }
    let hf = a.hf.as_ref().expect("clap requires --hf or --torchscript");
    // A model trained from scratch names no special tokens: its tokenizer's go out with it.
    let special =
        a.tokenizer.as_deref().and_then(|t| t.parent()).map(limpet_trainer::hf::tokenizer_special_tokens);
    limpet_trainer::hf::export_with(
        &image,
        hf,
        a.dtype,
        limpet_trainer::hf::MAX_SHARD_BYTES,
        special.as_ref(),
    )?;
    if let Some(t) = &a.tokenizer {
        std::fs::copy(t, hf.join("tokenizer.json")).with_context(|| format!("copying {}", t.display()))?;
        // The files transformers' AutoTokenizer reads beside it (special tokens, BOS/EOS).
        for f in ["tokenizer_config.json", "special_tokens_map.json"] {
            if let Some(src) = t.parent().map(|d| d.join(f)).filter(|p| p.exists()) {
                std::fs::copy(&src, hf.join(f)).with_context(|| format!("copying {}", src.display()))?;
            }
        }
    }
    println!(
        "limpet export: step {} of {} written to {} (config.json, generation_config.json, safetensors weights)",
        image.meta().step,
        file.display(),
        hf.display()
    );
    Ok(())
}

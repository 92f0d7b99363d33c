//! `[job]` in a file and `limpet train`'s flags: one definition of the training keys
//! (`JobKeys`), read from TOML and from the command line alike, which give the same job.

use super::tests::{example, secret};
use super::*;

/// The same job written as `[job]` keys and as `limpet train` flags is the same job: the
/// optimizer's defaults, the warmup, the clip and the schedule's floor come from one builder.
#[test]
fn a_job_from_the_file_equals_the_job_from_the_flags() {
    use clap::Parser;
    let s = secret();
    let keys = "optimizer = \"sgd\"\nwarmup = 7\nclip = 0.5\nmin_lr_ratio = 0.25\nseed = 3\nmicro_batch = 16";
    let text = example(s.path())
        .replace("data = \"digits\"", "data = \"synthetic\"")
        .replace("global_batch = 64", &format!("global_batch = 64\n{keys}"));
    let cfg = Config::parse(&text, "limpet.toml").unwrap();
    let from_file = cfg.job_spec().unwrap();
    let flags = crate::cli::Cli::parse_from([
        "limpet",
        "train",
        "--data",
        "synthetic",
        "--steps",
        "400",
        "--batch",
        "64",
        "--optimizer",
        "sgd",
        "--warmup",
        "7",
        "--clip",
        "0.5",
        "--min-lr-ratio",
        "0.25",
        "--seed",
        "3",
        "--micro-batch",
        "16",
        "--out",
        "/nonexistent",
    ]);
    let crate::cli::Command::Train(args) = flags.command else { panic!("parsed as train") };
    let (from_flags, _) = crate::train_cmd::job_from_flags(&args.job).unwrap();
    assert_eq!(from_file.diff(&from_flags), None);
    // SGD got SGD's learning rate, not AdamW's, and every key landed.
    assert_eq!(from_file.optimizer.lr(), limpet_trainer::job_keys::SGD_LR);
    assert_eq!(
        (
            from_file.schedule.warmup_steps,
            from_file.clip_norm,
            from_file.schedule.min_lr_ratio,
            from_file.micro_batch
        ),
        (7, Some(0.5), 0.25, 16)
    );
}

/// AdamW's recipe keys (`betas`, `eps`, `decay_embeddings`) land the same from the file and
/// from the flags; SGD refuses them by name.
#[test]
fn adamw_recipe_keys_from_the_file_equal_the_flags() {
    use clap::Parser;
    let s = secret();
    let keys = "betas = [0.9, 0.95]\neps = 1e-6\ndecay_embeddings = true";
    let text = example(s.path())
        .replace("data = \"digits\"", "data = \"synthetic\"")
        .replace("global_batch = 64", &format!("global_batch = 64\n{keys}"));
    let cfg = Config::parse(&text, "limpet.toml").unwrap();
    let from_file = cfg.job_spec().unwrap();
    let flags = crate::cli::Cli::parse_from([
        "limpet",
        "train",
        "--data",
        "synthetic",
        "--steps",
        "400",
        "--batch",
        "64",
        "--seed",
        "0",
        "--betas",
        "0.9,0.95",
        "--eps",
        "1e-6",
        "--decay-embeddings",
        "--out",
        "/nonexistent",
    ]);
    let crate::cli::Command::Train(args) = flags.command else { panic!("parsed as train") };
    let (from_flags, _) = crate::train_cmd::job_from_flags(&args.job).unwrap();
    assert_eq!(from_file.diff(&from_flags), None);
    let limpet_trainer::optim::OptimizerSpec::Adamw { beta1, beta2, eps, decay_embeddings, .. } =
        from_file.optimizer
    else {
        panic!("adamw")
    };
    assert_eq!((beta1, beta2, eps, decay_embeddings), (0.9, 0.95, 1e-6, true));
    let text = example(s.path())
        .replace("global_batch = 64", "global_batch = 64\noptimizer = \"sgd\"\nbetas = [0.9, 0.95]");
    let e = match Config::parse(&text, "limpet.toml") {
        Err(e) => e.to_string(),
        Ok(c) => c.job_spec().unwrap_err().to_string(),
    };
    assert!(e.contains("[job].betas: applies to optimizer adamw"), "{e}");
}

/// `[job]` in a file and `limpet train`'s flags spell the same training keys: one set of
/// values written both ways gives the same `JobKeys`, every key set. The destructuring names
/// every field, so a key added to `JobKeys` does not build here until both spellings
/// (`config/job.rs`, `args.rs`) carry it.
#[test]
fn every_training_key_reads_the_same_from_the_file_and_the_flags() {
    use clap::Parser;
    use limpet_trainer::job_keys::JobKeys;
    let s = secret();
    let keys = "micro_batch = 16\noptimizer = \"adamw\"\nlr = 0.002\nweight_decay = 0.05\nbetas = [0.9, 0.95]\n\
                eps = 1e-6\ndecay_embeddings = true\nwarmup = 7\nclip = 0.5\nmin_lr_ratio = 0.25\nseed = 3\n\
                precision = \"bf16\"\nreproducible = true\nshards = 4\nactivation_checkpointing = true\n\
                loss_chunk = 32\neval_every = 50\nshard_state = \"optimizer\"\nshard_replicas = 2\noverlap = false\n\
                reduce_dtype = \"fp32\"";
    let text = example(s.path()).replace("global_batch = 64", &format!("global_batch = 64\n{keys}"));
    let from_file = Config::parse_unchecked(&text, "c.toml").unwrap().job.keys;
    let flags = crate::cli::Cli::parse_from([
        "limpet",
        "train",
        "--steps",
        "400",
        "--batch",
        "64",
        "--micro-batch",
        "16",
        "--optimizer",
        "adamw",
        "--lr",
        "0.002",
        "--weight-decay",
        "0.05",
        "--betas",
        "0.9,0.95",
        "--eps",
        "1e-6",
        "--decay-embeddings",
        "--warmup",
        "7",
        "--clip",
        "0.5",
        "--min-lr-ratio",
        "0.25",
        "--seed",
        "3",
        "--precision",
        "bf16",
        "--reproducible",
        "--shards",
        "4",
        "--activation-checkpointing",
        "--loss-chunk",
        "32",
        "--eval-every",
        "50",
        "--out",
        "/nonexistent",
    ]);
    let crate::cli::Command::Train(args) = flags.command else { panic!("parsed as train") };
    // Every key of the struct was set by the file (a key serde cannot read is unknown).
    assert!(!format!("{from_file:?}").contains("None"), "a key the file did not carry: {from_file:?}");
    // `limpet train` runs one rank: sharding, overlap and the reduce's format are limpetd's
    // keys alone.
    let one_rank =
        JobKeys { shard_state: None, shard_replicas: None, overlap: None, reduce_dtype: None, ..from_file };
    assert_eq!(args.job.keys, one_rank);
}

/// A file with an unknown key and a bad value names both (an unknown key used to end the
/// parse), each with its line; a missing training key is named as `[job].key`.
#[test]
fn an_unknown_key_is_reported_beside_every_other_error() {
    let s = secret();
    let text = example(s.path()).replace("global_batch = 64", "global_batch = 0\nbogus_key = 1\nlr = -1.0");
    let errors = Config::parse(&text, "c.toml").unwrap_err();
    let shown = errors.to_string();
    let at = |key: &str| errors.all().iter().find(|e| e.key == key).and_then(|e| e.line);
    assert!(shown.contains("[job].bogus_key") && shown.contains("unknown field `bogus_key`"), "{shown}");
    assert!(shown.contains("[job].global_batch"), "{shown}");
    let line = |k: &str| text.lines().position(|l| l.starts_with(k)).map(|i| i + 1);
    assert_eq!(at("[job].bogus_key"), line("bogus_key"));
    assert_eq!(at("[job].global_batch"), line("global_batch"));
    // Unknown keys of other sections and a whole unknown section, all at once.
    let text =
        example(s.path()).replace("[job]", "[jobs]\nx = 1\n\n[job]").replace("control = ", "contorl = ");
    let shown = Config::parse(&text, "c.toml").unwrap_err().to_string();
    assert!(shown.contains("[jobs]") && shown.contains("unknown field `contorl`"), "{shown}");
    // A value serde refuses stops the parse; the unknown keys met before it are named with it,
    // and a training key (read after) is not taken for one.
    let text = example(s.path())
        .replace("[revocation]\n", "[revocation]\npoll = 2\n")
        .replace("sources = [\"aws\"]", "sources = []");
    let shown = Config::parse(&text, "c.toml").unwrap_err().to_string();
    assert!(shown.contains("[revocation].sources") && shown.contains("unknown field `poll`"), "{shown}");
    assert!(!shown.contains("global_batch") && !shown.contains("steps"), "{shown}");
    // Optional sections and nested tables name their keys as files write them, on their
    // lines; a key above the first section is one.
    let text =
        format!("steps = 10\n{}", example(s.path()).replace("insecure = true", "insecure = true\nbogus = 1"));
    let errors = Config::parse(&text, "c.toml").unwrap_err();
    let at = |key: &str| errors.all().iter().find(|e| e.key == key).map(|e| e.line);
    let bogus = text.lines().position(|l| l.starts_with("bogus")).map(|i| i + 1);
    assert_eq!(at("[security].bogus"), Some(bogus), "{errors}");
    assert_eq!(at("steps"), Some(Some(1)), "{errors}");
    assert!(errors.to_string().contains("unknown top-level key `steps`"), "{errors}");
    // Start-up and `limpetd validate` (parse_unchecked, then settings) report the same.
    let text = example(s.path()).replace("global_batch = 64", "bogus_key = 1");
    let shown = Config::parse_unchecked(&text, "c.toml").unwrap().settings().err().unwrap().to_string();
    assert!(shown.contains("[job].bogus_key") && shown.contains("[job].global_batch: missing"), "{shown}");
    // A training key left out is named in its section.
    let text = example(s.path()).replace("global_batch = 64", "");
    let shown = Config::parse(&text, "c.toml").unwrap_err().to_string();
    assert!(shown.contains("[job].global_batch") && shown.contains("missing"), "{shown}");
}

//! `limpetd fetch-credentials`: an EC2 host's first boot reads its node certificate, key, the
//! CA's certificate and the cluster secret from SSM Parameter Store (`[security.ssm]`, written
//! by `limpet fleet up --certs`) with the instance role, writes them where `[security]` and
//! `[node].secret_file` say, checks every key and these files (`Config::parse`: the
//! certificate bound to this node, the secret's length; the unit's `limpetd validate` then
//! builds the job), and only then deletes its key's parameter. Run again (a reboot) with the files in place, it changes nothing.

use crate::config::Config;
use crate::UsageError;
use anyhow::Context;
use limpet_deploy::ssm::{NodeCredentials, Vault};
use limpet_deploy::FleetConfig;
use std::path::Path;
use std::time::{Duration, Instant};

/// Fetches what `config` names (see the module's documentation).
pub fn run(config: &Path, wait: Option<Duration>) -> crate::Result<()> {
    let file = config.display().to_string();
    let text = std::fs::read_to_string(config).map_err(|e| UsageError(format!("{file}: {e}")))?;
    let cfg = Config::parse_unchecked(&text, &file).map_err(|e| UsageError(e.to_string()))?;
    let sec = cfg.security.as_ref().filter(|s| !s.insecure);
    let Some(ssm) = sec.and_then(|s| s.ssm.as_ref()) else {
        return Err(
            UsageError(format!("{file}: [security.ssm]: not set, so there is nothing to fetch")).into()
        );
    };
    let sec = sec.expect("ssm is inside it");
    let missing_key =
        |k: &str| UsageError(format!("{file}: [security].{k}: missing: where the fetched file goes"));
    let ca = sec.ca.clone().ok_or_else(|| missing_key("ca"))?;
    let cert = sec.cert.clone().ok_or_else(|| missing_key("cert"))?;
    let key = sec.key.clone().ok_or_else(|| missing_key("key"))?;
    let secret = cfg.node.secret_file.clone();
    let files = [&ca, &cert, &key, &secret];
    if files.iter().all(|p| p.exists()) {
        Config::parse(&text, &file).map_err(|e| UsageError(e.to_string()))?;
        println!("{file}: credentials already in place (nothing fetched)");
        return Ok(());
    }
    let wait = wait.unwrap_or(Duration::from_secs(ssm.wait_secs));
    let fleet = FleetConfig {
        region: ssm.region.clone().or_else(|| cfg.cluster.ec2_region.clone()),
        endpoint: None,
        credentials: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let name = cfg.node.name.clone();
    let creds = rt.block_on(async {
        let vault = Vault::connect(&ssm.prefix, &fleet).await?;
        let creds = fetch_waiting(&vault, &name, wait).await?;
        Ok::<_, crate::Failure>((vault, creds))
    })?;
    let (vault, creds) = creds;
    write_private(&secret, &creds.secret)?;
    write_private(&key, creds.key_pem.as_bytes())?;
    write_private(&cert, creds.cert_pem.as_bytes())?;
    write_private(&ca, creds.ca_pem.as_bytes())?;
    // What was fetched must be what this node can run with (its id, this CA, a matching key)
    // before the only other copy of the key is deleted.
    if let Err(e) = Config::parse(&text, &file) {
        // Removed, so that a run after the operator's fix fetches again (the key's parameter
        // is still there).
        for p in files {
            let _ = std::fs::remove_file(p);
        }
        return Err(UsageError(format!(
            "the credentials fetched from {} do not fit this node: {e}",
            ssm.prefix
        ))
        .into());
    }
    let forgot = rt.block_on(vault.forget_key(&name));
    match forgot {
        Ok(_) => println!(
            "{file}: credentials of node {name} fetched from {} and written; its key's parameter is deleted",
            ssm.prefix
        ),
        // The host runs either way; the operator learns the key is still stored.
        Err(e) => eprintln!(
            "warning: could not delete {} ({e}): the key stays readable with the instance role",
            vault.name(&format!("nodes/{name}/key"))
        ),
    }
    Ok(())
}

/// Waits for node `name`'s parameters (written just after its instance was launched).
async fn fetch_waiting(vault: &Vault, name: &str, wait: Duration) -> crate::Result<NodeCredentials> {
    let start = Instant::now();
    let mut said = None::<Instant>;
    loop {
        match vault.fetch(name).await? {
            Ok(creds) => return Ok(creds),
            Err(missing) if start.elapsed() >= wait => {
                return Err(UsageError(format!(
                    "{missing} does not exist after {:.0} s: was this instance launched with \
                     `limpet fleet up --certs`?",
                    wait.as_secs_f64()
                ))
                .into())
            }
            Err(missing) => {
                if said.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    eprintln!("waiting for {missing} ({:.0} s so far)", start.elapsed().as_secs_f64());
                    said = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Writes `bytes` to `path` readable by its owner only, through a temporary file renamed into
/// place (a crash leaves the old file or none, never half of one).
fn write_private(path: &Path, bytes: &[u8]) -> crate::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.part",
        path.file_name().map_or_else(|| "credential".into(), |n| n.to_string_lossy())
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

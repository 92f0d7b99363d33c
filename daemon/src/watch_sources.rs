//! Which metadata services `limpetd` watches for revocation notices: the ones
//! `[revocation].sources` lists, none when it says `"none"`, or (the default, `"auto"`) the
//! cloud whose metadata service answers a short probe. The startup log and
//! `limpetd validate` both say which, and why.

use crate::config::{Config, SourceName, Sources};
use limpet_agent::revocation::{detect, Endpoints, Probe, Source};
use std::time::Duration;

/// How long each detection probe may take (they run at once, so this bounds the whole).
pub const DETECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The sources in force and how they were chosen.
#[derive(Debug)]
pub struct Active {
    /// `auto`, `none` or `listed`.
    pub mode: &'static str,
    /// What is watched.
    pub sources: Vec<Source>,
    /// What detection saw (empty unless `auto`).
    pub probes: Vec<Probe>,
}

impl Active {
    /// One line: what is watched and how it was chosen.
    pub fn summary(&self) -> String {
        let names =
            self.sources.iter().map(|s| format!("{} at {}", s.cloud(), s.endpoint())).collect::<Vec<_>>();
        match (self.mode, names.is_empty()) {
            ("none", _) => "none ([revocation].sources = \"none\"; SIGTERM still drains)".into(),
            ("auto", true) => format!(
                "none: no cloud metadata service answered within {} s ({}); SIGTERM still drains. \
                 Name the source in [revocation].sources, or write sources = \"none\" to mean it",
                DETECT_TIMEOUT.as_secs_f64(),
                self.probes
                    .iter()
                    .map(|p| format!("{}: {}", p.cloud, p.detail))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            ("auto", false) => format!(
                "{} (detected: {})",
                names.join(", "),
                self.probes
                    .iter()
                    .filter(|p| p.source.is_some())
                    .map(|p| p.detail.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            _ => format!("{} (listed in [revocation].sources)", names.join(", ")),
        }
    }

    /// Whether a spot host would miss its notices (auto found nothing).
    pub fn is_blind(&self) -> bool {
        self.mode == "auto" && self.sources.is_empty()
    }

    /// The JSON form `limpetd validate --json` prints.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": self.mode,
            "sources": self.sources.iter().map(|s| serde_json::json!({"cloud": s.cloud(), "endpoint": s.endpoint()})).collect::<Vec<_>>(),
            "probes": self.probes.iter().map(|p| serde_json::json!({"cloud": p.cloud, "answered": p.source.is_some(), "detail": p.detail})).collect::<Vec<_>>(),
            "summary": self.summary(),
        })
    }
}

/// Resolves `[revocation].sources` (probing the clouds when it is `auto`).
pub async fn resolve(cfg: &Config) -> Active {
    let r = &cfg.revocation;
    match &r.sources {
        Sources::None => Active { mode: "none", sources: Vec::new(), probes: Vec::new() },
        Sources::These(list) => Active {
            mode: "listed",
            sources: list
                .iter()
                .map(|s| match s {
                    SourceName::Aws => Source::Aws { endpoint: r.aws_endpoint.clone() },
                    SourceName::Gcp => Source::Gcp { endpoint: r.gcp_endpoint.clone() },
                    SourceName::Azure => Source::Azure { endpoint: r.azure_endpoint.clone() },
                })
                .collect(),
            probes: Vec::new(),
        },
        Sources::Auto => {
            let at = Endpoints {
                aws: r.aws_endpoint.clone(),
                gcp: r.gcp_endpoint.clone(),
                azure: r.azure_endpoint.clone(),
            };
            let probes = detect(&at, DETECT_TIMEOUT).await;
            let sources = probes.iter().filter_map(|p| p.source.clone()).collect();
            Active { mode: "auto", sources, probes }
        }
    }
}

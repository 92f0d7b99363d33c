//! The configuration's closed sets of names, as serde enums: a value outside the set is a
//! parse error naming the key and the choices, and code matches them exhaustively.

use serde::Deserialize;

/// `[security].data_plane`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataPlaneMode {
    /// Encrypted and authenticated with node certificates.
    #[default]
    Tls,
    /// Authenticated by the cluster secret only.
    Secret,
}

/// `[node].log_format`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

pub use crate::args::{DataName, ModelName};

/// A revocation source in `[revocation].sources`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceName {
    /// AWS IMDSv2 spot notices and rebalance recommendations.
    Aws,
    /// GCP preemption.
    Gcp,
    /// Azure scheduled events.
    Azure,
}

/// `[revocation].sources`: `"auto"` (the default: probe the metadata services and watch the
/// one that answers), `"none"` (watch nothing: an explicit choice, never a default), or a
/// non-empty list of sources.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Sources {
    /// Detect the cloud at startup.
    #[default]
    Auto,
    /// Watch no metadata service (SIGTERM still drains).
    None,
    /// Exactly these.
    These(Vec<SourceName>),
}

impl<'de> Deserialize<'de> for Sources {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Sources, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Sources;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"auto\", \"none\" or a list of \"aws\", \"gcp\", \"azure\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Sources, E> {
                match v {
                    "auto" => Ok(Sources::Auto),
                    "none" => Ok(Sources::None),
                    other => Err(E::custom(format!(
                        "{other:?} is not \"auto\" or \"none\" (a single source is written as a list: [{other:?}])"
                    ))),
                }
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Sources, A::Error> {
                let mut list = Vec::new();
                while let Some(s) = seq.next_element::<SourceName>()? {
                    if !list.contains(&s) {
                        list.push(s);
                    }
                }
                if list.is_empty() {
                    return Err(serde::de::Error::custom(
                        "an empty list: write sources = \"none\" to watch no metadata service, or leave the key out to detect the cloud",
                    ));
                }
                Ok(Sources::These(list))
            }
        }
        d.deserialize_any(V)
    }
}

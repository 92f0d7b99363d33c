//! `[security]`: the node's certificates (or `insecure = true`), and where an EC2 host
//! fetches them from at first boot.

use super::{ConfigError, DataPlaneMode};
use serde::Deserialize;
use std::path::PathBuf;

/// `[security]`: mutual TLS with certificates of the cluster CA (`limpet certs`), or, said
/// in so many words, none.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct SecuritySection {
    /// Run without certificates: anyone who reaches the ports and knows the cluster secret
    /// is a member, and traffic is plain text. For a network you trust only.
    #[serde(default)]
    pub insecure: bool,
    /// The cluster CA's certificate.
    pub ca: Option<PathBuf>,
    /// This node's certificate (`limpet certs issue NAME --id ID`).
    pub cert: Option<PathBuf>,
    /// Its private key.
    pub key: Option<PathBuf>,
    /// Let clients without a certificate read status (drain and revoke always need one).
    #[serde(default)]
    pub anonymous_status: bool,
    /// Data-plane connections: `tls` (encrypted and authenticated, the default) or `secret`
    /// (authenticated by the cluster secret only, for a trusted network where encryption
    /// would cost gradient bandwidth).
    #[serde(default)]
    pub data_plane: DataPlaneMode,
    /// Where an EC2 host's first boot reads its certificate, key and the cluster secret
    /// (`limpetd fetch-credentials`): SSM Parameter Store, written by `limpet fleet up
    /// --certs`.
    pub ssm: Option<SsmSection>,
}

/// `[security.ssm]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct SsmSection {
    /// The cluster's parameter prefix (`limpet fleet up --ssm-prefix`, default
    /// `/limpet/CLUSTER`).
    pub prefix: String,
    /// The region (default: `[cluster].ec2_region`, else the instance's).
    pub region: Option<String>,
    /// How long to wait for the parameters to appear (they are written just after the
    /// instance is launched).
    #[serde(default = "default_ssm_wait")]
    pub wait_secs: u64,
}

fn default_ssm_wait() -> u64 {
    600
}

impl SecuritySection {
    /// Loads and checks the certificates for node `node`; errors name the key and the file.
    pub fn load(&self, file: &str, node: u64) -> Result<limpet_consensus::tls::Tls, ConfigError> {
        use limpet_consensus::tls::{Role, Tls, TlsError, TlsFiles};
        let need = |key: &str, v: &Option<PathBuf>| {
            v.clone().ok_or_else(|| {
                ConfigError::new(
                    file,
                    &format!("[security].{key}"),
                    "missing: set ca, cert and key (limpet certs init / issue), or insecure = true",
                )
            })
        };
        let files = TlsFiles {
            ca: need("ca", &self.ca)?,
            cert: need("cert", &self.cert)?,
            key: need("key", &self.key)?,
        };
        let key_of = |what: &str| match what {
            "CA certificate" => "[security].ca",
            "private key" => "[security].key",
            _ => "[security].cert",
        };
        let mut tls = Tls::load(&files).map_err(|e| {
            let what = match &e {
                TlsError::Read { what, .. } | TlsError::Bad { what, .. } => *what,
            };
            ConfigError::new(file, key_of(what), e.to_string())
        })?;
        if tls.role() != Some(Role::Node) {
            return Err(ConfigError::new(
                file,
                "[security].cert",
                format!(
                    "{} is an operator certificate; limpetd needs a node certificate (limpet certs issue NAME)",
                    files.cert.display()
                ),
            ));
        }
        // A certificate speaks for one node: another node's would be refused by every peer.
        if let Some(bound) = tls.node_id().filter(|&id| id != node) {
            return Err(ConfigError::new(
                file,
                "[security].cert",
                format!(
                    "{} is node {bound}'s certificate, but this node is node {node} ([node].id, or its \
                     name's id): issue its own with `limpet certs issue NAME --id {node}`",
                    files.cert.display()
                ),
            ));
        }
        tls.anonymous_reads = self.anonymous_status;
        Ok(tls)
    }
}

//! A cluster's mutual TLS: the CA, this process's certificate and key, and what a peer's
//! certificate allows.
//!
//! Every certificate is issued by the cluster's CA (`limpet certs`). A *node* certificate
//! carries the DNS name `limpet-node` (and the node's own name) and the URI
//! `urn:limpet:node:<id>` binding it to one node id: it may speak raft, send heartbeats, join
//! and carry data-plane traffic, each only as that node. An *operator* certificate carries
//! `limpet-client`: it may read and propose the operator's commands (drain, revoke, remove)
//! but never speak as a node. An *on-call* certificate carries `limpet-oncall`: for
//! day-to-day use, it may read and drain, and nothing else. Clients check that the server they reach holds a node
//! certificate of the same CA, so every connection is authenticated both ways.
//!
//! The same material configures tonic's rustls (control plane) and plain rustls connections
//! (data plane), both with the aws-lc-rs provider.

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::RootCertStore;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The DNS name every node certificate holds (and clients expect of a server).
pub const NODE_NAME: &str = "limpet-node";
/// How long a control-plane client has to finish its TLS handshake.
pub const GRPC_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The DNS name every operator (client) certificate holds.
pub const CLIENT_NAME: &str = "limpet-client";

/// The DNS name every on-call certificate (read and drain only) holds.
pub const ONCALL_NAME: &str = "limpet-oncall";

/// The prefix of the URI that binds a node certificate to its node id.
pub const NODE_URI_PREFIX: &str = "urn:limpet:node:";

/// The URI naming node `id` in its certificate.
pub fn node_uri(id: u64) -> String {
    format!("{NODE_URI_PREFIX}{id}")
}

/// Who a verified certificate says its holder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// What it may do.
    pub role: Role,
    /// The node a node certificate is bound to; `None` for an operator.
    pub node: Option<u64>,
}

/// What a certificate allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A cluster member.
    Node,
    /// An operator's command line.
    Operator,
    /// An on-call operator's command line: reads and drains only.
    OnCall,
}

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{what} {}: {source}", path.display())]
    Read {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file's contents are not what they should be.
    #[error("{what} {}: {detail}", path.display())]
    Bad {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

/// The files of one identity.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsFiles {
    /// The cluster CA's certificate (PEM).
    pub ca: PathBuf,
    /// This identity's certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8).
    pub key: PathBuf,
}

/// Loaded, checked TLS material: the CA and, except for an anonymous reader, one identity.
pub struct Tls {
    ca_pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    identity: Option<Identity>,
    /// Whether a client without a certificate may read (status); writes always need one.
    pub anonymous_reads: bool,
}

struct Identity {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    role: Role,
    node: Option<u64>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("role", &self.role())
            .field("anonymous_reads", &self.anonymous_reads)
            .finish()
    }
}

fn no_identity() -> rustls::Error {
    rustls::Error::General("the data plane needs a node certificate".into())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The PEM certificates in `pem` (at least one); `what` and `path` name the file in errors.
fn certs_of(what: &'static str, pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let bad = |detail: String| TlsError::Bad { what, path: path.to_path_buf(), detail };
    let all = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
    if all.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(all)
}

/// The trust roots of a CA file.
fn roots_of(pem: &[u8], path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs_of("CA certificate", pem, path)? {
        roots.add(c).map_err(|e| TlsError::Bad {
            what: "CA certificate",
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

/// A certificate's fingerprint as revocations name it: SHA-256 of its DER bytes, 64
/// lowercase hex digits (`openssl x509 -fingerprint -sha256`, without the colons).
pub fn fingerprint(cert: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(cert).iter().map(|b| format!("{b:02x}")).collect()
}

/// The role a (verified) certificate grants, from the names it is valid for.
pub fn role_of(cert: &CertificateDer<'_>) -> Option<Role> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    let valid_for = |name: &'static str| {
        let name = ServerName::try_from(name).expect("a valid DNS name");
        ee.verify_is_valid_for_subject_name(&name).is_ok()
    };
    if valid_for(NODE_NAME) {
        Some(Role::Node)
    } else if valid_for(CLIENT_NAME) {
        Some(Role::Operator)
    } else if valid_for(ONCALL_NAME) {
        Some(Role::OnCall)
    } else {
        None
    }
}

/// Who a (verified) certificate names: its role and, for a node, its node id. A node
/// certificate without exactly one valid id URI is not a node's (it could speak as anyone).
pub fn peer_of(cert: &CertificateDer<'_>) -> Option<Peer> {
    let role = role_of(cert)?;
    if role != Role::Node {
        return Some(Peer { role, node: None });
    }
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    let mut ids = ee.valid_uri_names().filter_map(|u| u.strip_prefix(NODE_URI_PREFIX));
    match (ids.next().map(str::parse::<u64>), ids.next()) {
        (Some(Ok(id)), None) if id != 0 => Some(Peer { role, node: Some(id) }),
        _ => None,
    }
}

impl Tls {
    /// Reads and checks the three files: the certificate must be issued by the CA, be valid
    /// now, and be a node or operator certificate.
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let read = |what: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.to_path_buf(), source })
        };
        Tls::from_pem(
            (read("CA certificate", &files.ca)?, &files.ca),
            (read("certificate", &files.cert)?, &files.cert),
            (read("private key", &files.key)?, &files.key),
        )
    }

    /// Only the CA: a client that verifies the nodes but presents no certificate (it may
    /// read status where the nodes allow anonymous reads).
    pub fn ca_only(ca: &Path) -> Result<Tls, TlsError> {
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let ca_pem = std::fs::read(ca).map_err(|source| TlsError::Read {
            what: "CA certificate",
            path: ca.to_path_buf(),
            source,
        })?;
        let roots = roots_of(&ca_pem, ca)?;
        Ok(Tls { ca_pem, roots, identity: None, anonymous_reads: false })
    }

    /// Like `load`, from PEM bytes; the paths only name the sources in errors.
    pub fn from_pem(
        (ca_pem, ca_path): (Vec<u8>, &Path),
        (cert_pem, cert_path): (Vec<u8>, &Path),
        (key_pem, key_path): (Vec<u8>, &Path),
    ) -> Result<Tls, TlsError> {
        use rustls::pki_types::pem::PemObject;
        // tonic builds its rustls configurations from the process-wide provider when one is
        // installed; make it the one this module uses (a second install is a no-op).
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let bad = |what: &'static str, path: &Path, detail: String| TlsError::Bad {
            what,
            path: path.to_path_buf(),
            detail,
        };
        let roots = roots_of(&ca_pem, ca_path)?;
        let chain = certs_of("certificate", &cert_pem, cert_path)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| bad("private key", key_path, format!("not a PEM private key: {e}")))?;
        // The same check a peer will make, so a wrong, foreign or expired certificate stops
        // the process at start with its reason instead of failing every connection later.
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| bad("CA certificate", ca_path, e.to_string()))?;
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .map_err(|e| bad("certificate", cert_path, format!("{e} (against CA {})", ca_path.display())))?;
        let role = role_of(&chain[0]).ok_or_else(|| {
            bad(
                "certificate",
                cert_path,
                format!("is for none of {NODE_NAME:?}, {CLIENT_NAME:?} and {ONCALL_NAME:?}"),
            )
        })?;
        let node = peer_of(&chain[0]).and_then(|p| p.node);
        if role == Role::Node && node.is_none() {
            return Err(bad(
                "certificate",
                cert_path,
                format!(
                    "is a node certificate without its node id (one {NODE_URI_PREFIX}<id> URI); \
                     issue it again with `limpet certs issue NAME --id ID`"
                ),
            ));
        }
        // The key must be the certificate's: a mismatch would only show as failed handshakes.
        let signing = provider()
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| bad("private key", key_path, e.to_string()))?;
        let certified = rustls::sign::CertifiedKey::new(chain.clone(), signing);
        if let Err(e) = certified.keys_match() {
            return Err(bad("private key", key_path, format!("does not match {}: {e}", cert_path.display())));
        }
        Ok(Tls {
            ca_pem,
            roots,
            identity: Some(Identity { cert_pem, key_pem, chain, key, role, node }),
            anonymous_reads: false,
        })
    }

    /// What this identity's certificate allows (`None`: no certificate).
    pub fn role(&self) -> Option<Role> {
        self.identity.as_ref().map(|i| i.role)
    }

    /// The node id this identity's certificate is bound to (a node certificate's).
    pub fn node_id(&self) -> Option<u64> {
        self.identity.as_ref().and_then(|i| i.node)
    }

    /// tonic's server configuration: a node certificate, clients verified against the CA
    /// (optional only when anonymous reads are allowed; each call checks its own needs).
    pub fn grpc_server(&self) -> tonic::transport::ServerTlsConfig {
        let mut cfg = tonic::transport::ServerTlsConfig::new();
        if let Some(i) = &self.identity {
            cfg = cfg.identity(tonic::transport::Identity::from_pem(&i.cert_pem, &i.key_pem));
        }
        cfg.client_ca_root(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(self.anonymous_reads)
            // A client that trickles its hello must not hold the connection (and a slot of
            // the server's connection cap) longer than this.
            .timeout(GRPC_HANDSHAKE_TIMEOUT)
    }

    /// tonic's client configuration: this identity, and servers must hold a node certificate
    /// of the CA.
    pub fn grpc_client(&self) -> tonic::transport::ClientTlsConfig {
        let cfg = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .domain_name(NODE_NAME);
        match &self.identity {
            Some(i) => cfg.identity(tonic::transport::Identity::from_pem(&i.cert_pem, &i.key_pem)),
            None => cfg,
        }
    }

    /// A rustls server configuration for data-plane connections: peers must present a
    /// certificate of the CA (the caller checks it is a node's with `role_of`).
    pub fn data_server(&self) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
        let id = self.identity.as_ref().ok_or_else(no_identity)?;
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(id.chain.clone(), id.key.clone_key())?;
        // Connections are never resumed; tickets would only be bytes in the way.
        cfg.send_tls13_tickets = 0;
        Ok(Arc::new(cfg))
    }

    /// A rustls client configuration for data-plane connections (servers must hold a node
    /// certificate of the CA).
    pub fn data_client(&self) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
        let id = self.identity.as_ref().ok_or_else(no_identity)?;
        let cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(id.chain.clone(), id.key.clone_key())?;
        Ok(Arc::new(cfg))
    }
}

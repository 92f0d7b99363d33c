//! `limpet certs`: a cluster's CA and the certificates it issues (rcgen), as PEM files.
//!
//! `init` writes `ca.pem` and `ca.key` into a directory; `issue NAME` writes `NAME.pem` and
//! `NAME.key` signed by that CA: a node certificate (names `limpet-node` and NAME, and the
//! URI `urn:limpet:node:ID` binding it to its node id, for limpetd) or, with `--client`, an
//! operator certificate (names `limpet-client` and NAME, for the command line), or with
//! `--on-call` an on-call operator's (names `limpet-oncall` and NAME: status and drain only).
//! Keys are ECDSA P-256, written with mode 0600, and nothing existing is overwritten.

use anyhow::Context;
use clap::{Args, Subcommand};
use limpet_consensus::state::{node_id_of_name, NodeId};
use limpet_consensus::tls::{node_uri, Role, CLIENT_NAME, NODE_NAME, ONCALL_NAME};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

/// `limpet certs ...`.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Create the cluster's CA in DIR (ca.pem, ca.key).
    Init(InitArgs),
    /// Issue a node certificate (or, with --client, an operator's) signed by the CA in DIR.
    Issue(IssueArgs),
    /// Issue NAME's certificate again, for the same node or operator, valid from now.
    Renew(RenewArgs),
    /// Revoke a certificate: every node of the cluster refuses it from now on (an operator's
    /// certificate proposes it).
    Revoke(crate::propose_cmd::RevokeCertArgs),
}

/// `limpet certs renew`.
#[derive(Debug, Args)]
pub struct RenewArgs {
    /// The name the certificate was issued to (DIR/NAME.pem).
    pub name: String,
    /// The directory with the CA and the certificate.
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// How long the new certificate is valid.
    #[arg(long, default_value_t = DEFAULT_DAYS, value_parser = clap::value_parser!(u32).range(1..=MAX_DAYS))]
    pub days: u32,
    /// Print the files written as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The longest validity `--days` takes (a hundred years): past it the end date leaves what
/// a certificate can carry.
const MAX_DAYS: i64 = 36_500;

/// How long a node's or an operator's certificate is valid unless `--days` says: short, so a
/// lost one stops working soon (`limpet certs renew` issues the next).
pub const DEFAULT_DAYS: u32 = 90;

/// `limpet certs init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// Where the CA's files go (created if missing).
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// The cluster's name (in the CA's subject).
    #[arg(long, default_value = "limpet")]
    pub cluster: String,
    /// How long the CA is valid.
    #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=MAX_DAYS))]
    pub days: u32,
    /// Print the files written as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `limpet certs issue`.
#[derive(Debug, Args)]
pub struct IssueArgs {
    /// The node's name (as in its `[node].name`) or the operator's.
    pub name: String,
    /// The directory with the CA (the new files go there too).
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// An operator's certificate for the command line instead of a node's.
    #[arg(long)]
    pub client: bool,
    /// An on-call operator's certificate: it may read status and drain hosts, but not
    /// revoke or remove them (for day-to-day use; keep a --client one for the rest).
    #[arg(long, conflicts_with = "client")]
    pub on_call: bool,
    /// The node id the certificate is bound to: the node's `[node].id` (default: the id a
    /// node of this name gets when its configuration sets none).
    #[arg(long, conflicts_with_all = ["client", "on_call"], value_parser = clap::value_parser!(u64).range(1..))]
    pub id: Option<u64>,
    /// How long the certificate is valid.
    #[arg(long, default_value_t = DEFAULT_DAYS, value_parser = clap::value_parser!(u32).range(1..=MAX_DAYS))]
    pub days: u32,
    /// Print the files written as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Which kind of certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// limpetd's, bound to its node id.
    Node(NodeId),
    /// An operator's.
    Client,
    /// An on-call operator's (status and drain only).
    OnCall,
}

/// Runs `limpet certs`.
pub fn run(cmd: CertsCommand) -> crate::Result<()> {
    match cmd {
        CertsCommand::Init(a) => {
            let (cert, key) = init(&a.dir, &a.cluster, a.days)?;
            if a.json {
                let doc = serde_json::json!({
                    "kind": "ca", "cluster": a.cluster, "cert": cert, "key": key, "days": a.days,
                });
                println!("{doc}");
            } else {
                println!("CA created: {} (key {})", cert.display(), key.display());
            }
        }
        CertsCommand::Revoke(a) => crate::propose_cmd::revoke_certificate(a)?,
        CertsCommand::Renew(a) => {
            check_name(&a.name)?;
            let (cert, key) = (a.dir.join(format!("{}.pem", a.name)), a.dir.join(format!("{}.key", a.name)));
            let kind = kind_of(&cert)?;
            let (cert_pem, key_pem) = issue_pem_for_days(&a.dir, &a.name, kind, a.days)?;
            // Written beside the old pair, then renamed over it: a failure leaves the old.
            for (path, pem, private) in [(&key, &key_pem, true), (&cert, &cert_pem, false)] {
                let new = path.with_extension(format!(
                    "{}.new",
                    path.extension().and_then(|e| e.to_str()).unwrap_or("")
                ));
                let _ = std::fs::remove_file(&new);
                write_new(&new, pem, private)?;
                std::fs::rename(&new, path).with_context(|| format!("replacing {}", path.display()))?;
            }
            announce(a.json, kind, &a.name, &cert, &key, a.days, "renewed");
        }
        CertsCommand::Issue(a) => {
            let kind = match (a.client, a.on_call, a.id) {
                (true, _, _) => Kind::Client,
                (_, true, _) => Kind::OnCall,
                (false, false, id) => Kind::Node(id.unwrap_or_else(|| node_id_of_name(&a.name))),
            };
            let (cert, key) = issue_for_days(&a.dir, &a.name, kind, a.days)?;
            announce(a.json, kind, &a.name, &cert, &key, a.days, "issued");
        }
    }
    Ok(())
}

/// Which kind of certificate the PEM file at `path` is (a node's, with its id, or an
/// operator's), as the nodes read it.
fn kind_of(path: &Path) -> crate::Result<Kind> {
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_file(path)
        .map_err(|e| usage(format!("{}: not a certificate ({e})", path.display())))?;
    match limpet_consensus::tls::peer_of(&cert) {
        Some(p) if p.role == Role::Operator => Ok(Kind::Client),
        Some(p) if p.role == Role::OnCall => Ok(Kind::OnCall),
        Some(limpet_consensus::tls::Peer { node: Some(id), .. }) => Ok(Kind::Node(id)),
        _ => Err(usage(format!("{}: neither a node's nor an operator's certificate", path.display()))),
    }
}

/// Says what was written: `what` is "issued" or "renewed".
fn announce(json: bool, kind: Kind, name: &str, cert: &Path, key: &Path, days: u32, what: &str) {
    if json {
        let (kind, id) = match kind {
            Kind::Node(id) => ("node", Some(id)),
            Kind::Client => ("client", None),
            Kind::OnCall => ("on-call", None),
        };
        let doc = serde_json::json!({
            "kind": kind, "name": name, "node_id": id, "cert": cert, "key": key, "days": days, "action": what,
        });
        println!("{doc}");
    } else {
        let who = match kind {
            Kind::Node(id) => format!("node certificate for {name:?} (node id {id})"),
            Kind::Client => format!("operator certificate for {name:?}"),
            Kind::OnCall => format!("on-call certificate for {name:?} (status and drain only)"),
        };
        println!("{who} {what}, valid {days} days: {} (key {})", cert.display(), key.display());
    }
}

fn usage(msg: String) -> crate::Failure {
    crate::UsageError(msg).into()
}

fn check_name(name: &str) -> crate::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !ok {
        return Err(usage(format!(
            "name {name:?}: use letters, digits and inner hyphens (at most 63), as in a host name"
        )));
    }
    if name == NODE_NAME || name == CLIENT_NAME || name == ONCALL_NAME || name == "ca" {
        return Err(usage(format!("name {name:?} is reserved")));
    }
    Ok(())
}

/// Writes `contents` to a new file (never over an existing one), private to its owner when
/// `private`.
fn write_new(path: &Path, contents: &str, private: bool) -> crate::Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => {
            usage(format!("{} exists; remove it first to replace it", path.display()))
        }
        _ => anyhow::Error::new(e).context(format!("creating {}", path.display())).into(),
    })?;
    f.write_all(contents.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Creates the CA in `dir`; returns its certificate's and key's paths.
pub fn init(dir: &Path, cluster: &str, days: u32) -> crate::Result<(PathBuf, PathBuf)> {
    if days == 0 {
        return Err(usage("--days must be at least 1".into()));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            return Err(usage(format!("{} exists; this directory already has a CA", p.display())));
        }
    }
    let key = KeyPair::generate().context("generating the CA key")?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("limpet CA for cluster {cluster}"));
    dn.push(DnType::OrganizationName, "limpet");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(days.into());
    let cert = params.self_signed(&key).context("signing the CA certificate")?;
    write_new(&key_path, &key.serialize_pem(), true)?;
    write_new(&cert_path, &cert.pem(), false)?;
    Ok((cert_path, key_path))
}

/// Issues a certificate for `name` valid from now (less five minutes of clock skew) for
/// `days`.
pub fn issue_for_days(dir: &Path, name: &str, kind: Kind, days: u32) -> crate::Result<(PathBuf, PathBuf)> {
    let now = OffsetDateTime::now_utc();
    issue(dir, name, kind, now - Duration::minutes(5), now + Duration::days(days.into()))
}

/// Issues a certificate for `name` valid from `not_before` to `not_after`, signed by the CA
/// in `dir`; returns its certificate's and key's paths.
pub fn issue(
    dir: &Path,
    name: &str,
    kind: Kind,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> crate::Result<(PathBuf, PathBuf)> {
    // The name becomes a file name: checked before it is joined to a path.
    check_name(name)?;
    let (cert_path, key_path) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            return Err(usage(format!("{} exists; remove it first to issue {name:?} again", p.display())));
        }
    }
    let (cert, key) = issue_pem(dir, name, kind, not_before, not_after)?;
    write_new(&key_path, &key, true)?;
    write_new(&cert_path, &cert, false)?;
    Ok((cert_path, key_path))
}

/// Issues a certificate for `name` valid for `days` from now (less five minutes of clock
/// skew), signed by the CA in `dir`, without writing it anywhere: (certificate, key) as PEM.
pub fn issue_pem_for_days(dir: &Path, name: &str, kind: Kind, days: u32) -> crate::Result<(String, String)> {
    let now = OffsetDateTime::now_utc();
    issue_pem(dir, name, kind, now - Duration::minutes(5), now + Duration::days(days.into()))
}

fn issue_pem(
    dir: &Path,
    name: &str,
    kind: Kind,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> crate::Result<(String, String)> {
    check_name(name)?;
    if not_after <= not_before {
        return Err(usage("the certificate would never be valid (--days must be at least 1)".into()));
    }
    let (ca_cert, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .with_context(|| format!("reading {} (run `limpet certs init` first?)", p.display()))
    };
    let ca_key = KeyPair::from_pem(&read(&ca_key)?)
        .with_context(|| format!("{}: not a PEM private key", ca_key.display()))?;
    let issuer = Issuer::from_ca_cert_pem(&read(&ca_cert)?, ca_key)
        .with_context(|| format!("{}: not a PEM CA certificate", ca_cert.display()))?;
    let role_name = match kind {
        Kind::Node(_) => NODE_NAME,
        Kind::Client => CLIENT_NAME,
        Kind::OnCall => ONCALL_NAME,
    };
    let mut params =
        CertificateParams::new(vec![role_name.to_string(), name.to_string()]).context("certificate names")?;
    if let Kind::Node(id) = kind {
        if id == 0 {
            return Err(usage("node id 0 is not a node's (--id must be at least 1)".into()));
        }
        let uri = rcgen::string::Ia5String::try_from(node_uri(id)).context("the node id URI")?;
        params.subject_alt_names.push(rcgen::SanType::URI(uri));
    }
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    let unit = match kind {
        Kind::Node(_) => "node",
        Kind::Client => "operator",
        Kind::OnCall => "on-call",
    };
    dn.push(DnType::OrganizationalUnitName, unit);
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = match kind {
        // A node is a server to its peers and a client of them.
        Kind::Node(_) => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        Kind::Client | Kind::OnCall => vec![ExtendedKeyUsagePurpose::ClientAuth],
    };
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    let key = KeyPair::generate().context("generating the key")?;
    let cert = params.signed_by(&key, &issuer).context("signing the certificate")?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use limpet_consensus::tls::{Role, Tls, TlsFiles};

    fn files(dir: &Path, name: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }

    #[test]
    fn issued_certificates_load_with_their_roles() {
        let d = tempfile::tempdir().unwrap();
        init(d.path(), "t", 10).unwrap();
        let now = OffsetDateTime::now_utc();
        issue(d.path(), "node-1", Kind::Node(1), now - Duration::minutes(1), now + Duration::days(1))
            .unwrap();
        issue(d.path(), "alice", Kind::Client, now - Duration::minutes(1), now + Duration::days(1)).unwrap();
        assert_eq!(Tls::load(&files(d.path(), "node-1")).unwrap().role(), Some(Role::Node));
        assert_eq!(Tls::load(&files(d.path(), "node-1")).unwrap().node_id(), Some(1));
        assert_eq!(Tls::load(&files(d.path(), "alice")).unwrap().node_id(), None);
        assert_eq!(Tls::load(&files(d.path(), "alice")).unwrap().role(), Some(Role::Operator));
        issue(d.path(), "pager", Kind::OnCall, now - Duration::minutes(1), now + Duration::days(1)).unwrap();
        let pager = Tls::load(&files(d.path(), "pager")).unwrap();
        assert_eq!((pager.role(), pager.node_id()), (Some(Role::OnCall), None));
        let mode = std::fs::metadata(d.path().join("alice.key")).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    }

    #[test]
    fn wrong_ca_expired_and_mismatched_keys_are_refused_at_load() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        init(a.path(), "a", 10).unwrap();
        init(b.path(), "b", 10).unwrap();
        let now = OffsetDateTime::now_utc();
        issue(a.path(), "n1", Kind::Node(1), now - Duration::minutes(1), now + Duration::days(1)).unwrap();
        issue(a.path(), "old", Kind::Node(9), now - Duration::days(3), now - Duration::days(1)).unwrap();
        issue(a.path(), "n2", Kind::Node(2), now - Duration::minutes(1), now + Duration::days(1)).unwrap();
        // Another cluster's CA.
        let e = Tls::load(&TlsFiles { ca: b.path().join("ca.pem"), ..files(a.path(), "n1") }).unwrap_err();
        assert!(e.to_string().contains("UnknownIssuer"), "{e}");
        // Expired.
        let e = Tls::load(&files(a.path(), "old")).unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
        assert!(e.to_string().contains("old.pem"), "{e}");
        // n1's certificate with n2's key.
        let e = Tls::load(&TlsFiles { key: a.path().join("n2.key"), ..files(a.path(), "n1") }).unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");
        // Not PEM at all.
        std::fs::write(a.path().join("junk.pem"), "hello").unwrap();
        let e =
            Tls::load(&TlsFiles { cert: a.path().join("junk.pem"), ..files(a.path(), "n1") }).unwrap_err();
        assert!(e.to_string().contains("junk.pem") && e.to_string().contains("no certificate"), "{e}");
    }

    #[test]
    fn a_node_certificate_without_its_node_id_is_refused_at_load() {
        // What `issue` made before certificates were bound to ids: the node name only.
        let d = tempfile::tempdir().unwrap();
        init(d.path(), "t", 10).unwrap();
        let ca_key = KeyPair::from_pem(&std::fs::read_to_string(d.path().join("ca.key")).unwrap()).unwrap();
        let issuer =
            Issuer::from_ca_cert_pem(&std::fs::read_to_string(d.path().join("ca.pem")).unwrap(), ca_key)
                .unwrap();
        let mut params = CertificateParams::new(vec![NODE_NAME.to_string(), "n1".to_string()]).unwrap();
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(d.path().join("n1.pem"), cert.pem()).unwrap();
        std::fs::write(d.path().join("n1.key"), key.serialize_pem()).unwrap();
        let e = Tls::load(&files(d.path(), "n1")).unwrap_err().to_string();
        assert!(e.contains("without its node id") && e.contains("--id"), "{e}");
    }

    #[test]
    fn nothing_is_overwritten_and_bad_names_are_refused() {
        let d = tempfile::tempdir().unwrap();
        init(d.path(), "t", 10).unwrap();
        let e = init(d.path(), "t", 10).unwrap_err();
        assert!(e.to_string().contains("already has a CA"), "{e}");
        let now = OffsetDateTime::now_utc();
        issue(d.path(), "n1", Kind::Node(1), now, now + Duration::days(1)).unwrap();
        let before = std::fs::read(d.path().join("n1.key")).unwrap();
        let e = issue(d.path(), "n1", Kind::Node(1), now, now + Duration::days(1)).unwrap_err();
        assert!(e.to_string().contains("exists"), "{e}");
        assert_eq!(std::fs::read(d.path().join("n1.key")).unwrap(), before);
        for bad in ["", "a b", "../x", "-x", "limpet-node", "ca"] {
            assert!(issue(d.path(), bad, Kind::Node(1), now, now + Duration::days(1)).is_err(), "{bad:?}");
        }
        let e = issue(tempfile::tempdir().unwrap().path(), "n2", Kind::Node(2), now, now + Duration::days(1))
            .unwrap_err();
        assert!(format!("{e:#}").contains("limpet certs init"), "{e:#}");
    }

    /// Renewing keeps what the certificate is (the node and its id, or an operator) and
    /// writes a new one.
    #[test]
    fn renewing_issues_the_same_kind_again() {
        let d = tempfile::tempdir().unwrap();
        init(d.path(), "c", 10).unwrap();
        issue_for_days(d.path(), "node-7", Kind::Node(7), 1).unwrap();
        issue_for_days(d.path(), "alice", Kind::Client, 1).unwrap();
        issue_for_days(d.path(), "pager", Kind::OnCall, 1).unwrap();
        let before = std::fs::read(d.path().join("node-7.pem")).unwrap();
        for name in ["node-7", "alice", "pager"] {
            let a = RenewArgs { name: name.into(), dir: d.path().to_path_buf(), days: 30, json: true };
            run(CertsCommand::Renew(a)).unwrap();
        }
        assert_ne!(std::fs::read(d.path().join("node-7.pem")).unwrap(), before);
        assert_eq!(kind_of(&d.path().join("node-7.pem")).unwrap(), Kind::Node(7));
        assert_eq!(kind_of(&d.path().join("alice.pem")).unwrap(), Kind::Client);
        assert_eq!(kind_of(&d.path().join("pager.pem")).unwrap(), Kind::OnCall);
        let missing = RenewArgs { name: "bob".into(), dir: d.path().to_path_buf(), days: 30, json: true };
        assert!(run(CertsCommand::Renew(missing)).is_err());
    }
}

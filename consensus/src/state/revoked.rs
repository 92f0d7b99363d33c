//! Revoked certificates: the SHA-256 fingerprints (of the DER bytes, as `openssl x509
//! -fingerprint -sha256` prints them, lowercase without colons) of certificates the cluster
//! no longer accepts. An operator revokes one (`limpet certs revoke`); every node then refuses
//! it on the control plane (each call) and the data plane (each handshake).

use super::{Invalid, Refused};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most revoked certificates the state keeps (each entry is bounded too): a full list
/// refuses more rather than grow the replicated state without end. Rotate the CA instead.
pub const MAX_REVOKED: usize = 4096;
/// The longest name a revocation may carry.
const MAX_NAME: usize = 128;

/// The revoked certificates, by fingerprint, with the name they were issued to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Revoked(pub BTreeMap<String, String>);

/// Whether `s` is a fingerprint as the state keeps it: 64 lowercase hex digits.
pub fn is_fingerprint(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Revoked {
    /// Whether nothing is revoked.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the certificate with this fingerprint is revoked.
    pub fn contains(&self, fingerprint: &str) -> bool {
        self.0.contains_key(fingerprint)
    }

    /// Revokes a certificate; refused (unchanged) for a malformed entry or a full list.
    pub fn apply(&mut self, fingerprint: &str, name: &str) -> super::Outcome {
        if !is_fingerprint(fingerprint) {
            return Err(Refused(format!(
                "{fingerprint:?} is not a SHA-256 fingerprint (64 lowercase hex digits)"
            )));
        }
        if name.len() > MAX_NAME {
            return Err(Refused(format!("a name of {} bytes (at most {MAX_NAME})", name.len())));
        }
        if self.0.contains_key(fingerprint) {
            return Ok(format!("certificate {fingerprint} was already revoked"));
        }
        if self.0.len() >= MAX_REVOKED {
            return Err(Refused(format!("{MAX_REVOKED} certificates are revoked already: rotate the CA")));
        }
        self.0.insert(fingerprint.to_string(), name.to_string());
        Ok(format!("certificate {fingerprint} ({name}) revoked"))
    }

    /// Checks a decoded list (a snapshot's).
    pub fn validate(&self) -> Result<(), super::Invalid> {
        if self.0.len() > MAX_REVOKED {
            return Err(Invalid(format!("{} revoked certificates (at most {MAX_REVOKED})", self.0.len())));
        }
        match self.0.iter().find(|(f, n)| !is_fingerprint(f) || n.len() > MAX_NAME) {
            Some((f, _)) => Err(Invalid(format!("a revoked certificate's entry {f:?} is malformed"))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_checked_and_the_list_is_bounded() {
        let mut r = Revoked::default();
        let fp = "ab".repeat(32);
        assert!(r.apply("AB".repeat(32).as_str(), "x").is_err());
        assert!(r.apply(&fp[..62], "x").is_err());
        assert!(r.apply(&fp, &"n".repeat(200)).is_err());
        assert!(r.apply(&fp, "op2").unwrap().contains("revoked"));
        assert!(r.contains(&fp) && r.validate().is_ok());
        assert!(r.apply(&fp, "op2").unwrap().contains("already"));
        for i in 1..MAX_REVOKED {
            r.apply(&format!("{i:064x}"), "n").unwrap();
        }
        assert!(r.apply(&"cd".repeat(32), "one too many").unwrap_err().0.contains("rotate the CA"));
        r.0.insert("zz".into(), "bad".into());
        assert!(r.validate().is_err());
    }
}

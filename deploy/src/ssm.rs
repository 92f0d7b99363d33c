//! Credentials for EC2 hosts through SSM Parameter Store: `limpet fleet up --certs` issues
//! each launched instance its node certificate and stores it, its key and the cluster secret
//! as parameters under the cluster's prefix; at first boot the host reads its own with the
//! instance role (`limpetd fetch-credentials`) and deletes its key's parameter. Keys never
//! travel in user data, which any local process can read from the metadata service.
//!
//! Layout under a prefix (default `/limpet/CLUSTER`):
//!
//! | parameter                | type         | holds                                  |
//! |--------------------------|--------------|----------------------------------------|
//! | `PREFIX/ca.pem`          | String       | the cluster CA's certificate           |
//! | `PREFIX/secret`          | SecureString | the cluster secret, base64             |
//! | `PREFIX/nodes/NAME/cert` | String       | node NAME's certificate                |
//! | `PREFIX/nodes/NAME/key`  | SecureString | its private key (deleted once fetched) |
//! | `PREFIX/spares/NAME`     | String       | NAME is a spare: issued, not yet taken  |
//!
//! Spares are credentials issued ahead (`limpet fleet spares`) for the hosts the leader's
//! reconciler launches: the CA's key stays with the operator, and each new host takes one
//! spare's name (the instance's `limpet:node` tag).

use crate::{api_error, sdk_config, FleetConfig, FleetError};
use aws_sdk_ssm::error::ProvideErrorMetadata;
use aws_sdk_ssm::types::ParameterType;
use base64::Engine;

/// A node's credentials as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCredentials {
    /// The cluster CA's certificate (PEM).
    pub ca_pem: String,
    /// The node's certificate (PEM).
    pub cert_pem: String,
    /// Its private key (PEM).
    pub key_pem: String,
    /// The cluster secret.
    pub secret: Vec<u8>,
}

/// One cluster's parameters.
pub struct Vault {
    client: aws_sdk_ssm::Client,
    prefix: String,
}

/// Checks a parameter prefix: absolute, SSM's characters only, no trailing slash.
pub fn check_prefix(prefix: &str) -> Result<(), FleetError> {
    let ok = prefix.len() > 1
        && prefix.len() <= 900
        && prefix.starts_with('/')
        && !prefix.ends_with('/')
        && !prefix.contains("//")
        && prefix.chars().all(|c| c.is_ascii_alphanumeric() || "/_.-".contains(c))
        // SSM reserves names that start with aws or ssm.
        && !["/aws", "/ssm"].iter().any(|r| prefix.to_ascii_lowercase().starts_with(r));
    if ok {
        Ok(())
    } else {
        Err(FleetError::Usage(format!(
            "SSM prefix {prefix:?}: use an absolute path of letters, digits, '_', '.', '-' and '/', \
             without a trailing '/', not under /aws or /ssm"
        )))
    }
}

/// The default prefix for a cluster.
pub fn default_prefix(cluster: &str) -> String {
    format!("/limpet/{cluster}")
}

impl Vault {
    /// A client for the parameters under `prefix`.
    pub async fn connect(prefix: &str, cfg: &FleetConfig) -> Result<Vault, FleetError> {
        check_prefix(prefix)?;
        let shared = sdk_config(cfg).await?;
        Ok(Vault { client: aws_sdk_ssm::Client::new(&shared), prefix: prefix.to_string() })
    }

    /// The full name of parameter `leaf`.
    pub fn name(&self, leaf: &str) -> String {
        format!("{}/{leaf}", self.prefix)
    }

    fn node_leaf(node: &str, what: &str) -> Result<String, FleetError> {
        if node.is_empty() || !node.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(FleetError::Usage(format!("node name {node:?} cannot name an SSM parameter")));
        }
        Ok(format!("nodes/{node}/{what}"))
    }

    async fn put(&self, leaf: &str, value: &str, secure: bool) -> Result<(), FleetError> {
        let kind = if secure { ParameterType::SecureString } else { ParameterType::String };
        self.client
            .put_parameter()
            .name(self.name(leaf))
            .value(value)
            .r#type(kind)
            .overwrite(true)
            .send()
            .await
            .map_err(|e| api_error("PutParameter", e))?;
        Ok(())
    }

    /// Stores what every node of the cluster shares: the CA's certificate and the secret.
    pub async fn put_cluster(&self, ca_pem: &str, secret: &[u8]) -> Result<(), FleetError> {
        self.put("ca.pem", ca_pem, false).await?;
        self.put("secret", &base64::engine::general_purpose::STANDARD.encode(secret), true).await
    }

    /// Stores node `node`'s certificate and key.
    pub async fn put_node(&self, node: &str, cert_pem: &str, key_pem: &str) -> Result<(), FleetError> {
        self.put(&Self::node_leaf(node, "cert")?, cert_pem, false).await?;
        self.put(&Self::node_leaf(node, "key")?, key_pem, true).await
    }

    /// One parameter's value, `None` while it does not exist.
    async fn get(&self, leaf: &str) -> Result<Option<String>, FleetError> {
        match self.client.get_parameter().name(self.name(leaf)).with_decryption(true).send().await {
            Ok(out) => Ok(out.parameter().and_then(|p| p.value()).map(String::from)),
            Err(e) if e.code() == Some("ParameterNotFound") => Ok(None),
            Err(e) => Err(api_error("GetParameter", e)),
        }
    }

    /// Node `node`'s credentials; `Err(missing)` names the first parameter that does not
    /// exist yet (the operator's `fleet up` writes them just after the launch).
    pub async fn fetch(&self, node: &str) -> Result<Result<NodeCredentials, String>, FleetError> {
        let mut values = Vec::new();
        for leaf in [
            "ca.pem".to_string(),
            "secret".into(),
            Self::node_leaf(node, "cert")?,
            Self::node_leaf(node, "key")?,
        ] {
            match self.get(&leaf).await? {
                Some(v) => values.push(v),
                None => return Ok(Err(self.name(&leaf))),
            }
        }
        let key_pem = values.pop().unwrap_or_default();
        let cert_pem = values.pop().unwrap_or_default();
        let secret = base64::engine::general_purpose::STANDARD
            .decode(values.pop().unwrap_or_default().trim())
            .map_err(|e| FleetError::Usage(format!("{}: not base64: {e}", self.name("secret"))))?;
        let ca_pem = values.pop().unwrap_or_default();
        Ok(Ok(NodeCredentials { ca_pem, cert_pem, key_pem, secret }))
    }

    /// Deletes node `node`'s key parameter (a host does this once its key is on its disk, so a
    /// later compromise of the role cannot read it); true when it was there.
    pub async fn forget_key(&self, node: &str) -> Result<bool, FleetError> {
        let name = self.name(&Self::node_leaf(node, "key")?);
        match self.client.delete_parameter().name(&name).send().await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some("ParameterNotFound") => Ok(false),
            Err(e) => Err(api_error("DeleteParameter", e)),
        }
    }

    /// Stores a spare credential: node `node`'s certificate and key, and its marker.
    pub async fn put_spare(&self, node: &str, cert_pem: &str, key_pem: &str) -> Result<(), FleetError> {
        self.put_node(node, cert_pem, key_pem).await?;
        self.put(&Self::spare_leaf(node)?, "spare", false).await
    }

    fn spare_leaf(node: &str) -> Result<String, FleetError> {
        Self::node_leaf(node, "x").map(|_| format!("spares/{node}"))
    }

    /// The spares not yet taken, sorted.
    pub async fn spares(&self) -> Result<Vec<String>, FleetError> {
        let mut pages =
            self.client.get_parameters_by_path().path(self.name("spares")).into_paginator().send();
        let mut names = Vec::new();
        let dir = self.name("spares/");
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| api_error("GetParametersByPath", e))?;
            names.extend(
                page.parameters().iter().filter_map(|p| p.name()?.strip_prefix(&dir).map(String::from)),
            );
        }
        names.sort();
        Ok(names)
    }

    /// Marks spare `node` taken (its host was launched); true when it was a spare.
    pub async fn take_spare(&self, node: &str) -> Result<bool, FleetError> {
        match self.client.delete_parameter().name(self.name(&Self::spare_leaf(node)?)).send().await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some("ParameterNotFound") => Ok(false),
            Err(e) => Err(api_error("DeleteParameter", e)),
        }
    }

    /// Deletes the parameters of nodes that are gone (terminated instances).
    pub async fn remove_nodes(&self, nodes: &[String]) -> Result<(), FleetError> {
        let mut names = Vec::new();
        for n in nodes {
            names.push(self.name(&Self::node_leaf(n, "cert")?));
            names.push(self.name(&Self::node_leaf(n, "key")?));
            names.push(self.name(&Self::spare_leaf(n)?));
        }
        // DeleteParameters takes at most 10 names; missing ones are reported, not errors.
        for chunk in names.chunks(10) {
            self.client
                .delete_parameters()
                .set_names(Some(chunk.to_vec()))
                .send()
                .await
                .map_err(|e| api_error("DeleteParameters", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_checked() {
        for good in ["/limpet/prod", "/a", "/x/y_z.1-2"] {
            check_prefix(good).unwrap();
        }
        for bad in ["", "/", "limpet/prod", "/limpet/", "/a//b", "/a b", "/aws/x", "/SSM/x", "/a$b"] {
            assert!(check_prefix(bad).is_err(), "{bad:?}");
        }
        assert!(Vault::node_leaf("i-0abc", "key").is_ok());
        for bad in ["", "../x", "a/b", "a b"] {
            assert!(Vault::node_leaf(bad, "key").is_err(), "{bad:?}");
        }
    }
}

//! (De)serializes a node-to-node map as a list of pairs (JSON object keys must be strings), refusing a node listed twice.
use super::NodeId;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

pub fn serialize<S: Serializer>(m: &BTreeMap<NodeId, NodeId>, s: S) -> Result<S::Ok, S::Error> {
    m.iter().map(|(k, v)| [*k, *v]).collect::<Vec<_>>().serialize(s)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<NodeId, NodeId>, D::Error> {
    let pairs = Vec::<[NodeId; 2]>::deserialize(d)?;
    let n = pairs.len();
    let m: BTreeMap<NodeId, NodeId> = pairs.into_iter().map(|[k, v]| (k, v)).collect();
    if m.len() != n {
        return Err(serde::de::Error::custom("a node has two state sources"));
    }
    Ok(m)
}

//! `[node].devices`: the devices a host trains with, one local rank each.

use super::NodeSection;
use serde::Deserialize;

/// `[node].devices`: a word (`"auto"`, `"cuda:1"`) or a list.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// One entry.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Devices {
    /// The entries as a list.
    pub fn entries(&self) -> Vec<String> {
        match self {
            Devices::One(s) => vec![s.clone()],
            Devices::Many(v) => v.clone(),
        }
    }
}

impl NodeSection {
    /// This host's local ranks' devices (absent `[node].devices`: none, the job's one device
    /// is used).
    pub fn local_devices(
        &self,
    ) -> Result<Option<Vec<limpet_trainer::device::Device>>, limpet_trainer::device::DeviceError> {
        let Some(d) = &self.devices else { return Ok(None) };
        limpet_trainer::device::local_devices(&d.entries(), limpet_trainer::device::gpu_count()).map(Some)
    }
}

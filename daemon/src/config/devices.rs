//! `[node].devices`: the devices a host trains with, one local rank each.

use super::NodeSection;
use limpet_agent::config_value::read_as;
use limpet_trainer::device::{Device, DeviceChoice, DeviceError};
use serde::{Deserialize, Deserializer};

/// `[node].devices`, each entry read as it is parsed: a word (`"auto"`, `"cuda:1"`) or a list.
#[derive(Clone, Debug, PartialEq)]
pub struct Devices(pub Vec<DeviceChoice>);

impl<'de> Deserialize<'de> for Devices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Devices, D::Error> {
        /// One entry or several, as written.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            One(String),
            Many(Vec<String>),
        }
        let convert = |w: Written| {
            let entries = match w {
                Written::One(one) => return DeviceChoice::parse(&one).map(|d| Devices(vec![d])),
                Written::Many(many) => many,
            };
            let entry = |(i, e): (usize, &String)| {
                DeviceChoice::parse(e).map_err(|e| DeviceError::Entry { entry: i + 1, source: Box::new(e) })
            };
            entries.iter().enumerate().map(entry).collect::<Result<_, _>>().map(Devices)
        };
        read_as(d, |w| convert(w).map_err(|e| e.to_string()), || Devices(vec![DeviceChoice::Cpu]))
    }
}

impl NodeSection {
    /// This host's local ranks' devices (absent `[node].devices`: none, the job's one device
    /// is used).
    pub fn local_devices(&self) -> Result<Option<Vec<Device>>, DeviceError> {
        let Some(d) = &self.devices else { return Ok(None) };
        limpet_trainer::device::local_devices(&d.0, limpet_trainer::device::gpu_count()).map(Some)
    }
}

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
        use serde_json::Value;
        let convert = |written: Value| -> Result<Devices, String> {
            let parse = |e: &Value| match e {
                Value::String(name) => DeviceChoice::parse(name).map_err(|e| e.to_string()),
                other => Err(format!("{other} is not a device name")),
            };
            match written {
                Value::Array(entries) => entries
                    .iter()
                    .enumerate()
                    .map(|(i, e)| parse(e).map_err(|why| format!("entry {}: {why}", i + 1)))
                    .collect::<Result<_, _>>()
                    .map(Devices),
                Value::String(_) => parse(&written).map(|d| Devices(vec![d])),
                other => {
                    Err(format!("{other} is neither a device (\"auto\", \"cuda:0\") nor a list of them"))
                }
            }
        };
        read_as(d, convert, || Devices(vec![DeviceChoice::Cpu]))
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

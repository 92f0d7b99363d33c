//! Where a rank's parameters live: `cpu`, `cuda`, `cuda:N`, or `auto` (the first GPU when
//! libtorch sees one, else the CPU), and what a host reports about its GPUs.

use tch::Cuda;
pub use tch::Device;

/// A device as a job names it, before it is checked against the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU.
    Cpu,
    /// GPU `N` (`cuda` is `cuda:0`).
    Cuda(usize),
    /// The first GPU when there is one, else the CPU.
    Auto,
}

impl DeviceChoice {
    /// Parses `cpu`, `cuda`, `cuda:N` or `auto`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "auto" => Ok(DeviceChoice::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("{s:?} is not one of cpu, cuda, cuda:N, auto")),
        }
    }

    /// The device on this host: an error when it names a GPU the host does not have.
    pub fn resolve(self) -> Result<Device, String> {
        self.resolve_with(gpu_count())
    }

    /// [`DeviceChoice::resolve`] on a host with `gpus` GPUs.
    pub fn resolve_with(self, gpus: usize) -> Result<Device, String> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Auto => Ok(if gpus > 0 { Device::Cuda(0) } else { Device::Cpu }),
            DeviceChoice::Cuda(n) if n < gpus => Ok(Device::Cuda(n)),
            DeviceChoice::Cuda(n) if gpus == 0 => Err(format!(
                "cuda:{n} asked for, but libtorch sees no CUDA device on this host (no GPU, no driver, or a CPU-only libtorch)"
            )),
            DeviceChoice::Cuda(n) => Err(format!("cuda:{n} asked for, but this host has {gpus} GPU(s)")),
        }
    }
}

/// GPUs libtorch can use on this host.
pub fn gpu_count() -> usize {
    if Cuda::is_available() {
        Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

/// The GPUs' model names as the NVIDIA driver lists them (`/proc/driver/nvidia/gpus/*/information`),
/// empty where there is no such driver.
pub fn gpu_models() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/driver/nvidia/gpus") else { return Vec::new() };
    let mut models: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("information")).ok())
        .filter_map(|text| text.lines().find_map(|l| l.strip_prefix("Model:").map(|m| m.trim().to_string())))
        .collect();
    models.sort();
    models
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_resolve_against_the_host() {
        assert_eq!(DeviceChoice::parse("cuda:3"), Ok(DeviceChoice::Cuda(3)));
        assert_eq!(DeviceChoice::parse("cuda"), Ok(DeviceChoice::Cuda(0)));
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", ""] {
            let err = DeviceChoice::parse(bad).unwrap_err();
            assert!(err.contains("is not one of cpu, cuda, cuda:N, auto"), "{err}");
        }
        assert_eq!(DeviceChoice::Auto.resolve_with(0), Ok(Device::Cpu));
        assert_eq!(DeviceChoice::Auto.resolve_with(2), Ok(Device::Cuda(0)));
        assert_eq!(DeviceChoice::Cuda(1).resolve_with(2), Ok(Device::Cuda(1)));
        assert!(DeviceChoice::Cuda(2).resolve_with(2).unwrap_err().contains("has 2 GPU(s)"));
        assert!(DeviceChoice::Cuda(0).resolve_with(0).unwrap_err().contains("no CUDA device"));
        // This host: whatever it has, `auto` resolves and `cpu` is the CPU.
        assert_eq!(DeviceChoice::Cpu.resolve(), Ok(Device::Cpu));
        assert!(DeviceChoice::Auto.resolve().is_ok());
    }
}

//! Where a rank's parameters live: `cpu`, `cuda`, `cuda:N`, or `auto` (the first GPU when
//! libtorch sees one, else the CPU), and what a host reports about its GPUs.

mod streams;

pub use streams::device_memory;
pub(crate) use streams::{Ready, SideStream};
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
    pub fn parse(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "auto" => Ok(DeviceChoice::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| DeviceError::Unknown(s.to_string())),
        }
    }

    /// The device on this host: an error when it names a GPU the host does not have.
    pub fn resolve(self) -> Result<Device, DeviceError> {
        self.resolve_with(gpu_count())
    }

    /// [`DeviceChoice::resolve`] on a host with `gpus` GPUs.
    pub fn resolve_with(self, gpus: usize) -> Result<Device, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Auto => Ok(if gpus > 0 { Device::Cuda(0) } else { Device::Cpu }),
            DeviceChoice::Cuda(n) if n < gpus => Ok(Device::Cuda(n)),
            DeviceChoice::Cuda(n) if gpus == 0 => Err(DeviceError::NoCuda(n)),
            DeviceChoice::Cuda(index) => Err(DeviceError::Missing { index, gpus }),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceChoice::Auto => f.write_str("auto"),
        }
    }
}

/// Why a device setting cannot be used on this host.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// A word that names no device.
    #[error("{0:?} is not one of cpu, cuda, cuda:N, auto")]
    Unknown(String),
    /// A GPU asked for where libtorch sees none.
    #[error(
        "cuda:{0} asked for, but libtorch sees no CUDA device on this host (no GPU, no driver, or a CPU-only libtorch)"
    )]
    NoCuda(usize),
    /// A GPU past the host's last.
    #[error("cuda:{index} asked for, but this host has {gpus} GPU(s)")]
    Missing {
        /// The GPU asked for.
        index: usize,
        /// The host's GPUs.
        gpus: usize,
    },
    /// An empty list.
    #[error("lists no device (\"auto\" for every GPU of the host)")]
    NoneListed,
    /// More devices than one host trains with.
    #[error("lists {0} devices, more than {MAX_LOCAL_DEVICES}")]
    TooMany(usize),
    /// `auto` beside other entries.
    #[error("\"auto\" stands alone (devices = \"auto\")")]
    AutoNotAlone,
    /// One GPU listed twice.
    #[error("{0} is listed twice (one rank per GPU)")]
    Twice(String),
    /// The CPU listed with GPUs.
    #[error("{0} mixes the CPU with GPUs (one kind of device per host)")]
    Mixed(String),
    /// A reproducible job cannot get deterministic kernels here.
    #[error("a reproducible job on a GPU: {0}")]
    Reproducible(String),
    /// What is wrong with one entry of a list (counted from 1).
    #[error("entry {entry}: {source}")]
    Entry {
        /// The entry, counted from 1.
        entry: usize,
        /// What is wrong with it.
        source: Box<DeviceError>,
    },
}

/// The most devices (local ranks) one host may train with.
pub const MAX_LOCAL_DEVICES: usize = 64;

/// The devices of a host's local ranks, one rank each, on a host with `gpus` GPUs: `[Auto]`
/// is every GPU (one CPU rank where there is none); otherwise each entry resolved (`auto`
/// alone), no GPU twice. CPU entries may repeat: several CPU ranks are how the tests run
/// local ranks.
pub fn local_devices(spec: &[DeviceChoice], gpus: usize) -> Result<Vec<Device>, DeviceError> {
    if spec.is_empty() {
        return Err(DeviceError::NoneListed);
    }
    if spec.len() > MAX_LOCAL_DEVICES {
        return Err(DeviceError::TooMany(spec.len()));
    }
    if spec == [DeviceChoice::Auto] {
        return Ok(if gpus == 0 { vec![Device::Cpu] } else { (0..gpus).map(Device::Cuda).collect() });
    }
    let mut out = Vec::with_capacity(spec.len());
    for (i, &choice) in spec.iter().enumerate() {
        let at = |e: DeviceError| DeviceError::Entry { entry: i + 1, source: Box::new(e) };
        if choice == DeviceChoice::Auto {
            return Err(at(DeviceError::AutoNotAlone));
        }
        let d = choice.resolve_with(gpus).map_err(at)?;
        if d != Device::Cpu && out.contains(&d) {
            return Err(at(DeviceError::Twice(choice.to_string())));
        }
        if out.first().is_some_and(|&f: &Device| (f == Device::Cpu) != (d == Device::Cpu)) {
            // Local ranks apply the same bytes and must stay equal: one kind of device.
            return Err(at(DeviceError::Mixed(choice.to_string())));
        }
        out.push(d);
    }
    Ok(out)
}

/// GPUs libtorch can use on this host.
pub fn gpu_count() -> usize {
    if Cuda::is_available() {
        Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

/// What libtorch in this process offers: whether its CUDA backend is loaded, with which CUDA
/// runtime, how many devices it sees, and why there is none when it sees none.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Backend {
    /// `libtorch_cuda.so` is loaded (the binary was linked with it).
    pub cuda_backend: bool,
    /// The CUDA runtime libtorch loaded (`libcudart.so.12`, ...), if any.
    pub cuda_runtime: Option<String>,
    /// CUDA devices libtorch sees.
    pub devices: usize,
    /// GPUs the NVIDIA driver lists (`/proc/driver/nvidia/gpus`), usable or not.
    pub driver_gpus: usize,
    /// Why there are none, in words, when there are none.
    pub why_none: Option<String>,
}

impl Backend {
    /// Why `"auto"` must not quietly mean the CPU here: the driver lists GPUs that libtorch
    /// cannot use (a driver older than libtorch's CUDA runtime, `CUDA_VISIBLE_DEVICES=""`, a
    /// CPU-only build on a GPU host). `None` where "auto" means what it says.
    pub fn gpus_unusable(&self) -> Option<String> {
        (self.devices == 0 && self.driver_gpus > 0).then(|| {
            format!(
                "the NVIDIA driver lists {} GPU(s) and libtorch can use none: {}",
                self.driver_gpus,
                self.why_none.as_deref().unwrap_or("no device")
            )
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.why_none, &self.cuda_runtime) {
            (None, rt) => {
                write!(f, "CUDA ({}), {} device(s)", rt.as_deref().unwrap_or("runtime unknown"), self.devices)
            }
            (Some(why), _) if self.driver_gpus > 0 => {
                write!(f, "CPU only, with {} GPU(s) it cannot use: {why}", self.driver_gpus)
            }
            (Some(why), _) => write!(f, "CPU only: {why}"),
        }
    }
}

/// This process's libtorch backend, read from what it loaded (`/proc/self/maps`) and what it
/// reports.
pub fn backend() -> Backend {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut b =
        backend_from(&maps, gpu_count(), std::path::Path::new("/proc/driver/nvidia/version").exists());
    b.driver_gpus = gpu_models().len();
    b
}

/// [`backend`] from a process's memory map, the devices libtorch counts and whether an
/// NVIDIA driver is loaded (the GPUs it lists left at 0).
pub fn backend_from(maps: &str, devices: usize, driver: bool) -> Backend {
    let loaded = |name: &str| {
        maps.lines().filter_map(|l| l.rsplit('/').next()).find(|f| f.starts_with(name)).map(str::to_string)
    };
    let cuda_backend = loaded("libtorch_cuda.so").is_some();
    let cuda_runtime = loaded("libcudart.so");
    let why_none = (devices == 0).then(|| {
        if !cuda_backend {
            "this binary's libtorch has no CUDA backend loaded (a CPU-only libtorch, or a binary linked without libtorch_cuda.so)".to_string()
        } else if !driver {
            "libtorch's CUDA backend is loaded, but no NVIDIA driver is (no GPU on this host, or its driver is not installed)".to_string()
        } else {
            "libtorch's CUDA backend and the NVIDIA driver are loaded, but libtorch sees no device (CUDA_VISIBLE_DEVICES, or a driver older than the CUDA runtime)".to_string()
        }
    });
    Backend { cuda_backend, cuda_runtime, devices, driver_gpus: 0, why_none }
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

/// What a reproducible job's bits depend on beyond the job: the kind of device and, for GPUs,
/// their models (kernels differ between GPU generations; every model of the host, so a host
/// whose local ranks mix models is its own class), for the CPU its instruction set (libtorch's
/// and the BLAS's kernels are chosen by the vector width the CPU has), and the libraries the
/// kernels come from (libtorch's version, and CUDA's and cuDNN's on a GPU).
pub fn device_class(device: Device) -> String {
    let kind = match device {
        Device::Cpu => {
            #[cfg(target_arch = "x86_64")]
            let width = if std::arch::is_x86_feature_detected!("avx512f") {
                "+avx512"
            } else if std::arch::is_x86_feature_detected!("avx2") {
                "+avx2"
            } else {
                ""
            };
            #[cfg(not(target_arch = "x86_64"))]
            let width = "";
            format!("cpu/{}{width}", std::env::consts::ARCH)
        }
        _ => {
            let mut models = gpu_models();
            models.dedup();
            // Without the driver's list (some containers) the models are unknown: such hosts
            // are one class among themselves, and no other.
            let models = if models.is_empty() { "unknown GPU".to_string() } else { models.join(" + ") };
            format!("cuda/{models}")
        }
    };
    format!("{kind} ({})", library_versions())
}

/// libtorch's version, and CUDA's and cuDNN's where CUDA is loaded (`kernels.cpp`).
pub fn library_versions() -> String {
    let mut out = [0u8; 128];
    // SAFETY: `out` is a live buffer of the length passed; the function writes at most that
    // many bytes, ended by a zero.
    #[allow(unsafe_code)]
    let failed =
        unsafe { limpet_library_versions(out.as_mut_ptr().cast(), out.len() as std::os::raw::c_int) };
    if failed != 0 {
        return "libraries unknown".into();
    }
    let end = out.iter().position(|&b| b == 0).unwrap_or(out.len());
    String::from_utf8_lossy(&out[..end]).into_owned()
}

extern "C" {
    /// `kernels.cpp`: the kernel choices a reproducible job needs on a GPU, on or off; 0, or
    /// 1 when libtorch threw.
    fn limpet_reproducible_kernels(on: std::os::raw::c_int) -> std::os::raw::c_int;
    /// `kernels.cpp`: whether those choices are in force (1) or not (0).
    fn limpet_reproducible_kernels_on() -> std::os::raw::c_int;
    /// `kernels.cpp`: the libraries' versions as text into a buffer; 0, or 1 when it threw.
    fn limpet_library_versions(
        out: *mut std::os::raw::c_char,
        len: std::os::raw::c_int,
    ) -> std::os::raw::c_int;
}

/// The CUDA setting deterministic cuBLAS needs (a workspace per stream of fixed size), read
/// by cuBLAS when it starts: set in the process's environment before any thread runs
/// (`limpetd` and `limpet` do at start), never later.
pub const CUBLAS_WORKSPACE: (&str, &str) = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8");

/// Turns on, for the whole process, the kernel choices a reproducible job needs on a GPU
/// (`kernels.cpp`: deterministic algorithms and cuDNN, no TF32, no reduced-precision
/// reductions, SDPA's math kernel). Refused, naming the fix, where cuBLAS would not be
/// deterministic because [`CUBLAS_WORKSPACE`] is not in the environment.
pub fn reproducible_kernels() -> Result<(), DeviceError> {
    let (name, value) = CUBLAS_WORKSPACE;
    // cuBLAS is deterministic with one of these two workspace settings only; libtorch would
    // throw at the first matrix product with any other.
    match std::env::var(name).as_deref() {
        Ok(":4096:8" | ":16:8") => set_reproducible_kernels(true),
        Ok(other) => Err(DeviceError::Reproducible(format!(
            "{name}={other:?}, and cuBLAS is deterministic only with \":4096:8\" or \":16:8\": start the process with {name}={value}"
        ))),
        Err(_) => Err(DeviceError::Reproducible(format!(
            "{name} is not set, and cuBLAS is deterministic only with it: start the process with {name}={value} (limpetd and limpet set it themselves)"
        ))),
    }
}

/// The kernel choices of [`reproducible_kernels`], on or off (libtorch's defaults), without
/// the environment's check.
pub fn set_reproducible_kernels(on: bool) -> Result<(), DeviceError> {
    // SAFETY: the function takes no pointers and changes libtorch's global settings only,
    // which libtorch reads when it picks a kernel.
    #[allow(unsafe_code)]
    match unsafe { limpet_reproducible_kernels(on.into()) } {
        0 => Ok(()),
        _ => Err(DeviceError::Reproducible("libtorch threw while choosing deterministic kernels".into())),
    }
}

/// Whether [`reproducible_kernels`]' choices are in force in this process.
pub fn reproducible_kernels_on() -> bool {
    // SAFETY: reads libtorch's global settings; no pointers.
    #[allow(unsafe_code)]
    let on = unsafe { limpet_reproducible_kernels_on() };
    on == 1
}

/// Hands the heap's free pages back to the system. glibc keeps what a model-sized host
/// transient freed (an entry's state image, a whole optimizer state just cut into shards)
/// for reuse, which would leave the resident size of the whole state behind for the rest of
/// the job.
#[allow(unsafe_code)]
pub fn return_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only walks the allocator's own free lists,
    // under the allocator's locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_says_what_is_loaded_and_why_there_is_no_gpu() {
        let cpu = "7f00-7f01 r-xp 0 08:01 1 /x/torch/lib/libtorch_cpu.so\n";
        let b = backend_from(cpu, 0, false);
        assert!(!b.cuda_backend && b.why_none.as_deref().unwrap().contains("no CUDA backend"), "{b:?}");
        let cuda = format!("{cpu}7f02-7f03 r-xp 0 08:01 2 /x/torch/lib/libtorch_cuda.so\n7f04-7f05 r-xp 0 08:01 3 /x/nvidia/cuda_runtime/lib/libcudart.so.12\n");
        let b = backend_from(&cuda, 0, false);
        assert!(b.cuda_backend && b.why_none.as_deref().unwrap().contains("no NVIDIA driver"), "{b:?}");
        assert_eq!(b.cuda_runtime.as_deref(), Some("libcudart.so.12"));
        assert!(backend_from(&cuda, 0, true).why_none.unwrap().contains("sees no device"));
        // A driver listing GPUs libtorch cannot use is said, and "auto" must not hide it.
        let old = Backend { driver_gpus: 4, ..backend_from(&cuda, 0, true) };
        assert!(old.to_string().starts_with("CPU only, with 4 GPU(s) it cannot use: "), "{old}");
        assert!(old.gpus_unusable().unwrap().contains("lists 4 GPU(s) and libtorch can use none"));
        assert_eq!(backend_from(&cuda, 0, false).gpus_unusable(), None);
        assert_eq!(Backend { driver_gpus: 4, ..backend_from(&cuda, 4, true) }.gpus_unusable(), None);
        let b = backend_from(&cuda, 8, true);
        assert_eq!(
            (b.why_none.clone(), b.to_string()),
            (None, "CUDA (libcudart.so.12), 8 device(s)".to_string())
        );
    }

    /// This test binary is linked like limpetd (deploy/link_libtorch.rs): where the libtorch
    /// it was built against has a CUDA backend, the backend is loaded.
    #[test]
    fn the_cuda_backend_is_loaded_where_libtorch_has_one() {
        let lib = std::path::Path::new(env!("LIMPET_LIBTORCH_LIB"));
        let b = backend();
        assert_eq!(b.cuda_backend, lib.join("libtorch_cuda.so").exists(), "{b:?}");
    }

    #[test]
    fn devices_parse_and_resolve_against_the_host() {
        assert_eq!(DeviceChoice::parse("cuda:3"), Ok(DeviceChoice::Cuda(3)));
        assert_eq!(DeviceChoice::parse("cuda"), Ok(DeviceChoice::Cuda(0)));
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", ""] {
            let err = DeviceChoice::parse(bad).unwrap_err().to_string();
            assert!(err.contains("is not one of cpu, cuda, cuda:N, auto"), "{err}");
        }
        assert_eq!(DeviceChoice::Auto.resolve_with(0), Ok(Device::Cpu));
        assert_eq!(DeviceChoice::Auto.resolve_with(2), Ok(Device::Cuda(0)));
        assert_eq!(DeviceChoice::Cuda(1).resolve_with(2), Ok(Device::Cuda(1)));
        assert!(DeviceChoice::Cuda(2).resolve_with(2).unwrap_err().to_string().contains("has 2 GPU(s)"));
        assert!(DeviceChoice::Cuda(0).resolve_with(0).unwrap_err().to_string().contains("no CUDA device"));
        // This host: whatever it has, `auto` resolves and `cpu` is the CPU.
        assert_eq!(DeviceChoice::Cpu.resolve(), Ok(Device::Cpu));
        assert!(DeviceChoice::Auto.resolve().is_ok());
    }

    #[test]
    fn a_hosts_devices_are_every_gpu_or_a_checked_list() {
        let list = |v: &[&str]| v.iter().map(|s| DeviceChoice::parse(s).unwrap()).collect::<Vec<_>>();
        assert_eq!(local_devices(&list(&["auto"]), 0), Ok(vec![Device::Cpu]));
        assert_eq!(local_devices(&list(&["auto"]), 4).unwrap().len(), 4);
        assert_eq!(local_devices(&list(&["cpu", "cpu"]), 0), Ok(vec![Device::Cpu, Device::Cpu]));
        assert_eq!(local_devices(&list(&["cuda:1", "cuda"]), 2), Ok(vec![Device::Cuda(1), Device::Cuda(0)]));
        assert!(DeviceChoice::parse("gpu").unwrap_err().to_string().contains("\"gpu\" is not one of"));
        for (bad, why) in [
            (list(&[]), "lists no device"),
            (list(&["cuda:0", "cuda"]), "entry 2: cuda:0 is listed twice"),
            (list(&["cuda:1", "cpu"]), "entry 2: cpu mixes the CPU with GPUs"),
            (list(&["cpu", "auto"]), "entry 2: \"auto\" stands alone"),
            (list(&["cuda:2"]), "entry 1: cuda:2 asked for"),
            (vec![DeviceChoice::Cpu; 65], "more than 64"),
        ] {
            let e = local_devices(&bad, 2).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}

//! The trainer's build: libtorch's link settings, as every crate that links it has them
//! (`deploy/link_libtorch.rs`), and its C++ shim (`src/train/forget_grad.cpp`,
//! `src/kernels.cpp`, `src/fused_adamw.cpp`, `src/device_streams.cpp`: the libtorch calls
//! tch does not expose),
//! compiled against the same libtorch's headers with the settings torch-sys compiles its own
//! C++ with.

#[path = "../deploy/link_libtorch.rs"]
mod link_libtorch;

fn main() {
    link_libtorch::main();
    println!("cargo:rerun-if-changed=src/train/forget_grad.cpp");
    println!("cargo:rerun-if-changed=src/kernels.cpp");
    println!("cargo:rerun-if-changed=src/fused_adamw.cpp");
    println!("cargo:rerun-if-changed=src/device_streams.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_INCLUDE");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    // torch-sys's choices: headers under LIBTORCH_INCLUDE when set, else beside the `lib/`
    // directory of the libtorch it links (which it reports); the C++11 string ABI unless
    // LIBTORCH_CXX11_ABI says otherwise (PyPI's wheels use it).
    let root = match std::env::var_os("LIBTORCH_INCLUDE") {
        Some(root) => std::path::PathBuf::from(root),
        None => {
            let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
                .expect("torch-sys reports its libtorch (DEP_TCH_LIBTORCH_LIB); run `make setup`");
            std::path::Path::new(&lib).join("..")
        }
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include(root.join("include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .warnings(false)
        .file("src/train/forget_grad.cpp")
        .file("src/kernels.cpp")
        .file("src/fused_adamw.cpp")
        .file("src/device_streams.cpp")
        .compile("limpet_forget_grad");
}

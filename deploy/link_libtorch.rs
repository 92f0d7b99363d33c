//! The build script of every crate that links libtorch (shared: each crate's `build` key
//! names this file; the trainer's own `build.rs` runs it as a module, then compiles its C++).
//!
//! 1. libtorch's directory goes into the rpath of the crate's binaries and tests, so they run
//!    without LD_LIBRARY_PATH. torch-sys reports the directory through its `links = "tch"`
//!    metadata; it is resolved to its real place so binaries do not depend on the clone's
//!    link.
//! 2. Where that libtorch has a CUDA backend (`libtorch_cuda.so`, as PyPI's Linux wheels do),
//!    it is linked with `--no-as-needed`. No symbol of it is referenced, so the linker's
//!    default `--as-needed` would drop it, and libtorch registers its CUDA backend only when
//!    the library is loaded: without it `cuda_if_available()` is false on a GPU host (tch-rs
//!    issue 980). `tests/module_graph.rs` reads the built binaries' NEEDED entries.

/// Prints the link settings above for cargo (public: the trainer's build script calls it).
pub fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB").unwrap_or_default();
    // The tests ask what libtorch the crate was built against.
    println!("cargo:rustc-env=LIMPET_LIBTORCH_LIB={lib}");
    if lib.is_empty() {
        return;
    }
    let lib = std::fs::canonicalize(&lib).map(|p| p.display().to_string()).unwrap_or(lib);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-L{lib},-ltorch_cuda,--as-needed");
    }
}

//! Puts libtorch's directory into the rpath of this crate's binaries and tests, so they run
//! without LD_LIBRARY_PATH. torch-sys reports the directory through its `links = "tch"`
//! metadata; it is resolved to its real place so binaries do not depend on the clone's link.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        let lib = std::fs::canonicalize(&lib).map(|p| p.display().to_string()).unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}

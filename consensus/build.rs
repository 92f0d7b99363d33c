//! Generates the gRPC transport from `proto/consensus.proto`. protoc comes from the
//! `protoc-bin-vendored` crate, so building needs nothing installed by hand.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(config, &["proto/consensus.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/consensus.proto");
    Ok(())
}

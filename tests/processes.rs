//! limpet-daemon's tests of the whole product: one module per file of `tests/`, most of them
//! with real `limpetd` processes. One binary: it links libtorch once, and its tests run two
//! at a time across the files (no file's last long test runs alone at its end). Run one
//! file's with `cargo test -p limpet-daemon --test processes elastic_processes::`.

// Each file includes `common.rs` as its own module, as it did as a binary of its own.
#![allow(clippy::duplicate_mod)]

#[path = "adversary_processes.rs"]
mod adversary_processes;
#[path = "capacity_processes.rs"]
mod capacity_processes;
#[path = "checkpoint_processes.rs"]
mod checkpoint_processes;
#[path = "cloud_init_processes.rs"]
mod cloud_init_processes;
#[path = "dataplane_processes.rs"]
mod dataplane_processes;
#[path = "dataplane_tls_processes.rs"]
mod dataplane_tls_processes;
#[path = "elastic_processes.rs"]
mod elastic_processes;
#[path = "fleet_processes.rs"]
mod fleet_processes;
#[path = "module_graph.rs"]
mod module_graph;
#[path = "operator_processes.rs"]
mod operator_processes;
#[path = "ops_processes.rs"]
mod ops_processes;
#[path = "raft_processes.rs"]
mod raft_processes;
#[path = "release_processes.rs"]
mod release_processes;
#[path = "reproducible_processes.rs"]
mod reproducible_processes;
#[path = "scale_processes.rs"]
mod scale_processes;
#[path = "security_processes.rs"]
mod security_processes;
#[path = "sharded_processes.rs"]
mod sharded_processes;
#[path = "torchscript_processes.rs"]
mod torchscript_processes;
#[path = "workload_processes.rs"]
mod workload_processes;

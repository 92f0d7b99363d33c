//! One host's life in a limpet cluster: the running agent (`runtime`: its tasks, the trainer
//! loop, epoch entry, checkpoints and shadows), the data plane (`dataplane`: authenticated
//! TCP between agents and the collectives training runs over them), pipeline stages over it
//! (`stage`), durable checkpoints (`checkpoint`, `remote` for S3), revocation sources
//! (`revocation`: AWS, GCP, Azure). The decisions it runs (controller, leader round, policies,
//! planner, reports, entry planning) are the `limpet-decide` crate, re-exported here.

pub mod checkpoint;
pub mod config_value;
pub mod dataplane;
pub mod remote;
pub mod revocation;

// The decisions the agent runs live in their own crate; their paths stay the agent's.
pub use limpet_decide::{balance, controller, leader, planner, policy, reconcile, report, scaling, stuck};
// The control part of `runtime` builds without libtorch (the lab's synthetic agents); its
// trainer loop and the pipeline stages need it.
pub mod runtime;
#[cfg(feature = "trainer")]
pub mod stage;

pub use dataplane::{Conn, DataPlaneConfig, DataPlaneError, DataTls, Endpoint, Group};

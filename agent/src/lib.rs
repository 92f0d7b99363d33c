//! One host's life in a limpet cluster. So far: the data plane (`dataplane`), the
//! authenticated TCP connections between agents and the collectives training runs over
//! them; the leader's reconfiguration controller (`controller`) and the batch and
//! learning-rate policies it applies (`policy`), both pure; the revocation sources
//! (`revocation`: AWS, GCP, Azure) and a fake metadata service that answers like those
//! clouds (`fake_metadata`). Failure detection and epoch switching build on them.

pub mod checkpoint;
pub mod controller;
pub mod dataplane;
pub mod fake_metadata;
pub mod leader;
pub mod planner;
pub mod policy;
pub mod remote;
pub mod report;
pub mod revocation;
#[cfg(feature = "trainer")]
pub mod runtime;
#[cfg(feature = "trainer")]
pub mod stage;

pub use dataplane::{Conn, DataPlaneConfig, DataPlaneError, DataTls, Endpoint, Group};

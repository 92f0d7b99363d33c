//! One host's life in a limpet cluster. So far: the data plane (`dataplane`), the
//! authenticated TCP connections between agents and the collectives training runs over
//! them. The revocation watchers, failure detection, the leader's controller and epoch
//! switching build on it (issue 5).

pub mod dataplane;

pub use dataplane::{DataPlaneConfig, DataPlaneError, Endpoint, Group};

//! The one shutdown path (`limpet_consensus::tasks`, where the consensus node spawns through
//! it too): the agent's, its consensus node's and `limpetd`'s tasks and threads under one
//! root token, tracked, and a panic in any fatal and named (docs/architecture.md lists what
//! runs outside it).

pub use limpet_consensus::tasks::*;

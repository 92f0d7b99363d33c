//! What the decision tests share: a member's spec with nothing but its id and name.

use limpet_consensus::state::{Hardware, MemberSpec, NodeId};

/// A member `id` named `n{id}`, without addresses or hardware.
pub fn spec(id: NodeId) -> MemberSpec {
    MemberSpec {
        id,
        name: format!("n{id}"),
        control_addr: String::new(),
        data_addr: String::new(),
        hardware: Hardware::default(),
    }
}

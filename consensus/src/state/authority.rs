//! Who may propose which command: a node about itself, an operator's drains, notices and
//! removals, and everything else only the leader's own controllers. Checked where a proposal
//! arrives: at the gRPC boundary against the caller's certificate, and at the leader against
//! the node that forwarded it through raft.

use super::{Command, NodeId};

/// Who asks for a command, as far as the asker can be proven: see [`Command::authorize`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proposer {
    /// The leading node's own controllers (in process, at the leader).
    Leader,
    /// A node speaking for itself: its certificate over gRPC, or its raft messages (which
    /// carry only proposals of the node that forwards them).
    Node(NodeId),
    /// An operator's certificate (or any caller of a cluster without TLS, where nothing
    /// proves who calls), proposing at the leader.
    Operator,
    /// An on-call operator's certificate: drains only (no revocation, no removal).
    OnCall,
}

/// The longest name, address, hardware description or reason a node or an operator may
/// write into the log, in bytes.
pub const MAX_WORDS: usize = 1024;

/// Why a proposer may not propose a command.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotAllowed(pub String);

/// Who may propose which command (docs/security.md shows this table):
///
/// | command | the node it is about | operator | on-call | leader's controller |
/// |---|---|---|---|---|
/// | `Join` | yes | no | no | yes |
/// | `Drain` | yes | yes | yes | yes |
/// | `Notice` | yes | yes | no | yes |
/// | `Remove`, `RevokeCertificate` | no | yes | no | yes |
/// | `UpdateHardware` | yes | no | no | yes |
/// | `RecordCheckpoint` | the node that wrote it | no | no | yes |
/// | `Activate`, `MarkFailed`, `RecordSpeed`, `SetJob`, `ScheduleEpoch`, `CancelEpoch`, `ActivateEpoch`, `RecordCapacity`, `RecordThroughput`, `Round` | no | no | no | yes |
impl Command {
    /// Whether `who` may propose this command; the reason when not.
    pub fn authorize(&self, who: Proposer) -> Result<(), NotAllowed> {
        let about = match self {
            Command::RecordCheckpoint { record } => Some(record.node),
            _ => self.subject(),
        };
        let (node_may, operator_may) = match self {
            Command::Join { .. } | Command::UpdateHardware { .. } | Command::RecordCheckpoint { .. } => {
                (true, false)
            }
            Command::Notice { .. } | Command::Drain { .. } => (true, true),
            Command::Remove { .. } | Command::RevokeCertificate { .. } => (false, true),
            Command::Activate { .. }
            | Command::MarkFailed { .. }
            | Command::RecordSpeed { .. }
            | Command::SetJob { .. }
            | Command::ScheduleEpoch { .. }
            | Command::CancelEpoch { .. }
            | Command::ActivateEpoch { .. }
            | Command::RecordCapacity { .. }
            | Command::RecordThroughput { .. }
            | Command::Round { .. } => (false, false),
        };
        let kind = self.kind();
        if who != Proposer::Leader {
            self.check_words()?;
        }
        match who {
            Proposer::Leader => Ok(()),
            Proposer::Operator if operator_may => Ok(()),
            Proposer::Operator => Err(NotAllowed(format!(
                "an operator may not propose {kind}: only drain, notice (revoke) and remove"
            ))),
            Proposer::OnCall if matches!(self, Command::Drain { .. }) => Ok(()),
            Proposer::OnCall => Err(NotAllowed(format!(
                "an on-call certificate may not propose {kind}: only drain (an operator's revokes and removes)"
            ))),
            Proposer::Node(id) if node_may && about == Some(id) => Ok(()),
            Proposer::Node(id) if node_may => Err(NotAllowed(format!(
                "node {id} may propose {kind} only about itself, not node {}",
                about.unwrap_or(0)
            ))),
            Proposer::Node(id) => Err(NotAllowed(format!(
                "node {id} may not propose {kind}: {}",
                if operator_may {
                    "only an operator or the leader"
                } else {
                    "only the leader's controller decides it"
                }
            ))),
        }
    }

    /// The text a node or an operator puts in the log (names, addresses, hardware, reasons):
    /// at most [`MAX_WORDS`] bytes a field and no control character. The log keeps it in
    /// every snapshot (a gone member's record too), and `limpet status` prints it to an
    /// operator's terminal.
    pub fn check_words(&self) -> Result<(), NotAllowed> {
        if let Command::Round { commands } = self {
            return commands.iter().try_for_each(Command::check_words);
        }
        fn hardware(h: &super::Hardware) -> [(&'static str, &str); 3] {
            [
                ("hardware.instance_type", h.instance_type.as_str()),
                ("hardware.gpu_model", h.gpu_model.as_str()),
                ("hardware.zone", h.zone.as_str()),
            ]
        }
        let fields: Vec<(&str, &str)> = match self {
            Command::Join { member: m } => [
                ("name", m.name.as_str()),
                ("control_addr", m.control_addr.as_str()),
                ("data_addr", m.data_addr.as_str()),
            ]
            .into_iter()
            .chain(hardware(&m.hardware))
            .collect(),
            Command::UpdateHardware { hardware: h, .. } => hardware(h).to_vec(),
            Command::Notice { source, .. } => vec![("source", source.as_str())],
            Command::Drain { reason, .. } | Command::Remove { reason, .. } => {
                vec![("reason", reason.as_str())]
            }
            Command::RevokeCertificate { fingerprint, name } => {
                vec![("fingerprint", fingerprint.as_str()), ("name", name.as_str())]
            }
            _ => Vec::new(),
        };
        for (field, text) in fields {
            if text.len() > MAX_WORDS {
                return Err(NotAllowed(format!(
                    "{}'s {field} is {} bytes; at most {MAX_WORDS}",
                    self.kind(),
                    text.len()
                )));
            }
            if text.chars().any(char::is_control) {
                return Err(NotAllowed(format!("{}'s {field} holds a control character", self.kind())));
            }
        }
        Ok(())
    }

    /// The command's kind as written in the log (`schedule_epoch`).
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Join { .. } => "join",
            Command::Activate { .. } => "activate",
            Command::Notice { .. } => "notice",
            Command::Drain { .. } => "drain",
            Command::MarkFailed { .. } => "mark_failed",
            Command::Remove { .. } => "remove",
            Command::UpdateHardware { .. } => "update_hardware",
            Command::RecordSpeed { .. } => "record_speed",
            Command::SetJob { .. } => "set_job",
            Command::ScheduleEpoch { .. } => "schedule_epoch",
            Command::CancelEpoch { .. } => "cancel_epoch",
            Command::ActivateEpoch { .. } => "activate_epoch",
            Command::RecordCheckpoint { .. } => "record_checkpoint",
            Command::RecordCapacity { .. } => "record_capacity",
            Command::RecordThroughput { .. } => "record_throughput",
            Command::RevokeCertificate { .. } => "revoke_certificate",
            Command::Round { .. } => "round",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{CheckpointRecord, Hardware, MemberSpec};

    fn all(id: NodeId) -> Vec<Command> {
        let member = MemberSpec {
            id,
            name: "n".into(),
            control_addr: String::new(),
            data_addr: String::new(),
            hardware: Hardware::default(),
        };
        let record = CheckpointRecord {
            step: 1,
            epoch: 1,
            content_hash: String::new(),
            location: String::new(),
            node: id,
        };
        vec![
            Command::Join { member },
            Command::Activate { id },
            Command::Notice { id, deadline_ms: 1, source: "t".into() },
            Command::Drain { id, reason: "t".into() },
            Command::MarkFailed { id, reason: "t".into() },
            Command::Remove { id, reason: "t".into() },
            Command::UpdateHardware { id, hardware: Hardware::default() },
            Command::RecordSpeed { id, speed_milli: 2000 },
            Command::SetJob { job: serde_json::json!({}) },
            Command::CancelEpoch { id: 1, reason: "t".into() },
            Command::ActivateEpoch { id: 1 },
            Command::RecordCheckpoint { record },
            Command::RevokeCertificate { fingerprint: "ab".repeat(32), name: "n".into() },
            Command::Round { commands: vec![Command::MarkFailed { id, reason: "t".into() }] },
        ]
    }

    /// The table in the docs, row by row: what a node may say about itself and about
    /// another, what an operator may, and that the leader may do all.
    #[test]
    fn each_command_names_who_may_propose_it() {
        for (c, o) in all(2).iter().zip(&all(3)) {
            let kind = c.kind();
            assert_eq!(serde_json::to_value(c).unwrap()["kind"], kind, "kind() is the log's tag");
            let own = ["join", "notice", "drain", "update_hardware", "record_checkpoint"].contains(&kind);
            let operator = ["notice", "drain", "remove", "revoke_certificate"].contains(&kind);
            assert_eq!(c.authorize(Proposer::Node(2)).is_ok(), own, "node 2: {kind} about itself");
            assert!(o.authorize(Proposer::Node(2)).is_err(), "node 2: {kind} about node 3");
            assert_eq!(c.authorize(Proposer::Operator).is_ok(), operator, "operator: {kind}");
            assert_eq!(c.authorize(Proposer::OnCall).is_ok(), kind == "drain", "on-call: {kind}");
            assert!(c.authorize(Proposer::Leader).is_ok(), "leader: {kind}");
        }
    }

    /// What a member says of itself, and an operator's reasons, are bounded in the log.
    #[test]
    fn a_nodes_words_are_bounded() {
        let join = |edit: &dyn Fn(&mut MemberSpec)| {
            let Command::Join { mut member } = all(2).remove(0) else {
                unreachable!("all() starts with a join")
            };
            edit(&mut member);
            Command::Join { member }.authorize(Proposer::Node(2)).map_err(|e| e.to_string())
        };
        assert!(join(&|m| m.name = "x".repeat(MAX_WORDS)).is_ok());
        let e = join(&|m| m.data_addr = "x".repeat(MAX_WORDS + 1)).unwrap_err();
        assert!(e.contains("join's data_addr is 1025 bytes; at most 1024"), "{e}");
        let e = join(&|m| m.hardware.gpu_model = "A100\u{1b}[2J".into()).unwrap_err();
        assert!(e.contains("join's hardware.gpu_model holds a control character"), "{e}");
        let drain = Command::Drain { id: 2, reason: "x".repeat(MAX_WORDS + 1) };
        assert!(drain.authorize(Proposer::Operator).unwrap_err().to_string().contains("drain's reason"));
        // The leader's own commands are its code's, not a peer's words.
        assert!(drain.authorize(Proposer::Leader).is_ok());
    }
}

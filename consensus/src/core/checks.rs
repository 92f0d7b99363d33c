//! The checks a peer's message passes before raft-rs sees it: raft-rs trusts its peers and
//! panics on (or quietly obeys) what a buggy or hostile one may send.

use super::{Core, StepError};
use crate::state::{CheckpointRecord, Command, MemberStatus, NodeId, Proposal, Proposer, SnapshotData};
use crate::storage::LogStore;
use raft::prelude::{ConfState, EntryType, Message, MessageType};

impl<S: LogStore> Core<S> {
    /// Refuses what raft-rs would panic on, or what would change the cluster behind the state
    /// machine, from a peer that may be buggy or hostile (its certificate already proved who
    /// it is): raft-rs trusts its peers and treats such messages as fatal bugs.
    pub(super) fn check_peer(&self, msg: &Message) -> std::result::Result<(), StepError> {
        let log = &self.raw.raft.raft_log;
        let (last, committed, from) = (log.last_index(), log.committed, msg.from);
        // raft-rs treats a term of 0 as its own local message (and may panic answering it);
        // only forwarded proposals and read requests travel without one.
        let forwarded = matches!(msg.get_msg_type(), MessageType::MsgPropose | MessageType::MsgReadIndex);
        if forwarded != (msg.term == 0) {
            return Err(StepError::Refused(format!(
                "{:?} from node {from} with term {}",
                msg.get_msg_type(),
                msg.term
            )));
        }
        // Only the configuration's nodes (voters and learners, both sides of a joint
        // configuration) speak raft here. A node that knows no configuration yet (a newcomer
        // before its first snapshot) cannot tell and takes the leader's word.
        let conf = self.raw.raft.prs().conf().to_conf_state();
        let known = !conf.voters.is_empty();
        let member = [&conf.voters, &conf.voters_outgoing, &conf.learners, &conf.learners_next]
            .iter()
            .any(|ids| ids.contains(&from));
        let kind = msg.get_msg_type();
        let as_leader = matches!(
            kind,
            MessageType::MsgAppend
                | MessageType::MsgHeartbeat
                | MessageType::MsgSnapshot
                | MessageType::MsgTimeoutNow
        );
        if known && as_leader {
            self.check_leader_claim(msg, &conf, member)?;
        } else if known && !member {
            return Err(StepError::Refused(format!(
                "{kind:?} from node {from}, which is not in the configuration"
            )));
        }
        // A term may run ahead of ours (elections we missed) but not without bound: a term
        // near u64::MAX, once adopted and persisted, overflows raft-rs's `term + 1` at the next
        // election and disables the node for good. With pre-vote, terms grow only by real
        // elections. The terms a message carries for log entries are never past its own.
        let ceiling = self.term().saturating_add(MAX_TERM_LEAD);
        if msg.term > ceiling {
            return Err(StepError::Refused(format!(
                "term {} from node {from}, past this node's {} by more than {MAX_TERM_LEAD}",
                msg.term,
                self.term()
            )));
        }
        // Indexes near u64::MAX overflow raft-rs's `index + 1` (a snapshot's, a rejection's
        // hint): no log gets anywhere near MAX_INDEX.
        let snap = msg.get_snapshot().get_metadata().index;
        let indexes = [msg.index, msg.commit, msg.reject_hint, snap];
        if indexes.iter().chain(msg.get_entries().iter().map(|e| &e.index)).any(|&i| i > MAX_INDEX) {
            return Err(StepError::Refused(format!(
                "{kind:?} from node {from} names an index past {MAX_INDEX}"
            )));
        }
        let past = |t: u64| !forwarded && t > msg.term;
        if past(msg.log_term)
            || msg.get_entries().iter().any(|e| past(e.term))
            || past(msg.get_snapshot().get_metadata().term)
        {
            return Err(StepError::Refused(format!(
                "{:?} from node {from} names a log term past its term {}",
                msg.get_msg_type(),
                msg.term
            )));
        }
        match msg.get_msg_type() {
            // `commit_to` panics past the last index.
            MessageType::MsgHeartbeat if msg.commit > last.max(committed) => {
                Err(StepError::Refused(format!(
                    "a heartbeat from node {from} commits index {} past its last index {last}",
                    msg.commit
                )))
            }
            // Entries must follow the message's index one by one: raft-rs slices the log by
            // their positions and panics on a conflict at or below the commit index, which
            // only entries out of sequence can reach (it answers appends below the commit).
            // raft-rs reads the term past its last index as 0, so an index or entry with term
            // 0 "matches" entries it does not hold and it commits past its log. Real entries
            // have terms from 1.
            MessageType::MsgAppend if msg.log_term == 0 && msg.index != 0 => Err(StepError::Refused(
                format!("an append from node {from} after index {} of term 0", msg.index),
            )),
            MessageType::MsgAppend => {
                for (i, e) in msg.get_entries().iter().enumerate() {
                    if e.term == 0 {
                        return Err(StepError::Refused(format!(
                            "an append from node {from} holds entry {} of term 0",
                            e.index
                        )));
                    }
                    if Some(e.index) != msg.index.checked_add(i as u64 + 1) {
                        return Err(StepError::Refused(format!(
                            "an append from node {from} after index {} holds entry {} at position {i}",
                            msg.index, e.index
                        )));
                    }
                }
                Ok(())
            }
            // A leader's progress for a peer must not pass its own log.
            MessageType::MsgAppendResponse if !msg.reject && msg.index > last => Err(StepError::Refused(
                format!("node {from} acknowledges index {} past the last index {last}", msg.index),
            )),
            MessageType::MsgPropose => self.check_forwarded(msg),
            // raft-rs takes the request's context from its first entry.
            MessageType::MsgReadIndex if msg.get_entries().len() != 1 => Err(StepError::Refused(format!(
                "a read request from node {from} with {} entries",
                msg.get_entries().len()
            ))),
            // Leadership is handed over only by the leader itself (before it leaves).
            MessageType::MsgTransferLeader => {
                Err(StepError::Refused(format!("node {from} asks for leadership")))
            }
            // ... and so only the current leader, in its term, may tell this node to campaign
            // now, and only while the log says it leaves (the voter controller hands
            // leadership over then and only then).
            MessageType::MsgTimeoutNow if from != self.raw.raft.leader_id || msg.term != self.term() => {
                Err(StepError::Refused(format!(
                    "node {from} tells this node to campaign (the leader is node {} of term {})",
                    self.raw.raft.leader_id,
                    self.term()
                )))
            }
            MessageType::MsgTimeoutNow
                if self.state.members.get(&from).is_some_and(|m| m.status.is_staying()) =>
            {
                Err(StepError::Refused(format!(
                    "node {from} tells this node to campaign, but the log says it stays"
                )))
            }
            MessageType::MsgSnapshot => {
                let meta = msg.get_snapshot().get_metadata();
                if meta.term == 0 || meta.index == 0 {
                    // Term 0 "matches" any index past the log (see appends above).
                    return Err(StepError::Refused(format!(
                        "a snapshot from node {from} at index {} of term {}",
                        meta.index, meta.term
                    )));
                }
                SnapshotData::decode(&msg.get_snapshot().data, self.cluster_id)
                    .map_err(|e| StepError::Refused(format!("snapshot from node {from}: {e}")))?;
                canonical_conf(msg.get_snapshot().get_metadata().get_conf_state()).map_err(|e| {
                    StepError::Refused(format!("snapshot from node {from}: its configuration {e}"))
                })
            }
            _ => Ok(()),
        }
    }

    /// Whether `msg` may come from a leader: what raft-rs obeys from whoever sends it at a
    /// term not below its own (it follows the sender, takes its entries, installs its
    /// snapshot). Raft has one leader a term, so at this node's term only the leader it knows
    /// speaks as one. A leader this node has not heard yet (a newer term, or none known) must
    /// be a node that may lead: a voter of this node's configuration whose member record has
    /// not failed or left, or a staying (joining, active) member whose promotion this node's
    /// configuration may not show yet. An id never admitted, a failed member (a learner kept
    /// in the configuration) or a gone one is refused at any term, so a spare credential or a
    /// member marked dead cannot take the log over.
    fn check_leader_claim(
        &self,
        msg: &Message,
        conf: &ConfState,
        member: bool,
    ) -> std::result::Result<(), StepError> {
        let (from, kind) = (msg.from, msg.get_msg_type());
        let leader = self.raw.raft.leader_id;
        if msg.term < self.term() {
            // raft-rs answers a stale leader of its configuration with its own term, which is
            // all it needs to step down; nothing of the message is taken.
            return if member {
                Ok(())
            } else {
                Err(StepError::Refused(format!(
                    "{kind:?} from node {from}, which is not in the configuration"
                )))
            };
        }
        if msg.term == self.term() && leader != 0 {
            return match (from == leader, member) {
                (true, _) => Ok(()),
                (false, false) => Err(StepError::Refused(format!(
                    "{kind:?} from node {from}, which is not in the configuration"
                ))),
                (false, true) => Err(StepError::Refused(format!(
                    "{kind:?} from node {from} at term {}, which node {leader} leads",
                    msg.term
                ))),
            };
        }
        let status = self.state.members.get(&from).map(|m| m.status);
        let voter = conf.voters.contains(&from) || conf.voters_outgoing.contains(&from);
        let may_lead = match status {
            Some(s) if s.is_staying() => true,
            Some(MemberStatus::Draining | MemberStatus::Leaving) => voter,
            // A state without members is a bootstrap's before its first entry.
            None => voter && self.state.members.is_empty(),
            Some(_) => false,
        };
        if may_lead {
            return Ok(());
        }
        let what = match status {
            None => "was never admitted".to_string(),
            Some(s) => format!("is {s:?} in the log"),
        };
        Err(StepError::Refused(format!(
            "{kind:?} from node {from} at term {} (this node's is {}): node {from} {what} and may not lead",
            msg.term,
            self.term()
        )))
    }

    /// A follower's proposal forwarded to this (leading) node: normal entries only (the
    /// membership controller alone changes the voters), each a proposal of the node that
    /// forwarded it that this node may make about itself (`Command::authorize`).
    fn check_forwarded(&self, msg: &Message) -> std::result::Result<(), StepError> {
        let from = msg.from;
        if msg.get_entries().is_empty() {
            // raft-rs treats an empty proposal as a fatal bug.
            return Err(StepError::Refused(format!("an empty proposal from node {from}")));
        }
        for e in msg.get_entries() {
            if e.get_entry_type() != EntryType::EntryNormal {
                return Err(StepError::Refused(format!("node {from} proposes a configuration change")));
            }
            let p = Proposal::decode(&e.data)
                .map_err(|err| StepError::Refused(format!("a proposal from node {from}: {err}")))?;
            if p.origin.node != from {
                return Err(StepError::Refused(format!(
                    "a proposal from node {from} speaks for node {}",
                    p.origin.node
                )));
            }
            // Raft carries a node's own proposals only: whatever needs more authority (an
            // operator's, the leader's controllers') is proposed at the leader itself.
            p.command
                .authorize(Proposer::Node(from))
                .map_err(|why| StepError::Refused(format!("a forwarded proposal: {why}")))?;
            if let Command::RecordCheckpoint { record } = &p.command {
                self.check_checkpoint_report(from, record)?;
            }
        }
        Ok(())
    }

    /// A member's report of a checkpoint it wrote: a content hash as the state's is written
    /// (64 lowercase hex digits) and a location of at most [`MAX_CHECKPOINT_LOCATION`] bytes
    /// with no control character (the log keeps the newest records in every snapshot, and
    /// `limpet status` prints them to an operator's terminal, which a control sequence would
    /// drive); of an epoch it trains in (a new cluster's resume point, epoch 0, is the
    /// leader's to record), at a step inside that epoch and the job. A record past them
    /// would make the log refuse every real one after it.
    pub(crate) fn check_checkpoint_report(
        &self,
        from: NodeId,
        r: &CheckpointRecord,
    ) -> std::result::Result<(), StepError> {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        if r.content_hash.len() != 64 || !r.content_hash.bytes().all(hex) {
            return Err(StepError::Refused(format!(
                "node {from} reports a checkpoint whose content hash is not 64 lowercase hex digits ({} bytes)",
                r.content_hash.len()
            )));
        }
        let location = match &r.location {
            l if l.is_empty() => Some("is empty"),
            l if l.len() > MAX_CHECKPOINT_LOCATION => Some("is longer than 4096 bytes"),
            l if l.chars().any(char::is_control) => Some("holds a control character"),
            _ => None,
        };
        if let Some(why) = location {
            return Err(StepError::Refused(format!(
                "node {from} reports a checkpoint location that {why} ({} bytes)",
                r.location.len()
            )));
        }
        let epoch = self.state.history.iter().find(|e| e.id == r.epoch && r.epoch != 0);
        let Some(epoch) = epoch.filter(|e| e.ranks.contains(&from)) else {
            return Err(StepError::Refused(format!(
                "node {from} reports a checkpoint of epoch {}, which it does not train in",
                r.epoch
            )));
        };
        let total = self.state.job.as_ref().and_then(|j| j.get("steps")).and_then(serde_json::Value::as_u64);
        // An epoch that ended trained up to the next one's start.
        let end = self.state.history.iter().find(|e| e.id > epoch.id).map(|e| e.start_step);
        if r.step < epoch.start_step || total.is_some_and(|t| r.step > t) || end.is_some_and(|s| r.step > s) {
            return Err(StepError::Refused(format!(
                "node {from} reports a checkpoint at step {}, outside epoch {} (steps {}..={}) and the job ({total:?} steps)",
                r.step,
                epoch.id,
                epoch.start_step,
                end.map_or("".to_string(), |s| s.to_string())
            )));
        }
        Ok(())
    }
}

/// The longest checkpoint location a member may record: a path the kernel can open
/// (`PATH_MAX`), or an S3 URL of one.
pub const MAX_CHECKPOINT_LOCATION: usize = 4096;

/// Whether a configuration is one raft-rs can restore as it is: raft-rs rebuilds it from
/// the lists and treats any difference from what it was sent (a duplicate, an id in two
/// roles, a joint state without its outgoing half) as a fatal bug.
fn canonical_conf(cs: &ConfState) -> std::result::Result<(), String> {
    let lists = [
        ("voters", cs.get_voters()),
        ("learners", cs.get_learners()),
        ("outgoing voters", cs.get_voters_outgoing()),
        ("next learners", cs.get_learners_next()),
    ];
    for (name, ids) in lists {
        let mut seen = std::collections::BTreeSet::new();
        if let Some(id) = ids.iter().find(|&&id| id == 0 || !seen.insert(id)) {
            return Err(format!("lists {name} with id {id} zero or twice"));
        }
    }
    let (voters, learners, outgoing, next) =
        (cs.get_voters(), cs.get_learners(), cs.get_voters_outgoing(), cs.get_learners_next());
    if voters.is_empty() {
        return Err("has no voters".into());
    }
    if let Some(id) = learners.iter().find(|id| voters.contains(id) || outgoing.contains(id)) {
        return Err(format!("has node {id} as a learner and a voter"));
    }
    if let Some(id) = next.iter().find(|id| voters.contains(id) || !outgoing.contains(id)) {
        return Err(format!("has node {id} as a next learner that is not only an outgoing voter"));
    }
    if cs.auto_leave && outgoing.is_empty() {
        return Err("leaves a joint state it is not in".into());
    }
    Ok(())
}

/// The largest log index a peer may name: far past any real log, far below where raft-rs's
/// `index + 1` overflows.
pub const MAX_INDEX: u64 = u64::MAX / 4;

/// How far past this node's term a peer's term may be: about 12 days of one election a
/// second, and far below where `term + 1` overflows.
pub const MAX_TERM_LEAD: u64 = 1 << 20;

//! How a command changes the state: `ClusterState::apply`, which checks a command against
//! the state and makes its change (a member's life, the job, the epochs, the records) or
//! refuses it, and the Raft configuration mirrored after a configuration change.

use super::{
    CheckpointRecord, ClusterState, Command, Epoch, Hardware, Member, MemberSpec, MemberStatus, NodeId,
    Outcome, Refused, MAX_CHECKPOINT_RECORDS, MAX_EPOCH_HISTORY,
};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

impl ClusterState {
    /// A member's record to change: copied first while a reader still holds it.
    fn member_mut(&mut self, id: &NodeId) -> Option<&mut Member> {
        self.members.get_mut(id).map(Arc::make_mut)
    }

    /// Applies a round's commands in order until one is refused (those after it are
    /// dropped, as a leader proposing them one by one stops at a refusal): `Ok` when the
    /// first was applied, saying what each did; `Err` (state unchanged) when the first was
    /// refused, or the round is empty or holds a round.
    fn apply_round(&mut self, commands: &[Command]) -> Outcome {
        if commands.is_empty() {
            return Err(Refused("an empty round".into()));
        }
        if commands.iter().any(|c| matches!(c, Command::Round { .. })) {
            return Err(Refused("a round within a round".into()));
        }
        let mut said = Vec::with_capacity(commands.len());
        for (i, c) in commands.iter().enumerate() {
            match self.apply(c) {
                Ok(what) => said.push(what),
                Err(Refused(why)) if i == 0 => return Err(Refused(why)),
                Err(Refused(why)) => {
                    said.push(format!(
                        "{} refused ({why}); the round's {} command(s) after it dropped",
                        c.kind(),
                        commands.len() - i - 1
                    ));
                    break;
                }
            }
        }
        Ok(said.join("; "))
    }

    /// Applies a command; `Ok` says what changed, `Err` why it was refused (state unchanged).
    pub fn apply(&mut self, command: &Command) -> Outcome {
        let outcome = match command {
            Command::Join { member } => self.apply_join(member),
            Command::Activate { id } => self.set_status(*id, Transition::Activate, "activated"),
            Command::Notice { id, deadline_ms, source } => self.apply_notice(*id, *deadline_ms, source),
            Command::Drain { id, reason } => self.set_status(*id, Transition::Drain, reason),
            Command::MarkFailed { id, reason } => self.set_status(*id, Transition::Fail, reason),
            Command::Remove { id, reason } => self.set_status(*id, Transition::Remove, reason),
            Command::UpdateHardware { id, hardware } => match self.member_mut(id) {
                Some(m) => {
                    let speed_milli = m.spec.hardware.speed_milli;
                    m.spec.hardware = Hardware { speed_milli, ..hardware.clone() };
                    Ok(format!("node {id} hardware updated"))
                }
                None => Err(Refused(format!("node {id} is not a member"))),
            },
            Command::RecordSpeed { id, speed_milli } => match self.member_mut(id) {
                Some(m) => {
                    m.spec.hardware.speed_milli = *speed_milli;
                    Ok(format!("node {id} measured at speed x{:.2}", *speed_milli as f64 / 1000.0))
                }
                None => Err(Refused(format!("node {id} is not a member"))),
            },
            Command::SetJob { job } => match &self.job {
                None => {
                    self.job = Some(job.clone());
                    Ok("job set".into())
                }
                Some(existing) if existing == job => Ok("job unchanged".into()),
                Some(_) => Err(Refused("a different job is already set; a running job cannot change".into())),
            },
            Command::ScheduleEpoch { epoch } => self.apply_schedule(epoch),
            Command::Round { commands } => self.apply_round(commands),
            Command::ActivateEpoch { id } => match self.scheduled.take() {
                Some(e) if e.id == *id => {
                    self.history.push(Arc::new(e.clone()));
                    if self.history.len() > MAX_EPOCH_HISTORY {
                        self.history.remove(0);
                    }
                    self.current = Some(e);
                    Ok(format!("epoch {id} started"))
                }
                other => {
                    let why = match &other {
                        Some(e) => format!("epoch {id} is not scheduled (epoch {} is)", e.id),
                        None => format!("epoch {id} is not scheduled (nothing is)"),
                    };
                    self.scheduled = other;
                    Err(Refused(why))
                }
            },
            Command::RecordCheckpoint { record } => self.apply_checkpoint(record),
            Command::RecordCapacity { record } => self.capacity.apply(record),
            Command::RecordThroughput { record } => self.throughput.apply(record, self.last_epoch_id),
            Command::RevokeCertificate { fingerprint, name } => self.revoked.apply(fingerprint, name),
            Command::CancelEpoch { id, reason } => match &self.scheduled {
                Some(e) if e.id == *id => {
                    self.scheduled = None;
                    Ok(format!("epoch {id} withdrawn: {reason}"))
                }
                _ => Err(Refused(format!("epoch {id} is not scheduled"))),
            },
        };
        debug_assert_eq!(self.validate(), Ok(()), "after {command:?}");
        outcome
    }

    fn apply_join(&mut self, spec: &MemberSpec) -> Outcome {
        if spec.id == 0 {
            return Err(Refused("node id 0 is reserved".into()));
        }
        if spec.name.is_empty() {
            return Err(Refused(format!("node {} has an empty name", spec.id)));
        }
        // Names are a member's word, but a spare credential's name is its node id's (its
        // certificate is issued for the id of its name): another node may not take the name
        // of a spare the reconciler launched, and a node that squatted a spare's name before
        // its launch gives the name up when the spare itself joins.
        let owner = super::node_id_of_name(&spec.name);
        let launched = self.capacity.records.iter().any(|r| {
            matches!(&r.action, super::CapacityAction::Launch { node_name: Some(n), .. } if *n == spec.name)
        });
        if launched && owner != spec.id {
            return Err(Refused(format!(
                "name {:?} is a launched spare's (node {owner}), not node {}'s",
                spec.name, spec.id
            )));
        }
        if let Some(other) = self
            .members
            .values()
            .find(|m| m.spec.id != spec.id && m.spec.name == spec.name && m.status != MemberStatus::Gone)
            .map(|m| m.spec.id)
        {
            if owner != spec.id || other == owner {
                return Err(Refused(format!("name {:?} is taken by node {other}", spec.name)));
            }
            let squatter = self.member_mut(&other).expect("found above");
            squatter.spec.name = format!("{}#{other}", spec.name);
        }
        match self.member_mut(&spec.id) {
            Some(m) if m.status.is_staying() || m.status == MemberStatus::Draining => {
                let speed_milli = m.spec.hardware.speed_milli;
                m.spec = spec.clone();
                m.spec.hardware.speed_milli = speed_milli;
                Ok(format!("node {} refreshed", spec.id))
            }
            Some(m) => {
                *m = Member {
                    spec: unmeasured(spec),
                    status: MemberStatus::Joining,
                    reason: format!("rejoined after {:?}", m.status),
                    deadline_ms: None,
                };
                self.gone.retain(|&g| g != spec.id);
                Ok(format!("node {} rejoined", spec.id))
            }
            None => {
                self.members.insert(
                    spec.id,
                    Arc::new(Member {
                        spec: unmeasured(spec),
                        status: MemberStatus::Joining,
                        reason: "joined".into(),
                        deadline_ms: None,
                    }),
                );
                Ok(format!("node {} ({}) joined", spec.id, spec.name))
            }
        }
    }

    fn apply_notice(&mut self, id: NodeId, deadline_ms: u64, source: &str) -> Outcome {
        let m = self.member_mut(&id).ok_or_else(|| Refused(format!("node {id} is not a member")))?;
        match m.status {
            MemberStatus::Failed | MemberStatus::Gone => {
                Err(Refused(format!("node {id} is already {:?}", m.status)))
            }
            MemberStatus::Leaving if m.deadline_ms.is_some_and(|d| d <= deadline_ms) => {
                Ok(format!("node {id} already leaving by {}", m.deadline_ms.unwrap_or(0)))
            }
            _ => {
                m.status = MemberStatus::Leaving;
                m.deadline_ms = Some(deadline_ms);
                m.reason = format!("revocation notice from {source}");
                Ok(format!("node {id} leaving by {deadline_ms} ({source})"))
            }
        }
    }

    fn set_status(&mut self, id: NodeId, t: Transition, reason: &str) -> Outcome {
        let m = self.member_mut(&id).ok_or_else(|| Refused(format!("node {id} is not a member")))?;
        let from = m.status;
        let to = match (t, from) {
            (Transition::Activate, MemberStatus::Joining | MemberStatus::Active) => MemberStatus::Active,
            (Transition::Drain, MemberStatus::Joining | MemberStatus::Active | MemberStatus::Draining) => {
                MemberStatus::Draining
            }
            (Transition::Fail, s) if s != MemberStatus::Gone => MemberStatus::Failed,
            (Transition::Remove, _) => MemberStatus::Gone,
            _ => return Err(Refused(format!("node {id} is {from:?}; cannot {}", t.verb()))),
        };
        if from == to {
            return Ok(format!("node {id} already {to:?}"));
        }
        m.status = to;
        m.reason = reason.to_string();
        if to != MemberStatus::Leaving {
            m.deadline_ms = None;
        }
        if to == MemberStatus::Gone {
            self.gone.push_back(id);
            self.forget_gone();
        }
        Ok(format!("node {id}: {from:?} -> {to:?}"))
    }

    fn apply_schedule(&mut self, epoch: &Epoch) -> Outcome {
        if epoch.id <= self.last_epoch_id {
            return Err(Refused(format!("epoch id {} is not above {}", epoch.id, self.last_epoch_id)));
        }
        if let Some(cur) = &self.current {
            if epoch.start_step < cur.start_step {
                return Err(Refused(format!(
                    "epoch {} starts at step {} before the current epoch's start {}",
                    epoch.id, epoch.start_step, cur.start_step
                )));
            }
        }
        self.check_epoch(epoch)?;
        self.last_epoch_id = epoch.id;
        let replaced = self.scheduled.replace(epoch.clone());
        Ok(match replaced {
            Some(old) => {
                format!("epoch {} scheduled at step {} (replaces {})", epoch.id, epoch.start_step, old.id)
            }
            None => format!("epoch {} scheduled at step {}", epoch.id, epoch.start_step),
        })
    }

    /// Records a checkpoint. Records are kept in step order, but each writer orders only its
    /// own: a record older than another node's newest is still taken (a member's record at
    /// the job's last step must not make the log refuse every honest record after it), and
    /// when the log keeps too many it drops the oldest record of the writer that holds the
    /// most, so no writer's records flush out another's.
    fn apply_checkpoint(&mut self, r: &CheckpointRecord) -> Outcome {
        // A writer whose proposal went unanswered (its leader died) sends it again; both may
        // land.
        if self.checkpoints.iter().any(|c| c == r) {
            return Ok(format!("checkpoint at step {} already recorded", r.step));
        }
        if let Some(last) = self.checkpoints.iter().rev().find(|c| c.node == r.node) {
            if r.step < last.step {
                return Err(Refused(format!(
                    "checkpoint at step {} is older than node {}'s last one ({})",
                    r.step, r.node, last.step
                )));
            }
        }
        let newest_epoch = self.last_epoch_id;
        if r.epoch > newest_epoch {
            return Err(Refused(format!(
                "checkpoint names epoch {}, newer than any scheduled ({newest_epoch})",
                r.epoch
            )));
        }
        // After every record of its step or below: a step written again (after going back)
        // reads as the latest of its step.
        let at = self.checkpoints.partition_point(|c| c.step <= r.step);
        self.checkpoints.insert(at, r.clone());
        if self.checkpoints.len() > MAX_CHECKPOINT_RECORDS {
            let mut held: BTreeMap<NodeId, usize> = BTreeMap::new();
            for c in &self.checkpoints {
                *held.entry(c.node).or_default() += 1;
            }
            let most = held.values().copied().max().unwrap_or(0);
            let drop = self.checkpoints.iter().position(|c| held[&c.node] == most).unwrap_or(0);
            self.checkpoints.remove(drop);
        }
        Ok(format!("checkpoint at step {} recorded", r.step))
    }

    /// Mirrors the Raft configuration after a configuration change is applied.
    pub fn set_configuration(&mut self, voters: &[NodeId], learners: &[NodeId]) {
        self.voters = sorted(voters);
        self.learners = sorted(learners);
        self.forget_gone();
    }

    /// Drops the records of the members that left first while more than
    /// [`super::MAX_GONE_RECORDS`] are kept, skipping any still in the raft configuration or
    /// an epoch (until it leaves them).
    fn forget_gone(&mut self) {
        // Gone records from before the list was kept count too, as the first to have left
        // (by id: the same order on every node).
        let untracked: Vec<NodeId> = self
            .members
            .values()
            .filter(|m| m.status == MemberStatus::Gone && !self.gone.contains(&m.spec.id))
            .map(|m| m.spec.id)
            .collect();
        for id in untracked.into_iter().rev() {
            self.gone.push_front(id);
        }
        let mut excess = self.gone.len().saturating_sub(super::MAX_GONE_RECORDS);
        if excess == 0 {
            return;
        }
        let held = |st: &ClusterState, id: NodeId| {
            st.voters.contains(&id)
                || st.learners.contains(&id)
                || [&st.current, &st.scheduled].into_iter().flatten().any(|e| e.ranks.contains(&id))
        };
        let mut kept = VecDeque::with_capacity(self.gone.len());
        for id in std::mem::take(&mut self.gone) {
            if excess > 0 && !held(self, id) {
                self.members.remove(&id);
                excess -= 1;
            } else {
                kept.push_back(id);
            }
        }
        self.gone = kept;
    }
}

#[derive(Clone, Copy)]
enum Transition {
    Activate,
    Drain,
    Fail,
    Remove,
}

impl Transition {
    fn verb(self) -> &'static str {
        match self {
            Transition::Activate => "activate",
            Transition::Drain => "drain",
            Transition::Fail => "mark failed",
            Transition::Remove => "remove",
        }
    }
}

fn sorted(ids: &[NodeId]) -> Vec<NodeId> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v
}

/// A joining node's record without a speed: only the leader measures it
/// ([`Command::RecordSpeed`]), and a member's word may not claim one.
fn unmeasured(spec: &MemberSpec) -> MemberSpec {
    let mut spec = spec.clone();
    spec.hardware.speed_milli = 0;
    spec
}

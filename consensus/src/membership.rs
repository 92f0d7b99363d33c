//! The leader's voter controller: which nodes vote, as a pure function of what the leader
//! sees. It does no I/O; `Core` feeds it a `VoterView` every tick and carries out the
//! `VoterDecision` it returns, and tests call it directly.
//!
//! Rules, in order (the first that applies wins, one change at a time):
//! 1. While a configuration change is pending or a leadership transfer runs, wait.
//! 2. If the leader itself is leaving, hand leadership to a healthy voter first.
//! 3. Members not yet in the configuration become learners; gone learners are removed.
//! 4. Voters that are leaving, gone, failed, or silent longer than the failure timeout are
//!    demoted (or removed, when gone) in one joint-consensus change that also promotes healthy,
//!    caught-up learners in their place.
//! 5. While there are fewer voters than the target (the largest odd number not above
//!    `max_voters` and the healthy candidates), healthy learners are promoted; while there
//!    are more than `max_voters` (a smaller `max_voters` than the founding voters), the extra
//!    voters become learners.
//! 6. While a zone (`Hardware::zone`, a failure domain) holds two voters more than another
//!    zone with a ready learner, one of its voters (never the leader) is swapped for that
//!    learner. Promotions (rules 4 and 5) pick learners of the zones with the fewest voters
//!    first. So five voters over three zones sit 2-2-1, and losing any one zone keeps a
//!    quorum.

use crate::state::{MemberStatus, NodeId};
use std::collections::BTreeMap;

/// Knobs of the controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VoterPolicy {
    /// At most this many voters (odd; default 5).
    pub max_voters: usize,
    /// A voter not heard from for this many ticks is replaced.
    pub failed_after_ticks: u64,
    /// A learner counts as healthy when heard from within this many ticks.
    pub healthy_within_ticks: u64,
    /// A learner is caught up when it matches the leader's log within this many entries.
    pub catch_up_slack: u64,
}

impl Default for VoterPolicy {
    fn default() -> VoterPolicy {
        VoterPolicy { max_voters: 5, failed_after_ticks: 50, healthy_within_ticks: 10, catch_up_slack: 50 }
    }
}

impl VoterPolicy {
    /// Checks the knobs (the core's configuration check turns the reason into
    /// `ConsensusError::Config`).
    #[cfg_attr(not(feature = "node"), allow(dead_code))]
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_voters == 0 || self.max_voters % 2 == 0 {
            return Err(format!("max_voters must be odd and positive, not {}", self.max_voters));
        }
        if self.failed_after_ticks == 0 || self.healthy_within_ticks == 0 {
            return Err("failure and health windows must be positive".into());
        }
        Ok(())
    }
}

/// What the leader sees.
#[derive(Clone, Debug)]
pub struct VoterView<'a> {
    /// The leader's id.
    pub me: NodeId,
    /// Current voters (incoming, if joint).
    pub voters: &'a [NodeId],
    /// Current learners.
    pub learners: &'a [NodeId],
    /// A configuration change is proposed but not applied, or the configuration is joint.
    pub change_pending: bool,
    /// A leadership transfer is running.
    pub transferring: bool,
    /// Members as the replicated state has them.
    pub members: &'a crate::state::Members,
    /// Ticks since the leader last heard from each peer (absent: never).
    pub heard_ago: &'a BTreeMap<NodeId, u64>,
    /// Each peer's matched log index.
    pub matched: &'a BTreeMap<NodeId, u64>,
    /// The leader's last log index.
    pub last_index: u64,
}

/// What to do about the voter set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VoterDecision {
    /// Hand leadership to this voter.
    TransferLeader {
        /// The new leader.
        to: NodeId,
    },
    /// One configuration change (joint consensus when it touches voters).
    Reconfigure {
        /// Learners to make voters.
        promote: Vec<NodeId>,
        /// Voters to make learners.
        demote: Vec<NodeId>,
        /// New learners.
        add_learners: Vec<NodeId>,
        /// Nodes to drop from the configuration.
        remove: Vec<NodeId>,
    },
}

impl VoterView<'_> {
    fn status(&self, id: NodeId) -> Option<MemberStatus> {
        self.members.get(&id).map(|m| m.status)
    }

    fn heard(&self, id: NodeId) -> Option<u64> {
        if id == self.me {
            Some(0)
        } else {
            self.heard_ago.get(&id).copied()
        }
    }

    /// A voter that must go: leaving, failed, gone, unknown, or silent too long.
    fn voter_must_go(&self, id: NodeId, policy: &VoterPolicy) -> Option<String> {
        match self.status(id) {
            None => return Some(format!("voter {id} is not a member")),
            Some(s) if !s.is_staying() => return Some(format!("voter {id} is {s:?}")),
            Some(_) => {}
        }
        match self.heard(id) {
            Some(t) if t <= policy.failed_after_ticks => None,
            Some(t) => Some(format!("voter {id} silent for {t} ticks")),
            None => Some(format!("voter {id} never heard from")),
        }
    }

    fn zone(&self, id: NodeId) -> &str {
        self.members.get(&id).map_or("", |m| m.spec.hardware.zone.as_str())
    }

    /// Voters per zone, of `voters`.
    fn per_zone(&self, voters: impl Iterator<Item = NodeId>) -> BTreeMap<&str, usize> {
        let mut out = BTreeMap::new();
        for v in voters {
            *out.entry(self.zone(v)).or_insert(0) += 1;
        }
        out
    }

    /// Up to `n` of `candidates`, each from the zone with the fewest voters so far (counting
    /// `staying` and those already picked); ties go to the candidates' order.
    fn pick_spread(&self, staying: &[NodeId], candidates: &[NodeId], n: usize) -> Vec<NodeId> {
        let mut counts = self.per_zone(staying.iter().copied());
        let mut left: Vec<NodeId> = candidates.to_vec();
        let mut out = Vec::new();
        while out.len() < n && !left.is_empty() {
            let k = (0..left.len())
                .min_by_key(|&k| (counts.get(self.zone(left[k])).copied().unwrap_or(0), k))
                .expect("not empty");
            let id = left.remove(k);
            *counts.entry(self.zone(id)).or_insert(0) += 1;
            out.push(id);
        }
        out
    }

    fn learner_ready(&self, id: NodeId, policy: &VoterPolicy) -> bool {
        self.status(id).is_some_and(MemberStatus::is_staying)
            && self.heard(id).is_some_and(|t| t <= policy.healthy_within_ticks)
            && self.matched.get(&id).is_some_and(|m| m + policy.catch_up_slack >= self.last_index)
    }
}

/// Ticks of silence of each peer as a leader that took over at tick `since` may count them:
/// from the later of the peer's last message and `since`. A new leader has heard from only
/// the peers that voted before it won; counting the others as silent since ever (or since
/// their last message to the previous leader) would demote a healthy voter in the leader's
/// first tick. The peers of the configuration that it never heard from count from `since`.
pub fn silence(
    heard: &BTreeMap<NodeId, u64>,
    configured: impl Iterator<Item = NodeId>,
    now: u64,
    since: u64,
) -> BTreeMap<NodeId, u64> {
    let mut out: BTreeMap<NodeId, u64> =
        heard.iter().map(|(&id, &t)| (id, now.saturating_sub(t.max(since)))).collect();
    for id in configured {
        out.entry(id).or_insert(now.saturating_sub(since));
    }
    out
}

fn largest_odd_at_most(n: usize) -> usize {
    if n == 0 {
        0
    } else if n % 2 == 1 {
        n
    } else {
        n - 1
    }
}

/// Decides the next change to the voter set, with its reason; `None` when nothing is due.
pub fn plan(view: &VoterView<'_>, policy: &VoterPolicy) -> Option<(VoterDecision, String)> {
    if view.change_pending || view.transferring {
        return None;
    }
    if let Some(why) = leader_must_go(view) {
        let successor = view
            .voters
            .iter()
            .copied()
            .filter(|&v| v != view.me && view.voter_must_go(v, policy).is_none())
            .min_by_key(|&v| (std::cmp::Reverse(view.matched.get(&v).copied().unwrap_or(0)), v));
        // Without a healthy voter to take over, fall through: promoting a learner first
        // makes one.
        if let Some(to) = successor {
            return Some((
                VoterDecision::TransferLeader { to },
                format!("{why}; transferring leadership to {to}"),
            ));
        }
    }
    let in_conf = |id: &NodeId| view.voters.contains(id) || view.learners.contains(id);
    let add_learners: Vec<NodeId> = view
        .members
        .values()
        .filter(|m| {
            m.status != MemberStatus::Gone && m.status != MemberStatus::Failed && !in_conf(&m.spec.id)
        })
        .map(|m| m.spec.id)
        .collect();
    // Failed learners stay: a node outside the configuration could not reach the leader to
    // rejoin (raft forwards only a configured node's proposals).
    let remove: Vec<NodeId> = view
        .learners
        .iter()
        .copied()
        .filter(|&l| matches!(view.status(l), None | Some(MemberStatus::Gone)))
        .collect();
    if !add_learners.is_empty() || !remove.is_empty() {
        let why = format!("learners: add {add_learners:?}, remove {remove:?}");
        return Some((reconfigure(vec![], vec![], add_learners, remove), why));
    }

    let going: Vec<(NodeId, String)> = view
        .voters
        .iter()
        .copied()
        .filter(|&v| v != view.me)
        .filter_map(|v| view.voter_must_go(v, policy).map(|why| (v, why)))
        .collect();
    let staying = view.voters.len() - going.len();
    let candidates: Vec<NodeId> =
        view.learners.iter().copied().filter(|&l| view.learner_ready(l, policy)).collect();
    let target = largest_odd_at_most(policy.max_voters.min(staying + candidates.len())).max(1);
    let kept: Vec<NodeId> =
        view.voters.iter().copied().filter(|v| !going.iter().any(|(g, _)| g == v)).collect();
    let promote = view.pick_spread(&kept, &candidates, target.saturating_sub(staying));

    if !going.is_empty() {
        let (mut demote, mut remove) = (Vec::new(), Vec::new());
        for (v, _) in &going {
            match view.status(*v) {
                None | Some(MemberStatus::Gone) => remove.push(*v),
                _ => demote.push(*v),
            }
        }
        let reasons: Vec<&str> = going.iter().map(|(_, w)| w.as_str()).collect();
        let why = format!("{}; replacing with {promote:?}", reasons.join(", "));
        return Some((reconfigure(promote, demote, vec![], remove), why));
    }
    if staying > policy.max_voters {
        // More voters than allowed (a `max_voters` below the founding voters'): every
        // commit waits for a majority of them and every leader feeds them all, so the extra
        // ones become learners, from the most crowded zones first, the leader never.
        let mut counts = view.per_zone(kept.iter().copied());
        let mut demote = Vec::new();
        for _ in policy.max_voters..staying {
            let pick = kept
                .iter()
                .copied()
                .filter(|&v| v != view.me && !demote.contains(&v))
                .max_by_key(|&v| (counts.get(view.zone(v)).copied().unwrap_or(0), v));
            let Some(v) = pick else { break };
            *counts.entry(view.zone(v)).or_insert(1) -= 1;
            demote.push(v);
        }
        let why = format!("{staying} voters, at most {}: demoting {demote:?} to learners", policy.max_voters);
        return Some((reconfigure(vec![], demote, vec![], vec![]), why));
    }
    if !promote.is_empty() {
        let why = format!("{staying} voters, target {target}: promoting {promote:?}");
        return Some((reconfigure(promote, vec![], vec![], vec![]), why));
    }
    spread_over_zones(view, &candidates)
}

/// Rule 6: one voter of the zone with the most voters swapped for a ready learner of a zone
/// with at least two fewer, if there is one.
fn spread_over_zones(view: &VoterView<'_>, ready: &[NodeId]) -> Option<(VoterDecision, String)> {
    let counts = view.per_zone(view.voters.iter().copied());
    let (&crowded, &most) = counts.iter().max_by_key(|&(z, n)| (*n, std::cmp::Reverse(*z)))?;
    let learner = ready
        .iter()
        .copied()
        .filter(|&l| counts.get(view.zone(l)).copied().unwrap_or(0) + 2 <= most)
        .min_by_key(|&l| (counts.get(view.zone(l)).copied().unwrap_or(0), l))?;
    let voter = view.voters.iter().copied().filter(|&v| v != view.me && view.zone(v) == crowded).max()?;
    let why = format!(
        "zone {crowded:?} holds {most} voters and zone {:?} {}: voter {voter} swapped for learner {learner}",
        view.zone(learner),
        counts.get(view.zone(learner)).copied().unwrap_or(0)
    );
    Some((reconfigure(vec![learner], vec![voter], vec![], vec![]), why))
}

fn leader_must_go(view: &VoterView<'_>) -> Option<String> {
    match view.status(view.me) {
        Some(s) if !s.is_staying() => Some(format!("leader {} is {s:?}", view.me)),
        None if !view.members.is_empty() => Some(format!("leader {} is not a member", view.me)),
        _ => None,
    }
}

fn reconfigure(
    promote: Vec<NodeId>,
    demote: Vec<NodeId>,
    add_learners: Vec<NodeId>,
    remove: Vec<NodeId>,
) -> VoterDecision {
    VoterDecision::Reconfigure { promote, demote, add_learners, remove }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Hardware, Member, MemberSpec};
    use std::sync::Arc;

    fn member(id: NodeId, status: MemberStatus) -> Member {
        Member {
            spec: MemberSpec {
                id,
                name: format!("n{id}"),
                control_addr: String::new(),
                data_addr: String::new(),
                hardware: Hardware::default(),
            },
            status,
            reason: String::new(),
            deadline_ms: None,
        }
    }

    struct World {
        members: crate::state::Members,
        heard: BTreeMap<NodeId, u64>,
        matched: BTreeMap<NodeId, u64>,
        voters: Vec<NodeId>,
        learners: Vec<NodeId>,
    }

    impl World {
        fn new(voters: &[NodeId], learners: &[NodeId]) -> World {
            let all: Vec<NodeId> = voters.iter().chain(learners).copied().collect();
            World {
                members: all.iter().map(|&i| (i, Arc::new(member(i, MemberStatus::Active)))).collect(),
                heard: all.iter().map(|&i| (i, 1)).collect(),
                matched: all.iter().map(|&i| (i, 100)).collect(),
                voters: voters.to_vec(),
                learners: learners.to_vec(),
            }
        }

        fn plan(&self, me: NodeId) -> Option<(VoterDecision, String)> {
            let view = VoterView {
                me,
                voters: &self.voters,
                learners: &self.learners,
                change_pending: false,
                transferring: false,
                members: &self.members,
                heard_ago: &self.heard,
                matched: &self.matched,
                last_index: 100,
            };
            plan(&view, &VoterPolicy::default())
        }
    }

    /// Nine nodes in three zones, founded with voters 1-5 in zones a, a, a, b, b: learners
    /// are promoted from the emptiest zone, and the crowded zone's voters are swapped one at
    /// a time until no zone holds two more than another, whence losing a zone keeps a quorum.
    #[test]
    fn voters_spread_over_zones_so_that_any_one_zone_can_be_lost() {
        let zone = |id: NodeId| ["a", "a", "a", "b", "b", "c", "c", "b", "a"][id as usize - 1];
        let mut w = World::new(&[1, 2, 3], &[4, 5, 6, 7, 8, 9]);
        for (id, m) in w.members.iter_mut() {
            Arc::make_mut(m).spec.hardware.zone = zone(*id).into();
        }
        let (d, _) = w.plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![4, 6], vec![], vec![], vec![]), "one from b, one from c");
        w.voters = vec![1, 2, 3, 4, 6];
        w.learners = vec![5, 7, 8, 9];
        // Zone a holds 3 voters, b and c one each: one of a's (never the leader) goes for a
        // learner of b or c.
        let (d, why) = w.plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![5], vec![3], vec![], vec![]), "{why}");
        assert!(why.contains("zone \"a\" holds 3 voters"), "{why}");
        w.voters = vec![1, 2, 4, 5, 6];
        w.learners = vec![3, 7, 8, 9];
        assert_eq!(w.plan(1), None, "2-2-1 stays");
        let counts = w.voters.iter().fold(BTreeMap::new(), |mut m, &v| {
            *m.entry(zone(v)).or_insert(0) += 1;
            m
        });
        assert!(counts.values().all(|&n| w.voters.len() - n > w.voters.len() / 2), "{counts:?}");
        // Without zones (all empty), nothing moves: the same as before zones existed.
        let plain = World::new(&[1, 2, 3, 4, 5], &[6, 7]);
        assert_eq!(plain.plan(1), None);
    }

    /// Forty voters (a configuration that allowed them, say) where five are allowed: all but
    /// five become learners in one change, the leader staying a voter, the crowded zone
    /// giving up the most.
    #[test]
    fn a_cluster_founded_by_many_keeps_max_voters() {
        let all: Vec<NodeId> = (1..=40).collect();
        let mut w = World::new(&all, &[]);
        for (id, m) in w.members.iter_mut() {
            Arc::make_mut(m).spec.hardware.zone = ["a", "b", "c"][(*id % 3) as usize].into();
        }
        let (d, why) = w.plan(40).unwrap();
        let VoterDecision::Reconfigure { promote, demote, .. } = d else { panic!("{d:?}") };
        assert!(promote.is_empty() && demote.len() == 35 && !demote.contains(&40), "{why}");
        let left: Vec<NodeId> = all.iter().copied().filter(|v| !demote.contains(v)).collect();
        let per = |z: NodeId| left.iter().filter(|&&v| v % 3 == z).count();
        assert!((0..3).all(|z| (1..=2).contains(&per(z))), "{left:?}");
        w.voters = left;
        w.learners = demote;
        assert_eq!(w.plan(40), None);
    }

    #[test]
    fn a_stable_group_needs_nothing() {
        assert_eq!(World::new(&[1, 2, 3, 4, 5], &[6, 7]).plan(1), None);
        assert_eq!(World::new(&[1, 2, 3], &[]).plan(1), None);
    }

    #[test]
    fn learners_are_promoted_to_the_largest_odd_count() {
        let (d, why) = World::new(&[1], &[2, 3, 4]).plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![2, 3], vec![], vec![], vec![]));
        assert!(why.contains("target 3"), "{why}");
        // Two voters and one learner: three is odd and allowed.
        let (d, _) = World::new(&[1, 2], &[3]).plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![3], vec![], vec![], vec![]));
    }

    #[test]
    fn a_lagging_or_silent_learner_is_not_promoted() {
        let mut w = World::new(&[1], &[2, 3]);
        w.matched.insert(3, 10);
        assert_eq!(w.plan(1), None, "only one caught-up learner: 2 voters would be even");
        w.matched.insert(3, 100);
        w.heard.insert(2, 11);
        assert_eq!(w.plan(1), None);
    }

    #[test]
    fn a_leaving_voter_is_swapped_for_a_learner_in_one_change() {
        let mut w = World::new(&[1, 2, 3], &[4]);
        Arc::make_mut(w.members.get_mut(&2).unwrap()).status = MemberStatus::Leaving;
        let (d, why) = w.plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![4], vec![2], vec![], vec![]));
        assert!(why.contains("voter 2 is Leaving"), "{why}");
    }

    #[test]
    fn a_leaving_voter_without_replacement_is_still_demoted() {
        let mut w = World::new(&[1, 2, 3], &[]);
        Arc::make_mut(w.members.get_mut(&3).unwrap()).status = MemberStatus::Draining;
        assert_eq!(w.plan(1).unwrap().0, reconfigure(vec![], vec![3], vec![], vec![]));
    }

    #[test]
    fn a_leaving_leader_transfers_first() {
        let mut w = World::new(&[1, 2, 3], &[4]);
        Arc::make_mut(w.members.get_mut(&1).unwrap()).status = MemberStatus::Leaving;
        w.matched.insert(2, 90);
        let (d, why) = w.plan(1).unwrap();
        assert_eq!(d, VoterDecision::TransferLeader { to: 3 }, "the most caught-up voter");
        assert!(why.contains("leader 1 is Leaving"), "{why}");
    }

    #[test]
    fn a_silent_voter_is_replaced_after_the_timeout_only() {
        let mut w = World::new(&[1, 2, 3], &[4]);
        w.heard.insert(3, 50);
        assert_eq!(w.plan(1), None, "at the timeout, not yet");
        w.heard.insert(3, 51);
        let (d, why) = w.plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![4], vec![3], vec![], vec![]));
        assert!(why.contains("silent for 51 ticks"), "{why}");
    }

    #[test]
    fn new_members_become_learners_and_gone_ones_leave() {
        let mut w = World::new(&[1, 2, 3], &[4]);
        w.members.insert(9, Arc::new(member(9, MemberStatus::Joining)));
        Arc::make_mut(w.members.get_mut(&4).unwrap()).status = MemberStatus::Gone;
        let (d, _) = w.plan(1).unwrap();
        assert_eq!(d, reconfigure(vec![], vec![], vec![9], vec![4]));
    }

    #[test]
    fn a_gone_voter_is_removed_not_demoted() {
        let mut w = World::new(&[1, 2, 3], &[]);
        Arc::make_mut(w.members.get_mut(&2).unwrap()).status = MemberStatus::Gone;
        assert_eq!(w.plan(1).unwrap().0, reconfigure(vec![], vec![], vec![], vec![2]));
    }

    #[test]
    fn nothing_happens_while_a_change_is_pending() {
        let mut w = World::new(&[1], &[2, 3]);
        Arc::make_mut(w.members.get_mut(&1).unwrap()).status = MemberStatus::Leaving;
        let view = VoterView {
            me: 1,
            voters: &w.voters,
            learners: &w.learners,
            change_pending: true,
            transferring: false,
            members: &w.members,
            heard_ago: &w.heard,
            matched: &w.matched,
            last_index: 100,
        };
        assert_eq!(plan(&view, &VoterPolicy::default()), None);
    }

    #[test]
    fn policy_refuses_even_voter_limits() {
        assert!(VoterPolicy { max_voters: 4, ..VoterPolicy::default() }.validate().is_err());
        assert!(VoterPolicy::default().validate().is_ok());
    }

    /// A leader elected without one voter's vote has not heard from it yet: that voter is
    /// not demoted in the leader's first ticks, only once it stays silent for the failure
    /// timeout counted from the election.
    #[test]
    fn a_new_leader_counts_silence_from_its_election() {
        let mut w = World::new(&[1, 2, 4], &[]);
        let policy = VoterPolicy::default();
        // Node 1 took over at tick 1000 with node 2's vote; node 4 last spoke (to the old
        // leader, not to node 1) never, as far as node 1 knows.
        let heard: BTreeMap<NodeId, u64> = [(2, 1000)].into_iter().collect();
        w.heard = silence(&heard, [1, 2, 4].into_iter(), 1001, 1000);
        assert_eq!(w.heard.get(&4), Some(&1));
        assert_eq!(w.plan(1), None, "a healthy voter demoted at election");
        // An old message does not count as more silence than the leader could judge.
        let heard: BTreeMap<NodeId, u64> = [(2, 1000), (4, 3)].into_iter().collect();
        assert_eq!(silence(&heard, [1, 2, 4].into_iter(), 1001, 1000).get(&4), Some(&1));
        // Silent for the whole timeout since the election: it goes.
        let now = 1000 + policy.failed_after_ticks + 1;
        w.heard = silence(&[(2, now)].into_iter().collect(), [1, 2, 4].into_iter(), now, 1000);
        let (_, why) = w.plan(1).expect("a change");
        assert!(why.contains("voter 4 silent"), "{why}");
    }
}

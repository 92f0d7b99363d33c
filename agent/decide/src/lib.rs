//! limpet's decisions, each a pure function of what it is given, so each is tested by what
//! it returns and read in one place. Nothing here does I/O, reads a clock or spawns:
//! - `controller`: from the replicated state and every member's progress, the commands that
//!   change the cluster (failures, notices, drains, joins, layout re-plans);
//! - `leader`: one round of the leader (reports in, commands and a reason out);
//! - `policy`: the batch and learning-rate policies an epoch applies;
//! - `planner`: the data x pipeline layout and stage cuts for a set of hosts;
//! - `report`: what an agent tells the leader in its heartbeats;
//! - `balance`: each step's samples shared out by measured speed (stragglers);
//! - `reconcile`: the fleet reconciler's next step (launch, terminate, drain, scale or hold);
//! - `scaling`: how many hosts are worth their price (the measured scaling curve);
//! - `regroup`: how the ranks of a sharded job re-cut its state (who gives which block);
//! - `entry`: how the ranks of a new epoch agree on one state (who copies what from whom);
//! - `next`: what a rank's trainer loop does next (train, enter, sit out, finish, leave);
//! - `bootstrap`: what a new leader does before the job is set (profile, resume, set);
//! - `speed`: how measured speeds are smoothed;
//! - `error`: what they refuse.
//!
//! The agent (`limpet-agent`) runs these; `limpet plan` and tests call them directly.

pub mod balance;
pub mod bootstrap;
pub mod controller;
pub mod entry;
pub mod error;
pub mod leader;
pub mod next;
pub mod planner;
pub mod policy;
pub mod reconcile;
pub mod regroup;
pub mod report;
pub mod scaling;
pub mod speed;
pub mod stuck;

pub use error::DecideError;

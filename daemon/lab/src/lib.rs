//! limpet's lab as a library: the demo (`demo`, which also drives scripted scenarios), trace
//! replays checked against the simulation (`chaos`), local clusters on loopback or in
//! network namespaces (`local`, `netns`) and the transitions their drivers see
//! (`transitions`), the benchmarks (`raft_cmd`, `dp_cmd`, `elastic_bench`, `pipe_bench`,
//! `train_bench`, `act_bench`, `scale_bench`, `collectives_bench`, `round_bench` and the
//! rest named `*_bench`) with the worker processes they start, and the `limpet-lab` command
//! line (`cli`). Everything an operator runs is `limpet-daemon`; this crate only
//! drives it, so the product binaries do not carry it.

#![forbid(unsafe_code)]

pub mod act_bench;
pub mod chaos;
pub mod chaos_ec2;
pub mod chaos_measured;
pub mod chaos_pick;
pub mod chaos_runs;
pub mod cli;
pub mod collectives_bench;
pub mod delay_relay;
pub mod demo;
pub mod dp_bench;
pub mod dp_cmd;
pub mod elastic_bench;
pub mod fake_metadata;
pub mod local;
pub mod netns;
pub mod pipe_bench;
pub mod raft_cmd;
pub mod round_bench;
pub mod scale_bench;
pub mod stats;
pub mod steplog;
pub mod straggler_bench;
pub mod torchft_peer;
pub mod train_bench;
pub mod transitions;

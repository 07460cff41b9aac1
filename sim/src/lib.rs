//! Deterministic simulation of warren's node code on turmoil.
//!
//! - [`scenario`]: three simulated hosts each run a [`warren::runtime::raft::MetaRaft`] node
//!   over [`transport::TurmoilTransport`] with an in-memory disk that outlives host crashes;
//!   a client streams metadata commands while a seeded fault schedule partitions the leader
//!   and crashes nodes; checkers compare what every node applied.
//! - [`gm_scenario`]: four hosts each run Raft, a failure detector and a
//!   [`warren::runtime::gm_host::GmHost`] with a broadcasting member, under partitions, held
//!   and slow links, crashes and restarts; checkers for GM's guarantees.
//! - [`mirror_scenario`]: three hosts each run what a clustered node runs for a mirrored
//!   queue (Raft, failure detector, broker, storage on a simulated disk, GM host, mirror
//!   host); a client publishes with confirms and consumes with acks while the master's node
//!   is partitioned or crashed and policies change; checkers for design §1 guarantees 1–4.
//!
//! - [`broker_links`]: the relay's node links over turmoil's TCP, so the node's own relay
//!   runs between simulated nodes; [`amqp_client`]: the AMQP 0-9-1 client the mirror
//!   scenario's session clients speak to the nodes' own sessions.
//! - [`cut`]: partitions that cut both ways or one way only, for every scenario.
//!
//! See `sim/README.md`.

// rustdoc does not get `build.rustflags`, so documentation builds are exempt.
#[cfg(not(any(tokio_unstable, doc)))]
compile_error!(
    "the simulation needs `--cfg tokio_unstable` (tokio's seeded RNG); \
     it is set in .cargo/config.toml — build from the workspace, or set \
     RUSTFLAGS=\"--cfg tokio_unstable\""
);

pub mod amqp_client;
pub mod broker_links;
pub mod cut;
pub mod gm_scenario;
pub mod mirror_scenario;
pub mod scenario;
pub mod session_clients;
pub mod task_ids;
pub mod trace;
pub mod transport;

pub use scenario::{run_seed, Outcome};

use std::sync::{Mutex, MutexGuard};

/// Simulated milliseconds since the run began (0 outside one).
pub(crate) fn now_ms() -> u64 {
    turmoil::sim_elapsed().map_or(0, |d| d.as_millis() as u64)
}

/// A mutex's guard whether or not it was poisoned: a panic while the harness held one of
/// its maps leaves it consistent (every update is one insert or remove).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
pub use trace::Trace;
pub use transport::TurmoilTransport;

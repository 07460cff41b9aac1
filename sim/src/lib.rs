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
pub mod trace;
pub mod transport;

pub use scenario::{run_seed, Outcome};
pub use trace::Trace;
pub use transport::TurmoilTransport;

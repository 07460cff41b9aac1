//! Warren: a RabbitMQ-compatible AMQP 0-9-1 broker.
//!
//! # Layout
//! - [`amqp`]: the wire codec (frame splitting, method and content-header encoding through
//!   `amq-protocol`, reply codes). Pure.
//! - [`session`]: the sans-IO connection and channel state machines. Bytes in, frames out.
//! - [`broker`]: the sans-IO domain: routing, queues, consumers, deliveries, flow credit.
//! - [`meta`]: the metadata state machine (vhosts, users, exchanges, bindings, queues,
//!   policies, nodes, GM group records). It applies validated commands; readers see
//!   immutable snapshots; `runtime::raft` replicates its commands with openraft.
//!   Mirrored queues' `ha-*` policies and placement are metadata rules (`meta::ha_policy`,
//!   `meta::placement`).
//! - [`gm`]: GM, the guaranteed-multicast ring, as a state machine (views from the metadata).
//! - [`mirror`]: mirrored queues: the reconciler's plan, the ops a master ships, the GM
//!   messages of a mirrored queue.
//! - [`cluster`]: cluster protocol cores: the failure detector.
//! - [`admin`]: the `warrenctl` protocol (frames, requests, plans); [`mgmt`]: the management
//!   HTTP API and console; [`metrics`]: the Prometheus exposition.
//! - [`runtime`]: the only code that touches tokio, sockets and clocks: listener, connection
//!   tasks, the node handle, cluster mode, the Raft driver (`runtime::raft`), the relay, the
//!   GM host, the mirror host, storage's syncer, shutdown.
//! - [`store`]: storage (the `Disk` trait, record framing, the message store and the queue
//!   index).
//! - [`fuzzing`]: the fuzz targets' entry points (`fuzz/`), replayed by `tests/fuzz_corpus.rs`.
//! - [`config`], [`time`]: configuration and the time type the cores take as input.
//! - [`shared_bytes`]: byte fields that decode as views of the frame they came in.
//!
//! The sans-IO modules never use tokio, `std::net`, `std::fs`, `Instant::now`,
//! `SystemTime::now` or `thread_rng`, and import one another in one direction only (`meta`
//! below `broker` and `cluster`, those below `mirror` and `session`, then `admin`, `mgmt`);
//! `tests/layering.rs` enforces both.

// Metadata errors carry RabbitMQ's full texts (names, received and current values); they
// are returned on cold paths only, so boxing them would add noise for no measurable gain.
#![allow(clippy::result_large_err)]

pub mod admin;
pub mod amqp;
pub mod broker;
pub mod cluster;
pub mod config;
pub mod fuzzing;
pub mod gm;
pub mod meta;
pub mod metrics;
pub mod mgmt;
pub mod mirror;
pub mod runtime;
pub mod session;
pub mod shared_bytes;
pub mod store;
pub mod time;

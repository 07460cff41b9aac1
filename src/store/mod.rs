//! Storage for messages (the persistence step): RabbitMQ's classic-queue design.
//!
//! - [`disk`]: the `Disk` trait every file access goes through; [`mem_disk`]: an in-memory
//!   disk with crash and fault injection (the real one is `runtime::file_disk`).
//! - [`record`]: checksummed record framing, so recovery can cut torn or corrupt tails.
//!
//! Status: the foundation of issue 4. The message store, queue index and variable queue
//! build on these pieces; see `docs/ARCHITECTURE.md`.

pub mod disk;
pub mod mem_disk;
pub mod message_codec;
pub mod msg_store;
pub mod queue_index;
pub mod record;

pub use disk::{Disk, DiskError};
pub use mem_disk::MemDisk;

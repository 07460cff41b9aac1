//! The shared message store: message bodies, stored once and reference-counted, in
//! append-only `.rdq` files. It mirrors RabbitMQ's `rabbit_msg_store`.
//!
//! # Pieces
//! - [`StoreIndex`] (`index.rs`): the sans-IO bookkeeping. Message id → location and reference
//!   count, one [`FileSummary`] per file (valid and total bytes), the write-back queue, where
//!   the next appends go (rollover), and which files are worth compacting. Unit-tested without
//!   any [`Disk`](super::Disk).
//! - [`MsgStore`] (`store.rs`): the I/O driver over a `Disk`: write-back cache, batched
//!   appends, group-commit fsync, compaction, clean shutdown.
//! - `recovery.rs`: [`MsgStore::open`]: wipe (transient store), trust a clean shutdown's saved
//!   index, or scan every file and cut torn or corrupt tails.
//! - `saved.rs`: the formats of the saved index and of the `clean.dot` marker.
//!
//! # On disk
//! A folder of `NNNNNNNNNNNNNNNNNNNN.rdq` files (the file number, zero-padded to 20 digits so
//! names sort numerically). Each is a sequence of [`crate::store::record`] frames whose payload
//! is the 16-byte [`MsgId`] followed by the message bytes. Only the highest-numbered file is
//! appended to; it rolls over at [`MsgStoreConfig::file_size_limit`]. A clean shutdown adds
//! `msg_store_index.dat` and `clean.dot`; both are removed as soon as the store is opened again.
//!
//! # Durability
//! A write is durable once [`MsgStore::sync`] has returned Ok after it. A failed fsync, or a
//! failed append that cannot be undone, is fatal: from then on every mutating call returns
//! [`MsgStoreError::Failed`] and `close` writes no clean marker, so the next `open` scans.
//! The owner must stop and reopen (after a restart); reads keep working meanwhile.

mod index;
mod recovery;
mod saved;
mod store;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::disk::DiskError;
use super::record::{RECORD_OVERHEAD, RECORD_PAYLOAD_MAX};

pub use index::{
    AppendBatch, FileSummary, IndexEntry, Location, Placed, RefCountReport, Removed, Slot,
    StoreIndex, WriteDecision,
};
pub use recovery::{DamagedFile, RecoveryReport};
pub use store::{CompactReport, MsgStore};

/// A message id: 16 bytes chosen by the caller (RabbitMQ uses a GUID per message).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MsgId(pub [u8; 16]);

impl MsgId {
    /// Bytes of an id.
    pub const LEN: usize = 16;

    /// The id at the start of `bytes`, if there are at least 16.
    pub fn from_prefix(bytes: &[u8]) -> Option<MsgId> {
        let head: [u8; 16] = bytes.get(..Self::LEN)?.try_into().ok()?;
        Some(MsgId(head))
    }
}

impl fmt::Display for MsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for MsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MsgId({self})")
    }
}

/// Settings of one store (RabbitMQ runs two per vhost: persistent and transient).
#[derive(Debug, Clone, PartialEq)]
pub struct MsgStoreConfig {
    /// A file rolls over before an append would take it past this size (a single larger
    /// message still gets a file of its own). RabbitMQ's `msg_store_file_size_limit`.
    pub file_size_limit: u64,
    /// `compact` rewrites a non-current file once more than this fraction of it is garbage.
    /// RabbitMQ's `GARBAGE_FRACTION`.
    pub garbage_fraction: f64,
    /// Bytes of written-but-unflushed messages; a `write` that reaches it flushes.
    pub write_buffer_max_bytes: u64,
    /// Delete everything in the folder on `open` (the transient store).
    pub wipe_on_open: bool,
}

impl Default for MsgStoreConfig {
    fn default() -> Self {
        MsgStoreConfig {
            file_size_limit: 16 * 1024 * 1024,
            garbage_fraction: 0.5,
            write_buffer_max_bytes: 1024 * 1024,
            wipe_on_open: false,
        }
    }
}

/// A message store failure.
#[derive(Debug, thiserror::Error)]
pub enum MsgStoreError {
    /// The disk failed.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// An earlier fsync or unrecoverable write failed; the store accepts no more changes.
    #[error("message store stopped after a failed fsync or write; reopen it to recover")]
    Failed,
    /// A stored record does not match its checksum or its id.
    #[error("{path}: corrupt record at offset {offset}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Offset of the record.
        offset: u64,
    },
    /// The disk appended somewhere other than where the index expected.
    #[error("{path}: append landed at offset {actual}, expected {expected}")]
    Misplaced {
        /// The file.
        path: PathBuf,
        /// Where the index placed the bytes.
        expected: u64,
        /// Where the disk put them.
        actual: u64,
    },
    /// The message is larger than a record may be.
    #[error("message of {size} bytes exceeds the record limit")]
    TooLarge {
        /// Message bytes.
        size: usize,
    },
}

/// Name of the marker a clean shutdown leaves (as RabbitMQ's `clean.dot`).
pub const CLEAN_MARKER: &str = "clean.dot";
/// Name of the index saved at clean shutdown.
pub const SAVED_INDEX: &str = "msg_store_index.dat";
/// Temporary name the saved index is written under before its atomic rename.
const SAVED_INDEX_TMP: &str = "msg_store_index.dat.tmp";
const RDQ_SUFFIX: &str = ".rdq";

/// The name of data file `n`.
pub fn file_name(n: u64) -> String {
    format!("{n:020}{RDQ_SUFFIX}")
}

/// The number of a data file from its name; `None` for anything but a canonical
/// [`file_name`] (a stray `3.rdq` would otherwise alias `00…03.rdq`).
pub fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(RDQ_SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Bytes a message of `body_len` bytes takes on disk (framing + id + body).
pub fn record_size(body_len: usize) -> Result<u32, MsgStoreError> {
    let payload = body_len.saturating_add(MsgId::LEN);
    if payload > RECORD_PAYLOAD_MAX {
        return Err(MsgStoreError::TooLarge { size: body_len });
    }
    // RECORD_PAYLOAD_MAX is far below u32::MAX, so this cannot fail.
    u32::try_from(payload + RECORD_OVERHEAD).map_err(|_| MsgStoreError::TooLarge { size: body_len })
}

/// Appends one message record: the same bytes as `record::encode(id ++ body)`, without first
/// copying id and body into one buffer.
#[cfg(test)]
pub(crate) fn encode_record(out: &mut Vec<u8>, id: MsgId, body: &[u8]) {
    encode_record_pieces(out, id, &[body]);
}

/// [`encode_record`] of a body in pieces (their concatenation is the body).
pub(crate) fn encode_record_pieces(out: &mut Vec<u8>, id: MsgId, body: &[&[u8]]) {
    let body_len: usize = body.iter().map(|p| p.len()).sum();
    let len = (MsgId::LEN + body_len) as u32;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&id.0);
    for piece in body {
        crc.update(piece);
    }
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&id.0);
    for piece in body {
        out.extend_from_slice(piece);
    }
}

/// The body of a record read back from disk, if `bytes` is exactly one intact record of `id`.
pub(crate) fn decode_record(bytes: &[u8], id: MsgId) -> Option<&[u8]> {
    let (found, valid) = super::record::scan(bytes);
    if found.len() != 1 || valid != bytes.len() {
        return None;
    }
    let payload = found[0].payload;
    (MsgId::from_prefix(payload)? == id).then(|| &payload[MsgId::LEN..])
}

//! The per-queue index (RabbitMQ's `rabbit_queue_index`, classic v1): which messages a
//! queue holds, in seq order, whether each was delivered, and its message-store id or, for
//! a small message, its body.
//!
//! Layout of a queue's folder:
//! - `journal.jif`: every publish, deliver and ack is appended here first; [`QueueIndex::sync`]
//!   fsyncs it (group commit: the caller batches records, then syncs once);
//! - `N.idx`: segment `N` holds seqs `[N*E, (N+1)*E)`; a full journal is scattered into the
//!   segments, which are fsynced before the journal is truncated;
//! - `index.meta`: the segment size `E` the folder was created with (it wins over the
//!   configuration, as RabbitMQ keeps 16384 for existing queues);
//! - `clean.dot`: written by [`QueueIndex::close`]; its absence at open means a crash;
//! - `clean.summary`: written (and fsynced) by [`QueueIndex::close`] just before `clean.dot`:
//!   the index state and, per segment, what the open must report of its live messages (see
//!   [`summary`] for the format). The open removes both files before it changes anything.
//!
//! Recovery ([`QueueIndex::open`]) has two paths. After a clean close, when the summary is
//! whole and agrees with `clean.dot`, the folder's geometry, its segment files and the (empty)
//! journal, the state is rebuilt from the summary and only the head segments are read: no
//! scan, whatever the queue's length (RabbitMQ trusts its recovery terms the same way; damage
//! in a segment not read then shows when it is paged in, and the next crash recovery repairs
//! it). Otherwise it scans: the journal first, then one segment at a time, so its memory is
//! bounded by one segment plus the journal, not by the queue's length. Both return the same
//! [`Recovered`]: the head of the queue ([`IndexConfig::recover_head_entries`]) in
//! [`Recovered::entries`]; the rest is read back with [`QueueIndex::read_segment`].
//!
//! Split: [`state`] and [`rebuild`] are the sans-IO bookkeeping, [`codec`] and [`summary`] the
//! bytes, `index` and `open` the I/O shell over [`Disk`](crate::store::Disk).

pub mod codec;
mod index;
mod open;
pub mod rebuild;
pub mod state;
pub mod summary;

#[cfg(test)]
mod clean_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use crate::store::disk::DiskError;

pub use index::{IndexStats, QueueIndex};
pub use state::StateError;

/// The journal's file name.
pub const JOURNAL_FILE: &str = "journal.jif";
/// The clean-shutdown marker's file name.
pub const CLEAN_FILE: &str = "clean.dot";
/// The clean-shutdown summary's file name (see [`summary`]).
pub const SUMMARY_FILE: &str = "clean.summary";
/// The geometry file's name.
pub const META_FILE: &str = "index.meta";
/// Segment files end with this.
pub const SEGMENT_SUFFIX: &str = ".idx";
/// The most entries a segment holds (`segment_entry_count`): it keeps a segment's three
/// bitsets small (128 KiB each at most).
pub const MAX_SEGMENT_ENTRY_COUNT: u64 = 1 << 20;

/// Tuning of one queue index (RabbitMQ's `queue_index_*` settings).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct IndexConfig {
    /// Seqs per segment file (`queue_index_segment_entry_count`).
    pub segment_entry_count: u64,
    /// Journal records that trigger a flush (`queue_index_max_journal_entries`).
    pub journal_max_entries: usize,
    /// Bodies shorter than this are embedded in the index (`queue_index_embed_msgs_below`).
    pub embed_below: usize,
    /// How many surviving messages [`QueueIndex::open`] returns in [`Recovered::entries`]:
    /// whole segments from the first live one, stopping after the segment in which this many
    /// were reached (0 counts as 1: the first live segment always comes back). The rest is
    /// read later with [`QueueIndex::read_segment`]. The default, `usize::MAX`, returns them
    /// all; with a bound the open holds no more message records than the head, one segment
    /// and the journal (plus per-segment bitsets and [`Recovered::store_refs`]). Any value is
    /// valid.
    pub recover_head_entries: usize,
    /// Whether an open keeps live transient records instead of dropping them (a node's
    /// start drops them, as RabbitMQ's does; a promoted mirror's copy keeps them: the
    /// queue lives on, and its transient messages with it). Not a setting.
    #[serde(skip)]
    pub keep_transient: bool,
}

impl Default for IndexConfig {
    fn default() -> IndexConfig {
        IndexConfig {
            segment_entry_count: 16384,
            journal_max_entries: 32768,
            embed_below: 4096,
            recover_head_entries: usize::MAX,
            keep_transient: false,
        }
    }
}

impl IndexConfig {
    /// Whether a body of `len` bytes belongs in the index rather than the message store.
    pub fn embeds(&self, len: usize) -> bool {
        len < self.embed_below
    }

    fn validate(&self) -> Result<(), QueueIndexError> {
        if !(1..=MAX_SEGMENT_ENTRY_COUNT).contains(&self.segment_entry_count) {
            return Err(QueueIndexError::Config(
                "segment_entry_count must be between 1 and 2^20",
            ));
        }
        if self.journal_max_entries == 0 {
            return Err(QueueIndexError::Config("journal_max_entries must be > 0"));
        }
        Ok(())
    }
}

/// A publish record: a message entering the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    /// Its seq id, assigned by the queue in arrival order.
    pub seq: u64,
    /// Its id in the message store.
    pub msg_id: [u8; 16],
    /// Delivery mode 2; transient messages are dropped at recovery.
    pub persistent: bool,
    /// Absolute expiry (per-message or queue TTL), if any.
    pub expires_at_ms: Option<u64>,
    /// The message's size in bytes (for the queue's byte counts).
    pub size: u32,
    /// The body, when shorter than `embed_below`: such a message never reaches the store.
    pub embedded: Option<Vec<u8>>,
}

/// An un-acked message as the index knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    /// Its publish record.
    pub publish: Publish,
    /// A deliver was recorded: it must go out again with `redelivered = true`.
    pub delivered: bool,
}

/// Something found damaged at open. Damage never fails the open: the intact records are
/// kept, and damaged segments are rewritten from what survived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Damage {
    /// Unreadable bytes in a segment file (records there are lost).
    Segment {
        /// The segment number.
        segment: u64,
        /// Where the damaged region starts.
        offset: u64,
        /// Its length.
        bytes: u64,
    },
    /// A segment file held a record of a seq outside its range.
    ForeignRecord {
        /// The segment number.
        segment: u64,
        /// The out-of-range seq.
        seq: u64,
    },
    /// Unreadable bytes in the middle of the journal (a torn tail is not damage).
    Journal {
        /// Where the damaged region starts.
        offset: u64,
        /// Its length.
        bytes: u64,
    },
    /// `index.meta` was unreadable; the configured segment size was assumed.
    Meta,
    /// `clean.dot` was unreadable; the open counts as a crash recovery.
    CleanMarker,
    /// `clean.summary` was unreadable or disagreed with `clean.dot` or the folder: the
    /// segments were scanned instead (a missing summary is not damage).
    Summary {
        /// What was wrong.
        reason: &'static str,
    },
    /// The clean marker's message count differs from what the files hold.
    CleanCountMismatch {
        /// Count in `clean.dot`.
        recorded: u64,
        /// Count found.
        found: u64,
    },
}

/// What [`QueueIndex::open`] found.
///
/// Surviving messages (un-acked, transient ones dropped) are split in two: the head of the
/// queue, returned in `entries`, and the rest, from `rest_from` on, only counted here and read
/// back a segment at a time with [`QueueIndex::read_segment`] (for each segment of
/// [`QueueIndex::segments`] at or after `rest_from / segment_entry_count`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The head of the queue: surviving messages in seq order, whole segments, starting with
    /// the lowest live segment and stopping after the segment in which
    /// [`IndexConfig::recover_head_entries`] was reached (all of them when the queue is
    /// shorter).
    pub entries: Vec<IndexEntry>,
    /// Every surviving message with seq >= `rest_from` is NOT in `entries` and is read later
    /// with [`QueueIndex::read_segment`]; `rest_from` is a segment boundary (the first seq of
    /// the first live segment left out), or the next seq when everything is in `entries`.
    pub rest_from: u64,
    /// Surviving messages in all (head and rest).
    pub live: u64,
    /// Sum of [`Publish::size`] of the surviving messages NOT in `entries`.
    pub rest_bytes: u64,
    /// Message-store references of ALL surviving messages whose body is not embedded
    /// (`embedded == None`): msg_id -> number of entries referring to it.
    pub store_refs: std::collections::BTreeMap<[u8; 16], u32>,
    /// The index was closed cleanly and its files still match the clean marker (the message
    /// store may trust its saved state only if every queue was): either the clean summary
    /// was used, or the scan found the marker's message count.
    pub clean: bool,
    /// Damage found and worked around.
    pub damage: Vec<Damage>,
    /// Transient messages dropped.
    pub dropped_transient: u64,
    /// Bytes of a partial record cut from the journal's end (normal after a crash).
    pub journal_torn_bytes: u64,
}

/// A queue index failure.
#[derive(Debug, thiserror::Error)]
pub enum QueueIndexError {
    /// The disk failed. After a failed write or sync the index is poisoned.
    #[error("queue index: {0}")]
    Disk(#[from] DiskError),
    /// The call breaks the index's rules; nothing was written.
    #[error("queue index: {0}")]
    State(#[from] StateError),
    /// An embedded body must be shorter than `embed_below`.
    #[error("queue index: embedded body of {len} bytes is not below embed_below ({limit})")]
    EmbedTooLarge {
        /// The body length.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Invalid configuration.
    #[error("queue index: {0}")]
    Config(&'static str),
    /// An earlier write or sync failed; what reached the disk is unknown, so the index
    /// refuses work until it is reopened (recovery rebuilds from the files).
    #[error("queue index is poisoned by an earlier disk failure; reopen it")]
    Poisoned,
}

fn segment_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{n}{SEGMENT_SUFFIX}"))
}

/// Whether `name` is a segment rewrite left behind by a crash before its rename.
fn is_segment_tmp(name: &str) -> bool {
    name.strip_suffix(".tmp").and_then(segment_number).is_some()
}

fn segment_number(name: &str) -> Option<u64> {
    let n = name.strip_suffix(SEGMENT_SUFFIX)?;
    // Only canonical names: "007.idx" is not ours and must not shadow "7.idx". Nor is a
    // segment whose first seq would pass codec::SEQ_LIMIT (so `n * entries` cannot overflow).
    n.parse::<u64>()
        .ok()
        .filter(|v| v.to_string() == n && *v < codec::SEQ_LIMIT / MAX_SEGMENT_ENTRY_COUNT)
}

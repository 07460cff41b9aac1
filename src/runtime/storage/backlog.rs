//! The master's side of a sync: its backlog read as range summaries (for a mirror that kept
//! a copy) and as batches of operations (`docs/mirroring.md`, *Sync*).
//!
//! A batch is read under the storage lock, which every round of the queue waits on, so the
//! read is kept short: the segment being copied is read once into a [`SyncCursor`] and later
//! batches take from it (a segment of 16,384 one-KiB messages is about 18 MB of file, and
//! a 4,096-message batch used to read it whole), and messages are decoded after the lock
//! is let go.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{decode_message, Storage, StorageError, SYNC_BATCH_BYTES};
use crate::broker::queue::IndexOp;
use crate::mirror::digest::{RangeSummary, SummaryBuilder};
use crate::store::msg_store::MsgId;
use crate::store::queue_index::{IndexEntry, Publish};
use crate::store::Disk;

/// What one sync has read of the segment it is copying, kept between its batches. A
/// cursor serves one queue's sync, whose batches go forward: a batch asked from another
/// seq than the last one stopped at reads again.
#[derive(Debug, Default)]
pub struct SyncCursor {
    /// The segment read, its entries not yet taken (in seq order), and the seq the last
    /// batch stopped at.
    read: Option<(u64, VecDeque<IndexEntry>, u64)>,
}

/// A message taken for a batch under the lock, decoded after it.
struct Taken {
    publish: Publish,
    bytes: Option<Vec<u8>>,
    delivered: bool,
}

impl<D: Disk + Clone> Storage<D> {
    /// A summary ([`RangeSummary`]) of the queue's persistent index over
    /// `[from, min(below, from + span))`, read a segment at a time without bodies. `f`
    /// gets it and the seq to continue from (`None`: `below` is reached) under the storage
    /// lock.
    pub fn sync_summary<T>(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        below: u64,
        span: u64,
        f: impl FnOnce(RangeSummary, Option<u64>) -> T,
    ) -> Result<T, StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let hi = below.min(from.saturating_add(span.max(1))).max(from);
        let next = (hi < below).then_some(hi);
        let mut summary = SummaryBuilder::new(from, hi);
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(index) = guard.as_ref().and_then(|s| s.indexes.get(&key)) else {
            return Ok(f(summary.finish(), next));
        };
        let wrap = |source| StorageError::Index {
            queue: format!("{vhost}/{queue}"),
            source,
        };
        let per_segment = index.config().segment_entry_count.max(1);
        let segments = index
            .segments()
            .into_iter()
            .filter(|n| (n + 1) * per_segment > from && n * per_segment < hi);
        for n in segments {
            for e in index.read_segment_light(n).map_err(wrap)? {
                let p = &e.publish;
                summary.add(p.seq, u128::from_be_bytes(p.msg_id), e.delivered);
            }
        }
        Ok(f(summary.finish(), next))
    }

    /// A sync batch: up to `max` live messages (and at most [`SYNC_BATCH_BYTES`] of them,
    /// or one bigger message alone) of the queue's persistent index (persistent ones, and
    /// the transient ones a mirrored queue records) with seq in `[from, below)`, in seq
    /// order, as operations (a publish, and a deliver for a message delivered and not
    /// acked), and the seq to continue from (`None`: the backlog is done).
    ///
    /// Which messages are live, and which delivered, is read under the storage lock when
    /// the batch is made (a message acked since `cursor` read its segment is left out).
    pub fn sync_batch(
        &self,
        vhost: &str,
        queue: &str,
        (from, below): (u64, u64),
        max: usize,
        cursor: &mut SyncCursor,
    ) -> Result<(Vec<IndexOp>, Option<u64>), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let wrap = |source| StorageError::Index {
            queue: format!("{vhost}/{queue}"),
            source,
        };
        let mut taken = Vec::new();
        let mut bytes = 0usize;
        let mut next = None;
        {
            let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let Some(state) = guard.as_ref() else {
                return Ok((Vec::new(), None));
            };
            let Some(index) = state.indexes.get(&key) else {
                return Ok((Vec::new(), None));
            };
            if cursor.read.as_ref().is_some_and(|(_, _, at)| *at != from) {
                cursor.read = None;
            }
            let per_segment = index.config().segment_entry_count.max(1);
            // Segments wholly before `from` are skipped unread: a backlog of a million
            // messages is read once, not once per batch.
            let segments = index
                .segments()
                .into_iter()
                .filter(|n| (n + 1) * per_segment > from);
            'segments: for n in segments {
                let entries = match &mut cursor.read {
                    Some((read, entries, _)) if *read == n => entries,
                    _ => {
                        let entries = index.read_segment(n).map_err(wrap)?.into();
                        &mut cursor.read.insert((n, entries, from)).1
                    }
                };
                while let Some(e) = entries.front() {
                    let (seq, size) = (e.publish.seq, e.publish.size as usize);
                    if seq >= below {
                        break 'segments;
                    }
                    if seq < from || !index.holds(seq) {
                        entries.pop_front();
                        continue;
                    }
                    // Stop before the message that would take the batch past the byte
                    // limit (a message bigger than it goes alone).
                    if taken.len() == max || (!taken.is_empty() && bytes + size > SYNC_BATCH_BYTES)
                    {
                        next = Some(seq);
                        break 'segments;
                    }
                    let Some(IndexEntry { mut publish, .. }) = entries.pop_front() else {
                        break;
                    };
                    bytes += size;
                    let body = match publish.embedded.take() {
                        Some(b) => Some(b),
                        None => state.msg_store.read(MsgId(publish.msg_id))?,
                    };
                    taken.push(Taken {
                        delivered: index.delivered(seq),
                        publish,
                        bytes: body,
                    });
                }
            }
            match (&mut cursor.read, next) {
                (Some((_, _, at)), Some(n)) => *at = n,
                _ => cursor.read = None,
            }
        }
        let mut ops = Vec::with_capacity(taken.len());
        for Taken {
            publish: p,
            bytes,
            delivered,
        } in taken
        {
            let Some(message) =
                bytes.and_then(|b| decode_message(&b, u128::from_be_bytes(p.msg_id)))
            else {
                tracing::error!(queue = %queue, seq = p.seq, "message body missing; not synced");
                continue;
            };
            ops.push(IndexOp::Publish {
                seq: p.seq,
                message: Arc::new(message),
                expires_at_ms: p
                    .expires_at_ms
                    .map_or(u64::MAX, |t| t.saturating_sub(self.epoch_unix_ms)),
                // The persistent index (the record's own flag follows the message).
                persistent: true,
            });
            if delivered {
                ops.push(IndexOp::Deliver { seq: p.seq });
            }
        }
        Ok((ops, next))
    }

    /// Segments the queue's index has read back with their bodies (tests).
    #[cfg(test)]
    pub(super) fn segment_reads(&self, vhost: &str, queue: &str) -> u64 {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let index = guard.as_ref().and_then(|s| s.indexes.get(&key));
        index.map_or(0, |i| i.stats().segment_reads)
    }
}

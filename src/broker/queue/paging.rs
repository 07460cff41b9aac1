//! The variable queue's paging: which messages live in RAM and which only on disk.
//!
//! RabbitMQ's variable queue keeps a queue as q4 (head, in RAM), q3, delta (only on disk:
//! neither body nor index entry in RAM, just a count and a seq range), q2 and q1 (tail, in
//! RAM). Here the head lane (`ready[0]`) plays q4+q3, [`Delta`] is delta and `q1` plays
//! q2+q1. A message is *alpha* (all in RAM), *beta* (entry in RAM, body only in a message
//! store: [`Entry::beta`]) or *delta*. Bodies go first: a completed page-out turns the
//! range's alphas whose body has its own place in a store into betas, and only a range
//! with no such alpha left moves to delta. A message whose body sits inside its index entry
//! (under `queue_index_embed_msgs_below`, the common case) goes from alpha to delta in one
//! step. There is no separate gamma: every paged message's index entry is written before it
//! leaves RAM. Delta comes back a whole index segment at a time, stored bodies as betas.
//!
//! When: node memory (message bytes held by queues) above the paging threshold (RabbitMQ's
//! `vm_memory_high_watermark_paging_ratio` of the watermark), or always for
//! `x-queue-mode: lazy`. What: everything behind the first
//! [`PagingConfig::keep_entries`] / [`KEEP_BYTES`] of the head, and the whole of q1 once delta exists.
//!
//! How, without I/O in the queue: a page-out records index entries for the messages that
//! have none (transient messages, any message of a non-durable queue: the transient store)
//! and takes a group-commit ticket; the messages leave RAM only when that ticket is durable,
//! so a delta message is always readable. Reads go through the [`Pager`] (storage), in
//! segment-sized batches, when the head runs dry.
//!
//! Why delta is exact: messages leave the head lane only from its front, so when a page-out
//! completes, the messages of its range still in RAM are a suffix of it, and nothing in
//! delta's range leaves the queue except through a read back. Priority queues (several
//! lanes) do not page.

use std::sync::Arc;

use super::{Entry, IndexOp, OnDisk, Queue};
use crate::broker::Message;

/// Bytes kept in RAM at the head when paging (consumers are served from RAM); never more
/// than a quarter of the paging threshold.
pub const KEEP_BYTES: u64 = 8 << 20;

/// When and how much a queue pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagingConfig {
    /// Node memory (message bytes held by queues) above which queues page out.
    pub threshold: u64,
    /// Messages kept in RAM at the head (at most [`KEEP_BYTES`] of them).
    pub keep_entries: usize,
    /// Stored messages smaller than this live inside the queue index
    /// (`queue_index_embed_msgs_below`): they page with their index entry, never as betas.
    pub embed_below: usize,
}

/// Whether storage keeps this message's body in a message store rather than inside its
/// index entry (the stored form is `StoredMessage`'s encoding, whose length this is).
fn stored_apart(m: &Message, embed_below: usize) -> bool {
    let stored = 6
        + m.exchange.len().min(255)
        + m.routing_key.len().min(255)
        + m.properties_raw.len()
        + m.body.len();
    stored >= embed_below
}

/// Messages only on disk: the live index entries with seq in `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta {
    /// First seq not yet read back.
    pub start: u64,
    /// One past the last seq.
    pub end: u64,
    /// Messages.
    pub count: u64,
    /// Their body bytes (for `x-max-length-bytes`; recovered messages count their stored size).
    pub bytes: u64,
    /// How many of them are persistent messages of a durable queue (RabbitMQ's
    /// `messages_persistent`; all of them after a restart, which keeps no other, except in
    /// an adopted mirror's copy: see `runtime::storage::recovery`).
    pub persistent: u64,
    /// Their bytes, counted as `bytes` is.
    pub persistent_bytes: u64,
}

/// Whether `e` counts in `messages_persistent` (see [`super::figures`]).
pub(super) fn counts_persistent(e: &Entry) -> bool {
    e.on_disk == OnDisk::Persistent && e.message.persistent()
}

/// A page-out waiting for its index records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageOut {
    ticket: u64,
    from: u64,
    to: u64,
}

/// A read-back failure.
#[derive(Debug, thiserror::Error)]
#[error("paging read failed: {0}")]
pub struct PageError(pub String);

/// Reads paged-out messages back (implemented by the runtime's storage).
///
/// Called with the queue's lock held: an implementation must never take a queue lock.
pub trait Pager: Send + Sync {
    /// The queue's messages with seq in `[from, to)` from one index segment (the one holding
    /// `from`), in seq order, and the seq to continue from. A message whose body is in a
    /// message store comes back as a beta: `Entry::beta` set, a placeholder message with the
    /// right id, read with [`Pager::read_message`] when it leaves the queue.
    fn page_in(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        to: u64,
    ) -> Result<(Vec<Entry>, u64), PageError>;

    /// A message from the persistent or the transient message store (None: not there).
    fn read_message(&self, id: u128, persistent: bool) -> Result<Option<Message>, PageError>;
}

impl Queue {
    fn pager(&self) -> Option<Arc<dyn Pager>> {
        if self.args.max_priority.is_some() {
            return None;
        }
        self.persist.as_ref()?.pager.clone()
    }

    /// Body bytes of messages only on disk.
    pub(super) fn paged_bytes(&self) -> u64 {
        self.delta.as_ref().map_or(0, |d| d.bytes)
    }

    /// Messages only on disk (for listings and tests).
    pub fn paged_count(&self) -> u64 {
        self.delta.as_ref().map_or(0, |d| d.count)
    }

    /// Betas: messages whose entry is in RAM but whose body is only in a store (a walk over
    /// the ready messages: for listings and tests, not for hot paths).
    pub fn beta_count(&self) -> u64 {
        let ready = self.ready.iter().flatten().chain(self.q1.iter());
        ready.filter(|e| e.beta.is_some()).count() as u64
    }

    fn under_pressure(&self) -> bool {
        let Some(p) = self.persist.as_ref() else {
            return false;
        };
        self.args.lazy
            || self
                .memory
                .load(std::sync::atomic::Ordering::Relaxed)
                .max(0) as u64
                > p.paging.threshold
    }

    /// Completes a page-out whose records are written, and starts the next one if memory
    /// (or lazy mode) asks for it.
    pub(super) fn page(&mut self) {
        // Checked on every publish: no Arc clone here, unlike pager().
        let can_page = self.args.max_priority.is_none()
            && self.persist.as_ref().is_some_and(|p| p.pager.is_some());
        if !can_page {
            return;
        }
        self.finish_page_out();
        if self.page_out.is_none() && self.under_pressure() {
            self.start_page_out();
        }
    }

    fn start_page_out(&mut self) {
        let (keep, keep_bytes) = self.persist.as_ref().map_or((0, 0), |p| {
            // The head may take a quarter of the paging budget at most: with a small budget
            // and large messages, a head of keep_entries would hold it all.
            (
                p.paging.keep_entries,
                KEEP_BYTES.min(p.paging.threshold / 4),
            )
        });
        let cut = if self.delta.is_some() {
            0
        } else {
            let lane = &self.ready[0];
            let mut bytes = 0u64;
            let mut cut = lane.len();
            for (i, e) in lane.iter().enumerate() {
                if i >= keep || bytes >= keep_bytes {
                    cut = i;
                    break;
                }
                bytes += e.message.size();
            }
            cut
        };
        let range = if self.delta.is_some() {
            &mut self.q1
        } else {
            &mut self.ready[0]
        };
        let (Some(from), Some(last)) = (range.get(cut).map(|e| e.seq), range.back().map(|e| e.seq))
        else {
            return;
        };
        let mut ops = Vec::new();
        for e in range.iter_mut().skip(cut) {
            if e.on_disk == OnDisk::No {
                e.on_disk = OnDisk::Transient;
                ops.push(IndexOp::Publish {
                    seq: e.seq,
                    message: e.message.clone(),
                    expires_at_ms: e.expires_at_ms,
                    persistent: false,
                });
            }
        }
        for op in ops {
            self.record(op);
        }
        let Some(ticket) = self.barrier() else {
            return;
        };
        self.page_out = Some(PageOut {
            ticket,
            from,
            to: last + 1,
        });
        tracing::debug!(from, to = last + 1, "page-out started");
    }

    /// A ticket that is durable once every operation recorded so far is written.
    fn barrier(&mut self) -> Option<u64> {
        let me = self.me.upgrade()?;
        let p = self.persist.as_mut()?;
        let newly_dirty = !p.dirty;
        p.dirty = true;
        Some(p.durability.ticket(&me, newly_dirty))
    }

    fn finish_page_out(&mut self) {
        let Some(po) = self.page_out else {
            return;
        };
        let written = self
            .persist
            .as_ref()
            .is_some_and(|p| p.durability.is_durable(po.ticket));
        if !written {
            return;
        }
        self.page_out = None;
        // Bodies first (RabbitMQ's alpha -> beta): a message whose body has its own place
        // in a store drops the body and keeps its entry. Only a range with no such body
        // left moves on to delta, at the next page-out if memory still asks for one.
        if self.drop_bodies(po.from, po.to) {
            return;
        }
        let (mut count, mut bytes, mut size) = (0u64, 0u64, 0u64);
        let (mut persistent, mut persistent_bytes) = (0u64, 0u64);
        let mut take = |e: Entry| {
            count += 1;
            bytes += e.body_len();
            size += e.message.size();
            if counts_persistent(&e) {
                persistent += 1;
                persistent_bytes += e.body_len();
            }
        };
        match self.delta.as_mut() {
            Some(d) => {
                while self.q1.front().is_some_and(|e| e.seq < po.to) {
                    if let Some(e) = self.q1.pop_front() {
                        take(e);
                    }
                }
                d.end = d.end.max(po.to);
                d.count += count;
                d.bytes += bytes;
                d.persistent += persistent;
                d.persistent_bytes += persistent_bytes;
            }
            None => {
                let lane = &mut self.ready[0];
                let split = lane.partition_point(|e| e.seq < po.from);
                let mut tail = lane.split_off(split);
                let after = tail.split_off(tail.partition_point(|e| e.seq < po.to));
                let Some(start) = tail.front().map(|e| e.seq) else {
                    // Consumers took the whole range meanwhile.
                    lane.extend(after);
                    return;
                };
                self.ready_len -= tail.len() + after.len();
                tail.into_iter().for_each(&mut take);
                self.q1 = after;
                self.delta = Some(Delta {
                    start,
                    end: po.to,
                    count,
                    bytes,
                    persistent,
                    persistent_bytes,
                });
            }
        }
        self.ready_bytes -= bytes;
        self.account(-(size as i64));
        tracing::debug!(count, bytes, "paged out");
    }

    /// Turns the alphas of `[from, to)` whose body is in a store into betas; returns
    /// whether there was any.
    fn drop_bodies(&mut self, from: u64, to: u64) -> bool {
        let embed_below = self.persist.as_ref().map_or(0, |p| p.paging.embed_below);
        let lane = if self.delta.is_some() {
            &mut self.q1
        } else {
            &mut self.ready[0]
        };
        let mut freed = 0u64;
        let mut any = false;
        for e in lane.iter_mut() {
            if e.seq < from || e.seq >= to || e.beta.is_some() || e.on_disk == OnDisk::No {
                continue;
            }
            if !stored_apart(&e.message, embed_below) {
                continue;
            }
            let len = e.message.body.len() as u64;
            let mut bodiless = (*e.message).clone();
            bodiless.body = bytes::Bytes::new();
            e.message = Arc::new(bodiless);
            e.beta = Some(len);
            freed += len;
            any = true;
        }
        self.account(-(freed as i64));
        if any {
            tracing::debug!(freed, "message bodies paged out");
        }
        any
    }

    /// Reads a beta's message back from its store; false (reported) when it is gone.
    pub(super) fn load_beta(&mut self, e: &mut Entry) -> bool {
        if e.beta.is_none() {
            return true;
        }
        let loaded = match self.pager() {
            Some(p) => p.read_message(e.message.id, e.on_disk == OnDisk::Persistent),
            None => Err(PageError("no pager".into())),
        };
        match loaded {
            Ok(Some(m)) => {
                let before = e.message.size() as i64;
                e.message = Arc::new(m);
                e.beta = None;
                self.account(e.message.size() as i64 - before);
                true
            }
            Ok(None) | Err(_) => {
                tracing::error!(seq = e.seq, error = ?loaded.err(), "paged message body missing or unreadable; dropped");
                false
            }
        }
    }

    /// Reads delta back into the head when the head is empty, a segment at a time; once
    /// delta is empty, q1 joins the head.
    pub(super) fn fill_front(&mut self) {
        if !self.ready[0].is_empty() {
            return;
        }
        let Some(mut d) = self.delta else {
            return;
        };
        let (Some(pager), Some(me)) = (self.pager(), self.me.upgrade()) else {
            return;
        };
        while self.ready[0].is_empty() && d.count > 0 && d.start < d.end {
            match pager.page_in(&me.vhost, &me.name, d.start, d.end) {
                Ok((entries, next)) => {
                    for e in entries {
                        if e.seq < d.start || e.seq >= d.end {
                            continue;
                        }
                        let body = e.body_len();
                        d.count = d.count.saturating_sub(1);
                        d.bytes = d.bytes.saturating_sub(body);
                        if counts_persistent(&e) {
                            d.persistent = d.persistent.saturating_sub(1);
                            d.persistent_bytes = d.persistent_bytes.saturating_sub(body);
                        }
                        self.ready_bytes += body;
                        self.account(e.message.size() as i64);
                        self.ready_len += 1;
                        self.ready[0].push_back(e);
                    }
                    d.start = next.max(d.start + 1);
                }
                Err(e) => {
                    // Left in place: storage failures raise the alarm; reads are retried.
                    tracing::error!(queue = %me.name, vhost = %me.vhost, error = %e, "cannot read paged messages");
                    self.delta = Some(d);
                    return;
                }
            }
        }
        if d.count > 0 && d.start < d.end {
            self.delta = Some(d);
            return;
        }
        if d.count > 0 {
            tracing::error!(queue = %me.name, vhost = %me.vhost, missing = d.count, "paged messages missing from the queue index");
        }
        self.delta = None;
        let q1 = std::mem::take(&mut self.q1);
        self.ready_len += q1.len();
        self.ready[0].extend(q1);
    }
}

//! Group commit: which persistent writes are durable, and who waits for them.
//!
//! A queue that records a write for disk takes a *ticket* (a node-wide increasing number)
//! while holding its own lock, and is put on the dirty list. The syncer (runtime) takes the
//! highest ticket issued and the dirty list in one step, drains each dirty queue's pending
//! operations, writes and fsyncs them, then marks everything up to that ticket durable and
//! wakes the connections whose confirms wait on it.
//!
//! Why this is sound: a writer takes its ticket and joins the dirty list under this module's
//! lock while it holds its queue's lock, and pushes its operation before releasing the queue.
//! So if ticket `t` was issued before the syncer read the highest ticket, the queue is on the
//! list the syncer took, and the syncer's later lock of that queue waits for the push.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::outbox::Outbox;
use super::queue::QueueHandle;

#[derive(Default)]
struct Inner {
    next_ticket: u64,
    dirty: Vec<Arc<QueueHandle>>,
}

/// The node's group-commit state.
#[derive(Default)]
pub struct Durability {
    inner: Mutex<Inner>,
    durable_upto: AtomicU64,
    failed: AtomicBool,
    /// Ticket ranges `(after, upto]` written here but never confirmed by a mirrored queue's
    /// lap (the master was deposed): their confirms are nacks. Rare, so a short list.
    voided: Mutex<Vec<(u64, u64)>>,
    waiters: Mutex<Vec<Weak<Outbox>>>,
    wake_syncer: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Durability")
            .field("durable_upto", &self.durable_upto.load(Ordering::Relaxed))
            .field("failed", &self.failed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Durability {
    /// Sets what wakes the syncer when a queue becomes dirty.
    pub fn set_syncer_waker(&self, wake: Box<dyn Fn() + Send + Sync>) {
        *self.wake_syncer.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }

    /// Issues a ticket for a write of `queue` (call with the queue's lock held);
    /// `newly_dirty` says whether the queue must join the dirty list.
    pub fn ticket(&self, queue: &Arc<QueueHandle>, newly_dirty: bool) -> u64 {
        let t = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            g.next_ticket += 1;
            if newly_dirty {
                g.dirty.push(queue.clone());
            }
            g.next_ticket
        };
        if newly_dirty {
            if let Some(w) = self
                .wake_syncer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                w();
            }
        }
        t
    }

    /// The highest ticket issued and the queues with pending writes.
    pub fn take_dirty(&self) -> (u64, Vec<Arc<QueueHandle>>) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (g.next_ticket, std::mem::take(&mut g.dirty))
    }

    /// Everything up to `ticket` is on disk: wake the waiting connections.
    pub fn mark_durable(&self, ticket: u64) {
        self.durable_upto.fetch_max(ticket, Ordering::AcqRel);
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|e| e.into_inner()));
        for w in waiters.into_iter().filter_map(|w| w.upgrade()) {
            w.wake();
        }
    }

    /// Tickets in `(after, upto]` will never be confirmed: a mirrored queue's batch in them
    /// did not complete its lap. Call before [`mark_durable`](Self::mark_durable) of `upto`.
    pub fn void(&self, after: u64, upto: u64) {
        if upto > after {
            self.voided
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((after, upto));
        }
    }

    /// Whether some ticket in `[from, upto]` was voided.
    pub fn any_void(&self, from: u64, upto: u64) -> bool {
        self.voided
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|&(after, hi)| from <= hi && upto > after)
    }

    /// Whether the write with `ticket` must be nacked: storage failed, or its round was
    /// voided.
    pub fn is_refused(&self, ticket: u64) -> bool {
        ticket != 0 && (self.has_failed() || self.any_void(ticket, ticket))
    }

    /// The highest ticket marked durable so far.
    pub fn durable_upto(&self) -> u64 {
        self.durable_upto.load(Ordering::Acquire)
    }

    /// Whether tickets were issued that are not durable yet.
    pub fn outstanding(&self) -> bool {
        let issued = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_ticket;
        issued > self.durable_upto.load(Ordering::Acquire) && !self.has_failed()
    }

    /// Whether the write with `ticket` is durable.
    pub fn is_durable(&self, ticket: u64) -> bool {
        self.durable_upto.load(Ordering::Acquire) >= ticket
    }

    /// Registers a connection to be woken at the next durable mark.
    pub fn wait(&self, outbox: &Arc<Outbox>) {
        let mut w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if !w.iter().any(|x| x.as_ptr() == Arc::as_ptr(outbox)) {
            w.push(Arc::downgrade(outbox));
        }
    }

    /// A write or fsync failed: from now on nothing is confirmed as durable.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        self.mark_durable(0);
    }

    /// Whether storage failed.
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::queue::Queue;
    use crate::meta::args::QueueArgs;
    use crate::time::Instant;
    use std::sync::atomic::AtomicI64;

    #[test]
    fn tickets_become_durable_in_order_and_wake_waiters() {
        let d = Durability::default();
        let q = QueueHandle::new(
            "/",
            "q",
            Queue::new(
                QueueArgs::default(),
                None,
                false,
                Arc::new(AtomicI64::new(0)),
                Instant::default(),
            ),
        );
        let woke = Arc::new(AtomicBool::new(false));
        let w = woke.clone();
        let outbox = Arc::new(Outbox::new(
            1 << 20,
            Box::new(move || w.store(true, Ordering::SeqCst)),
        ));
        let t1 = d.ticket(&q, true);
        let t2 = d.ticket(&q, false);
        assert!(t2 > t1);
        let (upto, dirty) = d.take_dirty();
        assert_eq!((upto, dirty.len()), (t2, 1));
        assert!(!d.is_durable(t1));
        d.wait(&outbox);
        d.mark_durable(upto);
        assert!(d.is_durable(t1) && d.is_durable(t2));
        assert!(woke.load(Ordering::SeqCst));
        assert!(d.take_dirty().1.is_empty());
    }
}

//! What the relay has for one other node: the order requests leave in, how they are
//! batched, what the memory alarm counts, and the fate of each item. Sans-IO: the relay's
//! sender (`runtime::relay::sender`) moves the batches and replies.
//!
//! Rules:
//! - items leave in the order they were queued, in batches of at most `max_items` items
//!   and `max_bytes` bytes (a single bigger item still goes, alone);
//! - one batch is handed to the link at a time; once the link took it, its reply is
//!   awaited while later batches go, and replies are taken in batch order;
//! - every item gets exactly one fate: answered (its batch's reply came) or failed (the
//!   link refused its batch, no reply came, or the node was declared down). A forwarded
//!   publish is thereby always confirmed or nacked, never left waiting;
//! - once the node is declared down ([`NodeOutbox::handle_down`]) everything queued, being
//!   handed over or awaiting a reply fails at once, and so does everything queued later:
//!   nothing sent to a node the failure detector gave up on would be answered before it
//!   comes back (a frozen node holds its sockets open, and a partitioned link's send
//!   waits for room without end, issue 16's stalled majority);
//! - an item's held bytes count from its enqueue to its fate ([`NodeOutbox::take_held`]):
//!   a link that stops draining raises the memory alarm, which blocks publishers, instead
//!   of what waits for that node growing without bound.

use std::collections::VecDeque;

/// One queued item with its sizes.
#[derive(Debug)]
struct Queued<T> {
    item: T,
    /// Encoded bytes, for batching.
    size: usize,
    /// Bytes it holds in memory, for the alarm.
    held: usize,
}

/// A batch handed over, or awaiting its reply.
#[derive(Debug)]
struct InFlight<T> {
    id: u64,
    items: Vec<Queued<T>>,
}

/// The relay's outbox for one node.
#[derive(Debug)]
pub struct NodeOutbox<T> {
    max_items: usize,
    max_bytes: usize,
    queued: VecDeque<Queued<T>>,
    /// The batch being handed to the link (waiting for room on it).
    handing: Option<InFlight<T>>,
    /// Batches the link took, oldest first, awaiting their replies.
    awaiting: VecDeque<InFlight<T>>,
    next_batch: u64,
    down: bool,
    /// Held bytes not yet reported through `take_held`.
    held_delta: i64,
}

impl<T> NodeOutbox<T> {
    /// An empty outbox sending batches of at most `max_items` items and `max_bytes` bytes.
    pub fn new(max_items: usize, max_bytes: usize) -> NodeOutbox<T> {
        NodeOutbox {
            max_items: max_items.max(1),
            max_bytes,
            queued: VecDeque::new(),
            handing: None,
            awaiting: VecDeque::new(),
            next_batch: 1,
            down: false,
            held_delta: 0,
        }
    }

    /// Queues `item` (`size` encoded bytes, `held` bytes in memory). `Err(item)`: the node
    /// is down, and the item fails now.
    pub fn handle_enqueue(&mut self, item: T, size: usize, held: usize) -> Result<(), T> {
        if self.down {
            return Err(item);
        }
        self.held_delta += held as i64;
        self.queued.push_back(Queued { item, size, held });
        Ok(())
    }

    /// The next batch to hand to the link, as its id and items (in order), when none is
    /// being handed over and something is queued. Its items stay here until
    /// [`NodeOutbox::handle_handed`] or [`NodeOutbox::handle_refused`].
    pub fn poll_batch(&mut self) -> Option<(u64, Vec<&T>)> {
        if self.handing.is_some() || self.queued.is_empty() {
            return None;
        }
        let mut items = Vec::new();
        let mut bytes = 0;
        while let Some(next) = self.queued.front() {
            let full = items.len() >= self.max_items || bytes >= self.max_bytes;
            if !items.is_empty() && (full || bytes + next.size > self.max_bytes) {
                break;
            }
            bytes += next.size;
            items.extend(self.queued.pop_front());
        }
        let id = self.next_batch;
        self.next_batch += 1;
        self.handing = Some(InFlight { id, items });
        let batch = self
            .handing
            .as_ref()
            .map(|b| b.items.iter().map(|q| &q.item).collect())?;
        Some((id, batch))
    }

    /// Batch `id` is with the link: its reply is awaited.
    pub fn handle_handed(&mut self, id: u64) {
        if let Some(batch) = self.handing.take_if(|b| b.id == id) {
            self.awaiting.push_back(batch);
        }
    }

    /// The link refused batch `id` (the node cannot be reached): its items fail.
    pub fn handle_refused(&mut self, id: u64) -> Vec<T> {
        match self.handing.take_if(|b| b.id == id) {
            Some(batch) => self.release(batch.items),
            None => Vec::new(),
        }
    }

    /// Batch `id`'s reply came: its items, in order, to be matched with the reply's
    /// answers. Replies come in batch order; a batch awaited before `id` whose reply never
    /// came can have none any more, and fails (returned second).
    pub fn handle_answered(&mut self, id: u64) -> (Vec<T>, Vec<T>) {
        let mut failed = Vec::new();
        while let Some(b) = self.awaiting.pop_front() {
            if b.id == id {
                return (self.release(b.items), failed);
            }
            if b.id > id {
                self.awaiting.push_front(b);
                break;
            }
            failed.extend(self.release(b.items));
        }
        (Vec::new(), failed)
    }

    /// Batch `id`'s reply will not come (the link failed with it in flight, or the reply
    /// could not be read): its items fail.
    pub fn handle_unanswered(&mut self, id: u64) -> Vec<T> {
        match self.awaiting.iter().position(|b| b.id == id) {
            Some(i) => {
                let batch = self.awaiting.remove(i).map(|b| b.items).unwrap_or_default();
                self.release(batch)
            }
            None => Vec::new(),
        }
    }

    /// The node was declared down: everything here fails, oldest first, and so will
    /// everything queued from now on.
    pub fn handle_down(&mut self) -> Vec<T> {
        self.down = true;
        let mut all = Vec::new();
        for b in std::mem::take(&mut self.awaiting) {
            all.extend(b.items);
        }
        all.extend(self.handing.take().map(|b| b.items).unwrap_or_default());
        all.extend(std::mem::take(&mut self.queued));
        self.release(all)
    }

    /// Whether the node was declared down.
    pub fn is_down(&self) -> bool {
        self.down
    }

    /// Whether nothing is queued, handed over or awaited.
    pub fn is_idle(&self) -> bool {
        self.queued.is_empty() && self.handing.is_none() && self.awaiting.is_empty()
    }

    /// The change in held bytes since the last call, for the memory alarm.
    pub fn take_held(&mut self) -> i64 {
        std::mem::take(&mut self.held_delta)
    }

    fn release(&mut self, items: Vec<Queued<T>>) -> Vec<T> {
        items
            .into_iter()
            .map(|q| {
                self.held_delta -= q.held as i64;
                q.item
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;

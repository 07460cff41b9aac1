//! Reading paged-out messages back ([`Pager`]): a queue's entries from its index and the
//! message store, and a single message by id.

use super::recovery::{beta_entry, queue_entry};
use super::{msg_id, Storage};
use crate::broker::queue::{Entry, OnDisk, PageError, Pager};
use crate::broker::Message;
use crate::store::queue_index::QueueIndex;
use crate::store::Disk;

impl<D: Disk + Clone + Send + Sync> Pager for Storage<D> {
    fn page_in(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        to: u64,
    ) -> Result<(Vec<Entry>, u64), PageError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = guard
            .as_ref()
            .ok_or_else(|| PageError("storage is closed".into()))?;
        let key = (vhost.to_string(), name.to_string());
        // Both indexes, each read a segment at a time, up to the nearer segment end.
        let indexes: Vec<(&QueueIndex<D>, OnDisk)> = [
            state.indexes.get(&key).map(|i| (i, OnDisk::Persistent)),
            state
                .transient_indexes
                .get(&key)
                .map(|i| (i, OnDisk::Transient)),
        ]
        .into_iter()
        .flatten()
        .collect();
        if indexes.is_empty() {
            return Err(PageError(format!("no queue index for {vhost}/{name}")));
        }
        let next = indexes
            .iter()
            .map(|(i, _)| {
                (from / i.config().segment_entry_count + 1) * i.config().segment_entry_count
            })
            .min()
            .unwrap_or(to);
        let mut found = Vec::new();
        for (index, on_disk) in indexes {
            let segment = from / index.config().segment_entry_count;
            found.extend(
                index
                    .read_segment(segment)
                    .map_err(|e| PageError(e.to_string()))?
                    .into_iter()
                    .filter(|e| e.publish.seq >= from && e.publish.seq < to.min(next))
                    .map(|e| (e, on_disk)),
            );
        }
        found.sort_by_key(|(e, _)| e.publish.seq);
        let mut entries = Vec::with_capacity(found.len());
        for (e, on_disk) in found {
            let p = &e.publish;
            let id = u128::from_be_bytes(p.msg_id);
            let Some(embedded) = &p.embedded else {
                // Body in a store: a beta, read when it leaves the queue (a segment of
                // large messages would not fit in RAM).
                entries.push(beta_entry(&e, self.epoch_unix_ms, on_disk));
                continue;
            };
            let Some(message) = decode_message(embedded, id) else {
                tracing::error!(queue = %format!("{vhost}/{name}"), seq = p.seq, "paged message unreadable; skipped");
                continue;
            };
            self.disk_reads.inc();
            entries.push(queue_entry(&e, message, 0, self.epoch_unix_ms, on_disk));
        }
        Ok((entries, next))
    }

    fn read_message(&self, id: u128, persistent: bool) -> Result<Option<Message>, PageError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = guard
            .as_ref()
            .ok_or_else(|| PageError("storage is closed".into()))?;
        let store = if persistent {
            &state.msg_store
        } else {
            &state.transient_store
        };
        let bytes = store
            .read(msg_id(id))
            .map_err(|e| PageError(e.to_string()))?;
        let message = bytes.and_then(|b| decode_message(&b, id));
        if message.is_some() {
            self.disk_reads.inc();
        }
        Ok(message)
    }
}

pub(crate) fn decode_message(bytes: &[u8], id: u128) -> Option<Message> {
    Message::from_stored(bytes, id)
}

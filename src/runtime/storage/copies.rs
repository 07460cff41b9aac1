//! Mirror copies on this node: the master's rounds applied to a mirror's copy, copies
//! started, dropped and adopted at promotion (the master's backlog reads are in `backlog`).

use std::sync::Arc;

use super::recovery::{recover_queue, remove_index_dir, COPY_INCARNATION_FILE};
use super::syncer::LapWait;
use super::{queue_dir_name, RecoverySummary, State, Storage, StorageError};
use crate::broker::queue::IndexOp;
use crate::broker::QueueHandle;
use crate::mirror::digest::{self, CopyEntry, RangeSummary, Verdict};
use crate::store::msg_store::MsgId;
use crate::store::queue_index::{IndexConfig, QueueIndex};
use crate::store::Disk;

/// A tap on the operations a round writes, per queue: (vhost, queue) and the operations.
/// For a mirrored queue it ships them and returns the wait for their lap: the round's
/// confirms are held until it completes, and refused (nacked) if it fails.
pub type OpsTap = Arc<dyn Fn(&(String, String), &[IndexOp]) -> Option<LapWait> + Send + Sync>;

/// A sync batch, or one GM message of a shipped round, holds at most this many bytes of
/// messages (whatever `ha-sync-batch-size` says), or one message alone when that is
/// bigger. Each travels as one GM message; one under GM's batch budget (8 MiB) goes in
/// one frame and can share it, a bigger one goes in parts (`docs/gm.md`, *Frame size*).
pub const SYNC_BATCH_BYTES: usize = 4 << 20;

impl<D: Disk + Clone> Storage<D> {
    /// Installs (or removes) the tap on the operations each round writes.
    pub fn set_ops_tap(&self, tap: Option<OpsTap>) {
        *self.tap.lock().unwrap_or_else(|e| e.into_inner()) = tap;
    }

    /// A mirror's write: applies operations another node's queue recorded (in its order)
    /// to this node's copy of that queue's index and message store, and fsyncs them, so
    /// that opening the copy (as crash recovery does) gives the master's queue.
    ///
    /// Only to the copy of `incarnation` that [`Storage::start_copy`] began: anything else
    /// under the name is refused ([`StorageError::NotOurCopy`]).
    pub fn apply_mirrored(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        ops: Vec<IndexOp>,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        if state.copies.get(&key) != Some(&incarnation) {
            return Err(StorageError::NotOurCopy {
                queue: format!("{vhost}/{queue}"),
                incarnation,
            });
        }
        let touched = self.apply(state, &key, ops, true)?;
        state.msg_store.flush()?;
        state.transient_store.flush()?;
        state.msg_store.sync()?;
        if touched {
            if let Some(index) = state.indexes.get_mut(&key) {
                index.sync().map_err(|source| StorageError::Index {
                    queue: format!("{vhost}/{queue}"),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// Opens (creating) a queue's persistent or transient index.
    pub(super) fn open_index(
        &self,
        key: &(String, String),
        transient: bool,
    ) -> Result<QueueIndex<D>, StorageError> {
        let label = format!("{}/{}", key.0, key.1);
        let base = if transient {
            &self.transient_queues_dir
        } else {
            &self.queues_dir
        };
        let dir = base.join(queue_dir_name(&key.0, &key.1));
        if transient {
            // Whatever an earlier run left there is void.
            remove_index_dir(&self.disk, &dir);
        }
        let (index, _) = QueueIndex::open(self.disk.clone(), &dir, self.index_config.clone())
            .map_err(|source| StorageError::Index {
                queue: label.clone(),
                source,
            })?;
        self.disk
            .write_file(&dir.join("queue.name"), label.as_bytes())?;
        Ok(index)
    }

    /// Starts an empty copy of incarnation `incarnation` of a queue this node mirrors:
    /// whatever the node held under that name goes first (an earlier copy, one left by an
    /// earlier run, or the local queue of a deposed master, which no longer serves).
    ///
    /// `since`: a [`next_generation`](crate::broker::queue::next_generation) the mirror
    /// took before it read the metadata that made it one. A queue handle of the name made
    /// before it is a deposed master's (or a deleted queue's), whose operations never touch
    /// the copy; one made after it is a new queue of the name, which replaces the copy
    /// (`Storage::write_round`).
    pub fn start_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        since: u64,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        self.remove_copy(state, &key)?;
        // Which incarnation the folder's copy is of, durable before the copy's first write:
        // a node that restarts with the copy and finds itself its queue's master by then
        // recovers it only if it is a copy of the same queue (`open_with`).
        let dir = self.queues_dir.join(queue_dir_name(vhost, queue));
        self.disk.create_dir_all(&dir)?;
        let marker = dir.join(COPY_INCARNATION_FILE);
        self.disk
            .write_file(&marker, incarnation.to_string().as_bytes())?;
        self.disk.sync(&marker)?;
        self.disk.sync_dir(&dir)?;
        state.copies.insert(key.clone(), incarnation);
        state.started.insert(key, since);
        Ok(())
    }

    /// The copies this run found on disk and no sync has compared yet: (vhost, name) and
    /// incarnation.
    pub fn kept_copies(&self) -> Vec<((String, String), u64)> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map_or_else(Vec::new, |s| {
            s.kept.iter().map(|(k, i)| (k.clone(), *i)).collect()
        })
    }

    /// A mirror's copy before it joins the queue's group: the copy of `incarnation` that
    /// this run found on disk is left as it is, for the first active sync to compare
    /// ([`Storage::resume_copy`]); anything else starts empty ([`Storage::start_copy`]).
    pub fn begin_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        since: u64,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        {
            let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(state) = guard.as_mut() {
                if state.kept.get(&key) == Some(&incarnation)
                    && state.copies.get(&key) == Some(&incarnation)
                {
                    state.started.insert(key, since);
                    return Ok(());
                }
            }
        }
        self.start_copy(vhost, queue, incarnation, since)
    }

    /// A mirror's copy at an active sync's start (`from_seq`: the master's next seq):
    /// `Some(next)` when the copy kept from the last run stays, holding seqs below
    /// `next` only (`next <= from_seq`); the digest then says which of them still count.
    /// Otherwise (no kept copy, or one with seqs the master never gave: the master
    /// restarted without rounds this copy has) the copy starts empty: `None`. Either way
    /// the copy is no longer "kept": a later sync starts empty.
    pub fn resume_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        from_seq: u64,
        since: u64,
    ) -> Result<Option<u64>, StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        {
            let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let Some(state) = guard.as_mut() else {
                return Ok(None);
            };
            let kept = state.kept.remove(&key) == Some(incarnation)
                && state.copies.get(&key) == Some(&incarnation);
            let next = state.indexes.get(&key).map(|i| i.bounds().1);
            if let (true, Some(next)) = (kept, next) {
                if next <= from_seq {
                    return Ok(Some(next));
                }
            }
        }
        self.start_copy(vhost, queue, incarnation, since)
            .map(|()| None)
    }

    /// Compares a kept copy's seqs in the summary's range with the master's summary of it
    /// ([`digest::compare`]) and makes the copy match it: entries the master no longer
    /// holds go, deliveries the copy missed are recorded, all fsynced. `false` (nothing
    /// changed) when the copy lacks a live message, holds another one at its seq or has
    /// lost its body: the copy cannot take it any more (an index takes publishes in seq
    /// order), so the caller starts the copy empty.
    pub fn reconcile_summary(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        summary: &RangeSummary,
    ) -> Result<bool, StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(false);
        };
        if state.copies.get(&key) != Some(&incarnation) {
            return Err(StorageError::NotOurCopy {
                queue: format!("{vhost}/{queue}"),
                incarnation,
            });
        }
        let wrap = |source| StorageError::Index {
            queue: format!("{vhost}/{queue}"),
            source,
        };
        let (lo, hi) = (summary.lo, summary.hi);
        // The copy's live entries in the range, in seq order.
        let mut held = Vec::new();
        if let Some(index) = state.indexes.get(&key) {
            let per_segment = index.config().segment_entry_count.max(1);
            for n in index.segments() {
                if (n + 1) * per_segment <= lo || n * per_segment >= hi {
                    continue;
                }
                for e in index.read_segment_light(n).map_err(wrap)? {
                    let p = &e.publish;
                    if p.seq < lo || p.seq >= hi {
                        continue;
                    }
                    held.push(CopyEntry {
                        seq: p.seq,
                        id: u128::from_be_bytes(p.msg_id),
                        size: u64::from(p.size),
                        delivered: e.delivered,
                        body: p.embedded.is_some() || state.msg_store.contains(MsgId(p.msg_id)),
                    });
                }
            }
        }
        let Verdict::Matches { acks, delivers } = digest::compare(summary, held) else {
            return Ok(false);
        };
        let mut ops: Vec<IndexOp> = delivers
            .into_iter()
            .map(|seq| IndexOp::Deliver { seq })
            .collect();
        ops.extend(acks.into_iter().map(|e| IndexOp::Ack {
            seq: e.seq,
            message_id: e.id,
            size: e.size as usize,
            persistent: true,
        }));
        if ops.is_empty() {
            return Ok(true);
        }
        self.apply(state, &key, ops, true)?;
        state.msg_store.flush()?;
        state.msg_store.sync()?;
        if let Some(index) = state.indexes.get_mut(&key) {
            index.sync().map_err(wrap)?;
        }
        Ok(true)
    }

    /// Drops this node's copy of incarnation `incarnation` of a queue it mirrored (index
    /// and bodies); anything else under the name (a newer incarnation's copy, or a queue
    /// of this node) stays.
    pub fn drop_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        if state.copies.get(&key) == Some(&incarnation) {
            self.remove_copy(state, &key)?;
        }
        Ok(())
    }

    /// Removes whatever index the name has, its folder (a copy never opened in this run,
    /// left by an earlier one, goes too) and its record as a copy.
    pub(super) fn remove_copy(
        &self,
        state: &mut State<D>,
        key: &(String, String),
    ) -> Result<(), StorageError> {
        state.copies.remove(key);
        state.started.remove(key);
        state.kept.remove(key);
        self.apply(state, key, vec![IndexOp::DeleteQueue], true)?;
        remove_index_dir(
            &self.disk,
            &self.queues_dir.join(queue_dir_name(&key.0, &key.1)),
        );
        state.msg_store.flush()?;
        state.msg_store.sync()?;
        Ok(())
    }

    /// Promotion: this node's mirror copy becomes the queue `handle` (just created, not yet
    /// serving). The copy's index is closed and opened again exactly as crash recovery
    /// opens it, so deliveries never acked come back `redelivered`.
    ///
    /// Never a copy of another incarnation than `incarnation` (the promoted queue's); a
    /// copy this run has no record of (left by an earlier run) is taken as it is.
    pub fn adopt(
        &self,
        handle: &QueueHandle,
        incarnation: u64,
    ) -> Result<RecoverySummary, StorageError> {
        let key = (handle.vhost.clone(), handle.name.clone());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(RecoverySummary::default());
        };
        state.kept.remove(&key);
        state.started.remove(&key);
        if state.copies.remove(&key).is_some_and(|c| c != incarnation) {
            return Err(StorageError::NotOurCopy {
                queue: format!("{}/{}", key.0, key.1),
                incarnation,
            });
        }
        if let Some(index) = state.indexes.remove(&key) {
            index.close().map_err(|source| StorageError::Index {
                queue: format!("{}/{}", key.0, key.1),
                source,
            })?;
        }
        let mut summary = RecoverySummary {
            clean: true,
            ..RecoverySummary::default()
        };
        let dir = self.queues_dir.join(queue_dir_name(&key.0, &key.1));
        // The queue lives on: so do its transient messages (a mirrored queue records them).
        let config = IndexConfig {
            keep_transient: true,
            ..self.index_config.clone()
        };
        let (index, _) = recover_queue(
            &self.disk,
            &dir,
            handle,
            &config,
            self.head_entries,
            &state.msg_store,
            self.epoch_unix_ms,
            // A mirror's copy becoming the queue: the old master's last deliveries may
            // not have reached it.
            true,
            &mut summary,
        )?;
        state.indexes.insert(key, index);
        Ok(summary)
    }

    /// Runs `f` with the next seq of the queue's persistent index (0 when it has none),
    /// under the storage lock: what `f` broadcasts is ordered after every round already
    /// shipped and before every later one (a mirror's sync starts there).
    pub fn at_next_seq<T>(&self, vhost: &str, queue: &str, f: impl FnOnce(u64) -> T) -> T {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let next = guard
            .as_ref()
            .and_then(|s| s.indexes.get(&key))
            .map_or(0, |i| i.bounds().1);
        f(next)
    }

    /// Live messages of the queue's transient page index (paged-out messages that are not
    /// in its persistent index).
    pub fn transient_len(&self, vhost: &str, queue: &str) -> u64 {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .and_then(|s| s.transient_indexes.get(&key))
            .map_or(0, |i| i.len())
    }

    /// The lowest live seq of the queue's persistent index (`None`: empty or none).
    pub fn low_seq(&self, vhost: &str, queue: &str) -> Option<u64> {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let index = guard.as_ref()?.indexes.get(&key)?;
        (!index.is_empty()).then(|| index.bounds().0)
    }
}

//! A syncing mirror's backlog writer: writes an active sync's batches to the copy beside
//! the mirror's loop, in order, and broadcasts each one's report (`SyncWritten`) once it is
//! written. The loop releases a batch as soon as it hands it over, so the rounds behind it
//! (held during the sync) wait on no disk write, and the master paces its batches by the
//! reports (`docs/mirroring.md`, *Sync*). The loop finishes the writer before anything
//! else reads or writes the copy.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{Key, StorageDisk};
use crate::mirror::message::MirrorMsg;
use crate::mirror::ops;
use crate::runtime::gm_host::GmSender;
use crate::runtime::storage::Storage;

/// The writer task of one membership's sync.
pub(super) struct BatchWriter {
    batches: mpsc::UnboundedSender<(Bytes, MirrorMsg)>,
    task: JoinHandle<bool>,
}

impl BatchWriter {
    /// A writer of `key`'s copy of `incarnation`, reporting through `sender`.
    pub(super) fn start<D: StorageDisk>(
        storage: Arc<Storage<D>>,
        inline: bool,
        key: Key,
        incarnation: u64,
        sender: GmSender,
    ) -> BatchWriter {
        let (batches, mut rx) = mpsc::unbounded_channel::<(Bytes, MirrorMsg)>();
        let task = tokio::spawn(async move {
            while let Some((batch, then)) = rx.recv().await {
                let written =
                    write_copy(storage.clone(), inline, &key, incarnation, vec![batch]).await;
                if !written {
                    return false;
                }
                if let Err(e) = sender.broadcast(Bytes::from(then.encode())) {
                    tracing::debug!(queue = %key.1, error = %e, "cannot report a written sync batch");
                }
            }
            true
        });
        BatchWriter { batches, task }
    }

    /// Queues a batch, and the report to send once it is written; `false`: the writer
    /// has stopped (a write failed).
    pub(super) fn write(&self, batch: Bytes, then: MirrorMsg) -> bool {
        self.batches.send((batch, then)).is_ok()
    }

    /// Waits until every queued batch is written: `false` if one could not be.
    pub(super) async fn finish(self) -> bool {
        drop(self.batches);
        self.task.await.unwrap_or(false)
    }

    /// Returns once the writer has stopped on its own, which it does only when a write
    /// failed (the loop keeps its queue open until [`BatchWriter::finish`]).
    pub(super) async fn stopped(&mut self) {
        let _ = (&mut self.task).await;
    }
}

/// Writes rounds or sync batches to `key`'s copy of `incarnation`, in order, with one
/// fsync (on the blocking pool, or on this task when `inline`): `false` if they could not
/// be decoded or written.
pub(super) async fn write_copy<D: StorageDisk>(
    storage: Arc<Storage<D>>,
    inline: bool,
    key: &Key,
    incarnation: u64,
    batches: Vec<Bytes>,
) -> bool {
    let mut decoded = Vec::new();
    for batch in &batches {
        match ops::decode(batch) {
            Ok(o) => decoded.extend(o),
            Err(e) => {
                tracing::error!(queue = %key.1, error = %e, "undecodable mirrored batch");
                return false;
            }
        }
    }
    let (vhost, name) = key.clone();
    let write = move || storage.apply_mirrored(&vhost, &name, incarnation, decoded);
    let written = if inline {
        Some(write())
    } else {
        tokio::task::spawn_blocking(write).await.ok()
    };
    match written {
        Some(Ok(())) => true,
        Some(Err(e)) => {
            tracing::error!(queue = %key.1, error = %e, "cannot write a mirrored batch");
            false
        }
        None => false,
    }
}

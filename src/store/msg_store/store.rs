//! [`MsgStore`]: the I/O driver. It asks the [`StoreIndex`] what to do and does it through a
//! [`Disk`].
//!
//! Writes go to a write-back cache; `flush` appends everything cached in one append per file,
//! `sync` fsyncs the files appended to since the last sync (group commit). A message removed
//! before its flush never touches the disk, as RabbitMQ cancels such writes.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::store::disk::Disk;

use super::index::{AppendBatch, Location, RefCountReport, Removed, Slot, StoreIndex};
use super::{
    decode_record, encode_record_pieces, file_name, record_size, MsgId, MsgStoreConfig,
    MsgStoreError,
};

/// What one [`MsgStore::compact`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactReport {
    /// Files deleted, ascending.
    pub files_removed: Vec<u64>,
    /// Live records copied into the current file.
    pub records_moved: usize,
    /// Size of the deleted files.
    pub bytes_reclaimed: u64,
    /// Records found corrupt while copying: unreadable, so dropped from the store. Sorted.
    pub corrupt: Vec<MsgId>,
}

/// The message store over a [`Disk`]. One owner drives it (`&mut self`); see the module docs
/// for durability and for what a failure means.
///
/// Usage: [`open`](MsgStore::open); [`write`](MsgStore::write) / [`remove`](MsgStore::remove)
/// / [`read`](MsgStore::read) freely; [`sync`](MsgStore::sync) before acknowledging writes
/// (the owner batches: many writes, one sync); [`compact`](MsgStore::compact) when
/// [`compaction_due`](MsgStore::compaction_due); [`close`](MsgStore::close) at shutdown.
#[derive(Debug)]
pub struct MsgStore<D: Disk> {
    pub(super) disk: D,
    pub(super) dir: PathBuf,
    pub(super) config: MsgStoreConfig,
    pub(super) index: StoreIndex,
    /// Bodies of pending (unflushed) writes.
    pub(super) cache: HashMap<MsgId, [Bytes; 2]>,
    /// Files appended to since the last sync.
    pub(super) unsynced: BTreeSet<u64>,
    /// A file was created or deleted since the last folder sync.
    pub(super) dir_unsynced: bool,
    /// A fatal error happened: no more changes.
    pub(super) failed: bool,
}

impl<D: Disk> MsgStore<D> {
    /// Stores `body` under `id`, or counts one more reference if `id` is already stored (the
    /// body is then ignored: one id, one body). Buffered; when the buffer reaches
    /// `write_buffer_max_bytes` it is flushed, and a flush error is returned (the write itself
    /// stays recorded and cached).
    pub fn write(&mut self, id: MsgId, body: &[u8]) -> Result<(), MsgStoreError> {
        self.write_pieces(id, Bytes::new(), Bytes::copy_from_slice(body))
    }

    /// [`write`](Self::write) of the body `head ++ tail`, kept in two pieces until the flush
    /// writes them into the record: the storage syncer's stored-message header and the
    /// AMQP body it shares with the queue and the publisher's frame, never copied whole.
    pub fn write_pieces(
        &mut self,
        id: MsgId,
        head: Bytes,
        tail: Bytes,
    ) -> Result<(), MsgStoreError> {
        self.check()?;
        let total = record_size(head.len().saturating_add(tail.len()))?;
        if let super::WriteDecision::Buffer = self.index.write(id, total) {
            self.cache.insert(id, [head, tail]);
        }
        if self.index.pending_bytes() >= self.config.write_buffer_max_bytes {
            self.flush()?;
        }
        Ok(())
    }

    /// The body of `id`: from the write-back cache if not flushed yet, else from its file.
    pub fn read(&self, id: MsgId) -> Result<Option<Vec<u8>>, MsgStoreError> {
        let Some(entry) = self.index.entry(&id) else {
            return Ok(None);
        };
        let loc = match entry.slot {
            Slot::Pending { .. } => return Ok(self.cache.get(&id).map(|p| p.concat())),
            Slot::Stored(loc) => loc,
        };
        let path = self.file_path(loc.file);
        let bytes = self
            .disk
            .read_at(&path, loc.offset, loc.total_size as usize)?;
        match decode_record(&bytes, id) {
            Some(body) => Ok(Some(body.to_vec())),
            None => Err(MsgStoreError::Corrupt {
                path,
                offset: loc.offset,
            }),
        }
    }

    /// Drops one reference to `id`. At zero the record becomes garbage (reclaimed by
    /// `compact`), or, if it was never flushed, is forgotten without any I/O.
    pub fn remove(&mut self, id: MsgId) -> Result<Removed, MsgStoreError> {
        self.check()?;
        let removed = self.index.remove(id);
        if removed == Removed::Cancelled {
            self.cache.remove(&id);
        }
        Ok(removed)
    }

    /// True when `id` is stored (at least one reference).
    pub fn contains(&self, id: MsgId) -> bool {
        self.index.entry(&id).is_some()
    }

    /// References to `id` (0 when absent).
    pub fn ref_count(&self, id: MsgId) -> u32 {
        self.index.ref_count(&id)
    }

    /// Messages stored.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes waiting in the write-back cache.
    pub fn buffered_bytes(&self) -> u64 {
        self.index.pending_bytes()
    }

    /// True when a [`sync`](Self::sync) has work to do: cached writes, or appends and folder
    /// changes not yet fsynced.
    pub fn needs_sync(&self) -> bool {
        self.index.pending_bytes() > 0 || !self.unsynced.is_empty() || self.dir_unsynced
    }

    /// The bookkeeping, read-only.
    pub fn index(&self) -> &StoreIndex {
        &self.index
    }

    /// The store's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True after a fatal error (see the module docs).
    pub fn is_failed(&self) -> bool {
        self.failed
    }

    /// True when some file is worth compacting.
    pub fn compaction_due(&self) -> bool {
        !self
            .index
            .compaction_candidates(self.config.garbage_fraction)
            .is_empty()
    }

    /// Replaces every reference count (after a dirty recovery, from the queue indexes); see
    /// [`StoreIndex::set_ref_counts`].
    pub fn set_ref_counts(
        &mut self,
        counts: impl IntoIterator<Item = (MsgId, u32)>,
    ) -> Result<RefCountReport, MsgStoreError> {
        self.check()?;
        let report = self.index.set_ref_counts(counts);
        for id in &report.dropped {
            self.cache.remove(id);
        }
        Ok(report)
    }

    /// Like [`set_ref_counts`](Self::set_ref_counts) from a list of references: each
    /// occurrence of an id is one reference (one queue holding it), as RabbitMQ's walker
    /// counts them. Ids not listed are dropped.
    pub fn retain_only(
        &mut self,
        refs: impl IntoIterator<Item = MsgId>,
    ) -> Result<RefCountReport, MsgStoreError> {
        self.set_ref_counts(refs.into_iter().map(|id| (id, 1)))
    }

    /// Appends every cached write to the current file(s): one append per file.
    ///
    /// On a failed append (disk full, short write) the file is cut back to where the batch
    /// started, so what was there before stays intact and the next append lands where the
    /// index expects; the writes stay cached and the next flush retries them. If the cut
    /// fails too, the store fails (see the module docs).
    pub fn flush(&mut self) -> Result<(), MsgStoreError> {
        self.check()?;
        let pending = self.index.pending();
        if pending.is_empty() {
            return Ok(());
        }
        for batch in self.index.plan_append(&pending) {
            let mut buf = Vec::with_capacity(batch.len() as usize);
            for p in &batch.records {
                let body = self
                    .cache
                    .get(&p.id)
                    .expect("a pending write has a cached body");
                encode_record_pieces(&mut buf, p.id, &[&body[0], &body[1]]);
            }
            self.append_batch(&batch, &buf)?;
            for p in &batch.records {
                self.cache.remove(&p.id);
            }
        }
        Ok(())
    }

    /// Flushes, then fsyncs every file appended to since the last sync, and the folder if a
    /// file was created or deleted. Everything written before is durable once this returns
    /// Ok. A failed fsync is fatal.
    pub fn sync(&mut self) -> Result<(), MsgStoreError> {
        self.flush()?;
        self.sync_written()
    }

    /// Reclaims garbage: every non-current file that is empty of live records or more than
    /// `garbage_fraction` garbage has its live records copied to the end of the current file,
    /// then, once the copies are fsynced, is deleted. A crash at any point leaves each live
    /// record in at least one durable place (recovery keeps one copy of duplicates).
    /// Syncs pending writes first.
    pub fn compact(&mut self) -> Result<CompactReport, MsgStoreError> {
        self.sync()?;
        let mut report = CompactReport::default();
        let candidates = self
            .index
            .compaction_candidates(self.config.garbage_fraction);
        if candidates.is_empty() {
            return Ok(report);
        }
        let live = self.index.live_records(&candidates);
        for (file, records) in &live {
            if records.is_empty() {
                continue;
            }
            let path = self.file_path(*file);
            let chunks = self.read_live(&path, *file, records)?;
            let mut copies = Vec::with_capacity(records.len());
            let mut slices = Vec::with_capacity(records.len());
            for (id, loc) in records {
                let slice = slice_of(&chunks, loc);
                // Copy only verified records: a bad one in the middle of the current file
                // would make a later recovery scan stop there and lose everything after it.
                match slice.filter(|s| decode_record(s, *id).is_some()) {
                    Some(s) => {
                        copies.push((*id, loc.total_size));
                        slices.push(s);
                    }
                    None => {
                        tracing::error!(%id, file, offset = loc.offset, "corrupt record dropped during compaction");
                        self.index.drop_entry(*id);
                        report.corrupt.push(*id);
                    }
                }
            }
            let mut next = slices.iter();
            for batch in self.index.plan_append(&copies) {
                let mut buf = Vec::with_capacity(batch.len() as usize);
                for _ in &batch.records {
                    buf.extend_from_slice(next.next().expect("one slice per planned record"));
                }
                self.append_batch(&batch, &buf)?;
                report.records_moved += batch.records.len();
            }
        }
        // The copies must be durable before any original goes.
        self.sync_written()?;
        for file in candidates {
            let Some(summary) = self.index.file_summary(file) else {
                continue;
            };
            if summary.valid_bytes != 0 {
                continue;
            }
            self.disk.remove(&self.file_path(file))?;
            self.index.forget_file(file);
            self.dir_unsynced = true;
            report.files_removed.push(file);
            report.bytes_reclaimed += summary.total_bytes;
        }
        self.sync_written()?;
        report.corrupt.sort_unstable();
        Ok(report)
    }

    /// Syncs everything, then saves the index and the clean marker, so the next `open` skips
    /// the scan. A failed store writes no marker and returns [`MsgStoreError::Failed`].
    pub fn close(mut self) -> Result<(), MsgStoreError> {
        self.sync()?;
        super::recovery::save_clean(&self.disk, &self.dir, &self.index)
    }

    /// The path of data file `file`.
    pub(super) fn file_path(&self, file: u64) -> PathBuf {
        self.dir.join(file_name(file))
    }

    fn check(&self) -> Result<(), MsgStoreError> {
        if self.failed {
            return Err(MsgStoreError::Failed);
        }
        Ok(())
    }

    /// The bytes of `file`'s live `records` (sorted by offset), as (offset, bytes) chunks in
    /// offset order. A file that is mostly garbage is read record by record, adjacent ones
    /// together: a compaction behind a consumer that keeps up finds a few live records in a
    /// large file, and reading it whole re-read everything the store wrote (from the device
    /// once its writes skip the page cache). A mostly live file is read whole.
    fn read_live(
        &self,
        path: &Path,
        file: u64,
        records: &[(MsgId, Location)],
    ) -> Result<Vec<(u64, Vec<u8>)>, MsgStoreError> {
        let live: u64 = records.iter().map(|(_, l)| u64::from(l.total_size)).sum();
        let total = self
            .index
            .file_summary(file)
            .map_or(u64::MAX, |s| s.total_bytes);
        if live.saturating_mul(2) >= total {
            return Ok(vec![(0, self.disk.read(path)?)]);
        }
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (_, loc) in records {
            let end = loc.offset + u64::from(loc.total_size);
            match ranges.last_mut() {
                Some((_, last_end)) if *last_end == loc.offset => *last_end = end,
                _ => ranges.push((loc.offset, end)),
            }
        }
        let mut chunks = Vec::with_capacity(ranges.len());
        for (start, end) in ranges {
            let bytes = self.disk.read_at(path, start, (end - start) as usize)?;
            chunks.push((start, bytes));
        }
        Ok(chunks)
    }

    /// Appends one planned batch and commits it to the index.
    fn append_batch(&mut self, batch: &AppendBatch, bytes: &[u8]) -> Result<(), MsgStoreError> {
        let path = self.file_path(batch.file);
        match self.disk.append(&path, bytes) {
            Ok(at) if at == batch.start => {}
            Ok(actual) => {
                self.failed = true;
                return Err(MsgStoreError::Misplaced {
                    path,
                    expected: batch.start,
                    actual,
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "append failed; cutting the partial batch");
                if !self.cut_back(&path, batch.start) {
                    tracing::error!(path = %path.display(), "cannot cut a partial append; store stopped");
                    self.failed = true;
                }
                return Err(e.into());
            }
        }
        self.unsynced.insert(batch.file);
        self.dir_unsynced |= batch.new_file;
        self.index.commit_append(batch);
        Ok(())
    }

    /// Cuts `path` back to `len` bytes after a failed append; true when it is that long (or
    /// absent, for a new file) afterwards.
    fn cut_back(&self, path: &Path, len: u64) -> bool {
        if self.disk.truncate(path, len).is_ok() {
            return true;
        }
        match self.disk.len(path) {
            Ok(Some(now)) => now == len,
            Ok(None) => len == 0,
            Err(_) => false,
        }
    }

    /// Fsyncs the files appended to since the last sync, then the folder if needed.
    fn sync_written(&mut self) -> Result<(), MsgStoreError> {
        self.check()?;
        let files = std::mem::take(&mut self.unsynced);
        for file in files {
            if let Err(e) = self.disk.sync(&self.file_path(file)) {
                tracing::error!(error = %e, file, "fsync failed; store stopped");
                self.failed = true;
                return Err(e.into());
            }
        }
        if self.dir_unsynced {
            if let Err(e) = self.disk.sync_dir(&self.dir) {
                tracing::error!(error = %e, "folder fsync failed; store stopped");
                self.failed = true;
                return Err(e.into());
            }
            self.dir_unsynced = false;
        }
        Ok(())
    }
}

/// The bytes at `loc` within `chunks` (from [`MsgStore::read_live`]), if a chunk holds all of
/// them (a file shorter than the index says leaves a record out).
fn slice_of<'a>(chunks: &'a [(u64, Vec<u8>)], loc: &Location) -> Option<&'a [u8]> {
    let i = chunks.partition_point(|(start, _)| *start <= loc.offset);
    let (start, bytes) = chunks.get(i.checked_sub(1)?)?;
    let from = usize::try_from(loc.offset - start).ok()?;
    bytes.get(from..from.checked_add(loc.total_size as usize)?)
}

//! [`QueueIndex`]: the I/O shell that carries out what [`IndexState`] decides, through a
//! [`Disk`]. Records are buffered in RAM and reach the journal file at `sync`, at a flush, or
//! when the buffer grows past [`WRITE_BUFFER`] (RabbitMQ's file handle cache does the same):
//! nothing is durable before a sync anyway, and one append per batch saves syscalls.
//!
//! [`QueueIndex::close`] leaves `clean.summary` (see [`super::summary`]) and then `clean.dot`,
//! so the next open can skip reading the segments.

use std::path::{Path, PathBuf};

use crate::store::disk::{Disk, DiskError};

use super::codec::{self, CleanMarker};
use super::state::{IndexState, Tally};
use super::summary::{self, Header};
use super::{
    segment_number, segment_path, IndexConfig, IndexEntry, Publish, QueueIndexError, CLEAN_FILE,
    JOURNAL_FILE, SUMMARY_FILE,
};

/// Journal bytes buffered before they are written without waiting for a sync.
pub const WRITE_BUFFER: usize = 64 * 1024;

/// Counters, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Journal flushes done (each one makes every earlier record durable).
    pub flushes: u64,
    /// Journal fsyncs done by [`QueueIndex::sync`].
    pub syncs: u64,
    /// Records in the journal since the last flush.
    pub journal_records: usize,
    /// Segment files.
    pub segment_files: usize,
    /// Un-acked messages.
    pub unacked: u64,
    /// Segments read back with their bodies ([`QueueIndex::read_segment`]).
    pub segment_reads: u64,
}

/// One queue's index over a [`Disk`].
#[derive(Debug)]
pub struct QueueIndex<D: Disk> {
    pub(super) disk: D,
    pub(super) dir: PathBuf,
    pub(super) journal: PathBuf,
    pub(super) config: IndexConfig,
    pub(super) state: IndexState,
    /// Encoded records not yet written to the journal file.
    pub(super) buf: Vec<u8>,
    /// Bytes written to the journal file since its last truncation.
    pub(super) journal_len: u64,
    /// Records were appended since the last journal fsync.
    pub(super) unsynced: bool,
    pub(super) poisoned: bool,
    pub(super) flushes: u64,
    pub(super) syncs: u64,
    /// Counts [`QueueIndex::read_segment`] calls, which take `&self`.
    pub(super) segment_reads: std::sync::atomic::AtomicU64,
}

impl<D: Disk> QueueIndex<D> {
    fn usable(&self) -> Result<(), QueueIndexError> {
        if self.poisoned {
            return Err(QueueIndexError::Poisoned);
        }
        Ok(())
    }

    /// Runs disk work; any failure poisons the index, because what reached the disk (and
    /// what the in-RAM state already assumes) is then unknown.
    fn guarded<T>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<T, DiskError>,
    ) -> Result<T, QueueIndexError> {
        self.usable()?;
        work(self).map_err(|e| {
            self.poisoned = true;
            e.into()
        })
    }

    /// Records a message entering the queue. `p.seq` must be at least the next seq.
    pub fn publish(&mut self, p: Publish) -> Result<(), QueueIndexError> {
        self.usable()?;
        if let Some(body) = &p.embedded {
            if !self.config.embeds(body.len()) {
                return Err(QueueIndexError::EmbedTooLarge {
                    len: body.len(),
                    limit: self.config.embed_below,
                });
            }
        }
        let mark = self.buf.len();
        codec::encode_publish(&mut self.buf, &p);
        if let Err(e) = self.state.publish(p) {
            self.buf.truncate(mark);
            return Err(e.into());
        }
        self.appended()
    }

    /// Records that a message was handed to a consumer (idempotent).
    pub fn deliver(&mut self, seq: u64) -> Result<(), QueueIndexError> {
        self.usable()?;
        if self.state.deliver(seq)? {
            codec::encode_deliver(&mut self.buf, seq);
            self.appended()?;
        }
        Ok(())
    }

    /// Records acks; the whole batch is refused if any seq is not a live message.
    pub fn ack(&mut self, seqs: &[u64]) -> Result<(), QueueIndexError> {
        self.usable()?;
        self.state.ack(seqs)?;
        for &seq in seqs {
            codec::encode_ack(&mut self.buf, seq);
        }
        self.appended()
    }

    fn appended(&mut self) -> Result<(), QueueIndexError> {
        self.unsynced = true;
        if self.buf.len() >= WRITE_BUFFER {
            self.guarded(Self::write_buf)?;
        }
        if self.state.needs_flush(self.config.journal_max_entries) {
            self.flush_journal()?;
        }
        Ok(())
    }

    fn write_buf(&mut self) -> Result<(), DiskError> {
        if !self.buf.is_empty() {
            self.disk.append(&self.journal, &self.buf)?;
            self.journal_len += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }

    /// Makes every record so far durable (one journal fsync; a no-op when nothing changed).
    pub fn sync(&mut self) -> Result<(), QueueIndexError> {
        self.guarded(|ix| {
            if !ix.unsynced {
                return Ok(());
            }
            ix.write_buf()?;
            ix.disk.sync(&ix.journal)?;
            ix.unsynced = false;
            ix.syncs += 1;
            Ok(())
        })
    }

    /// Scatters the journal into the segments and empties it. Afterwards every record so
    /// far is durable.
    pub fn flush_journal(&mut self) -> Result<(), QueueIndexError> {
        self.guarded(Self::flush)
    }

    /// The flush, in crash-safe order: segments are appended and fsynced and fully acked
    /// ones removed, the folder synced, and only then is the journal truncated (and that
    /// truncation fsynced, so a later crash cannot bring back records of segments that
    /// have since been deleted).
    pub(super) fn flush(&mut self) -> Result<(), DiskError> {
        let plan = self.state.take_flush();
        let mut bytes = Vec::new();
        let mut created = false;
        for w in &plan.writes {
            bytes.clear();
            for r in &w.records {
                codec::encode_record(&mut bytes, r);
            }
            self.disk
                .append(&segment_path(&self.dir, w.segment), &bytes)?;
            created |= w.creates;
        }
        for w in &plan.writes {
            self.disk.sync(&segment_path(&self.dir, w.segment))?;
        }
        for n in &plan.deletes {
            self.disk.remove(&segment_path(&self.dir, *n))?;
        }
        if created || !plan.deletes.is_empty() {
            self.disk.sync_dir(&self.dir)?;
        }
        self.buf.clear();
        if self.journal_len > 0 {
            self.disk.truncate(&self.journal, 0)?;
            self.disk.sync(&self.journal)?;
            self.journal_len = 0;
        }
        self.unsynced = false;
        self.flushes += 1;
        Ok(())
    }

    /// The un-acked messages of segment `n`, in seq order, read back for paging.
    pub fn read_segment(&self, n: u64) -> Result<Vec<IndexEntry>, QueueIndexError> {
        self.usable()?;
        let Some(summary) = self.state.segment(n) else {
            return Ok(Vec::new());
        };
        self.segment_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let read = read_live(&self.disk, &self.dir, &self.state, n)?;
        if (read.entries.len() as u64) < summary.unacked() {
            // The file was damaged after open; recovery will report and repair it.
            tracing::warn!(
                dir = %self.dir.display(),
                segment = n,
                missing = summary.unacked() - read.entries.len() as u64,
                "queue index segment lacks entries"
            );
        }
        Ok(read.entries)
    }

    /// [`QueueIndex::read_segment`] without the embedded bodies: an entry whose body is in
    /// the index has an empty `embedded` (a sync's digest needs seqs, ids and sizes only).
    pub fn read_segment_light(&self, n: u64) -> Result<Vec<IndexEntry>, QueueIndexError> {
        self.usable()?;
        Ok(read_live_by(&self.disk, &self.dir, &self.state, n, codec::scan_light)?.entries)
    }

    /// Segments holding un-acked messages, in order (what to page through).
    pub fn segments(&self) -> Vec<u64> {
        self.state.live_segments()
    }

    /// `(lowest un-acked seq, next seq)`; the low bound equals the next seq when empty.
    pub fn bounds(&self) -> (u64, u64) {
        (self.state.low_seq(), self.state.next_seq())
    }

    /// Whether `seq` was published here and not acked.
    pub fn holds(&self, seq: u64) -> bool {
        self.state.is_live(seq)
    }

    /// Whether a deliver was recorded for `seq`.
    pub fn delivered(&self, seq: u64) -> bool {
        self.state.is_delivered(seq)
    }

    /// Un-acked messages.
    pub fn len(&self) -> u64 {
        self.state.unacked()
    }

    /// No un-acked message.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The configuration in force (its segment size is the folder's, see `index.meta`).
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// The queue's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Counters.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            flushes: self.flushes,
            syncs: self.syncs,
            journal_records: self.state.journal_records(),
            segment_files: self.state.segments_on_disk(),
            unacked: self.state.unacked(),
            segment_reads: self
                .segment_reads
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Clean shutdown: flushes the journal, writes `clean.summary` (fsynced, and its name
    /// made durable) and only then `clean.dot` with the next seq and the message count, so
    /// the marker implies a complete summary. A segment whose tally an ack dropped is read
    /// back to tally it again; if that fails the summary is left out (the next open scans).
    pub fn close(mut self) -> Result<(), QueueIndexError> {
        self.guarded(|ix| {
            ix.flush()?;
            if let Some(bytes) = ix.clean_summary() {
                let path = ix.dir.join(SUMMARY_FILE);
                ix.disk.write_file(&path, &bytes)?;
                ix.disk.sync(&path)?;
                ix.disk.sync_dir(&ix.dir)?;
            }
            let marker = CleanMarker {
                next_seq: ix.state.next_seq(),
                unacked: ix.state.unacked(),
            };
            let path = ix.dir.join(CLEAN_FILE);
            ix.disk.write_file(&path, &codec::encode_clean(marker))?;
            ix.disk.sync(&path)?;
            ix.disk.sync_dir(&ix.dir)
        })
    }

    /// The bytes of `clean.summary` for the state as it is after the close's flush (nothing
    /// pending, every segment on disk and live); `None` when a segment cannot be summed up.
    fn clean_summary(&self) -> Option<Vec<u8>> {
        let e = self.config.segment_entry_count;
        let header = Header {
            entries_per_segment: e,
            next_seq: self.state.next_seq(),
            unacked: self.state.unacked(),
            segments: self.state.segments().count() as u64,
        };
        let mut out = Vec::new();
        summary::encode_header(&mut out, &header);
        for (n, s) in self.state.segments() {
            if !s.on_disk || s.unacked() == 0 {
                // Not after a flush; but the open would refuse such a summary.
                return None;
            }
            let redone;
            let tally = match s.tally() {
                Some(t) => t,
                None => {
                    let read = read_live(&self.disk, &self.dir, &self.state, n);
                    match read {
                        Ok(r) if r.entries.len() as u64 == s.unacked() => {
                            redone = Tally::of(r.entries.iter().map(|x| &x.publish));
                            &redone
                        }
                        other => {
                            tracing::warn!(
                                dir = %self.dir.display(),
                                segment = n,
                                error = ?other.err(),
                                "queue index segment unreadable at close; no clean summary"
                            );
                            return None;
                        }
                    }
                }
            };
            summary::encode_segment(&mut out, e, n, s, tally);
        }
        Some(out)
    }

    /// The queue was deleted: removes every index file (allowed even when poisoned). The
    /// folder itself stays: the `Disk` trait has no way to remove folders.
    pub fn delete_all(self) -> Result<(), QueueIndexError> {
        for name in self.disk.list(&self.dir)? {
            let ours = segment_number(&name).is_some()
                || super::is_segment_tmp(&name)
                || [JOURNAL_FILE, CLEAN_FILE, SUMMARY_FILE, super::META_FILE]
                    .contains(&name.as_str());
            if ours {
                self.disk.remove(&self.dir.join(name))?;
            }
        }
        self.disk.sync_dir(&self.dir)?;
        Ok(())
    }
}

/// What [`read_live`] found in a segment.
#[derive(Debug)]
pub(super) struct SegmentRead {
    /// The live entries, in seq order.
    pub(super) entries: Vec<IndexEntry>,
    /// The file had unreadable bytes or records of seqs outside the segment.
    pub(super) damaged: bool,
    /// Publish records read from the file.
    pub(super) publishes: usize,
}

/// The live messages of segment `n` as `state` sees them: the publishes of its file and the
/// pending ones, kept when `state` says they are live. Used to page ([`QueueIndex::read_segment`]),
/// to read the head at a clean open and to tally a segment at a clean close.
pub(super) fn read_live<D: Disk>(
    disk: &D,
    dir: &Path,
    state: &IndexState,
    n: u64,
) -> Result<SegmentRead, DiskError> {
    read_live_by(disk, dir, state, n, codec::scan)
}

fn read_live_by<D: Disk>(
    disk: &D,
    dir: &Path,
    state: &IndexState,
    n: u64,
    scan: fn(&[u8]) -> codec::Scan,
) -> Result<SegmentRead, DiskError> {
    let mut read = SegmentRead {
        entries: Vec::new(),
        damaged: false,
        publishes: 0,
    };
    let Some(summary) = state.segment(n) else {
        return Ok(read);
    };
    // Live publishes in the order found: the file's (in seq order unless a crashed flush
    // appended some twice), then the journal's pending ones.
    let mut found = Vec::new();
    if summary.on_disk {
        let scan = scan(&disk.read_view(&segment_path(dir, n))?);
        read.damaged = !scan.skipped.is_empty();
        for r in scan.records {
            if state.segment_of(r.seq()) != n {
                read.damaged = true;
            } else if let codec::Record::Publish(p) = r {
                read.publishes += 1;
                if state.is_live(p.seq) {
                    found.push(p);
                }
            }
        }
    }
    found.extend(
        state
            .pending_publishes(n)
            .filter(|p| state.is_live(p.seq))
            .cloned(),
    );
    // One entry per seq, the last found winning (a pending publish over the file's): a
    // stable sort keeps the finding order among equal seqs. Already sorted is linear.
    found.sort_by_key(|p| p.seq);
    let mut entries: Vec<IndexEntry> = Vec::with_capacity(found.len());
    for publish in found {
        let entry = IndexEntry {
            delivered: state.is_delivered(publish.seq),
            publish,
        };
        match entries.last_mut() {
            Some(last) if last.publish.seq == entry.publish.seq => *last = entry,
            _ => entries.push(entry),
        }
    }
    read.entries = entries;
    Ok(read)
}

//! [`StoreIndex`]: the message store's bookkeeping, free of I/O.
//!
//! It answers the questions the driver asks before and after touching the disk: is this write
//! a duplicate, where does the next batch of appends go (and does it roll over to a new file),
//! what became garbage, which files are worth compacting. The driver carries out the I/O and
//! reports back with [`StoreIndex::commit_append`]; a batch whose append failed is simply not
//! committed, so the index never points at bytes that were not written.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::MsgId;

/// Where a message's record is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// File number.
    pub file: u64,
    /// Offset of the record's framing in the file.
    pub offset: u64,
    /// Bytes of the whole record (framing, id, body).
    pub total_size: u32,
}

/// Where a message's bytes are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// In the write-back cache, not yet appended; `seq` orders the pending writes.
    Pending {
        /// Write order.
        seq: u64,
        /// Bytes its record will take.
        total_size: u32,
    },
    /// Appended to a file.
    Stored(Location),
}

/// One live message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// Writes not yet matched by removes; always at least 1 (an entry at 0 is dropped).
    pub ref_count: u32,
    /// Where its bytes are.
    pub slot: Slot,
}

/// Space accounting of one file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileSummary {
    /// Bytes of records still referenced.
    pub valid_bytes: u64,
    /// Length of the file.
    pub total_bytes: u64,
}

impl FileSummary {
    /// The share of the file nobody references any more (0 for an empty file).
    pub fn garbage_fraction(&self) -> f64 {
        if self.total_bytes == 0 {
            return 0.0;
        }
        1.0 - self.valid_bytes as f64 / self.total_bytes as f64
    }
}

/// What a write needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteDecision {
    /// The id is already stored or pending: only its count went up.
    Dedup {
        /// The new count.
        ref_count: u32,
    },
    /// New: its bytes go into the write-back cache, to be appended at the next flush.
    Buffer,
}

/// What a remove did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Removed {
    /// The id was not in the store.
    Unknown,
    /// Other references remain.
    Decremented {
        /// The new count.
        ref_count: u32,
    },
    /// The last reference went before the write was flushed: nothing reaches the disk.
    Cancelled,
    /// The last reference went: the record in `file` is now garbage.
    Garbage {
        /// The file holding the record.
        file: u64,
        /// That file's garbage share now.
        garbage_fraction: f64,
    },
}

/// One record placed by [`StoreIndex::plan_append`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// The message.
    pub id: MsgId,
    /// Where its record starts.
    pub offset: u64,
    /// Bytes of the record.
    pub total_size: u32,
}

/// Records to append to one file in one go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendBatch {
    /// File number.
    pub file: u64,
    /// The file's length before the append: where the first record lands.
    pub start: u64,
    /// The file does not exist yet (its name needs a folder sync to be durable).
    pub new_file: bool,
    /// The records, in order, back to back from `start`.
    pub records: Vec<Placed>,
}

impl AppendBatch {
    /// Bytes of the whole batch.
    pub fn len(&self) -> u64 {
        self.records.iter().map(|r| u64::from(r.total_size)).sum()
    }

    /// True when the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// Outcome of [`StoreIndex::set_ref_counts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RefCountReport {
    /// Stored ids nobody references: dropped (their bytes are garbage). Sorted.
    pub dropped: Vec<MsgId>,
    /// Referenced ids the store does not have (lost in a crash before their sync). Sorted.
    pub missing: Vec<MsgId>,
}

/// The index: id → entry, file summaries, the pending-write queue and the append position.
#[derive(Debug, Clone)]
pub struct StoreIndex {
    entries: HashMap<MsgId, IndexEntry>,
    /// Ordered, so candidates and listings come out sorted.
    files: BTreeMap<u64, FileSummary>,
    /// The file appends go to: always the highest-numbered one.
    current_file: u64,
    /// Pending writes in write order (seq → id); removal cancels in O(log n).
    pending: BTreeMap<u64, MsgId>,
    next_seq: u64,
    pending_bytes: u64,
    file_size_limit: u64,
}

impl StoreIndex {
    /// An empty index; the first append creates file 0.
    pub fn new(file_size_limit: u64) -> StoreIndex {
        StoreIndex {
            entries: HashMap::new(),
            files: BTreeMap::new(),
            current_file: 0,
            pending: BTreeMap::new(),
            next_seq: 0,
            pending_bytes: 0,
            file_size_limit: file_size_limit.max(1),
        }
    }

    /// Records a write of `id` whose record takes `total_size` bytes.
    pub fn write(&mut self, id: MsgId, total_size: u32) -> WriteDecision {
        if let Some(e) = self.entries.get_mut(&id) {
            e.ref_count = e.ref_count.saturating_add(1);
            return WriteDecision::Dedup {
                ref_count: e.ref_count,
            };
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.insert(seq, id);
        self.pending_bytes += u64::from(total_size);
        let slot = Slot::Pending { seq, total_size };
        self.entries.insert(id, IndexEntry { ref_count: 1, slot });
        WriteDecision::Buffer
    }

    /// Drops one reference to `id`.
    pub fn remove(&mut self, id: MsgId) -> Removed {
        match self.entries.get_mut(&id) {
            None => Removed::Unknown,
            Some(e) if e.ref_count > 1 => {
                e.ref_count -= 1;
                Removed::Decremented {
                    ref_count: e.ref_count,
                }
            }
            Some(_) => self.drop_entry(id),
        }
    }

    /// Forgets `id` whatever its count (an unreferenced or unreadable message).
    pub fn drop_entry(&mut self, id: MsgId) -> Removed {
        let Some(e) = self.entries.remove(&id) else {
            return Removed::Unknown;
        };
        match e.slot {
            Slot::Pending { seq, total_size } => {
                self.pending.remove(&seq);
                self.pending_bytes -= u64::from(total_size);
                Removed::Cancelled
            }
            Slot::Stored(loc) => {
                let s = self.files.entry(loc.file).or_default();
                s.valid_bytes = s.valid_bytes.saturating_sub(u64::from(loc.total_size));
                Removed::Garbage {
                    file: loc.file,
                    garbage_fraction: s.garbage_fraction(),
                }
            }
        }
    }

    /// Replaces every count with the caller's (after a dirty recovery, the queue indexes know
    /// who references what). Counts given twice for one id add up; ids given no positive
    /// count are dropped.
    pub fn set_ref_counts(
        &mut self,
        counts: impl IntoIterator<Item = (MsgId, u32)>,
    ) -> RefCountReport {
        let mut wanted: HashMap<MsgId, u32> = HashMap::new();
        for (id, n) in counts {
            let c = wanted.entry(id).or_insert(0);
            *c = c.saturating_add(n);
        }
        let mut dropped: Vec<MsgId> = self
            .entries
            .keys()
            .filter(|id| wanted.get(id).copied().unwrap_or(0) == 0)
            .copied()
            .collect();
        dropped.sort_unstable();
        for id in &dropped {
            self.drop_entry(*id);
        }
        let mut missing = Vec::new();
        for (id, n) in wanted {
            match self.entries.get_mut(&id) {
                Some(e) => e.ref_count = n,
                None if n > 0 => missing.push(id),
                None => {}
            }
        }
        missing.sort_unstable();
        RefCountReport { dropped, missing }
    }

    /// The entry of `id`.
    pub fn entry(&self, id: &MsgId) -> Option<&IndexEntry> {
        self.entries.get(id)
    }

    /// The count of `id` (0 when absent).
    pub fn ref_count(&self, id: &MsgId) -> u32 {
        self.entries.get(id).map_or(0, |e| e.ref_count)
    }

    /// Live messages.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no message is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pending writes in write order, with their record sizes.
    pub fn pending(&self) -> Vec<(MsgId, u32)> {
        let size = |id: &MsgId| match self.entries.get(id).map(|e| e.slot) {
            Some(Slot::Pending { total_size, .. }) => total_size,
            // A pending id always has a pending entry (drop_entry removes both together).
            other => unreachable!("pending {id} has slot {other:?}"),
        };
        self.pending.values().map(|id| (*id, size(id))).collect()
    }

    /// Bytes of pending records.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// The file appends go to.
    pub fn current_file(&self) -> u64 {
        self.current_file
    }

    /// The current file's length.
    pub fn current_len(&self) -> u64 {
        self.files
            .get(&self.current_file)
            .map_or(0, |s| s.total_bytes)
    }

    /// The summary of `file`.
    pub fn file_summary(&self, file: u64) -> Option<FileSummary> {
        self.files.get(&file).copied()
    }

    /// Every known file, ascending.
    pub fn files(&self) -> impl Iterator<Item = (u64, FileSummary)> + '_ {
        self.files.iter().map(|(f, s)| (*f, *s))
    }

    /// Places `records` (id, record size) after the current end, rolling over to a new file
    /// before a record that would take a non-empty file past the size limit. Changes nothing:
    /// commit each batch once its bytes are appended.
    pub fn plan_append(&self, records: &[(MsgId, u32)]) -> Vec<AppendBatch> {
        let mut batches = Vec::new();
        let mut cur = AppendBatch {
            file: self.current_file,
            start: self.current_len(),
            new_file: !self.files.contains_key(&self.current_file),
            records: Vec::new(),
        };
        let mut len = cur.start;
        for &(id, total_size) in records {
            if len > 0 && len + u64::from(total_size) > self.file_size_limit {
                let file = cur.file + 1;
                let full = std::mem::replace(
                    &mut cur,
                    AppendBatch {
                        file,
                        start: 0,
                        new_file: true,
                        records: Vec::new(),
                    },
                );
                if !full.is_empty() {
                    batches.push(full);
                }
                len = 0;
            }
            cur.records.push(Placed {
                id,
                offset: len,
                total_size,
            });
            len += u64::from(total_size);
        }
        if !cur.is_empty() {
            batches.push(cur);
        }
        batches
    }

    /// Records that `batch` is on disk: pending entries become stored, stored ones (copied by
    /// compaction) move, and the file grows.
    pub fn commit_append(&mut self, batch: &AppendBatch) {
        let summary = self.files.entry(batch.file).or_default();
        assert_eq!(
            summary.total_bytes, batch.start,
            "batch for file {} planned at {} but the file is {} bytes",
            batch.file, batch.start, summary.total_bytes
        );
        summary.total_bytes += batch.len();
        self.current_file = self.current_file.max(batch.file);
        for p in &batch.records {
            let Some(e) = self.entries.get_mut(&p.id) else {
                // Removed since the plan: the record went to disk as garbage.
                continue;
            };
            let new = Location {
                file: batch.file,
                offset: p.offset,
                total_size: p.total_size,
            };
            match std::mem::replace(&mut e.slot, Slot::Stored(new)) {
                Slot::Pending { seq, total_size } => {
                    self.pending.remove(&seq);
                    self.pending_bytes -= u64::from(total_size);
                }
                Slot::Stored(old) => {
                    let s = self.files.entry(old.file).or_default();
                    s.valid_bytes = s.valid_bytes.saturating_sub(u64::from(old.total_size));
                }
            }
            self.files.entry(batch.file).or_default().valid_bytes += u64::from(p.total_size);
        }
    }

    /// Non-current files that are empty of live records or more than `threshold` garbage,
    /// ascending.
    pub fn compaction_candidates(&self, threshold: f64) -> Vec<u64> {
        self.files
            .iter()
            .filter(|(f, s)| {
                **f != self.current_file && (s.valid_bytes == 0 || s.garbage_fraction() > threshold)
            })
            .map(|(f, _)| *f)
            .collect()
    }

    /// The live records of each of `files`, by offset. One pass over the index.
    pub fn live_records(&self, files: &[u64]) -> BTreeMap<u64, Vec<(MsgId, Location)>> {
        let wanted: BTreeSet<u64> = files.iter().copied().collect();
        let mut out: BTreeMap<u64, Vec<(MsgId, Location)>> =
            files.iter().map(|f| (*f, Vec::new())).collect();
        for (id, e) in &self.entries {
            if let Slot::Stored(loc) = e.slot {
                if wanted.contains(&loc.file) {
                    out.entry(loc.file).or_default().push((*id, loc));
                }
            }
        }
        for recs in out.values_mut() {
            recs.sort_unstable_by_key(|(_, loc)| loc.offset);
        }
        out
    }

    /// Forgets a file that holds no live record (it was deleted). Returns its summary.
    pub fn forget_file(&mut self, file: u64) -> Option<FileSummary> {
        let s = self.files.get(&file)?;
        assert_eq!(s.valid_bytes, 0, "forgetting file {file} with live records");
        assert_ne!(file, self.current_file, "forgetting the current file");
        self.files.remove(&file)
    }

    /// Registers a file found on disk with `total_bytes` bytes (recovery). It becomes current
    /// if it is the highest-numbered so far.
    pub fn add_file(&mut self, file: u64, total_bytes: u64) {
        self.files.entry(file).or_default().total_bytes = total_bytes;
        self.current_file = self.current_file.max(file);
    }

    /// Makes `file` current if it is above every known one (a saved index may name a current
    /// file that was never created).
    pub fn raise_current(&mut self, file: u64) {
        self.current_file = self.current_file.max(file);
    }

    /// Indexes a record found on disk (recovery). False, leaving it as garbage, when the id is
    /// already indexed: an interrupted compaction leaves two identical copies.
    pub fn insert_stored(&mut self, id: MsgId, ref_count: u32, loc: Location) -> bool {
        if self.entries.contains_key(&id) || ref_count == 0 {
            return false;
        }
        let slot = Slot::Stored(loc);
        self.entries.insert(id, IndexEntry { ref_count, slot });
        self.files.entry(loc.file).or_default().valid_bytes += u64::from(loc.total_size);
        true
    }

    /// Every stored entry as (id, count, location), by file and offset: deterministic output
    /// for the saved index.
    pub fn snapshot(&self) -> Vec<(MsgId, u32, Location)> {
        let mut out: Vec<(MsgId, u32, Location)> = self
            .entries
            .iter()
            .filter_map(|(id, e)| match e.slot {
                Slot::Stored(loc) => Some((*id, e.ref_count, loc)),
                Slot::Pending { .. } => None,
            })
            .collect();
        out.sort_unstable_by_key(|(_, _, loc)| (loc.file, loc.offset));
        out
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;

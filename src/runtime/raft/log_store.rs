//! [`LogStore`]: openraft's log storage (v2) on a [`Disk`].
//!
//! Files in the node's Raft folder:
//! - `log-<first index, 20 digits>`: segments of framed bincode entries, appended in order. A
//!   segment rolls over past `segment_bytes`, so purging removes whole files.
//! - `vote`, `purged`: replaced atomically and fsynced before the call returns.
//! - `committed`: a hint written without fsync; losing it only means the node re-applies
//!   fewer entries at start-up and waits for the leader to repeat the commit index.
//!
//! Every entry is fsynced before openraft's append callback runs, so an acknowledged entry
//! survives a crash. On open, a torn tail of the last segment (a crash mid-append) is cut; a
//! damaged record anywhere else, or a gap in the indexes, means acknowledged data was lost
//! and opening fails rather than let the node vote with a log it does not have.
//!
//! The entries also stay in memory (metadata logs are small and purged after each snapshot),
//! so readers never touch the disk. Disk calls are blocking and run inline: metadata writes
//! are rare, and the simulation needs them to happen within the calling task.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    Entry, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogReader, StorageError,
    StorageIOError, Vote,
};

use super::persist::{self, PersistError};
use super::types::{NodeId, TypeConfig};
use crate::store::{record, Disk};

const SEGMENT_PREFIX: &str = "log-";
const VOTE: &str = "vote";
const PURGED: &str = "purged";
const COMMITTED: &str = "committed";

fn segment_name(first: u64) -> String {
    format!("{SEGMENT_PREFIX}{first:020}")
}

/// An entry and where it sits on disk.
#[derive(Clone)]
struct Stored {
    entry: Entry<TypeConfig>,
    /// First index of the segment holding it.
    segment: u64,
    /// Offset of its record in that segment.
    offset: u64,
}

struct Files {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    segment_bytes: u64,
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
    last_purged: Option<LogId<NodeId>>,
    entries: BTreeMap<u64, Stored>,
    /// Segment first index → its length in bytes.
    segments: BTreeMap<u64, u64>,
}

/// The Raft log of one node. Clones share the same files (the clone is the log reader).
#[derive(Clone)]
pub struct LogStore {
    files: Arc<Mutex<Files>>,
}

fn io_err(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: PersistError) -> StorageError<NodeId> {
    StorageIOError::new(subject, verb, &e).into()
}

impl LogStore {
    /// Opens (or creates) the log in `dir`, recovering from a crash as described above.
    pub fn open(
        disk: Arc<dyn Disk>,
        dir: &Path,
        segment_bytes: u64,
    ) -> Result<LogStore, PersistError> {
        disk.create_dir_all(dir)?;
        let vote = persist::read_durable(&*disk, dir, VOTE, "vote")?;
        let last_purged: Option<LogId<NodeId>> =
            persist::read_durable(&*disk, dir, PURGED, "purged")?;
        // Stored as written by save_committed: an Option, itself inside read_hint's Option.
        let committed: Option<Option<LogId<NodeId>>> =
            persist::read_hint(&*disk, dir, COMMITTED, "committed")?;
        let mut files = Files {
            disk,
            dir: dir.to_path_buf(),
            segment_bytes: segment_bytes.max(1),
            vote,
            committed: committed.flatten(),
            last_purged,
            entries: BTreeMap::new(),
            segments: BTreeMap::new(),
        };
        files.load_segments()?;
        Ok(LogStore {
            files: Arc::new(Mutex::new(files)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Files> {
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Files {
    fn path(&self, first: u64) -> PathBuf {
        self.dir.join(segment_name(first))
    }

    fn load_segments(&mut self) -> Result<(), PersistError> {
        let mut names: Vec<u64> = self
            .disk
            .list(&self.dir)?
            .iter()
            .filter_map(|n| n.strip_prefix(SEGMENT_PREFIX)?.parse().ok())
            .collect();
        names.sort_unstable();
        let purged_upto = self.last_purged.map(|l| l.index);
        let mut expected = purged_upto.map(|i| i + 1);
        let mut leftovers = Vec::new();
        for (n, &first) in names.iter().enumerate() {
            let path = self.path(first);
            let bytes = self.disk.read(&path)?;
            let (found, valid) = record::scan(&bytes);
            if valid < bytes.len() {
                if n + 1 < names.len() {
                    return Err(PersistError::Corrupt {
                        path,
                        reason: format!("damaged record at byte {valid} before the last segment"),
                    });
                }
                // A crash during an append: nothing past `valid` was acknowledged.
                tracing::warn!(segment = %path.display(), valid, len = bytes.len(), "cutting a torn log tail");
                self.disk.truncate(&path, valid as u64)?;
                self.disk.sync(&path)?;
            }
            let mut live = false;
            for r in found {
                let entry: Entry<TypeConfig> = persist::decode("log entry", &path, r.payload)?;
                let index = entry.log_id.index;
                if purged_upto.is_some_and(|p| index <= p) {
                    // Left over from a purge interrupted before it removed this segment.
                    continue;
                }
                if expected.is_some_and(|e| e != index) {
                    return Err(PersistError::Corrupt {
                        path,
                        reason: format!("log index {index} found where {expected:?} was expected"),
                    });
                }
                expected = Some(index + 1);
                live = true;
                let stored = Stored {
                    entry,
                    segment: first,
                    offset: r.offset as u64,
                };
                self.entries.insert(index, stored);
            }
            if live {
                self.segments.insert(first, valid as u64);
            } else {
                leftovers.push(path);
            }
        }
        // Fully purged or empty segments: remove them so the next append starts a segment
        // named after its own first index.
        for path in &leftovers {
            self.disk.remove(path)?;
        }
        if !leftovers.is_empty() {
            self.disk.sync_dir(&self.dir)?;
        }
        Ok(())
    }

    fn last_log_id(&self) -> Option<LogId<NodeId>> {
        self.entries
            .values()
            .next_back()
            .map(|s| s.entry.log_id)
            .or(self.last_purged)
    }

    fn append(&mut self, entries: Vec<Entry<TypeConfig>>) -> Result<(), PersistError> {
        let mut current = self.segments.iter().next_back().map(|(&f, &len)| (f, len));
        let mut created = false;
        let mut stored = Vec::with_capacity(entries.len());
        for entry in entries {
            let bytes = persist::frame(&persist::encode("log entry", &entry)?);
            let first = match current {
                Some((first, len)) if len < self.segment_bytes => first,
                full => {
                    // Make the full segment durable before a later one exists, so a crash can
                    // never keep the later segment and lose the end of this one.
                    if let Some((first, _)) = full {
                        self.disk.sync(&self.path(first))?;
                    }
                    created = true;
                    entry.log_id.index
                }
            };
            // The disk's offset, not our tracked length, locates the record.
            let offset = self.disk.append(&self.path(first), &bytes)?;
            let len = offset + bytes.len() as u64;
            current = Some((first, len));
            self.segments.insert(first, len);
            stored.push(Stored {
                entry,
                segment: first,
                offset,
            });
        }
        if let Some((first, _)) = current {
            self.disk.sync(&self.path(first))?;
        }
        if created {
            self.disk.sync_dir(&self.dir)?;
        }
        for s in stored {
            self.entries.insert(s.entry.log_id.index, s);
        }
        Ok(())
    }

    fn truncate(&mut self, index: u64) -> Result<(), PersistError> {
        // Later segments go first: a crash in between leaves a log that still ends with some
        // of the doomed (never committed) entries, never a log with a hole.
        let doomed: Vec<u64> = self.segments.range(index..).map(|(&f, _)| f).collect();
        for &first in &doomed {
            self.disk.remove(&self.path(first))?;
            self.segments.remove(&first);
        }
        if !doomed.is_empty() {
            self.disk.sync_dir(&self.dir)?;
        }
        if let Some(s) = self.entries.get(&index) {
            if self.segments.contains_key(&s.segment) {
                let (first, offset) = (s.segment, s.offset);
                let path = self.path(first);
                self.disk.truncate(&path, offset)?;
                self.disk.sync(&path)?;
                self.segments.insert(first, offset);
            }
        }
        self.entries.split_off(&index);
        Ok(())
    }

    fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), PersistError> {
        // Record the purge point first: segments that survive a crash below it are skipped
        // on open.
        persist::write_durable(&*self.disk, &self.dir, PURGED, "purged", &log_id)?;
        self.last_purged = Some(log_id);
        self.entries = self.entries.split_off(&(log_id.index + 1));
        let keep = self.entries.values().next().map(|s| s.segment);
        let doomed: Vec<u64> = self
            .segments
            .keys()
            .copied()
            .filter(|&f| keep.is_none_or(|k| f < k))
            .collect();
        for &first in &doomed {
            self.disk.remove(&self.path(first))?;
            self.segments.remove(&first);
        }
        if !doomed.is_empty() {
            self.disk.sync_dir(&self.dir)?;
        }
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let files = self.lock();
        Ok(files
            .entries
            .range(range)
            .map(|(_, s)| s.entry.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let files = self.lock();
        Ok(LogState {
            last_purged_log_id: files.last_purged,
            last_log_id: files.last_log_id(),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut files = self.lock();
        persist::write_durable(&*files.disk, &files.dir, VOTE, "vote", vote)
            .map_err(|e| io_err(ErrorSubject::Vote, ErrorVerb::Write, e))?;
        files.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        let mut files = self.lock();
        persist::write_hint(&*files.disk, &files.dir, COMMITTED, "committed", &committed)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))?;
        files.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<_> = entries.into_iter().collect();
        self.lock()
            .append(entries)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, e))?;
        // Only now is every entry fsynced; openraft may count them towards a quorum.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.lock()
            .truncate(log_id.index)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.lock()
            .purge(log_id)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}

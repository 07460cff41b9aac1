//! Opening a store: wipe it (transient store), trust a clean shutdown's saved index, or scan
//! every file; and saving the index at clean shutdown.
//!
//! The clean marker and the saved index are deleted (durably) as soon as `open` has read them:
//! the saved index goes stale with the first change, so a crash from then on must lead to a
//! scan. A scan cuts each file at its first torn or corrupt record and reports it; damage never
//! makes `open` fail (I/O errors do). After a scan every message found has one reference; the
//! owner then sets the real counts with [`MsgStore::set_ref_counts`] or
//! [`MsgStore::retain_only`], which drop what no queue references.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::store::disk::{Disk, DiskError};
use crate::store::record::{self, RECORD_OVERHEAD};

use super::saved::{decode_index, encode_index, encode_marker, marker_matches};
use super::{
    parse_file_name, Location, MsgId, MsgStore, MsgStoreConfig, MsgStoreError, StoreIndex,
    CLEAN_MARKER, SAVED_INDEX, SAVED_INDEX_TMP,
};

/// A file cut during recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedFile {
    /// File number.
    pub file: u64,
    /// Bytes cut from its end (the first bad record and everything after it).
    pub bytes_cut: u64,
    /// Intact records kept before the damage.
    pub records_kept: usize,
}

/// What `open` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// The saved index of a clean shutdown was used; no file was scanned.
    pub clean: bool,
    /// The folder was emptied (`wipe_on_open`).
    pub wiped: bool,
    /// Data files found.
    pub files: usize,
    /// Messages indexed.
    pub messages: usize,
    /// Intact records read by the scan (0 after a clean shutdown).
    pub records_scanned: usize,
    /// Extra copies of a message found by the scan (an interrupted compaction leaves them);
    /// one copy is kept, the others count as garbage.
    pub duplicates: usize,
    /// Files cut at a torn or corrupt record, ascending.
    pub damaged: Vec<DamagedFile>,
    /// Names in the folder that are not the store's, left alone.
    pub ignored: Vec<String>,
}

impl<D: Disk> MsgStore<D> {
    /// Opens (creating, wiping or recovering) the store in `dir`. See the module docs.
    pub fn open(
        disk: D,
        dir: impl AsRef<Path>,
        config: MsgStoreConfig,
    ) -> Result<(MsgStore<D>, RecoveryReport), MsgStoreError> {
        let dir = dir.as_ref().to_path_buf();
        disk.create_dir_all(&dir)?;
        let names = disk.list(&dir)?;
        let mut report = RecoveryReport::default();
        let mut index = StoreIndex::new(config.file_size_limit);
        if config.wipe_on_open {
            for name in &names {
                disk.remove(&dir.join(name))?;
            }
            if !names.is_empty() {
                disk.sync_dir(&dir)?;
            }
            report.wiped = true;
        } else {
            let mut data_files = BTreeMap::new();
            let mut leftovers = Vec::new();
            for name in names {
                match parse_file_name(&name) {
                    Some(n) => {
                        data_files.insert(n, name);
                    }
                    None if [CLEAN_MARKER, SAVED_INDEX, SAVED_INDEX_TMP].contains(&&*name) => {
                        leftovers.push(name)
                    }
                    None => report.ignored.push(name),
                }
            }
            report.files = data_files.len();
            match load_clean(&disk, &dir, &data_files, &leftovers, config.file_size_limit)? {
                Some(saved) => {
                    index = saved;
                    report.clean = true;
                }
                None => scan(&disk, &dir, &data_files, &mut index, &mut report)?,
            }
            for name in &leftovers {
                disk.remove(&dir.join(name))?;
            }
            if !leftovers.is_empty() {
                disk.sync_dir(&dir)?;
            }
        }
        report.messages = index.len();
        tracing::info!(
            dir = %dir.display(),
            clean = report.clean,
            wiped = report.wiped,
            files = report.files,
            messages = report.messages,
            damaged = report.damaged.len(),
            "message store opened"
        );
        let store = MsgStore {
            disk,
            dir,
            config,
            index,
            cache: HashMap::new(),
            unsynced: Default::default(),
            dir_unsynced: false,
            failed: false,
        };
        Ok((store, report))
    }
}

/// The saved index, if a valid marker vouches for it and it agrees with the files on disk.
fn load_clean<D: Disk>(
    disk: &D,
    dir: &Path,
    data_files: &BTreeMap<u64, String>,
    leftovers: &[String],
    file_size_limit: u64,
) -> Result<Option<StoreIndex>, DiskError> {
    if !leftovers.iter().any(|n| n == CLEAN_MARKER) || !leftovers.iter().any(|n| n == SAVED_INDEX) {
        return Ok(None);
    }
    let marker = disk.read(&dir.join(CLEAN_MARKER))?;
    let bytes = disk.read(&dir.join(SAVED_INDEX))?;
    if !marker_matches(&marker, &bytes) {
        tracing::warn!(dir = %dir.display(), "clean marker does not match the saved index; scanning");
        return Ok(None);
    }
    let Some(saved) = decode_index(&bytes) else {
        return Ok(None);
    };
    let mut index = StoreIndex::new(file_size_limit);
    for (&n, name) in data_files {
        index.add_file(n, disk.len(&dir.join(name))?.unwrap_or(0));
    }
    index.raise_current(saved.current_file);
    for (id, ref_count, loc) in saved.entries {
        let fits = index
            .file_summary(loc.file)
            .is_some_and(|s| loc.offset + u64::from(loc.total_size) <= s.total_bytes);
        if !fits || !index.insert_stored(id, ref_count, loc) {
            tracing::warn!(dir = %dir.display(), %id, "saved index disagrees with the files; scanning");
            return Ok(None);
        }
    }
    Ok(Some(index))
}

/// Rebuilds the index from the files, cutting each at its first bad record.
fn scan<D: Disk>(
    disk: &D,
    dir: &Path,
    data_files: &BTreeMap<u64, String>,
    index: &mut StoreIndex,
    report: &mut RecoveryReport,
) -> Result<(), DiskError> {
    for (&n, name) in data_files {
        let path = dir.join(name);
        let data = disk.read(&path)?;
        let (found, mut valid) = record::scan(&data);
        let mut records = Vec::with_capacity(found.len());
        for f in &found {
            let Some(id) = MsgId::from_prefix(f.payload) else {
                // Intact framing but too short to be a message: not ours, cut here.
                valid = f.offset;
                break;
            };
            let loc = Location {
                file: n,
                offset: f.offset as u64,
                total_size: (RECORD_OVERHEAD + f.payload.len()) as u32,
            };
            records.push((id, loc));
        }
        if valid < data.len() {
            disk.truncate(&path, valid as u64)?;
            disk.sync(&path)?;
            let damage = DamagedFile {
                file: n,
                bytes_cut: (data.len() - valid) as u64,
                records_kept: records.len(),
            };
            tracing::warn!(path = %path.display(), bytes_cut = damage.bytes_cut, records_kept = damage.records_kept, "cut a torn or corrupt tail");
            report.damaged.push(damage);
        }
        index.add_file(n, valid as u64);
        report.records_scanned += records.len();
        for (id, loc) in records {
            if !index.insert_stored(id, 1, loc) {
                report.duplicates += 1;
            }
        }
    }
    Ok(())
}

/// Saves the index, then the marker vouching for it, each made durable before the next step:
/// a crash part-way leaves no marker, or a marker whose index does not match, and the next
/// open scans.
pub(super) fn save_clean<D: Disk>(
    disk: &D,
    dir: &Path,
    index: &StoreIndex,
) -> Result<(), MsgStoreError> {
    let bytes = encode_index(index.current_file(), &index.snapshot());
    let tmp = dir.join(SAVED_INDEX_TMP);
    disk.write_file(&tmp, &bytes)?;
    disk.sync(&tmp)?;
    disk.rename(&tmp, &dir.join(SAVED_INDEX))?;
    disk.sync_dir(dir)?;
    let marker = dir.join(CLEAN_MARKER);
    disk.write_file(&marker, &encode_marker(&bytes))?;
    disk.sync(&marker)?;
    disk.sync_dir(dir)?;
    tracing::info!(dir = %dir.display(), messages = index.len(), current_file = index.current_file(), "message store closed cleanly");
    Ok(())
}

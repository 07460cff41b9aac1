//! Opening an index: read the geometry, the clean marker and the clean summary (and remove
//! the last two before anything changes), then recover by one of two paths.
//!
//! The clean path ([`clean_open`]), after a clean close whose summary is whole and agrees
//! with `clean.dot`, the folder's segment size, its segment files and the journal (empty, as
//! the close left it): the state is loaded from the summary, the live transient messages it
//! lists are dropped exactly as the scan drops them (an ack each, written by the flush that
//! ends the open), and only the head segments are read (with the code of
//! [`QueueIndex::read_segment`]) to fill [`Recovered::entries`]; the counts, bytes and store
//! references of the rest come from the summary. A head segment that disagrees with the
//! summary (damaged, entries missing, a different tally) sends the open to the scan; nothing
//! was written by then.
//!
//! The scan ([`scan_open`]), in any other case, streams with memory bounded by one segment
//! plus the journal whatever the queue's length:
//! 1. the journal is read and scanned first (a torn tail is cut, damage elsewhere reported)
//!    and its records grouped by segment;
//! 2. each segment, in ascending order (those with a file and those the journal mentions), is
//!    read, scanned (skipping damage) and folded with its journal records by the sans-IO
//!    [`Rebuild`]: that loads its part of the state and yields its survivors. A damaged
//!    segment that still holds messages is rewritten there and then. [`Survivors`] keeps the
//!    survivors of the first segments (up to [`IndexConfig::recover_head_entries`]) and only
//!    counts the others, whose bodies are dropped before the next segment is read;
//! 3. the state is finished (next seq, clean-marker count check).
//!
//! Either way the journal is then flushed, so it is empty and every segment consistent before
//! the queue writes again; the segments after the head are read with
//! [`QueueIndex::read_segment`].
//!
//! What stays in RAM across segments is small per message: the segment bitsets and tallies
//! (see [`super::state`]), the pending records of the journal (bounded by it) and, for each
//! dropped transient message, a pending ack (no body).

#[cfg(test)]
use std::cell::Cell;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::store::disk::{Disk, DiskError};

use super::codec::{self, CleanMarker};
use super::index::read_live;
use super::rebuild::{Rebuild, Survivors};
use super::state::{IndexState, Tally};
use super::summary::{self, Decoded};
use super::{
    is_segment_tmp, segment_number, segment_path, Damage, IndexConfig, IndexEntry, QueueIndex,
    QueueIndexError, Recovered, CLEAN_FILE, JOURNAL_FILE, MAX_SEGMENT_ENTRY_COUNT, META_FILE,
    SUMMARY_FILE,
};

#[cfg(test)]
thread_local! {
    /// [`Rebuilt::peak_held`](super::rebuild::Rebuilt::peak_held) of this thread's last open
    /// (for a clean open: the most publishes read from one head segment).
    pub(super) static LAST_PEAK_HELD: Cell<usize> = const { Cell::new(0) };
    /// Whether this thread's last open took the clean path (no scan).
    pub(super) static LAST_OPEN_CLEAN_PATH: Cell<bool> = const { Cell::new(false) };
}

/// The folder being opened.
struct Folder<'a, D: Disk> {
    disk: &'a D,
    dir: &'a Path,
    config: &'a IndexConfig,
    /// Its segment files.
    files: BTreeSet<u64>,
}

/// What either recovery path found.
struct Opened {
    state: IndexState,
    survivors: Survivors,
    clean: bool,
    dropped_transient: u64,
    journal_torn_bytes: u64,
    /// Bytes in the journal file.
    journal_len: u64,
    #[cfg_attr(not(test), allow(dead_code))]
    peak_held: usize,
}

impl<D: Disk> QueueIndex<D> {
    /// Opens (creating if needed) the index in `dir` and recovers its messages. Damaged
    /// files are reported in [`Recovered::damage`], never fail the open; disk errors do.
    pub fn open(
        disk: D,
        dir: &Path,
        config: IndexConfig,
    ) -> Result<(QueueIndex<D>, Recovered), QueueIndexError> {
        config.validate()?;
        disk.create_dir_all(dir)?;
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            disk.sync_dir(parent)?;
        }
        let names = disk.list(dir)?;
        let mut damage = Vec::new();
        let config = IndexConfig {
            segment_entry_count: geometry(&disk, dir, &names, &config, &mut damage)?,
            ..config
        };

        let listed = |file: &str| names.iter().any(|n| n == file);
        let mut marker = None;
        if listed(CLEAN_FILE) {
            marker = codec::decode_clean(&disk.read(&dir.join(CLEAN_FILE))?);
            if marker.is_none() {
                damage.push(Damage::CleanMarker);
            }
        }
        // A summary counts only next to a valid marker (without one, the close that wrote it
        // did not finish).
        let mut summary = None;
        if listed(SUMMARY_FILE) && marker.is_some() {
            summary = Some(disk.read(&dir.join(SUMMARY_FILE))?);
        }
        if listed(CLEAN_FILE) || listed(SUMMARY_FILE) {
            // Removed before anything else changes, so a crash from here on is seen as one
            // and a summary never describes files changed after it was written.
            disk.remove(&dir.join(CLEAN_FILE))?;
            disk.remove(&dir.join(SUMMARY_FILE))?;
            disk.sync_dir(dir)?;
        }

        // Leftover segment rewrites go; the segment files are only listed for now.
        let mut files = BTreeSet::new();
        for name in &names {
            if is_segment_tmp(name) {
                // A segment rewrite that crashed before its rename.
                disk.remove(&dir.join(name))?;
            } else if let Some(n) = segment_number(name) {
                files.insert(n);
            }
        }
        let folder = Folder {
            disk: &disk,
            dir,
            config: &config,
            files,
        };

        let journal = dir.join(JOURNAL_FILE);
        let journal_len = disk.len(&journal)?;
        let mut opened = None;
        if let (Some(m), Some(bytes)) = (marker, summary) {
            match usable_summary(&folder, &bytes, m, journal_len) {
                Ok(decoded) => {
                    drop(bytes);
                    opened = clean_open(&folder, decoded)?;
                }
                Err(reason) => damage.push(Damage::Summary { reason }),
            }
        }
        #[cfg(test)]
        LAST_OPEN_CLEAN_PATH.with(|c| c.set(opened.is_some()));
        let opened = match opened {
            Some(o) => o,
            None => scan_open(&folder, &journal, journal_len, marker, &mut damage)?,
        };
        #[cfg(test)]
        LAST_PEAK_HELD.with(|p| p.set(opened.peak_held));

        let next_seq = opened.state.next_seq();
        let mut index = QueueIndex {
            disk,
            dir: dir.to_path_buf(),
            journal,
            config,
            state: opened.state,
            buf: Vec::new(),
            journal_len: opened.journal_len,
            unsynced: false,
            poisoned: false,
            flushes: 0,
            syncs: 0,
            segment_reads: Default::default(),
        };
        index.flush()?;
        let survivors = opened.survivors;
        let recovered = Recovered {
            entries: survivors.entries,
            rest_from: survivors.rest_from.unwrap_or(next_seq),
            live: survivors.live,
            rest_bytes: survivors.rest_bytes,
            store_refs: survivors.store_refs,
            clean: opened.clean,
            damage,
            dropped_transient: opened.dropped_transient,
            journal_torn_bytes: opened.journal_torn_bytes,
        };
        Ok((index, recovered))
    }
}

/// Decodes the summary and checks it against the marker and the folder; `Err` says why it
/// cannot be used.
fn usable_summary<D: Disk>(
    folder: &Folder<'_, D>,
    bytes: &[u8],
    marker: CleanMarker,
    journal_len: Option<u64>,
) -> Result<Decoded, &'static str> {
    let decoded = summary::decode(bytes)?;
    let h = &decoded.header;
    if h.entries_per_segment != folder.config.segment_entry_count {
        return Err("segment size differs from the folder's");
    }
    if (h.next_seq, h.unacked) != (marker.next_seq, marker.unacked) {
        return Err("does not match clean.dot");
    }
    if journal_len != Some(0) {
        return Err("the journal is not empty");
    }
    let segments: BTreeSet<u64> = decoded.segments.iter().map(|(n, _)| *n).collect();
    let on_disk = decoded.segments.iter().all(|(_, s)| s.on_disk);
    if !on_disk || segments != folder.files {
        return Err("segment files differ");
    }
    Ok(decoded)
}

/// The clean path (see the module docs). `None` when a head segment disagrees with the
/// summary: the caller scans instead (nothing was written).
fn clean_open<D: Disk>(
    folder: &Folder<'_, D>,
    decoded: Decoded,
) -> Result<Option<Opened>, DiskError> {
    let e = folder.config.segment_entry_count;
    let mut state = IndexState::new(e);
    let segments: Vec<u64> = decoded.segments.iter().map(|(n, _)| *n).collect();
    for (n, s) in decoded.segments {
        state.load_summary(n, s);
    }
    state.raise_next_seq(decoded.header.next_seq);
    let mut dropped_transient = 0;
    if !folder.config.keep_transient {
        for &n in &segments {
            dropped_transient += state.drop_transients(n);
        }
    }

    let mut survivors = Survivors::new(folder.config.recover_head_entries);
    let mut peak_held = 0;
    for n in segments {
        let s = state.segment(n).expect("loaded from the summary");
        let tally = s.tally().expect("the summary has every tally");
        let live = s.unacked();
        if live == 0 {
            // Only transient messages, dropped.
            continue;
        }
        if !survivors.in_head() {
            survivors.counted(n * e, live, tally.bytes, &tally.refs);
            continue;
        }
        let read = read_live(folder.disk, folder.dir, &state, n)?;
        peak_held = peak_held.max(read.publishes);
        let found = Tally::of(read.entries.iter().map(|x| &x.publish));
        if read.damaged || read.entries.len() as u64 != live || found != *tally {
            tracing::warn!(
                dir = %folder.dir.display(),
                segment = n,
                "queue index segment disagrees with the clean summary; scanning"
            );
            return Ok(None);
        }
        survivors.segment(n * e, read.entries);
    }
    Ok(Some(Opened {
        state,
        survivors,
        clean: true,
        dropped_transient,
        journal_torn_bytes: 0,
        journal_len: 0,
        peak_held,
    }))
}

/// The scan (see the module docs).
fn scan_open<D: Disk>(
    folder: &Folder<'_, D>,
    journal: &Path,
    journal_len: Option<u64>,
    marker: Option<CleanMarker>,
    damage: &mut Vec<Damage>,
) -> Result<Opened, QueueIndexError> {
    let Folder {
        disk,
        dir,
        config,
        ref files,
    } = *folder;
    // The journal first: its records of a segment are needed to fold that segment.
    let mut rebuild = Rebuild::new(config.segment_entry_count, !config.keep_transient);
    let mut journal_damage = Vec::new();
    let mut journal_torn_bytes = 0;
    if journal_len.is_some() {
        let bytes = disk.read(journal)?;
        let (scan, total) = (codec::scan(&bytes), bytes.len());
        drop(bytes);
        for (start, end) in scan.skipped {
            if end == total {
                journal_torn_bytes += (end - start) as u64;
            } else {
                journal_damage.push(Damage::Journal {
                    offset: start as u64,
                    bytes: (end - start) as u64,
                });
            }
        }
        scan.records
            .into_iter()
            .for_each(|r| rebuild.journal_record(r));
    } else {
        // The journal's name must be durable before sync() can make records durable.
        disk.write_file(journal, &[])?;
        disk.sync(journal)?;
        disk.sync_dir(dir)?;
    }

    // Then one segment at a time: its bodies are dropped (or kept in the head) before
    // the next segment is read.
    let mut survivors = Survivors::new(config.recover_head_entries);
    let mut rewrote = false;
    for n in rebuild.segments(files.iter().copied()) {
        let file = files.contains(&n);
        let mut fold = rebuild.start_segment(n, file);
        let mut damaged = false;
        if file {
            let bytes = disk.read_view(&segment_path(dir, n))?;
            // Past the head only counts, sizes and store ids are kept: the bodies embedded
            // in the segment are not copied. A damaged segment is rewritten from its
            // survivors, so it is read again whole.
            let mut scan = if survivors.in_head() {
                codec::scan(&bytes)
            } else {
                codec::scan_light(&bytes)
            };
            let per_segment = config.segment_entry_count.max(1);
            let light = !survivors.in_head();
            if light
                && (!scan.skipped.is_empty()
                    || scan.records.iter().any(|r| r.seq() / per_segment != n))
            {
                scan = codec::scan(&bytes);
            }
            for (start, end) in scan.skipped {
                damaged = true;
                damage.push(Damage::Segment {
                    segment: n,
                    offset: start as u64,
                    bytes: (end - start) as u64,
                });
            }
            for r in scan.records {
                let seq = r.seq();
                if !fold.file_record(r) {
                    damaged = true;
                    damage.push(Damage::ForeignRecord { segment: n, seq });
                }
            }
        }
        let outcome = rebuild.finish_segment(fold, damaged);
        if let Some(acked) = &outcome.rewrite {
            rewrite_segment(disk, dir, n, &outcome.live, acked)?;
            rewrote = true;
        }
        survivors.segment(n * config.segment_entry_count, outcome.live);
    }
    if rewrote {
        // The renames must be durable before the flush truncates the journal: the new
        // files hold records that may be nowhere else but there.
        disk.sync_dir(dir)?;
    }
    damage.extend(journal_damage);

    let rebuilt = rebuild.finish(marker.map_or(0, |m| m.next_seq));
    let mut clean = marker.is_some();
    if let Some(m) = marker {
        if m.unacked != rebuilt.unacked_before_drop {
            // Files changed after the clean close: do not let the caller trust it.
            clean = false;
            damage.push(Damage::CleanCountMismatch {
                recorded: m.unacked,
                found: rebuilt.unacked_before_drop,
            });
        }
    }
    Ok(Opened {
        state: rebuilt.state,
        survivors,
        clean,
        dropped_transient: rebuilt.dropped_transient,
        journal_torn_bytes,
        journal_len: journal_len.unwrap_or(0),
        peak_held: rebuilt.peak_held,
    })
}

/// Replaces a damaged segment that still holds messages with a clean copy: the publish (and
/// deliver, when delivered) of each survivor and an ack of each acked seq (see
/// [`SegmentOutcome::rewrite`](super::rebuild::SegmentOutcome::rewrite)). Appending after
/// garbage would leave the new records behind a damaged region at the next scan. The caller
/// syncs the folder afterwards.
fn rewrite_segment<D: Disk>(
    disk: &D,
    dir: &Path,
    n: u64,
    live: &[IndexEntry],
    acked: &[u64],
) -> Result<(), DiskError> {
    let mut bytes = Vec::new();
    for e in live {
        codec::encode_publish(&mut bytes, &e.publish);
        if e.delivered {
            codec::encode_deliver(&mut bytes, e.publish.seq);
        }
    }
    for &seq in acked {
        codec::encode_ack(&mut bytes, seq);
    }
    let path = segment_path(dir, n);
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    disk.write_file(&tmp, &bytes)?;
    disk.sync(&tmp)?;
    disk.rename(&tmp, &path)
}

/// The folder's segment size: `index.meta` when readable, else the configured one (which
/// is then recorded, for a new folder or one whose meta file was lost).
fn geometry<D: Disk>(
    disk: &D,
    dir: &Path,
    names: &[String],
    config: &IndexConfig,
    damage: &mut Vec<Damage>,
) -> Result<u64, QueueIndexError> {
    let path = dir.join(META_FILE);
    if names.iter().any(|n| n == META_FILE) {
        let stored = codec::decode_meta(&disk.read(&path)?);
        match stored.filter(|e| (1..=MAX_SEGMENT_ENTRY_COUNT).contains(e)) {
            Some(e) => return Ok(e),
            None => damage.push(Damage::Meta),
        }
    }
    disk.write_file(&path, &codec::encode_meta(config.segment_entry_count))?;
    disk.sync(&path)?;
    disk.sync_dir(dir)?;
    Ok(config.segment_entry_count)
}

//! Opening an index: read the geometry and the clean marker, scan every segment and the
//! journal (skipping damage), rebuild the state, then flush so the journal is empty and
//! every segment is consistent before the queue starts writing again.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::store::disk::{Disk, DiskError};

use super::codec;
use super::rebuild::Rebuild;
use super::{
    is_segment_tmp, segment_number, segment_path, Damage, IndexConfig, IndexEntry, QueueIndex,
    QueueIndexError, Recovered, CLEAN_FILE, JOURNAL_FILE, META_FILE,
};

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

        let mut marker = None;
        if names.iter().any(|n| n == CLEAN_FILE) {
            let path = dir.join(CLEAN_FILE);
            marker = codec::decode_clean(&disk.read(&path)?);
            if marker.is_none() {
                damage.push(Damage::CleanMarker);
            }
            // Removed before anything else changes, so a crash from here on is seen as one.
            disk.remove(&path)?;
            disk.sync_dir(dir)?;
        }

        let mut rebuild = Rebuild::new(config.segment_entry_count);
        let mut damaged = BTreeSet::new();
        for name in &names {
            if is_segment_tmp(name) {
                // A segment rewrite that crashed before its rename.
                disk.remove(&dir.join(name))?;
                continue;
            }
            let Some(n) = segment_number(name) else {
                continue;
            };
            rebuild.segment_file(n);
            let scan = codec::scan(&disk.read(&segment_path(dir, n))?);
            for (start, end) in scan.skipped {
                damaged.insert(n);
                damage.push(Damage::Segment {
                    segment: n,
                    offset: start as u64,
                    bytes: (end - start) as u64,
                });
            }
            for r in scan.records {
                let seq = r.seq();
                if !rebuild.segment_record(n, r) {
                    damaged.insert(n);
                    damage.push(Damage::ForeignRecord { segment: n, seq });
                }
            }
        }

        let journal = dir.join(JOURNAL_FILE);
        let mut journal_torn_bytes = 0;
        let journal_len = disk.len(&journal)?;
        if journal_len.is_some() {
            let bytes = disk.read(&journal)?;
            let scan = codec::scan(&bytes);
            for (start, end) in scan.skipped {
                if end == bytes.len() {
                    journal_torn_bytes += (end - start) as u64;
                } else {
                    damage.push(Damage::Journal {
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
            disk.write_file(&journal, &[])?;
            disk.sync(&journal)?;
            disk.sync_dir(dir)?;
        }

        let rebuilt = rebuild.finish(true, marker.map_or(0, |m| m.next_seq));
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
        let mut index = QueueIndex {
            disk,
            dir: dir.to_path_buf(),
            journal,
            config,
            state: rebuilt.state,
            buf: Vec::new(),
            journal_len: journal_len.unwrap_or(0),
            unsynced: false,
            poisoned: false,
            flushes: 0,
            syncs: 0,
        };
        index.flush()?;
        index.rewrite_damaged(&damaged, &rebuilt.live)?;
        let recovered = Recovered {
            entries: rebuilt.live,
            clean,
            damage,
            dropped_transient: rebuilt.dropped_transient,
            journal_torn_bytes,
        };
        Ok((index, recovered))
    }

    /// Replaces each damaged segment that still holds messages with a clean copy of its
    /// surviving entries (publish, plus deliver when delivered): appending after garbage
    /// would leave the new records behind a damaged region at the next scan.
    fn rewrite_damaged(
        &mut self,
        damaged: &BTreeSet<u64>,
        live: &[IndexEntry],
    ) -> Result<(), DiskError> {
        let mut any = false;
        for &n in damaged {
            if !self.state.segment(n).is_some_and(|s| s.on_disk) {
                continue;
            }
            let mut bytes = Vec::new();
            let in_segment = live
                .iter()
                .filter(|e| self.state.segment_of(e.publish.seq) == n);
            for e in in_segment {
                codec::encode_publish(&mut bytes, &e.publish);
                if e.delivered {
                    codec::encode_deliver(&mut bytes, e.publish.seq);
                }
            }
            let path = segment_path(&self.dir, n);
            let tmp = PathBuf::from(format!("{}.tmp", path.display()));
            self.disk.write_file(&tmp, &bytes)?;
            self.disk.sync(&tmp)?;
            self.disk.rename(&tmp, &path)?;
            any = true;
        }
        if any {
            self.disk.sync_dir(&self.dir)?;
        }
        Ok(())
    }
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
        match stored.filter(|e| (1..=1 << 20).contains(e)) {
            Some(e) => return Ok(e),
            None => damage.push(Damage::Meta),
        }
    }
    disk.write_file(&path, &codec::encode_meta(config.segment_entry_count))?;
    disk.sync(&path)?;
    disk.sync_dir(dir)?;
    Ok(config.segment_entry_count)
}

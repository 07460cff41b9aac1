//! [`FileDisk`]: the real [`Disk`], over std files with fsync. Blocking: call it from a
//! blocking-capable thread (the store's writer), never from a connection task. Large appends
//! to message store and queue index files skip the page cache ([`direct`]).

mod direct;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;

use crate::metrics::{FileKind, IoCounters};
use crate::store::disk::{Disk, DiskError, FileBytes};

/// Files on the local file system. Keeps append handles open so appends cost one syscall.
#[derive(Debug, Default)]
pub struct FileDisk {
    open: Mutex<HashMap<PathBuf, File>>,
    /// Where each file fsync's duration goes (`warren_fsync_latency_seconds`), if anywhere.
    fsync_latency: Option<Histogram>,
    /// Where reads, writes, seeks and syncs are counted (the node's storage), if anywhere.
    io: Option<IoCounters>,
    /// The `O_DIRECT` handles of message store files, and the buffer their writes go through.
    /// Locked inside `open`'s lock.
    direct: Mutex<(HashMap<PathBuf, direct::Direct>, direct::Bounce)>,
    /// Appends that wrote pages through a direct handle.
    direct_appends: AtomicU64,
}

impl FileDisk {
    /// A file disk.
    pub fn new() -> FileDisk {
        FileDisk::default()
    }

    /// A file disk that records how long each file fsync takes in `h`, and counts its I/O
    /// into `io`.
    pub fn measured(h: Histogram, io: IoCounters) -> FileDisk {
        FileDisk {
            fsync_latency: Some(h),
            io: Some(io),
            ..FileDisk::default()
        }
    }

    /// Counts one read of `bytes` from `path`, started at `started`.
    fn count_read(&self, path: &Path, bytes: usize, started: Instant) {
        if let Some(io) = &self.io {
            io.read(kind(path), bytes as u64, started.elapsed().as_secs_f64());
        }
    }

    /// Counts one write of `bytes` to `path`, started at `started`.
    fn count_write(&self, path: &Path, bytes: usize, started: Instant) {
        if let Some(io) = &self.io {
            io.write(kind(path), bytes as u64, started.elapsed().as_secs_f64());
        }
    }

    /// Counts one seek, started at `started`.
    fn count_seek(&self, started: Instant) {
        if let Some(io) = &self.io {
            io.seek_ops.inc();
            io.seek_seconds.inc_by(started.elapsed().as_secs_f64());
        }
    }

    /// Counts one fsync, started at `started`.
    fn count_sync(&self, started: Instant) {
        if let Some(io) = &self.io {
            io.sync_ops.inc();
            io.sync_seconds.inc_by(started.elapsed().as_secs_f64());
        }
    }

    /// Counts a file opened again to read it.
    fn count_reopen(&self) {
        if let Some(io) = &self.io {
            io.reopen_ops.inc();
        }
    }

    fn with_file<T>(
        &self,
        path: &Path,
        f: impl FnOnce(&mut File) -> Result<T, DiskError>,
    ) -> Result<T, DiskError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if !open.contains_key(path) {
            let file = OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .open(path)
                .map_err(|e| DiskError::io("open", path, e))?;
            open.insert(path.to_path_buf(), file);
        }
        let file = open.get_mut(path).expect("inserted above");
        f(file)
    }

    fn forget(&self, path: &Path) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(path);
        self.direct
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .remove(path);
    }

    /// Appends that wrote whole pages without the page cache, since this disk was made.
    pub fn direct_appends(&self) -> u64 {
        self.direct_appends.load(Ordering::Relaxed)
    }

    /// Writes `data` at `offset`, the end of `f`: through [`direct`] when it is a large
    /// append to a message store or queue index file, else with one buffered write.
    fn write_appended(
        &self,
        path: &Path,
        f: &mut File,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        if data.len() < direct::DIRECT_MIN || kind(path) == FileKind::Other {
            return f.write_all(data);
        }
        let mut guard = self.direct.lock().unwrap_or_else(|e| e.into_inner());
        let (handles, bounce) = &mut *guard;
        if !handles.contains_key(path) {
            handles.insert(path.to_path_buf(), direct::open(path)?);
        }
        let handle = handles.get_mut(path).expect("inserted above");
        if direct::append(f, handle, bounce, offset, data)? {
            self.direct_appends.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Names in `dir` whose type `keep` accepts, sorted; none when `dir` is missing.
fn kind(path: &Path) -> FileKind {
    FileKind::of(path.file_name().and_then(|n| n.to_str()).unwrap_or(""))
}

fn names(dir: &Path, keep: fn(&std::fs::FileType) -> bool) -> Result<Vec<String>, DiskError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DiskError::io("list", dir, e)),
    };
    let mut names = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| DiskError::io("list", dir, e))?;
        if entry.file_type().is_ok_and(|t| keep(&t)) {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

impl Disk for FileDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        std::fs::create_dir_all(dir).map_err(|e| DiskError::io("mkdir", dir, e))
    }

    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        names(dir, |t| t.is_file())
    }

    fn list_dirs(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        names(dir, |t| t.is_dir())
    }

    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        let started = Instant::now();
        let data = std::fs::read(path).map_err(|e| DiskError::io("read", path, e))?;
        self.count_read(path, data.len(), started);
        Ok(data)
    }

    fn read_view(&self, path: &Path) -> Result<FileBytes, DiskError> {
        let started = Instant::now();
        let file = File::open(path).map_err(|e| DiskError::io("open", path, e))?;
        self.count_reopen();
        let len = file
            .metadata()
            .map_err(|e| DiskError::io("stat", path, e))?
            .len();
        if len == 0 {
            // An empty file cannot be mapped.
            return Ok(FileBytes::from(Vec::new()));
        }
        // SAFETY: the map is read-only and private to this read; the store never shrinks a
        // file it reads this way (segments are appended to, renamed over or removed, none
        // of which invalidates mapped pages), so no access can fault past the end.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| DiskError::io("mmap", path, e))?;
        // Mapped whole: counted as one read of the file (its pages come in as touched).
        self.count_read(path, map.len(), started);
        Ok(FileBytes::new(map))
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        let mut f = File::open(path).map_err(|e| DiskError::io("open", path, e))?;
        self.count_reopen();
        let started = Instant::now();
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| DiskError::io("seek", path, e))?;
        self.count_seek(started);
        let started = Instant::now();
        let mut buf = Vec::with_capacity(len);
        f.take(len as u64)
            .read_to_end(&mut buf)
            .map_err(|e| DiskError::io("read", path, e))?;
        self.count_read(path, buf.len(), started);
        Ok(buf)
    }

    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.with_file(path, |f| {
            let started = Instant::now();
            let offset = f
                .seek(SeekFrom::End(0))
                .map_err(|e| DiskError::io("seek", path, e))?;
            self.count_seek(started);
            let started = Instant::now();
            self.write_appended(path, f, offset, data)
                .map_err(|e| DiskError::io("append", path, e))?;
            self.count_write(path, data.len(), started);
            Ok(offset)
        })
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.forget(path);
        let started = Instant::now();
        std::fs::write(path, data).map_err(|e| DiskError::io("write", path, e))?;
        self.count_write(path, data.len(), started);
        Ok(())
    }

    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        self.with_file(path, |f| {
            f.set_len(len)
                .map_err(|e| DiskError::io("truncate", path, e))
        })
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        self.forget(from);
        self.forget(to);
        std::fs::rename(from, to).map_err(|e| DiskError::io("rename", from, e))
    }

    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        self.forget(path);
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DiskError::io("remove", path, e)),
        }
    }

    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        self.with_file(path, |f| {
            let started = Instant::now();
            let r = f.sync_data().map_err(|e| DiskError::io("fsync", path, e));
            if let Some(h) = &self.fsync_latency {
                h.observe(started.elapsed().as_secs_f64());
            }
            self.count_sync(started);
            r
        })
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        let d = File::open(dir).map_err(|e| DiskError::io("open dir", dir, e))?;
        let started = Instant::now();
        d.sync_all()
            .map_err(|e| DiskError::io("fsync dir", dir, e))?;
        self.count_sync(started);
        Ok(())
    }

    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        match std::fs::remove_dir(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DiskError::io("rmdir", dir, e)),
        }
    }

    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        match std::fs::metadata(path) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(DiskError::io("stat", path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_measured_disk_counts_reads_writes_seeks_and_syncs_by_file() {
        let dir = std::env::temp_dir().join(format!("warren-file-disk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let io = IoCounters::default();
        let disk = FileDisk::measured(Histogram::new([0.001]), io.clone());
        disk.create_dir_all(&dir).unwrap();
        let rdq = dir.join("00000000000000000001.rdq");
        let journal = dir.join("journal.jif");
        assert_eq!(disk.append(&rdq, b"hello").unwrap(), 0);
        assert_eq!(disk.append(&rdq, b" world").unwrap(), 5);
        disk.sync(&rdq).unwrap();
        disk.write_file(&journal, b"j").unwrap();
        disk.sync_dir(&dir).unwrap();
        assert_eq!(disk.read_at(&rdq, 6, 5).unwrap(), b"world");
        assert_eq!(&disk.read(&journal).unwrap()[..], b"j");
        let s = io.snapshot();
        assert_eq!((s.write_count, s.write_bytes), (3, 12));
        assert_eq!((s.read_count, s.read_bytes), (2, 6));
        // Two appends seek to the end, the positioned read seeks once.
        assert_eq!((s.seek_count, s.sync_count, s.reopen_count), (3, 2, 1));
        assert_eq!((s.msg_store_write_count, s.msg_store_read_count), (2, 1));
        assert_eq!(
            (s.queue_index_write_count, s.queue_index_read_count),
            (1, 1)
        );
        // An unmeasured disk counts nothing.
        let plain = FileDisk::new();
        plain.append(&rdq, b"!").unwrap();
        assert_eq!(io.snapshot().write_count, 3);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn large_appends_to_store_and_index_files_write_the_same_bytes_without_the_page_cache() {
        let dir = std::env::temp_dir().join(format!("warren-direct-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let disk = FileDisk::new();
        disk.create_dir_all(&dir).unwrap();
        let rdq = dir.join("00000000000000000007.rdq");
        let idx = dir.join("00000000000000000007.idx");
        let body = |len: usize, seed: u8| -> Vec<u8> {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect()
        };
        // Unaligned starts, an append of exactly whole pages, one of several bounce chunks
        // with a ragged tail, and small ones in between that stay buffered.
        let appends = [
            body(100, 1),
            body(direct::DIRECT_MIN + 5_000, 2),
            body(7, 3),
            body(3 << 20, 4),
            body(direct::DIRECT_MIN, 5),
            body((5 << 20) + 123, 6),
        ];
        let mut expected = Vec::new();
        for a in &appends {
            assert_eq!(disk.append(&rdq, a).unwrap(), expected.len() as u64);
            expected.extend_from_slice(a);
        }
        disk.sync(&rdq).unwrap();
        assert_eq!(disk.read(&rdq).unwrap(), expected);
        assert_eq!(
            disk.read_at(&rdq, 100 + direct::DIRECT_MIN as u64 + 4_990, 20)
                .unwrap(),
            expected[100 + direct::DIRECT_MIN + 4_990..][..20]
        );
        // A file system that refuses O_DIRECT keeps every append buffered; anywhere else
        // the four large ones went direct.
        if let direct::Direct::Open(_) = direct::open(&rdq).unwrap() {
            assert_eq!(disk.direct_appends(), 4);
        }
        // Queue index files go direct too (a journal flush appends megabytes of segments
        // with embedded bodies), with the same bytes; other files (Raft's log, saved
        // state) never do.
        let before = disk.direct_appends();
        disk.append(&idx, &appends[0]).unwrap();
        disk.append(&idx, &appends[3]).unwrap();
        disk.sync(&idx).unwrap();
        let mut idx_expected = appends[0].clone();
        idx_expected.extend_from_slice(&appends[3]);
        assert_eq!(disk.read(&idx).unwrap(), idx_expected);
        if let direct::Direct::Open(_) = direct::open(&idx).unwrap() {
            assert_eq!(disk.direct_appends(), before + 1);
        }
        let other = dir.join("raft.log");
        let before = disk.direct_appends();
        disk.append(&other, &appends[3]).unwrap();
        disk.append(&other, &appends[3]).unwrap();
        assert_eq!(disk.direct_appends(), before);
        // An append cut back (a failed batch) and written again lands where the cut was.
        let len = expected.len() as u64;
        disk.append(&rdq, &appends[5]).unwrap();
        disk.truncate(&rdq, len).unwrap();
        assert_eq!(disk.append(&rdq, &appends[1]).unwrap(), len);
        expected.extend_from_slice(&appends[1]);
        assert_eq!(disk.read(&rdq).unwrap(), expected);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

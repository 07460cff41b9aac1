//! [`FileDisk`]: the real [`Disk`], over std files with fsync. Blocking: call it from a
//! blocking-capable thread (the store's writer), never from a connection task.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use prometheus_client::metrics::histogram::Histogram;

use crate::store::disk::{Disk, DiskError, FileBytes};

/// Files on the local file system. Keeps append handles open so appends cost one syscall.
#[derive(Debug, Default)]
pub struct FileDisk {
    open: Mutex<HashMap<PathBuf, File>>,
    /// Where each file fsync's duration goes (`warren_fsync_latency_seconds`), if anywhere.
    fsync_latency: Option<Histogram>,
}

impl FileDisk {
    /// A file disk.
    pub fn new() -> FileDisk {
        FileDisk::default()
    }

    /// A file disk that records how long each file fsync takes in `h`.
    pub fn timing_fsyncs(h: Histogram) -> FileDisk {
        FileDisk {
            fsync_latency: Some(h),
            ..FileDisk::default()
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
    }
}

/// Names in `dir` whose type `keep` accepts, sorted; none when `dir` is missing.
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
        std::fs::read(path).map_err(|e| DiskError::io("read", path, e))
    }

    fn read_view(&self, path: &Path) -> Result<FileBytes, DiskError> {
        let file = File::open(path).map_err(|e| DiskError::io("open", path, e))?;
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
        Ok(FileBytes::new(map))
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        let mut f = File::open(path).map_err(|e| DiskError::io("open", path, e))?;
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| DiskError::io("seek", path, e))?;
        let mut buf = Vec::with_capacity(len);
        f.take(len as u64)
            .read_to_end(&mut buf)
            .map_err(|e| DiskError::io("read", path, e))?;
        Ok(buf)
    }

    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.with_file(path, |f| {
            let offset = f
                .seek(SeekFrom::End(0))
                .map_err(|e| DiskError::io("seek", path, e))?;
            f.write_all(data)
                .map_err(|e| DiskError::io("append", path, e))?;
            Ok(offset)
        })
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.forget(path);
        std::fs::write(path, data).map_err(|e| DiskError::io("write", path, e))
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
            let started = std::time::Instant::now();
            let r = f.sync_data().map_err(|e| DiskError::io("fsync", path, e));
            if let Some(h) = &self.fsync_latency {
                h.observe(started.elapsed().as_secs_f64());
            }
            r
        })
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        let d = File::open(dir).map_err(|e| DiskError::io("open dir", dir, e))?;
        d.sync_all().map_err(|e| DiskError::io("fsync dir", dir, e))
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

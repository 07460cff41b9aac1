//! The `Disk` trait: the only way storage code reaches files.
//!
//! The store's bookkeeping is sans-IO; what it decides to write goes through a `Disk`.
//! [`crate::runtime::file_disk::FileDisk`] is the real one (std files, fsync);
//! [`super::mem_disk::MemDisk`] keeps files in memory, separates synced from unsynced bytes
//! and injects faults, for tests and the simulation.
//!
//! Durability contract: bytes written by `append`/`write_file` are durable only after
//! `sync(path)` returns Ok; a new or renamed file's name is durable after `sync_dir(dir)`.
//! A failed `sync` is fatal for the data it covered: callers must not acknowledge it and must
//! not retry as if it had succeeded (the kernel may have dropped the dirty pages).

use std::path::{Path, PathBuf};

/// A storage failure, with the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// An I/O error from the operating system.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The disk (or the configured limit) is full.
    #[error("{path}: no space left on device")]
    Full {
        /// The file being written.
        path: PathBuf,
    },
    /// A write stored fewer bytes than asked.
    #[error("{path}: short write ({written} of {wanted} bytes)")]
    ShortWrite {
        /// The file.
        path: PathBuf,
        /// Bytes stored.
        written: usize,
        /// Bytes asked for.
        wanted: usize,
    },
    /// The file does not exist.
    #[error("{0}: not found")]
    NotFound(PathBuf),
}

impl DiskError {
    /// Wraps an OS error.
    pub fn io(op: &'static str, path: &Path, source: std::io::Error) -> DiskError {
        if source.kind() == std::io::ErrorKind::NotFound {
            return DiskError::NotFound(path.to_path_buf());
        }
        if source.raw_os_error() == Some(28) {
            return DiskError::Full {
                path: path.to_path_buf(),
            };
        }
        DiskError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A whole file's bytes from [`Disk::read_view`]: owned, or a read-only map of the file.
pub struct FileBytes(Box<dyn std::ops::Deref<Target = [u8]> + Send + Sync>);

impl FileBytes {
    /// Bytes held by something that derefs to them (a `Vec`, a file map).
    pub fn new(bytes: impl std::ops::Deref<Target = [u8]> + Send + Sync + 'static) -> FileBytes {
        FileBytes(Box::new(bytes))
    }
}

impl From<Vec<u8>> for FileBytes {
    fn from(bytes: Vec<u8>) -> FileBytes {
        FileBytes::new(bytes)
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// File operations the store needs. Paths are absolute or relative to the process.
pub trait Disk: Send + Sync + 'static {
    /// Creates a folder and its parents.
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError>;
    /// File names (not paths) in a folder, sorted; empty when the folder is missing.
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError>;
    /// The whole file.
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError>;
    /// The whole file, for a scan that only reads it: the real disk maps it instead of
    /// copying it (a queue index segment of embedded bodies is tens of MiB, and a scan
    /// for ids touches every page once). The file must not shrink while the bytes live;
    /// the store only ever appends to, renames or removes a file (all safe under a map).
    fn read_view(&self, path: &Path) -> Result<FileBytes, DiskError> {
        self.read(path).map(FileBytes::from)
    }
    /// `len` bytes at `offset` (fewer at the end of the file).
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError>;
    /// Appends `data` (creating the file); returns the offset it was written at.
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError>;
    /// Creates or replaces the file with `data` (not durable until `sync`).
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError>;
    /// Cuts the file to `len` bytes.
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError>;
    /// Renames a file (atomic replace of `to`).
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError>;
    /// Removes a file; missing files are not an error.
    fn remove(&self, path: &Path) -> Result<(), DiskError>;
    /// Makes the file's written bytes durable (fsync).
    fn sync(&self, path: &Path) -> Result<(), DiskError>;
    /// Makes the folder's entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError>;
    /// The file's length, if it exists.
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError>;
    /// Removes an empty folder; a missing one is not an error.
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError>;
    /// Sub-folder names (not paths) of a folder, sorted; empty when the folder is missing.
    /// (Storage finds queue index folders with it; a disk without folders has none.)
    fn list_dirs(&self, _dir: &Path) -> Result<Vec<String>, DiskError> {
        Ok(Vec::new())
    }
}

/// A shared disk is a disk: the message store and every queue index use one `Arc`'d
/// instance (and its open-file cache).
impl<T: Disk + ?Sized> Disk for std::sync::Arc<T> {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        (**self).create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        (**self).list(dir)
    }
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        (**self).read(path)
    }
    fn read_view(&self, path: &Path) -> Result<FileBytes, DiskError> {
        (**self).read_view(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        (**self).read_at(path, offset, len)
    }
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        (**self).append(path, data)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        (**self).write_file(path, data)
    }
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        (**self).truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        (**self).rename(from, to)
    }
    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        (**self).remove(path)
    }
    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        (**self).sync(path)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        (**self).sync_dir(dir)
    }
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        (**self).len(path)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        (**self).remove_dir(dir)
    }
    fn list_dirs(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        (**self).list_dirs(dir)
    }
}

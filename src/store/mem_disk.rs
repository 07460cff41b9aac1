//! An in-memory [`Disk`] that remembers what was synced, loses the rest on [`MemDisk::crash`],
//! and injects faults (failed fsync, short write, full disk). Used by store tests and the
//! simulation; its state is shared through `Arc` so it outlives a simulated node crash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::disk::{Disk, DiskError};

#[derive(Debug, Default, Clone)]
struct File {
    /// What a reader sees now.
    data: Vec<u8>,
    /// What survives a crash.
    durable: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct State {
    files: BTreeMap<PathBuf, File>,
    /// Names whose existence is durable (folder synced after creation).
    durable_names: std::collections::BTreeSet<PathBuf>,
    capacity_bytes: Option<u64>,
    fail_next_sync: bool,
    short_next_write: bool,
}

/// The in-memory disk. Clones share the same files.
#[derive(Debug, Clone, Default)]
pub struct MemDisk {
    state: Arc<Mutex<State>>,
}

impl MemDisk {
    /// An empty disk.
    pub fn new() -> MemDisk {
        MemDisk::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Simulates power loss: every file returns to its last synced contents; files whose
    /// name was never made durable disappear.
    pub fn crash(&self) {
        let mut s = self.lock();
        let names = s.durable_names.clone();
        s.files.retain(|p, _| names.contains(p));
        for f in s.files.values_mut() {
            f.data = f.durable.clone().unwrap_or_default();
        }
        s.fail_next_sync = false;
        s.short_next_write = false;
    }

    /// The next `sync` fails with an I/O error (and syncs nothing).
    pub fn fail_next_sync(&self) {
        self.lock().fail_next_sync = true;
    }

    /// The next `append` stores only half its bytes and reports a short write.
    pub fn short_next_write(&self) {
        self.lock().short_next_write = true;
    }

    /// The bytes stored, over every file.
    pub fn used_bytes(&self) -> u64 {
        Self::used(&self.lock())
    }

    /// Limits the total bytes stored; writes past it fail with [`DiskError::Full`].
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock().capacity_bytes = bytes;
    }

    /// Flips one byte of a file (bit rot / torn page), for recovery tests.
    pub fn corrupt(&self, path: &Path, offset: usize) {
        let mut s = self.lock();
        if let Some(f) = s.files.get_mut(path) {
            if offset < f.data.len() {
                f.data[offset] ^= 0xFF;
                if let Some(d) = &mut f.durable {
                    if offset < d.len() {
                        d[offset] ^= 0xFF;
                    }
                }
            }
        }
    }

    fn used(s: &State) -> u64 {
        s.files.values().map(|f| f.data.len() as u64).sum()
    }
}

impl Disk for MemDisk {
    fn create_dir_all(&self, _dir: &Path) -> Result<(), DiskError> {
        Ok(())
    }

    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        let s = self.lock();
        Ok(s.files
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect())
    }

    fn list_dirs(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        // Folders exist here only as the parents of files.
        let s = self.lock();
        let names: std::collections::BTreeSet<String> = s
            .files
            .keys()
            .filter_map(|p| p.strip_prefix(dir).ok())
            .filter(|rest| rest.components().count() > 1)
            .filter_map(|rest| rest.components().next())
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        Ok(names.into_iter().collect())
    }

    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        let s = self.lock();
        s.files
            .get(path)
            .map(|f| f.data.clone())
            .ok_or_else(|| DiskError::NotFound(path.to_path_buf()))
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        let s = self.lock();
        let f = s
            .files
            .get(path)
            .ok_or_else(|| DiskError::NotFound(path.to_path_buf()))?;
        let start = (offset as usize).min(f.data.len());
        let end = start.saturating_add(len).min(f.data.len());
        Ok(f.data[start..end].to_vec())
    }

    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        let mut s = self.lock();
        if let Some(cap) = s.capacity_bytes {
            if Self::used(&s) + data.len() as u64 > cap {
                return Err(DiskError::Full {
                    path: path.to_path_buf(),
                });
            }
        }
        let short = std::mem::take(&mut s.short_next_write);
        let f = s.files.entry(path.to_path_buf()).or_default();
        let offset = f.data.len() as u64;
        if short {
            let half = data.len() / 2;
            f.data.extend_from_slice(&data[..half]);
            return Err(DiskError::ShortWrite {
                path: path.to_path_buf(),
                written: half,
                wanted: data.len(),
            });
        }
        f.data.extend_from_slice(data);
        Ok(offset)
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        let mut s = self.lock();
        if let Some(cap) = s.capacity_bytes {
            let old = s.files.get(path).map_or(0, |f| f.data.len() as u64);
            if Self::used(&s) - old + data.len() as u64 > cap {
                return Err(DiskError::Full {
                    path: path.to_path_buf(),
                });
            }
        }
        s.files.entry(path.to_path_buf()).or_default().data = data.to_vec();
        Ok(())
    }

    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        let mut s = self.lock();
        let f = s
            .files
            .get_mut(path)
            .ok_or_else(|| DiskError::NotFound(path.to_path_buf()))?;
        f.data.truncate(len as usize);
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        let mut s = self.lock();
        let f = s
            .files
            .remove(from)
            .ok_or_else(|| DiskError::NotFound(from.to_path_buf()))?;
        // The rename itself is durable only after sync_dir; until then a crash keeps the old
        // name durable. Modelled simply: the new name inherits the file's durable contents.
        s.durable_names.remove(from);
        s.files.insert(to.to_path_buf(), f);
        Ok(())
    }

    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        let mut s = self.lock();
        s.files.remove(path);
        s.durable_names.remove(path);
        Ok(())
    }

    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        let mut s = self.lock();
        if std::mem::take(&mut s.fail_next_sync) {
            return Err(DiskError::Io {
                op: "fsync",
                path: path.to_path_buf(),
                source: std::io::Error::other("injected fsync failure"),
            });
        }
        if let Some(f) = s.files.get_mut(path) {
            f.durable = Some(f.data.clone());
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        let mut s = self.lock();
        let names: Vec<PathBuf> = s
            .files
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect();
        s.durable_names.extend(names);
        Ok(())
    }

    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        Ok(self.lock().files.get(path).map(|f| f.data.len() as u64))
    }

    fn remove_dir(&self, _dir: &Path) -> Result<(), DiskError> {
        // Folders exist implicitly through their files here.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_keeps_only_synced_bytes_of_durable_names() {
        let d = MemDisk::new();
        let dir = Path::new("/s");
        let a = dir.join("a");
        d.append(&a, b"one").unwrap();
        d.sync(&a).unwrap();
        d.sync_dir(dir).unwrap();
        d.append(&a, b"two").unwrap();
        d.append(&dir.join("b"), b"never named").unwrap();
        d.crash();
        assert_eq!(d.read(&a).unwrap(), b"one");
        assert!(d.read(&dir.join("b")).is_err());
    }

    #[test]
    fn injected_faults_surface_as_errors() {
        let d = MemDisk::new();
        let p = Path::new("/x");
        d.fail_next_sync();
        d.append(p, b"abc").unwrap();
        assert!(d.sync(p).is_err());
        d.short_next_write();
        assert!(matches!(
            d.append(p, b"abcd"),
            Err(DiskError::ShortWrite { written: 2, .. })
        ));
        d.set_capacity(Some(6));
        assert!(matches!(d.append(p, b"zzzz"), Err(DiskError::Full { .. })));
    }
}

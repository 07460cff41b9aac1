//! Rounds a syncing mirror holds back, in memory up to a limit and then in a file.

use bytes::Bytes;

/// Rounds a syncing mirror holds back, in order: in memory up to [`HOLD_IN_MEMORY`] bytes,
/// the rest in a file (a long sync under heavy publishing must not exhaust memory).
pub(super) struct Held {
    memory: Vec<Bytes>,
    bytes: usize,
    file: Option<(std::path::PathBuf, std::fs::File)>,
    spill_path: std::path::PathBuf,
    limit: usize,
}

/// Held rounds kept in memory before they go to the hold file.
pub(super) const HOLD_IN_MEMORY: usize = 64 << 20;

impl Held {
    pub(super) fn new(spill_path: std::path::PathBuf) -> Held {
        Held::with_limit(spill_path, HOLD_IN_MEMORY)
    }

    pub(super) fn with_limit(spill_path: std::path::PathBuf, limit: usize) -> Held {
        Held {
            memory: Vec::new(),
            bytes: 0,
            file: None,
            spill_path,
            limit,
        }
    }

    pub(super) fn push(&mut self, batch: Bytes) -> std::io::Result<()> {
        use std::io::Write;
        if self.file.is_none() && self.bytes + batch.len() <= self.limit {
            self.bytes += batch.len();
            self.memory.push(batch);
            return Ok(());
        }
        if self.file.is_none() {
            if let Some(dir) = self.spill_path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&self.spill_path)?;
            self.file = Some((self.spill_path.clone(), f));
        }
        if let Some((_, f)) = &mut self.file {
            f.write_all(&(batch.len() as u64).to_be_bytes())?;
            f.write_all(&batch)?;
        }
        Ok(())
    }

    /// Every held round, in order (the file's are read back once, at the end of the sync).
    pub(super) fn drain(self) -> std::io::Result<Vec<Bytes>> {
        use std::io::{Read, Seek};
        let mut all = self.memory;
        if let Some((path, mut f)) = self.file {
            f.seek(std::io::SeekFrom::Start(0))?;
            let mut r = std::io::BufReader::new(f);
            let mut len = [0u8; 8];
            while r.read_exact(&mut len).is_ok() {
                let mut batch = vec![0u8; u64::from_be_bytes(len) as usize];
                r.read_exact(&mut batch)?;
                all.push(Bytes::from(batch));
            }
            let _ = std::fs::remove_file(path);
        }
        Ok(all)
    }
}

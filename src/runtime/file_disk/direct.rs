//! Large appends to message store and queue index files without the page cache: the whole
//! 4 KiB pages of an append are written through a second handle opened with `O_DIRECT`, the
//! ragged head and tail through the ordinary one. The file's bytes are exactly those of a plain append, so the
//! format, recovery and the group commit's fsync are unchanged.
//!
//! Why: on this project's machine a buffered write of new data runs at about 300 MB/s (the
//! kernel allocates and fills a page-cache page for every 4 KiB), a direct one at 1.4–1.7
//! GB/s. Where the brokers are short of CPU (three nodes of a mirrored queue on two cores)
//! that page-cache work was the largest cost of a large message; going direct took mirrored
//! 64 KiB, 1 MiB and 16 MiB from about 1.9k, 123 and 4 to 3.3k, 230 and 7 confirmed msg/s
//! (`docs/performance.md`, *Large messages without the page cache*). A queue delivers from
//! memory and reads a body back only once it has paged it out; the one other reader,
//! compaction, reads only the live records of the files it empties, so caching what the
//! store writes bought little else. The queue index goes the same way: a journal flush
//! appends its records to the segments, bodies under 4 KiB embedded, so 32,768 records of
//! 1 KiB messages are 32 MB written at once; buffered, each flush held a mirror's sync
//! batch up for about 145 ms, direct about 60 ms (`docs/performance.md`, *Sync without
//! stalls*). Segments are read back only to page a backlog in and for a sync. Direct
//! writes still need the fsync that follows: they bypass the page cache, not the device's
//! cache, and the file's new length is metadata.
//!
//! A file system that refuses `O_DIRECT` (tmpfs before Linux 6.6, some FUSE mounts) is found
//! at the first try: that file's appends then stay buffered.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Appends at least this long go direct (smaller ones gain nothing worth a second handle).
pub const DIRECT_MIN: usize = 256 * 1024;
/// The alignment of a direct write's offset, length and buffer: a page, which covers every
/// logical block size in use.
pub const ALIGN: usize = 4096;
/// Bytes copied into the aligned buffer and written per direct `pwrite`: the buffer a node
/// keeps once it has written a large append (1 MiB pieces were slower).
const CHUNK: usize = 8 << 20;

/// The direct handle of one file.
#[derive(Debug)]
pub enum Direct {
    /// Open with `O_DIRECT`.
    Open(File),
    /// The file system refused it: this file's appends stay buffered.
    Refused,
}

/// The aligned bounce buffer the direct writes go through, allocated at the first one and
/// kept (a body's own bytes are not aligned).
#[derive(Debug, Default)]
pub struct Bounce(Vec<u8>);

impl Bounce {
    /// An aligned slice of `CHUNK` bytes.
    fn slice(&mut self) -> &mut [u8] {
        if self.0.is_empty() {
            self.0 = vec![0; CHUNK + ALIGN];
        }
        let skip = self.0.as_ptr().align_offset(ALIGN);
        &mut self.0[skip..skip + CHUNK]
    }
}

/// Opens `path`'s direct handle, or records that its file system refuses one.
pub fn open(path: &Path) -> std::io::Result<Direct> {
    match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok(Direct::Open(f)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Direct::Refused),
        Err(e) => Err(e),
    }
}

/// How an append at `start` of `len` bytes splits: buffered head (up to the first page
/// boundary), direct middle (whole pages), buffered tail. The middle is empty when the append
/// does not cover a whole page.
pub fn split(start: u64, len: usize) -> (usize, usize) {
    let head = ((ALIGN as u64 - start % ALIGN as u64) % ALIGN as u64) as usize;
    if head >= len {
        return (len, 0);
    }
    let middle = (len - head) / ALIGN * ALIGN;
    (head, middle)
}

/// Appends `data` at `start`, the end of `appender` (opened with `O_APPEND`): head and tail
/// through `appender`, the whole pages in between through `direct`. Returns whether the
/// direct handle was used; on `EINVAL` from the file system it is set to
/// [`Direct::Refused`] and the rest goes buffered.
pub fn append(
    appender: &mut File,
    direct: &mut Direct,
    bounce: &mut Bounce,
    start: u64,
    data: &[u8],
) -> std::io::Result<bool> {
    let (head, middle) = split(start, data.len());
    let Direct::Open(file) = direct else {
        appender.write_all(data)?;
        return Ok(false);
    };
    if middle == 0 {
        appender.write_all(data)?;
        return Ok(false);
    }
    appender.write_all(&data[..head])?;
    let mut done = 0;
    while done < middle {
        let n = CHUNK.min(middle - done);
        let buf = bounce.slice();
        buf[..n].copy_from_slice(&data[head + done..head + done + n]);
        match file.write_all_at(&buf[..n], start + (head + done) as u64) {
            Ok(()) => done += n,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && done == 0 => {
                // Offsets and buffer are aligned, so the file system does not do direct
                // writes after all. Nothing was written: the rest goes buffered.
                *direct = Direct::Refused;
                appender.write_all(&data[head..])?;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
    }
    appender.write_all(&data[head + middle..])?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn split_takes_whole_pages_between_the_ragged_ends() {
        assert_eq!(split(0, 10_000), (0, 8192));
        assert_eq!(split(100, 10_000), (3996, 4096));
        assert_eq!(split(4096, 4096), (0, 4096));
        assert_eq!(split(100, 4000), (3996, 0));
        assert_eq!(split(100, 3996), (3996, 0));
        assert_eq!(split(100, 8091), (3996, 0));
        assert_eq!(split(100, 8092), (3996, 4096));
    }

    proptest! {
        #[test]
        fn split_covers_the_append_with_an_aligned_middle(start in 0u64..1 << 20, len in 0usize..1 << 16) {
            let (head, middle) = split(start, len);
            prop_assert!(head + middle <= len);
            prop_assert_eq!(middle % ALIGN, 0);
            if middle > 0 {
                prop_assert_eq!((start + head as u64) % ALIGN as u64, 0);
                prop_assert!(head < ALIGN);
            }
            // No whole page is left out: the tail is less than one.
            prop_assert!(len - head - middle < ALIGN);
        }
    }
}

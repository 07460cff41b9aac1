//! Free space on the file system holding the data folder, for the disk alarm (RabbitMQ's
//! `disk_free_limit`): below the limit, publishers are blocked before a write can fail.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Bytes available to this (unprivileged) process on the file system of `path`, or None
/// when the file system cannot be asked.
pub fn available_bytes(path: &Path) -> Option<u64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_temp_folder_has_some_space_and_a_missing_path_has_none() {
        let free = available_bytes(&std::env::temp_dir()).expect("statvfs of the temp dir");
        assert!(free > 0);
        assert_eq!(available_bytes(Path::new("/no/such/folder/here")), None);
    }
}

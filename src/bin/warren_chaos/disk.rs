//! Disk faults (`--extended`): each node's data folder is its own small ext4 file system,
//! a loop-mounted image in the run's folder, so one node's disk can be filled up or slowed
//! down without touching the others or the machine.
//!
//! - **Full:** a filler file takes every free block (root's reserve too: the node runs as
//!   root), and is deleted when the fault ends.
//! - **Slow:** the node's process moves into a blkio cgroup (v1) whose throttle limits
//!   writes to its loop device; fsync waits for them, so every group commit is slow.
//!
//! Every mount and cgroup made is remembered until undone, so the run's end, an error and
//! Ctrl-C all remove what is left ([`remove_all`]); a failing run's image stays in its folder.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

/// Size of each node's file system: room for a run's queues many times over, small enough
/// to fill in a moment.
const IMAGE_BYTES: u64 = 384 << 20;

static MOUNTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static CGROUPS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

const BLKIO: &str = "/sys/fs/cgroup/blkio";

/// `mkfs.ext4`, `mount` and a blkio cgroup hierarchy, or an error saying what is missing.
pub fn check_available() -> Result<()> {
    for tool in ["mkfs.ext4", "mount", "umount"] {
        let ok = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !ok {
            bail!("--extended needs `{tool}` (e2fsprogs, mount)");
        }
    }
    if !Path::new(BLKIO).join("cgroup.procs").is_file() {
        bail!("--extended needs the cgroup v1 blkio controller at {BLKIO}");
    }
    Ok(())
}

/// Makes `data` a mount point of a fresh ext4 image `<data>.img`.
pub fn mount_fresh(data: &Path) -> Result<()> {
    let image = data.with_extension("img");
    let f = std::fs::File::create(&image).context("create the disk image")?;
    f.set_len(IMAGE_BYTES).context("size the disk image")?;
    drop(f);
    run("mkfs.ext4", &["-q", "-F", &image.display().to_string()])?;
    std::fs::create_dir_all(data)?;
    run(
        "mount",
        &[
            "-o",
            "loop",
            &image.display().to_string(),
            &data.display().to_string(),
        ],
    )?;
    lock(&MOUNTS).push(data.to_path_buf());
    Ok(())
}

/// Unmounts `data` (its loop device goes with it: `mount -o loop` sets autoclear).
pub fn unmount(data: &Path) -> Result<()> {
    run("umount", &[&data.display().to_string()])?;
    lock(&MOUNTS).retain(|m| m != data);
    Ok(())
}

/// A filler file that takes the file system's free space while this lives.
pub struct Full {
    filler: PathBuf,
}

impl Full {
    /// Fills `data`'s file system, to within a block or so. `data` must be a mount point
    /// (one of [`mount_fresh`]'s), never the machine's own disk.
    pub fn new(data: &Path) -> Result<Full> {
        let parent = data.parent().context("a data folder's parent")?;
        if std::fs::metadata(data)?.dev() == std::fs::metadata(parent)?.dev() {
            bail!(
                "{} is not a file system of its own: not filling it",
                data.display()
            );
        }
        let filler = data.join("chaos-filler");
        let f = std::fs::File::create(&filler).context("create the filler")?;
        // SAFETY: an all-zero statvfs is a valid out-parameter; the path is NUL-terminated.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(data.as_os_str().as_encoded_bytes())?;
        // SAFETY: as above.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            bail!("statvfs {}", data.display());
        }
        let mut len = (st.f_bfree as u64) * (st.f_frsize as u64);
        // fallocate may want a little room for its own extent blocks: back off until it fits.
        use std::os::fd::AsRawFd;
        loop {
            // SAFETY: a valid open file descriptor and in-range sizes.
            let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) };
            if rc == 0 {
                break;
            }
            if len < (1 << 20) {
                bail!("fallocate the filler: {}", std::io::Error::last_os_error());
            }
            len -= 256 << 10;
        }
        Ok(Full { filler })
    }

    /// Frees the space again.
    pub fn end(self) -> Result<()> {
        std::fs::remove_file(&self.filler).context("remove the filler")?;
        std::mem::forget(self);
        Ok(())
    }
}

impl Drop for Full {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.filler);
    }
}

/// A throttle on process `pid`'s writes to `data`'s device while this lives.
pub struct Slow {
    cgroup: PathBuf,
}

impl Slow {
    /// At most `bytes_per_s` and `iops` writes per second to `data`'s loop device.
    pub fn new(pid: u32, data: &Path, bytes_per_s: u64, iops: u64) -> Result<Slow> {
        let dev = std::fs::metadata(data)
            .with_context(|| format!("stat {}", data.display()))?
            .dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let cgroup = Path::new(BLKIO).join(format!("warren-chaos-{}-{pid}", std::process::id()));
        std::fs::create_dir_all(&cgroup).context("make a blkio cgroup")?;
        lock(&CGROUPS).push(cgroup.clone());
        let slow = Slow { cgroup };
        std::fs::write(
            slow.cgroup.join("blkio.throttle.write_bps_device"),
            format!("{major}:{minor} {bytes_per_s}"),
        )
        .context("set write_bps_device")?;
        std::fs::write(
            slow.cgroup.join("blkio.throttle.write_iops_device"),
            format!("{major}:{minor} {iops}"),
        )
        .context("set write_iops_device")?;
        std::fs::write(slow.cgroup.join("cgroup.procs"), pid.to_string())
            .context("move the node into the blkio cgroup")?;
        Ok(slow)
    }

    /// Lifts the throttle: the node's process goes back to the root group.
    pub fn end(self) -> Result<()> {
        let r = release(&self.cgroup);
        std::mem::forget(self);
        r
    }
}

impl Drop for Slow {
    fn drop(&mut self) {
        let _ = release(&self.cgroup);
    }
}

fn release(cgroup: &Path) -> Result<()> {
    // Every task back to the root group; the group can then go.
    if let Ok(procs) = std::fs::read_to_string(cgroup.join("cgroup.procs")) {
        for pid in procs.split_whitespace() {
            let _ = std::fs::write(Path::new(BLKIO).join("cgroup.procs"), pid);
        }
    }
    std::fs::remove_dir(cgroup).with_context(|| format!("remove {}", cgroup.display()))?;
    lock(&CGROUPS).retain(|c| c != cgroup);
    Ok(())
}

/// Undoes every cgroup and mount this process made that is still there.
pub fn remove_all() {
    let cgroups: Vec<PathBuf> = lock(&CGROUPS).clone();
    for c in cgroups {
        if let Err(e) = release(&c) {
            eprintln!("warren-chaos: {e:#}");
        }
    }
    let mounts: Vec<PathBuf> = lock(&MOUNTS).clone();
    for m in mounts {
        if let Err(e) = unmount(&m) {
            eprintln!("warren-chaos: could not unmount {}: {e:#}", m.display());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(tool: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {tool}"))?;
    if !out.status.success() {
        bail!(
            "{tool} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

//! A hang guard for tests that run node processes. Every wait in those tests is meant to be
//! bounded, but one unbounded await (or a node that never answers one) once hung CI until
//! its 90-minute limit, with nothing printed but the test's name. The watchdog turns such a
//! hang into a failure that says what it saw: after `WARREN_TEST_HANG_SECS` (900 s by
//! default) it writes the nodes' last log lines straight to stderr (libtest's capture would
//! swallow them), kills every process started from the cluster's directory (the test's
//! awaits then fail with connection errors) and, if the test still has not let go of the
//! cluster a minute later, aborts the test binary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Held by a [`super::procs::Cluster`]; dropping it stands the watchdog down.
pub struct Watchdog {
    released: Arc<(Mutex<bool>, Condvar)>,
}

/// How long a test may hold a cluster.
fn limit() -> Duration {
    let secs = std::env::var("WARREN_TEST_HANG_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(900);
    Duration::from_secs(secs)
}

impl Watchdog {
    /// Watches the cluster whose configs, data and logs are under `dir`.
    pub fn start(dir: PathBuf) -> Watchdog {
        let released = Arc::new((Mutex::new(false), Condvar::new()));
        let watched = released.clone();
        let test = std::thread::current()
            .name()
            .unwrap_or("a test")
            .to_string();
        std::thread::spawn(move || {
            let limit = limit();
            if wait_released(&watched, limit) {
                return;
            }
            let mut report = format!(
                "\nWATCHDOG: {test} still holds the cluster in {} after {limit:?}: it hangs. \
                 Killing its nodes.\n",
                dir.display()
            );
            report.push_str(&log_tails(&dir, 40));
            let _ = std::io::stderr().write_all(report.as_bytes());
            kill_processes_under(&dir);
            if wait_released(&watched, Duration::from_secs(60)) {
                return;
            }
            let _ = std::io::stderr().write_all(
                format!(
                    "WATCHDOG: {test} did not end a minute after its nodes were killed: aborting\n"
                )
                .as_bytes(),
            );
            std::process::abort();
        });
        Watchdog { released }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.released;
        if let Ok(mut released) = lock.lock() {
            *released = true;
        }
        cv.notify_all();
    }
}

/// Whether the watchdog was released within `wait`.
fn wait_released(state: &(Mutex<bool>, Condvar), wait: Duration) -> bool {
    let (lock, cv) = state;
    let Ok(guard) = lock.lock() else {
        return true;
    };
    match cv.wait_timeout_while(guard, wait, |released| !*released) {
        Ok((released, _)) => *released,
        Err(_) => true,
    }
}

/// The last `lines` lines of every `*.log` in `dir`.
fn log_tails(dir: &Path, lines: usize) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut logs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        out.push_str(&format!("--- last lines of {}\n", log.display()));
        for l in &all[all.len().saturating_sub(lines)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// SIGKILL to every process whose command line names `dir` (the nodes: `--config DIR/…`).
fn kill_processes_under(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            // SAFETY: a signal to a process of our own cluster, found by its command line.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

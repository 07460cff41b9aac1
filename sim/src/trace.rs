//! The run's trace: one line per event, stamped with simulated time only, so two runs of the
//! same seed can be compared byte for byte.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Inner {
    lines: Mutex<Vec<String>>,
    /// Simulated time (ms) for lines logged from outside any host (the harness).
    harness_now_ms: AtomicU64,
}

/// A shared, append-only event log. Clones share it.
#[derive(Clone, Default)]
pub struct Trace {
    inner: Arc<Inner>,
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Sets the time stamped on lines logged by the harness (outside any host).
    pub fn set_harness_time(&self, ms: u64) {
        self.inner.harness_now_ms.store(ms, Ordering::SeqCst);
    }

    /// Appends `line`, stamped with the simulated time.
    pub fn log(&self, line: impl AsRef<str>) {
        let ms = match turmoil::sim_elapsed() {
            Some(d) => d.as_millis() as u64,
            None => self.inner.harness_now_ms.load(Ordering::SeqCst),
        };
        let mut lines = self.inner.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines.push(format!("{ms:>7}ms {}", line.as_ref()));
    }

    /// Every line so far.
    pub fn lines(&self) -> Vec<String> {
        self.inner
            .lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

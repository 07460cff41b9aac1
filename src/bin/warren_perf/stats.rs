//! Shared counters, latency histograms and the run-wide stop signal.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use hdrhistogram::Histogram;
use tokio::sync::watch;

/// Latencies are recorded in nanoseconds, 3 significant digits, up to 1 hour.
pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds")
}

pub struct Latency {
    pub interval: Histogram<u64>,
    pub total: Histogram<u64>,
}

pub struct Stats {
    epoch: Instant,
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub confirmed: AtomicU64,
    pub nacked: AtomicU64,
    pub returned: AtomicU64,
    /// Time of the last delivery, ns since the epoch (drain detection).
    pub last_recv_ns: AtomicU64,
    /// Producers that finished their --count (and got its confirms).
    pub producers_done: AtomicU64,
    /// When the last of them finished, ns since the epoch.
    pub producers_done_ns: AtomicU64,
    pub latency: Mutex<Latency>,
    pub confirm_latency: Mutex<Histogram<u64>>,
    /// The longest confirm since the last per-second line, ns.
    pub confirm_interval_max_ns: AtomicU64,
    stopping: AtomicBool,
    stop_tx: watch::Sender<bool>,
    error: Mutex<Option<String>>,
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            epoch: Instant::now(),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            nacked: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            last_recv_ns: AtomicU64::new(0),
            producers_done: AtomicU64::new(0),
            producers_done_ns: AtomicU64::new(0),
            latency: Mutex::new(Latency {
                interval: new_hist(),
                total: new_hist(),
            }),
            confirm_latency: Mutex::new(new_hist()),
            confirm_interval_max_ns: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            stop_tx: watch::channel(false).0,
            error: Mutex::new(None),
        }
    }

    /// Nanoseconds since the process-wide epoch: the timestamp carried in
    /// each message body, comparable across all connections of this process.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The Instant `ns` nanoseconds after the epoch.
    pub fn at(&self, ns: u64) -> Instant {
        self.epoch + std::time::Duration::from_nanos(ns)
    }

    #[inline]
    pub fn stopping(&self) -> bool {
        self.stopping.load(Relaxed)
    }

    pub fn stop_rx(&self) -> watch::Receiver<bool> {
        self.stop_tx.subscribe()
    }

    pub fn request_stop(&self) {
        self.stopping.store(true, Relaxed);
        self.stop_tx.send_replace(true);
    }

    /// Record the first fatal error and stop the run.
    pub fn fail(&self, msg: String) {
        {
            let mut e = self.error.lock().unwrap();
            if e.is_none() {
                *e = Some(msg);
            }
        }
        self.request_stop();
    }

    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap().clone()
    }

    pub fn record_latencies(&self, ns: &[u64]) {
        if ns.is_empty() {
            return;
        }
        let mut l = self.latency.lock().unwrap();
        for &v in ns {
            l.interval.saturating_record(v.max(1));
            l.total.saturating_record(v.max(1));
        }
    }

    pub fn record_confirm_latencies(&self, ns: &[u64]) {
        if ns.is_empty() {
            return;
        }
        let mut h = self.confirm_latency.lock().unwrap();
        for &v in ns {
            h.saturating_record(v.max(1));
        }
        drop(h);
        if let Some(&max) = ns.iter().max() {
            self.confirm_interval_max_ns.fetch_max(max, Relaxed);
        }
    }
}

/// Value at quantile `q` in microseconds (histogram holds nanoseconds).
pub fn q_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// CPU time (user, system) consumed by this process so far, in seconds.
/// Linux only (reads /proc/self/stat); None elsewhere.
pub fn process_cpu() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the ")" that ends the command name; utime is field 14, stime 15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = 100.0; // USER_HZ, 100 on every mainstream Linux
    let utime = f.get(11)?.parse::<f64>().ok()? / ticks;
    let stime = f.get(12)?.parse::<f64>().ok()? / ticks;
    Some((utime, stime))
}

/// Minimal JSON object writer (serde_json is not available).
pub struct Json {
    out: String,
    first: bool,
}

impl Json {
    pub fn new() -> Json {
        Json {
            out: String::from("{"),
            first: true,
        }
    }
    fn key(&mut self, k: &str) {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        self.out.push_str(&quote(k));
        self.out.push(':');
    }
    /// A number rounded to one decimal.
    pub fn num(&mut self, k: &str, v: f64) -> &mut Self {
        self.num_prec(k, v, 1)
    }
    pub fn num_prec(&mut self, k: &str, v: f64, decimals: usize) -> &mut Self {
        self.key(k);
        if v.is_finite() {
            let s = format!("{v:.decimals$}");
            let s = if s.contains('.') {
                s.trim_end_matches('0').trim_end_matches('.')
            } else {
                &s
            };
            self.out.push_str(if s == "-0" { "0" } else { s });
        } else {
            self.out.push_str("null");
        }
        self
    }
    pub fn int(&mut self, k: &str, v: u64) -> &mut Self {
        self.key(k);
        self.out.push_str(&v.to_string());
        self
    }
    pub fn boolean(&mut self, k: &str, v: bool) -> &mut Self {
        self.key(k);
        self.out.push_str(if v { "true" } else { "false" });
        self
    }
    pub fn str(&mut self, k: &str, v: Option<&str>) -> &mut Self {
        self.key(k);
        match v {
            Some(s) => self.out.push_str(&quote(s)),
            None => self.out.push_str("null"),
        }
        self
    }
    pub fn raw(&mut self, k: &str, json: &str) -> &mut Self {
        self.key(k);
        self.out.push_str(json);
        self
    }
    pub fn finish(&mut self) -> String {
        let mut s = std::mem::take(&mut self.out);
        s.push('}');
        s
    }
}

fn quote(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

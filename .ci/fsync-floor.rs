//! The CPU floor of a confirmed, mirrored 1 KiB message on this machine (issue 18,
//! docs/performance.md "CPU at everyday rates"). Not Warren: the least any broker must do
//! per message with three copies on disk, in one process of plain threads and blocking
//! calls, no runtime and no hand-offs between threads of a node.
//!
//! A client thread sends 1 KiB messages over loopback TCP to node A at a fixed rate. For
//! each message A sends it to B and C, appends it to its own file with `O_DIRECT` and
//! `fdatasync`, reads B's and C's acks (each appended and `fdatasync`ed its copy first),
//! then writes the confirm back. Every message is a round of its own, as at 1,000 msg/s
//! in Warren. At the end it prints the CPU time of A, B and C (from
//! `/proc/thread-self/schedstat`: time on a CPU, user and kernel) per message and as cores,
//! and the confirm latency.
//!
//! Only std: `bash .ci/probe-floor.sh RATE SECS ACKS` compiles it with rustc and runs it.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const SIZE: usize = 1024;
/// `O_DIRECT` on Linux x86_64 and aarch64 (std has no constant for it).
#[cfg(target_arch = "x86_64")]
const O_DIRECT: i32 = 0o40000;
#[cfg(target_arch = "aarch64")]
const O_DIRECT: i32 = 0o200000;
const BLOCK: usize = 4096;
/// The first byte of a record that is written but not synced.
const UNSYNCED: u8 = 2;

/// Nanoseconds this thread has spent on a CPU (`schedstat`), and its utime + stime in
/// clock ticks (`stat`, what the Warren benchmarks count).
fn thread_cpu() -> (u64, u64) {
    let ns = std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|f| f.parse().ok()))
        .unwrap_or(0);
    let ticks = std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|s| {
            let f: Vec<u64> = s[s.rfind(')')? + 2..]
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|x| x.parse().ok())
                .collect();
            Some(f.iter().sum())
        })
        .unwrap_or(0);
    (ns, ticks)
}

fn since(start: (u64, u64)) -> (u64, u64) {
    let now = thread_cpu();
    (now.0 - start.0, now.1 - start.1)
}

/// A 4 KiB-aligned block for `O_DIRECT` writes.
struct Aligned(Box<[u8]>, usize);

impl Aligned {
    fn new() -> Aligned {
        let raw = vec![0u8; BLOCK * 2].into_boxed_slice();
        let off = (BLOCK - (raw.as_ptr() as usize % BLOCK)) % BLOCK;
        Aligned(raw, off)
    }
    fn block(&mut self) -> &mut [u8] {
        &mut self.0[self.1..self.1 + BLOCK]
    }
}

/// Appends each message as one block and syncs it, as a queue's journal would.
struct Log {
    file: std::fs::File,
    at: u64,
    buf: Aligned,
}

impl Log {
    fn open(path: &Path) -> Log {
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .custom_flags(O_DIRECT)
            .open(path)
            .expect("open with O_DIRECT");
        Log {
            file,
            at: 0,
            buf: Aligned::new(),
        }
    }
    fn append(&mut self, msg: &[u8]) {
        self.buf.block()[..msg.len()].copy_from_slice(msg);
        self.file
            .write_all_at(self.buf.block(), self.at)
            .expect("pwrite");
        // Byte 0 says whether the record waits for the disk: a publish does, an ack
        // does only with `synced` (as Warren's rounds of acks do today).
        if msg[0] != UNSYNCED {
            self.file.sync_data().expect("fdatasync");
        }
        self.at += BLOCK as u64;
    }
}

/// A mirror: receive, append, sync, ack. Returns its CPU time.
fn mirror(mut link: TcpStream, path: PathBuf, frames: u64) -> (u64, u64) {
    let mut log = Log::open(&path);
    let mut msg = [0u8; SIZE];
    let start = thread_cpu();
    for _ in 0..frames {
        link.read_exact(&mut msg).expect("mirror read");
        log.append(&msg);
        link.write_all(&msg[..8]).expect("mirror ack");
    }
    since(start)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 || !["none", "synced", "unsynced"].contains(&args[4].as_str()) {
        eprintln!("usage: fsync-floor DIR RATE SECS none|synced|unsynced");
        std::process::exit(2);
    }
    // Each message's consumer ack as a round of its own after the publish's: none,
    // written and synced everywhere (Warren), or written without a sync (RabbitMQ's
    // queue index).
    let ack_kind = match args[4].as_str() {
        "none" => None,
        "synced" => Some(1u8),
        _ => Some(UNSYNCED),
    };
    let per_msg: u64 = if ack_kind.is_some() { 2 } else { 1 };
    let dir = PathBuf::from(&args[1]);
    let rate: u64 = args[2].parse().expect("RATE");
    let secs: u64 = args[3].parse().expect("SECS");
    let n = rate * secs;
    let frames = n * per_msg;

    let listen = |_: ()| TcpListener::bind("127.0.0.1:0").expect("bind");
    let (la, lb, lc) = (listen(()), listen(()), listen(()));
    let (pa, pb, pc) = (
        la.local_addr().unwrap(),
        lb.local_addr().unwrap(),
        lc.local_addr().unwrap(),
    );
    let mirrors: Vec<_> = [(lb, "b.log"), (lc, "c.log")]
        .into_iter()
        .map(|(l, name)| {
            let path = dir.join(name);
            thread::spawn(move || {
                let (s, _) = l.accept().expect("accept");
                s.set_nodelay(true).expect("nodelay");
                mirror(s, path, frames)
            })
        })
        .collect();
    let a_path = dir.join("a.log");
    let master = thread::spawn(move || {
        let (mut client, _) = la.accept().expect("accept");
        client.set_nodelay(true).expect("nodelay");
        let mut to: Vec<TcpStream> = [pb, pc]
            .iter()
            .map(|p| {
                let s = TcpStream::connect(p).expect("connect mirror");
                s.set_nodelay(true).expect("nodelay");
                s
            })
            .collect();
        let mut log = Log::open(&a_path);
        let (mut msg, mut ack) = ([0u8; SIZE], [0u8; 8]);
        let start = thread_cpu();
        for _ in 0..frames {
            client.read_exact(&mut msg).expect("master read");
            for m in to.iter_mut() {
                m.write_all(&msg).expect("to mirror");
            }
            log.append(&msg);
            for m in to.iter_mut() {
                m.read_exact(&mut ack).expect("mirror ack");
            }
            client.write_all(&msg[..8]).expect("confirm");
        }
        since(start)
    });

    let client = TcpStream::connect(pa).expect("connect A");
    client.set_nodelay(true).expect("nodelay");
    let mut reader = client.try_clone().expect("clone");
    let (sent_tx, sent_rx) = mpsc::channel::<Instant>();
    let confirms = thread::spawn(move || {
        let mut lat = Vec::with_capacity(n as usize);
        let mut ack = [0u8; 8];
        for _ in 0..n {
            reader.read_exact(&mut ack).expect("confirm read");
            let sent = sent_rx.recv().expect("sent time");
            lat.push(sent.elapsed().as_micros() as u64);
            for _ in 1..per_msg {
                reader.read_exact(&mut ack).expect("ack's reply read");
            }
        }
        lat
    });
    let began = Instant::now();
    let mut writer = client;
    let msg = [0u8; SIZE];
    let mut ack = [0u8; SIZE];
    ack[0] = ack_kind.unwrap_or(1);
    for i in 0..n {
        let due = began + Duration::from_nanos(i * 1_000_000_000 / rate.max(1));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        sent_tx.send(Instant::now()).expect("send time");
        writer.write_all(&msg).expect("publish");
        if ack_kind.is_some() {
            writer.write_all(&ack).expect("ack");
        }
    }
    let mut lat = confirms.join().expect("confirms");
    let wall = began.elapsed().as_secs_f64();
    let a = master.join().expect("master");
    let bc: Vec<(u64, u64)> = mirrors
        .into_iter()
        .map(|m| m.join().expect("mirror"))
        .collect();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let total = a.0 + bc[0].0 + bc[1].0;
    let ticks = a.1 + bc[0].1 + bc[1].1;
    println!(
        "rate {} msg/s, acks {}, for {:.1} s: {} messages, {:.0} confirmed msg/s",
        rate,
        args[4],
        wall,
        n,
        n as f64 / wall
    );
    println!(
        "cpu µs per message: A {:.1}, B {:.1}, C {:.1}, sum {:.1}; cores summed {:.3} \
         (utime + stime: {} ticks, {:.3} cores)",
        a.0 as f64 / n as f64 / 1e3,
        bc[0].0 as f64 / n as f64 / 1e3,
        bc[1].0 as f64 / n as f64 / 1e3,
        total as f64 / n as f64 / 1e3,
        total as f64 / 1e9 / wall,
        ticks,
        ticks as f64 / 100.0 / wall
    );
    println!(
        "confirm latency µs: p50 {} p99 {} max {}",
        pct(0.5),
        pct(0.99),
        lat[lat.len() - 1]
    );
}

//! Issue 6's failover benchmark: the time from `kill -9` (or, with `--stop`, SIGTERM) of a
//! mirrored queue's master node to the first publisher confirm from the new master.
//!
//! `cargo bench --bench mirrored` starts three release `warren` processes on
//! 127.0.87.{1,2,3} (data in a temporary folder, default config plus `[cluster]`), sets the
//! policy `{"ha-mode":"all","ha-sync-mode":"automatic"}` on `^ha\.`, declares the durable
//! queue `ha.failover` on node 1 (client-local: its master is node 1), waits until both
//! mirrors are synchronised, and publishes persistent 64-byte messages with confirms, one at a
//! time, through node 2 (whose connection survives node 1). After 2 s it kills node 1 with
//! SIGKILL and measures until 200 publishes have been confirmed after the kill. It prints the
//! time from the kill to the first ack of a publish sent after it, and the longest time
//! without an ack (from the last ack before the kill on: with `--stop`, acks from the old
//! master can follow the signal, so this is the outage a client sees). Each run uses a fresh
//! cluster. Options (after `--`):
//!
//!   --runs N                  runs (fresh cluster each) [1]
//!   --peer-timeout-ms MS      `[cluster] peer_timeout_ms` [default config: 5000]
//!   --heartbeat-ms MS         `[cluster] heartbeat_ms` [default config: 250]
//!   --master N                the node that declares the queue (its master) and is killed
//!                             [1]; the publisher uses the next node. Node 1 initialises the
//!                             cluster, so it is normally also the Raft leader: killing it
//!                             adds a leader election before `NodeDown` can commit.
//!   --publisher-on-master     the publisher connects to the master's node, so the kill drops
//!                             its connection: it reconnects to the next node (connect,
//!                             channel, `confirm.select`, the queue's declare again), the
//!                             path a client of the lost node takes (issue 18's target)
//!   --pause                   the master's node vanishes: SIGSTOP instead of SIGKILL (its
//!                             sockets stay open and nothing refuses, as with a host that
//!                             lost power or a cut cable), so only `peer_timeout_ms` of
//!                             silence finds it; killed at the end of the run
//!   --stop                    a controlled stop: SIGTERM instead of SIGKILL (the node hands
//!                             its mirrored queues over to a synchronised mirror, then stops);
//!                             the figures then count from the signal, and the stopping
//!                             node's own log lines are shown too
//!
//! External mode, for another broker (RabbitMQ): the cluster and the queue's policy exist;
//!
//!   --external --uri URI[,URI...] --declare-uri URI --queue Q --kill-pid PID
//!
//! declares Q (durable) through --declare-uri (RabbitMQ's client-local locator puts its master
//! on that node), publishes through the first --uri (reconnecting to the next ones if the
//! connection drops) and kills PID (the OS process of the master's node) with SIGKILL (SIGTERM
//! with `--stop`).
//!
//! It prints figures; it asserts nothing about timings. `WARREN_BENCH_LOG` sets the nodes'
//! `RUST_LOG` (default `info`); `KEEP_LOGS=1` keeps their logs.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amq_protocol::types::FieldTable;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const IPS: [&str; 3] = ["127.0.87.1", "127.0.87.2", "127.0.87.3"];
/// Confirms after the kill before a run ends.
const ACKS_AFTER: usize = 200;

struct Opts {
    runs: usize,
    master: usize,
    peer_timeout_ms: Option<u64>,
    heartbeat_ms: Option<u64>,
    external: bool,
    uris: Vec<String>,
    declare_uri: Option<String>,
    queue: String,
    kill_pid: Option<i32>,
    stop: bool,
    pause: bool,
    publisher_on_master: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        runs: 1,
        master: 1,
        peer_timeout_ms: None,
        heartbeat_ms: None,
        external: false,
        uris: Vec::new(),
        declare_uri: None,
        queue: "ha.failover".into(),
        kill_pid: None,
        stop: false,
        pause: false,
        publisher_on_master: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--runs" => o.runs = val().parse().expect("--runs N"),
            "--master" => o.master = val().parse().expect("--master 1|2|3"),
            "--peer-timeout-ms" => o.peer_timeout_ms = Some(val().parse().expect("ms")),
            "--heartbeat-ms" => o.heartbeat_ms = Some(val().parse().expect("ms")),
            "--external" => o.external = true,
            "--uri" => o.uris = val().split(',').map(String::from).collect(),
            "--declare-uri" => o.declare_uri = Some(val()),
            "--queue" => o.queue = val(),
            "--kill-pid" => o.kill_pid = Some(val().parse().expect("pid")),
            "--stop" => o.stop = true,
            "--pause" => o.pause = true,
            "--publisher-on-master" => o.publisher_on_master = true,
            "--bench" => {}
            other => panic!("unknown option {other} (see benches/mirrored.rs)"),
        }
    }
    o
}

// ------------------------------------------------------------------ the Warren cluster

struct Nodes {
    dir: PathBuf,
    children: Vec<Option<Child>>,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::env::var("KEEP_LOGS").is_err() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Nodes {
    fn log(&self, id: usize) -> String {
        let raw =
            std::fs::read_to_string(self.dir.join(format!("node{id}.log"))).unwrap_or_default();
        strip_ansi(&raw)
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn config(id: usize, data: &std::path::Path, o: &Opts) -> String {
    let mut members = String::new();
    for (i, ip) in IPS.iter().enumerate() {
        members.push_str(&format!(
            "[[cluster.initial_members]]\nid = {}\nlink = \"{ip}:25672\"\n\n",
            i + 1
        ));
    }
    let mut timing = String::new();
    if let Some(ms) = o.peer_timeout_ms {
        timing.push_str(&format!("peer_timeout_ms = {ms}\n"));
    }
    if let Some(ms) = o.heartbeat_ms {
        timing.push_str(&format!("heartbeat_ms = {ms}\n"));
    }
    let ip = IPS[id - 1];
    format!(
        "[node]\nname = \"warren{id}@bench\"\ndata_dir = \"{}\"\n\n[amqp]\nlisten = \"{ip}:5672\"\n\n\
         [admin]\nlisten = \"{ip}:5679\"\n\n[management]\nlisten = \"{ip}:15672\"\n\n[prometheus]\nlisten = \"{ip}:15692\"\n\n[cluster]\nnode_id = {id}\ncluster_id = \"bench-mirrored\"\n\
         listen = \"{ip}:25672\"\n{timing}\n{members}",
        data.display()
    )
}

fn start(o: &Opts, run: usize) -> Nodes {
    let dir = std::env::temp_dir().join(format!(
        "warren-bench-mirrored-{}-{run}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    let mut children = Vec::new();
    for id in 1..=3 {
        let cfg = dir.join(format!("node{id}.toml"));
        std::fs::write(&cfg, config(id, &dir.join(format!("data{id}")), o)).expect("config");
        let log = std::fs::File::create(dir.join(format!("node{id}.log"))).expect("log");
        children.push(Some(
            Command::new(env!("CARGO_BIN_EXE_warren"))
                .arg("--config")
                .arg(&cfg)
                .env(
                    "RUST_LOG",
                    std::env::var("WARREN_BENCH_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdout(log.try_clone().expect("log"))
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .expect("start warren"),
        ));
    }
    Nodes { dir, children }
}

fn uri(node: usize) -> String {
    format!("amqp://guest:guest@{}:5672/%2f", IPS[node - 1])
}

fn ctl(node: usize, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_warrenctl"))
        .args(["--node", &format!("{}:5679", IPS[node - 1])])
        .args(args)
        .output()
        .expect("warrenctl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn connect_retry(uri: &str) -> Connection {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(2),
            Connection::connect(uri, ConnectionProperties::default()),
        )
        .await
        {
            return c;
        }
        assert!(Instant::now() < deadline, "{uri} does not serve");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn declare(uri: &str, queue: &str) {
    let conn = connect_retry(uri).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let _ = conn.close(200, "bye".into()).await;
}

// ------------------------------------------------------------------ the measurement

#[derive(Default)]
struct Record {
    /// (publish sent, outcome time, acked) for every publish.
    events: Vec<(Instant, Instant, bool)>,
    errors: Vec<(Instant, String)>,
    reconnects: usize,
}

/// A connection to the first of `uris` from `start_at` on that serves: a channel in confirm
/// mode and the queue declared again (what a reconnecting client does).
async fn open(
    uris: &[String],
    start_at: usize,
    queue: &str,
) -> Option<(Connection, Channel, usize)> {
    for k in 0..uris.len() {
        let i = (start_at + k) % uris.len();
        let Ok(Ok(conn)) = tokio::time::timeout(
            Duration::from_secs(2),
            Connection::connect(&uris[i], ConnectionProperties::default()),
        )
        .await
        else {
            continue;
        };
        let Ok(ch) = conn.create_channel().await else {
            continue;
        };
        if ch
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .is_err()
        {
            continue;
        }
        let declared = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        if declared.is_ok() {
            return Some((conn, ch, i));
        }
    }
    None
}

/// Publishes one at a time with confirms until `ACKS_AFTER` acks after the kill (or 120 s).
async fn publisher(
    uris: Vec<String>,
    queue: String,
    killed: Arc<Mutex<Option<Instant>>>,
    rec: Arc<Mutex<Record>>,
) {
    let (mut conn, mut ch, mut at) = open(&uris, 0, &queue).await.expect("publisher connects");
    let body = vec![7u8; 64];
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut acks_after = 0;
    while acks_after < ACKS_AFTER && Instant::now() < deadline {
        let sent = Instant::now();
        let outcome = async {
            let confirm = ch
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .map_err(|e| e.to_string())?;
            match tokio::time::timeout(Duration::from_secs(60), confirm).await {
                Ok(Ok(c)) => Ok(c.is_ack()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no confirm within 60 s".into()),
            }
        }
        .await;
        let now = Instant::now();
        let after_kill = killed.lock().unwrap().is_some_and(|k| now > k);
        match outcome {
            Ok(acked) => {
                rec.lock().unwrap().events.push((sent, now, acked));
                if acked && after_kill {
                    acks_after += 1;
                }
                if !acked {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Err(e) => {
                rec.lock().unwrap().errors.push((now, e));
                tokio::time::sleep(Duration::from_millis(5)).await;
                // A closed channel (or connection): a new channel, else the next node.
                if conn.status().connected() {
                    if let Ok(c) = conn.create_channel().await {
                        if c.confirm_select(ConfirmSelectOptions::default())
                            .await
                            .is_ok()
                        {
                            ch = c;
                            continue;
                        }
                    }
                }
                if let Some((c, h, i)) = open(&uris, at + 1, &queue).await {
                    (conn, ch, at) = (c, h, i);
                    rec.lock().unwrap().reconnects += 1;
                }
            }
        }
    }
    let _ = conn.close(200, "bye".into()).await;
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs the publisher, kills (or stops: `what` names it) after 2 s, and prints the figures;
/// returns (kill → first ack of a publish sent after the kill, the longest time without an
/// ack from the last one before the kill on) in ms.
async fn measure(
    uris: Vec<String>,
    queue: &str,
    what: &str,
    kill: impl FnOnce(),
) -> (Option<f64>, Option<f64>) {
    let killed = Arc::new(Mutex::new(None));
    let rec = Arc::new(Mutex::new(Record::default()));
    let task = tokio::spawn(publisher(
        uris,
        queue.to_string(),
        killed.clone(),
        rec.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let k = Instant::now();
    *killed.lock().unwrap() = Some(k);
    kill();
    let _ = task.await;
    let r = rec.lock().unwrap();
    let before: Vec<f64> = r
        .events
        .iter()
        .filter(|(s, t, a)| *a && *t < k && *s < k)
        .map(|(s, t, _)| ms(*t - *s))
        .collect();
    let mut sorted = before.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let first_any = r
        .events
        .iter()
        .find(|(_, t, a)| *a && *t > k)
        .map(|(_, t, _)| ms(*t - k));
    let first_new = r
        .events
        .iter()
        .find(|(s, _, a)| *a && *s > k)
        .map(|(_, t, _)| ms(*t - k));
    let nacks = r.events.iter().filter(|(_, t, a)| !*a && *t > k).count();
    let after: Vec<f64> = r
        .events
        .iter()
        .filter(|(s, _, a)| *a && *s > k)
        .map(|(s, t, _)| ms(*t - *s))
        .collect();
    let mut after_sorted = after.clone();
    after_sorted.sort_by(f64::total_cmp);
    let p50_after = after_sorted
        .get(after_sorted.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    // The longest time without an ack, from the last ack before the kill on.
    let mut ack_times: Vec<Instant> = r
        .events
        .iter()
        .filter(|(_, _, a)| *a)
        .map(|(_, t, _)| *t)
        .collect();
    ack_times.sort();
    let widest = ack_times
        .windows(2)
        .filter(|w| w[1] > k)
        .max_by_key(|w| w[1] - w[0]);
    let gap = widest.map(|w| {
        let from = if w[0] >= k {
            format!("+{:.1}", ms(w[0] - k))
        } else {
            format!("-{:.1}", ms(k - w[0]))
        };
        format!(
            "{:.1} ms (from {what} {from} ms to +{:.1} ms)",
            ms(w[1] - w[0]),
            ms(w[1] - k)
        )
    });
    let fmt = |v: Option<f64>| v.map_or("none".to_string(), |v| format!("{v:.1} ms"));
    println!(
        "  {what} -> first ack: {} (of a publish sent after the {what}: {}); longest time without \
         an ack: {}; acks before the {what} {} (confirm p50 {p50:.2} ms), after {} (confirm p50 \
         {p50_after:.2} ms); nacks after the {what} {nacks}; errors {}; reconnects {}",
        fmt(first_any),
        fmt(first_new),
        gap.unwrap_or_else(|| "none".into()),
        before.len(),
        after.len(),
        r.errors.len(),
        r.reconnects
    );
    for (t, e) in r.errors.iter().take(5) {
        println!(
            "    error at {what} + {:.1} ms: {e}",
            ms(t.saturating_duration_since(k))
        );
    }
    (first_new, widest.map(|w| ms(w[1] - w[0])))
}

fn summary(label: &str, metric: &str, v: &[f64]) {
    if v.is_empty() {
        println!("{label}: no run recovered");
        return;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    println!(
        "{label}: {metric}, ms: min {:.1}  median {:.1}  max {:.1}  ({} runs: {})",
        s[0],
        s[s.len() / 2],
        s[s.len() - 1],
        s.len(),
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// Seconds since midnight of a log line's RFC 3339 UTC timestamp ("2026-11-30T09:54:26.744453Z").
fn log_tod(line: &str) -> Option<f64> {
    let t = line.split_whitespace().next()?;
    let time = t.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

fn warren(o: &Opts, rt: &tokio::runtime::Runtime) {
    let settings = format!(
        "peer_timeout_ms {}, heartbeat_ms {}",
        o.peer_timeout_ms
            .map_or("default (5000)".into(), |v| v.to_string()),
        o.heartbeat_ms
            .map_or("default (250)".into(), |v| v.to_string())
    );
    assert!(
        !(o.pause && (o.stop || o.publisher_on_master)),
        "--pause goes with neither --stop nor --publisher-on-master"
    );
    let what = if o.stop {
        "SIGTERM"
    } else if o.pause {
        "SIGSTOP"
    } else {
        "kill"
    };
    println!(
        "Warren, 3 nodes on {IPS:?}, {settings}, master ({}) on node {}",
        if o.stop {
            "stopped with SIGTERM"
        } else if o.pause {
            "paused with SIGSTOP"
        } else {
            "killed"
        },
        o.master
    );
    let (mut results, mut gaps) = (Vec::new(), Vec::new());
    for run in 1..=o.runs {
        let mut nodes = start(o, run);
        let killed_wall = Arc::new(Mutex::new(None::<std::time::SystemTime>));
        // With --stop: the thread that waits for the stopping node's exit (its time, from the signal).
        let exited = Arc::new(Mutex::new(None::<std::thread::JoinHandle<Duration>>));
        let got = rt.block_on(async {
            for n in 1..=3 {
                drop(connect_retry(&uri(n)).await);
            }
            let policy = ctl(
                1,
                &[
                    "set_policy",
                    "ha",
                    "^ha\\.",
                    r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
                    "--apply-to",
                    "queues",
                ],
            );
            assert!(policy.contains("Setting policy"), "set_policy: {policy}");
            let (m, p) = (o.master, o.master % 3 + 1);
            let q = 6 - m - p;
            declare(&uri(m), &o.queue).await;
            let t = Instant::now();
            loop {
                let log = nodes.log(m);
                if log.contains(&format!("node={p} synchronised=true"))
                    && log.contains(&format!("node={q} synchronised=true"))
                {
                    break;
                }
                assert!(t.elapsed() < Duration::from_secs(30), "mirrors not synchronised");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let leader = ctl(p, &["cluster_status"])
                .lines()
                .map(|l| l.split('\t').map(String::from).collect::<Vec<_>>())
                .find(|c| c.get(3).map(String::as_str) == Some("leader"))
                .map_or("?".to_string(), |c| c[1].clone());
            let uris = if o.publisher_on_master {
                vec![uri(m), uri(p), uri(q)]
            } else {
                vec![uri(p), uri(q)]
            };
            let on = if o.publisher_on_master { m } else { p };
            println!("run {run}: master on node {m} (Raft leader: node {leader}), both mirrors synchronised; publisher on node {on}");
            let pid = nodes.children[m - 1].as_ref().map(|c| c.id() as i32);
            // A paused node stays in `nodes`, which kills it at the end.
            let victim = if o.pause {
                None
            } else {
                nodes.children[m - 1].take()
            };
            let killed_wall = killed_wall.clone();
            let (stop, pause, exited) = (o.stop, o.pause, exited.clone());
            let got = measure(uris, &o.queue, what, move || {
                *killed_wall.lock().unwrap() = Some(std::time::SystemTime::now());
                if pause {
                    // SAFETY: kill(2) of our own child.
                    unsafe {
                        libc::kill(pid.expect("the master's node"), libc::SIGSTOP);
                    }
                    return;
                }
                let mut c = victim.expect("the master's node");
                if stop {
                    let at = Instant::now();
                    // SAFETY: kill(2) of our own child.
                    unsafe {
                        libc::kill(c.id() as i32, libc::SIGTERM);
                    }
                    *exited.lock().unwrap() = Some(std::thread::spawn(move || {
                        let _ = c.wait();
                        at.elapsed()
                    }));
                } else {
                    let _ = c.kill(); // SIGKILL
                    let _ = c.wait();
                }
            })
            .await;
            got
        });
        if let Some(h) = exited.lock().unwrap().take() {
            match h.join() {
                Ok(d) => println!("  the stopped node exited {:.1} ms after SIGTERM", ms(d)),
                Err(_) => println!("  the stopped node's wait failed"),
            }
        }
        let survivor = o.master % 3 + 1;
        let master = ctl(survivor, &["list_queues", "name", "pid"]);
        let master = master
            .lines()
            .find(|l| l.starts_with(&format!("{}\t", o.queue)))
            .unwrap_or("?");
        println!("  queue now: {master}");
        // Seconds since midnight UTC of the kill, to place the survivors' log lines.
        let kill_tod = killed_wall.lock().unwrap().map(|t| {
            let d = t.duration_since(std::time::UNIX_EPOCH).expect("clock");
            (d.as_secs() % 86400) as f64 + d.subsec_nanos() as f64 / 1e9
        });
        for id in (1..=3).filter(|&n| o.stop || n != o.master) {
            for line in nodes.log(id).lines().filter(|l| {
                l.contains("mirror promoted")
                    || l.contains("handing the queue over")
                    || l.contains("hand over")
                    || l.contains("shutting down")
                    || l.contains("node stopped")
                    || l.contains("link closed")
                    || l.contains("promoting a mirror")
                    || l.contains("NodeDown")
                    || l.contains("node down")
                    || l.contains("is down")
                    || l.contains("election timeout passed")
                    || l.contains("calling an election")
            }) {
                let at = match (kill_tod, log_tod(line)) {
                    (Some(k), Some(t)) => format!("{what} + {:.0} ms", (t - k) * 1000.0),
                    _ => "?".into(),
                };
                println!("  node {id} ({at}): {}", line.trim());
            }
        }
        if let Some(v) = got.0 {
            results.push(v);
        }
        if let Some(v) = got.1 {
            gaps.push(v);
        }
        drop(nodes);
    }
    let label = format!(
        "Warren ({settings}, master on node {}{}{})",
        o.master,
        if o.pause { ", paused" } else { "" },
        if o.publisher_on_master {
            ", publisher on it, reconnecting"
        } else {
            ""
        }
    );
    summary(
        &label,
        &format!("{what} -> first confirm of a publish sent after it"),
        &results,
    );
    summary(&label, "longest time without a confirm", &gaps);
}

fn external(o: &Opts, rt: &tokio::runtime::Runtime) {
    assert!(!o.uris.is_empty(), "--uri is needed");
    let pid = o.kill_pid.expect("--kill-pid is needed");
    let what = if o.stop { "SIGTERM" } else { "kill" };
    let got = rt.block_on(async {
        if let Some(d) = &o.declare_uri {
            declare(d, &o.queue).await;
        }
        let sig = if o.stop { libc::SIGTERM } else { libc::SIGKILL };
        measure(o.uris.clone(), &o.queue, what, move || {
            // SAFETY: kill(2) with a pid given by the caller.
            unsafe {
                libc::kill(pid, sig);
            }
        })
        .await
    });
    summary(
        "external broker",
        &format!("{what} -> first confirm of a publish sent after it"),
        &got.0.into_iter().collect::<Vec<_>>(),
    );
    summary(
        "external broker",
        "longest time without a confirm",
        &got.1.into_iter().collect::<Vec<_>>(),
    );
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if o.external {
        external(&o, &rt);
    } else {
        warren(&o, &rt);
    }
}

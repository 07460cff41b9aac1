//! The 3-node loopback cluster, measured: metadata commit latency and queue.declare rate
//! (through AMQP, on the leader and on a follower), and publish/consume throughput with the
//! queue on the clients' node versus publishing on one node and consuming on another with
//! the queue on a third.
//!
//! `cargo bench --bench cluster` (add `-- --quick` for a short run). It starts three release
//! `warren` processes on 127.0.77.{1,2,3} with data in a temporary folder (fsync on, as
//! configured by default), drives declares with lapin, and runs `warren-perf` for throughput.
//! Figures go to stdout; `docs/performance.md` keeps the reference run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::types::FieldTable;
use lapin::options::QueueDeclareOptions;
use lapin::{Connection, ConnectionProperties};

const IPS: [&str; 3] = ["127.0.77.1", "127.0.77.2", "127.0.77.3"];

struct Nodes {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(id: usize, data: &Path) -> String {
    let mut members = String::new();
    for (i, ip) in IPS.iter().enumerate() {
        members.push_str(&format!(
            "[[cluster.initial_members]]\nid = {}\nlink = \"{ip}:25672\"\n\n",
            i + 1
        ));
    }
    let ip = IPS[id - 1];
    format!(
        "[node]\nname = \"warren{id}@bench\"\ndata_dir = \"{}\"\n\n[amqp]\nlisten = \"{ip}:5672\"\n\n\
         [admin]\nlisten = \"{ip}:5679\"\n\n[management]\nlisten = \"{ip}:15672\"\n\n[prometheus]\nlisten = \"{ip}:15692\"\n\n[cluster]\nnode_id = {id}\ncluster_id = \"bench\"\n\
         listen = \"{ip}:25672\"\n\n{members}",
        data.display()
    )
}

fn start() -> Nodes {
    let dir = std::env::temp_dir().join(format!("warren-bench-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    let mut children = Vec::new();
    for id in 1..=3 {
        let cfg = dir.join(format!("node{id}.toml"));
        std::fs::write(&cfg, config(id, &dir.join(format!("data{id}")))).expect("config");
        let log = std::fs::File::create(dir.join(format!("node{id}.log"))).expect("log");
        children.push(
            Command::new(env!("CARGO_BIN_EXE_warren"))
                .arg("--config")
                .arg(&cfg)
                .env("RUST_LOG", "warn")
                .stdout(log.try_clone().expect("log"))
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .expect("start warren"),
        );
    }
    Nodes { dir, children }
}

fn uri(node: usize) -> String {
    format!("amqp://guest:guest@{}:5672/%2f", IPS[node - 1])
}

async fn connect(node: usize) -> Connection {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(2),
            Connection::connect(&uri(node), ConnectionProperties::default()),
        )
        .await
        {
            return c;
        }
        assert!(Instant::now() < deadline, "node {node} does not serve");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn leader() -> usize {
    let out = Command::new(env!("CARGO_BIN_EXE_warrenctl"))
        .args(["--node", &format!("{}:5679", IPS[0]), "cluster_status"])
        .output()
        .expect("warrenctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .find(|c| c.get(3) == Some(&"leader"))
        .and_then(|c| c[1].parse().ok())
        .expect("a leader")
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

async fn declare(ch: &lapin::Channel, name: String) {
    ch.queue_declare(
        name.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
}

/// Sequential declares of new durable queues through `node`: each is one Raft commit.
async fn latency(node: usize, n: usize, tag: &str) {
    let conn = connect(node).await;
    let ch = conn.create_channel().await.expect("channel");
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        declare(&ch, format!("lat.{tag}.{i}")).await;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!(
        "queue.declare latency via node {node} ({tag}): p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms  ({n} sequential)",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        pct(&lat, 1.0)
    );
    let _ = conn.close(200, "bye".into()).await;
}

/// `conns` connections each declaring new queues back to back for `secs`.
async fn rate(node: usize, conns: usize, secs: u64, tag: &str) {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for c in 0..conns {
        let done = done.clone();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let conn = connect(node).await;
            let ch = conn.create_channel().await.expect("channel");
            let mut i = 0;
            while Instant::now() < stop {
                declare(&ch, format!("rate.{tag}.{c}.{i}")).await;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            let _ = conn.close(200, "bye".into()).await;
        }));
    }
    let t = Instant::now();
    for task in tasks {
        task.await.expect("declarer");
    }
    let n = done.load(Ordering::Relaxed);
    println!(
        "queue.declare rate via node {node} ({tag}): {:.0}/s  ({n} declares, {conns} connections, {:.1} s)",
        n as f64 / t.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
}

fn field(json: &str, key: &str) -> Option<f64> {
    let at = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

fn perf(label: &str, producer: usize, consumer: usize, queue: &str, extra: &[&str], secs: u64) {
    let out = Command::new(env!("CARGO_BIN_EXE_warren-perf"))
        .args(["--uri", &uri(producer), "--consumer-uri", &uri(consumer)])
        .args(["--queue", queue, "--size", "1024", "--json"])
        .args(["--duration", &secs.to_string()])
        .args(extra)
        .stderr(Stdio::null())
        .output()
        .expect("warren-perf");
    let json = String::from_utf8_lossy(&out.stdout);
    let lat = json
        .find("\"latency_us\":")
        .map(|i| json[i..].to_string())
        .unwrap_or_default();
    println!(
        "{label:<44} publish {:>7.0} msg/s  consume {:>7.0} msg/s  latency p50 {:>7.0} us  p99 {:>7.0} us",
        field(&json, "sent_rate").unwrap_or(0.0),
        field(&json, "received_rate").unwrap_or(0.0),
        field(&lat, "p50").unwrap_or(0.0),
        field(&lat, "p99").unwrap_or(0.0),
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (n, secs) = if quick { (100, 3) } else { (500, 10) };
    let nodes = start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        for node in 1..=3 {
            drop(connect(node).await);
        }
        let leader = leader();
        let follower = (1..=3).find(|&n| n != leader).expect("a follower");
        println!("3 nodes on {IPS:?}; leader: node {leader}");
        latency(leader, n, "leader").await;
        latency(follower, n, "follower").await;
        rate(leader, 1, secs / 2, "leader-1").await;
        rate(leader, 16, secs / 2, "leader-16").await;
        rate(follower, 16, secs / 2, "follower-16").await;
        // Queues for the throughput runs: one on node 1, declared there (client-local).
        let c1 = connect(1).await;
        let ch = c1.create_channel().await.expect("channel");
        declare(&ch, "tp.q".into()).await;
        let _ = c1.close(200, "bye".into()).await;
    });
    for (mode, extra) in [
        ("autoack, no confirms", vec!["--autoack"]),
        (
            "confirms 200, acks, prefetch 200",
            vec![
                "--confirm",
                "200",
                "--prefetch",
                "200",
                "--multi-ack-every",
                "50",
            ],
        ),
    ] {
        println!("-- 1 producer, 1 consumer, 1 KiB messages, {mode}, {secs} s each");
        perf(
            "same node (publish 1, consume 1, queue on 1)",
            1,
            1,
            "tp.q",
            &extra,
            secs,
        );
        perf(
            "cross node (publish 2, consume 3, queue on 1)",
            2,
            3,
            "tp.q",
            &extra,
            secs,
        );
    }
    drop(nodes);
}

//! Real multi-process clusters on loopback, for the cluster and mirroring tests: each node
//! is the `warren` binary started with a generated `[cluster]` config, clients are lapin,
//! administration is the `warrenctl` binary.
//!
//! Every cluster gets its own 127.x.y.0/24 addresses (x, y from the process id and a counter),
//! so clusters of concurrent tests never meet, and nodes use the standard ports on their own
//! address. Processes are killed when a [`Cluster`] is dropped; every wait is bounded.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use amq_protocol::types::{AMQPValue, FieldTable};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::within;

pub static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

/// `ha-mode: all` with automatic sync.
pub const ALL_AUTOMATIC: &str = r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#;

/// Upper bound for a node to start serving clients.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The `warren` binary the nodes run: `$WARREN_BIN` when set (CI points it at the release
/// build, so fault tests run the binary users run, at its speed), else this build's.
pub fn warren_bin() -> PathBuf {
    std::env::var_os("WARREN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_warren")))
}

pub struct NodeProc {
    pub id: u64,
    pub ip: String,
    pub config: PathBuf,
    pub log: PathBuf,
    pub child: Option<Child>,
}

impl NodeProc {
    pub fn amqp_uri(&self) -> String {
        format!("amqp://guest:guest@{}:5672/%2f", self.ip)
    }

    pub fn admin(&self) -> String {
        format!("{}:5679", self.ip)
    }

    pub fn spawn(&mut self) {
        let log = std::fs::File::create(&self.log).expect("log file");
        let child = Command::new(warren_bin())
            .arg("--config")
            .arg(&self.config)
            // WARREN_NODE_LOG overrides the nodes' log filter when a run needs tracing.
            .env(
                "RUST_LOG",
                std::env::var("WARREN_NODE_LOG").unwrap_or_else(|_| "info,openraft=warn".into()),
            )
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start warren");
        self.child = Some(child);
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the process freezes, its sockets stay open (a partition the node itself
    /// does not notice, as a long GC pause or a VM stall).
    ///
    /// Returns once every thread of the process has stopped. `kill` only queues the stop:
    /// the kernel wakes one thread to begin it, and on a loaded machine the others run on,
    /// serving requests, until that thread is scheduled (a relayed basic.get sent after
    /// `kill` was answered 0.1 s later that way).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let Some(c) = &self.child else { return };
        let tasks = PathBuf::from(format!("/proc/{}/task", c.id()));
        let asked = Instant::now();
        let deadline = asked + Duration::from_secs(10);
        while !all_stopped(&tasks) {
            assert!(
                Instant::now() < deadline,
                "node {} did not stop within 10 s of SIGSTOP",
                self.id
            );
            // Not a busy loop: the thread that begins the stop needs a core.
            std::thread::sleep(Duration::from_millis(1));
        }
        if asked.elapsed() > Duration::from_millis(20) {
            eprintln!(
                "node {} stopped {:?} after SIGSTOP",
                self.id,
                asked.elapsed()
            );
        }
    }

    /// SIGCONT after [`NodeProc::pause`].
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: sending a signal to our own child process by pid.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    /// SIGTERM, then wait for the process to exit (a clean shutdown).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: sending a signal to our own child process by pid.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// How many times this process run has logged that it serves clients.
    pub fn ready_count(&self) -> usize {
        self.log_text().matches("node listening").count()
    }
}

pub struct Cluster {
    pub dir: PathBuf,
    pub nodes: Vec<NodeProc>,
    /// The initial members' addresses (the first names the cluster).
    pub ips: Vec<String>,
    /// Options every warrenctl run gets before the command (`--cacert` for `[admin.tls]`).
    pub ctl_options: Vec<String>,
    /// Fails the test, with the nodes' logs, if it holds the cluster too long (a hang).
    _watchdog: super::watchdog::Watchdog,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("cluster logs kept in {}", self.dir.display());
        }
    }
}

/// The failure detector's settings of test clusters: (`peer_timeout_ms`, `heartbeat_ms`).
pub const TEST_TIMEOUTS: (u64, u64) = (1500, 100);

/// The shipped cluster configs' (`config/cluster/node*.toml`).
pub const DEFAULT_TIMEOUTS: (u64, u64) = (5000, 250);

pub fn config_text(id: u64, ip: &str, cluster: &str, ips: &[String], data: &Path) -> String {
    config_text_with(id, ip, cluster, ips, data, TEST_TIMEOUTS, "")
}

pub fn config_text_with(
    id: u64,
    ip: &str,
    cluster: &str,
    ips: &[String],
    data: &Path,
    (peer_timeout_ms, heartbeat_ms): (u64, u64),
    cluster_keys: &str,
) -> String {
    let mut members = String::new();
    for (i, peer) in ips.iter().enumerate() {
        members.push_str(&format!(
            "[[cluster.initial_members]]\nid = {}\nlink = \"{peer}:25672\"\n\n",
            i + 1
        ));
    }
    format!(
        r#"[node]
name = "warren{id}@test"
data_dir = "{data}"

[amqp]
listen = "{ip}:5672"

[admin]
listen = "{ip}:5679"

[management]
listen = "{ip}:15672"

[prometheus]
listen = "{ip}:15692"

[limits]
memory_high_watermark_bytes = 1073741824

[cluster]
node_id = {id}
cluster_id = "test-{cluster}"
listen = "{ip}:25672"
peer_timeout_ms = {peer_timeout_ms}
heartbeat_ms = {heartbeat_ms}
commit_timeout_ms = 5000
{cluster_keys}
{members}"#,
        data = data.display(),
    )
}

impl Cluster {
    /// Starts three nodes and waits until each serves clients.
    pub async fn start(name: &str) -> Cluster {
        Cluster::start_with(name, TEST_TIMEOUTS).await
    }

    /// [`Cluster::start`] with other failure-detector settings.
    pub async fn start_with(name: &str, timeouts: (u64, u64)) -> Cluster {
        Cluster::start_configured(name, timeouts, |_, _| String::new(), Vec::new()).await
    }

    fn ips_of(n: u32) -> Vec<String> {
        let pid = std::process::id();
        // Wrapped: without it, a process id with `pid / 200 % 50 == 49` put its eleventh
        // cluster on 127.x.256.y, not an address (node configs refused, tests failed).
        let (a, b) = (10 + (pid % 200), ((pid / 200 % 50) * 5 + n) % 256);
        (1..=3).map(|i| format!("127.{a}.{b}.{i}")).collect()
    }

    /// [`Cluster::start_with`], with `extra(id, ip)` appended to each node's config (more
    /// sections, such as `[cluster.tls]`) and `ctl_options` given to every warrenctl run.
    pub async fn start_configured(
        name: &str,
        timeouts: (u64, u64),
        extra: impl Fn(u64, &str) -> String,
        ctl_options: Vec<String>,
    ) -> Cluster {
        Cluster::start_keyed(name, timeouts, "", extra, ctl_options).await
    }

    /// [`Cluster::start_with`] with `cluster_keys` (lines such as
    /// `election_timeout_ms = 3000`) added to every node's `[cluster]` section.
    pub async fn start_with_keys(name: &str, timeouts: (u64, u64), cluster_keys: &str) -> Cluster {
        Cluster::start_keyed(
            name,
            timeouts,
            cluster_keys,
            |_, _| String::new(),
            Vec::new(),
        )
        .await
    }

    async fn start_keyed(
        name: &str,
        timeouts: (u64, u64),
        cluster_keys: &str,
        extra: impl Fn(u64, &str) -> String,
        ctl_options: Vec<String>,
    ) -> Cluster {
        let n = NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("warren-cluster-{name}-{pid}-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        let ips = Cluster::ips_of(n);
        let mut nodes = Vec::new();
        for (i, ip) in ips.iter().enumerate() {
            let id = i as u64 + 1;
            let config = dir.join(format!("node{id}.toml"));
            let data = dir.join(format!("data{id}"));
            let text = config_text_with(id, ip, &ips[0], &ips, &data, timeouts, cluster_keys);
            std::fs::write(&config, format!("{text}\n{}", extra(id, ip))).expect("config");
            nodes.push(NodeProc {
                id,
                ip: ip.clone(),
                config,
                log: dir.join(format!("node{id}.log")),
                child: None,
            });
        }
        let watchdog = super::watchdog::Watchdog::start(dir.clone());
        let mut cluster = Cluster {
            dir,
            nodes,
            ips: ips.clone(),
            ctl_options,
            _watchdog: watchdog,
        };
        for n in &mut cluster.nodes {
            n.spawn();
        }
        for i in 0..3 {
            cluster.wait_serving(i, 1).await;
        }
        cluster
    }

    /// SIGTERM to every running node at once, then waits for each to exit: a whole-cluster
    /// clean stop, in which every node stops while the others are stopping too.
    pub fn stop_all(&mut self) {
        for n in &self.nodes {
            n.signal(libc::SIGTERM);
        }
        for n in &mut self.nodes {
            n.stop();
        }
    }

    pub fn node(&self, id: u64) -> &NodeProc {
        &self.nodes[id as usize - 1]
    }

    /// Waits until node `id`'s log says it serves clients for the `runs`-th time.
    pub async fn wait_serving(&self, index: usize, runs: usize) {
        let node = &self.nodes[index];
        let deadline = Instant::now() + START_TIMEOUT;
        while node.ready_count() < runs {
            assert!(
                Instant::now() < deadline,
                "node {} did not start serving; log:\n{}",
                node.id,
                node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts node `id` with a `[cluster]` section but outside the initial members: it
    /// waits for `join_cluster`. Returns its index.
    pub fn spawn_joiner(&mut self, id: u64) -> usize {
        let prefix = self.ips[0].rsplit_once('.').expect("an ip").0.to_string();
        let ip = format!("{prefix}.{id}");
        let config = self.dir.join(format!("node{id}.toml"));
        let data = self.dir.join(format!("data{id}"));
        std::fs::write(&config, config_text(id, &ip, &self.ips[0], &[], &data)).expect("config");
        let mut node = NodeProc {
            id,
            ip,
            config,
            log: self.dir.join(format!("node{id}.log")),
            child: None,
        };
        node.spawn();
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Restarts node `id` (already stopped or killed) and waits until it serves again.
    pub async fn restart(&mut self, id: u64) {
        let i = id as usize - 1;
        // A fresh log per run keeps "node listening" counts simple.
        self.nodes[i].spawn();
        self.wait_serving(i, 1).await;
    }

    /// Runs warrenctl against node `id`.
    pub async fn ctl(&self, id: u64, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_warrenctl"));
        cmd.arg("--node")
            .arg(self.node(id).admin())
            .args(&self.ctl_options)
            .args(args);
        within(
            "warrenctl",
            tokio::task::spawn_blocking(move || cmd.output().expect("run warrenctl")),
        )
        .await
        .expect("join")
    }

    /// warrenctl's output rows (header first), failing on a non-zero exit.
    /// Sets policy `ha` on `^ha\.` (queues) through node 1 with `definition`.
    pub async fn set_ha_policy(&self, definition: &str) {
        let args = [
            "set_policy",
            "ha",
            "^ha\\.",
            definition,
            "--apply-to",
            "queues",
        ];
        let out = self.ctl(1, &args).await;
        assert!(out.status.success(), "{out:?}");
    }

    pub async fn ctl_rows(&self, id: u64, args: &[&str]) -> Vec<Vec<String>> {
        let out = self.ctl(id, args).await;
        assert!(
            out.status.success(),
            "warrenctl {args:?} on node {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect()
    }

    /// The leader's id as node `asked` sees it, if any.
    pub async fn leader(&self, asked: u64) -> Option<u64> {
        let out = self.ctl(asked, &["cluster_status"]).await;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .skip(1)
            .map(|l| l.split('\t').collect::<Vec<_>>())
            .find(|c| c.get(3) == Some(&"leader"))
            .and_then(|c| c[1].parse().ok())
    }

    /// Waits until node `asked` knows a leader accepted by `ok`; how long that took.
    pub async fn wait_leader(&self, asked: u64, ok: impl Fn(u64) -> bool) -> (u64, Duration) {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader(asked).await {
                if ok(l) {
                    return (l, start.elapsed());
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no acceptable leader seen by node {asked}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Queue names node `id` lists.
    pub async fn queues(&self, id: u64) -> BTreeSet<String> {
        self.ctl_rows(id, &["list_queues", "name"])
            .await
            .into_iter()
            .skip(1)
            .map(|r| r[0].clone())
            .collect()
    }
}

pub async fn connect(uri: &str) -> Connection {
    within(
        "connect",
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await
    .expect("connect")
}

pub async fn channel(conn: &Connection) -> Channel {
    within("channel", conn.create_channel())
        .await
        .expect("channel")
}

pub async fn declare(
    ch: &Channel,
    name: &str,
    durable: bool,
    args: FieldTable,
) -> lapin::Result<()> {
    within(
        "queue.declare",
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable,
                ..Default::default()
            },
            args,
        ),
    )
    .await
    .map(|_| ())
}

pub fn locator(value: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-master-locator".into(),
        AMQPValue::LongString(value.into()),
    );
    t
}

/// Publishes with confirms on `ch` (in confirm mode); whether the broker acked.
pub async fn publish_acked(ch: &Channel, exchange: &str, key: &str, body: &[u8]) -> bool {
    let confirm = within(
        "basic.publish",
        ch.basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_delivery_mode(2),
        ),
    )
    .await
    .expect("publish");
    within("confirm", confirm).await.expect("confirm").is_ack()
}

/// Whether every thread under `/proc/<pid>/task` is stopped (state `T`), read from the field
/// after the command name, which may itself hold spaces and parentheses. A process that has
/// exited (a zombie, or gone) counts as stopped: it serves nothing either.
fn all_stopped(tasks: &Path) -> bool {
    let Ok(dir) = std::fs::read_dir(tasks) else {
        return true;
    };
    dir.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let rest = &stat[stat.rfind(')')? + 1..];
                rest.split_whitespace()
                    .next()
                    .map(|state| matches!(state, "T" | "Z" | "X"))
            })
            // A thread that exited between the listing and the read serves nothing.
            .unwrap_or(true)
    })
}

//! Real three-process clusters on loopback: each node is the `warren` binary started with a
//! generated `[cluster]` config, clients are lapin, administration is the `warrenctl` binary.
//!
//! Every cluster gets its own 127.x.y.0/24 addresses (x, y from the process id and a counter),
//! so clusters of concurrent tests never meet, and nodes use the standard ports on their own
//! address. Processes are killed when a [`Cluster`] is dropped; every wait is bounded.

mod common;

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use amq_protocol::types::{AMQPValue, FieldTable};
use common::{reply_code, within};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

/// Upper bound for a node to start serving clients.
const START_TIMEOUT: Duration = Duration::from_secs(30);

struct NodeProc {
    id: u64,
    ip: String,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl NodeProc {
    fn amqp_uri(&self) -> String {
        format!("amqp://guest:guest@{}:5672/%2f", self.ip)
    }

    fn admin(&self) -> String {
        format!("{}:5679", self.ip)
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(&self.log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_warren"))
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info,openraft=warn")
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start warren");
        self.child = Some(child);
    }

    /// `kill -9`.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait for the process to exit (a clean shutdown).
    fn stop(&mut self) {
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

    fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// How many times this process run has logged that it serves clients.
    fn ready_count(&self) -> usize {
        self.log_text().matches("node listening").count()
    }
}

struct Cluster {
    dir: PathBuf,
    nodes: Vec<NodeProc>,
    /// The initial members' addresses (the first names the cluster).
    ips: Vec<String>,
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

fn config_text(id: u64, ip: &str, cluster: &str, ips: &[String], data: &Path) -> String {
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

[limits]
memory_high_watermark_bytes = 1073741824

[cluster]
node_id = {id}
cluster_id = "test-{cluster}"
listen = "{ip}:25672"
peer_timeout_ms = 1500
heartbeat_ms = 100
commit_timeout_ms = 5000

{members}"#,
        data = data.display(),
    )
}

impl Cluster {
    /// Starts three nodes and waits until each serves clients.
    async fn start(name: &str) -> Cluster {
        let n = NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let (a, b) = (10 + (pid % 200), (pid / 200 % 50) * 5 + n);
        let dir = std::env::temp_dir().join(format!("warren-cluster-{name}-{pid}-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        let ips: Vec<String> = (1..=3).map(|i| format!("127.{a}.{b}.{i}")).collect();
        let mut nodes = Vec::new();
        for (i, ip) in ips.iter().enumerate() {
            let id = i as u64 + 1;
            let config = dir.join(format!("node{id}.toml"));
            let data = dir.join(format!("data{id}"));
            std::fs::write(&config, config_text(id, ip, &ips[0], &ips, &data)).expect("config");
            nodes.push(NodeProc {
                id,
                ip: ip.clone(),
                config,
                log: dir.join(format!("node{id}.log")),
                child: None,
            });
        }
        let mut cluster = Cluster {
            dir,
            nodes,
            ips: ips.clone(),
        };
        for n in &mut cluster.nodes {
            n.spawn();
        }
        for i in 0..3 {
            cluster.wait_serving(i, 1).await;
        }
        cluster
    }

    fn node(&self, id: u64) -> &NodeProc {
        &self.nodes[id as usize - 1]
    }

    /// Waits until node `id`'s log says it serves clients for the `runs`-th time.
    async fn wait_serving(&self, index: usize, runs: usize) {
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
    fn spawn_joiner(&mut self, id: u64) -> usize {
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
    async fn restart(&mut self, id: u64) {
        let i = id as usize - 1;
        // A fresh log per run keeps "node listening" counts simple.
        self.nodes[i].spawn();
        self.wait_serving(i, 1).await;
    }

    /// Runs warrenctl against node `id`.
    async fn ctl(&self, id: u64, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_warrenctl"));
        cmd.arg("--node").arg(self.node(id).admin()).args(args);
        within(
            "warrenctl",
            tokio::task::spawn_blocking(move || cmd.output().expect("run warrenctl")),
        )
        .await
        .expect("join")
    }

    /// warrenctl's output rows (header first), failing on a non-zero exit.
    async fn ctl_rows(&self, id: u64, args: &[&str]) -> Vec<Vec<String>> {
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
    async fn leader(&self, asked: u64) -> Option<u64> {
        let out = self.ctl(asked, &["cluster_status"]).await;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .skip(1)
            .map(|l| l.split('\t').collect::<Vec<_>>())
            .find(|c| c.get(3) == Some(&"leader"))
            .and_then(|c| c[1].parse().ok())
    }

    /// Waits until node `asked` knows a leader accepted by `ok`; how long that took.
    async fn wait_leader(&self, asked: u64, ok: impl Fn(u64) -> bool) -> (u64, Duration) {
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
    async fn queues(&self, id: u64) -> BTreeSet<String> {
        self.ctl_rows(id, &["list_queues", "name"])
            .await
            .into_iter()
            .skip(1)
            .map(|r| r[0].clone())
            .collect()
    }
}

async fn connect(uri: &str) -> Connection {
    within(
        "connect",
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await
    .expect("connect")
}

async fn channel(conn: &Connection) -> Channel {
    within("channel", conn.create_channel())
        .await
        .expect("channel")
}

async fn declare(ch: &Channel, name: &str, durable: bool, args: FieldTable) -> lapin::Result<()> {
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

fn locator(value: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-master-locator".into(),
        AMQPValue::LongString(value.into()),
    );
    t
}

/// Publishes with confirms on `ch` (in confirm mode); whether the broker acked.
async fn publish_acked(ch: &Channel, exchange: &str, key: &str, body: &[u8]) -> bool {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_is_shared_and_queues_live_where_the_locator_puts_them() {
    let cluster = Cluster::start("shared").await;
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    within(
        "exchange.declare",
        ch1.exchange_declare(
            "orders".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare exchange on node 1");
    declare(&ch1, "orders.eu", true, FieldTable::default())
        .await
        .expect("declare on node 1");
    within(
        "queue.bind",
        ch1.queue_bind(
            "orders.eu".into(),
            "orders".into(),
            "eu.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind");

    // Node 2 sees the definitions at once: a passive declare of the exchange and the
    // queue succeeds, and warrenctl on node 3 lists the queue on node 1.
    let c2 = connect(&cluster.node(2).amqp_uri()).await;
    let ch2 = channel(&c2).await;
    within(
        "passive exchange.declare",
        ch2.exchange_declare(
            "orders".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("the exchange is known on node 2");
    within(
        "passive queue.declare",
        ch2.queue_declare(
            "orders.eu".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("the queue is known on node 2");
    let rows = cluster
        .ctl_rows(3, &["list_queues", "name", "pid", "durable"])
        .await;
    assert_eq!(rows[0], ["name", "pid", "durable"]);
    assert!(
        rows.contains(&vec![
            "orders.eu".to_string(),
            "warren1@test".to_string(),
            "true".to_string()
        ]),
        "{rows:?}"
    );

    // Publishing on the queue's node routes through the replicated binding.
    within(
        "confirm.select",
        ch1.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    assert!(publish_acked(&ch1, "orders", "eu.fr", b"order-1").await);
    let got = within(
        "basic.get",
        ch1.basic_get("orders.eu".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    .expect("the message is there");
    assert_eq!(got.delivery.data, b"order-1");

    // Publish on node 2, consume on node 3: the message goes to the queue's node 1, is
    // confirmed once there, and is delivered through node 3; a rejected delivery comes
    // back redelivered, an ack removes it.
    within(
        "confirm.select",
        ch2.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    assert!(publish_acked(&ch2, "orders", "eu.de", b"order-2").await);
    let c3 = connect(&cluster.node(3).amqp_uri()).await;
    let ch3 = channel(&c3).await;
    within("basic.qos", ch3.basic_qos(1, BasicQosOptions::default()))
        .await
        .expect("qos");
    let mut deliveries = common::consume_tagged(&ch3, "orders.eu", "c3", Default::default()).await;
    let first = deliveries.next().await;
    assert_eq!(first.data, b"order-2");
    assert!(!first.redelivered);
    within(
        "basic.reject",
        first.acker.reject(BasicRejectOptions { requeue: true }),
    )
    .await
    .expect("reject");
    let again = deliveries.next().await;
    assert_eq!(again.data, b"order-2");
    assert!(again.redelivered, "requeued on node 1, redelivered");
    within("basic.ack", again.acker.ack(BasicAckOptions::default()))
        .await
        .expect("ack");
    let start = Instant::now();
    loop {
        let rows = cluster
            .ctl_rows(1, &["list_queues", "name", "messages"])
            .await;
        if rows.contains(&vec!["orders.eu".to_string(), "0".to_string()]) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{rows:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The consumer on node 3 gets what is published on node 1 too, in order.
    for i in 0..20 {
        assert!(publish_acked(&ch1, "orders", "eu.it", format!("n{i}").as_bytes()).await);
    }
    for i in 0..20 {
        let d = deliveries.next().await;
        assert_eq!(d.data, format!("n{i}").as_bytes());
        within("basic.ack", d.acker.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
    }
    within(
        "basic.cancel",
        ch3.basic_cancel("c3".into(), BasicCancelOptions::default()),
    )
    .await
    .expect("cancel");
    let _ = c3.close(200, "bye".into()).await;

    // Placement: client-local by default; min-masters spreads queues over the nodes.
    declare(&ch2, "local.2", true, FieldTable::default())
        .await
        .expect("declare");
    for i in 0..6 {
        declare(&ch1, &format!("spread.{i}"), true, locator("min-masters"))
            .await
            .expect("declare with min-masters");
    }
    let rows = cluster.ctl_rows(1, &["list_queues", "name", "pid"]).await;
    let home = |q: &str| {
        rows.iter()
            .find(|r| r[0] == q)
            .map(|r| r[1].clone())
            .unwrap_or_default()
    };
    assert_eq!(home("local.2"), "warren2@test");
    let spread: BTreeSet<String> = (0..6).map(|i| home(&format!("spread.{i}"))).collect();
    assert_eq!(
        spread,
        BTreeSet::from([
            "warren1@test".to_string(),
            "warren2@test".to_string(),
            "warren3@test".to_string()
        ]),
        "min-masters used every node: {rows:?}"
    );

    // A policy set on node 3 is everywhere; a queue on node 1 gets it.
    let out = cluster
        .ctl(
            3,
            &[
                "set_policy",
                "cap",
                "^orders\\.",
                r#"{"max-length":1}"#,
                "--apply-to",
                "queues",
            ],
        )
        .await;
    assert!(out.status.success(), "{out:?}");
    let rows = cluster
        .ctl_rows(1, &["list_queues", "name", "policy"])
        .await;
    assert!(
        rows.contains(&vec!["orders.eu".to_string(), "cap".to_string()]),
        "{rows:?}"
    );
    for i in 0..3 {
        assert!(publish_acked(&ch1, "orders", "eu.x", format!("m{i}").as_bytes()).await);
    }
    let rows = cluster
        .ctl_rows(1, &["list_queues", "name", "messages"])
        .await;
    assert!(
        rows.contains(&vec!["orders.eu".to_string(), "1".to_string()]),
        "max-length 1 from the policy applies on the queue's node: {rows:?}"
    );
    let _ = c1.close(200, "bye".into()).await;
    let _ = c2.close(200, "bye".into()).await;
}

/// Declares `name` on a fresh channel of `conn`, retrying while the cluster elects a
/// leader; whether the broker confirmed it (declare-ok) within the deadline.
async fn declare_until_ok(uri: &str, name: &str, deadline: Instant) -> bool {
    // Re-declaring is idempotent, so a declare whose outcome was lost is simply retried.
    while Instant::now() < deadline {
        let Ok(Ok(conn)) = tokio::time::timeout(
            Duration::from_secs(3),
            Connection::connect(uri, ConnectionProperties::default()),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if let Ok(ch) = conn.create_channel().await {
            match tokio::time::timeout(
                Duration::from_secs(8),
                ch.queue_declare(
                    name.into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            )
            .await
            {
                Ok(Ok(_)) => {
                    let _ = conn.close(200, "bye".into()).await;
                    return true;
                }
                Ok(Err(e)) => {
                    // 541: the metadata store had no leader or no outcome; retried.
                    assert_eq!(reply_code(&e), Some(541), "unexpected refusal: {e}");
                }
                Err(_) => {}
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_follower_and_the_leader_loses_no_acknowledged_definition() {
    let mut cluster = Cluster::start("failover").await;
    let (leader, _) = cluster.wait_leader(1, |_| true).await;
    let follower = (1..=3).find(|&n| n != leader).expect("a follower");
    let survivor = (1..=3)
        .find(|&n| n != leader && n != follower)
        .expect("a third node");
    // A stream of declares through the third node, running while nodes die: a follower
    // after 10 acknowledged declares, then (once it is back) the leader after 25.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let uri = cluster.node(survivor).amqp_uri();
    let counter = done.clone();
    let stream = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut acked = Vec::new();
        for i in 0..40 {
            let name = format!("def.{i}");
            if declare_until_ok(&uri, &name, deadline).await {
                acked.push(name);
            }
            counter.fetch_add(1, Ordering::SeqCst);
            // Paced, so the kills land in the middle of the stream.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        acked
    });
    let reach = |n: usize| {
        let done = done.clone();
        async move {
            while done.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    reach(10).await;
    cluster.nodes[follower as usize - 1].kill();
    reach(15).await;
    cluster.restart(follower).await;
    reach(25).await;
    cluster.nodes[leader as usize - 1].kill();
    let (new_leader, took) = cluster.wait_leader(survivor, |l| l != leader).await;
    eprintln!("new leader {new_leader} {took:?} after the old one was killed");
    assert!(
        took < Duration::from_secs(10),
        "a new leader within seconds"
    );
    let acked = tokio::time::timeout(Duration::from_secs(90), stream)
        .await
        .expect("the declares finished")
        .expect("join");
    assert_eq!(acked.len(), 40, "every declare eventually succeeded");
    // The old leader comes back as a follower with every definition.
    cluster.restart(leader).await;
    for n in 1..=3 {
        let names = cluster.queues(n).await;
        let missing: Vec<&String> = acked.iter().filter(|q| !names.contains(*q)).collect();
        assert!(
            missing.is_empty(),
            "node {n} lacks acknowledged {missing:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_brings_back_durable_definitions_and_policies() {
    let mut cluster = Cluster::start("restart").await;
    let c = connect(&cluster.node(2).amqp_uri()).await;
    let ch = channel(&c).await;
    declare(&ch, "keep.durable", true, FieldTable::default())
        .await
        .expect("declare durable");
    declare(&ch, "lose.transient", false, FieldTable::default())
        .await
        .expect("declare transient");
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    for i in 0..5 {
        assert!(publish_acked(&ch, "", "keep.durable", format!("p{i}").as_bytes()).await);
    }
    let out = cluster
        .ctl(
            1,
            &["set_policy", "ttl", "^keep", r#"{"message-ttl":600000}"#],
        )
        .await;
    assert!(out.status.success(), "{out:?}");
    let _ = c.close(200, "bye".into()).await;

    for n in &mut cluster.nodes {
        n.stop();
    }
    for n in &mut cluster.nodes {
        n.spawn();
    }
    for i in 0..3 {
        cluster.wait_serving(i, 1).await;
    }
    for n in 1..=3 {
        let names = cluster.queues(n).await;
        assert!(names.contains("keep.durable"), "node {n}: {names:?}");
        assert!(
            !names.contains("lose.transient"),
            "a transient queue does not outlive its node's restart (node {n}: {names:?})"
        );
        let policies = cluster.ctl_rows(n, &["list_policies"]).await;
        assert!(
            policies.iter().skip(1).any(|r| r[1] == "ttl"),
            "node {n}: {policies:?}"
        );
    }
    // The persistent messages are back on the queue's node.
    let c = connect(&cluster.node(2).amqp_uri()).await;
    let ch = channel(&c).await;
    let mut bodies = Vec::new();
    while let Some(m) = within(
        "basic.get",
        ch.basic_get("keep.durable".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    {
        bodies.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    assert_eq!(bodies, ["p0", "p1", "p2", "p3", "p4"]);
    let _ = c.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_goes_down_takes_its_transient_queues_and_its_durable_ones_wait() {
    let mut cluster = Cluster::start("nodedown").await;
    let c3 = connect(&cluster.node(3).amqp_uri()).await;
    let ch3 = channel(&c3).await;
    declare(&ch3, "n3.durable", true, FieldTable::default())
        .await
        .expect("declare");
    declare(&ch3, "n3.transient", false, FieldTable::default())
        .await
        .expect("declare");
    within(
        "exclusive declare",
        ch3.queue_declare(
            "n3.exclusive".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare exclusive");
    let before = cluster.queues(1).await;
    assert!(before.contains("n3.exclusive") && before.contains("n3.transient"));
    // A consumer on node 1 of the durable queue on node 3.
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    let mut remote =
        common::consume_tagged(&ch1, "n3.durable", "watcher", Default::default()).await;
    within(
        "confirm.select",
        ch3.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    assert!(publish_acked(&ch3, "", "n3.durable", b"before").await);
    let d = remote.next().await;
    assert_eq!(d.data, b"before");
    // The delivery is recorded in the queue index by the next group commit, not before the
    // message goes out (as RabbitMQ): give it that commit before the crash.
    tokio::time::sleep(Duration::from_millis(500)).await;

    cluster.nodes[2].kill();
    // As RabbitMQ, the consumer of a queue whose node went down is cancelled.
    match remote.next_event().await {
        Ok(None) => {}
        other => panic!("expected a consumer cancel, got {other:?}"),
    }
    let start = Instant::now();
    loop {
        let names = cluster.queues(1).await;
        if !names.contains("n3.transient") && !names.contains("n3.exclusive") {
            assert!(names.contains("n3.durable"), "{names:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "node 3's transient queues outlived it: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Using the durable queue of the down node answers as RabbitMQ does.
    let ch1 = channel(&c1).await;
    let err = within(
        "basic.get",
        ch1.basic_get("n3.durable".into(), BasicGetOptions::default()),
    )
    .await
    .expect_err("the queue's node is down");
    assert_eq!(reply_code(&err), Some(404), "{err}");
    assert!(err.to_string().contains("down or inaccessible"), "{err}");
    let _ = c1.close(200, "bye".into()).await;

    // It comes back with its node.
    cluster.restart(3).await;
    let c3 = connect(&cluster.node(3).amqp_uri()).await;
    let ch3 = channel(&c3).await;
    within(
        "passive declare",
        ch3.queue_declare(
            "n3.durable".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("the durable queue is back");
    // Its persistent message, delivered before the crash and never acked, is still there.
    let got = within(
        "basic.get",
        ch3.basic_get("n3.durable".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    .expect("the unacked message survived");
    assert_eq!(got.delivery.data, b"before");
    assert!(got.delivery.redelivered);
    let _ = c3.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fourth_node_joins_as_a_voter_and_is_forgotten() {
    let mut cluster = Cluster::start("join").await;
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    declare(&ch1, "before.join", true, FieldTable::default())
        .await
        .expect("declare");
    let index = cluster.spawn_joiner(4);
    // Not a member yet: its admin endpoint answers, its AMQP listener does not serve.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        cluster.nodes[index].ready_count(),
        0,
        "serves only once joined"
    );
    let seed = cluster.node(1).admin();
    let out = cluster.ctl(4, &["join_cluster", &seed]).await;
    assert!(
        out.status.success(),
        "join_cluster: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    cluster.wait_serving(index, 1).await;
    // Registered, a voter (fewer than five), with the metadata: the queue declared before.
    let start = Instant::now();
    loop {
        let rows = cluster.ctl_rows(1, &["cluster_status"]).await;
        let four = rows.iter().find(|r| r[1] == "4").cloned();
        if four
            .as_ref()
            .is_some_and(|r| r[3] == "voter" || r[3] == "leader")
        {
            assert_eq!(four.expect("row")[0], "warren4@test");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "{rows:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cluster.queues(4).await.contains("before.join"));
    // A queue declared on the new node lives there and is usable from node 1.
    let c4 = connect(&cluster.node(4).amqp_uri()).await;
    let ch4 = channel(&c4).await;
    declare(&ch4, "on.four", true, FieldTable::default())
        .await
        .expect("declare on node 4");
    within(
        "confirm.select",
        ch1.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    assert!(publish_acked(&ch1, "", "on.four", b"to four").await);
    let got = within(
        "basic.get",
        ch4.basic_get("on.four".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    .expect("forwarded from node 1");
    assert_eq!(got.delivery.data, b"to four");
    let _ = c4.close(200, "bye".into()).await;

    // A node cannot forget itself; another node forgets it: it leaves the membership and
    // its queues go.
    let out = cluster
        .ctl(4, &["forget_cluster_node", "warren4@test"])
        .await;
    assert!(!out.status.success());
    cluster.nodes[index].kill();
    let out = cluster
        .ctl(2, &["forget_cluster_node", "warren4@test"])
        .await;
    assert!(
        out.status.success(),
        "forget: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = Instant::now();
    loop {
        let rows = cluster.ctl_rows(1, &["cluster_status"]).await;
        if rows.len() == 4 && !rows.iter().any(|r| r[1] == "4") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "{rows:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let names = cluster.queues(1).await;
    assert!(
        !names.contains("on.four") && names.contains("before.join"),
        "{names:?}"
    );
    // The three remaining nodes still commit metadata.
    declare(&ch1, "after.forget", true, FieldTable::default())
        .await
        .expect("declare after forget");
    let _ = c1.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_get_counts_purge_and_delete_reach_another_nodes_queue() {
    let cluster = Cluster::start("get").await;
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    declare(&ch1, "remote.q", true, FieldTable::default())
        .await
        .expect("declare on node 1");
    within(
        "confirm.select",
        ch1.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    for i in 0..3 {
        assert!(publish_acked(&ch1, "", "remote.q", format!("m{i}").as_bytes()).await);
    }
    let c2 = connect(&cluster.node(2).amqp_uri()).await;
    let ch2 = channel(&c2).await;
    let passive = |ch: Channel| async move {
        within(
            "passive declare",
            ch.queue_declare(
                "remote.q".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
    };
    let q = passive(ch2.clone()).await.expect("passive declare");
    assert_eq!((q.message_count(), q.consumer_count()), (3, 0));
    // warrenctl on node 2 asks node 1 for the counts of its queue.
    let rows = cluster
        .ctl_rows(2, &["list_queues", "name", "messages", "pid"])
        .await;
    assert!(
        rows.contains(&vec![
            "remote.q".to_string(),
            "3".to_string(),
            "warren1@test".to_string()
        ]),
        "{rows:?}"
    );

    // basic.get with ack from node 2; a reject requeues on node 1, an ack removes.
    let get = |ch: Channel, no_ack: bool| async move {
        within(
            "basic.get",
            ch.basic_get("remote.q".into(), BasicGetOptions { no_ack }),
        )
        .await
        .expect("get")
    };
    let first = get(ch2.clone(), false).await.expect("a message");
    assert_eq!(first.delivery.data, b"m0");
    assert_eq!(first.message_count, 2);
    within(
        "basic.reject",
        first
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: true }),
    )
    .await
    .expect("reject");
    let again = get(ch2.clone(), false).await.expect("requeued");
    assert_eq!(again.delivery.data, b"m0");
    assert!(again.delivery.redelivered);
    within(
        "basic.ack",
        again.delivery.acker.ack(BasicAckOptions::default()),
    )
    .await
    .expect("ack");
    let no_ack = get(ch2.clone(), true).await.expect("m1");
    assert_eq!(no_ack.delivery.data, b"m1");
    let q = passive(ch2.clone()).await.expect("passive declare");
    assert_eq!(q.message_count(), 1, "m0 acked, m1 taken without ack");

    // A delete with if-empty is refused while a message is there (406, channel closed).
    let err = within(
        "queue.delete",
        ch2.queue_delete(
            "remote.q".into(),
            lapin::options::QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        ),
    )
    .await
    .expect_err("not empty");
    assert_eq!(reply_code(&err), Some(406), "{err}");
    let ch2 = channel(&c2).await;
    let purged = within(
        "queue.purge",
        ch2.queue_purge("remote.q".into(), Default::default()),
    )
    .await
    .expect("purge");
    assert_eq!(purged, 1);
    assert!(
        get(ch2.clone(), true).await.is_none(),
        "get-empty after the purge"
    );
    let deleted = within(
        "queue.delete",
        ch2.queue_delete(
            "remote.q".into(),
            lapin::options::QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        ),
    )
    .await
    .expect("delete once empty");
    assert_eq!(deleted, 0);
    assert!(!cluster.queues(1).await.contains("remote.q"));
    let _ = c1.close(200, "bye".into()).await;
    let _ = c2.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_reach_a_queue_on_another_node() {
    let cluster = Cluster::start("dlx").await;
    // The dead-letter queue lives on node 2, the queue that dead-letters on node 1.
    let c2 = connect(&cluster.node(2).amqp_uri()).await;
    let ch2 = channel(&c2).await;
    within(
        "exchange.declare",
        ch2.exchange_declare(
            "dlx".into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare dlx");
    declare(&ch2, "dead.letters", true, FieldTable::default())
        .await
        .expect("declare on node 2");
    within(
        "queue.bind",
        ch2.queue_bind(
            "dead.letters".into(),
            "dlx".into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind");
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("dlx".into()),
    );
    declare(&ch1, "work", true, args)
        .await
        .expect("declare on node 1");
    within(
        "confirm.select",
        ch1.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    assert!(publish_acked(&ch1, "", "work", b"poison").await);
    let got = within(
        "basic.get",
        ch1.basic_get("work".into(), BasicGetOptions { no_ack: false }),
    )
    .await
    .expect("get")
    .expect("the message");
    within(
        "basic.reject",
        got.delivery
            .acker
            .reject(BasicRejectOptions { requeue: false }),
    )
    .await
    .expect("reject");
    // The rejected message is dead-lettered by node 1 into the queue on node 2.
    let start = Instant::now();
    let dead = loop {
        if let Some(m) = within(
            "basic.get",
            ch2.basic_get("dead.letters".into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .expect("get")
        {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no dead letter arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.delivery.data, b"poison");
    let death = dead
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-death").cloned());
    assert!(death.is_some(), "x-death is set");
    let _ = c1.close(200, "bye".into()).await;
    let _ = c2.close(200, "bye".into()).await;
}

/// The queue's master node as node `asked` lists it (`pid`), and its synchronised mirrors.
async fn master_and_synced(cluster: &Cluster, asked: u64, queue: &str) -> (String, String) {
    let rows = cluster
        .ctl_rows(
            asked,
            &["list_queues", "name", "pid", "synchronised_slave_pids"],
        )
        .await;
    rows.into_iter()
        .find(|r| r[0] == queue)
        .map(|r| (r[1].clone(), r.get(2).cloned().unwrap_or_default()))
        .unwrap_or_default()
}

/// Issue 6's test: confirmed messages of a mirrored queue survive `kill -9` of its master's
/// node; a publisher on another node keeps going once a mirror is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mirrored_queue_loses_no_confirmed_message_when_its_master_is_killed() {
    let mut cluster = Cluster::start("mirrored").await;
    let out = cluster
        .ctl(
            1,
            &[
                "set_policy",
                "ha",
                "^ha\\.",
                r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
                "--apply-to",
                "queues",
            ],
        )
        .await;
    assert!(out.status.success(), "{out:?}");
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    let ch1 = channel(&c1).await;
    declare(&ch1, "ha.orders", true, locator("client-local"))
        .await
        .expect("declare");
    let _ = c1.close(200, "bye".into()).await;
    // Both mirrors synchronised (an empty queue: at once).
    let start = Instant::now();
    loop {
        let (master, synced) = master_and_synced(&cluster, 2, "ha.orders").await;
        if master == "warren1@test"
            && synced.contains("warren2@test")
            && synced.contains("warren3@test")
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "mirrors not synchronised: {master} {synced}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A publisher on node 2 (its publishes go to the master on node 1) with confirms.
    let c2 = connect(&cluster.node(2).amqp_uri()).await;
    let ch2 = channel(&c2).await;
    within(
        "confirm.select",
        ch2.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let acked_w = acked.clone();
    let killed_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let killed_w = killed_at.clone();
    let publisher = tokio::spawn(async move {
        let mut next = 0u32;
        let mut first_ack_after = None;
        let mut acks_after = 0;
        let deadline = Instant::now() + Duration::from_secs(60);
        // Until 500 publishes are confirmed by the new master.
        while acks_after < 500 && Instant::now() < deadline {
            let mut refused = false;
            let mut confirms = Vec::new();
            for _ in 0..25 {
                let body = next.to_be_bytes();
                let c = ch2
                    .basic_publish(
                        "".into(),
                        "ha.orders".into(),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .expect("publish");
                confirms.push((next, c));
                next += 1;
            }
            for (n, c) in confirms {
                if within("confirm", c).await.is_ok_and(|c| c.is_ack()) {
                    acked_w.lock().unwrap().push(n);
                    if let Some(t) = *killed_w.lock().unwrap() {
                        acks_after += 1;
                        first_ack_after.get_or_insert_with(|| t.elapsed());
                    }
                } else {
                    refused = true;
                }
            }
            if refused {
                // The queue is between masters: nacked, as it should be; not too fast.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        (ch2, first_ack_after)
    });
    // kill -9 the master's node mid-stream.
    let start = Instant::now();
    while acked.lock().unwrap().len() < 600 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "publishing stalled"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cluster.nodes[0].kill();
    let killed = Instant::now();
    *killed_at.lock().unwrap() = Some(killed);
    let (_ch2, first_ack_after) = tokio::time::timeout(Duration::from_secs(90), publisher)
        .await
        .expect("publisher finished")
        .expect("publisher task");
    let acked: Vec<u32> = acked.lock().unwrap().clone();
    // A mirror took over.
    let (master, _) = loop {
        let (master, synced) = master_and_synced(&cluster, 3, "ha.orders").await;
        if master == "warren2@test" || master == "warren3@test" {
            break (master, synced);
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "no mirror promoted: master {master}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "promoted {master}; first confirm {first_ack_after:?} after the kill; {} publishes confirmed",
        acked.len()
    );
    assert!(
        first_ack_after.is_some(),
        "publishing went on after the promotion"
    );
    // Drain from node 3.
    let c3 = connect(&cluster.node(3).amqp_uri()).await;
    let ch3 = channel(&c3).await;
    let mut drained = Vec::new();
    loop {
        let got = within(
            "basic.get",
            ch3.basic_get("ha.orders".into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .expect("get");
        let Some(m) = got else { break };
        let n = u32::from_be_bytes(m.delivery.data[..4].try_into().expect("4 bytes"));
        drained.push((n, m.delivery.redelivered));
    }
    let held: BTreeSet<u32> = drained.iter().map(|(n, _)| *n).collect();
    let lost: Vec<u32> = acked
        .iter()
        .copied()
        .filter(|n| !held.contains(n))
        .collect();
    assert!(lost.is_empty(), "confirmed messages lost: {lost:?}");
    // Duplicates only with redelivered; the publisher's order kept.
    let mut seen = BTreeSet::new();
    let mut last = None;
    for (n, redelivered) in &drained {
        if !seen.insert(*n) {
            assert!(redelivered, "{n} delivered twice without redelivered");
            continue;
        }
        assert!(
            last.is_none_or(|l| l < *n),
            "order broken at {n} after {last:?}"
        );
        last = Some(*n);
    }
    let _ = c3.close(200, "bye".into()).await;
}

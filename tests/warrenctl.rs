//! `warrenctl` against an in-process node: vhosts, users, permissions, policies (and their
//! effect on a queue), refusals, authentication and the JSON formatter; and the live
//! listings (connections, channels, consumers) with lapin clients connected.

mod common;

use std::net::SocketAddr;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amq_protocol::types::FieldTable;
use warren::config::Config;
use warren::meta::state::QueueDef;
use warren::meta::Command;
use warren::runtime::Node;
use warren::time::Instant;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("warrenctl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

async fn ctl_as(addr: SocketAddr, user: &str, password: &str, args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_warrenctl"));
    cmd.arg("--node")
        .arg(addr.to_string())
        .args(["-u", user, "--password", password])
        .args(args);
    tokio::task::spawn_blocking(move || cmd.output().expect("run warrenctl"))
        .await
        .expect("join")
}

async fn ctl(addr: SocketAddr, args: &[&str]) -> Output {
    ctl_as(addr, "guest", "guest", args).await
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "warrenctl failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(o),
        stderr(o)
    );
    stdout(o)
}

/// Rows of a tab-separated listing (header skipped).
fn rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .skip(1)
        .map(|l| l.split('\t').map(str::to_string).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warrenctl_manages_a_node() {
    let dir = temp_dir("manage");
    let node = Node::start(Config::for_tests(&dir))
        .await
        .expect("start node");
    let addr = node.admin_addr();
    let result = tokio::time::timeout(Duration::from_secs(120), scenario(&node, addr)).await;
    node.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    result.expect("scenario timed out");
}

async fn scenario(node: &Node, addr: SocketAddr) {
    // Vhosts.
    ok(&ctl(addr, &["add_vhost", "staging"]).await);
    let out = ok(&ctl(addr, &["list_vhosts"]).await);
    assert_eq!(out.lines().next(), Some("name"), "{out}");
    let names: Vec<String> = rows(&out).into_iter().map(|r| r[0].clone()).collect();
    assert!(
        names.contains(&"/".to_string()) && names.contains(&"staging".to_string()),
        "{out}"
    );

    // Users and permissions.
    ok(&ctl(addr, &["add_user", "alice", "s3cret"]).await);
    let dup = ctl(addr, &["add_user", "alice", "x"]).await;
    assert_eq!(dup.status.code(), Some(1), "{}", stderr(&dup));
    ok(&ctl(
        addr,
        &[
            "set_permissions",
            "-p",
            "staging",
            "alice",
            ".*",
            ".*",
            "^amq",
        ],
    )
    .await);
    let out = ok(&ctl(addr, &["list_users"]).await);
    assert_eq!(out.lines().next(), Some("user\ttags"), "{out}");
    assert!(rows(&out).iter().any(|r| r[0] == "alice"), "{out}");
    assert!(
        rows(&out)
            .iter()
            .any(|r| r[0] == "guest" && r[1].contains("administrator")),
        "{out}"
    );
    let out = ok(&ctl(addr, &["list_permissions", "-p", "staging"]).await);
    assert!(out.contains("alice\t.*\t.*\t^amq"), "{out}");
    let perm = node.broker().snapshot();
    assert!(perm.permission("alice", "staging").is_some());
    // clear_permissions takes them away again (and set_permissions gives them back).
    let out = ok(&ctl(addr, &["clear_permissions", "-p", "staging", "alice"]).await);
    assert!(
        out.contains("Clearing permissions for user \"alice\" in vhost \"staging\""),
        "{out}"
    );
    assert!(node
        .broker()
        .snapshot()
        .permission("alice", "staging")
        .is_none());
    let bad = ctl(addr, &["clear_permissions", "-p", "staging", "nobody"]).await;
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    ok(&ctl(
        addr,
        &[
            "set_permissions",
            "-p",
            "staging",
            "alice",
            ".*",
            ".*",
            "^amq",
        ],
    )
    .await);

    // Policies: set, list, and see them apply to a queue declared through the broker.
    ok(&ctl(
        addr,
        &[
            "set_policy",
            "-p",
            "staging",
            "limits",
            "^lim\\.",
            r#"{"max-length": 5, "overflow": "reject-publish"}"#,
            "--priority",
            "7",
            "--apply-to",
            "queues",
        ],
    )
    .await);
    let out = ok(&ctl(addr, &["list_policies", "-p", "staging"]).await);
    assert_eq!(
        out.lines().next(),
        Some("vhost\tname\tpattern\tapply-to\tdefinition\tpriority"),
        "{out}"
    );
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!(r[0][1], "limits");
    assert_eq!(r[0][3], "queues");
    assert!(r[0][4].contains("\"max-length\":5"), "{out}");
    assert_eq!(r[0][5], "7");

    for name in ["lim.a", "other"] {
        node.broker()
            .apply(
                &Command::DeclareQueue(QueueDef {
                    vhost: "staging".into(),
                    name: name.into(),
                    durable: false,
                    exclusive_owner: None,
                    auto_delete: false,
                    arguments: FieldTable::default(),
                    home: 0,
                }),
                Instant::from_millis(0),
            )
            .expect("declare queue");
    }
    let out = ok(&ctl(
        addr,
        &[
            "list_queues",
            "-p",
            "staging",
            "name",
            "messages",
            "policy",
            "pid",
            "durable",
        ],
    )
    .await);
    assert_eq!(
        out.lines().next(),
        Some("name\tmessages\tpolicy\tpid\tdurable"),
        "{out}"
    );
    let r = rows(&out);
    let lim = r.iter().find(|r| r[0] == "lim.a").expect("lim.a listed");
    assert_eq!(lim[1], "0");
    assert_eq!(lim[2], "limits", "{out}");
    assert_eq!(lim[4], "false");
    let other = r.iter().find(|r| r[0] == "other").expect("other listed");
    assert_eq!(other[2], "", "{out}");
    // The policy is in force on the queue itself.
    let h = node
        .broker()
        .queue("staging", "lim.a")
        .expect("queue exists");
    assert_eq!(h.lock().args().max_length, Some(5));

    // Default columns, unknown column.
    let out = ok(&ctl(addr, &["list_queues", "-p", "staging"]).await);
    assert_eq!(out.lines().next(), Some("name\tmessages"), "{out}");
    let bad = ctl(addr, &["list_queues", "bogus"]).await;
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("bogus"), "{}", stderr(&bad));

    // Mirrored-queue operations on a single node: nothing is mirrored, so the mirror
    // columns are empty lists and sync or promotion are refused, committing nothing.
    let out = ok(&ctl(
        addr,
        &[
            "list_queues",
            "-p",
            "staging",
            "name",
            "slave_pids",
            "synchronised_slave_pids",
            "mirror_pids",
            "synchronised_mirror_pids",
            "mirror_epoch",
            "mirrors",
        ],
    )
    .await);
    let lim = rows(&out).into_iter().find(|r| r[0] == "lim.a");
    assert_eq!(
        lim,
        Some(
            ["lim.a", "[]", "[]", "[]", "[]", "0", "[]"]
                .map(str::to_string)
                .to_vec()
        ),
        "{out}"
    );
    let version = node.broker().snapshot().version;
    for (args, why) in [
        (
            &["sync_queue", "-p", "staging", "lim.a"][..],
            "Error: queue 'lim.a' in vhost 'staging' is not mirrored",
        ),
        (
            &["cancel_sync_queue", "-p", "staging", "lim.a"][..],
            "Error: queue 'lim.a' in vhost 'staging' is not mirrored",
        ),
        (
            &["sync_queue", "-p", "staging", "nope"][..],
            "Error: no queue 'nope' in vhost 'staging'",
        ),
        (
            &["force_promote_mirror", "-p", "staging", "lim.a"][..],
            "Error: queue 'lim.a' in vhost 'staging' is not mirrored",
        ),
    ] {
        let bad = ctl(addr, args).await;
        assert_eq!(bad.status.code(), Some(1), "{args:?}: {}", stderr(&bad));
        assert_eq!(stderr(&bad).trim_end(), why, "{args:?}");
    }
    assert_eq!(
        node.broker().snapshot().version,
        version,
        "nothing committed"
    );

    // Invalid JSON and an invalid policy key are refused with the reason.
    let bad = ctl(addr, &["set_policy", "p1", ".*", "{\"max-length\": }"]).await;
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("JSON"), "{}", stderr(&bad));
    let bad = ctl(addr, &["set_policy", "p2", ".*", r#"{"no-such-key": 1}"#]).await;
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("no-such-key"), "{}", stderr(&bad));
    let bad = ctl(
        addr,
        &["set_policy", "p3", ".*", r#"{"max-length": "ten"}"#],
    )
    .await;
    assert_eq!(bad.status.code(), Some(1));
    let bad = ctl(
        addr,
        &[
            "set_operator_policy",
            "p4",
            ".*",
            r#"{"overflow": "drop-head"}"#,
        ],
    )
    .await;
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("operator"), "{}", stderr(&bad));
    assert!(node
        .broker()
        .snapshot()
        .vhost("/")
        .is_some_and(|v| v.policies.is_empty()));

    // Usage errors.
    let bad = ctl(addr, &["add_user", "onlyname"]).await;
    assert_eq!(bad.status.code(), Some(64));
    assert!(stderr(&bad).contains("Usage"), "{}", stderr(&bad));
    let bad = ctl(addr, &["frobnicate"]).await;
    assert_eq!(bad.status.code(), Some(64));

    // Authentication: a wrong password, and a user who is not an administrator.
    let bad = ctl_as(addr, "guest", "wrong", &["list_vhosts"]).await;
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("authentication failed"),
        "{}",
        stderr(&bad)
    );
    assert!(stdout(&bad).is_empty());
    let bad = ctl_as(addr, "alice", "s3cret", &["list_vhosts"]).await;
    assert!(!bad.status.success());
    ok(&ctl(addr, &["set_user_tags", "alice", "administrator"]).await);
    ok(&ctl_as(addr, "alice", "s3cret", &["list_vhosts"]).await);
    ok(&ctl(addr, &["change_password", "alice", "n3w"]).await);
    assert!(!ctl_as(addr, "alice", "s3cret", &["list_vhosts"])
        .await
        .status
        .success());
    ok(&ctl_as(addr, "alice", "n3w", &["list_vhosts"]).await);

    // JSON formatter.
    let out = ok(&ctl(addr, &["--formatter", "json", "list_vhosts"]).await);
    assert!(out.trim_start().starts_with('['), "{out}");
    assert!(out.contains("\"name\":\"staging\""), "{out}");
    assert!(out.trim_end().ends_with(']'), "{out}");

    // Operator policies, clearing, cluster status, deletions.
    ok(&ctl(
        addr,
        &[
            "set_operator_policy",
            "-p",
            "staging",
            "cap",
            ".*",
            r#"{"max-length": 3}"#,
        ],
    )
    .await);
    let out = ok(&ctl(addr, &["list_operator_policies", "-p", "staging"]).await);
    assert!(out.contains("cap"), "{out}");
    assert_eq!(h.lock().args().max_length, Some(3));
    ok(&ctl(addr, &["clear_operator_policy", "-p", "staging", "cap"]).await);
    ok(&ctl(addr, &["clear_policy", "-p", "staging", "limits"]).await);
    assert_eq!(
        rows(&ok(&ctl(addr, &["list_policies", "-p", "staging"]).await)).len(),
        0
    );
    assert_eq!(
        ctl(addr, &["clear_policy", "-p", "staging", "limits"])
            .await
            .status
            .code(),
        Some(1)
    );
    let out = ok(&ctl(addr, &["cluster_status"]).await);
    assert!(out.contains("\ttrue"), "{out}");
    ok(&ctl(addr, &["list_exchanges", "-p", "staging"]).await);
    ok(&ctl(addr, &["list_bindings", "-p", "staging"]).await);
    ok(&ctl(addr, &["delete_user", "alice"]).await);
    ok(&ctl(addr, &["delete_vhost", "staging"]).await);
    let out = ok(&ctl(addr, &["list_vhosts"]).await);
    assert!(!out.contains("staging"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_close_the_connection_and_the_node_survives() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = temp_dir("frames");
    let node = Node::start(Config::for_tests(&dir))
        .await
        .expect("start node");
    let addr = node.admin_addr();
    let result = tokio::time::timeout(Duration::from_secs(60), async {
        for junk in [
            vec![0xff, 0xff, 0xff, 0xff],
            vec![0, 0, 0, 3, 1, 2, 3],
            vec![0, 0, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
        ] {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(&junk).await.expect("write");
            let mut buf = Vec::new();
            let n = s.read_to_end(&mut buf).await.unwrap_or(0);
            assert_eq!(n, 0, "no reply to a bad frame");
        }
        ok(&ctl(addr, &["list_vhosts"]).await);
    })
    .await;
    node.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    result.expect("timed out");
}

/// A lapin connection as guest to `/`, and the local address of its socket: the node's
/// `peer_port` for it. lapin keeps its socket to itself, so this goes through
/// `Connection::connector` with lapin's own connect step, noting the address on the way.
async fn connect_noting_addr(node: &common::TestNode) -> (lapin::Connection, SocketAddr) {
    use lapin::tcp::{AMQPUriTcpExt, AsyncTcpStream};
    let slot: Arc<Mutex<Option<SocketAddr>>> = Arc::new(Mutex::new(None));
    let seen = slot.clone();
    let uri: lapin::uri::AMQPUri = node.uri().parse().expect("amqp uri");
    let runtime = lapin::runtime::default_runtime().expect("lapin runtime");
    let conn = common::within(
        "lapin connect",
        lapin::Connection::connector(
            uri,
            runtime,
            async move |uri, runtime| {
                let stream = uri.connect_async(&runtime).await?;
                if let AsyncTcpStream::Plain(s) = &stream {
                    *seen.lock().expect("slot") = s.get_ref().local_addr().ok();
                }
                Ok(stream)
            },
            lapin::ConnectionProperties::default(),
        ),
    )
    .await
    .expect("lapin connects");
    let local = slot
        .lock()
        .expect("slot")
        .expect("the connect step saw a plain TCP socket");
    (conn, local)
}

/// The listing as rows keyed by column name, checking the header is `columns`.
fn table(out: &str, columns: &[&str]) -> Vec<std::collections::BTreeMap<String, String>> {
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(columns.join("\t").as_str()), "{out}");
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split('\t').collect();
            assert_eq!(cells.len(), columns.len(), "{out}");
            columns
                .iter()
                .zip(cells)
                .map(|(c, v)| (c.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// Runs `args` until `check` accepts the (successful) output; the broker sees acks and
/// closes after the client has sent them.
async fn eventually_listed(addr: SocketAddr, args: &[&str], check: impl Fn(&str) -> bool) {
    let start = std::time::Instant::now();
    loop {
        let out = ok(&ctl(addr, args).await);
        if check(&out) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{args:?} never showed what was expected; last output:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warrenctl_lists_live_connections_channels_and_consumers() {
    use lapin::options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions,
    };

    let node = common::TestNode::start().await;
    let admin = node.admin_addr();
    let amqp_port = node.addr.port().to_string();

    // Client A: channel 1 with prefetch 7 consuming (acks required) two messages it does
    // not ack yet; channel 2 in confirm mode.
    let (conn_a, local_a) = connect_noting_addr(&node).await;
    let ch1 = common::open_channel(&conn_a).await;
    common::within("basic.qos", ch1.basic_qos(7, BasicQosOptions::default()))
        .await
        .expect("basic.qos");
    common::declare_queue(&ch1, "live.q").await;
    common::declare_queue(&ch1, "live.other").await;
    let mut consumer_a =
        common::consume_tagged(&ch1, "live.q", "ctag-a", BasicConsumeOptions::default()).await;
    let ch2 = common::confirm_channel(&conn_a).await;
    common::publish_confirmed(&ch2, "", "live.q", b"one").await;
    common::publish_confirmed(&ch2, "", "live.q", b"two").await;
    let d1 = consumer_a.next().await;
    let d2 = consumer_a.next().await;

    // Client B: one channel, a no-ack consumer on another queue.
    let (conn_b, local_b) = connect_noting_addr(&node).await;
    let ch_b = common::open_channel(&conn_b).await;
    let _consumer_b = common::consume_tagged(
        &ch_b,
        "live.other",
        "ctag-b",
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;

    // Connections: default columns, one row per client, found by the client's own port.
    let out = ok(&ctl(admin, &["list_connections"]).await);
    let conns = table(&out, &["user", "peer_host", "peer_port", "state"]);
    assert_eq!(conns.len(), 2, "{out}");
    for local in [local_a, local_b] {
        let row = conns
            .iter()
            .find(|r| r["peer_port"] == local.port().to_string())
            .unwrap_or_else(|| panic!("no connection with peer_port {}: {out}", local.port()));
        assert_eq!(row["user"], "guest", "{out}");
        assert_eq!(row["peer_host"], local.ip().to_string(), "{out}");
        assert_eq!(row["state"], "running", "{out}");
    }
    let cols = [
        "pid",
        "name",
        "peer_port",
        "channels",
        "protocol",
        "vhost",
        "node",
    ];
    let out = ok(&ctl(admin, &[&["list_connections"][..], &cols].concat()).await);
    let conns = table(&out, &cols);
    let a = conns
        .iter()
        .find(|r| r["peer_port"] == local_a.port().to_string())
        .expect("client A listed");
    assert_eq!(a["channels"], "2", "{out}");
    assert_eq!(a["protocol"], "AMQP 0-9-1", "{out}");
    assert_eq!(a["vhost"], "/", "{out}");
    assert_eq!(
        a["name"],
        format!("{local_a} -> 127.0.0.1:{amqp_port}"),
        "{out}"
    );
    // rabbitmqctl's start time and socket counts (numbers, from the connection's driver).
    let cols2 = [
        "peer_port",
        "connected_at",
        "recv_oct",
        "recv_cnt",
        "send_oct",
        "send_cnt",
    ];
    let out2 = ok(&ctl(admin, &[&["list_connections"][..], &cols2].concat()).await);
    let rows2 = table(&out2, &cols2);
    let a2 = rows2
        .iter()
        .find(|r| r["peer_port"] == local_a.port().to_string())
        .expect("client A listed");
    for col in &cols2[1..] {
        let n: u64 = a2[*col]
            .parse()
            .unwrap_or_else(|_| panic!("{col} is not a number: {out2}"));
        assert!(n > 0, "{col} is 0: {out2}");
    }
    let node_name = a["node"].clone();
    let pid_a = a["pid"].clone();
    assert!(
        pid_a.starts_with(&format!("<{node_name}.")) && pid_a.ends_with('>'),
        "{out}"
    );

    // Channels: three in all; A's carry its prefetch, unacked count and confirm mode.
    let out = ok(&ctl(admin, &["list_channels"]).await);
    let chans = table(
        &out,
        &["pid", "user", "consumer_count", "messages_unacknowledged"],
    );
    assert_eq!(chans.len(), 3, "{out}");
    let cols = [
        "pid",
        "connection",
        "number",
        "consumer_count",
        "messages_unacknowledged",
        "prefetch_count",
        "confirm",
        "transactional",
    ];
    let out = ok(&ctl(admin, &[&["list_channels"][..], &cols].concat()).await);
    let chans = table(&out, &cols);
    let of_a: Vec<_> = chans.iter().filter(|r| r["connection"] == pid_a).collect();
    assert_eq!(of_a.len(), 2, "{out}");
    let consuming = of_a
        .iter()
        .find(|r| r["consumer_count"] == "1")
        .expect("A's consuming channel");
    assert_eq!(consuming["prefetch_count"], "7", "{out}");
    assert_eq!(consuming["messages_unacknowledged"], "2", "{out}");
    assert_eq!(consuming["confirm"], "false", "{out}");
    assert_eq!(
        consuming["pid"],
        format!("{}.{}>", pid_a.trim_end_matches('>'), consuming["number"]),
        "{out}"
    );
    let confirming = of_a
        .iter()
        .find(|r| r["consumer_count"] == "0")
        .expect("A's confirm channel");
    assert_eq!(confirming["confirm"], "true", "{out}");
    assert_eq!(confirming["messages_unacknowledged"], "0", "{out}");
    let consuming_pid = consuming["pid"].clone();

    // Consumers: default columns; A's requires acks with prefetch 7, B's does not.
    let out = ok(&ctl(admin, &["list_consumers"]).await);
    let cons = table(
        &out,
        &[
            "queue_name",
            "channel_pid",
            "consumer_tag",
            "ack_required",
            "prefetch_count",
            "active",
            "arguments",
        ],
    );
    assert_eq!(cons.len(), 2, "{out}");
    let ca = cons
        .iter()
        .find(|r| r["consumer_tag"] == "ctag-a")
        .expect("ctag-a listed");
    assert_eq!(ca["queue_name"], "live.q", "{out}");
    assert_eq!(ca["channel_pid"], consuming_pid, "{out}");
    assert_eq!(ca["ack_required"], "true", "{out}");
    assert_eq!(ca["prefetch_count"], "7", "{out}");
    assert_eq!(ca["active"], "true", "{out}");
    assert_eq!(ca["arguments"], "{}", "{out}");
    let cb = cons
        .iter()
        .find(|r| r["consumer_tag"] == "ctag-b")
        .expect("ctag-b listed");
    assert_eq!(cb["queue_name"], "live.other", "{out}");
    assert_eq!(cb["ack_required"], "false", "{out}");
    assert_eq!(cb["prefetch_count"], "0", "{out}");

    // JSON formatter.
    let out = ok(&ctl(admin, &["--formatter", "json", "list_consumers"]).await);
    assert!(
        out.trim_start().starts_with('[') && out.trim_end().ends_with(']'),
        "{out}"
    );
    assert!(out.contains("\"consumer_tag\":\"ctag-a\""), "{out}");
    assert!(out.contains("\"queue_name\":\"live.q\""), "{out}");
    let out = ok(&ctl(
        admin,
        &["--formatter", "json", "list_connections", "peer_port"],
    )
    .await);
    assert!(
        out.contains(&format!("{{\"peer_port\":\"{}\"}}", local_a.port())),
        "{out}"
    );

    // Refusals: an unknown column, an unknown vhost, an option these commands do not take.
    for (cmd, good) in [
        ("list_connections", "user"),
        ("list_channels", "pid"),
        ("list_consumers", "queue_name"),
    ] {
        let bad = ctl(admin, &[cmd, good, "bogus"]).await;
        assert_eq!(bad.status.code(), Some(1), "{cmd}: {}", stderr(&bad));
        assert!(stderr(&bad).contains("bogus"), "{cmd}: {}", stderr(&bad));
        assert!(stdout(&bad).is_empty(), "{cmd}: {}", stdout(&bad));
    }
    let bad = ctl(admin, &["list_consumers", "-p", "no-such-vhost"]).await;
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("no-such-vhost"), "{}", stderr(&bad));
    let bad = ctl(admin, &["list_connections", "-p", "/"]).await;
    assert_eq!(bad.status.code(), Some(64), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("Usage"), "{}", stderr(&bad));
    let out = ok(&ctl(admin, &["list_consumers", "-p", "/", "consumer_tag"]).await);
    assert_eq!(table(&out, &["consumer_tag"]).len(), 2, "{out}");

    // Acks bring the unacked count down; a cancel removes the consumer; a closed
    // connection leaves the listings with its channel and consumer.
    common::within(
        "basic.ack",
        ch1.basic_ack(d2.delivery_tag, BasicAckOptions { multiple: true }),
    )
    .await
    .expect("basic.ack");
    drop(d1);
    let consuming_pid2 = consuming_pid.clone();
    eventually_listed(
        admin,
        &["list_channels", "pid", "messages_unacknowledged"],
        move |out| {
            table(out, &["pid", "messages_unacknowledged"])
                .iter()
                .any(|r| r["pid"] == consuming_pid2 && r["messages_unacknowledged"] == "0")
        },
    )
    .await;
    common::within(
        "basic.cancel",
        ch1.basic_cancel("ctag-a".into(), BasicCancelOptions::default()),
    )
    .await
    .expect("basic.cancel");
    let out = ok(&ctl(admin, &["list_consumers", "consumer_tag"]).await);
    assert!(!out.contains("ctag-a") && out.contains("ctag-b"), "{out}");
    common::within("connection.close", conn_b.close(200, "bye".into()))
        .await
        .expect("close B");
    let port_b = local_b.port().to_string();
    eventually_listed(admin, &["list_connections", "peer_port"], move |out| {
        !out.lines().any(|l| l == port_b)
    })
    .await;
    let out = ok(&ctl(admin, &["list_consumers", "consumer_tag"]).await);
    assert_eq!(table(&out, &["consumer_tag"]).len(), 0, "{out}");
    let out = ok(&ctl(admin, &["list_channels", "connection"]).await);
    assert_eq!(table(&out, &["connection"]).len(), 2, "{out}");

    drop(conn_a);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_export_to_a_file_and_import_back() {
    let node = common::TestNode::start().await;
    let admin = node.admin_addr();
    ok(&ctl(admin, &["add_vhost", "exported"]).await);
    ok(&ctl(
        admin,
        &["set_policy", "cap", "^cap\\.", r#"{"max-length":3}"#],
    )
    .await);
    {
        let (_conn, ch) = node.channel().await;
        common::declare_queue_with(
            &ch,
            "cap.q",
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    }
    let dir = temp_dir("defs");
    let file = dir.join("defs.json");
    let out = ok(&ctl(admin, &["export_definitions", file.to_str().unwrap()]).await);
    assert!(out.is_empty(), "nothing on stdout: {out}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).expect("the file")).expect("JSON");
    assert_eq!(json["rabbit_version"], "3.10.8");
    assert!(json["vhosts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "exported"));
    assert!(json["queues"]
        .as_array()
        .unwrap()
        .iter()
        .any(|q| q["name"] == "cap.q"));
    // To stdout with `-`: the same document.
    let out = ok(&ctl(admin, &["export_definitions", "-"]).await);
    let again: serde_json::Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(again, json);

    // Gone, then imported back.
    ok(&ctl(admin, &["delete_vhost", "exported"]).await);
    ok(&ctl(admin, &["clear_policy", "cap"]).await);
    {
        let (_conn, ch) = node.channel().await;
        common::within(
            "queue.delete",
            ch.queue_delete("cap.q".into(), Default::default()),
        )
        .await
        .expect("delete");
    }
    let out = ok(&ctl(admin, &["import_definitions", file.to_str().unwrap()]).await);
    assert!(out.starts_with("Imported "), "{out}");
    assert!(ok(&ctl(admin, &["list_vhosts"]).await).contains("exported"));
    assert!(ok(&ctl(admin, &["list_policies"]).await).contains("cap"));
    assert!(ok(&ctl(admin, &["list_queues", "name"]).await).contains("cap.q"));
    // A file that is not definitions is refused, and changes nothing.
    std::fs::write(dir.join("bad.json"), b"{\"queues\": 5}").unwrap();
    let bad = ctl(
        admin,
        &["import_definitions", dir.join("bad.json").to_str().unwrap()],
    )
    .await;
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    assert!(
        stderr(&bad).contains("invalid definitions"),
        "{}",
        stderr(&bad)
    );
    let _ = std::fs::remove_dir_all(&dir);
    node.shutdown().await;
}

/// A definitions file as RabbitMQ 3.10.8 exports it (users with a SHA-256 hash).
const RABBIT_EXPORT: &str = r#"{"rabbit_version":"3.10.8","rabbitmq_version":"3.10.8",
"product_name":"RabbitMQ","product_version":"3.10.8",
"users":[{"name":"loader","password_hash":"kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR",
  "hashing_algorithm":"rabbit_password_hashing_sha256","tags":["management"],"limits":{}}],
"vhosts":[{"name":"/"},{"name":"loaded"}],
"permissions":[{"user":"loader","vhost":"loaded","configure":".*","write":".*","read":".*"}],
"topic_permissions":[],"parameters":[],"global_parameters":[],
"policies":[{"vhost":"loaded","name":"ttl","pattern":".*","apply-to":"queues",
  "definition":{"message-ttl":60000},"priority":0}],
"queues":[{"name":"lq","vhost":"loaded","durable":true,"auto_delete":false,"arguments":{}}],
"exchanges":[{"name":"lx","vhost":"loaded","type":"topic","durable":true,"auto_delete":false,
  "internal":false,"arguments":{}}],
"bindings":[{"source":"lx","vhost":"loaded","destination":"lq","destination_type":"queue",
  "routing_key":"a.#","arguments":{}}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_file_is_imported_before_clients_and_a_bad_one_stops_the_start() {
    let dir = temp_dir("load");
    let file = dir.join("definitions.json");
    std::fs::write(&file, RABBIT_EXPORT).unwrap();
    let path = file.to_str().unwrap().to_string();
    let node = common::TestNode::start_with(|c| c.definitions.load_file = path.clone()).await;
    let admin = node.admin_addr();
    assert!(ok(&ctl(admin, &["list_vhosts"]).await).contains("loaded"));
    let bindings = ok(&ctl(admin, &["list_bindings", "-p", "loaded"]).await);
    assert!(
        bindings.contains("lx") && bindings.contains("a.#"),
        "{bindings}"
    );
    let policies = ok(&ctl(admin, &["list_policies", "-p", "loaded"]).await);
    assert!(policies.contains("ttl"), "{policies}");
    let perms = ok(&ctl(admin, &["list_permissions", "-p", "loaded"]).await);
    assert!(perms.contains("loader"), "{perms}");
    node.shutdown().await;

    std::fs::write(&file, b"not json").unwrap();
    let mut config = Config::for_tests(&dir.join("data"));
    config.definitions.load_file = file.to_str().unwrap().to_string();
    let Err(err) = Node::start(config).await else {
        panic!("a start with an invalid definitions file succeeded")
    };
    assert!(err.to_string().contains("invalid definitions"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warrenctl_sets_lists_and_clears_vhost_and_user_limits() {
    let node = common::TestNode::start().await;
    let addr = node.admin_addr();
    let set = ok(&ctl(
        addr,
        &[
            "set_vhost_limits",
            "-p",
            "/",
            r#"{"max-connections": 1, "max-queues": -1}"#,
        ],
    )
    .await);
    assert_eq!(
        set.trim(),
        r#"Setting vhost limits to "{"max-connections": 1, "max-queues": -1}" for vhost "/" ..."#
    );
    let listed = ok(&ctl(addr, &["list_vhost_limits", "-p", "/"]).await);
    assert_eq!(
        rows(&listed),
        [["/", r#"{"max-connections":1,"max-queues":-1}"#]]
    );
    // In force for the next connection.
    let _first = node.connect().await;
    let err = common::assert_code(node.try_connect_uri(&node.uri()).await, 530, "limit 1");
    assert!(
        common::reply_text(&err).is_some_and(|t| t.ends_with("connection limit (1) is reached")),
        "{err}"
    );
    ok(&ctl(addr, &["clear_vhost_limits", "-p", "/"]).await);
    assert!(rows(&ok(&ctl(addr, &["list_vhost_limits", "--global"]).await)).is_empty());

    ok(&ctl(
        addr,
        &["set_user_limits", "guest", r#"{"max-channels": 3}"#],
    )
    .await);
    ok(&ctl(
        addr,
        &["set_user_limits", "guest", r#"{"max-connections": 4}"#],
    )
    .await);
    let listed = ok(&ctl(addr, &["list_user_limits", "--user", "guest"]).await);
    assert_eq!(
        rows(&listed),
        [["guest", r#"{"max-channels":3,"max-connections":4}"#]]
    );
    let cleared = ok(&ctl(addr, &["clear_user_limits", "guest", "max-channels"]).await);
    assert_eq!(
        cleared.trim(),
        "Clearing \"max-channels\" limit for user \"guest\" ..."
    );
    ok(&ctl(addr, &["clear_user_limits", "guest", "all"]).await);
    assert!(rows(&ok(&ctl(addr, &["list_user_limits"]).await)).is_empty());
    assert!(rows(&ok(&ctl(addr, &["list_user_limits", "--global"]).await)).is_empty());

    // Refusals: a limit the object does not have, a value that is not an integer, a user
    // that does not exist; and a usage error.
    for (args, why) in [
        (
            vec!["set_vhost_limits", r#"{"max-channels": 1}"#],
            "Unrecognised terms",
        ),
        (
            vec!["set_user_limits", "guest", r#"{"max-channels": "x"}"#],
            "should be a number",
        ),
        (
            vec!["set_user_limits", "nobody", r#"{"max-channels": 1}"#],
            "User \"nobody\" does not exist",
        ),
    ] {
        let o = ctl(addr, &args).await;
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
    assert_eq!(
        ctl(addr, &["clear_user_limits", "guest"])
            .await
            .status
            .code(),
        Some(64)
    );
    node.shutdown().await;
}

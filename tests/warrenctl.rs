//! `warrenctl` against an in-process node: vhosts, users, permissions, policies (and their
//! effect on a queue), refusals, authentication and the JSON formatter.

use std::net::SocketAddr;
use std::process::Output;
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

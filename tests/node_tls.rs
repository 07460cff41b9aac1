//! Node links over mutual TLS (`[cluster.tls]`) and the admin endpoint over TLS
//! (`[admin.tls]`), with certificates made at test time (`tls/pki.rs`; no key is committed):
//!
//! - a TLS link listener refuses, and logs, a peer with a certificate from another CA, a
//!   TLS peer with no certificate, and a peer that speaks plaintext; a member with the
//!   cluster CA's certificate links;
//! - a certificate of the cluster's CA takes a node id only if it names the host of that
//!   node's link address;
//! - three `warren` processes with `[cluster.tls]` and `[admin.tls]` form a cluster and keep
//!   a mirrored queue's confirmed messages when its master's node is killed, administered
//!   with `warrenctl --cacert`;
//! - `warrenctl` against an endpoint with `verify_peer`: served with the CA and a client
//!   certificate, refused without the CA, with another CA, or without a certificate.

mod common;
#[path = "tls/pki.rs"]
mod pki;

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::procs::{self, Cluster, TEST_TIMEOUTS};
use common::*;
use lapin::options::{BasicGetOptions, ConfirmSelectOptions};
use pki::Pki;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren::config::TlsConfig;
use warren::runtime::node_link::wire::{self, Envelope, PROTOCOL_VERSION};
use warren::runtime::node_link::{NodeLinkConfig, TcpTransport};
use warren::runtime::tls::link::LinkTls;

const CLUSTER_ID: &str = "tls-test";

/// Log lines of the test's own thread, for asserting what a refusal logs.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// The node-link log lines of this thread from now until the guard drops.
    fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .with_env_filter("warren::runtime::node_link=debug")
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// A node-link transport of node `id` on 127.0.0.1 over TLS with `tls`.
async fn tls_transport(id: u64, tls: &TlsConfig) -> TcpTransport {
    tls_transport_on("127.0.0.1", id, tls).await
}

/// A node-link transport of node `id` on the loopback address `ip` over TLS with `tls`.
async fn tls_transport_on(ip: &str, id: u64, tls: &TlsConfig) -> TcpTransport {
    let mut cfg = NodeLinkConfig::new(CLUSTER_ID, id);
    cfg.connect_timeout = Duration::from_secs(5);
    let tls = LinkTls::new(tls).expect("usable TLS files");
    TcpTransport::bind_with_tls(&format!("{ip}:0"), cfg, Some(tls))
        .await
        .expect("bind")
}

/// Everything the listener sends a connection that wrote `hello` until it closes.
async fn answer_to<S>(mut stream: S, hello: &[u8]) -> Vec<u8>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let _ = stream.write_all(hello).await;
    let _ = stream.flush().await;
    let mut got = Vec::new();
    // A reset or a TLS alert ends the read too; either way nothing more comes.
    let _ = within(
        "the refused connection closes",
        stream.read_to_end(&mut got),
    )
    .await;
    got
}

/// Whether `bytes` start with a node-link frame holding a `Hello` (the listener answering).
fn holds_hello(bytes: &[u8]) -> bool {
    bytes.len() > 4
        && matches!(
            wire::decode_body(&bytes::Bytes::copy_from_slice(&bytes[4..]), 1 << 20),
            Ok(Envelope::Hello { .. })
        )
}

#[tokio::test]
async fn a_tls_link_listener_refuses_and_logs_peers_without_the_cluster_ca() {
    // Current-thread runtime: every task of the transports runs on this thread, under
    // this subscriber.
    let (logs, _guard) = Logs::capture();

    let pki = Pki::new("Warren cluster CA");
    let other = Pki::new("Another CA");
    let node1 = tls_transport(1, &pki.node("node1", &["127.0.0.1"])).await;
    let addr1 = node1.local_addr();
    let hello = |id| {
        wire::encode_frame(
            &Envelope::Hello {
                cluster_id: CLUSTER_ID.into(),
                node_id: id,
                version: PROTOCOL_VERSION,
            },
            1 << 20,
        )
        .expect("encodes")
    };

    // 1. A node whose certificate comes from another CA (it trusts the cluster's CA, so it
    //    is node 1 that refuses it).
    let mut stranger_tls = other.node("node2", &["127.0.0.1"]);
    stranger_tls.cacertfile = Some(pki.ca_file());
    let stranger = tls_transport(2, &stranger_tls).await;
    stranger.set_peer(1, addr1.to_string());
    node1.set_peer(2, stranger.local_addr().to_string());
    let refused = stranger.send_broker(1, b"x".to_vec()).await;
    assert!(refused.is_err(), "a link with another CA's certificate");

    // 2. TLS without a client certificate.
    let client = pki.client_config(None, &[&rustls::version::TLS13]);
    let tcp = within("connect", TcpStream::connect(addr1))
        .await
        .expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("name");
    let session = within(
        "client handshake",
        tokio_rustls::TlsConnector::from(client).connect(name, tcp),
    )
    .await;
    // With TLS 1.3 the client finishes first; the server's refusal arrives as an alert.
    if let Ok(session) = session {
        assert!(!holds_hello(&answer_to(session, &hello(3)).await));
    }

    // 3. Plaintext: a well-formed Hello of a known node, without TLS.
    let tcp = within("connect", TcpStream::connect(addr1))
        .await
        .expect("connect");
    let answer = answer_to(tcp, &hello(2)).await;
    assert!(!holds_hello(&answer), "a plaintext peer got a Hello back");
    assert!(node1.connected_peers().is_empty());

    // A member with the cluster CA's certificate links (so the refusals above are the
    // certificates', not a broken setup).
    let member = tls_transport(3, &pki.node("node3", &["127.0.0.1"])).await;
    member.set_peer(1, addr1.to_string());
    node1.set_peer(3, member.local_addr().to_string());
    let reply = member
        .send_broker(1, b"x".to_vec())
        .await
        .expect("a member links");
    within("reply over TLS", reply)
        .await
        .expect("answered")
        .expect("served");
    assert_eq!(node1.connected_peers(), vec![3]);

    let text = logs.text();
    let refusals: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("refusing link: TLS handshake failed"))
        .collect();
    eprintln!("{}", refusals.join("\n"));
    assert!(refusals.len() >= 3, "three refusals logged:\n{text}");
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("invalid peer certificate")),
        "the other CA's certificate is named as the reason:\n{text}"
    );
    assert!(
        refusals.iter().any(|l| l.contains("no certificates")),
        "a missing certificate is named as the reason:\n{text}"
    );
    for t in [node1, stranger, member] {
        t.shutdown();
    }
}

#[tokio::test]
async fn a_tls_link_listener_takes_a_node_id_only_from_a_certificate_naming_that_nodes_host() {
    let (logs, _guard) = Logs::capture();

    // Three hosts, as three loopback addresses, each node's certificate naming its own.
    let pki = Pki::new("Warren cluster CA");
    let node1 = tls_transport_on("127.0.0.1", 1, &pki.node("node1", &["127.0.0.1"])).await;
    let node2 = tls_transport_on("127.0.0.2", 2, &pki.node("node2", &["127.0.0.2"])).await;
    let node3 = tls_transport_on("127.0.0.3", 3, &pki.node("node3", &["127.0.0.3"])).await;
    let (addr1, addr2, addr3) = (
        node1.local_addr().to_string(),
        node2.local_addr().to_string(),
        node3.local_addr().to_string(),
    );
    node1.set_peer(2, addr2.clone());
    node1.set_peer(3, addr3.clone());

    // A node of 127.0.0.3 with a valid certificate of the cluster's CA claims to be node 2,
    // which node 1 knows at 127.0.0.2.
    let impostor = tls_transport_on("127.0.0.3", 2, &pki.node("node3", &["127.0.0.3"])).await;
    impostor.set_peer(1, addr1.clone());
    let refused = impostor.send_broker(1, b"x".to_vec()).await;
    assert!(
        refused.is_err(),
        "a certificate of another host took node 2's id"
    );
    assert!(node1.connected_peers().is_empty());

    // The real nodes 2 and 3 link: their certificates name their hosts.
    for (node, id) in [(&node2, 2), (&node3, 3)] {
        node.set_peer(1, addr1.clone());
        let reply = node
            .send_broker(1, b"x".to_vec())
            .await
            .unwrap_or_else(|e| panic!("node {id} links: {e}"));
        within("reply over TLS", reply)
            .await
            .expect("answered")
            .expect("served");
    }
    assert_eq!(node1.connected_peers(), vec![2, 3]);

    let text = logs.text();
    let refusal = text
        .lines()
        .find(|l| l.contains("refusing link: node 2 is registered at"))
        .unwrap_or_else(|| panic!("the refusal is logged with its reason:\n{text}"));
    assert!(
        refusal.contains("does not name 127.0.0.2"),
        "the refusal names the host the certificate lacks: {refusal}"
    );
    for t in [node1, node2, node3, impostor] {
        t.shutdown();
    }
}

/// The `[cluster.tls]` and `[admin.tls]` sections of node `id` at `ip`, with a node
/// certificate for `ip` from `pki`.
fn tls_sections(pki: &Pki, id: u64, ip: &str) -> String {
    let t = pki.node(&format!("node{id}"), &[ip]);
    let ca = pki.ca_file();
    format!(
        "[cluster.tls]\ncertfile = \"{cert}\"\nkeyfile = \"{key}\"\ncacertfile = \"{ca}\"\n\n\
         [admin.tls]\ncertfile = \"{cert}\"\nkeyfile = \"{key}\"\n",
        cert = t.certfile.display(),
        key = t.keyfile.display(),
        ca = ca.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tls_cluster_of_three_forms_and_keeps_a_mirrored_queue_through_a_master_kill() {
    let pki = Pki::new("Warren cluster CA");
    let ctl = vec!["--cacert".to_string(), pki.ca_file().display().to_string()];
    let mut cluster = Cluster::start_configured(
        "tls",
        TEST_TIMEOUTS,
        |id, ip| tls_sections(&pki, id, ip),
        ctl,
    )
    .await;
    // warrenctl over TLS, through every node.
    for id in 1..=3 {
        let status = cluster.ctl_rows(id, &["cluster_status"]).await;
        assert_eq!(status.len(), 4, "three nodes seen by node {id}: {status:?}");
    }
    cluster.set_ha_policy(procs::ALL_AUTOMATIC).await;
    let c1 = procs::connect(&cluster.node(1).amqp_uri()).await;
    procs::declare(
        &procs::channel(&c1).await,
        "ha.tls",
        true,
        procs::locator("client-local"),
    )
    .await
    .expect("declare");
    common::close_connection(&c1).await;

    // 200 confirmed publishes through node 2: forwarded to the master on node 1 and
    // mirrored to nodes 2 and 3, all over TLS links.
    let c2 = procs::connect(&cluster.node(2).amqp_uri()).await;
    let ch = procs::channel(&c2).await;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm mode");
    for i in 0..200u32 {
        let body = format!("m{i}");
        assert!(procs::publish_acked(&ch, "", "ha.tls", body.as_bytes()).await);
    }
    common::close_connection(&c2).await;
    let start = Instant::now();
    loop {
        let rows = cluster
            .ctl_rows(
                3,
                &["list_queues", "name", "messages", "synchronised_slave_pids"],
            )
            .await;
        let row = rows.iter().find(|r| r[0] == "ha.tls");
        if row.is_some_and(|r| {
            r[1] == "200" && r[2].contains("warren2@test") && r[2].contains("warren3@test")
        }) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "mirrors never synchronised: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The master's node dies; a mirror takes over with every confirmed message.
    cluster.nodes[0].kill();
    let c3 = procs::connect(&cluster.node(3).amqp_uri()).await;
    let mut got = Vec::new();
    let start = Instant::now();
    while got.len() < 200 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} of 200 messages after the kill",
            got.len()
        );
        // A fresh channel each round: a get during the failover may close the channel.
        let ch = procs::channel(&c3).await;
        match within(
            "basic.get",
            ch.basic_get("ha.tls".into(), BasicGetOptions { no_ack: true }),
        )
        .await
        {
            Ok(Some(m)) => got.push(String::from_utf8_lossy(&m.delivery.data).into_owned()),
            Ok(None) | Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let expected: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    assert_eq!(got, expected);

    for n in &cluster.nodes[1..] {
        let log = n.log_text();
        assert!(
            log.contains("link up") && log.contains("tls=true"),
            "node {} linked over TLS:\n{log}",
            n.id
        );
        assert!(
            !log.contains("refusing link"),
            "node {} refused a member:\n{log}",
            n.id
        );
    }
}

/// Runs warrenctl with `args`.
async fn warrenctl(args: Vec<String>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_warrenctl"));
    cmd.args(args);
    within(
        "warrenctl",
        tokio::task::spawn_blocking(move || cmd.output().expect("run warrenctl")),
    )
    .await
    .expect("join")
}

#[tokio::test]
async fn warrenctl_needs_the_ca_and_a_client_certificate_for_a_tls_admin_endpoint() {
    let pki = Pki::new("Warren admin CA");
    let other = Pki::new("Another CA");
    let mut admin = pki.listener(true, true);
    admin.listen = None;
    let node = TestNode::start_with(|c| c.admin.tls = Some(admin)).await;
    let client = pki.client("guest", &["guest"]);
    let (cert, key) = (pki.dir.join("client.pem"), pki.dir.join("client.key"));
    std::fs::write(&cert, &client.cert_pem).expect("write");
    std::fs::write(&key, &client.key_pem).expect("write");
    let path = |p: &std::path::Path| p.display().to_string();
    let node_addr = node.admin_addr().to_string();
    let run = |extra: Vec<String>| {
        let mut args = vec!["--node".to_string(), node_addr.clone()];
        args.extend(extra);
        args.push("list_vhosts".into());
        warrenctl(args)
    };

    let ok = run(vec![
        "--cacert".into(),
        path(&pki.ca_file()),
        "--cert".into(),
        path(&cert),
        "--key".into(),
        path(&key),
    ])
    .await;
    assert!(ok.status.success(), "{ok:?}");
    assert!(String::from_utf8_lossy(&ok.stdout).contains('/'), "{ok:?}");

    // Plaintext against a TLS endpoint.
    let plain = run(vec![]).await;
    assert!(!plain.status.success(), "{plain:?}");
    // The node's certificate does not chain to the CA given.
    let wrong_ca = run(vec![
        "--cacert".into(),
        path(&other.ca_file()),
        "--cert".into(),
        path(&cert),
        "--key".into(),
        path(&key),
    ])
    .await;
    assert_eq!(wrong_ca.status.code(), Some(69), "{wrong_ca:?}");
    let stderr = String::from_utf8_lossy(&wrong_ca.stderr);
    assert!(stderr.contains("TLS handshake failed"), "{stderr}");
    // The right CA, no client certificate: the endpoint wants one.
    let anonymous = run(vec!["--cacert".into(), path(&pki.ca_file())]).await;
    assert!(!anonymous.status.success(), "{anonymous:?}");
    // Options without --cacert are a usage error.
    let usage = run(vec![
        "--cert".into(),
        path(&cert),
        "--key".into(),
        path(&key),
    ])
    .await;
    assert_eq!(usage.status.code(), Some(64), "{usage:?}");
    node.shutdown().await;
}

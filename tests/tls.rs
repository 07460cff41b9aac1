//! TLS against a real node over loopback, with certificates made at test time
//! ([`pki`]): AMQPS with lapin beside the plaintext listener, SASL EXTERNAL with client
//! certificates, `verify_peer` / `fail_if_no_peer_cert`, the protocol versions offered,
//! the management API over HTTPS, and the typed start-up errors of unusable files.

mod common;
#[path = "tls/pki.rs"]
mod pki;

use std::net::SocketAddr;
use std::sync::Arc;

use amq_protocol::frame::{parse_frame, AMQPFrame};
use amq_protocol::protocol::{connection, AMQPClass};
use common::*;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Connection, DefaultConnectionBuilder};
use pki::{Identity, Pki};
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use warren::config::{CertLoginFrom, Config, TlsConfig};
use warren::runtime::tls::TlsError;
use warren::runtime::{Node, NodeError};

const BOTH: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// A node with `[amqp.tls]` (`verify_peer`, `fail_if_no_peer_cert` as given) and
/// `[management.tls]`, and the user `alice` with every permission on `/`.
async fn tls_node(pki: &Pki, verify_peer: bool, fail: bool) -> TestNode {
    tls_node_with(pki, verify_peer, fail, |_| {}).await
}

async fn tls_node_with(
    pki: &Pki,
    verify_peer: bool,
    fail: bool,
    adjust: impl FnOnce(&mut Config),
) -> TestNode {
    let amqp = pki.listener(verify_peer, fail);
    let management = pki.listener(false, false);
    TestNode::start_with(|c| {
        c.amqp.tls = Some(amqp);
        c.management.tls = Some(management);
        add_user(c, "alice", "alice-pw", Some(("/", ".*", ".*", ".*")));
        c.users.last_mut().expect("alice").tags = vec!["administrator".into()];
        adjust(c);
    })
    .await
}

fn lapin_tls(pki: &Pki, identity: Option<&Identity>) -> OwnedTLSConfig {
    OwnedTLSConfig {
        identity: identity.map(|i| OwnedIdentity::PKCS8 {
            pem: i.cert_pem.clone().into_bytes(),
            key: i.key_pem.clone().into_bytes(),
        }),
        cert_chain: Some(pki.ca_pem.clone()),
    }
}

/// A lapin connection over TLS to `uri` (`amqps://...`).
async fn connect_tls(uri: &str, tls: OwnedTLSConfig) -> lapin::Result<Connection> {
    let builder = DefaultConnectionBuilder::new()?
        .with_uri_str(uri.to_string())
        .with_tls_config(tls);
    within("lapin TLS connect", builder.connect()).await
}

/// A TLS session with the node, made by hand (tokio-rustls).
async fn handshake(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = within("tcp connect", TcpStream::connect(addr)).await?;
    let name = ServerName::try_from("127.0.0.1").expect("server name");
    within(
        "TLS handshake",
        TlsConnector::from(config).connect(name, tcp),
    )
    .await
}

/// Sends the protocol header and returns connection.start's mechanisms, or the error /
/// end of stream met instead.
async fn start_mechanisms<S>(stream: &mut S) -> Result<String, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut buf = Vec::new();
    loop {
        if let Ok((_, frame)) = parse_frame(&buf[..]) {
            return match frame {
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(s))) => {
                    Ok(s.mechanisms.to_string())
                }
                other => Err(format!("unexpected {other:?}")),
            };
        }
        let mut chunk = [0u8; 4096];
        match within("read connection.start", stream.read(&mut chunk)).await {
            Ok(0) => return Err("end of stream".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// A GET with basic auth over HTTPS trusting `pki`'s CA: (status, JSON body).
async fn https_get(
    pki: &Pki,
    addr: SocketAddr,
    path: &str,
    auth: Option<(&str, &str)>,
) -> (u16, Value) {
    let agent = ureq::AgentBuilder::new()
        .tls_config(pki.client_config(None, BOTH))
        .build();
    let url = format!("https://127.0.0.1:{}{path}", addr.port());
    let auth = auth.map(|(u, p)| warren::mgmt::basic_auth(u, p));
    tokio::task::spawn_blocking(move || {
        let mut req = agent.get(&url);
        if let Some(a) = &auth {
            req = req.set("Authorization", a);
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("GET {url}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().expect("body");
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status, json)
    })
    .await
    .expect("https task")
}

#[tokio::test]
async fn lapin_round_trip_over_tls_beside_the_plaintext_listener() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, false, false).await;
    assert_ne!(node.addr, node.amqps_addr(), "two listeners");
    let plain = node.connect().await;
    let plain_ch = confirm_channel(&plain).await;
    declare_queue(&plain_ch, "over-tls").await;
    let uri = format!(
        "amqps://guest:guest@127.0.0.1:{}/%2f",
        node.amqps_addr().port()
    );
    let tls = connect_tls(&uri, lapin_tls(&pki, None))
        .await
        .expect("TLS connection opens");
    let tls_ch = confirm_channel(&tls).await;
    let body = vec![7u8; 1024];
    publish_confirmed(&plain_ch, "", "over-tls", b"from plaintext").await;
    publish_confirmed(&tls_ch, "", "over-tls", &body).await;
    let mut deliveries = consume(&tls_ch, "over-tls", BasicConsumeOptions::default()).await;
    let first = deliveries.next().await;
    assert_eq!(first.data, b"from plaintext");
    let second = deliveries.next().await;
    assert_eq!(second.data, body, "1 KiB body intact over TLS");
    second
        .ack(BasicAckOptions { multiple: true })
        .await
        .expect("ack");
    // The listings tell the two apart.
    let (status, conns) = https_get(
        &pki,
        node.mgmt_tls_addr(),
        "/api/connections",
        Some(("guest", "guest")),
    )
    .await;
    assert_eq!(status, 200, "{conns}");
    let conns = conns.as_array().expect("a list").clone();
    assert_eq!(conns.len(), 2, "{conns:?}");
    let tls_entry = conns
        .iter()
        .find(|c| c["port"] == node.amqps_addr().port())
        .expect("the TLS connection is listed");
    assert_eq!(tls_entry["ssl"], true);
    assert_eq!(tls_entry["ssl_protocol"], "tlsv1.3");
    assert_eq!(tls_entry["auth_mechanism"], "PLAIN");
    let plain_entry = conns
        .iter()
        .find(|c| c["port"] == node.addr.port())
        .expect("the plaintext connection is listed");
    assert_eq!(plain_entry["ssl"], false);
    node.shutdown().await;
}

#[tokio::test]
async fn external_is_offered_on_tls_and_logs_in_as_the_certificate_user() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, true, false).await;
    let alice = pki.client("alice", &[]);
    let mut tls = handshake(node.amqps_addr(), pki.client_config(Some(&alice), BOTH))
        .await
        .expect("handshake with a client certificate");
    assert_eq!(
        start_mechanisms(&mut tls).await.as_deref(),
        Ok("PLAIN AMQPLAIN EXTERNAL")
    );
    let mut anonymous = handshake(node.amqps_addr(), pki.client_config(None, BOTH))
        .await
        .expect("verify_peer alone lets a client without a certificate in");
    assert_eq!(
        start_mechanisms(&mut anonymous).await.as_deref(),
        Ok("PLAIN AMQPLAIN EXTERNAL"),
        "offered without a certificate too, as RabbitMQ does"
    );
    let mut plain = TcpStream::connect(node.addr).await.expect("tcp");
    assert_eq!(
        start_mechanisms(&mut plain).await.as_deref(),
        Ok("PLAIN AMQPLAIN")
    );

    let uri = format!(
        "amqps://127.0.0.1:{}/%2f?auth_mechanism=external",
        node.amqps_addr().port()
    );
    let conn = connect_tls(&uri, lapin_tls(&pki, Some(&alice)))
        .await
        .expect("EXTERNAL login as alice");
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "alice-q").await;
    publish_confirmed(&ch, "", "alice-q", b"hello").await;
    let (status, conns) = https_get(
        &pki,
        node.mgmt_tls_addr(),
        "/api/connections",
        Some(("guest", "guest")),
    )
    .await;
    assert_eq!(status, 200);
    let entry = conns
        .as_array()
        .and_then(|l| l.iter().find(|c| c["user"] == "alice"))
        .expect("alice's connection is listed")
        .clone();
    assert_eq!(entry["auth_mechanism"], "EXTERNAL");
    let subject = entry["peer_cert_subject"].as_str().expect("a subject");
    assert!(subject.contains("CN=alice"), "{subject}");
    // The rest of RabbitMQ's TLS fields: the CA as issuer, the validity, and the suite in
    // Erlang's names (TLS 1.3: key exchange `any`, an AEAD cipher's hash `aead`).
    let issuer = entry["peer_cert_issuer"].as_str().expect("an issuer");
    assert!(issuer.contains("CN=Warren test CA"), "{entry}");
    let validity = entry["peer_cert_validity"].as_str().expect("a validity");
    let (from, to) = validity.split_once(" - ").expect("from - to");
    assert!(
        from.len() == 20 && from.ends_with('Z') && to.len() == 20 && from < to,
        "{validity}"
    );
    assert_eq!(
        (
            &entry["ssl_protocol"],
            &entry["ssl_key_exchange"],
            &entry["ssl_hash"]
        ),
        (&json!("tlsv1.3"), &json!("any"), &json!("aead")),
        "{entry}"
    );
    let cipher = entry["ssl_cipher"].as_str().expect("a cipher");
    assert!(
        ["aes_256_gcm", "aes_128_gcm", "chacha20_poly1305"].contains(&cipher),
        "{entry}"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn external_takes_the_first_dns_name_with_subject_alternative_name() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node_with(&pki, true, false, |c| {
        if let Some(t) = c.amqp.tls.as_mut() {
            t.ssl_cert_login_from = Some(CertLoginFrom::SubjectAlternativeName);
        }
    })
    .await;
    let uri = format!(
        "amqps://127.0.0.1:{}/%2f?auth_mechanism=external",
        node.amqps_addr().port()
    );
    let by_san = pki.client("not-a-user", &["alice", "bob"]);
    let conn = connect_tls(&uri, lapin_tls(&pki, Some(&by_san)))
        .await
        .expect("EXTERNAL login as the first DNS name, alice");
    open_channel(&conn).await;
    let by_cn_only = pki.client("alice", &[]);
    let refused = connect_tls(&uri, lapin_tls(&pki, Some(&by_cn_only))).await;
    assert_code(refused, 403, "a certificate without a DNS name");
    node.shutdown().await;
}

#[tokio::test]
async fn external_is_refused_as_rabbitmq_refuses_it() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, true, false).await;
    let uri = format!(
        "amqps://127.0.0.1:{}/%2f?auth_mechanism=external",
        node.amqps_addr().port()
    );
    let no_cert = connect_tls(&uri, lapin_tls(&pki, None)).await;
    assert_code(no_cert, 403, "EXTERNAL without a client certificate");
    let mallory = pki.client("mallory", &[]);
    let unknown = connect_tls(&uri, lapin_tls(&pki, Some(&mallory))).await;
    assert_code(unknown, 403, "EXTERNAL for a user that does not exist");
    let plain = node
        .try_connect_uri(&format!("amqp://{}/%2f?auth_mechanism=external", node.addr))
        .await;
    // A mechanism the listener does not offer is a handshake error: RabbitMQ closes the
    // socket without a method (differential scenario handshake/login-external-without-tls).
    let refused = plain.expect_err("EXTERNAL on the plaintext listener, where it is not offered");
    assert_eq!(
        reply_code(&refused),
        None,
        "EXTERNAL on the plaintext listener: the socket closes without connection.close, got {refused:?}"
    );
    // Passwords still work on the TLS listener for a client with a certificate.
    let alice = pki.client("alice", &[]);
    let password = format!(
        "amqps://alice:alice-pw@127.0.0.1:{}/%2f",
        node.amqps_addr().port()
    );
    connect_tls(&password, lapin_tls(&pki, Some(&alice)))
        .await
        .expect("PLAIN over TLS");
    node.shutdown().await;
}

#[tokio::test]
async fn fail_if_no_peer_cert_refuses_clients_without_a_valid_certificate_at_the_tls_layer() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, true, true).await;
    let addr = node.amqps_addr();
    // With a certificate of the node's CA: the AMQP handshake starts.
    let alice = pki.client("alice", &[]);
    let mut ok = handshake(addr, pki.client_config(Some(&alice), BOTH))
        .await
        .expect("handshake");
    assert!(start_mechanisms(&mut ok).await.is_ok());
    // TLS 1.3 clients finish their side before the server has checked them: the refusal
    // arrives as an alert on the first read, never as connection.start.
    let refused = match handshake(addr, pki.client_config(None, &[&rustls::version::TLS13])).await {
        Ok(mut s) => start_mechanisms(&mut s).await,
        Err(e) => Err(e.to_string()),
    };
    let err = refused.expect_err("no certificate: refused");
    assert!(err.contains("CertificateRequired"), "{err}");
    // TLS 1.2: the handshake itself fails.
    let tls12 = handshake(addr, pki.client_config(None, &[&rustls::version::TLS12])).await;
    assert!(tls12.is_err(), "TLS 1.2 without a certificate completed");
    // A certificate from another CA is no better.
    let other = Pki::new("Another CA");
    let stranger = other.client("alice", &[]);
    let mut config = (*pki.client_config(None, BOTH)).clone();
    config.client_auth_cert_resolver = other
        .client_config(Some(&stranger), BOTH)
        .client_auth_cert_resolver
        .clone();
    let foreign = match handshake(addr, Arc::new(config)).await {
        Ok(mut s) => start_mechanisms(&mut s).await,
        Err(e) => Err(e.to_string()),
    };
    assert!(foreign.is_err(), "a certificate of another CA was accepted");
    // lapin sees a failed connection, not an AMQP refusal.
    let uri = format!("amqps://guest:guest@127.0.0.1:{}/%2f", addr.port());
    let lapin = connect_tls(&uri, lapin_tls(&pki, None)).await;
    assert!(lapin.is_err(), "lapin without a certificate connected");
    node.shutdown().await;
}

/// A TLS 1.1 ClientHello (no supported_versions extension), by hand: rustls clients cannot
/// send one. Its cipher suite and signature algorithm suit the test certificate (ECDSA
/// P-256), so the version is the only thing wrong with it.
fn tls11_client_hello() -> Vec<u8> {
    let mut body = vec![0x03, 0x02]; // client_version TLS 1.1
    body.extend([0x42u8; 32]); // random
    body.push(0); // session id
    body.extend([0x00, 0x02, 0xc0, 0x2b]); // ECDHE-ECDSA-AES128-GCM-SHA256
    body.extend([0x01, 0x00]); // compression: null
                               // Extensions: signature_algorithms = [ecdsa_secp256r1_sha256].
    body.extend([0x00, 0x08, 0x00, 0x0d, 0x00, 0x04, 0x00, 0x02, 0x04, 0x03]);
    let mut handshake = vec![0x01, 0, (body.len() >> 8) as u8, body.len() as u8];
    handshake.extend(body);
    let mut record = vec![
        0x16,
        0x03,
        0x01,
        (handshake.len() >> 8) as u8,
        handshake.len() as u8,
    ];
    record.extend(handshake);
    record
}

#[tokio::test]
async fn only_tls_1_2_and_1_3_are_accepted() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, false, false).await;
    for (version, expected) in [
        (&rustls::version::TLS12, rustls::ProtocolVersion::TLSv1_2),
        (&rustls::version::TLS13, rustls::ProtocolVersion::TLSv1_3),
    ] {
        let mut s = handshake(node.amqps_addr(), pki.client_config(None, &[version]))
            .await
            .expect("handshake");
        assert_eq!(s.get_ref().1.protocol_version(), Some(expected));
        assert!(start_mechanisms(&mut s).await.is_ok(), "{expected:?}");
    }
    let mut tcp = TcpStream::connect(node.amqps_addr()).await.expect("tcp");
    tcp.write_all(&tls11_client_hello()).await.expect("hello");
    let mut answer = Vec::new();
    within("the server's answer", tcp.read_to_end(&mut answer))
        .await
        .expect("read");
    // One alert record: fatal (2), protocol_version (70).
    assert_eq!(
        answer,
        [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 70],
        "expected a protocol_version alert"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn the_management_api_answers_over_https_and_http() {
    let pki = Pki::new("Warren test CA");
    let node = tls_node(&pki, false, false).await;
    let https = node.mgmt_tls_addr();
    let (status, overview) =
        https_get(&pki, https, "/api/overview", Some(("guest", "guest"))).await;
    assert_eq!(status, 200, "{overview}");
    assert_eq!(overview["node"], "warren@localhost", "{overview}");
    let (status, _) = https_get(&pki, https, "/api/overview", None).await;
    assert_eq!(status, 401);
    let port_check = format!(
        "/api/health/checks/port-listener/{}",
        node.amqps_addr().port()
    );
    let (status, body) = https_get(&pki, https, &port_check, Some(("guest", "guest"))).await;
    assert_eq!(status, 200, "the AMQPS port is a listener: {body}");
    // The HTTP listener still answers, and a client not trusting the CA gets nowhere.
    let http = format!("http://{}/api/overview", node.mgmt_addr());
    let plain = tokio::task::spawn_blocking(move || {
        ureq::get(&http)
            .set("Authorization", &warren::mgmt::basic_auth("guest", "guest"))
            .call()
            .map(|r| r.status())
            .ok()
    })
    .await
    .expect("task");
    assert_eq!(plain, Some(200));
    let other = Pki::new("Another CA");
    let mistrusting = handshake(https, other.client_config(None, BOTH)).await;
    assert!(
        mistrusting.is_err(),
        "a client trusting another CA connected"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn unusable_tls_files_stop_the_start_with_a_typed_error() {
    let pki = Pki::new("Warren test CA");
    let data = std::env::temp_dir().join(unique("warren-tls-start"));
    let start = |adjust: &dyn Fn(&mut TlsConfig), management: bool| {
        let mut config = Config::for_tests(&data);
        let mut tls = pki.listener(true, false);
        adjust(&mut tls);
        if management {
            config.management.tls = Some(tls);
        } else {
            config.amqp.tls = Some(tls);
        }
        Node::start(config)
    };
    let missing = pki.dir.join("absent.pem");
    let err = within("start", start(&|t| t.certfile = missing.clone(), false))
        .await
        .expect_err("a missing certfile stops the start");
    assert!(
        matches!(
            &err,
            NodeError::Tls(TlsError::Read {
                section: "amqp.tls",
                key: "certfile",
                ..
            })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("absent.pem"), "{err}");
    let junk = pki.dir.join("junk.pem");
    std::fs::write(&junk, "junk\n").expect("write");
    let err = within("start", start(&|t| t.cacertfile = Some(junk.clone()), true))
        .await
        .expect_err("a CA file without certificates stops the start");
    assert!(
        matches!(
            &err,
            NodeError::Tls(TlsError::Pem {
                section: "management.tls",
                key: "cacertfile",
                ..
            })
        ),
        "{err:?}"
    );
    // A key that is not the certificate's.
    let other = pki.client("x", &[]);
    let key = pki.dir.join("other.key");
    std::fs::write(&key, &other.key_pem).expect("write");
    let err = within("start", start(&|t| t.keyfile = key.clone(), false))
        .await
        .expect_err("a key that does not match stops the start");
    assert!(
        matches!(&err, NodeError::Tls(TlsError::Rustls { .. })),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&data);
}

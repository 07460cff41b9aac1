//! Makes the fuzz targets' seed corpora from real traffic and real files (`docs/security.md`,
//! *Fuzzing*). Ignored: it writes into `fuzz/corpus/`, and is run by hand when the formats
//! change:
//!
//! ```sh
//! cargo test --test fuzz_seeds -- --ignored --nocapture
//! ```
//!
//! - `amqp_frames`, `content_header`: what lapin writes to a node, recorded by a tap between
//!   them (one file per connection; every content header frame's payload).
//! - `definitions`: the node's `GET /api/definitions` after the workload, and RabbitMQ
//!   3.10.8's answers to it recorded in `.ci/mgmt-compare-rabbitmq-3.10.8.json`.
//! - `store`: the node's data folder (message store, each queue's index, definitions file)
//!   while it runs (as a crash leaves it) and after a clean shutdown.
//! - `admin`: the frames `warrenctl` writes (its parser and encoder) for several commands,
//!   sent to the node so each is known to be served.
//! - `gm_wire`, `node_link`: GM frames and node-link envelopes made by the broker's own
//!   encoders (the GM host's outbox, with parts) from mirror messages of real operations.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use common::{within, TestNode};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use warren::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use warren::broker::queue::IndexOp;
use warren::broker::Message;
use warren::fuzzing::{pack_files, pack_length_prefixed};
use warren::gm::{Batch, GmFrame, GmMsg, GmReply, Inbox, Item, MemberId, Outbox};
use warren::mirror::message::MirrorMsg;
use warren::runtime::node_link::wire::{encode_frame, Envelope, RemoteFailure, Service};

fn corpus_dir(target: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("create corpus folder");
    dir
}

fn write_seed(target: &str, name: &str, bytes: &[u8]) {
    std::fs::write(corpus_dir(target).join(format!("seed-{name}")), bytes).expect("write seed");
}

/// What a tap recorded: each connection's client bytes, in order of arrival.
type Recorded = Arc<Mutex<Vec<Arc<Mutex<Vec<u8>>>>>>;

/// A TCP tap: forwards connections to `target` and records what each client wrote.
async fn tap(target: SocketAddr) -> (SocketAddr, Recorded) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind tap");
    let addr = listener.local_addr().expect("tap addr");
    let streams: Recorded = Arc::default();
    let all = streams.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(target).await else {
                continue;
            };
            let record: Arc<Mutex<Vec<u8>>> = Arc::default();
            all.lock().expect("tap lock").push(record.clone());
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    record
                        .lock()
                        .expect("tap lock")
                        .extend_from_slice(&buf[..n]);
                }
                let _ = sw.shutdown().await;
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
        }
    });
    (addr, streams)
}

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn lstr(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Properties with every field set, and headers of most value types (a nested table, an
/// array, an `x-death` as a dead-lettered message carries it).
fn rich_properties() -> BasicProperties {
    let death = table(&[
        ("queue", lstr("fq")),
        ("reason", lstr("rejected")),
        ("count", AMQPValue::LongLongInt(2)),
        ("exchange", lstr("")),
    ]);
    let headers = table(&[
        ("h1", lstr("v1")),
        ("n", AMQPValue::LongLongInt(-42)),
        ("f", AMQPValue::Double(1.5)),
        ("b", AMQPValue::Boolean(true)),
        ("t", AMQPValue::FieldTable(table(&[("inner", lstr("x"))]))),
        (
            "a",
            AMQPValue::FieldArray(FieldArray::from(vec![lstr("one"), AMQPValue::ShortInt(2)])),
        ),
        (
            "x-death",
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        ),
        ("x-match-me", AMQPValue::Void),
    ]);
    BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_content_encoding("utf-8".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("corr".into())
        .with_reply_to("reply-q".into())
        .with_expiration("60000".into())
        .with_message_id("id-1".into())
        .with_timestamp(1_700_000_000)
        .with_type("t".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
}

/// The AMQP workload whose client bytes become the `amqp_frames` seeds.
async fn amqp_workload(uri: &str) {
    let conn = within(
        "connect",
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await
    .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm");
    ch.exchange_declare(
        "fx.h".into(),
        ExchangeKind::Headers,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange");
    let args = table(&[
        ("x-max-length", AMQPValue::LongInt(1000)),
        ("x-message-ttl", AMQPValue::LongInt(600_000)),
        ("x-dead-letter-exchange", lstr("fx.h")),
    ]);
    ch.queue_declare(
        "fq".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("queue");
    let bind_args = table(&[("x-match", lstr("any")), ("h1", lstr("v1"))]);
    ch.queue_bind(
        "fq".into(),
        "fx.h".into(),
        "".into(),
        QueueBindOptions::default(),
        bind_args,
    )
    .await
    .expect("bind");
    // A small body (embedded in the queue index), one past the index's embedding limit,
    // and one over several body frames (the node offers an 8 KiB frame_max).
    let bodies: Vec<Vec<u8>> = vec![b"hello".to_vec(), vec![b'm'; 5000], vec![b'b'; 20_000]];
    for body in &bodies {
        ch.basic_publish(
            "fx.h".into(),
            "".into(),
            BasicPublishOptions::default(),
            body,
            rich_properties(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    for i in 0..3 {
        ch.basic_publish(
            "".into(),
            "fq".into(),
            BasicPublishOptions::default(),
            format!("plain {i}").as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    let got = ch
        .basic_get("fq".into(), BasicGetOptions::default())
        .await
        .expect("get")
        .expect("a message");
    got.delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .expect("nack");
    let ch2 = conn.create_channel().await.expect("channel 2");
    ch2.basic_qos(2, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut deliveries = common::consume(&ch2, "fq", BasicConsumeOptions::default()).await;
    for _ in 0..2 {
        let d = deliveries.next().await;
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    ch2.close(200, "bye".into()).await.expect("close channel");
    conn.close(200, "bye".into()).await.expect("close");
}

/// The files of `dir` (recursively one level: a queue's index folder), packed for `store`.
fn data_files(data: &Path) -> Vec<Vec<u8>> {
    let read = |dir: &Path, prefix: &str| -> Vec<(String, Vec<u8>)> {
        let mut files = Vec::new();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return files;
        };
        for e in entries.flatten() {
            if e.path().is_file() {
                let bytes = std::fs::read(e.path()).expect("read data file");
                files.push((
                    format!("{prefix}{}", e.file_name().to_string_lossy()),
                    bytes,
                ));
            }
        }
        files.sort();
        files
    };
    let store = read(&data.join("msg_store_persistent"), "m/");
    let definitions = read(data, "")
        .into_iter()
        .filter(|(n, _)| n == "definitions");
    let mut seeds = Vec::new();
    let mut queues: Vec<PathBuf> = std::fs::read_dir(data.join("queues"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    queues.sort();
    let definitions: Vec<_> = definitions.collect();
    for q in queues {
        let mut files = store.clone();
        files.extend(read(&q, "q/"));
        files.extend(definitions.iter().cloned());
        seeds.push(pack_files(&files));
    }
    seeds
}

/// The frames `warrenctl` writes: the login, then one request per command line.
fn admin_seeds(admin: SocketAddr) -> Vec<Vec<u8>> {
    let auth = warren::admin::Auth {
        user: "guest".into(),
        password: "guest".into(),
    };
    let commands: &[&[&str]] = &[
        &["list_queues", "name", "messages", "arguments"],
        &["list_exchanges"],
        &["list_bindings"],
        &["list_connections"],
        &["list_channels"],
        &["list_consumers"],
        &["list_users"],
        &["list_vhosts"],
        &["list_permissions"],
        &["list_policies"],
        &["cluster_status"],
        &["add_vhost", "v1"],
        &["add_user", "bob", "secret"],
        &["set_user_tags", "bob", "administrator"],
        &["set_permissions", "-p", "v1", "bob", ".*", ".*", ".*"],
        &[
            "set_policy",
            "ha",
            "^fq$",
            r#"{"ha-mode":"exactly","ha-params":2,"message-ttl":1000,"x":[1,{"a":null}]}"#,
            "--priority",
            "1",
            "--apply-to",
            "queues",
        ],
        &["clear_policy", "ha"],
        &["sync_queue", "fq"],
        &["set_operator_policy", "op", ".*", r#"{"max-length":10}"#],
        &["list_operator_policies"],
        &["export_definitions", "-"],
        &["delete_user", "bob"],
        &["delete_vhost", "v1"],
    ];
    let mut seeds = Vec::new();
    for argv in commands {
        let args: Vec<String> = argv[1..].iter().map(|s| s.to_string()).collect();
        let Ok(request) = warren::admin::cli::parse(argv[0], &args) else {
            panic!("warrenctl does not parse {argv:?}");
        };
        let login = warren::admin::encode_frame(&auth).expect("encode auth");
        let frame = warren::admin::encode_frame(&request).expect("encode request");
        // Sent to the node, so the seed is a session it serves.
        let mut s = std::net::TcpStream::connect(admin).expect("admin connect");
        s.write_all(&login).expect("write");
        read_admin_frame(&mut s);
        s.write_all(&frame).expect("write");
        read_admin_frame(&mut s);
        seeds.push([login, frame].concat());
    }
    seeds
}

fn read_admin_frame(s: &mut std::net::TcpStream) {
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).expect("admin answer");
    let len = warren::admin::frame_len(prefix).expect("admin frame length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("admin answer body");
}

/// GM frames as a member host sends them: mirror messages of real queue operations through
/// the outbox, in batches and, for a big one, in parts.
fn gm_frames() -> Vec<Vec<Vec<u8>>> {
    let message = Arc::new(
        Message::from_stored(
            &warren::store::message_codec::StoredMessage {
                exchange: "fx.h".into(),
                routing_key: "fq".into(),
                properties_raw: frame::encode_properties(&rich_properties()).into(),
                body: bytes::Bytes::from_static(b"mirrored body"),
            }
            .encode(),
            7,
        )
        .expect("stored message decodes"),
    );
    let ops = vec![
        IndexOp::Publish {
            seq: 1,
            message: message.clone(),
            expires_at_ms: 0,
            persistent: true,
        },
        IndexOp::Deliver { seq: 1 },
        IndexOp::Ack {
            seq: 1,
            message_id: 7,
            size: 13,
            persistent: true,
        },
    ];
    let mirror = [
        MirrorMsg::Ops {
            epoch: 1,
            ops: warren::mirror::ops::encode(&ops).into(),
        },
        MirrorMsg::Flush { epoch: 1 },
        MirrorMsg::SyncStart {
            epoch: 1,
            target: MemberId { node: 2, since: 1 },
            from_seq: 1,
            active: true,
            sync: 1,
        },
        MirrorMsg::SyncBatch {
            epoch: 1,
            target: MemberId { node: 2, since: 1 },
            sync: 1,
            ops: warren::mirror::ops::encode(&ops[..1]).into(),
        },
    ];
    let from = MemberId { node: 1, since: 1 };
    let to = MemberId { node: 2, since: 1 };
    let activity = |pubs: Vec<(u64, bytes::Bytes)>| GmMsg::Activity {
        version: 3,
        from,
        items: vec![Item {
            id: from,
            pubs,
            acks: vec![1],
        }],
    };
    let mut streams = Vec::new();
    // max_bytes small enough that the last message goes in parts.
    for max_bytes in [1 << 20, 64] {
        let mut outbox = Outbox::new();
        let mut inbox = Inbox::new();
        for (i, m) in mirror.iter().enumerate() {
            outbox.push(activity(vec![(i as u64 + 1, m.encode().into())]));
        }
        let mut frames = Vec::new();
        while let Some(batch) = outbox.batch(2, max_bytes) {
            let (first_seq, msgs, part) = match batch {
                Batch::Msgs { first_seq, msgs } => (first_seq, msgs, None),
                Batch::Part { seq, part } => (seq, Vec::new(), Some(part)),
            };
            let frame = GmFrame {
                group: "mirror:/:fq:1".into(),
                from,
                to,
                first_seq,
                msgs,
                part,
            };
            frames.push(bincode::serialize(&frame).expect("encode GM frame"));
            // The receiver's answers drive the sender, as between two hosts.
            match inbox.accept(frame).1 {
                GmReply::Accepted { upto } => outbox.accepted(upto),
                GmReply::Partial { upto, have } => outbox.partial(upto, have),
                other => panic!("unexpected GM reply {other:?}"),
            }
            if frames.len() > 64 {
                break;
            }
        }
        streams.push(frames);
    }
    streams
}

/// Node-link streams: a dialler's hello and requests (GM frames as payloads), an
/// acceptor's answers and refusal, heartbeats.
fn node_link_streams(gm: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    let max = 64 << 20;
    let frame = |e: &Envelope| encode_frame(e, max).expect("encode envelope").to_vec();
    let hello = frame(&Envelope::Hello {
        cluster_id: "warren-cluster".into(),
        node_id: 1,
        version: warren::runtime::node_link::wire::PROTOCOL_VERSION,
    });
    let mut dialler = hello.clone();
    for (id, payload) in gm.iter().flatten().enumerate() {
        dialler.extend(frame(&Envelope::Request {
            id: id as u64,
            service: Service::Gm,
            payload: payload.clone().into(),
        }));
    }
    dialler.extend(frame(&Envelope::Heartbeat { alarms: 0 }));
    dialler.extend(frame(&Envelope::Heartbeat { alarms: 3 }));
    let mut acceptor = hello;
    acceptor.extend(frame(&Envelope::Response {
        id: 0,
        result: Ok(b"reply".to_vec()),
    }));
    acceptor.extend(frame(&Envelope::Response {
        id: 1,
        result: Err(RemoteFailure::NotServing),
    }));
    acceptor.extend(frame(&Envelope::Request {
        id: 9,
        service: Service::Broker,
        payload: vec![0, 1, 2, 3].into(),
    }));
    let refused = frame(&Envelope::Refused {
        reason: "unknown cluster id".into(),
    });
    vec![dialler, acceptor, refused]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the seed corpora into fuzz/corpus/; run by hand"]
async fn write_seed_corpora() {
    // A small frame_max (lapin asks for 8 KiB at least), so that bodies span frames while the seeds stay small.
    let mut node = TestNode::start_with(|c| c.amqp.frame_max_bytes = 8192).await;
    let data = node.data_dir().to_path_buf();
    let (tap_addr, streams) = tap(node.addr).await;
    amqp_workload(&format!("amqp://guest:guest@{tap_addr}/%2f")).await;
    // A second connection that only opens and closes: the handshake alone.
    let conn = Connection::connect(
        &format!("amqp://guest:guest@{tap_addr}/%2f"),
        ConnectionProperties::default(),
    )
    .await
    .expect("connect");
    conn.close(200, "bye".into()).await.expect("close");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let recorded: Vec<Vec<u8>> = streams
        .lock()
        .expect("tap lock")
        .iter()
        .map(|r| r.lock().expect("tap lock").clone())
        .collect();
    let mut headers = 0;
    for (i, bytes) in recorded.iter().enumerate() {
        assert!(
            bytes.starts_with(&PROTOCOL_HEADER[..]),
            "a client stream starts with the header"
        );
        write_seed("amqp_frames", &format!("lapin-{i}"), bytes);
        let mut rest = &bytes[PROTOCOL_HEADER.len()..];
        while let Ok(Some((f, used))) = frame::split(rest, 0) {
            if f.kind == FrameKind::Header {
                write_seed("content_header", &format!("lapin-{i}-{headers}"), f.payload);
                headers += 1;
            }
            rest = &rest[used..];
        }
    }
    let mgmt = node.mgmt_addr();
    let definitions = ureq::get(&format!("http://{mgmt}/api/definitions"))
        .set("Authorization", &warren::mgmt::basic_auth("guest", "guest"))
        .call()
        .expect("GET /api/definitions")
        .into_string()
        .expect("definitions text");
    write_seed("definitions", "export", definitions.as_bytes());
    // RabbitMQ 3.10.8's own exports, as recorded for the management comparison.
    let recorded_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/mgmt-compare-rabbitmq-3.10.8.json");
    let recorded_text =
        std::fs::read_to_string(&recorded_path).expect("read recorded RabbitMQ answers");
    let recorded_json: serde_json::Value =
        serde_json::from_str(&recorded_text).expect("recorded answers are JSON");
    for (step, name) in [
        ("GET /api/definitions", "rabbitmq-3.10.8"),
        ("GET /api/definitions/{v}", "rabbitmq-3.10.8-vhost"),
    ] {
        let body = &recorded_json["steps"][step]["body"];
        assert!(body.is_object(), "no recorded answer for {step}");
        write_seed("definitions", name, body.to_string().as_bytes());
    }
    for (i, seed) in admin_seeds(node.admin_addr()).iter().enumerate() {
        write_seed("admin", &format!("warrenctl-{i}"), seed);
    }
    for (i, seed) in data_files(&data).iter().enumerate() {
        write_seed("store", &format!("running-{i}"), seed);
    }
    let running = node.take_node();
    within("shutdown", running.shutdown()).await;
    for (i, seed) in data_files(&data).iter().enumerate() {
        write_seed("store", &format!("clean-{i}"), seed);
    }
    let _ = std::fs::remove_dir_all(&data);
    let gm = gm_frames();
    for (i, frames) in gm.iter().enumerate() {
        write_seed(
            "gm_wire",
            &format!("outbox-{i}"),
            &pack_length_prefixed(frames),
        );
    }
    for (i, stream) in node_link_streams(&gm).iter().enumerate() {
        write_seed("node_link", &format!("link-{i}"), stream);
    }
    println!(
        "seeds: {} AMQP streams, {headers} content headers",
        recorded.len()
    );
}

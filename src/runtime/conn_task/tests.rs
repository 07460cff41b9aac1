//! The task with commits that take time, as Raft proposals will: the waiting channel holds
//! its frames, the others run, and a lost connection still removes its exclusive queues.

use std::time::Duration;

use amq_protocol::protocol::{basic, channel, connection, queue, AMQPClass};
use amq_protocol::types::FieldTable;
use tokio::io::{DuplexStream, ReadHalf};

use super::*;
use crate::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use crate::config::Config;
use crate::session::meta::BACKLOG_BYTES_MAX;

const COMMIT_DELAY: Duration = Duration::from_millis(150);

/// Applies each command after a delay, in the order started.
struct SlowMeta {
    broker: Arc<Broker>,
}

impl MetaCommit for SlowMeta {
    fn commit(&self, command: Command, now: Instant) -> MetaFuture {
        let broker = self.broker.clone();
        Box::pin(async move {
            tokio::time::sleep(COMMIT_DELAY).await;
            broker.apply(&command, now)
        })
    }
}

struct Node {
    broker: Arc<Broker>,
    ctx: ConnContext,
    // Dropping a sender reads as shutdown: they live as long as the test.
    _shutdown: watch::Sender<bool>,
    _alarm: watch::Sender<bool>,
}

fn node() -> Node {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    let broker = Arc::new(Broker::new(&config, 7, 1 << 30, 0));
    let (shutdown_tx, shutdown) = watch::channel(false);
    let (alarm_tx, alarm) = watch::channel(false);
    let ctx = ConnContext {
        broker: broker.clone(),
        session: SessionConfig::from_config(&config),
        clock: Clock::start(),
        shutdown,
        alarm,
        outbound_bytes_max: 1 << 20,
        node_span: tracing::Span::none(),
        meta: Arc::new(LocalMeta::new(broker.clone())),
    };
    Node {
        broker,
        ctx,
        _shutdown: shutdown_tx,
        _alarm: alarm_tx,
    }
}

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_method(&mut out, ch, &m);
    out
}

fn hello() -> Vec<u8> {
    let mut v = PROTOCOL_HEADER.to_vec();
    v.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
    ));
    v.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: 131_072,
            heartbeat: 0,
        })),
    ));
    v.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    ));
    v
}

fn open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn declare(ch: u16, name: &str, passive: bool, exclusive: bool) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive,
            durable: false,
            exclusive,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn start(node: &Node, meta: Arc<dyn MetaCommit>) -> (DuplexStream, tokio::task::JoinHandle<()>) {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let peer: SocketAddr = "127.0.0.1:5000".parse().expect("address");
    let local: SocketAddr = "127.0.0.1:5672".parse().expect("address");
    let task = tokio::spawn(run_with_meta(
        server,
        peer,
        local,
        None,
        node.ctx.clone(),
        meta,
    ));
    (client, task)
}

/// The next method the server sent, skipping content and heartbeats.
async fn next_method(rd: &mut ReadHalf<DuplexStream>, buf: &mut Vec<u8>) -> (u16, AMQPClass) {
    loop {
        if let Some((f, used)) = frame::split(buf, 0).expect("well-formed output") {
            let found = (f.kind == FrameKind::Method)
                .then(|| (f.channel, frame::decode_method(f.payload).expect("decodes")));
            buf.drain(..used);
            match found {
                Some(m) => return m,
                None => continue,
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), rd.read(&mut chunk))
            .await
            .expect("the server answers in time")
            .expect("read");
        assert!(n > 0, "the server closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test]
async fn a_slow_commit_holds_its_channel_while_others_run() {
    let node = node();
    let meta = Arc::new(SlowMeta {
        broker: node.broker.clone(),
    });
    let (client, task) = start(&node, meta);
    let (mut rd, mut wr) = tokio::io::split(client);
    let body = vec![3u8; 16 * 1024];
    let publishes = 2 * BACKLOG_BYTES_MAX / body.len();
    let mut bytes = hello();
    bytes.extend(open(1));
    bytes.extend(open(2));
    bytes.extend(declare(1, "q", false, false));
    bytes.extend(method(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 1,
            global: false,
        })),
    ));
    for _ in 0..publishes {
        bytes.extend(method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "q".into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        frame::encode_content(&mut bytes, 1, &[0, 0], &body, 131_072);
    }
    bytes.extend(declare(1, "q", true, false));
    // More than parked channels may hold: the task stops reading until the commit.
    let writer = tokio::spawn(async move {
        wr.write_all(&bytes).await.expect("write");
        wr
    });
    let mut buf = Vec::new();
    let mut seen = Vec::new();
    while seen.len() < 7 {
        let (ch, m) = next_method(&mut rd, &mut buf).await;
        seen.push(match m {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)) => {
                format!("{ch} declare-ok {}", d.message_count)
            }
            m => format!("{ch} {}.{}", m.get_amqp_class_id(), m.get_amqp_method_id()),
        });
    }
    assert_eq!(
        seen,
        [
            "0 10.10".to_string(), // start
            "0 10.30".into(),      // tune
            "0 10.41".into(),      // open-ok
            "1 20.11".into(),      // channel.open-ok
            "2 20.11".into(),
            "2 60.11".into(), // qos-ok while channel 1 waits
            "1 declare-ok 0".into(),
        ]
    );
    let (_, m) = next_method(&mut rd, &mut buf).await;
    match m {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)) => {
            assert_eq!(d.message_count, publishes as u32)
        }
        m => panic!("expected the passive declare-ok, got {m:?}"),
    }
    drop(writer.await.expect("writer"));
    drop(rd);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the task ends")
        .expect("no panic");
}

#[tokio::test]
async fn a_lost_connection_still_deletes_its_exclusive_queues_after_slow_commits() {
    let node = node();
    let meta = Arc::new(SlowMeta {
        broker: node.broker.clone(),
    });
    let (client, task) = start(&node, meta);
    let (mut rd, mut wr) = tokio::io::split(client);
    let mut bytes = hello();
    bytes.extend(open(1));
    bytes.extend(declare(1, "mine", false, true));
    wr.write_all(&bytes).await.expect("write");
    let mut buf = Vec::new();
    loop {
        if let (1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))) =
            next_method(&mut rd, &mut buf).await
        {
            break;
        }
    }
    // A second declare is in flight when the socket goes away.
    wr.write_all(&declare(1, "mine2", false, true))
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(wr);
    drop(rd);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the task ends")
        .expect("no panic");
    assert!(node.broker.queue("/", "mine").is_none());
    assert!(node.broker.queue("/", "mine2").is_none());
}

//! Metadata commands leave the sans-IO session as requests (`poll_meta`) and come back as
//! results (`handle_meta_result`); the channel that asked is parked meanwhile and keeps its
//! later frames in order. These tests drive `Connection` directly with raw frames and commit
//! each command themselves, at the moment they choose, with the broker's own `apply`; the
//! last one checks over TCP that the runtime's local commit keeps a pipelined client's view.

mod common;

use std::sync::Arc;

use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, queue, AMQPClass};
use amq_protocol::types::FieldTable;
use warren::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use warren::broker::{Broker, Outbox};
use warren::config::Config;
use warren::meta::Command;
use warren::session::meta::BACKLOG_BYTES_MAX;
use warren::session::{Connection, MetaToken, PeerInfo, SessionConfig};
use warren::time::Instant;

const FRAME_MAX: u32 = 131_072;

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_method(&mut out, ch, &m);
    out
}

fn open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn channel_close(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

fn connection_close() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

#[derive(Clone, Copy, Default)]
struct QueueFlags {
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
    nowait: bool,
}

fn declare_queue(ch: u16, name: &str, f: QueueFlags) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive: false,
            durable: f.durable,
            exclusive: f.exclusive,
            auto_delete: f.auto_delete,
            nowait: f.nowait,
            arguments: FieldTable::default(),
        })),
    )
}

fn passive_declare(ch: u16, name: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive: true,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn bind_queue(ch: u16, name: &str, exchange: &str, routing_key: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: name.into(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn declare_exchange(ch: u16, name: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: name.into(),
            kind: "direct".into(),
            passive: false,
            durable: false,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn publish(ch: u16, exchange: &str, routing_key: &str, body: &[u8]) -> Vec<u8> {
    let mut out = method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            mandatory: false,
            immediate: false,
        })),
    );
    frame::encode_content(&mut out, ch, &[0, 0], body, FRAME_MAX);
    out
}

fn consume(ch: u16, name: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: name.into(),
            consumer_tag: "c1".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn qos(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 10,
            global: false,
        })),
    )
}

/// One line per output frame, for the methods these tests look at.
fn describe(bytes: &[u8]) -> Vec<String> {
    let mut rest = bytes;
    let mut lines = Vec::new();
    while !rest.is_empty() {
        let (f, used) = frame::split(rest, 0)
            .expect("server output is well-formed")
            .expect("server output has no partial frame");
        let ch = f.channel;
        lines.push(match f.kind {
            FrameKind::Heartbeat => "heartbeat".to_string(),
            FrameKind::Header => format!("{ch} header"),
            FrameKind::Body => format!("{ch} body"),
            FrameKind::Method => match frame::decode_method(f.payload).expect("decodes") {
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)) => format!(
                    "{ch} queue.declare-ok {} {} {}",
                    d.queue.as_str(),
                    d.message_count,
                    d.consumer_count
                ),
                AMQPClass::Queue(queue::AMQPMethod::BindOk(_)) => format!("{ch} queue.bind-ok"),
                AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)) => {
                    format!("{ch} exchange.declare-ok")
                }
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => {
                    format!("{ch} channel.open-ok")
                }
                AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                    format!("{ch} channel.close-ok")
                }
                AMQPClass::Channel(channel::AMQPMethod::Close(c)) => format!(
                    "{ch} channel.close {} {}.{}",
                    c.reply_code, c.class_id, c.method_id
                ),
                AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                    format!("{ch} connection.close {}", c.reply_code)
                }
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                    format!("{ch} connection.close-ok")
                }
                AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => format!("{ch} basic.qos-ok"),
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(c)) => {
                    format!("{ch} basic.consume-ok {}", c.consumer_tag.as_str())
                }
                AMQPClass::Basic(basic::AMQPMethod::CancelOk(c)) => {
                    format!("{ch} basic.cancel-ok {}", c.consumer_tag.as_str())
                }
                AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
                    format!("{ch} basic.ack {} {}", a.delivery_tag, a.multiple)
                }
                m => format!("{ch} {}.{}", m.get_amqp_class_id(), m.get_amqp_method_id()),
            },
        });
        rest = &rest[used..];
    }
    lines
}

/// The reply text of the first channel.close in `bytes`.
fn channel_close_text(bytes: &[u8]) -> Option<String> {
    let mut rest = bytes;
    while !rest.is_empty() {
        let (f, used) = frame::split(rest, 0).ok()??;
        if f.kind == FrameKind::Method {
            if let Ok(AMQPClass::Channel(channel::AMQPMethod::Close(c))) =
                frame::decode_method(f.payload)
            {
                return Some(c.reply_text.to_string());
            }
        }
        rest = &rest[used..];
    }
    None
}

/// A session past the handshake on vhost "/", with the broker it shares.
struct Harness {
    s: Connection,
    broker: Arc<Broker>,
    now: Instant,
}

impl Harness {
    fn new() -> Harness {
        let config = Config::for_tests(std::path::Path::new("/nonexistent"));
        let broker = Arc::new(Broker::new(&config, 7, 1 << 30, 0));
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let now = Instant::from_millis(0);
        let s = Connection::new(
            broker.clone(),
            SessionConfig::from_config(&config),
            PeerInfo {
                addr: "test".into(),
                is_loopback: true,
                host: "127.0.0.1".into(),
                port: 40000,
                local_host: "127.0.0.1".into(),
                local_port: 5672,
                tls: None,
                connected_at: 0,
                socket: Default::default(),
            },
            outbox,
            now,
        );
        let mut h = Harness { s, broker, now };
        let mut hello = PROTOCOL_HEADER.to_vec();
        hello.extend(method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        ));
        hello.extend(method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 16,
                frame_max: FRAME_MAX,
                heartbeat: 0,
            })),
        ));
        hello.extend(method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        ));
        h.feed_all(&hello);
        h.output();
        h
    }

    /// Feeds bytes that must all be consumed.
    fn feed_all(&mut self, bytes: &[u8]) {
        let used = self.s.handle_bytes(bytes, self.now);
        assert_eq!(used, bytes.len(), "the session consumed everything");
    }

    /// Everything written since the last call, described.
    fn output(&mut self) -> Vec<String> {
        self.s.handle_outbox(self.now);
        self.s
            .poll_transmit(self.now)
            .map(|b| describe(&b))
            .unwrap_or_default()
    }

    /// The commands emitted since the last call.
    fn emitted(&mut self) -> Vec<(MetaToken, Command)> {
        std::iter::from_fn(|| self.s.poll_meta()).collect()
    }

    /// Commits one command and hands its result back.
    fn commit(&mut self, (token, command): (MetaToken, Command)) {
        let result = self.broker.apply(&command, self.now);
        self.s.handle_meta_result(token, result, self.now);
    }

    /// Commits everything emitted, and what that emits, as the runtime does.
    fn commit_all(&mut self) {
        while let Some(m) = self.s.poll_meta() {
            self.commit(m);
        }
    }

    fn message_count(&self, name: &str) -> Option<u32> {
        self.broker
            .queue("/", name)
            .map(|q| q.lock().message_count())
    }

    fn only(&mut self) -> (MetaToken, Command) {
        let mut v = self.emitted();
        assert_eq!(v.len(), 1, "exactly one command: {v:?}");
        v.pop().expect("one")
    }
}

fn is_declare_queue(c: &Command, name: &str) -> bool {
    matches!(c, Command::DeclareQueue(d) if d.name == name)
}

#[test]
fn a_declare_parks_its_channel_until_the_result_then_the_rest_follows_in_order() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    assert_eq!(h.output(), ["1 channel.open-ok"]);

    let mut read = declare_queue(1, "q", QueueFlags::default());
    read.extend(publish(1, "", "q", b"hello"));
    read.extend(declare_queue(1, "q2", QueueFlags::default()));
    h.feed_all(&read);

    let first = h.only();
    assert!(is_declare_queue(&first.1, "q"), "{first:?}");
    assert_eq!(first.0.channel(), Some(1));
    assert!(h.output().is_empty(), "nothing is sent before the result");
    assert_eq!(
        h.message_count("q"),
        None,
        "the session applied nothing itself"
    );

    h.commit(first);
    // declare-ok first (with the count before the publish), then the publish, then q2's command.
    assert_eq!(h.output(), ["1 queue.declare-ok q 0 0"]);
    assert_eq!(h.message_count("q"), Some(1));
    let second = h.only();
    assert!(is_declare_queue(&second.1, "q2"), "{second:?}");
    assert_eq!(h.message_count("q2"), None);

    h.commit(second);
    assert_eq!(h.output(), ["1 queue.declare-ok q2 0 0"]);
    assert!(h.emitted().is_empty());
}

#[test]
fn other_channels_proceed_while_one_is_parked() {
    let mut h = Harness::new();
    let mut read = open(1);
    read.extend(open(2));
    h.feed_all(&read);
    h.output();

    let mut read = declare_exchange(1, "e");
    read.extend(qos(1));
    read.extend(qos(2));
    frame::encode_heartbeat(&mut read);
    read.extend(qos(2));
    h.feed_all(&read);
    assert_eq!(h.output(), ["2 basic.qos-ok", "2 basic.qos-ok"]);

    let m = h.only();
    assert!(matches!(&m.1, Command::DeclareExchange(d) if d.name == "e"));
    h.commit(m);
    assert_eq!(h.output(), ["1 exchange.declare-ok", "1 basic.qos-ok"]);
}

#[test]
fn an_inequivalent_redeclare_closes_the_channel_406_when_its_result_arrives() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.feed_all(&declare_queue(1, "q", QueueFlags::default()));
    h.commit_all();
    h.output();

    let durable = QueueFlags {
        durable: true,
        ..QueueFlags::default()
    };
    let mut read = declare_queue(1, "q", durable);
    read.extend(publish(1, "", "q", b"dropped"));
    h.feed_all(&read);
    let m = h.only();
    assert!(h.output().is_empty());
    h.commit(m);
    h.s.handle_outbox(h.now);
    let bytes = h.s.poll_transmit(h.now).expect("a close");
    assert_eq!(describe(&bytes), ["1 channel.close 406 50.10"]);
    let text = channel_close_text(&bytes).expect("close text");
    assert!(
        text.starts_with("PRECONDITION_FAILED - inequivalent arg 'durable'"),
        "{text}"
    );
    // The publish behind the declare reached a closing channel, which drops it.
    assert_eq!(h.message_count("q"), Some(0));
}

#[test]
fn bind_errors_keep_their_reply_codes() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    // A missing queue is found before any command: the channel closes at once.
    h.feed_all(&bind_queue(1, "missing", "amq.direct", "k"));
    assert!(h.emitted().is_empty());
    assert_eq!(h.output(), ["1 channel.close 404 50.20"]);

    // A missing exchange is the command's refusal.
    h.feed_all(&open(2));
    h.feed_all(&declare_queue(2, "q", QueueFlags::default()));
    h.commit_all();
    h.output();
    h.feed_all(&bind_queue(2, "q", "nope", "k"));
    let m = h.only();
    assert!(matches!(m.1, Command::Bind(_)));
    assert!(h.output().is_empty());
    h.commit(m);
    assert_eq!(h.output(), ["2 channel.close 404 50.20"]);
}

#[test]
fn a_bind_and_a_publish_after_a_nowait_declare_find_the_queue() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    let nowait = QueueFlags {
        nowait: true,
        ..QueueFlags::default()
    };
    let mut read = declare_queue(1, "q", nowait);
    read.extend(bind_queue(1, "q", "amq.direct", "k"));
    read.extend(publish(1, "amq.direct", "k", b"routed"));
    h.feed_all(&read);
    let declare = h.only();
    h.commit(declare);
    assert!(h.output().is_empty(), "nowait: no declare-ok");
    let bind = h.only();
    assert!(matches!(bind.1, Command::Bind(_)));
    assert_eq!(
        h.message_count("q"),
        Some(0),
        "the publish waits for the bind"
    );
    h.commit(bind);
    assert_eq!(h.output(), ["1 queue.bind-ok"]);
    assert_eq!(h.message_count("q"), Some(1));
}

#[test]
fn confirms_of_a_parked_channel_keep_their_place_after_its_reply() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.feed_all(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    h.output();
    let mut read = publish(1, "", "nowhere", b"x");
    read.extend(declare_queue(1, "q", QueueFlags::default()));
    h.feed_all(&read);
    assert!(h.output().is_empty(), "the ack waits with the channel");
    h.commit_all();
    assert_eq!(
        h.output(),
        ["1 queue.declare-ok q 0 0", "1 basic.ack 1 false"]
    );
}

#[test]
fn connection_close_waits_for_parked_channels_to_finish_what_came_before() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    let flags = QueueFlags {
        exclusive: true,
        nowait: true,
        ..QueueFlags::default()
    };
    let mut read = declare_queue(1, "q", flags);
    read.extend(publish(1, "", "q", b"before close"));
    read.extend(connection_close());
    read.extend(qos(1)); // after close: ignored
    h.feed_all(&read);
    assert!(h.output().is_empty());
    assert!(!h.s.is_finished());
    let m = h.only();
    h.commit(m);
    assert_eq!(h.output(), ["0 connection.close-ok"]);
    // The publish ran before the close; the close deleted the exclusive queue.
    assert_eq!(h.message_count("q"), Some(1));
    let teardown = h.only();
    assert_eq!(teardown.0.channel(), None);
    assert!(matches!(teardown.1, Command::DeleteExclusiveQueues { .. }));
    h.commit(teardown);
    assert_eq!(h.message_count("q"), None);
}

#[test]
fn connection_close_stops_waiting_for_results_at_the_deadline() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    let mut read = declare_queue(1, "q", QueueFlags::default());
    read.extend(connection_close());
    h.feed_all(&read);
    let late = h.only();
    let deadline = h.s.poll_timeout().expect("a close deadline");
    h.s.handle_timeout(deadline);
    assert_eq!(h.output(), ["0 connection.close-ok"]);
    let teardown = h.only();
    assert!(matches!(teardown.1, Command::DeleteExclusiveQueues { .. }));
    // The late result changes nothing on the wire.
    h.commit(late);
    h.commit(teardown);
    assert!(h.output().is_empty());
    h.s.handle_timeout(h.s.poll_timeout().expect("close-ok deadline"));
    assert!(h.s.is_finished());
}

#[test]
fn repeated_results_and_results_for_gone_channels_are_ignored() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    let mut read = declare_queue(1, "q", QueueFlags::default());
    read.extend(channel_close(1));
    read.extend(open(1));
    read.extend(declare_queue(1, "q2", QueueFlags::default()));
    read.extend(qos(1));
    h.feed_all(&read);
    let (first, command) = h.only();
    let result = h.broker.apply(&command, h.now);
    h.s.handle_meta_result(first, result.clone(), h.now);
    assert_eq!(
        h.output(),
        [
            "1 queue.declare-ok q 0 0",
            "1 channel.close-ok",
            "1 channel.open-ok"
        ]
    );
    let second = h.only();
    assert!(is_declare_queue(&second.1, "q2"));
    // The first result again, for the reopened channel now parked on q2: dropped.
    h.s.handle_meta_result(first, result, h.now);
    assert!(h.output().is_empty());
    assert!(h.emitted().is_empty());
    h.commit(second);
    assert_eq!(h.output(), ["1 queue.declare-ok q2 0 0", "1 basic.qos-ok"]);

    // A result for a connection that went away meanwhile.
    h.feed_all(&declare_queue(1, "q3", QueueFlags::default()));
    let third = h.only();
    h.s.handle_shutdown(h.now);
    assert_eq!(h.output(), ["0 connection.close 320"]);
    h.commit(third);
    assert!(h.output().is_empty());
    h.commit_all();
    assert!(h.output().is_empty());
}

#[test]
fn losing_the_socket_while_parked_still_deletes_exclusive_queues() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    let exclusive = QueueFlags {
        exclusive: true,
        ..QueueFlags::default()
    };
    h.feed_all(&declare_queue(1, "mine", exclusive));
    h.commit_all();
    h.output();
    h.feed_all(&declare_queue(1, "mine2", exclusive));
    let parked = h.only();
    h.s.handle_disconnect(h.now);
    assert!(h.s.is_finished());
    let teardown = h.only();
    assert!(matches!(teardown.1, Command::DeleteExclusiveQueues { .. }));
    // The runtime commits in emission order: the declare, then the teardown.
    h.commit(parked);
    assert_eq!(h.message_count("mine2"), Some(0));
    h.commit(teardown);
    assert_eq!(h.message_count("mine"), None);
    assert_eq!(h.message_count("mine2"), None);
    assert!(h.output().is_empty());
}

#[test]
fn flooding_a_parked_channel_stops_reading_until_the_result() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    h.output();
    let body = vec![7u8; 16 * 1024];
    let publishes = 2 * BACKLOG_BYTES_MAX / body.len();
    let mut read = declare_queue(1, "q", QueueFlags::default());
    for _ in 0..publishes {
        read.extend(publish(1, "", "q", &body));
    }
    let used = h.s.handle_bytes(&read, h.now);
    assert!(used < read.len(), "the session stopped taking input");
    assert!(!h.s.wants_read());
    // Asked again before any result, it takes nothing more.
    assert_eq!(h.s.handle_bytes(&read[used..], h.now), 0);
    h.commit_all();
    assert!(h.s.wants_read());
    let rest = h.s.handle_bytes(&read[used..], h.now);
    assert_eq!(used + rest, read.len());
    assert_eq!(h.message_count("q"), Some(publishes as u32));
    assert_eq!(h.output(), ["1 queue.declare-ok q 0 0"]);
}

#[test]
fn cancelling_the_last_consumer_deletes_an_auto_delete_queue_before_cancel_ok() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    let auto_delete = QueueFlags {
        auto_delete: true,
        ..QueueFlags::default()
    };
    h.feed_all(&declare_queue(1, "ad", auto_delete));
    h.commit_all();
    h.feed_all(&consume(1, "ad"));
    assert_eq!(
        h.output(),
        [
            "1 channel.open-ok",
            "1 queue.declare-ok ad 0 0",
            "1 basic.consume-ok c1"
        ]
    );
    h.feed_all(&method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "c1".into(),
            nowait: false,
        })),
    ));
    let m = h.only();
    assert!(matches!(&m.1, Command::DeleteQueue { name, .. } if name == "ad"));
    assert!(h.output().is_empty());
    h.commit(m);
    assert_eq!(h.output(), ["1 basic.cancel-ok c1"]);
    assert_eq!(h.message_count("ad"), None);
}

#[test]
fn closing_a_channel_deletes_its_auto_delete_queues_without_waiting() {
    let mut h = Harness::new();
    h.feed_all(&open(1));
    let auto_delete = QueueFlags {
        auto_delete: true,
        ..QueueFlags::default()
    };
    h.feed_all(&declare_queue(1, "ad", auto_delete));
    h.commit_all();
    h.feed_all(&consume(1, "ad"));
    h.output();
    h.feed_all(&channel_close(1));
    assert_eq!(h.output(), ["1 channel.close-ok"]);
    let m = h.only();
    assert_eq!(m.0.channel(), None, "nobody waits for it");
    h.commit(m);
    assert_eq!(h.message_count("ad"), None);
}

#[tokio::test]
async fn a_pipelined_declare_publish_and_close_keep_their_order_over_tcp() {
    let node = common::TestNode::start().await;
    let opts = common::RawOpts::default();
    let (mut c, _, _) = common::RawClient::handshake(node.addr, &opts).await;
    c.open_channel(1).await;
    let q = common::unique("pipelined");
    let flags = QueueFlags {
        exclusive: true,
        nowait: true,
        ..QueueFlags::default()
    };
    // One write: the runtime reads it at once, so the declare's commit happens mid-batch.
    let mut bytes = declare_queue(1, &q, flags);
    bytes.extend(publish(1, "", &q, b"one"));
    bytes.extend(passive_declare(1, &q));
    bytes.extend(connection_close());
    c.write_bytes(&bytes).await;
    match c.next_method().await {
        Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)))) => {
            assert_eq!(d.queue.as_str(), q);
            assert_eq!(
                d.message_count, 1,
                "the publish ran before the passive declare"
            );
        }
        other => panic!("expected declare-ok, got {other:?}"),
    }
    match c.next_method().await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))) => {}
        other => panic!("expected close-ok, got {other:?}"),
    }
    // The exclusive queue went with its connection, before close-ok was written.
    let (mut other, _, _) = common::RawClient::handshake(node.addr, &opts).await;
    other.open_channel(1).await;
    other.write_bytes(&passive_declare(1, &q)).await;
    match other.next_method().await {
        Some((1, AMQPClass::Channel(channel::AMQPMethod::Close(close)))) => {
            assert_eq!(close.reply_code, 404)
        }
        other => panic!("expected channel.close 404, got {other:?}"),
    }
}

#[tokio::test]
async fn a_flood_behind_a_nowait_declare_is_all_published_over_tcp() {
    let node = common::TestNode::start().await;
    let opts = common::RawOpts::default();
    let (mut c, _, _) = common::RawClient::handshake(node.addr, &opts).await;
    c.open_channel(1).await;
    let q = common::unique("flood");
    let body = vec![1u8; 16 * 1024];
    // More than parked channels may hold. On one node the declare is committed right after
    // the read that carried it, so the channel never fills; this guards the path end to end.
    let publishes = 2 * BACKLOG_BYTES_MAX / body.len();
    let nowait = QueueFlags {
        nowait: true,
        ..QueueFlags::default()
    };
    let mut bytes = declare_queue(1, &q, nowait);
    for _ in 0..publishes {
        bytes.extend(publish(1, "", &q, &body));
    }
    bytes.extend(passive_declare(1, &q));
    c.write_bytes(&bytes).await;
    match c.next_method().await {
        Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d)))) => {
            assert_eq!(d.message_count, publishes as u32)
        }
        other => panic!("expected the passive declare-ok, got {other:?}"),
    }
}

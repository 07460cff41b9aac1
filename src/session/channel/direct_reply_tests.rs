//! Direct reply-to's rules, driven through the sans-IO session: raw frames in, frames out,
//! two connections sharing one broker. Texts and codes are RabbitMQ 3.10.8's, as a 3.10.8
//! node answered them.

use std::sync::Arc;

use amq_protocol::protocol::basic::{self, AMQPProperties};
use amq_protocol::protocol::{channel, confirm, connection, queue, tx, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};

use crate::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use crate::broker::direct_reply::{REPLY_PREFIX, REPLY_QUEUE};
use crate::broker::Broker;
use crate::config::Config;
use crate::session::Connection;
use crate::time::Instant;

const FRAME_MAX: u32 = 131_072;

/// One frame the session wrote.
#[derive(Debug)]
enum Out {
    Method(u16, AMQPClass),
    Header,
    Body(Vec<u8>),
}

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_method(&mut out, ch, &m);
    out
}

fn consume(ch: u16, queue: &str, tag: &str, no_ack: bool) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue.into(),
            consumer_tag: tag.into(),
            no_local: false,
            no_ack,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn cancel(ch: u16, tag: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: tag.into(),
            nowait: false,
        })),
    )
}

fn declare(ch: u16, name: &str, passive: bool) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

fn publish_with(
    ch: u16,
    routing_key: &str,
    mandatory: bool,
    properties: &AMQPProperties,
    body: &[u8],
) -> Vec<u8> {
    let mut out = method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: routing_key.into(),
            mandatory,
            immediate: false,
        })),
    );
    let raw = frame::encode_properties(properties);
    frame::encode_content(&mut out, ch, &raw, body, FRAME_MAX);
    out
}

fn publish(ch: u16, routing_key: &str, body: &[u8]) -> Vec<u8> {
    publish_with(ch, routing_key, false, &AMQPProperties::default(), body)
}

fn request(ch: u16, queue: &str) -> Vec<u8> {
    let p = AMQPProperties::default().with_reply_to(REPLY_QUEUE.into());
    publish_with(ch, queue, false, &p, b"request")
}

/// A session past the handshake on vhost "/" with channel 1 open.
struct Client {
    s: Connection,
    broker: Arc<Broker>,
}

impl Client {
    fn new(broker: &Arc<Broker>) -> Client {
        let s = crate::session::limits_tests::session(broker);
        let mut c = Client {
            s,
            broker: broker.clone(),
        };
        let mut hello = PROTOCOL_HEADER.to_vec();
        for m in [
            connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            }),
            connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 16,
                frame_max: FRAME_MAX,
                heartbeat: 0,
            }),
            connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            }),
        ] {
            hello.extend(method(0, AMQPClass::Connection(m)));
        }
        hello.extend(method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        c.send(&hello);
        c
    }

    /// Feeds `bytes`, commits what they emit as a single node does, and returns the frames
    /// written (deliveries included).
    fn send(&mut self, bytes: &[u8]) -> Vec<Out> {
        let now = Instant::from_millis(0);
        assert_eq!(self.s.handle_bytes(bytes, now), bytes.len());
        while let Some((token, command)) = self.s.poll_meta() {
            let result = self.broker.apply(&command, now);
            self.s.handle_meta_result(token, result, now);
        }
        self.read()
    }

    /// What the session wrote since the last call, deliveries from its outbox included.
    fn read(&mut self) -> Vec<Out> {
        let now = Instant::from_millis(0);
        self.s.handle_outbox(now);
        let bytes = self.s.poll_transmit(now).unwrap_or_default();
        let mut rest = &bytes[..];
        let mut out = Vec::new();
        while let Some((f, used)) = frame::split(rest, 0).expect("well-formed output") {
            out.push(match f.kind {
                FrameKind::Method => {
                    Out::Method(f.channel, frame::decode_method(f.payload).unwrap())
                }
                FrameKind::Header => Out::Header,
                FrameKind::Body => Out::Body(f.payload.to_vec()),
                FrameKind::Heartbeat => continue,
            });
            rest = &rest[used..];
        }
        out
    }
}

fn broker() -> Arc<Broker> {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    Arc::new(Broker::new(&config, 7, 1 << 30, 0))
}

/// The channel.close in `out`: (code, text, class, method).
fn channel_close(out: &[Out]) -> Option<(u16, String, u16, u16)> {
    out.iter().find_map(|o| match o {
        Out::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => Some((
            c.reply_code,
            c.reply_text.to_string(),
            c.class_id,
            c.method_id,
        )),
        _ => None,
    })
}

/// (consumer tag, delivery tag, exchange, routing key, body) of each basic.deliver.
fn deliveries(out: &[Out]) -> Vec<(String, u64, String, String, Vec<u8>)> {
    let mut v = Vec::new();
    for (i, o) in out.iter().enumerate() {
        if let Out::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) = o {
            let body = match out.get(i + 2) {
                Some(Out::Body(b)) => b.clone(),
                _ => Vec::new(),
            };
            v.push((
                d.consumer_tag.to_string(),
                d.delivery_tag,
                d.exchange.to_string(),
                d.routing_key.to_string(),
                body,
            ));
        }
    }
    v
}

/// The declare-ok in `out`: (queue, messages, consumers).
fn declare_ok(out: &[Out]) -> Option<(String, u32, u32)> {
    out.iter().find_map(|o| match o {
        Out::Method(_, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(d))) => {
            Some((d.queue.to_string(), d.message_count, d.consumer_count))
        }
        _ => None,
    })
}

/// Declares `queue`, sends a request to it from `c` (reply_to the pseudo-queue), and
/// returns the `reply_to` the queue's copy carries.
fn reply_name_of_request(c: &mut Client, queue: &str) -> String {
    c.send(&declare(1, queue, false));
    c.send(&request(1, queue));
    let h = c.broker.queue("/", queue).expect("declared");
    let mut dead = Vec::new();
    let (entry, _) = h
        .lock()
        .get(Instant::from_millis(0), false, &mut dead)
        .expect("the request is queued");
    let reply_to = entry.message.properties.reply_to().clone();
    reply_to.expect("reply_to kept").to_string()
}

#[test]
fn a_reply_consumer_that_acknowledges_is_refused_406() {
    let b = broker();
    let mut c = Client::new(&b);
    let out = c.send(&consume(1, REPLY_QUEUE, "", false));
    assert_eq!(
        channel_close(&out),
        Some((
            406,
            "PRECONDITION_FAILED - reply consumer cannot acknowledge".into(),
            60,
            20
        ))
    );
    assert!(b.direct_replies().is_empty());
}

#[test]
fn a_second_reply_consumer_on_a_channel_is_refused_406() {
    let b = broker();
    let mut c = Client::new(&b);
    let out = c.send(&consume(1, REPLY_QUEUE, "first", true));
    assert!(
        matches!(&out[..], [Out::Method(1, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)))] if ok.consumer_tag.as_str() == "first"),
        "{out:?}"
    );
    let out = c.send(&consume(1, REPLY_QUEUE, "second", true));
    assert_eq!(
        channel_close(&out).map(|c| (c.0, c.1)),
        Some((
            406,
            "PRECONDITION_FAILED - reply consumer already set".into()
        ))
    );
    // Closing the channel ended the reply consumer with it.
    assert!(b.direct_replies().is_empty());
}

#[test]
fn a_reply_consumer_cannot_take_a_queue_consumers_tag_530() {
    let b = broker();
    let mut c = Client::new(&b);
    c.send(&declare(1, "rpc", false));
    c.send(&consume(1, "rpc", "t", true));
    let out = c.send(&consume(1, REPLY_QUEUE, "t", true));
    assert_eq!(
        channel_close(&out).map(|c| c.0),
        None,
        "530 is a connection error"
    );
    assert!(
        out.iter().any(|o| matches!(o, Out::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) if c.reply_code == 530)),
        "{out:?}"
    );
}

#[test]
fn publishing_with_the_pseudo_queue_as_reply_to_needs_a_reply_consumer_406() {
    let b = broker();
    let mut c = Client::new(&b);
    c.send(&declare(1, "rpc", false));
    let out = c.send(&request(1, "rpc"));
    assert_eq!(
        channel_close(&out),
        Some((
            406,
            "PRECONDITION_FAILED - fast reply consumer does not exist".into(),
            60,
            40
        ))
    );
    assert_eq!(
        b.queue("/", "rpc").unwrap().lock().message_count(),
        0,
        "the request was not routed"
    );
}

#[test]
fn a_reply_to_the_rewritten_name_reaches_the_reply_consumer_from_another_connection() {
    let b = broker();
    let mut client = Client::new(&b);
    let mut server = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let name = reply_name_of_request(&mut client, "rpc");
    assert!(name.starts_with(REPLY_PREFIX), "{name}");
    assert_ne!(name.len(), REPLY_PREFIX.len());

    let out = server.send(&publish(1, &name, b"answer"));
    assert!(out.is_empty(), "no return, no error: {out:?}");
    let got = deliveries(&client.read());
    assert_eq!(
        got,
        vec![(
            "replies".to_string(),
            1,
            String::new(),
            name.clone(),
            b"answer".to_vec()
        )]
    );
    // Each reply takes the channel's next delivery tag.
    server.send(&publish(1, &name, b"again"));
    assert_eq!(deliveries(&client.read())[0].1, 2);
}

#[test]
fn a_mandatory_reply_is_delivered_and_returned_and_confirmed_as_rabbitmq_does() {
    let b = broker();
    let mut client = Client::new(&b);
    let mut server = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let name = reply_name_of_request(&mut client, "rpc");
    server.send(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    let out = server.send(&publish_with(
        1,
        &name,
        true,
        &AMQPProperties::default(),
        b"m",
    ));
    // RabbitMQ 3.10 never counts a reply as routed: basic.return NO_ROUTE, then the ack.
    let kinds: Vec<String> = out
        .iter()
        .filter_map(|o| match o {
            Out::Method(_, AMQPClass::Basic(basic::AMQPMethod::Return(r))) => {
                Some(format!("return {} {}", r.reply_code, r.reply_text))
            }
            Out::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                Some(format!("ack {}", a.delivery_tag))
            }
            _ => None,
        })
        .collect();
    assert_eq!(kinds, ["return 312 NO_ROUTE", "ack 1"]);
    assert_eq!(deliveries(&client.read()).len(), 1, "and it was delivered");
    // A name nobody consumes any more: returned and acked too, delivered nowhere.
    let out = server.send(&publish_with(
        1,
        &format!("{REPLY_PREFIX}bogus"),
        false,
        &AMQPProperties::default(),
        b"m",
    ));
    assert!(
        out.iter().any(|o| matches!(o, Out::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) if a.delivery_tag == 2)),
        "{out:?}"
    );
}

#[test]
fn a_cancelled_reply_consumer_gets_nothing_and_a_new_one_a_new_name() {
    let b = broker();
    let mut client = Client::new(&b);
    let mut server = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let old = reply_name_of_request(&mut client, "rpc");
    // A reply already in the outbox when the cancel comes is dropped with it.
    server.send(&publish(1, &old, b"in flight"));
    let out = client.send(&cancel(1, "replies"));
    assert!(
        matches!(&out[..], [Out::Method(1, AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)))] if ok.consumer_tag.as_str() == "replies"),
        "{out:?}"
    );
    assert!(b.direct_replies().is_empty());
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    server.send(&publish(1, &old, b"stale"));
    assert!(deliveries(&client.read()).is_empty());
    let new = reply_name_of_request(&mut client, "rpc");
    assert_ne!(new, old);
    server.send(&publish(1, &new, b"fresh"));
    assert_eq!(deliveries(&client.read())[0].4, b"fresh");
}

#[test]
fn a_cc_header_naming_a_reply_name_delivers_once_with_the_publish_routing_key() {
    let b = broker();
    let mut client = Client::new(&b);
    let mut server = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let name = reply_name_of_request(&mut client, "rpc");
    let mut headers = FieldTable::default();
    let names = FieldArray::from(vec![
        AMQPValue::LongString(name.as_str().into()),
        AMQPValue::LongString(name.as_str().into()),
    ]);
    headers.insert("CC".into(), AMQPValue::FieldArray(names));
    let p = AMQPProperties::default().with_headers(headers);
    server.send(&publish_with(1, "nothing-here", false, &p, b"cc"));
    let got = deliveries(&client.read());
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].3, "nothing-here");
}

#[test]
fn every_declare_of_reply_names_is_passive_and_answers_as_rabbitmq() {
    let b = broker();
    let mut client = Client::new(&b);
    let mut other = Client::new(&b);
    for passive in [true, false] {
        let out = other.send(&declare(1, REPLY_QUEUE, passive));
        assert_eq!(declare_ok(&out), Some((REPLY_QUEUE.into(), 0, 1)));
    }
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let name = reply_name_of_request(&mut client, "rpc");
    let out = other.send(&declare(1, &name, false));
    assert_eq!(declare_ok(&out), Some((name.clone(), 0, 1)));
    // Its own name too (RabbitMQ 3.10 fails that with 541 and closes the connection).
    let out = client.send(&declare(1, &name, true));
    assert_eq!(declare_ok(&out), Some((name.clone(), 0, 1)));
    client.send(&cancel(1, "replies"));
    for missing in [
        name.clone(),
        format!("{REPLY_QUEUE}x"),
        format!("{REPLY_PREFIX}abc.def"),
    ] {
        let mut c = Client::new(&b);
        let out = c.send(&declare(1, &missing, true));
        assert_eq!(
            channel_close(&out).map(|c| (c.0, c.1)),
            Some((
                404,
                format!("NOT_FOUND - no queue '{missing}' in vhost '/'")
            )),
            "{missing}"
        );
    }
}

#[test]
fn the_empty_queue_name_after_declaring_the_pseudo_queue_consumes_it() {
    // RabbitMQ expands "" to the last declared queue before it looks at the name.
    let b = broker();
    let mut c = Client::new(&b);
    c.send(&declare(1, REPLY_QUEUE, true));
    let out = c.send(&consume(1, "", "replies", true));
    assert!(
        matches!(
            &out[..],
            [Out::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))
            )]
        ),
        "{out:?}"
    );
    assert_eq!(b.direct_replies().len(), 1);
}

#[test]
fn closing_the_connection_ends_its_reply_names() {
    let b = broker();
    let mut client = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    assert_eq!(b.direct_replies().len(), 1);
    client.s.handle_disconnect(Instant::from_millis(0));
    assert!(b.direct_replies().is_empty());
}

#[test]
fn a_reply_published_in_a_transaction_is_delivered_at_commit_and_not_after_rollback() {
    // RabbitMQ 3.10 delivers it at publish, even when the transaction is rolled back (its
    // routing has the side effect); Warren keeps the transaction's promise.
    let b = broker();
    let mut client = Client::new(&b);
    let mut server = Client::new(&b);
    client.send(&consume(1, REPLY_QUEUE, "replies", true));
    let name = reply_name_of_request(&mut client, "rpc");
    let select = method(1, AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})));
    server.send(&select);
    server.send(&publish(1, &name, b"committed"));
    assert!(
        deliveries(&client.read()).is_empty(),
        "not before the commit"
    );
    server.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
    ));
    assert_eq!(deliveries(&client.read())[0].4, b"committed");
    server.send(&publish(1, &name, b"rolled back"));
    server.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {})),
    ));
    server.send(&method(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
    ));
    assert!(deliveries(&client.read()).is_empty());
}

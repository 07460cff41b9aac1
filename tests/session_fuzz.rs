//! Property test: the sans-IO session never panics on random or mutated input, every byte it
//! writes is a well-formed frame, and a broken stream ends in a close with a spec reply code.
//! Metadata commands the session emits are committed with the broker's `apply`, sometimes at
//! once (as the single-node runtime does) and sometimes a few reads later (as a cluster
//! would), so parked channels see the same random input.

use std::sync::Arc;

use amq_protocol::protocol::{basic, channel, connection, exchange, queue, AMQPClass};
use amq_protocol::types::FieldTable;
use proptest::prelude::*;
use warren::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use warren::broker::{Broker, Outbox};
use warren::config::Config;
use warren::session::{Connection, PeerInfo, SessionConfig};
use warren::time::Instant;

const VALID_CODES: &[u16] = &[
    200, 320, 402, 403, 404, 405, 406, 501, 502, 503, 504, 505, 506, 530, 540, 541,
];

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_method(&mut out, ch, &m);
    out
}

fn handshake() -> Vec<u8> {
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
            frame_max: 4096,
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

/// Valid client frames the mutations start from.
fn corpus() -> Vec<Vec<u8>> {
    let mut publish = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: true,
            immediate: false,
        })),
    );
    frame::encode_content(&mut publish, 1, &[0x10, 0x00, 2], b"hello", 4096);
    vec![
        method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ),
        method(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "q".into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ),
        method(
            1,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: "e".into(),
                kind: "topic".into(),
                passive: false,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ),
        publish,
        method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: "q".into(),
                consumer_tag: "".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ),
        method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: true,
            })),
        ),
        method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        ),
    ]
}

#[derive(Debug, Clone)]
enum Chunk {
    Valid(usize),
    Mutated(usize, Vec<(usize, u8)>),
    Random(Vec<u8>),
}

fn chunk() -> impl Strategy<Value = Chunk> {
    let n = corpus().len();
    prop_oneof![
        (0..n).prop_map(Chunk::Valid),
        (0..n, prop::collection::vec((0usize..64, any::<u8>()), 1..4))
            .prop_map(|(i, m)| Chunk::Mutated(i, m)),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Chunk::Random),
    ]
}

fn session() -> (Connection, Arc<Broker>) {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    let broker = Arc::new(Broker::new(&config, 7, 1 << 30, 0));
    let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
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
        Instant::from_millis(0),
    );
    (s, broker)
}

/// Commits every metadata command the session emitted, and what their results emit.
fn commit_all(s: &mut Connection, broker: &Broker, now: Instant) {
    while let Some((token, command)) = s.poll_meta() {
        let result = broker.apply(&command, now);
        s.handle_meta_result(token, result, now);
    }
}

/// Checks every output frame; returns the reply code of a connection.close if one was sent.
fn check_output(bytes: &[u8]) -> Option<u16> {
    let mut rest = bytes;
    let mut close = None;
    while !rest.is_empty() {
        let (f, used) = frame::split(rest, 0)
            .expect("server output is well-formed")
            .expect("server output has no partial frame");
        if f.kind == FrameKind::Method {
            let m = frame::decode_method(f.payload).expect("server methods decode");
            match m {
                AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
                    assert!(VALID_CODES.contains(&c.reply_code), "code {}", c.reply_code);
                    close = Some(c.reply_code);
                }
                AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                    assert!(VALID_CODES.contains(&c.reply_code), "code {}", c.reply_code);
                }
                _ => {}
            }
        }
        rest = &rest[used..];
    }
    close
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn session_survives_random_and_mutated_input(
        chunks in prop::collection::vec(chunk(), 1..12),
        commit_every in 1usize..4,
    ) {
        let corpus = corpus();
        let (mut s, broker) = session();
        let mut input = handshake();
        for c in &chunks {
            match c {
                Chunk::Valid(i) => input.extend(&corpus[*i]),
                Chunk::Mutated(i, muts) => {
                    let mut f = corpus[*i].clone();
                    for (pos, byte) in muts {
                        let p = pos % f.len();
                        f[p] = *byte;
                    }
                    input.extend(f);
                }
                Chunk::Random(r) => input.extend(r),
            }
        }
        // Feed in uneven pieces, as a socket would.
        let mut buf: Vec<u8> = Vec::new();
        let mut out = Vec::new();
        let mut now = 0;
        for (i, piece) in input.chunks(7).enumerate() {
            buf.extend_from_slice(piece);
            let used = s.handle_bytes(&buf, Instant::from_millis(now));
            buf.drain(..used);
            if i % commit_every == 0 {
                commit_all(&mut s, &broker, Instant::from_millis(now));
            }
            s.handle_outbox(Instant::from_millis(now));
            if let Some(b) = s.poll_transmit(Instant::from_millis(now)) {
                out.extend(b);
            }
            now += 1;
            if s.is_finished() {
                break;
            }
        }
        // Late results arrive; whatever they release is well-formed output too.
        commit_all(&mut s, &broker, Instant::from_millis(now));
        let used = s.handle_bytes(&buf, Instant::from_millis(now));
        buf.drain(..used);
        commit_all(&mut s, &broker, Instant::from_millis(now));
        s.handle_outbox(Instant::from_millis(now));
        if let Some(b) = s.poll_transmit(Instant::from_millis(now)) {
            out.extend(b);
        }
        // The first 8 bytes of output are a connection.start frame, never a header echo,
        // because the handshake prefix is valid.
        let close = check_output(&out);
        // A stream that stopped being parseable must have been closed with a code.
        if !buf.is_empty() && buf.len() > 4096 {
            prop_assert!(close.is_some() || s.is_finished());
        }
        // Time passing after a close ends the session.
        if close.is_some() {
            s.handle_timeout(Instant::from_millis(now + 10_000));
            prop_assert!(s.is_finished());
        }
    }
}

#[test]
fn garbage_after_handshake_closes_with_a_frame_error() {
    let (mut s, _broker) = session();
    let mut input = handshake();
    input.extend([0x41u8; 20]);
    let _ = s.handle_bytes(&input, Instant::from_millis(0));
    let out = s.poll_transmit(Instant::from_millis(0)).expect("output");
    assert_eq!(check_output(&out), Some(501));
}

#[test]
fn wrong_protocol_header_gets_ours_back_and_finishes() {
    let (mut s, _broker) = session();
    let _ = s.handle_bytes(b"AMQP\x01\x01\x00\x0a", Instant::from_millis(0));
    assert_eq!(
        s.poll_transmit(Instant::from_millis(0)).unwrap(),
        PROTOCOL_HEADER.to_vec()
    );
    assert!(s.is_finished());
}

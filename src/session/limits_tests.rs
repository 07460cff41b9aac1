//! Vhost and user limits driven through the sans-IO session: raw frames in, the close
//! frames out, several sessions sharing one broker. Texts are RabbitMQ 3.10's
//! (`rabbit_reader`, `rabbit_channel`). close_tests uses the helpers too.

use std::sync::Arc;

use amq_protocol::protocol::{channel, connection, queue, AMQPClass};
use amq_protocol::types::FieldTable;

use crate::amqp::frame::{self, FrameKind, PROTOCOL_HEADER};
use crate::broker::{Broker, Outbox};
use crate::config::Config;
use crate::meta::limits::LimitScope;
use crate::meta::state::User;
use crate::meta::Command;
use crate::session::{Connection, PeerInfo, SessionConfig};
use crate::time::Instant;

const FRAME_MAX: u32 = 131_072;

pub(super) fn now() -> Instant {
    Instant::from_millis(0)
}

pub(super) fn broker() -> Arc<Broker> {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    let b = Arc::new(Broker::new(&config, 7, 1 << 30, 0));
    b.apply(
        &Command::PutUser(User {
            name: "nobody".into(),
            password: "pw".into(),
            tags: vec![],
        }),
        now(),
    )
    .expect("user");
    b
}

fn limit(b: &Broker, scope: LimitScope, name: &str, value: i64) {
    let c = Command::SetLimits {
        scope,
        limits: [(name.to_string(), value)].into(),
        replace: false,
    };
    b.apply(&c, now()).expect("limit");
}

pub(super) fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_method(&mut out, ch, &m);
    out
}

pub(super) fn channel_open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn declare(ch: u16, name: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    )
}

/// A session of `user` (password `guest` or `pw`) through connection.open of `vhost`.
pub(super) fn open(
    b: &Arc<Broker>,
    user: &str,
    password: &str,
    vhost: &str,
) -> (Connection, Vec<AMQPClass>) {
    let mut s = session(b);
    let mut hello = PROTOCOL_HEADER.to_vec();
    for m in [
        connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{password}").as_str().into(),
            locale: "en_US".into(),
        }),
        connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: FRAME_MAX,
            heartbeat: 0,
        }),
        connection::AMQPMethod::Open(connection::Open {
            virtual_host: vhost.into(),
        }),
    ] {
        hello.extend(method(0, AMQPClass::Connection(m)));
    }
    let out = send(b, &mut s, &hello);
    (s, out)
}

/// A session that has read nothing yet, from a loopback peer.
pub(super) fn session(b: &Arc<Broker>) -> Connection {
    session_from(b, true)
}

/// A session that has read nothing yet, from a loopback peer or from afar.
pub(super) fn session_from(b: &Arc<Broker>, is_loopback: bool) -> Connection {
    let config = Config::for_tests(std::path::Path::new("/nonexistent"));
    Connection::new(
        b.clone(),
        SessionConfig::from_config(&config),
        PeerInfo {
            addr: "test".into(),
            is_loopback,
            host: "127.0.0.1".into(),
            port: 40000,
            local_host: "127.0.0.1".into(),
            local_port: 5672,
            tls: None,
            connected_at: 0,
            socket: Default::default(),
        },
        Arc::new(Outbox::new(1 << 20, Box::new(|| {}))),
        now(),
    )
}

/// Feeds `bytes`, commits what they emit as a single node does, returns the methods written.
pub(super) fn send(b: &Broker, s: &mut Connection, bytes: &[u8]) -> Vec<AMQPClass> {
    s.handle_bytes(bytes, now());
    while let Some((token, command)) = s.poll_meta() {
        let result = b.apply(&command, now());
        s.handle_meta_result(token, result, now());
    }
    let bytes = s.poll_transmit(now()).unwrap_or_default();
    let mut rest = &bytes[..];
    let mut out = Vec::new();
    while let Some((f, used)) = frame::split(rest, 0).expect("well-formed output") {
        if f.kind == FrameKind::Method {
            out.push(frame::decode_method(f.payload).expect("method"));
        }
        rest = &rest[used..];
    }
    out
}

pub(super) fn connection_close(out: &[AMQPClass]) -> Option<(u16, String)> {
    out.iter().find_map(|m| match m {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
            Some((c.reply_code, c.reply_text.to_string()))
        }
        _ => None,
    })
}

pub(super) fn channel_close(out: &[AMQPClass]) -> Option<(u16, String)> {
    out.iter().find_map(|m| match m {
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
            Some((c.reply_code, c.reply_text.to_string()))
        }
        _ => None,
    })
}

fn opened(out: &[AMQPClass]) -> bool {
    out.iter()
        .any(|m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))))
}

#[test]
fn the_vhost_connection_limit_is_checked_before_the_permissions() {
    let b = broker();
    limit(&b, LimitScope::Vhost("/".into()), "max-connections", 0);
    // "nobody" has no permissions on "/": RabbitMQ reports the limit first.
    let (_s, out) = open(&b, "nobody", "pw", "/");
    assert_eq!(
        connection_close(&out),
        Some((
            530,
            "NOT_ALLOWED - access to vhost '/' refused for user 'nobody': connection limit (0) is reached".into()
        ))
    );
    assert_eq!(b.sessions().len(), 0, "a refused connection is not listed");
}

#[test]
fn a_refused_permission_leaves_no_listing_behind() {
    let b = broker();
    limit(&b, LimitScope::Vhost("/".into()), "max-connections", 1);
    let (_s, out) = open(&b, "nobody", "pw", "/");
    assert_eq!(connection_close(&out).map(|c| c.0), Some(530));
    assert_eq!(b.sessions().len(), 0);
    let (_s, out) = open(&b, "guest", "guest", "/");
    assert!(opened(&out), "the place was not taken: {out:?}");
}

#[test]
fn the_user_connection_limit_counts_the_users_sessions() {
    let b = broker();
    limit(&b, LimitScope::User("guest".into()), "max-connections", 1);
    let (first, out) = open(&b, "guest", "guest", "/");
    assert!(opened(&out));
    let (_s, out) = open(&b, "guest", "guest", "/");
    assert_eq!(
        connection_close(&out),
        Some((
            530,
            "NOT_ALLOWED - Connection refused for user 'guest': user connection limit (1) is reached".into()
        ))
    );
    drop(first);
    let (_s, out) = open(&b, "guest", "guest", "/");
    assert!(opened(&out), "a gone session frees its place");
}

#[test]
fn the_user_channel_limit_closes_the_connection_that_asks_for_one_more() {
    let b = broker();
    limit(&b, LimitScope::User("guest".into()), "max-channels", 2);
    let (mut a, _) = open(&b, "guest", "guest", "/");
    let (mut c, _) = open(&b, "guest", "guest", "/");
    assert!(connection_close(&send(&b, &mut a, &channel_open(1))).is_none());
    assert!(connection_close(&send(&b, &mut c, &channel_open(1))).is_none());
    let out = send(&b, &mut c, &channel_open(2));
    assert_eq!(
        connection_close(&out),
        Some((
            530,
            "NOT_ALLOWED - number of channels opened for user 'guest' has reached the maximum allowed user limit of (2)".into()
        ))
    );
    // A channel closed frees its place.
    let close = method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    send(&b, &mut a, &close);
    drop(c);
    assert!(connection_close(&send(&b, &mut a, &channel_open(2))).is_none());
}

#[test]
fn the_vhost_queue_limit_closes_the_channel_with_406() {
    let b = broker();
    limit(&b, LimitScope::Vhost("/".into()), "max-queues", 1);
    let (mut s, _) = open(&b, "guest", "guest", "/");
    send(&b, &mut s, &channel_open(1));
    assert!(channel_close(&send(&b, &mut s, &declare(1, "q1"))).is_none());
    let out = send(&b, &mut s, &declare(1, "q2"));
    assert_eq!(
        channel_close(&out),
        Some((
            406,
            "PRECONDITION_FAILED - cannot declare queue 'q2': queue limit in vhost '/' (1) is reached".into()
        ))
    );
}

//! The handshake through the sans-IO session, bytes in and what goes out: which errors get
//! connection.close and which only a closed socket, as RabbitMQ 3.10's reader decides
//! (`rabbit_reader:handle_exception`; the differential suite's `handshake/*` scenarios hold
//! the recorded answers).

use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};

use super::limits_tests::{broker, channel_open, method, now, send, session, session_from};
use crate::amqp::frame::PROTOCOL_HEADER;

fn start_ok(password: &str, close_on_refusal: bool) -> Vec<u8> {
    let mut caps = FieldTable::default();
    caps.insert(
        "authentication_failure_close".into(),
        AMQPValue::Boolean(close_on_refusal),
    );
    let mut props = FieldTable::default();
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: props,
            mechanism: "PLAIN".into(),
            response: format!("\0guest\0{password}").as_str().into(),
            locale: "en_US".into(),
        })),
    )
}

fn tune_ok(channel_max: u16, frame_max: u32) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max,
            frame_max,
            heartbeat: 0,
        })),
    )
}

fn open_vhost() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    )
}

fn close_of(out: &[AMQPClass]) -> Option<(u16, String, u16, u16)> {
    out.iter().find_map(|m| match m {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some((
            c.reply_code,
            c.reply_text.to_string(),
            c.class_id,
            c.method_id,
        )),
        _ => None,
    })
}

/// The close a refused login gets from a client that asked for one.
fn refused() -> Option<(u16, String, u16, u16)> {
    Some((
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile.".into(),
        0,
        0,
    ))
}

/// A session (from loopback or afar) after the protocol header and guest's start-ok with
/// `password`; what the start-ok brought.
fn started(
    b: &std::sync::Arc<crate::broker::Broker>,
    is_loopback: bool,
    password: &str,
    close_on_refusal: bool,
) -> (crate::session::Connection, Vec<AMQPClass>) {
    let mut s = session_from(b, is_loopback);
    send(b, &mut s, PROTOCOL_HEADER);
    let out = send(b, &mut s, &start_ok(password, close_on_refusal));
    (s, out)
}

#[test]
fn a_0_9_header_is_answered_as_0_9_1_and_a_0_8_header_with_warrens_own() {
    let b = broker();
    let mut s = session(&b);
    let out = send(&b, &mut s, b"AMQP\x01\x01\x00\x09");
    assert!(
        matches!(out.as_slice(), [AMQPClass::Connection(connection::AMQPMethod::Start(st))] if (st.version_major, st.version_minor) == (0, 9)),
        "connection.start 0-9 for 0-9's header, got {out:?}"
    );
    let mut s = session(&b);
    s.handle_bytes(b"AMQP\x01\x01\x08\x00", now());
    assert_eq!(
        s.poll_transmit(now()).as_deref(),
        Some(&PROTOCOL_HEADER[..])
    );
    assert!(s.is_finished());
}

#[test]
fn a_refused_login_gets_a_close_naming_no_method_only_when_the_client_asked_for_one() {
    let b = broker();
    let (_, out) = started(&b, true, "wrong", true);
    assert_eq!(close_of(&out), refused());
    let (s, out) = started(&b, true, "wrong", false);
    assert!(out.is_empty(), "nothing sent, got {out:?}");
    assert!(s.is_finished(), "the socket closes");
}

#[test]
fn a_loopback_only_user_from_afar_is_refused_as_a_failed_login() {
    let b = broker();
    // guest is in the default `loopback_users`; its password is right.
    let (_, out) = started(&b, false, "guest", true);
    assert_eq!(close_of(&out), refused());
    let (_, out) = started(&b, true, "guest", true);
    assert!(
        matches!(
            out.as_slice(),
            [AMQPClass::Connection(connection::AMQPMethod::Tune(_))]
        ),
        "from loopback: tune, got {out:?}"
    );
}

#[test]
fn errors_before_tune_ok_close_the_socket_without_a_method() {
    let b = broker();
    // tune-ok values RabbitMQ refuses: 0 ("no limit") against a server limit, above the
    // server's, below the minimum.
    for (channel_max, frame_max) in [(0, 131_072), (2047, 0), (2048, 131_072), (2047, 4095)] {
        let (mut s, _) = started(&b, true, "guest", true);
        let out = send(&b, &mut s, &tune_ok(channel_max, frame_max));
        assert!(out.is_empty(), "{channel_max}/{frame_max}: got {out:?}");
        assert!(
            s.is_finished(),
            "{channel_max}/{frame_max}: the socket closes"
        );
    }
    // Methods out of order while starting.
    let mut s = session(&b);
    send(&b, &mut s, PROTOCOL_HEADER);
    let out = send(&b, &mut s, &open_vhost());
    assert!(out.is_empty() && s.is_finished(), "got {out:?}");
}

#[test]
fn after_tune_ok_errors_get_rabbitmqs_close_with_the_culprit() {
    let b = broker();
    let (mut s, _) = started(&b, true, "guest", true);
    let out = send(
        &b,
        &mut s,
        &[tune_ok(2047, 131_072), tune_ok(2047, 131_072)].concat(),
    );
    assert_eq!(
        close_of(&out),
        Some((
            504,
            "CHANNEL_ERROR - unexpected method in connection state opening".into(),
            10,
            31
        ))
    );
    // A channel's frame before open-ok: an unexpected frame, no culprit.
    let (mut s, _) = started(&b, true, "guest", true);
    let out = send(
        &b,
        &mut s,
        &[tune_ok(2047, 131_072), channel_open(1)].concat(),
    );
    assert_eq!(
        close_of(&out),
        Some((
            505,
            "UNEXPECTED_FRAME - type 1, all octets = <<0,20,0,10,0>>".into(),
            0,
            0
        ))
    );
    // Once open, the handshake's methods and the server's own are unexpected there too.
    let (mut s, _) = started(&b, true, "guest", true);
    send(&b, &mut s, &[tune_ok(2047, 131_072), open_vhost()].concat());
    let blocked = method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
            reason: "client".into(),
        })),
    );
    let out = send(&b, &mut s, &blocked);
    assert_eq!(
        close_of(&out),
        Some((
            504,
            "CHANNEL_ERROR - unexpected method in connection state running".into(),
            10,
            60
        ))
    );
}

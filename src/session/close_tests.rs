//! Channel closing through the sans-IO session, raw frames in and the methods out (the
//! helpers are limits_tests'). RabbitMQ 3.10 is the reference (`rabbit_channel`).

use amq_protocol::protocol::{basic, channel, exchange, AMQPClass};

use super::limits_tests::{
    broker, channel_close, channel_open, connection_close, method, open, send,
};
use crate::amqp::frame;

const FRAME_MAX: u32 = 131_072;

fn publish(ch: u16, exchange: &str) -> Vec<u8> {
    let mut out = method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: "".into(),
            mandatory: false,
            immediate: false,
        })),
    );
    frame::encode_content(&mut out, ch, &[0, 0], b"", FRAME_MAX);
    out
}

fn close(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "Goodbye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
}

fn close_ok(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
}

fn is_close_ok(m: &AMQPClass) -> bool {
    matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
}

/// The client closes a channel while the server closes it for an error (amqp091-go's
/// TestChannelExceptionWithCloseIssue43): the server answers the client's close with
/// close-ok and takes the client's close-ok to its own close, without a connection error.
#[test]
fn a_channel_close_crossing_the_servers_is_answered_and_its_close_ok_still_accepted() {
    let b = broker();
    let (mut s, _) = open(&b, "guest", "guest", "/");
    assert_eq!(
        send(&b, &mut s, &channel_open(1)).len(),
        1,
        "channel.open-ok"
    );
    let mut bytes = publish(1, "no-such-exchange");
    bytes.extend(close(1));
    let out = send(&b, &mut s, &bytes);
    assert_eq!(
        channel_close(&out),
        Some((
            404,
            "NOT_FOUND - no exchange 'no-such-exchange' in vhost '/'".into()
        ))
    );
    assert!(
        matches!(out.as_slice(), [_, m] if is_close_ok(m)),
        "channel.close then close-ok, got {out:?}"
    );
    let out = send(&b, &mut s, &close_ok(1));
    assert_eq!(connection_close(&out), None, "{out:?}");
    assert!(out.is_empty(), "{out:?}");
    // The channel is closed now, its number free again.
    let out = send(&b, &mut s, &channel_open(1));
    assert!(
        matches!(
            out.as_slice(),
            [AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))]
        ),
        "{out:?}"
    );
}

/// Once the channel is gone, a stray close-ok is still a connection error (504), as before.
#[test]
fn a_close_ok_on_a_channel_that_is_not_open_closes_the_connection_504() {
    let b = broker();
    let (mut s, _) = open(&b, "guest", "guest", "/");
    let out = send(&b, &mut s, &close_ok(3));
    assert_eq!(
        connection_close(&out),
        Some((504, "CHANNEL_ERROR - expected 'channel.open'".into()))
    );
}

fn exchange_declare(ch: u16, name: &str, internal: bool) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: name.into(),
            kind: "direct".into(),
            passive: false,
            durable: false,
            auto_delete: false,
            internal,
            nowait: false,
            arguments: Default::default(),
        })),
    )
}

fn exchange_delete(ch: u16, name: &str) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: name.into(),
            if_unused: false,
            nowait: false,
        })),
    )
}

/// A channel remembers the exchange it last published to (its lookup was a tenth of a
/// node's CPU with small messages) only until the metadata changes: published to, then
/// deleted, `x` is gone for the next publish (404); declared again as internal, it is
/// refused (403).
#[test]
fn a_publish_sees_its_exchange_deleted_or_made_internal_since_the_last_one() {
    let b = broker();
    let (mut s, _) = open(&b, "guest", "guest", "/");
    send(&b, &mut s, &channel_open(1));
    send(&b, &mut s, &exchange_declare(1, "x", false));
    // Unroutable and not mandatory: no answer, the channel stays open.
    assert_eq!(send(&b, &mut s, &publish(1, "x")), [], "published to x");
    send(&b, &mut s, &exchange_delete(1, "x"));
    let out = send(&b, &mut s, &publish(1, "x"));
    assert_eq!(
        channel_close(&out),
        Some((404, "NOT_FOUND - no exchange 'x' in vhost '/'".into()))
    );
    send(&b, &mut s, &close_ok(1));
    send(&b, &mut s, &channel_open(2));
    send(&b, &mut s, &exchange_declare(2, "y", false));
    assert_eq!(send(&b, &mut s, &publish(2, "y")), [], "published to y");
    send(&b, &mut s, &exchange_delete(2, "y"));
    send(&b, &mut s, &exchange_declare(2, "y", true));
    let out = send(&b, &mut s, &publish(2, "y"));
    assert_eq!(
        channel_close(&out),
        Some((
            403,
            "ACCESS_REFUSED - cannot publish to internal exchange 'y' in vhost '/'".into()
        ))
    );
}

//! Channel closing through the sans-IO session, raw frames in and the methods out (the
//! helpers are limits_tests'). RabbitMQ 3.10 is the reference (`rabbit_channel`).

use amq_protocol::protocol::{basic, channel, AMQPClass};

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

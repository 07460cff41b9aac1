//! Publisher confirms through the sans-IO session: which acks and nacks one flush writes,
//! with RabbitMQ 3.10.8's coalescing (`rabbit_channel:coalesce_and_send`): nacks below the
//! batch's first ack go as one `multiple` nack, even one alone; after the other kind in the
//! same batch, each goes single. The helpers are limits_tests'.

use amq_protocol::protocol::{basic, confirm, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};

use super::limits_tests::{broker, channel_open, method, open, send};
use crate::amqp::frame;

const FRAME_MAX: u32 = 131_072;
const QUEUE: &str = "capped";

fn publish() -> Vec<u8> {
    let mut out = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: QUEUE.into(),
            mandatory: false,
            immediate: false,
        })),
    );
    frame::encode_content(&mut out, 1, &[0, 0], b"m", FRAME_MAX);
    out
}

fn get() -> Vec<u8> {
    method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: QUEUE.into(),
            no_ack: true,
        })),
    )
}

/// (tag, multiple, Some(requeue) for a nack) of each confirm written.
fn confirms(out: &[AMQPClass]) -> Vec<(u64, bool, Option<bool>)> {
    out.iter()
        .filter_map(|m| match m {
            AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => Some((a.delivery_tag, a.multiple, None)),
            AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
                Some((n.delivery_tag, n.multiple, Some(n.requeue)))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn nacks_are_coalesced_as_rabbitmq_coalesces_them() {
    let b = broker();
    let (mut s, _) = open(&b, "guest", "guest", "/");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let mut setup = channel_open(1);
    setup.extend(method(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: QUEUE.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: args,
        })),
    ));
    setup.extend(method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    assert_eq!(
        send(&b, &mut s, &setup).len(),
        3,
        "open-ok, declare-ok, select-ok"
    );

    // One batch: the first is taken, the two after it refused: an ack alone is single,
    // and the nacks after it in the batch go single.
    let batch: Vec<u8> = [publish(), publish(), publish()].concat();
    assert_eq!(
        confirms(&send(&b, &mut s, &batch)),
        [
            (1, false, None),
            (2, false, Some(true)),
            (3, false, Some(true))
        ]
    );
    // A nack alone is `multiple` (everything below it is settled).
    assert_eq!(
        confirms(&send(&b, &mut s, &publish())),
        [(4, true, Some(true))]
    );
    // Two refused in one batch: one `multiple` nack.
    let batch: Vec<u8> = [publish(), publish()].concat();
    assert_eq!(confirms(&send(&b, &mut s, &batch)), [(6, true, Some(true))]);
    // Refused, taken (a get made room), refused: the nack first is `multiple`, the ack
    // after a nack and the nack after an ack are single.
    let batch: Vec<u8> = [publish(), get(), publish(), publish()].concat();
    assert_eq!(
        confirms(&send(&b, &mut s, &batch)),
        [
            (7, true, Some(true)),
            (8, false, None),
            (9, false, Some(true))
        ]
    );
}

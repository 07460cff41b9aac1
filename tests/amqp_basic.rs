//! basic.*: consume, qos, get, ack/nack/reject, recover, cancel, returns, requeue on close.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use common::*;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRecoverOptions, BasicRejectOptions,
    QueueDeleteOptions,
};
use lapin::{BasicProperties, Channel};

async fn qos(ch: &Channel, prefetch: u16, global: bool) {
    within(
        "basic.qos",
        ch.basic_qos(prefetch, BasicQosOptions { global }),
    )
    .await
    .expect("basic.qos");
}

async fn ack(ch: &Channel, tag: u64, multiple: bool) {
    within("basic.ack", ch.basic_ack(tag, BasicAckOptions { multiple }))
        .await
        .expect("basic.ack sent");
}

/// Publishes m1..mn to an empty queue and waits until all are enqueued.
async fn fill(ch: &Channel, q: &str, n: usize) {
    for i in 1..=n {
        publish(ch, "", q, format!("m{i}").as_bytes()).await;
    }
    wait_count(ch, q, n as u32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_consume_round_robins_across_two_consumers() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("rr-q");
    declare_queue(&ch, &q).await;
    let mut c1 = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let mut c2 = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let pub_ch = open_channel(&_conn).await;
    for i in 0..10 {
        publish(&pub_ch, "", &q, format!("{i}").as_bytes()).await;
    }
    let mut got1 = Vec::new();
    let mut got2 = Vec::new();
    for _ in 0..5 {
        got1.push(body(&c1.next().await).parse::<u32>().unwrap());
        got2.push(body(&c2.next().await).parse::<u32>().unwrap());
    }
    c1.expect_nothing(QUIET).await;
    c2.expect_nothing(QUIET).await;
    // Strict alternation: one consumer gets the even messages, the other the odd ones, each
    // in publish order.
    let evens = vec![0, 2, 4, 6, 8];
    let odds = vec![1, 3, 5, 7, 9];
    assert!(
        (got1 == evens && got2 == odds) || (got1 == odds && got2 == evens),
        "not round-robin: c1 {got1:?}, c2 {got2:?}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_carry_exchange_routing_key_tags_and_properties() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("props-q");
    declare_queue(&ch, &q).await;
    within(
        "queue.bind",
        ch.queue_bind(
            q.as_str().into(),
            "amq.direct".into(),
            "rk".into(),
            Default::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind");
    let mut c = consume_tagged(&ch, &q, "my-tag", BasicConsumeOptions::default()).await;
    assert_eq!(c.tag(), "my-tag");
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_content_encoding("utf-8".into())
        .with_headers(table(&[
            ("h1", lstr("v1")),
            ("h2", AMQPValue::LongLongInt(42)),
        ]))
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("corr".into())
        .with_reply_to("reply-q".into())
        .with_expiration("60000".into())
        .with_message_id("id-1".into())
        .with_timestamp(1_700_000_000)
        .with_type("t".into())
        .with_user_id("guest".into())
        .with_app_id("app".into());
    publish_with(
        &ch,
        "amq.direct",
        "rk",
        b"first",
        BasicPublishOptions::default(),
        props.clone(),
    )
    .await;
    publish(&ch, "amq.direct", "rk", b"").await;
    let d1 = c.next().await;
    let d2 = c.next().await;
    assert_eq!(d1.exchange.as_str(), "amq.direct");
    assert_eq!(d1.routing_key.as_str(), "rk");
    assert!(!d1.redelivered);
    assert_eq!(d1.data, b"first");
    assert_eq!(
        d1.properties, props,
        "all basic properties must round-trip unchanged"
    );
    assert_eq!(d2.data, b"", "empty bodies are delivered");
    assert_eq!(
        (d1.delivery_tag, d2.delivery_tag),
        (1, 2),
        "delivery tags start at 1 per channel"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_id_property_must_match_the_connection_user_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    let mut watch = watch_channel(&ch).await;
    publish_with(
        &ch,
        "",
        q.name().as_str(),
        b"spoofed",
        BasicPublishOptions::default(),
        BasicProperties::default().with_user_id("someone-else".into()),
    )
    .await;
    expect_closed_with(
        &mut watch,
        406,
        "publish with a user_id other than the login",
    )
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_count_limits_unacked_deliveries_per_consumer() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("prefetch-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 5).await;
    qos(&ch, 2, false).await;
    let mut c = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let d1 = c.next().await;
    let d2 = c.next().await;
    assert_eq!((body(&d1).as_str(), body(&d2).as_str()), ("m1", "m2"));
    c.expect_nothing(QUIET).await;
    ack(&ch, d1.delivery_tag, false).await;
    let d3 = c.next().await;
    assert_eq!(body(&d3), "m3");
    c.expect_nothing(QUIET).await;
    // Multiple ack frees both slots.
    ack(&ch, d3.delivery_tag, true).await;
    assert_eq!(body(&c.next().await), "m4");
    assert_eq!(body(&c.next().await), "m5");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_consumer_prefetch_applies_to_each_consumer_separately() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let qa = unique("pc-a");
    let qb = unique("pc-b");
    declare_queue(&ch, &qa).await;
    declare_queue(&ch, &qb).await;
    fill(&ch, &qa, 5).await;
    fill(&ch, &qb, 5).await;
    qos(&ch, 2, false).await;
    let mut a = consume(&ch, &qa, BasicConsumeOptions::default()).await;
    let mut b = consume(&ch, &qb, BasicConsumeOptions::default()).await;
    for c in [&mut a, &mut b] {
        c.next().await;
        c.next().await;
    }
    a.expect_nothing(QUIET).await;
    b.expect_nothing(Duration::from_millis(50)).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_qos_limits_unacked_deliveries_across_the_channel() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let qa = unique("gq-a");
    let qb = unique("gq-b");
    declare_queue(&ch, &qa).await;
    declare_queue(&ch, &qb).await;
    fill(&ch, &qa, 5).await;
    fill(&ch, &qb, 5).await;
    qos(&ch, 3, true).await;
    let mut a = consume(&ch, &qa, BasicConsumeOptions::default()).await;
    let mut b = consume(&ch, &qb, BasicConsumeOptions::default()).await;
    // Count everything both consumers get until things go quiet.
    let mut tags = Vec::new();
    loop {
        tokio::select! {
            d = a.next() => tags.push(d.delivery_tag),
            d = b.next() => tags.push(d.delivery_tag),
            _ = tokio::time::sleep(QUIET) => break,
        }
    }
    assert_eq!(
        tags.len(),
        3,
        "global prefetch 3 across two consumers, got {tags:?}"
    );
    // Acking one frees exactly one slot on the channel.
    ack(&ch, tags[0], false).await;
    let mut more = 0;
    loop {
        tokio::select! {
            _ = a.next() => more += 1,
            _ = b.next() => more += 1,
            _ = tokio::time::sleep(QUIET) => break,
        }
    }
    assert_eq!(more, 1);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_consumer_refuses_other_consumers_403() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let q = unique("excl-consume-q");
    declare_queue(&ch, &q).await;
    let _owner = consume(
        &ch,
        &q,
        BasicConsumeOptions {
            exclusive: true,
            ..Default::default()
        },
    )
    .await;
    let ch2 = open_channel(&conn).await;
    let res = within(
        "basic.consume",
        ch2.basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "second consumer on an exclusively consumed queue");
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_consume_on_queue_with_consumers_is_refused_403() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let q = unique("excl-late-q");
    declare_queue(&ch, &q).await;
    let _first = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let ch2 = open_channel(&conn).await;
    let res = within(
        "basic.consume",
        ch2.basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "exclusive consume while another consumer exists");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_consumer_removes_messages_on_delivery() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let q = unique("noack-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 3).await;
    let consumer_ch = open_channel(&conn).await;
    qos(&consumer_ch, 1, false).await; // prefetch does not apply to no-ack consumers
    let mut c = consume(
        &consumer_ch,
        &q,
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;
    for i in 1..=3 {
        assert_eq!(body(&c.next().await), format!("m{i}"));
    }
    within("channel.close", consumer_ch.close(200, "bye".into()))
        .await
        .expect("close");
    assert_eq!(
        queue_counts(&ch, &q).await.0,
        0,
        "no-ack deliveries are not requeued"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_deliveries_to_that_consumer() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("cancel-q");
    declare_queue(&ch, &q).await;
    let mut c = consume(
        &ch,
        &q,
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;
    publish(&ch, "", &q, b"before").await;
    assert_eq!(body(&c.next().await), "before");
    within(
        "basic.cancel",
        ch.basic_cancel(c.tag().as_str().into(), BasicCancelOptions::default()),
    )
    .await
    .expect("cancel");
    c.expect_cancelled().await;
    publish(&ch, "", &q, b"after").await;
    wait_count(&ch, &q, 1).await;
    assert_eq!(queue_counts(&ch, &q).await, (1, 0));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_queue_cancels_its_consumers_with_basic_cancel() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let q = unique("srv-cancel-q");
    declare_queue(&ch, &q).await;
    let mut c = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let admin = open_channel(&conn).await;
    within(
        "queue.delete",
        admin.queue_delete(q.as_str().into(), QueueDeleteOptions::default()),
    )
    .await
    .expect("delete");
    c.expect_cancelled().await;
    // The consumer's channel is unaffected.
    assert!(ch.status().connected());
    let q2 = declare_queue(&ch, "").await;
    publish(&ch, "", q2.name().as_str(), b"still-works").await;
    wait_count(&ch, q2.name().as_str(), 1).await;
    assert_eq!(
        get_some(&ch, q2.name().as_str(), true).await.delivery.data,
        b"still-works"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_unroutable_publish_is_returned_with_312_no_route() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    let key = unique("nowhere");
    publish_with(
        &ch,
        "amq.direct",
        &key,
        b"lost",
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        BasicProperties::default(),
    )
    .await;
    // Not mandatory: silently dropped, nothing returned.
    publish(&ch, "amq.direct", &key, b"dropped").await;
    // Without confirms lapin keeps returns until wait_for_confirms drains them.
    let mut returned = Vec::new();
    let start = std::time::Instant::now();
    while returned.is_empty() && start.elapsed() < TIMEOUT {
        queue_counts(&ch, q.name().as_str()).await;
        returned.extend(
            within("drain returns", ch.wait_for_confirms())
                .await
                .expect("returns"),
        );
    }
    tokio::time::sleep(QUIET).await;
    queue_counts(&ch, q.name().as_str()).await;
    returned.extend(
        within("drain returns", ch.wait_for_confirms())
            .await
            .expect("returns"),
    );
    assert_eq!(
        returned.len(),
        1,
        "exactly the mandatory message is returned: {returned:?}"
    );
    let r = &returned[0];
    assert_eq!(r.reply_code, 312);
    assert_eq!(r.reply_text.as_str(), "NO_ROUTE");
    assert_eq!(r.delivery.exchange.as_str(), "amq.direct");
    assert_eq!(r.delivery.routing_key.as_str(), key);
    assert_eq!(r.delivery.data, b"lost");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_routable_publish_is_not_returned() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    publish_with(
        &ch,
        "",
        q.name().as_str(),
        b"ok",
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        BasicProperties::default(),
    )
    .await;
    wait_count(&ch, q.name().as_str(), 1).await;
    tokio::time::sleep(QUIET).await;
    queue_counts(&ch, q.name().as_str()).await;
    let returned = within("drain returns", ch.wait_for_confirms())
        .await
        .expect("returns");
    assert!(returned.is_empty(), "{returned:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_flag_closes_connection_540_not_implemented() {
    // Raw client: the exact connection.close is observable (lapin may report a
    // server-initiated connection close to consumers without its code).
    let node = TestNode::start().await;
    let (_admin_conn, admin) = node.channel().await;
    let q = unique("immediate-q");
    declare_queue(&admin, &q).await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    let mut bytes = encode(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: q.as_str().into(),
            mandatory: false,
            immediate: true,
        })),
    ));
    bytes.extend(encode(&AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 3,
            properties: BasicProperties::default(),
        },
    )));
    bytes.extend(encode(&AMQPFrame::Body(1, b"now".to_vec())));
    raw.write_bytes(&bytes).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 540, "close: {close:?}");
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        queue_counts(&admin, &q).await.0,
        0,
        "the immediate publish is not enqueued"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_get_reports_remaining_count_then_get_empty() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("get-q");
    declare_queue(&ch, &q).await;
    assert!(
        get(&ch, &q, false).await.is_none(),
        "get on an empty queue is get-empty"
    );
    fill(&ch, &q, 3).await;
    for (i, remaining) in [(1, 2), (2, 1), (3, 0)] {
        let m = get_some(&ch, &q, true).await;
        assert_eq!(body(&m.delivery), format!("m{i}"));
        assert_eq!(m.message_count, remaining, "message_count after m{i}");
        assert!(!m.delivery.redelivered);
        assert_eq!(m.delivery.routing_key.as_str(), q);
    }
    assert!(get(&ch, &q, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_get_on_missing_queue_closes_channel_404() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let res = within(
        "basic.get",
        ch.basic_get(unique("nope").into(), Default::default()),
    )
    .await;
    assert_code(
        res.map(|m| m.is_some()),
        404,
        "basic.get on a missing queue",
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_on_missing_queue_closes_channel_404() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let res = within(
        "basic.consume",
        ch.basic_consume(
            unique("nope").into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res.map(|c| c.tag()), 404, "consume on a missing queue");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_multiple_acknowledges_everything_up_to_the_tag() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let admin = open_channel(&conn).await;
    let q = unique("ackmulti-q");
    declare_queue(&admin, &q).await;
    fill(&admin, &q, 4).await;
    let ch = open_channel(&conn).await;
    let tags: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(get_some(&ch, &q, false).await.delivery.delivery_tag);
        }
        v
    };
    assert_eq!(tags, vec![1, 2, 3, 4]);
    ack(&ch, 3, true).await;
    within("channel.close", ch.close(200, "bye".into()))
        .await
        .expect("close");
    // Only m4 was unacked: it alone comes back.
    eventually("m4 requeued", || {
        let admin = admin.clone();
        let q = q.clone();
        async move { queue_counts(&admin, &q).await.0 == 1 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(queue_counts(&admin, &q).await.0, 1);
    let m = get_some(&admin, &q, true).await;
    assert_eq!(body(&m.delivery), "m4");
    assert!(m.delivery.redelivered);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_multiple_with_tag_zero_acknowledges_all_outstanding() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let admin = open_channel(&conn).await;
    let q = unique("ackzero-q");
    declare_queue(&admin, &q).await;
    fill(&admin, &q, 3).await;
    let ch = open_channel(&conn).await;
    for _ in 0..3 {
        get_some(&ch, &q, false).await;
    }
    ack(&ch, 0, true).await;
    // recover(requeue) would put back anything still unacked; recover-ok is synchronous.
    within(
        "basic.recover",
        ch.basic_recover(BasicRecoverOptions { requeue: true }),
    )
    .await
    .expect("recover-ok");
    assert_eq!(queue_counts(&admin, &q).await.0, 0);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_with_requeue_puts_message_back_in_its_original_position_redelivered() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("nack-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 3).await;
    let m1 = get_some(&ch, &q, false).await;
    assert_eq!(body(&m1.delivery), "m1");
    within(
        "basic.nack",
        ch.basic_nack(
            m1.delivery.delivery_tag,
            BasicNackOptions {
                multiple: false,
                requeue: true,
            },
        ),
    )
    .await
    .expect("nack");
    let again = get_some(&ch, &q, true).await;
    assert_eq!(
        body(&again.delivery),
        "m1",
        "requeued message goes back to the head"
    );
    assert!(
        again.delivery.redelivered,
        "requeued message is marked redelivered"
    );
    assert_eq!(again.message_count, 2);
    let m2 = get_some(&ch, &q, true).await;
    assert_eq!(body(&m2.delivery), "m2");
    assert!(!m2.delivery.redelivered);
    assert_eq!(body(&get_some(&ch, &q, true).await.delivery), "m3");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_multiple_requeues_in_original_order() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("nackmulti-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 4).await;
    let mut last = 0;
    for _ in 0..3 {
        last = get_some(&ch, &q, false).await.delivery.delivery_tag;
    }
    within(
        "basic.nack",
        ch.basic_nack(
            last,
            BasicNackOptions {
                multiple: true,
                requeue: true,
            },
        ),
    )
    .await
    .expect("nack");
    let mut order = Vec::new();
    while let Some(m) = get(&ch, &q, true).await {
        order.push((body(&m.delivery), m.delivery.redelivered));
    }
    assert_eq!(
        order,
        vec![
            ("m1".to_string(), true),
            ("m2".to_string(), true),
            ("m3".to_string(), true),
            ("m4".to_string(), false)
        ]
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_to_consumer_redelivers_with_redelivered_flag() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("nack-consume-q");
    declare_queue(&ch, &q).await;
    qos(&ch, 1, false).await;
    let mut c = consume(&ch, &q, BasicConsumeOptions::default()).await;
    publish(&ch, "", &q, b"once-more").await;
    let d = c.next().await;
    assert!(!d.redelivered);
    within(
        "nack",
        d.acker.nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        }),
    )
    .await
    .expect("nack");
    let d2 = c.next().await;
    assert_eq!(body(&d2), "once-more");
    assert!(d2.redelivered);
    assert!(
        d2.delivery_tag > d.delivery_tag,
        "a redelivery gets a new delivery tag"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_without_requeue_drops_the_message() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("reject-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 2).await;
    let m1 = get_some(&ch, &q, false).await;
    within(
        "basic.reject",
        ch.basic_reject(
            m1.delivery.delivery_tag,
            BasicRejectOptions { requeue: false },
        ),
    )
    .await
    .expect("reject");
    let next = get_some(&ch, &q, true).await;
    assert_eq!(body(&next.delivery), "m2");
    assert_eq!(next.message_count, 0);
    assert!(
        get(&ch, &q, true).await.is_none(),
        "the rejected message is gone"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_with_requeue_redelivers() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("reject-rq-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 1).await;
    let m1 = get_some(&ch, &q, false).await;
    within(
        "basic.reject",
        ch.basic_reject(
            m1.delivery.delivery_tag,
            BasicRejectOptions { requeue: true },
        ),
    )
    .await
    .expect("reject");
    let again = get_some(&ch, &q, true).await;
    assert_eq!(body(&again.delivery), "m1");
    assert!(again.delivery.redelivered);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_with_requeue_redelivers_all_unacked() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("recover-q");
    declare_queue(&ch, &q).await;
    fill(&ch, &q, 3).await;
    get_some(&ch, &q, false).await;
    get_some(&ch, &q, false).await;
    within(
        "basic.recover",
        ch.basic_recover(BasicRecoverOptions { requeue: true }),
    )
    .await
    .expect("recover-ok");
    let mut got = Vec::new();
    while let Some(m) = get(&ch, &q, true).await {
        got.push((body(&m.delivery), m.delivery.redelivered));
    }
    assert_eq!(
        got,
        vec![
            ("m1".to_string(), true),
            ("m2".to_string(), true),
            ("m3".to_string(), false)
        ]
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_messages_are_requeued_when_the_channel_closes() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let admin = open_channel(&conn).await;
    let q = unique("chclose-q");
    declare_queue(&admin, &q).await;
    fill(&admin, &q, 2).await;
    let ch = open_channel(&conn).await;
    let mut c = consume(&ch, &q, BasicConsumeOptions::default()).await;
    c.next().await;
    c.next().await;
    assert_eq!(queue_counts(&admin, &q).await, (0, 1));
    within("channel.close", ch.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("both messages requeued", || {
        let admin = admin.clone();
        let q = q.clone();
        async move { queue_counts(&admin, &q).await == (2, 0) }
    })
    .await;
    let m = get_some(&admin, &q, true).await;
    assert_eq!(body(&m.delivery), "m1");
    assert!(m.delivery.redelivered);
    let m = get_some(&admin, &q, true).await;
    assert_eq!(body(&m.delivery), "m2");
    assert!(m.delivery.redelivered);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_messages_are_requeued_when_the_connection_closes() {
    let node = TestNode::start().await;
    let (admin_conn, admin) = node.channel().await;
    let q = unique("connclose-q");
    declare_queue(&admin, &q).await;
    fill(&admin, &q, 2).await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let g = get_some(&ch, &q, false).await;
    assert_eq!(body(&g.delivery), "m1");
    within("connection.close", conn.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("m1 requeued", || {
        let admin = admin.clone();
        let q = q.clone();
        async move { queue_counts(&admin, &q).await.0 == 2 }
    })
    .await;
    let m = get_some(&admin, &q, true).await;
    assert_eq!(body(&m.delivery), "m1", "requeued to its original position");
    assert!(m.delivery.redelivered);
    drop(admin_conn);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_of_unknown_delivery_tag_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let mut watch = watch_channel(&ch).await;
    ack(&ch, 999, false).await;
    expect_closed_with(&mut watch, 406, "ack of a never-delivered tag").await;
    assert!(conn.status().connected(), "406 is a channel error");
    let other = open_channel(&conn).await;
    declare_queue(&other, "").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_ack_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    fill(&ch, q.name().as_str(), 1).await;
    let m = get_some(&ch, q.name().as_str(), false).await;
    let mut watch = watch_channel(&ch).await;
    ack(&ch, m.delivery.delivery_tag, false).await;
    ack(&ch, m.delivery.delivery_tag, false).await;
    expect_closed_with(&mut watch, 406, "second ack of the same tag").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_of_no_ack_get_tag_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    fill(&ch, q.name().as_str(), 1).await;
    let m = get_some(&ch, q.name().as_str(), true).await;
    let mut watch = watch_channel(&ch).await;
    ack(&ch, m.delivery.delivery_tag, false).await;
    expect_closed_with(&mut watch, 406, "ack of a tag delivered with no-ack").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_on_separate_channels_share_a_queue_without_duplicates() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch1 = open_channel(&conn).await;
    let ch2 = open_channel(&conn).await;
    let q = unique("share-q");
    declare_queue(&ch1, &q).await;
    let mut c1 = consume(
        &ch1,
        &q,
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;
    let mut c2 = consume(
        &ch2,
        &q,
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;
    let n = 50;
    for i in 0..n {
        publish(&ch1, "", &q, format!("{i}").as_bytes()).await;
    }
    let mut seen = BTreeSet::new();
    let mut from = [0, 0];
    while seen.len() < n {
        tokio::select! {
            d = c1.next() => { assert!(seen.insert(body(&d)), "duplicate {}", body(&d)); from[0] += 1; }
            d = c2.next() => { assert!(seen.insert(body(&d)), "duplicate {}", body(&d)); from[1] += 1; }
        }
    }
    c1.expect_nothing(QUIET).await;
    assert!(
        from[0] > 0 && from[1] > 0,
        "both consumers served: {from:?}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priority_consumer_gets_messages_first() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("prio-consumer-q");
    declare_queue(&ch, &q).await;
    let mut low = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let mut high = consume_with_args(
        &ch,
        &q,
        BasicConsumeOptions::default(),
        table(&[("x-priority", AMQPValue::LongInt(10))]),
    )
    .await;
    for i in 0..5 {
        publish(&ch, "", &q, format!("{i}").as_bytes()).await;
    }
    for i in 0..5 {
        assert_eq!(body(&high.next().await), format!("{i}"));
    }
    low.expect_nothing(QUIET).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_high_priority_consumer_lets_lower_priority_consumer_receive() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let q = unique("prio-full-q");
    declare_queue(&ch, &q).await;
    let high_ch = open_channel(&conn).await;
    qos(&high_ch, 1, false).await;
    let mut high = consume_with_args(
        &high_ch,
        &q,
        BasicConsumeOptions::default(),
        table(&[("x-priority", AMQPValue::LongInt(10))]),
    )
    .await;
    let mut low = consume(&ch, &q, BasicConsumeOptions::default()).await;
    for i in 0..3 {
        publish(&ch, "", &q, format!("{i}").as_bytes()).await;
    }
    // The high-priority consumer holds one unacked message; the rest go to the other one.
    assert_eq!(body(&high.next().await), "0");
    assert_eq!(body(&low.next().await), "1");
    assert_eq!(body(&low.next().await), "2");
    high.expect_nothing(QUIET).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_larger_than_max_message_size_closes_channel_406() {
    let node = TestNode::start_with(|c| c.amqp.max_message_size_bytes = 10_000).await;
    let (conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    publish(&ch, "", q.name().as_str(), &vec![1u8; 10_000]).await;
    wait_count(&ch, q.name().as_str(), 1).await;
    let mut watch = watch_channel(&ch).await;
    publish(&ch, "", q.name().as_str(), &vec![2u8; 20_000]).await;
    expect_closed_with(&mut watch, 406, "publish above max_message_size").await;
    assert!(conn.status().connected());
    let other = open_channel(&conn).await;
    assert_eq!(queue_counts(&other, q.name().as_str()).await.0, 1);
    node.shutdown().await;
}

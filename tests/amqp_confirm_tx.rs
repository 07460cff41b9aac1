//! Publisher confirms and transactions.

mod common;
#[path = "../src/bin/warren_chaos/returns.rs"]
mod returns;

use std::collections::BTreeSet;

use amq_protocol::protocol::{basic, confirm, AMQPClass};
use common::*;
use lapin::options::{
    BasicAckOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::{BasicProperties, Channel, Confirmation};

async fn confirm_select(ch: &Channel) {
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
}

async fn tx_select(ch: &Channel) {
    within("tx.select", ch.tx_select())
        .await
        .expect("tx.select");
}

// ----------------------------------------------------------------------------- confirms

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_publish_is_acked_after_confirm_select() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("confirm-q");
    declare_queue(&ch, &q).await;
    confirm_select(&ch).await;
    assert!(ch.status().confirm());
    let mut pending = Vec::new();
    for i in 0..100 {
        let c = within(
            "publish",
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("{i}").as_bytes(),
                BasicProperties::default(),
            ),
        )
        .await
        .expect("publish");
        pending.push(c);
    }
    for (i, c) in pending.into_iter().enumerate() {
        let conf = within("publisher confirm", c).await.expect("confirm");
        assert!(conf.is_ack(), "message {i} was nacked");
    }
    assert_eq!(queue_counts(&ch, &q).await.0, 100);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_and_persistent_publishes_are_acked_too() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("confirm-durable-q");
    declare_queue_with(&ch, &q, QueueDeclareOptions::durable(), Default::default()).await;
    confirm_select(&ch).await;
    let persistent = within(
        "publish",
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"p",
            BasicProperties::default().with_delivery_mode(2),
        ),
    )
    .await
    .expect("publish");
    let unroutable = within(
        "publish",
        ch.basic_publish(
            "amq.direct".into(),
            unique("nowhere").into(),
            BasicPublishOptions::default(),
            b"u",
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    assert!(within("confirm", persistent)
        .await
        .expect("confirm")
        .is_ack());
    let u = within("confirm", unroutable).await.expect("confirm");
    assert!(u.is_ack(), "a message routed nowhere is confirmed at once");
    assert!(
        u.take_message().is_none(),
        "not mandatory: nothing returned"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_acks_cover_each_publish_sequence_number_once() {
    let node = TestNode::start().await;
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.send_method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    )
    .await;
    match raw.next_method().await {
        Some((1, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))) => {}
        other => panic!("expected confirm.select-ok, got {other:?}"),
    }
    let n = 30u64;
    for i in 0..n {
        // Half routed to nowhere through amq.fanout (no bindings), half to the default
        // exchange with no such queue: all unroutable, all must still be confirmed.
        let ex = if i % 2 == 0 { "amq.fanout" } else { "" };
        raw.publish(1, ex, "no-such-queue", b"x", 1024).await;
    }
    let mut confirmed = BTreeSet::new();
    while (confirmed.len() as u64) < n {
        match raw.next_method().await {
            Some((1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))) => {
                assert!(a.delivery_tag <= n, "ack for unknown sequence number {a:?}");
                let covered: Vec<u64> = if a.multiple {
                    (1..=a.delivery_tag).collect()
                } else {
                    vec![a.delivery_tag]
                };
                let mut new = 0;
                for t in covered {
                    if confirmed.insert(t) {
                        new += 1;
                    }
                }
                assert!(new > 0, "ack {a:?} confirms nothing new");
            }
            Some((1, AMQPClass::Basic(basic::AMQPMethod::Nack(nk)))) => {
                panic!("unexpected nack {nk:?}")
            }
            other => panic!("expected basic.ack, got {other:?}"),
        }
    }
    assert_eq!(confirmed, (1..=n).collect::<BTreeSet<_>>());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_unroutable_publish_is_returned_before_its_ack() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    let key = unique("nowhere");
    let c = within(
        "publish",
        ch.basic_publish(
            "amq.direct".into(),
            key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"bounce",
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    let conf = within("confirm", c).await.expect("confirm");
    assert!(
        conf.is_ack(),
        "an unroutable message is acked (after its return)"
    );
    // lapin attaches a basic.return to the confirm only if it arrived before the ack.
    let returned = conf
        .take_message()
        .expect("basic.return must arrive before the basic.ack of the same message");
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.delivery.routing_key.as_str(), key);
    assert_eq!(returned.delivery.data, b"bounce");
    node.shutdown().await;
}

/// warren-chaos's publishers (windows of mandatory publishes, some unroutable) learn which
/// came back from the returned bodies (`returns`), not from the confirm lapin hangs each
/// return on: lapin hands a return to whichever confirm it completes next, and the tags of a
/// `multiple` ack in a `HashMap`'s order. Campaign seed 6742 counted a returned publish as
/// confirmed and lost that way (`docs/reliability.md`, session 44).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_in_a_window_of_confirms_are_named_by_their_bodies() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("windowed");
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await;
    confirm_select(&ch).await;
    let nowhere = unique("nowhere");
    let (mut unroutable, mut by_body, mut by_confirm) = (BTreeSet::new(), BTreeSet::new(), 0);
    let mut seq = 0u64;
    for window in 0..40u64 {
        let mut confirms = Vec::new();
        for k in 0..10u64 {
            // A different mix in each window: some routable, some not.
            let routed = (window * 7 + k * 3) % 5 < 3;
            if !routed {
                unroutable.insert(seq);
            }
            let c = within(
                "publish",
                ch.basic_publish(
                    "".into(),
                    if routed { q.as_str() } else { nowhere.as_str() }.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &seq.to_be_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish");
            confirms.push((seq, c));
            seq += 1;
        }
        let mut answered = Vec::new();
        for (s, c) in confirms {
            let conf = within("confirm", c).await.expect("confirm");
            assert!(conf.is_ack(), "publish {s} was nacked");
            answered.push((s, conf));
        }
        by_body.extend(returns::returned(answered.iter().map(|(_, c)| c), |b| {
            Some(u64::from_be_bytes(b.try_into().ok()?))
        }));
        by_confirm += answered
            .iter()
            .filter(|(s, c)| matches!(c, Confirmation::Ack(Some(m)) if m.delivery.data != s.to_be_bytes()))
            .count();
    }
    eprintln!(
        "{} of {} returns rode on another publish's confirm",
        by_confirm,
        unroutable.len()
    );
    assert_eq!(
        by_body, unroutable,
        "the returned publishes, by their bodies"
    );
    assert_eq!(
        queue_counts(&ch, &q).await.0 as usize,
        seq as usize - unroutable.len()
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_to_missing_exchange_in_confirm_mode_closes_channel_404() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    let mut watch = watch_channel(&ch).await;
    let c = within(
        "publish",
        ch.basic_publish(
            unique("no-ex").into(),
            "k".into(),
            BasicPublishOptions::default(),
            b"x",
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish written");
    expect_closed_with(&mut watch, 404, "publish to a missing exchange").await;
    let res = within("confirm", c).await;
    assert!(
        res.is_err() || res.as_ref().map(|c| !c.is_ack()).unwrap_or(false),
        "no ack for a message that closed the channel: {res:?}"
    );
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_select_on_transactional_channel_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    tx_select(&ch).await;
    let res = within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await;
    assert_code(res, 406, "confirm.select on a tx channel");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_select_on_confirm_channel_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    confirm_select(&ch).await;
    let res = within("tx.select", ch.tx_select()).await;
    assert_code(res, 406, "tx.select on a confirm channel");
    node.shutdown().await;
}

// ----------------------------------------------------------------------------- tx

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_rollback_discards_publishes() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("tx-rb-q");
    declare_queue(&ch, &q).await;
    tx_select(&ch).await;
    for _ in 0..3 {
        publish(&ch, "", &q, b"never").await;
    }
    within("tx.rollback", ch.tx_rollback())
        .await
        .expect("rollback");
    // A committed marker after the rollback: once it is in the queue, anything published
    // before it would be too.
    publish(&ch, "", &q, b"marker").await;
    within("tx.commit", ch.tx_commit()).await.expect("commit");
    wait_count(&ch, &q, 1).await;
    assert_eq!(body(&get_some(&ch, &q, true).await.delivery), "marker");
    assert!(
        get(&ch, &q, true).await.is_none(),
        "rolled back publishes must never arrive"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_commit_makes_publishes_visible_only_then() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let q = unique("tx-commit-q");
    declare_queue(&ch, &q).await;
    let observer = open_channel(&conn).await;
    tx_select(&ch).await;
    for i in 0..3 {
        publish(&ch, "", &q, format!("t{i}").as_bytes()).await;
    }
    // Let the broker read the publishes (a synchronous method on the same channel), then
    // look from outside: nothing yet.
    queue_counts(&ch, &q).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        queue_counts(&observer, &q).await.0,
        0,
        "uncommitted publishes are invisible"
    );
    within("tx.commit", ch.tx_commit()).await.expect("commit");
    wait_count(&observer, &q, 3).await;
    for i in 0..3 {
        assert_eq!(
            body(&get_some(&observer, &q, true).await.delivery),
            format!("t{i}")
        );
    }
    node.shutdown().await;
}

/// A queue that refuses a transaction's publish (here its `reject-publish` limit) fails the
/// commit with RabbitMQ's 406 "partial tx completion": a commit-ok would tell the publisher
/// a message was kept that no queue took. The other queue keeps its copy, as in RabbitMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_a_queue_refused_fails_the_commit_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let full = unique("tx-full-q");
    let open = unique("tx-open-q");
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    declare_queue_with(&ch, &full, QueueDeclareOptions::default(), args).await;
    declare_queue(&ch, &open).await;
    tx_select(&ch).await;
    publish(&ch, "", &open, b"kept").await;
    publish(&ch, "", &full, b"refused").await;
    let res = within("tx.commit", ch.tx_commit()).await;
    let e = assert_code(res, 406, "tx.commit with a refused publish");
    assert!(
        e.to_string().contains("partial tx completion"),
        "RabbitMQ's text: {e}"
    );
    let observer = open_channel(&conn).await;
    wait_count(&observer, &open, 1).await;
    assert_eq!(queue_counts(&observer, &full).await.0, 0);
    // A transaction whose publishes were all taken still commits on a new channel.
    let ch2 = open_channel(&conn).await;
    tx_select(&ch2).await;
    publish(&ch2, "", &open, b"second").await;
    within("tx.commit", ch2.tx_commit())
        .await
        .expect("a commit of taken publishes");
    wait_count(&observer, &open, 2).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_stays_transactional_after_commit() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let q = unique("tx-stay-q");
    declare_queue(&ch, &q).await;
    tx_select(&ch).await;
    publish(&ch, "", &q, b"kept").await;
    within("tx.commit", ch.tx_commit()).await.expect("commit");
    publish(&ch, "", &q, b"dropped").await;
    within("tx.rollback", ch.tx_rollback())
        .await
        .expect("rollback");
    publish(&ch, "", &q, b"marker").await;
    within("tx.commit", ch.tx_commit()).await.expect("commit");
    wait_count(&ch, &q, 2).await;
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"kept");
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"marker");
    assert!(get(&ch, &q, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_inside_tx_is_applied_on_commit() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let admin = open_channel(&conn).await;
    let q = unique("tx-ack-q");
    declare_queue(&admin, &q).await;
    publish(&admin, "", &q, b"m").await;
    wait_count(&admin, &q, 1).await;
    let ch = open_channel(&conn).await;
    tx_select(&ch).await;
    let m = get_some(&ch, &q, false).await;
    within(
        "basic.ack",
        ch.basic_ack(m.delivery.delivery_tag, BasicAckOptions::default()),
    )
    .await
    .expect("ack");
    within("tx.commit", ch.tx_commit()).await.expect("commit");
    within("channel.close", ch.close(200, "bye".into()))
        .await
        .expect("close");
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        queue_counts(&admin, &q).await,
        (0, 0),
        "a committed ack is final"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_inside_tx_is_discarded_on_rollback() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let admin = open_channel(&conn).await;
    let q = unique("tx-ack-rb-q");
    declare_queue(&admin, &q).await;
    publish(&admin, "", &q, b"m").await;
    wait_count(&admin, &q, 1).await;
    let ch = open_channel(&conn).await;
    tx_select(&ch).await;
    let m = get_some(&ch, &q, false).await;
    within(
        "basic.ack",
        ch.basic_ack(m.delivery.delivery_tag, BasicAckOptions::default()),
    )
    .await
    .expect("ack");
    within("tx.rollback", ch.tx_rollback())
        .await
        .expect("rollback");
    // Still unacked: closing the channel requeues it.
    within("channel.close", ch.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("message requeued after rollback + close", || {
        let admin = admin.clone();
        let q = q.clone();
        async move { queue_counts(&admin, &q).await.0 == 1 }
    })
    .await;
    let again = get_some(&admin, &q, true).await;
    assert!(again.delivery.redelivered);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_commit_without_select_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let res = within("tx.commit", ch.tx_commit()).await;
    assert_code(res, 406, "tx.commit on a non-transactional channel");
    let ch2 = open_channel(&conn).await;
    let res = within("tx.rollback", ch2.tx_rollback()).await;
    assert_code(res, 406, "tx.rollback on a non-transactional channel");
    assert!(conn.status().connected());
    node.shutdown().await;
}

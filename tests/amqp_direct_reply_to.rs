//! Direct reply-to through lapin over TCP: an RPC round trip over the pseudo-queue
//! `amq.rabbitmq.reply-to`, and RabbitMQ 3.10's errors (checked against a 3.10.8 node).

mod common;

use amq_protocol::types::{FieldTable, ShortString};
use common::*;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::options::{BasicCancelOptions, QueueDeclareOptions};
use lapin::BasicProperties;

const REPLY_QUEUE: &str = "amq.rabbitmq.reply-to";
const REPLY_PREFIX: &str = "amq.rabbitmq.reply-to.";

fn no_ack() -> BasicConsumeOptions {
    BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    }
}

fn request_properties(correlation_id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_reply_to(REPLY_QUEUE.into())
        .with_correlation_id(correlation_id.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_round_trip_goes_through_direct_reply_to() {
    let node = TestNode::start().await;
    let rpc = unique("rpc");
    // The server: its own connection, a request queue, acks.
    let (_server_conn, server) = node.channel().await;
    declare_queue(&server, &rpc).await;
    let mut requests = consume(&server, &rpc, BasicConsumeOptions::default()).await;
    let replies_ch = {
        let conn = node.connect().await;
        let ch = confirm_channel(&conn).await;
        (conn, ch)
    };
    // The client: consumes the pseudo-queue, then asks.
    let (_client_conn, client) = node.channel().await;
    let mut replies = consume_tagged(&client, REPLY_QUEUE, "replies", no_ack()).await;
    for i in 0..3 {
        let id = format!("req-{i}");
        publish_with(
            &client,
            "",
            &rpc,
            format!("question {i}").as_bytes(),
            BasicPublishOptions::default(),
            request_properties(&id),
        )
        .await;
        let req = requests.next().await;
        let reply_to = req
            .properties
            .reply_to()
            .as_ref()
            .map(ShortString::to_string)
            .expect("the request carries reply_to");
        assert!(
            reply_to.starts_with(REPLY_PREFIX) && reply_to.len() > REPLY_PREFIX.len(),
            "reply_to rewritten to the channel's reply name: {reply_to}"
        );
        let correlation = req.properties.correlation_id().clone();
        assert_eq!(correlation.as_ref().map(|c| c.as_str()), Some(id.as_str()));
        // The reply, published on a third connection, is confirmed (an ack, as RabbitMQ).
        let confirmation = publish_confirmed_with(
            &replies_ch.1,
            "",
            &reply_to,
            format!("answer {i}").as_bytes(),
            BasicPublishOptions::default(),
            BasicProperties::default().with_correlation_id(id.as_str().into()),
        )
        .await;
        assert!(confirmation.is_ack(), "a reply's confirm is an ack");
        within("ack", req.ack(BasicAckOptions::default()))
            .await
            .expect("ack the request");
        let reply = replies.next().await;
        assert_eq!(body(&reply), format!("answer {i}"));
        assert_eq!(reply.routing_key.as_str(), reply_to);
        assert_eq!(reply.exchange.as_str(), "");
        assert!(!reply.redelivered);
        assert_eq!(
            reply
                .properties
                .correlation_id()
                .as_ref()
                .map(|c| c.as_str()),
            Some(id.as_str())
        );
    }
    replies.expect_nothing(QUIET).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_consumer_that_acknowledges_closes_the_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let res = within(
        "basic.consume",
        ch.basic_consume(
            REPLY_QUEUE.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    let e = assert_code(res, 406, "consume amq.rabbitmq.reply-to with acks");
    assert!(
        e.to_string().contains("reply consumer cannot acknowledge"),
        "{e}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_reply_consumer_closes_the_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    consume(&ch, REPLY_QUEUE, no_ack()).await;
    let res = within(
        "basic.consume",
        ch.basic_consume(
            REPLY_QUEUE.into(),
            "".into(),
            no_ack(),
            FieldTable::default(),
        ),
    )
    .await;
    let e = assert_code(res, 406, "a second reply consumer");
    assert!(e.to_string().contains("reply consumer already set"), "{e}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_with_reply_to_and_no_reply_consumer_closes_the_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let rpc = unique("rpc");
    declare_queue(&ch, &rpc).await;
    let mut watch = watch_channel(&ch).await;
    publish_with(
        &ch,
        "",
        &rpc,
        b"question",
        BasicPublishOptions::default(),
        request_properties("c1"),
    )
    .await;
    expect_closed_with(
        &mut watch,
        406,
        "publish with reply_to and no reply consumer",
    )
    .await;
    let (_c2, other) = node.channel().await;
    assert_eq!(queue_counts(&other, &rpc).await, (0, 0), "not routed");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pseudo_queue_and_live_reply_names_declare_with_one_consumer() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(queue_counts(&ch, REPLY_QUEUE).await, (0, 1));
    // A live reply name exists (declared from another connection); once its consumer is
    // cancelled, it is 404.
    let mut replies = consume_tagged(&ch, REPLY_QUEUE, "r", no_ack()).await;
    let rpc = unique("rpc");
    declare_queue(&ch, &rpc).await;
    publish_with(
        &ch,
        "",
        &rpc,
        b"q",
        BasicPublishOptions::default(),
        request_properties("c"),
    )
    .await;
    let name = get_some(&ch, &rpc, true)
        .await
        .delivery
        .properties
        .reply_to()
        .as_ref()
        .map(ShortString::to_string)
        .expect("reply_to");
    let (_c2, other) = node.channel().await;
    assert_eq!(queue_counts(&other, &name).await, (0, 1));
    within(
        "basic.cancel",
        ch.basic_cancel("r".into(), BasicCancelOptions::default()),
    )
    .await
    .expect("cancel the reply consumer");
    replies.expect_cancelled().await;
    let res = within(
        "passive queue.declare",
        other.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "declare of a reply name whose consumer is gone");
    node.shutdown().await;
}

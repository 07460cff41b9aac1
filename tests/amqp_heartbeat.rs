//! Heartbeats, with a raw client and a 1 s interval to keep the tests short.

mod common;

use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel as chan, AMQPClass};
use common::*;

fn one_second() -> RawOpts {
    RawOpts {
        heartbeat: Some(1),
        ..RawOpts::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_sends_heartbeats_at_the_negotiated_interval() {
    let node = TestNode::start_with(|c| c.amqp.heartbeat_s = 1).await;
    let (mut raw, _start, tune) = RawClient::handshake(node.addr, &one_second()).await;
    assert_eq!(tune.heartbeat, 1);

    // Keep our side alive (a heartbeat every 300 ms) and count the server's for 3.5 s.
    let window = Duration::from_millis(3500);
    let start = Instant::now();
    let mut next_beat = Instant::now();
    let mut received = 0;
    while start.elapsed() < window {
        if Instant::now() >= next_beat {
            raw.send(AMQPFrame::Heartbeat).await;
            next_beat += Duration::from_millis(300);
        }
        match raw.read_frame_for(Duration::from_millis(100)).await {
            Err(()) => {}
            Ok(Some(AMQPFrame::Heartbeat)) => received += 1,
            Ok(Some(other)) => panic!("unexpected frame {other:?}"),
            Ok(None) => panic!(
                "server closed a client that sent heartbeats, after {:?}",
                start.elapsed()
            ),
        }
    }
    // At a 1 s interval a server sends one at least every second (RabbitMQ sends twice per
    // interval); an idle connection must not be flooded either.
    assert!(
        (3..=10).contains(&received),
        "received {received} heartbeats in {window:?} at a 1 s interval"
    );

    // Still fully usable.
    raw.open_channel(1).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_disconnected_after_two_missed_intervals() {
    let node = TestNode::start_with(|c| c.amqp.heartbeat_s = 1).await;
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &one_second()).await;
    // From here on the client sends nothing at all.
    let took = raw.wait_eof(Duration::from_secs(8)).await;
    assert!(
        took >= Duration::from_millis(1000),
        "closed after {took:?}: a client must be allowed to miss one interval"
    );
    assert!(
        took <= Duration::from_millis(4500),
        "closed only after {took:?}: expected about two 1 s intervals"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_traffic_other_than_heartbeats_keeps_connection_alive() {
    let node = TestNode::start_with(|c| c.amqp.heartbeat_s = 1).await;
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &one_second()).await;
    // Open/close a channel every 400 ms for 3 s instead of sending heartbeats.
    let start = Instant::now();
    let mut id = 1u16;
    while start.elapsed() < Duration::from_secs(3) {
        raw.send_method(
            id,
            AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})),
        )
        .await;
        loop {
            match raw.read_frame().await {
                Some(AMQPFrame::Heartbeat) => continue,
                Some(AMQPFrame::Method(c, AMQPClass::Channel(chan::AMQPMethod::OpenOk(_))))
                    if c == id =>
                {
                    break
                }
                Some(other) => panic!("unexpected frame {other:?}"),
                None => panic!("server closed an active client after {:?}", start.elapsed()),
            }
        }
        id += 1;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_zero_from_client_disables_server_heartbeats() {
    let node = TestNode::start_with(|c| c.amqp.heartbeat_s = 1).await;
    let opts = RawOpts {
        heartbeat: Some(0),
        ..RawOpts::default()
    };
    let (mut raw, _start, tune) = RawClient::handshake(node.addr, &opts).await;
    assert_eq!(tune.heartbeat, 1);
    // Client said 0 in tune-ok: no heartbeats, and no disconnect for silence.
    match raw.read_frame_for(Duration::from_millis(3000)).await {
        Err(()) => {}
        Ok(f) => panic!("expected silence with heartbeats disabled, got {f:?}"),
    }
    raw.open_channel(1).await;
    node.shutdown().await;
}

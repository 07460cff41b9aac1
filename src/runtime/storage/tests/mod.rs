//! Storage's tests on a `MemDisk`: rounds, recovery, sync batches, disk faults; mirror copies
//! in `copies`, kept copies caught up in `kept_copies`.

use super::syncer::block_on;
use super::*;
use crate::amqp::frame::encode_properties;
use crate::broker::queue::next_generation;
use crate::broker::{Message, PublishOutcome};
use crate::config::Config;
use crate::meta::args::QueueArgs;
use crate::meta::{Command, QueueDef};
use crate::store::MemDisk;
use crate::time::Instant;
use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;

fn data() -> PathBuf {
    PathBuf::from("/data")
}

fn broker(d: &Arc<Durability>) -> Broker {
    broker_at(d, 0)
}

fn broker_at(d: &Arc<Durability>, epoch_unix_ms: u64) -> Broker {
    let broker =
        Broker::new(&Config::default(), 1, 1 << 30, epoch_unix_ms).with_durability(d.clone());
    declare(&broker, "q");
    broker
}

/// Declares the durable queue `name`.
fn declare(broker: &Broker, name: &str) {
    broker
        .apply(
            &Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable: true,
                exclusive_owner: None,
                auto_delete: false,
                arguments: Default::default(),
                home: 0,
            }),
            Instant::default(),
        )
        .expect("declare");
}

/// Deletes the queue `name` and declares it again: a new queue handle of the name.
fn redeclare(broker: &Broker, name: &str) {
    broker
        .apply(
            &Command::DeleteQueue {
                vhost: "/".into(),
                name: name.into(),
            },
            Instant::default(),
        )
        .expect("delete");
    declare(broker, name);
}

fn publish(broker: &Broker, body: &[u8]) -> PublishOutcome {
    publish_as(broker, body, 2)
}

fn publish_as(broker: &Broker, body: &[u8], delivery_mode: u8) -> PublishOutcome {
    publish_to(broker, "q", body, delivery_mode)
}

fn publish_to(broker: &Broker, queue: &str, body: &[u8], delivery_mode: u8) -> PublishOutcome {
    let props = AMQPProperties::default().with_delivery_mode(delivery_mode);
    let m = Arc::new(Message {
        id: broker.next_message_id(),
        exchange: String::new(),
        routing_key: queue.into(),
        properties_raw: Bytes::from(encode_properties(&props)),
        properties: props,
        body: Bytes::copy_from_slice(body),
    });
    let snap = broker.snapshot();
    broker.publish(snap.vhost("/").expect("vhost"), "", m, Instant::default())
}

fn open(
    disk: &MemDisk,
) -> (
    Broker,
    Arc<Durability>,
    Arc<Storage<MemDisk>>,
    RecoverySummary,
) {
    let d = Arc::new(Durability::default());
    let b = broker(&d);
    let (s, summary) = Storage::open_with(
        disk.clone(),
        &b,
        d.clone(),
        &data(),
        &StorageConfig::default(),
        crate::time::Instant::default(),
    )
    .expect("open storage");
    // As the node does: queues read paged messages and stored bodies through storage.
    b.set_pager(s.clone());
    (b, d, s, summary)
}

fn bodies(b: &Broker) -> Vec<Vec<u8>> {
    contents(b).into_iter().map(|(body, _)| body).collect()
}

/// The queue's messages as a new master would serve them: body and redelivered flag.
fn contents(b: &Broker) -> Vec<(Vec<u8>, bool)> {
    let q = b.queue("/", "q").expect("queue");
    let mut out = Vec::new();
    let mut dead = Vec::new();
    while let Some((e, _)) = q.lock().get(Instant::default(), false, &mut dead) {
        out.push((e.message.body.to_vec(), e.redelivered));
    }
    out
}

/// Takes `n` messages of queue `q` for delivery with acks due: their seqs.
fn deliver(b: &Broker, n: usize) -> Vec<u64> {
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    (0..n)
        .map(|_| {
            let (e, _) = q
                .lock()
                .get(Instant::default(), true, &mut dead)
                .expect("a message");
            e.seq
        })
        .collect()
}

/// Acks `seqs` of queue `q`.
fn ack(b: &Broker, seqs: &[u64]) {
    let q = b.queue("/", "q").expect("queue");
    q.lock().ack(&q, seqs, Instant::default(), &mut Vec::new());
}

#[test]
fn a_sync_reads_the_live_backlog_below_its_start_in_batches() {
    let disk = MemDisk::new();
    let d = Arc::new(Durability::default());
    let b = broker(&d);
    let config = StorageConfig {
        queue_index_segment_entry_count: 8,
        ..StorageConfig::default()
    };
    let (s, _) = Storage::open_with(
        disk,
        &b,
        d,
        &data(),
        &config,
        crate::time::Instant::default(),
    )
    .expect("open");
    b.set_pager(s.clone());
    for i in 0..50u32 {
        publish(&b, &i.to_be_bytes());
    }
    assert!(s.step());
    // Ten delivered, the first five of them acked.
    let delivered = deliver(&b, 10);
    ack(&b, &delivered[..5]);
    assert!(s.step());
    let start = s.at_next_seq("/", "q", |next| next);
    assert_eq!(start, 50);
    // Later publishes are not the backlog.
    publish(&b, b"later");
    assert!(s.step());
    let (mut from, mut batches, mut got) = (0, 0, Vec::new());
    let mut cursor = SyncCursor::default();
    loop {
        let (ops, next) = s
            .sync_batch("/", "q", (from, start), 7, &mut cursor)
            .expect("a batch");
        batches += 1;
        got.extend(synced(ops));
        match next {
            Some(n) => from = n,
            None => break,
        }
    }
    let expected: Vec<(u64, Vec<u8>, bool)> = (5..50u32)
        .map(|i| (i as u64, i.to_be_bytes().to_vec(), i < 10))
        .collect();
    assert_eq!(
        got, expected,
        "the live backlog, in order, delivered ones marked"
    );
    assert_eq!(batches, 45usize.div_ceil(7), "batches of at most 7");
}

/// The publishes (seq, body, delivered) of a batch's operations.
fn synced(ops: Vec<IndexOp>) -> Vec<(u64, Vec<u8>, bool)> {
    let mut got: Vec<(u64, Vec<u8>, bool)> = Vec::new();
    for op in ops {
        match op {
            IndexOp::Publish { seq, message, .. } => got.push((seq, message.body.to_vec(), false)),
            IndexOp::Deliver { seq } => {
                let last = got.last_mut().expect("a deliver follows its publish");
                assert_eq!(last.0, seq);
                last.2 = true;
            }
            other => panic!("not a sync operation: {other:?}"),
        }
    }
    got
}

#[test]
fn a_sync_reads_each_segment_once_and_batches_what_is_live_when_each_is_made() {
    let disk = MemDisk::new();
    let d = Arc::new(Durability::default());
    let b = broker(&d);
    let config = StorageConfig {
        queue_index_segment_entry_count: 16,
        ..StorageConfig::default()
    };
    let (s, _) =
        Storage::open_with(disk, &b, d, &data(), &config, Instant::default()).expect("open");
    b.set_pager(s.clone());
    for i in 0..48u32 {
        publish(&b, &i.to_be_bytes());
    }
    assert!(s.step());
    let mut cursor = SyncCursor::default();
    let reads = s.segment_reads("/", "q");
    // The first batch reads segment 0 (seqs 0-15) and takes 0-4.
    let (ops, next) = s
        .sync_batch("/", "q", (0, 48), 5, &mut cursor)
        .expect("a batch");
    assert_eq!(synced(ops).len(), 5);
    assert_eq!(next, Some(5));
    // Then seqs 0-7 are delivered and the first seven acked: 5 and 6 go, 7 is delivered.
    let delivered = deliver(&b, 8);
    ack(&b, &delivered[..7]);
    assert!(s.step());
    let (ops, next) = s
        .sync_batch("/", "q", (5, 48), 5, &mut cursor)
        .expect("a batch");
    let expected: Vec<(u64, Vec<u8>, bool)> = (7..12u32)
        .map(|i| (i as u64, i.to_be_bytes().to_vec(), i == 7))
        .collect();
    assert_eq!(
        synced(ops),
        expected,
        "what was acked since the segment was read is left out, what was delivered is marked"
    );
    let mut from = next.expect("more");
    let mut rest = Vec::new();
    loop {
        let (ops, next) = s
            .sync_batch("/", "q", (from, 48), 5, &mut cursor)
            .expect("a batch");
        rest.extend(synced(ops));
        match next {
            Some(n) => from = n,
            None => break,
        }
    }
    let expected: Vec<(u64, Vec<u8>, bool)> = (12..48u32)
        .map(|i| (i as u64, i.to_be_bytes().to_vec(), false))
        .collect();
    assert_eq!(rest, expected);
    assert_eq!(
        s.segment_reads("/", "q") - reads,
        3,
        "each of the three segments read once over ten batches"
    );
    // A batch asked from elsewhere than the last one stopped reads again.
    let (ops, _) = s
        .sync_batch("/", "q", (40, 48), 2, &mut cursor)
        .expect("a batch");
    let (again, _) = s
        .sync_batch("/", "q", (0, 48), 2, &mut cursor)
        .expect("a batch");
    assert_eq!(
        synced(ops).iter().map(|m| m.0).collect::<Vec<_>>(),
        [40, 41]
    );
    assert_eq!(
        synced(again).iter().map(|m| m.0).collect::<Vec<_>>(),
        [7, 8]
    );
}

#[test]
fn a_sync_batch_stops_before_the_message_that_would_pass_its_byte_limit() {
    let disk = MemDisk::new();
    let d = Arc::new(Durability::default());
    let b = broker(&d);
    let (s, _) = Storage::open_with(
        disk,
        &b,
        d,
        &data(),
        &StorageConfig::default(),
        crate::time::Instant::default(),
    )
    .expect("open");
    b.set_pager(s.clone());
    // 1.5 MiB, 5 MiB (bigger than a batch: alone), then more of 1.5 MiB and 1 KiB.
    let sizes = [
        1536 << 10,
        1536 << 10,
        5 << 20,
        1536 << 10,
        1 << 10,
        1536 << 10,
    ];
    for (i, n) in sizes.iter().enumerate() {
        publish(&b, &vec![i as u8; *n]);
    }
    assert!(s.step());
    let (mut from, mut got) = (0, Vec::new());
    let mut cursor = SyncCursor::default();
    loop {
        let (ops, next) = s
            .sync_batch("/", "q", (from, 100), 1000, &mut cursor)
            .expect("a batch");
        let bodies: Vec<usize> = ops
            .iter()
            .map(|op| match op {
                IndexOp::Publish { message, .. } => message.body.len(),
                other => panic!("not a sync publish: {other:?}"),
            })
            .collect();
        got.push(bodies);
        match next {
            Some(n) => from = n,
            None => break,
        }
    }
    for batch in &got {
        assert!(
            batch.len() == 1 || batch.iter().sum::<usize>() <= SYNC_BATCH_BYTES,
            "a batch over {SYNC_BATCH_BYTES} bytes holds one message: {got:?}"
        );
    }
    let all: Vec<usize> = got.concat();
    assert_eq!(all, sizes, "every message once, in order");
    assert_eq!(
        got.len(),
        3,
        "[1.5, 1.5], [5], [1.5, 0.001, 1.5] MiB: {got:?}"
    );
}

/// Pipelined rounds complete in the order written: a round with no laps of its own
/// waits for an earlier round's, and an earlier round's failed lap refuses its own
/// confirms only.
#[test]
fn pipelined_rounds_complete_in_order_and_a_failed_lap_refuses_only_its_round() {
    let disk = MemDisk::new();
    let (b, d, s, _) = open(&disk);
    declare(&b, "plain");
    // Queue "q" is mirrored: its rounds wait for a lap the test completes.
    type Laps = Vec<tokio::sync::oneshot::Sender<bool>>;
    let laps: Arc<Mutex<Laps>> = Arc::default();
    let senders = laps.clone();
    s.set_ops_tap(Some(Arc::new(move |(_, queue), _| {
        if queue != "q" {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        senders.lock().unwrap_or_else(|e| e.into_inner()).push(tx);
        Some(Box::pin(async move { rx.await.unwrap_or(false) }) as LapWait)
    })));
    let mirrored = publish_to(&b, "q", b"m1", 2).ticket;
    let first = s.write_round().expect("write").expect("waits for its lap");
    let plain = publish_to(&b, "plain", b"p1", 2).ticket;
    assert!(
        s.write_round().expect("write").is_none(),
        "no laps of its own"
    );
    assert_eq!(s.rounds_in_flight(), 2, "but it waits for the first round");
    assert!(!d.is_durable(plain), "not before the earlier round");
    let mirrored_again = publish_to(&b, "q", b"m2", 2).ticket;
    let third = s.write_round().expect("write").expect("waits for its lap");
    // The first round's lap fails (its master was deposed).
    let lap = laps.lock().unwrap_or_else(|e| e.into_inner()).remove(0);
    let _ = lap.send(false);
    let (round, ok) = block_on(first.wait());
    assert!(!ok);
    s.laps_done(round, ok);
    assert!(d.is_refused(mirrored), "its confirm is a nack");
    assert!(
        d.is_durable(plain) && !d.is_refused(plain),
        "the round after it waited only for it: confirmed"
    );
    assert!(!d.is_durable(mirrored_again), "its own lap is still out");
    let lap = laps.lock().unwrap_or_else(|e| e.into_inner()).remove(0);
    let _ = lap.send(true);
    let (round, ok) = block_on(third.wait());
    s.laps_done(round, ok);
    assert!(d.is_durable(mirrored_again) && !d.is_refused(mirrored_again));
    assert_eq!(s.rounds_in_flight(), 0);
    // With nothing out, a lap-less round is durable at once.
    let again = publish_to(&b, "plain", b"p2", 2).ticket;
    assert!(s.write_round().expect("write").is_none());
    assert!(d.is_durable(again));
}

#[test]
fn confirmed_writes_survive_power_loss_in_order() {
    let disk = MemDisk::new();
    let (b, d, s, _) = open(&disk);
    let big = vec![7u8; 10_000];
    let tickets: Vec<u64> = [b"one".to_vec(), big.clone(), b"three".to_vec()]
        .iter()
        .map(|body| publish(&b, body).ticket)
        .collect();
    assert!(tickets.iter().all(|t| *t > 0 && !d.is_durable(*t)));
    assert!(s.step());
    assert!(
        tickets.iter().all(|t| d.is_durable(*t)),
        "one round makes them durable"
    );
    disk.crash();
    let (b2, _, _, summary) = open(&disk);
    assert_eq!((summary.messages, summary.lost), (3, 0));
    assert_eq!(bodies(&b2), vec![b"one".to_vec(), big, b"three".to_vec()]);
}

#[test]
fn writes_not_yet_synced_are_lost_but_were_never_confirmed() {
    let disk = MemDisk::new();
    let (b, d, s, _) = open(&disk);
    let t = publish(&b, b"kept").ticket;
    assert!(s.step() && d.is_durable(t));
    let t2 = publish(&b, b"in flight").ticket;
    assert!(
        !d.is_durable(t2),
        "no round ran: its confirm is still held back"
    );
    disk.crash();
    let (b2, _, _, _) = open(&disk);
    assert_eq!(bodies(&b2), vec![b"kept".to_vec()]);
}

#[test]
fn acked_messages_do_not_come_back() {
    let disk = MemDisk::new();
    let (b, _, s, _) = open(&disk);
    for body in [b"a", b"b", b"c"] {
        publish(&b, body);
    }
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    let (first, _) = q
        .lock()
        .get(Instant::default(), true, &mut dead)
        .expect("a");
    q.lock()
        .ack(&q, &[first.seq], Instant::default(), &mut dead);
    assert!(s.step());
    s.close();
    let (b2, _, _, summary) = open(&disk);
    assert!(summary.clean, "a clean close is recognised");
    assert_eq!(bodies(&b2), vec![b"b".to_vec(), b"c".to_vec()]);
}

#[test]
fn a_queue_emptied_before_a_restart_takes_new_persistent_messages() {
    let disk = MemDisk::new();
    let (b, _, s, _) = open(&disk);
    publish(&b, b"gone");
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    q.lock().get(Instant::default(), false, &mut dead);
    assert!(s.step());
    s.close();
    // The index remembers seq 0; the recovered queue must not hand it out again.
    let (b2, d2, s2, _) = open(&disk);
    let t = publish(&b2, b"new").ticket;
    assert!(s2.step(), "storage accepts the new message");
    assert!(d2.is_durable(t));
    s2.close();
    let (b3, _, _, _) = open(&disk);
    assert_eq!(bodies(&b3), vec![b"new".to_vec()]);
}

#[test]
fn deleting_a_queue_releases_its_stored_bodies_at_once() {
    let disk = MemDisk::new();
    let (b, _, s, _) = open(&disk);
    for _ in 0..3 {
        publish(&b, &vec![5u8; 20_000]);
    }
    assert!(s.step());
    let stored = |s: &Storage<MemDisk>| {
        let g = s.state.lock().expect("state");
        g.as_ref().map(|st| st.msg_store.len()).expect("open")
    };
    assert_eq!(stored(&s), 3, "large bodies live in the message store");
    b.apply(
        &Command::DeleteQueue {
            vhost: "/".into(),
            name: "q".into(),
        },
        Instant::default(),
    )
    .expect("delete");
    assert!(s.step());
    assert_eq!(stored(&s), 0, "no body outlives its queue until a restart");
}

#[test]
fn a_full_disk_stops_storage_and_nothing_is_confirmed() {
    let disk = MemDisk::new();
    let (b, d, s, _) = open(&disk);
    assert!(s.step());
    disk.set_capacity(Some(disk_used(&disk) + 100));
    let t = publish(&b, &vec![1u8; 50_000]).ticket;
    assert!(!s.step(), "the write does not fit");
    assert!(d.has_failed(), "storage reports the failure (alarm, nacks)");
    assert!(!d.is_durable(t), "the failed write is never marked durable");
}

#[test]
fn a_failed_fsync_is_fatal() {
    let disk = MemDisk::new();
    let (b, d, s, _) = open(&disk);
    publish(&b, &vec![2u8; 9000]);
    disk.fail_next_sync();
    assert!(!s.step());
    assert!(d.has_failed());
}

#[test]
fn expiry_survives_a_restart_as_wall_clock_time() {
    let disk = MemDisk::new();
    let d = Arc::new(Durability::default());
    let b = broker_at(&d, 1_000_000);
    let (s, _) = Storage::open_with(
        disk.clone(),
        &b,
        d.clone(),
        &data(),
        &StorageConfig::default(),
        crate::time::Instant::default(),
    )
    .expect("open");
    let props = AMQPProperties::default()
        .with_delivery_mode(2)
        .with_expiration("60000".into());
    let m = Arc::new(Message {
        id: b.next_message_id(),
        exchange: String::new(),
        routing_key: "q".into(),
        properties_raw: Bytes::from(encode_properties(&props)),
        properties: props,
        body: Bytes::from_static(b"ttl"),
    });
    let snap = b.snapshot();
    b.publish(
        snap.vhost("/").expect("vhost"),
        "",
        m,
        Instant::from_millis(0),
    );
    assert!(s.step());
    s.close();
    // The next start is 50 s later on the wall clock: 10 s of the TTL are left.
    let d2 = Arc::new(Durability::default());
    let b2 = broker_at(&d2, 1_050_000);
    Storage::open_with(
        disk.clone(),
        &b2,
        d2,
        &data(),
        &StorageConfig::default(),
        crate::time::Instant::default(),
    )
    .expect("reopen");
    let q = b2.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    let (e, _) = q
        .lock()
        .get(Instant::from_millis(0), false, &mut dead)
        .expect("message");
    assert_eq!(e.expires_at_ms, 10_000);
}

fn disk_used(disk: &MemDisk) -> u64 {
    let mut total = 0;
    let mut dirs = vec![data()];
    dirs.push(data().join("msg_store_persistent"));
    dirs.push(data().join("queues").join(queue_dir_name("/", "q")));
    for dir in dirs {
        for n in disk.list(&dir).unwrap_or_default() {
            total += disk.len(&dir.join(n)).ok().flatten().unwrap_or(0);
        }
    }
    total
}

mod copies;
mod kept_copies;

//! Storage's tests on a `MemDisk`: rounds, recovery, mirror copies, sync batches, disk faults.

use super::syncer::block_on;
use super::*;
use crate::amqp::frame::encode_properties;
use crate::broker::queue::next_generation;
use crate::broker::PublishOutcome;
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
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    let mut delivered = Vec::new();
    for _ in 0..10 {
        let (e, _) = q
            .lock()
            .get(Instant::default(), true, &mut dead)
            .expect("a message");
        delivered.push(e.seq);
    }
    q.lock()
        .ack(&q, &delivered[..5], Instant::default(), &mut dead);
    assert!(s.step());
    let start = s.at_next_seq("/", "q", |next| next);
    assert_eq!(start, 50);
    // Later publishes are not the backlog.
    publish(&b, b"later");
    assert!(s.step());
    let (mut from, mut batches, mut got) = (0, 0, Vec::new());
    loop {
        let (ops, next) = s
            .sync_batch("/", "q", from, start, 7, |ops, next| (ops, next))
            .expect("a batch");
        batches += 1;
        for op in ops {
            match op {
                IndexOp::Publish { seq, message, .. } => {
                    got.push((seq, message.body.to_vec(), false))
                }
                IndexOp::Deliver { seq } => {
                    let last = got.last_mut().expect("a deliver follows its publish");
                    assert_eq!(last.0, seq);
                    last.2 = true;
                }
                other => panic!("not a sync operation: {other:?}"),
            }
        }
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
    loop {
        let (ops, next) = s
            .sync_batch("/", "q", from, 100, 1000, |ops, next| (ops, next))
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

#[test]
fn a_mirror_fed_the_masters_operations_recovers_the_masters_queue() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let (_, _, mirror, _) = open(&mirror_disk);
    // What the master ships: each round's operations, on the wire (as a GM broadcast
    // would carry them).
    type Shipped = Vec<(String, String, Vec<u8>)>;
    let shipped: Arc<Mutex<Shipped>> = Arc::default();
    let tap = shipped.clone();
    s.set_ops_tap(Some(Arc::new(move |(vhost, queue), ops| {
        tap.lock().unwrap_or_else(|e| e.into_inner()).push((
            vhost.clone(),
            queue.clone(),
            crate::mirror::ops::encode(ops),
        ));
        None
    })));
    let big = vec![9u8; 10_000];
    for body in [b"a".to_vec(), big.clone(), b"c".to_vec(), b"d".to_vec()] {
        publish(&b, &body);
    }
    assert!(s.step());
    // Two deliveries awaiting acks; the first is acked.
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    let (first, _) = q
        .lock()
        .get(Instant::default(), true, &mut dead)
        .expect("a");
    q.lock()
        .get(Instant::default(), true, &mut dead)
        .expect("big");
    q.lock()
        .ack(&q, &[first.seq], Instant::default(), &mut dead);
    publish(&b, b"e");
    assert!(s.step());
    let batches = std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner()));
    assert!(
        batches.len() >= 2,
        "one batch per round that wrote the queue"
    );
    let mut started = std::collections::BTreeSet::new();
    for (vhost, queue, bytes) in batches {
        if started.insert((vhost.clone(), queue.clone())) {
            mirror
                .start_copy(&vhost, &queue, 1, next_generation())
                .expect("a copy starts");
        }
        let ops = crate::mirror::ops::decode(&bytes).expect("a batch decodes");
        mirror
            .apply_mirrored(&vhost, &queue, 1, ops)
            .expect("the mirror writes");
    }
    // Both nodes lose power; each reopens what it fsynced.
    master_disk.crash();
    mirror_disk.crash();
    let (master_again, _, _, _) = open(&master_disk);
    let (promoted, _, _, summary) = open(&mirror_disk);
    // After an unclean stop any message may have gone out unrecorded: all of them
    // come back `redelivered` (the delivered, unacked one would anyway).
    let expected = vec![
        (big, true),
        (b"c".to_vec(), true),
        (b"d".to_vec(), true),
        (b"e".to_vec(), true),
    ];
    assert_eq!(
        contents(&master_again),
        expected,
        "the master's own recovery"
    );
    assert_eq!(contents(&promoted), expected, "the mirror's copy");
    assert_eq!((summary.messages, summary.lost), (4, 0));
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

/// Keeps every round `s` writes, encoded as shipped, instead of shipping it.
fn capture_rounds(s: &Storage<MemDisk>) -> Arc<Mutex<Vec<Vec<u8>>>> {
    let shipped: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let tap = shipped.clone();
    s.set_ops_tap(Some(Arc::new(move |_, ops| {
        let mut t = tap.lock().unwrap_or_else(|e| e.into_inner());
        t.push(crate::mirror::ops::encode(ops));
        None
    })));
    shipped
}

/// A broker on node 1 following metadata in which `q` (durable, home node 2) is mirrored
/// on node 1, synchronised; with `promoted`, node 1's mirror was then promoted (the
/// broker leaves the queue to be adopted). The set's incarnation too.
fn mirror_broker(d: &Arc<Durability>, promoted: bool) -> (Broker, u64) {
    let broker = node1_broker(d);
    let mut state = mirror_state(&broker);
    broker.follow(Arc::new(state.clone()), Instant::default());
    if promoted {
        promote(&mut state);
        broker.follow(Arc::new(state.clone()), Instant::default());
    }
    assert!(broker.queue("/", "q").is_none(), "no queue of its own here");
    let key = ("/".to_string(), "q".to_string());
    (broker, state.mirror_sets[&key].incarnation)
}

/// A broker on node 1 that starts from metadata in which node 1's mirror of `q` was
/// promoted already (as a node restarting after the promotion committed): it runs `q`.
fn restarted_master_broker(d: &Arc<Durability>) -> Broker {
    let broker = node1_broker(d);
    let mut state = mirror_state(&broker);
    promote(&mut state);
    broker.follow(Arc::new(state), Instant::default());
    assert!(broker.queue("/", "q").is_some(), "the queue runs here");
    broker
}

fn node1_broker(d: &Arc<Durability>) -> Broker {
    Broker::new(&Config::default(), 1, 1 << 30, 0)
        .with_node_id(1)
        .with_durability(d.clone())
}

fn promote(state: &mut crate::meta::MetaState) {
    state
        .apply(&Command::PromoteMirror {
            vhost: "/".into(),
            queue: "q".into(),
            expected_epoch: 0,
            node: 1,
        })
        .expect("promote");
}

/// `broker`'s metadata with `q` (durable, home node 2) mirrored on node 1, synchronised.
fn mirror_state(broker: &Broker) -> crate::meta::MetaState {
    let mut state = (*broker.snapshot()).clone();
    let node = |id| {
        Command::RegisterNode(crate::meta::NodeRecord {
            id,
            name: format!("n{id}"),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        })
    };
    for c in [
        node(1),
        node(2),
        Command::DeclareQueue(QueueDef {
            vhost: "/".into(),
            name: "q".into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Default::default(),
            home: 2,
        }),
        Command::SetMirrors {
            vhost: "/".into(),
            queue: "q".into(),
            expected_version: 0,
            mirrors: vec![crate::meta::state::MirrorRecord {
                node: 1,
                since: 0,
                synchronised: true,
            }],
        },
    ] {
        state.apply(&c).expect("metadata");
    }
    state
}

/// Storage over `disk` for `broker`, with the default config.
fn open_for(
    disk: &MemDisk,
    broker: &Broker,
    d: Arc<Durability>,
) -> (Arc<Storage<MemDisk>>, RecoverySummary) {
    Storage::open_with(
        disk.clone(),
        broker,
        d,
        &data(),
        &StorageConfig::default(),
        Instant::default(),
    )
    .expect("open storage")
}

/// A mirror node's broker and storage over `disk` (node 1: the queue's mirror, or with
/// `promoted` its master), and the queue's incarnation.
fn open_mirror(disk: &MemDisk, promoted: bool) -> (Broker, Arc<Storage<MemDisk>>, u64) {
    let d = Arc::new(Durability::default());
    let (mb, incarnation) = mirror_broker(&d, promoted);
    let (storage, _) = open_for(disk, &mb, d);
    (mb, storage, incarnation)
}

/// Writes every round the master shipped so far (and takes them) to the mirror's copy of
/// `incarnation`.
fn write_shipped(mirror: &Storage<MemDisk>, incarnation: u64, shipped: &Mutex<Vec<Vec<u8>>>) {
    for round in std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner())) {
        let ops = crate::mirror::ops::decode(&round).expect("a batch decodes");
        mirror
            .apply_mirrored("/", "q", incarnation, ops)
            .expect("the mirror writes");
    }
}

/// A mirror promoted while its node was down or catching up (the promotion commits
/// before the node's restart re-registers it) finds itself the queue's master at start:
/// storage recovers its copy as the queue, bodies included, if the copy is of the
/// queue's present incarnation; a stale copy of the name is dropped. Before, every
/// copy was pruned at start and the promoted queue came up empty (a whole-cluster
/// SIGTERM lost every confirmed message, `tests/mirroring.rs`).
#[test]
fn a_copy_promoted_while_its_node_was_starting_is_recovered_as_the_queue() {
    for stale in [false, true] {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let shipped = capture_rounds(&s);
        let big = vec![7u8; 10_000];
        for body in [b"a".to_vec(), big.clone()] {
            publish(&b, &body);
        }
        assert!(s.step());
        let d = Arc::new(Durability::default());
        let (mirror_b, incarnation) = mirror_broker(&d, false);
        let (mirror, _) = open_for(&mirror_disk, &mirror_b, d);
        let copy_of = if stale { incarnation + 1 } else { incarnation };
        mirror
            .start_copy("/", "q", copy_of, next_generation())
            .expect("a copy starts");
        for round in shipped.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let ops = crate::mirror::ops::decode(round).expect("a batch decodes");
            mirror
                .apply_mirrored("/", "q", copy_of, ops)
                .expect("the mirror writes");
        }
        mirror_disk.crash();
        let d = Arc::new(Durability::default());
        let (promoted, _) = mirror_broker(&d, true);
        let (storage, summary) = open_for(&mirror_disk, &promoted, d);
        if stale {
            assert!(
                promoted.queue("/", "q").is_none(),
                "a stale copy is not the queue"
            );
            assert_eq!(summary.messages, 0);
            continue;
        }
        promoted.set_pager(storage);
        assert_eq!(summary.messages, 2);
        let got: Vec<(usize, u8, bool)> = contents(&promoted)
            .into_iter()
            .map(|(body, redelivered)| (body.len(), body[0], redelivered))
            .collect();
        assert_eq!(
            got,
            [(1, b'a', true), (big.len(), 7, true)],
            "the copy is the queue, stored bodies too; its messages may have gone out \
             unrecorded"
        );
    }
}

/// A copy belongs to one incarnation of its queue (issue 16): another incarnation's
/// mirror can neither write to it nor drop it, and a queue of this node declared under
/// the same name drops a stale copy before its first write, after which the stale
/// mirror can touch neither.
#[test]
fn a_copy_is_its_incarnations_and_a_new_queue_of_its_name_replaces_it() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let (mirror_b, _, mirror, _) = open(&mirror_disk);
    let shipped = capture_rounds(&s);
    publish(&b, b"old");
    assert!(s.step());
    let rounds = std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner()));
    let ops = || crate::mirror::ops::decode(&rounds[0]).expect("a batch decodes");
    let write = |incarnation| mirror.apply_mirrored("/", "q", incarnation, ops());
    assert!(
        matches!(write(1), Err(StorageError::NotOurCopy { .. })),
        "no copy started"
    );
    mirror
        .start_copy("/", "q", 1, next_generation())
        .expect("a copy starts");
    write(1).expect("the copy's own incarnation writes");
    assert!(matches!(write(2), Err(StorageError::NotOurCopy { .. })));
    mirror.drop_copy("/", "q", 2).expect("drop");
    write(1).expect("another incarnation's drop left the copy alone");
    // This node's own queue `q`, declared again here after the copy started, writes: the
    // stale copy goes.
    redeclare(&mirror_b, "q");
    publish(&mirror_b, b"new");
    assert!(mirror.step());
    assert!(
        matches!(write(1), Err(StorageError::NotOurCopy { .. })),
        "the stale mirror cannot write into the new queue"
    );
    mirror.drop_copy("/", "q", 1).expect("drop");
    mirror_disk.crash();
    let (again, _, _, _) = open(&mirror_disk);
    assert_eq!(
        bodies(&again),
        [b"new".to_vec()],
        "the new queue holds its own message, none of the old copy's"
    );
}

/// Bug 18 (chaos seed 2130, CI seed 16): a deposed master's queue handle still had
/// operations waiting for a round (a delivery of a message written in an earlier round, and
/// a publish) when its node started a copy as the new master's mirror. The round took them
/// for a new queue replacing a stale copy: it removed the copy, applied the delivery to an
/// empty index, failed, and the node stopped (code 74). They are the old queue's: they
/// must leave the copy alone, and the publish among them is refused, never confirmed.
/// Both orders: the handle closed (moved away) before the copy started, and still open
/// (the broker has not applied the move yet).
#[test]
fn a_deposed_masters_last_operations_leave_its_nodes_new_mirror_copy_alone() {
    for moved_away in [true, false] {
        let (master_disk, disk) = (MemDisk::new(), MemDisk::new());
        let (b, d, s, _) = open(&disk);
        for body in [b"a", b"b"] {
            publish(&b, body);
        }
        assert!(s.step());
        // Waiting for the next round: a delivery of "a" and a new publish.
        let q = b.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        assert!(q.lock().get(Instant::default(), false, &mut dead).is_some());
        let late = publish(&b, b"c").ticket;
        assert!(late > 0 && !d.is_durable(late));
        if moved_away {
            q.lock().move_away(&q);
        }
        // This node now mirrors the queue (its new master is elsewhere).
        s.start_copy("/", "q", 1, next_generation())
            .expect("a copy starts");
        assert!(s.step(), "storage still works (moved away: {moved_away})");
        assert!(
            d.is_refused(late),
            "the deposed master's late publish is nacked (moved away: {moved_away})"
        );
        // The copy is intact: the new master's rounds go on being written to it.
        let (mb, _, ms, _) = open(&master_disk);
        let shipped = capture_rounds(&ms);
        publish(&mb, b"x");
        assert!(ms.step());
        write_shipped(&s, 1, &shipped);
        assert!(s.step());
    }
}

/// Bug 19 (chaos seed 2220): a mirror's node stopped cleanly just after the queue was
/// handed over to it, before it adopted its copy; it started again as the queue's home and
/// recovered the copy as its own queue, clean, so messages the old master had delivered
/// unrecorded came back without `redelivered`. A copy recovered as the queue is suspect
/// as at any promotion, and that stays on disk: a second clean restart still flags those
/// messages, and only those (one published after the first restart is not).
#[test]
fn a_copy_recovered_as_its_nodes_queue_after_a_clean_stop_flags_its_messages() {
    let (master_disk, disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let shipped = capture_rounds(&s);
    for body in [b"a", b"b"] {
        publish(&b, body);
    }
    assert!(s.step());
    let (_mb, mirror, incarnation) = open_mirror(&disk, false);
    mirror
        .start_copy("/", "q", incarnation, next_generation())
        .expect("a copy starts");
    write_shipped(&mirror, incarnation, &shipped);
    mirror.close();
    let reopen = || {
        let d = Arc::new(Durability::default());
        let broker = restarted_master_broker(&d);
        let (storage, summary) = open_for(&disk, &broker, d);
        broker.set_pager(storage.clone());
        (broker, storage, summary)
    };
    let (broker, storage, summary) = reopen();
    assert!(summary.clean && summary.messages == 2, "{summary:?}");
    publish(&broker, b"c");
    assert!(storage.step());
    storage.close();
    let (broker, _, summary) = reopen();
    assert!(summary.clean && summary.messages == 3, "{summary:?}");
    assert_eq!(
        contents(&broker),
        [
            (b"a".to_vec(), true),
            (b"b".to_vec(), true),
            (b"c".to_vec(), false)
        ]
    );
}

/// After an unclean stop every recovered message is suspect; a clean restart after that
/// one must not forget it.
#[test]
fn messages_suspect_after_a_crash_stay_flagged_across_a_clean_restart() {
    let disk = MemDisk::new();
    let (b, _, s, _) = open(&disk);
    publish(&b, b"a");
    assert!(s.step());
    disk.crash();
    let (b, _, s, summary) = open(&disk);
    assert!(!summary.clean);
    publish(&b, b"b");
    assert!(s.step());
    s.close();
    let (b, _, _, summary) = open(&disk);
    assert!(summary.clean);
    assert_eq!(
        contents(&b),
        [(b"a".to_vec(), true), (b"b".to_vec(), false)]
    );
}

#[test]
fn a_mirrored_queues_transient_messages_reach_its_mirror_and_a_promoted_copy_keeps_them() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let (mirror_b, _, mirror, _) = open(&mirror_disk);
    let shipped = capture_rounds(&s);
    let q = b.queue("/", "q").expect("queue");
    // Not mirrored: a transient message has no record, so its confirm waits for nothing.
    assert_eq!(publish_as(&b, b"before", 1).ticket, 0);
    let mut dead = Vec::new();
    q.lock().get(Instant::default(), false, &mut dead);
    // An `ha-mode` policy applies: every message is recorded.
    let args = QueueArgs {
        mirrored: true,
        ..q.lock().args().clone()
    };
    q.lock().set_args(args, &mut dead);
    let big = vec![7u8; 10_000];
    assert_ne!(
        publish_as(&b, b"t1", 1).ticket,
        0,
        "a transient confirm waits"
    );
    publish_as(&b, b"p1", 2);
    publish_as(&b, &big, 1);
    assert!(s.step());
    let (t1, _) = q
        .lock()
        .get(Instant::default(), true, &mut dead)
        .expect("t1");
    assert_eq!(&t1.message.body[..], b"t1");
    q.lock().ack(&q, &[t1.seq], Instant::default(), &mut dead);
    publish_as(&b, b"t2", 1);
    assert!(!q.lock().holds_unindexed());
    assert!(s.step());
    mirror
        .start_copy("/", "q", 1, next_generation())
        .expect("a copy starts");
    for bytes in std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner())) {
        let ops = crate::mirror::ops::decode(&bytes).expect("a batch decodes");
        mirror
            .apply_mirrored("/", "q", 1, ops)
            .expect("the mirror writes");
    }
    // The mirror's copy becomes the queue: transient messages and all.
    let h = mirror_b.queue("/", "q").expect("queue");
    mirror.adopt(&h, 1).expect("adopt");
    let expected = vec![
        (b"p1".to_vec(), true),
        (big.clone(), true),
        (b"t2".to_vec(), true),
    ];
    assert_eq!(contents(&mirror_b), expected, "the promoted copy");
    // The master's node restarting drops its transient messages, as RabbitMQ's does.
    master_disk.crash();
    let (again, _, _, _) = open(&master_disk);
    assert_eq!(contents(&again), vec![(b"p1".to_vec(), true)]);
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

/// Issue 16, *Mirrors keep their data*: a mirror's copy survives its node's crash, and
/// the next sync compares it with the master's digest instead of copying it whole. What
/// the master acked meanwhile leaves the copy, deliveries are recorded, and only the
/// messages published while the mirror was down are sent (from the copy's next seq); the
/// copy promoted then is the master's queue. A copy that differs below its end (a message
/// the master holds that the copy does not, or another one at the same seq) is refused,
/// and one with seqs past the master's start is started empty.
#[test]
fn a_kept_copy_catches_up_only_what_it_missed() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let shipped = capture_rounds(&s);
    let body = |i: u32| {
        let mut v = i.to_be_bytes().to_vec();
        // Every fourth one stored in the message store, the rest in the index.
        if i.is_multiple_of(4) {
            v.resize(10_000, i as u8);
        }
        v
    };
    for i in 0..30u32 {
        publish(&b, &body(i));
    }
    assert!(s.step());
    let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
    mirror
        .start_copy("/", "q", incarnation, next_generation())
        .expect("a copy starts");
    write_shipped(&mirror, incarnation, &shipped);
    // The mirror's node dies; meanwhile the master delivers ten, acks five of them, and
    // takes ten more.
    mirror_disk.crash();
    let q = b.queue("/", "q").expect("queue");
    let mut dead = Vec::new();
    let mut delivered = Vec::new();
    for _ in 0..10 {
        let (e, _) = q
            .lock()
            .get(Instant::default(), true, &mut dead)
            .expect("a message");
        delivered.push(e.seq);
    }
    q.lock()
        .ack(&q, &delivered[..5], Instant::default(), &mut dead);
    for i in 30..40u32 {
        publish(&b, &body(i));
    }
    assert!(s.step());
    let from_seq = s.at_next_seq("/", "q", |next| next);
    assert_eq!(from_seq, 40);

    // Restarted: the copy is kept, joining leaves it as it is, and the sync resumes it.
    let (_, mirror, _) = open_mirror(&mirror_disk, false);
    mirror
        .begin_copy("/", "q", incarnation, next_generation())
        .expect("the kept copy stays");
    let copy_next = mirror
        .resume_copy("/", "q", incarnation, from_seq, next_generation())
        .expect("resume")
        .expect("the copy kept from the last run is resumed");
    assert_eq!(copy_next, 30);
    // The master summarises what the copy may hold, [0, copy_next), in spans of seven.
    let summary = |from: u64| {
        s.sync_summary("/", "q", from, copy_next, 7, |summary, next| {
            (summary, next)
        })
        .expect("a summary")
    };
    // Another message at a seq the copy holds (another hash): refused, nothing changed.
    let (mut forged, _) = summary(0);
    forged.hash[0] ^= 1;
    assert!(!mirror
        .reconcile_summary("/", "q", incarnation, &forged)
        .expect("compare"));
    // The real summaries.
    let (mut lo, mut batches) = (0, 0);
    loop {
        let (range, next) = summary(lo);
        assert_eq!((range.lo, range.hi), (lo, next.unwrap_or(copy_next)));
        batches += 1;
        assert!(
            mirror
                .reconcile_summary("/", "q", incarnation, &range)
                .expect("compare"),
            "the copy holds everything the master holds below {copy_next}"
        );
        match next {
            Some(n) => lo = n,
            None => break,
        }
    }
    assert_eq!(batches, 30usize.div_ceil(7));
    // Only what the mirror missed is sent.
    let (ops, next) = s
        .sync_batch("/", "q", copy_next, from_seq, 1000, |ops, next| (ops, next))
        .expect("a batch");
    assert_eq!(next, None);
    let sent: Vec<u64> = ops
        .iter()
        .filter_map(|o| match o {
            IndexOp::Publish { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect();
    assert_eq!(sent, (30..40).collect::<Vec<u64>>());
    mirror
        .apply_mirrored("/", "q", incarnation, ops)
        .expect("the mirror writes");
    mirror_disk.crash();
    let (promoted, storage, _) = open_mirror(&mirror_disk, true);
    promoted.set_pager(storage);
    let got: Vec<Vec<u8>> = contents(&promoted).into_iter().map(|(b, _)| b).collect();
    let expected: Vec<Vec<u8>> = (5..40u32).map(body).collect();
    assert_eq!(got, expected, "the caught-up copy is the master's queue");
}

/// A kept copy is resumed only by its own incarnation's sync, and only when it holds no
/// seq the master has not given yet (the master restarted without rounds the copy has):
/// otherwise the copy starts empty. An empty queue's summary is one empty range.
#[test]
fn a_kept_copy_past_the_masters_start_or_of_another_incarnation_starts_empty() {
    for case in ["past the start", "another incarnation"] {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let shipped = capture_rounds(&s);
        for i in 0..5u32 {
            publish(&b, &i.to_be_bytes());
        }
        assert!(s.step());
        let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
        mirror
            .start_copy("/", "q", incarnation, next_generation())
            .expect("a copy starts");
        write_shipped(&mirror, incarnation, &shipped);
        mirror_disk.crash();
        let (_, mirror, _) = open_mirror(&mirror_disk, false);
        let (inc, from_seq) = match case {
            "past the start" => (incarnation, 4),
            _ => (incarnation + 1, 5),
        };
        assert_eq!(
            mirror
                .resume_copy("/", "q", inc, from_seq, next_generation())
                .expect("resume"),
            None,
            "{case}: the copy starts empty"
        );
        // Empty: it matches a range with nothing live, and no range with a message.
        let nothing = crate::mirror::digest::SummaryBuilder::new(0, 5).finish();
        assert!(
            mirror
                .reconcile_summary("/", "q", inc, &nothing)
                .expect("compare"),
            "{case}: nothing held"
        );
        let mut one = crate::mirror::digest::SummaryBuilder::new(0, 5);
        one.add(0, 1, false);
        assert!(
            !mirror
                .reconcile_summary("/", "q", inc, &one.finish())
                .expect("compare"),
            "{case}: a message the empty copy lacks"
        );
        assert_eq!(mirror.low_seq("/", "q"), None, "{case}: nothing kept");
    }
    let (_, _, s, _) = open(&MemDisk::new());
    assert!(s
        .sync_summary("/", "q", 0, 1, 7, |summary, next| summary.live == vec![0]
            && next.is_none())
        .expect("an empty queue's summary"));
}

/// A mirror promoted before its first sync after a restart (`ha-promote-on-failure:
/// always`, or `force_promote_mirror`): the copy kept from its last run, left as it is by
/// joining, is adopted as it is. It becomes the queue with every message it held, each
/// flagged redelivered (any adoption does that); a kept copy emptied at the start would
/// bring the queue up empty.
#[test]
fn a_kept_copy_promoted_before_its_first_sync_becomes_the_queue() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let shipped = capture_rounds(&s);
    let big = vec![9u8; 10_000];
    let bodies = [b"a".to_vec(), big.clone(), b"c".to_vec()];
    for body in &bodies {
        publish(&b, body);
    }
    assert!(s.step());
    let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
    mirror
        .start_copy("/", "q", incarnation, next_generation())
        .expect("a copy starts");
    write_shipped(&mirror, incarnation, &shipped);
    mirror_disk.crash();

    // Restarted: the copy is kept, and joining leaves it as it is.
    let (mb, mirror, _) = open_mirror(&mirror_disk, false);
    let key = ("/".to_string(), "q".to_string());
    assert_eq!(mirror.kept_copies(), vec![(key, incarnation)]);
    mirror
        .begin_copy("/", "q", incarnation, next_generation())
        .expect("the kept copy stays");
    // The master's node dies before any sync: this mirror is promoted.
    let mut state = (*mb.snapshot()).clone();
    state
        .apply(&Command::PromoteMirror {
            vhost: "/".into(),
            queue: "q".into(),
            expected_epoch: 0,
            node: 1,
        })
        .expect("promote");
    mb.follow(Arc::new(state), Instant::default());
    let adopted = mb
        .adopt_queue("/", "q", Instant::default(), |h| {
            mirror.adopt(h, incarnation).map(|_| ())
        })
        .expect("the queue is this node's now");
    adopted.expect("the kept copy is adopted");
    mb.set_pager(mirror.clone());
    let expected: Vec<(Vec<u8>, bool)> = bodies.iter().map(|b| (b.clone(), true)).collect();
    assert_eq!(contents(&mb), expected, "the promoted copy is the queue");
    assert!(
        mirror.kept_copies().is_empty(),
        "no longer kept once adopted"
    );
}

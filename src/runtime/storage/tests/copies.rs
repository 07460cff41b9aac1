//! A mirror's copy in storage: fed the master's operations, recovered as the queue when
//! promoted, replaced by a new incarnation, flagged after a crash.

use super::*;

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
        let ops = crate::mirror::ops::decode(&bytes.clone().into()).expect("a batch decodes");
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

/// Keeps every round `s` writes, encoded as shipped, instead of shipping it.
pub(super) fn capture_rounds(s: &Storage<MemDisk>) -> Arc<Mutex<Vec<Vec<u8>>>> {
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
pub(super) fn mirror_broker(d: &Arc<Durability>, promoted: bool) -> (Broker, u64) {
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
pub(super) fn open_for(
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
pub(super) fn open_mirror(disk: &MemDisk, promoted: bool) -> (Broker, Arc<Storage<MemDisk>>, u64) {
    let d = Arc::new(Durability::default());
    let (mb, incarnation) = mirror_broker(&d, promoted);
    let (storage, _) = open_for(disk, &mb, d);
    (mb, storage, incarnation)
}

/// Writes every round the master shipped so far (and takes them) to the mirror's copy of
/// `incarnation`.
pub(super) fn write_shipped(
    mirror: &Storage<MemDisk>,
    incarnation: u64,
    shipped: &Mutex<Vec<Vec<u8>>>,
) {
    for round in std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner())) {
        let ops = crate::mirror::ops::decode(&round.clone().into()).expect("a batch decodes");
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
            let ops = crate::mirror::ops::decode(&round.clone().into()).expect("a batch decodes");
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
    let ops = || crate::mirror::ops::decode(&rounds[0].clone().into()).expect("a batch decodes");
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
        let ops = crate::mirror::ops::decode(&bytes.clone().into()).expect("a batch decodes");
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

//! Model-based tests of a queue over real storage (on `MemDisk`): random publishes,
//! deliveries, acks, requeues, purges, syncer rounds, paging and reopens (clean or after a
//! power loss), compared after every step with a plain in-memory model of what RabbitMQ
//! promises: FIFO order with requeued messages back in their place, `redelivered` set on
//! anything handed out before, persistent messages of a durable queue surviving a restart
//! and transient ones not.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use proptest::prelude::*;

use super::Storage;
use crate::amqp::frame::encode_properties;
use crate::broker::{Broker, Durability, Message, QueueHandle};
use crate::config::Config;
use crate::meta::{Command, QueueDef};
use crate::store::MemDisk;
use crate::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pressure {
    /// Node memory above the paging threshold all the time.
    Memory,
    /// `x-queue-mode: lazy`, no memory pressure.
    Lazy,
    /// Neither: nothing pages.
    None,
}

#[derive(Debug, Clone)]
enum Op {
    Publish { persistent: bool, large: bool },
    Get { ack: bool },
    Ack(usize),
    Requeue(usize),
    Purge,
    Step,
    Reopen { crash: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(persistent, large)| Op::Publish { persistent, large }),
        4 => any::<bool>().prop_map(|ack| Op::Get { ack }),
        2 => (0usize..8).prop_map(Op::Ack),
        2 => (0usize..8).prop_map(Op::Requeue),
        1 => Just(Op::Purge),
        3 => Just(Op::Step),
        1 => any::<bool>().prop_map(|crash| Op::Reopen { crash }),
    ]
}

#[derive(Debug, Clone)]
struct Msg {
    persistent: bool,
    redelivered: bool,
    /// Restored after an unclean stop: it leaves flagged `redelivered` (it may have gone
    /// out unrecorded), across later clean restarts too (storage keeps the suspicion).
    suspect: bool,
}

#[derive(Default)]
struct Model {
    /// Ready messages by publish number (= their place in the queue).
    ready: BTreeMap<u64, Msg>,
    /// Delivered, unacknowledged: delivery seq → publish number.
    unacked: Vec<(u64, u64, Msg)>,
    published: u64,
}

fn config() -> Config {
    let mut c = Config::default();
    c.storage.queue_index_segment_entry_count = 4;
    c.storage.queue_index_journal_max_entries = 8;
    c.storage.queue_index_embed_msgs_below = 128;
    c.storage.queue_paging_head_messages = 2;
    c
}

struct Node {
    broker: Broker,
    storage: Arc<Storage<MemDisk>>,
    queue: Arc<QueueHandle>,
}

/// `generation` seeds message ids: each start of a real node draws a fresh prefix.
fn open(disk: &MemDisk, pressure: Pressure, durable: bool, generation: u64) -> Node {
    let config = config();
    let d = Arc::new(Durability::default());
    // A 1-byte watermark puts any message above the paging threshold.
    let watermark = if pressure == Pressure::Memory {
        1
    } else {
        1 << 40
    };
    let broker = Broker::new(&config, generation, watermark, 0).with_durability(d.clone());
    let mut arguments = amq_protocol::types::FieldTable::default();
    if pressure == Pressure::Lazy {
        arguments.insert(
            "x-queue-mode".into(),
            amq_protocol::types::AMQPValue::LongString("lazy".into()),
        );
    }
    broker
        .apply(
            &Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: "q".into(),
                durable,
                exclusive_owner: None,
                auto_delete: false,
                arguments,
                home: 0,
            }),
            Instant::default(),
        )
        .expect("declare");
    let (storage, _) = Storage::open_with(
        disk.clone(),
        &broker,
        d,
        &PathBuf::from("/data"),
        &config.storage,
        crate::time::Instant::default(),
    )
    .expect("open storage");
    broker.set_pager(storage.clone());
    let queue = broker.queue("/", "q").expect("queue");
    Node {
        broker,
        storage,
        queue,
    }
}

fn body(n: u64, large: bool) -> Vec<u8> {
    let mut b = format!("m{n:08}").into_bytes();
    if large {
        b.resize(300, b'x');
    }
    b
}

fn number(body: &[u8]) -> u64 {
    std::str::from_utf8(&body[1..9])
        .expect("utf8")
        .parse()
        .expect("number")
}

fn publish(node: &Node, n: u64, persistent: bool, large: bool) {
    let props = AMQPProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
    let m = Arc::new(Message {
        id: node.broker.next_message_id(),
        exchange: String::new(),
        routing_key: "q".into(),
        properties_raw: Bytes::from(encode_properties(&props)),
        properties: props,
        body: Bytes::from(body(n, large)),
    });
    let snap = node.broker.snapshot();
    let out = node
        .broker
        .publish(snap.vhost("/").expect("vhost"), "", m, Instant::default());
    assert!(!out.rejected);
}

fn check(node: &Node, model: &Model, durable: bool) {
    let q = node.queue.lock();
    assert_eq!(q.message_count() as usize, model.ready.len(), "ready count");
    assert_eq!(
        q.unacked_count() as usize,
        model.unacked.len(),
        "unacked count"
    );
    // The listings' figures: the same counts, and the persistent messages of a durable
    // queue wherever they are (RAM, betas, delta across page-outs, read-backs and reopens).
    let f = q.figures();
    assert_eq!(
        (f.ready, f.unacked),
        (model.ready.len() as u64, model.unacked.len() as u64),
        "figures' counts"
    );
    let persistent = model
        .ready
        .values()
        .chain(model.unacked.iter().map(|(_, _, m)| m))
        .filter(|m| durable && m.persistent)
        .count() as u64;
    assert_eq!(f.persistent, persistent, "messages_persistent");
    assert!(f.paged_out >= q.paged_count(), "messages_paged_out");
}

/// What a run saw at most: messages only on disk (delta), and betas (bodies only on disk).
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    paged: u64,
    betas: u64,
}

fn run(ops: Vec<Op>, pressure: Pressure, durable: bool) -> Seen {
    let disk = MemDisk::new();
    let mut generation = 1;
    let mut node = open(&disk, pressure, durable, generation);
    let mut model = Model::default();
    let mut seen = Seen::default();
    let now = Instant::default();
    for op in ops {
        let mut dead = Vec::new();
        match op {
            Op::Publish { persistent, large } => {
                let n = model.published;
                model.published += 1;
                publish(&node, n, persistent, large);
                model.ready.insert(
                    n,
                    Msg {
                        persistent,
                        redelivered: false,
                        suspect: false,
                    },
                );
            }
            Op::Get { ack } => {
                let got = node.queue.lock().get(now, ack, &mut dead);
                let expected = model.ready.pop_first();
                match (got, expected) {
                    (None, None) => {}
                    (Some((e, _)), Some((n, mut m))) => {
                        assert_eq!(number(&e.message.body), n, "FIFO order");
                        assert_eq!(
                            e.redelivered,
                            m.redelivered || m.suspect,
                            "redelivered of {n}"
                        );
                        if ack {
                            m.redelivered = true;
                            model.unacked.push((e.seq, n, m));
                        }
                    }
                    (got, expected) => panic!(
                        "queue gave {:?}, model {:?}",
                        got.map(|g| number(&g.0.message.body)),
                        expected.map(|e| e.0)
                    ),
                }
            }
            Op::Ack(i) | Op::Requeue(i) if !model.unacked.is_empty() => {
                let (seq, n, m) = model.unacked.remove(i % model.unacked.len());
                let q = node.queue.clone();
                if matches!(op, Op::Ack(_)) {
                    q.lock().ack(&q, &[seq], now, &mut dead);
                } else {
                    q.lock().settle(&q, &[seq], true, now, &mut dead);
                    model.ready.insert(n, m);
                }
            }
            Op::Ack(_) | Op::Requeue(_) => {}
            Op::Purge => {
                let n = node.queue.lock().purge();
                assert_eq!(n as usize, model.ready.len());
                model.ready.clear();
            }
            Op::Step => {
                node.storage.round().expect("syncer round");
                let q = node.queue.clone();
                q.lock().tick(&q, now, &mut dead);
            }
            Op::Reopen { crash } => {
                if !durable {
                    continue;
                }
                // Everything recorded so far is made durable, then the node goes away.
                node.storage.round().expect("syncer round");
                if crash {
                    disk.crash();
                } else {
                    node.storage.close();
                }
                drop(node);
                generation += 1;
                node = open(&disk, pressure, durable, generation);
                let unacked = std::mem::take(&mut model.unacked);
                for (_, n, m) in unacked {
                    model.ready.insert(n, m);
                }
                model.ready.retain(|_, m| m.persistent);
                // After an unclean stop any of them may have gone out unrecorded; a clean
                // stop does not clear that.
                for m in model.ready.values_mut() {
                    m.suspect |= crash;
                }
            }
        }
        {
            let q = node.queue.lock();
            seen.paged = seen.paged.max(q.paged_count());
            seen.betas = seen.betas.max(q.beta_count());
        }
        check(&node, &model, durable);
    }
    // Drain: everything left comes out in order.
    let mut dead = Vec::new();
    loop {
        let got = node.queue.lock().get(now, false, &mut dead);
        let expected = model.ready.pop_first();
        match (got, expected) {
            (None, None) => break,
            (Some((e, _)), Some((n, m))) => {
                assert_eq!(number(&e.message.body), n);
                assert_eq!(e.redelivered, m.redelivered || m.suspect);
            }
            (got, expected) => panic!(
                "drain: queue {:?}, model {:?}",
                got.map(|g| number(&g.0.message.body)),
                expected.map(|e| e.0)
            ),
        }
    }
    seen
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn paging_durable_queue_matches_the_model(ops in prop::collection::vec(op(), 1..160)) {
        run(ops, Pressure::Memory, true);
    }

    #[test]
    fn lazy_durable_queue_matches_the_model(ops in prop::collection::vec(op(), 1..160)) {
        run(ops, Pressure::Lazy, true);
    }

    #[test]
    fn paging_transient_queue_matches_the_model(ops in prop::collection::vec(op(), 1..160)) {
        run(ops, Pressure::Memory, false);
    }

    #[test]
    fn unpaged_queue_matches_the_model(ops in prop::collection::vec(op(), 1..120)) {
        run(ops, Pressure::None, true);
    }
}

/// The runs above would pass if nothing ever paged: this one proves that messages do leave
/// RAM, under memory pressure and in lazy mode, and come back in order.
#[test]
fn a_long_queue_pages_out_and_reads_back_in_order() {
    for (pressure, durable) in [
        (Pressure::Memory, true),
        (Pressure::Lazy, true),
        (Pressure::Memory, false),
    ] {
        let mut ops = Vec::new();
        for i in 0..200 {
            ops.push(Op::Publish {
                persistent: i % 3 != 0,
                large: i % 7 == 0,
            });
            if i % 10 == 9 {
                ops.push(Op::Step);
            }
        }
        ops.push(Op::Step);
        ops.push(Op::Step);
        let seen = run(ops, pressure, durable);
        assert!(
            seen.paged > 150,
            "{pressure:?}/{durable}: only {} messages paged",
            seen.paged
        );
        if pressure == Pressure::Memory {
            // Bodies in a store go first (alpha -> beta), then whole entries (-> delta).
            assert!(seen.betas > 0, "{pressure:?}/{durable}: no betas");
        }
    }
}

#[test]
fn unpressured_queue_does_not_page() {
    let ops = (0..100)
        .map(|_| Op::Publish {
            persistent: true,
            large: false,
        })
        .chain([Op::Step, Op::Step])
        .collect();
    let seen = run(ops, Pressure::None, true);
    assert_eq!((seen.paged, seen.betas), (0, 0));
}

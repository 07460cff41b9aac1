//! Model-based property test: random publishes, delivers, acks, syncs, flushes, clean
//! reopens, crashes and failing fsyncs against a plain `BTreeMap` model, compared after every
//! step. Small segments (8) and journal (5) make flushes and many segments routine. Reopens
//! use a random, small `recover_head_entries`: the recovered queue is the head plus the
//! segments read back with `read_segment` from `rest_from` on (see `recovered_all`).
//!
//! Every clean reopen must take the clean path (no scan), and is checked against a scan of a
//! copy of the same folder without its summary: the same [`Recovered`], the same state (the
//! model then goes on with the index the clean path opened) and the same files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::open::LAST_OPEN_CLEAN_PATH;
use super::tests::{recovered_all, small_config};
use super::*;
use crate::store::disk::{Disk, DiskError};
use crate::store::mem_disk::MemDisk;

/// `MemDisk` whose n-th next `sync` fails, to crash a flush at any of its fsyncs.
#[derive(Debug, Clone, Default)]
pub(super) struct FaultDisk {
    pub(super) mem: MemDisk,
    /// Syncs left before the failing one; negative when disarmed.
    pub(super) fail_in: Arc<AtomicI64>,
}

impl FaultDisk {
    pub(super) fn new() -> FaultDisk {
        let d = FaultDisk::default();
        d.fail_in.store(-1, Ordering::SeqCst);
        d
    }
}

impl Disk for FaultDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        self.mem.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        self.mem.list(dir)
    }
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        self.mem.read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        self.mem.read_at(path, offset, len)
    }
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.mem.append(path, data)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.mem.write_file(path, data)
    }
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        self.mem.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        self.mem.rename(from, to)
    }
    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        self.mem.remove(path)
    }
    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        if self.fail_in.fetch_sub(1, Ordering::SeqCst) == 0 {
            self.mem.fail_next_sync();
        }
        self.mem.sync(path)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.mem.sync_dir(dir)
    }
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        self.mem.len(path)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.mem.remove_dir(dir)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Publish {
        size: usize,
        persistent: bool,
        expires: Option<u64>,
    },
    Deliver(usize),
    Ack(Vec<usize>),
    Sync,
    Flush,
    /// A clean close and open, with this `recover_head_entries`.
    Reopen(usize),
    /// A crash and open, with this `recover_head_entries`.
    Crash(usize),
    /// A flush whose n-th fsync fails, then a crash.
    FailedFlush(i64),
}

fn op() -> impl Strategy<Value = Op> {
    let publish = (
        0usize..80,
        prop::bool::weighted(0.85),
        prop::option::of(0u64..9),
    );
    prop_oneof![
        12 => publish.prop_map(|(size, persistent, expires)| Op::Publish { size, persistent, expires }),
        4 => any::<usize>().prop_map(Op::Deliver),
        6 => prop::collection::vec(any::<usize>(), 1..6).prop_map(Op::Ack),
        2 => Just(Op::Sync),
        1 => Just(Op::Flush),
        1 => (0usize..12).prop_map(Op::Reopen),
        2 => (0usize..12).prop_map(Op::Crash),
        1 => (0i64..6).prop_map(Op::FailedFlush),
    ]
}

#[derive(Debug, Clone)]
struct Msg {
    publish: Publish,
    delivered: bool,
    acked: bool,
    pub_durable: bool,
    del_durable: bool,
}

#[derive(Debug, Default)]
struct Model {
    msgs: BTreeMap<u64, Msg>,
    next_seq: u64,
    ids: u64,
}

impl Model {
    /// Everything so far reached the disk: acked messages can never come back.
    fn durable(&mut self) {
        self.msgs.retain(|_, m| !m.acked);
        for m in self.msgs.values_mut() {
            m.pub_durable = true;
            m.del_durable |= m.delivered;
        }
    }

    fn live(&self) -> Vec<u64> {
        let live = self.msgs.iter().filter(|(_, m)| !m.acked);
        live.map(|(s, _)| *s).collect()
    }

    fn expected(&self) -> Vec<IndexEntry> {
        let live = self.msgs.values().filter(|m| !m.acked);
        live.map(|m| IndexEntry {
            publish: m.publish.clone(),
            delivered: m.delivered,
        })
        .collect()
    }

    /// After any reopen the index's view is the whole truth, and all of it is on disk.
    fn reset(&mut self, recovered: &[IndexEntry], next_seq: u64) {
        self.msgs = recovered
            .iter()
            .map(|e| {
                let m = Msg {
                    publish: e.publish.clone(),
                    delivered: e.delivered,
                    acked: false,
                    pub_durable: true,
                    del_durable: e.delivered,
                };
                (e.publish.seq, m)
            })
            .collect();
        self.next_seq = next_seq;
    }
}

fn dir() -> PathBuf {
    PathBuf::from("/vhost/queues/q")
}

/// Opens with `head` as `recover_head_entries`; returns the whole recovered queue too.
fn open(disk: &FaultDisk, head: usize) -> (QueueIndex<FaultDisk>, Recovered, Vec<IndexEntry>) {
    let config = IndexConfig {
        recover_head_entries: head,
        ..small_config()
    };
    let (ix, rec) = QueueIndex::open(disk.clone(), &dir(), config).expect("open");
    let all = recovered_all(&ix, &rec);
    (ix, rec, all)
}

/// Copies `from`'s folder durably to `to`, except the files named in `skip`.
pub(super) fn copy_folder<D: Disk, T: Disk>(from: &D, to: &T, dir: &Path, skip: &[&str]) {
    for name in from.list(dir).expect("list") {
        if skip.contains(&name.as_str()) {
            continue;
        }
        let path = dir.join(name);
        to.write_file(&path, &from.read(&path).expect("read"))
            .expect("write");
        to.sync(&path).expect("sync");
    }
    to.sync_dir(dir).expect("sync dir");
}

/// Every file of the folder, with its contents.
pub(super) fn folder_files<D: Disk>(disk: &D, dir: &Path) -> Vec<(String, Vec<u8>)> {
    let names = disk.list(dir).expect("list");
    let read = |n: String| {
        let bytes = disk.read(&dir.join(&n)).expect("read");
        (n, bytes)
    };
    names.into_iter().map(read).collect()
}

/// A clean reopen, checked against a scan of a copy of the folder without its summary.
fn clean_reopen(
    disk: &FaultDisk,
    head: usize,
) -> (QueueIndex<FaultDisk>, Recovered, Vec<IndexEntry>) {
    let scanned_disk = FaultDisk::new();
    copy_folder(disk, &scanned_disk, &dir(), &[SUMMARY_FILE]);
    let (scanned, scanned_rec, scanned_all) = open(&scanned_disk, head);
    assert!(!LAST_OPEN_CLEAN_PATH.with(|c| c.get()));

    let (ix, rec, all) = open(disk, head);
    assert!(
        LAST_OPEN_CLEAN_PATH.with(|c| c.get()),
        "a clean close reopens without a scan: {:?}",
        rec.damage
    );
    assert_eq!(
        rec, scanned_rec,
        "the clean path recovers what the scan does"
    );
    assert_eq!(all, scanned_all);
    assert_eq!(ix.state.live_view(), scanned.state.live_view());
    assert_eq!(
        folder_files(disk, &dir()),
        folder_files(&scanned_disk, &dir()),
        "the clean path leaves the files the scan leaves"
    );
    (ix, rec, all)
}

fn check_live(ix: &QueueIndex<FaultDisk>, model: &Model, disk: &FaultDisk, flushed: bool) {
    let expected = model.expected();
    let mut got = Vec::new();
    for n in ix.segments() {
        got.extend(ix.read_segment(n).expect("read segment"));
    }
    assert_eq!(got, expected);
    assert_eq!(ix.len(), expected.len() as u64);
    let low = expected.first().map_or(model.next_seq, |e| e.publish.seq);
    assert_eq!(ix.bounds(), (low, model.next_seq));
    let e = small_config().segment_entry_count;
    let live: BTreeSet<u64> = expected.iter().map(|x| x.publish.seq / e).collect();
    assert_eq!(ix.segments(), live.iter().copied().collect::<Vec<_>>());
    if flushed {
        let files = disk.list(&dir()).expect("list");
        let files: BTreeSet<u64> = files.iter().filter_map(|n| segment_number(n)).collect();
        assert_eq!(
            files, live,
            "after a flush exactly the live segments have files"
        );
    }
}

/// After a crash: synced and un-acked messages are back, synced acks stay gone, unsynced
/// changes may or may not have survived.
fn check_crash(model: &Model, rec: &Recovered, all: &[IndexEntry]) {
    assert!(!rec.clean);
    for e in all {
        let seq = e.publish.seq;
        let m = model
            .msgs
            .get(&seq)
            .unwrap_or_else(|| panic!("seq {seq} came back"));
        assert_eq!(e.publish, m.publish);
        assert!(m.publish.persistent, "transient seq {seq} came back");
        assert!(!m.del_durable || e.delivered, "seq {seq} lost its deliver");
        assert!(m.delivered || !e.delivered, "seq {seq} gained a deliver");
    }
    let back: BTreeSet<u64> = all.iter().map(|e| e.publish.seq).collect();
    for (seq, m) in &model.msgs {
        if m.publish.persistent && m.pub_durable && !m.acked {
            assert!(back.contains(seq), "synced seq {seq} was lost");
        }
    }
}

fn crash_and_reopen(
    ix: QueueIndex<FaultDisk>,
    disk: &FaultDisk,
    model: &mut Model,
    head: usize,
) -> QueueIndex<FaultDisk> {
    drop(ix);
    disk.mem.crash();
    let (ix, rec, all) = open(disk, head);
    check_crash(model, &rec, &all);
    assert!(
        rec.damage.is_empty(),
        "a crash is not damage: {:?}",
        rec.damage
    );
    let max = all.last().map_or(0, |e| e.publish.seq + 1);
    assert!(ix.bounds().1 >= max);
    model.reset(&all, ix.bounds().1);
    ix
}

fn run(ops: Vec<Op>) {
    let disk = FaultDisk::new();
    let (mut ix, _, _) = open(&disk, usize::MAX);
    let mut model = Model::default();
    for op in ops {
        let flushes = ix.stats().flushes;
        let mut flushed = false;
        match op {
            Op::Publish {
                size,
                persistent,
                expires,
            } => {
                model.ids += 1;
                let p = Publish {
                    seq: model.next_seq,
                    msg_id: model.ids.to_le_bytes().repeat(2).try_into().expect("16"),
                    persistent,
                    expires_at_ms: expires,
                    size: size as u32,
                    embedded: small_config().embeds(size).then(|| vec![size as u8; size]),
                };
                ix.publish(p.clone()).expect("publish");
                let m = Msg {
                    publish: p,
                    delivered: false,
                    acked: false,
                    pub_durable: false,
                    del_durable: false,
                };
                model.msgs.insert(model.next_seq, m);
                model.next_seq += 1;
            }
            Op::Deliver(i) => {
                let live = model.live();
                if live.is_empty() {
                    assert!(ix.deliver(model.next_seq).is_err());
                } else {
                    let seq = live[i % live.len()];
                    ix.deliver(seq).expect("deliver");
                    model.msgs.get_mut(&seq).expect("live").delivered = true;
                }
            }
            Op::Ack(picks) => {
                let live = model.live();
                if !live.is_empty() {
                    let seqs: BTreeSet<u64> = picks.iter().map(|i| live[i % live.len()]).collect();
                    let seqs: Vec<u64> = seqs.into_iter().collect();
                    ix.ack(&seqs).expect("ack");
                    for s in seqs {
                        model.msgs.get_mut(&s).expect("live").acked = true;
                    }
                }
            }
            Op::Sync => {
                ix.sync().expect("sync");
                model.durable();
            }
            Op::Flush => {
                ix.flush_journal().expect("flush");
                flushed = true;
            }
            Op::Reopen(head) => {
                let expected: Vec<IndexEntry> = model
                    .expected()
                    .into_iter()
                    .filter(|e| e.publish.persistent)
                    .collect();
                let transient = model.expected().len() - expected.len();
                ix.close().expect("close");
                let (reopened, rec, all) = clean_reopen(&disk, head);
                ix = reopened;
                assert!(rec.clean && rec.damage.is_empty());
                assert_eq!(all, expected);
                assert_eq!(rec.dropped_transient, transient as u64);
                assert_eq!(ix.bounds().1, model.next_seq);
                model.reset(&all, model.next_seq);
                flushed = true;
            }
            Op::Crash(head) => {
                ix = crash_and_reopen(ix, &disk, &mut model, head);
                flushed = true;
            }
            Op::FailedFlush(n) => {
                disk.fail_in.store(n, Ordering::SeqCst);
                let r = ix.flush_journal();
                disk.fail_in.store(-1, Ordering::SeqCst);
                if r.is_ok() {
                    flushed = true;
                } else {
                    assert!(matches!(ix.sync(), Err(QueueIndexError::Poisoned)));
                    ix = crash_and_reopen(ix, &disk, &mut model, 1);
                    flushed = true;
                }
            }
        }
        if ix.stats().flushes > flushes {
            model.durable();
            flushed = true;
        }
        check_live(&ix, &model, &disk, flushed);
    }
}

/// Builds some history, then flips one byte of one segment and reopens.
fn run_corruption(ops: Vec<Op>, file: usize, at: usize) {
    let disk = FaultDisk::new();
    let (mut ix, _, _) = open(&disk, usize::MAX);
    let mut next = 0;
    for op in ops {
        match op {
            Op::Publish { persistent, .. } => {
                ix.publish(super::tests::msg(next, persistent))
                    .expect("publish");
                next += 1;
            }
            Op::Ack(picks) if next > 0 => {
                let seqs: BTreeSet<u64> = picks.iter().map(|i| *i as u64 % next).collect();
                let seqs: Vec<u64> = seqs.into_iter().filter(|s| ix.state.is_live(*s)).collect();
                ix.ack(&seqs).expect("ack");
            }
            _ => {}
        }
    }
    ix.close().expect("close");
    let files = disk.list(&dir()).expect("list");
    let segments: Vec<&String> = files
        .iter()
        .filter(|n| segment_number(n).is_some())
        .collect();
    if segments.is_empty() {
        return;
    }
    // The scan is what notices damage: a clean open trusts the summary for the segments it
    // does not read (see `clean_tests.rs` for damage it does read).
    disk.remove(&dir().join(SUMMARY_FILE)).expect("remove");
    let path = dir().join(segments[file % segments.len()]);
    let len = disk.len(&path).expect("len").expect("exists") as usize;
    disk.mem.corrupt(&path, at % len);
    let (ix, rec, all) = open(&disk, 1);
    assert!(!rec.damage.is_empty(), "a flipped byte is always noticed");
    assert_eq!(ix.len(), all.len() as u64);
    drop(ix);
    let (_, again, all_again) = open(&disk, 2);
    assert!(again.damage.is_empty(), "repaired: {:?}", again.damage);
    assert_eq!(all_again, all);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_index_matches_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(ops);
    }

    #[test]
    fn a_corrupt_segment_byte_never_fails_the_open(
        ops in prop::collection::vec(op(), 1..60),
        file in any::<usize>(),
        at in any::<usize>(),
    ) {
        run_corruption(ops, file, at);
    }
}

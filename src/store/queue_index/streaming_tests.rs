//! Tests of the streaming recovery: the head/rest split of [`Recovered`] with a small
//! `recover_head_entries` over tiny segments (4 seqs), after clean closes, crashes with a
//! non-empty journal and damaged segments, compared against a plain model; and the bound on
//! what recovery holds at once.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::super::codec;
use super::super::model_tests::FaultDisk;
use super::super::open::LAST_PEAK_HELD;
use super::*;

const E: u64 = 4;

fn config(head: usize, journal_max_entries: usize) -> IndexConfig {
    IndexConfig {
        segment_entry_count: E,
        journal_max_entries,
        embed_below: 32,
        recover_head_entries: head,
        keep_transient: false,
    }
}

fn dir() -> PathBuf {
    PathBuf::from("/queues/streamed")
}

/// A queue index and the plain model it must match.
struct Queue<D: Disk> {
    disk: D,
    ix: Option<QueueIndex<D>>,
    model: BTreeMap<u64, IndexEntry>,
    next: u64,
}

impl<D: Disk + Clone> Queue<D> {
    fn new(disk: &D, journal_max_entries: usize) -> Queue<D> {
        let (ix, _) =
            QueueIndex::open(disk.clone(), &dir(), config(1, journal_max_entries)).expect("open");
        Queue {
            disk: disk.clone(),
            ix: Some(ix),
            model: BTreeMap::new(),
            next: 0,
        }
    }

    fn ix(&mut self) -> &mut QueueIndex<D> {
        self.ix.as_mut().expect("open")
    }

    fn publish(&mut self, n: u64) {
        for _ in 0..n {
            let mut p = msg(self.next, true);
            // Four seqs share an id (two of them with a body in the store, as `msg` embeds
            // the bodies of even seqs): a reference count can exceed one.
            p.msg_id = [(self.next / 4) as u8; 16];
            self.ix().publish(p.clone()).expect("publish");
            let e = IndexEntry {
                publish: p,
                delivered: false,
            };
            self.model.insert(self.next, e);
            self.next += 1;
        }
    }

    fn deliver(&mut self, seq: u64) {
        self.ix().deliver(seq).expect("deliver");
        self.model.get_mut(&seq).expect("live").delivered = true;
    }

    fn ack(&mut self, seqs: &[u64]) {
        self.ix().ack(seqs).expect("ack");
        for s in seqs {
            self.model.remove(s).expect("live");
        }
    }

    fn expected(&self) -> Vec<IndexEntry> {
        self.model.values().cloned().collect()
    }

    /// Reopens with `head` (after a clean close or a crash) and returns what came back; the
    /// whole queue (head + `read_segment` from `rest_from`) is checked by `recovered_all`.
    fn reopen(&mut self, head: usize, clean: bool) -> (Recovered, Vec<IndexEntry>)
    where
        D: Crashable,
    {
        let old = self.ix.take().expect("open");
        let journal_max = old.config().journal_max_entries;
        if clean {
            old.close().expect("close");
        } else {
            drop(old);
            self.disk.crash();
        }
        let (ix, rec) =
            QueueIndex::open(self.disk.clone(), &dir(), config(head, journal_max)).expect("reopen");
        let ix = self.ix.insert(ix);
        assert_eq!(rec.clean, clean);
        assert_eq!(ix.stats().journal_records, 0, "the open ends with a flush");
        let journal_len = self.disk.len(&dir().join(JOURNAL_FILE)).expect("len");
        assert_eq!(journal_len, Some(0), "the journal is empty after the open");
        let all = recovered_all(ix, &rec);
        (rec, all)
    }
}

/// A disk that can lose what was not synced.
trait Crashable {
    fn crash(&self);
}

impl Crashable for MemDisk {
    fn crash(&self) {
        MemDisk::crash(self);
    }
}

impl Crashable for FaultDisk {
    fn crash(&self) {
        self.mem.crash();
    }
}

fn seq_list(entries: &[IndexEntry]) -> Vec<u64> {
    entries.iter().map(|e| e.publish.seq).collect()
}

fn rest_bytes(all: &[IndexEntry], from: u64) -> u64 {
    let rest = all.iter().filter(|e| e.publish.seq >= from);
    rest.map(|e| u64::from(e.publish.size)).sum()
}

#[test]
fn a_small_head_holds_the_first_live_segments_and_the_rest_reads_back() {
    let disk = MemDisk::new();
    let mut q = Queue::new(&disk, 5);
    q.publish(30);
    q.deliver(5);
    q.deliver(9);
    q.deliver(21);
    q.ack(&[0, 1, 2]);
    q.ack(&[8, 9, 10, 11]);
    q.ack(&[13]);
    // Segment 0 keeps 1 message (< 3), segment 1 brings the head to 5: the head stops there.
    let (rec, all) = q.reopen(3, true);
    assert_eq!(seq_list(&rec.entries), [3, 4, 5, 6, 7]);
    assert!(rec.entries[2].delivered);
    assert_eq!((rec.rest_from, rec.live), (12, 22));
    assert_eq!(rec.rest_bytes, rest_bytes(&all, 12));
    assert_eq!(rec.store_refs.get(&[1; 16]), Some(&2), "seqs 5 and 7");
    assert_eq!(rec.store_refs.get(&[0; 16]), Some(&1), "seq 3 (1 is acked)");
    assert_eq!(rec.store_refs.get(&[2; 16]), None, "segment 2 is all acked");
    assert_eq!(all, q.expected());
    assert!(rec.damage.is_empty());

    // Without a limit everything is in the head, as before.
    let (rec, all) = q.reopen(usize::MAX, true);
    assert_eq!(rec.entries, q.expected());
    assert_eq!((rec.rest_from, rec.rest_bytes, rec.live), (30, 0, 22));
    assert_eq!(all, q.expected());

    // A limit of 0 still brings back the first live segment.
    let (rec, all) = q.reopen(0, true);
    assert_eq!(seq_list(&rec.entries), [3]);
    assert_eq!(rec.rest_from, 4);
    assert_eq!(all, q.expected());

    // The queue goes on after a split open: acks of the rest, new publishes.
    q.ack(&[29, 4]);
    q.publish(3);
    let (_, all) = q.reopen(2, true);
    assert_eq!(all, q.expected());
}

#[test]
fn an_empty_queue_has_nothing_to_split() {
    let disk = MemDisk::new();
    let mut q = Queue::new(&disk, 5);
    q.publish(9);
    q.ack(&(0..9).collect::<Vec<_>>());
    let (rec, all) = q.reopen(1, true);
    assert!(rec.entries.is_empty() && all.is_empty() && rec.store_refs.is_empty());
    assert_eq!((rec.rest_from, rec.live, rec.rest_bytes), (9, 0, 0));
}

#[test]
fn after_a_crash_with_a_full_journal_the_rest_reads_back() {
    let disk = MemDisk::new();
    let mut q = Queue::new(&disk, 1000);
    q.publish(10);
    q.ix().flush_journal().expect("flush");
    // Now in the journal only: publishes of segments 2..4, delivers and acks of seqs whose
    // publish is in a segment file and of seqs published in the journal.
    q.publish(8);
    q.deliver(2);
    q.deliver(11);
    q.ack(&[0, 1, 3, 12]);
    q.ix().sync().expect("sync");
    let synced = q.expected();
    // Never synced: lost in the crash.
    q.publish(1);
    q.ix().ack(&[4]).expect("ack");
    q.model = synced.iter().map(|e| (e.publish.seq, e.clone())).collect();

    let (rec, all) = q.reopen(2, false);
    assert!(rec.damage.is_empty());
    assert_eq!(seq_list(&rec.entries), [2, 4, 5, 6, 7]);
    assert!(rec.entries[0].delivered);
    assert_eq!(rec.rest_from, 8);
    assert_eq!(rec.rest_bytes, rest_bytes(&all, 8));
    assert_eq!(all, synced);
    assert_eq!(q.ix().bounds(), (2, 18));

    // Nothing pending is lost by a second crash right after the open.
    let (rec, all) = q.reopen(2, false);
    assert_eq!(all, synced);
    assert_eq!(rec.live, synced.len() as u64);
}

#[test]
fn damaged_segments_of_the_rest_are_rewritten_and_read_back() {
    let disk = MemDisk::new();
    let mut q = Queue::new(&disk, 1000);
    q.publish(16);
    q.ix().flush_journal().expect("flush");
    q.publish(2);
    q.deliver(9);
    q.ack(&[8, 5]);
    q.ix().sync().expect("sync");
    // A flipped last byte costs the last publish of segments 2 (seq 11) and 3 (seq 15).
    for n in [2, 3] {
        let path = dir().join(format!("{n}.idx"));
        let len = disk.len(&path).expect("len").expect("exists") as usize;
        disk.corrupt(&path, len - 1);
        q.model.remove(&(n * E + 3)).expect("live");
    }

    let (rec, all) = q.reopen(1, false);
    let damaged: Vec<u64> = rec
        .damage
        .iter()
        .map(|d| match d {
            Damage::Segment { segment, .. } => *segment,
            other => panic!("unexpected damage {other:?}"),
        })
        .collect();
    assert_eq!(damaged, [2, 3]);
    assert_eq!(seq_list(&rec.entries), [0, 1, 2, 3]);
    assert_eq!(rec.rest_from, 4);
    assert_eq!(all, q.expected());
    assert!(all.iter().any(|e| e.publish.seq == 9 && e.delivered));

    let (rec, all) = q.reopen(1, false);
    assert!(rec.damage.is_empty(), "repaired: {:?}", rec.damage);
    assert_eq!(all, q.expected());
    let names = disk.list(&dir()).expect("list");
    assert!(names.iter().all(|n| !n.ends_with(".tmp")));
}

/// Writes a file durably (contents and name).
fn put<D: Disk>(disk: &D, name: &str, bytes: &[u8]) {
    let path = dir().join(name);
    disk.write_file(&path, bytes).expect("write");
    disk.sync(&path).expect("sync");
    disk.sync_dir(&dir()).expect("sync dir");
}

#[test]
fn a_crash_between_a_rewrite_and_the_journal_truncation_keeps_acks() {
    // Segment 0 holds publish 0 and 1 and the ack of 1, then garbage; the journal still holds
    // publish 1 (its flush crashed before truncating it).
    let disk = FaultDisk::new();
    disk.create_dir_all(&dir()).expect("dir");
    put(&disk, META_FILE, &codec::encode_meta(E));
    let mut seg = Vec::new();
    codec::encode_publish(&mut seg, &msg(0, true));
    codec::encode_publish(&mut seg, &msg(1, true));
    codec::encode_ack(&mut seg, 1);
    seg.extend_from_slice(&[0xAB; 7]);
    put(&disk, "0.idx", &seg);
    let mut journal = Vec::new();
    codec::encode_publish(&mut journal, &msg(1, true));
    put(&disk, JOURNAL_FILE, &journal);

    // The rewrite's fsync passes; the fsync of the journal's truncation fails.
    disk.fail_in.store(1, Ordering::SeqCst);
    let err = QueueIndex::open(disk.clone(), &dir(), config(1, 5)).unwrap_err();
    disk.fail_in.store(-1, Ordering::SeqCst);
    assert!(matches!(err, QueueIndexError::Disk(_)));
    disk.mem.crash();
    let len = disk.len(&dir().join(JOURNAL_FILE)).expect("len");
    assert_eq!(len, Some(journal.len() as u64), "the journal came back");

    let (ix, rec) = QueueIndex::open(disk.clone(), &dir(), config(1, 5)).expect("open");
    assert!(
        rec.damage.is_empty(),
        "the rewrite landed: {:?}",
        rec.damage
    );
    assert_eq!(seq_list(&rec.entries), [0], "seq 1 stays acked");
    assert_eq!(recovered_all(&ix, &rec), vec![rec.entries[0].clone()]);
    assert_eq!(ix.bounds(), (0, 2));
}

#[test]
fn recovery_holds_one_segment_and_the_journal_at_most() {
    let journal_max = 8;
    let disk = MemDisk::new();
    let mut q = Queue::new(&disk, journal_max);
    for round in 0..50 {
        q.publish(4);
        q.deliver(round * 4 + 1);
    }
    q.ack(&[0]);
    q.ack(&[6]);
    // Some journal left at the crash: publishes and an ack.
    q.publish(2);
    q.ack(&[9]);
    q.ix().sync().expect("sync");
    assert!(q.ix().stats().journal_records > 0);
    let total = q.model.len();

    for (head, clean) in [(4, false), (4, true), (1, true)] {
        LAST_PEAK_HELD.with(|p| p.set(0));
        let (rec, all) = q.reopen(head, clean);
        assert_eq!(all, q.expected());
        assert!(
            rec.entries.len() < 2 * E as usize,
            "the head is one or two segments"
        );
        let peak = LAST_PEAK_HELD.with(|p| p.get());
        assert!(
            (E as usize..=E as usize + journal_max).contains(&peak),
            "peak of {peak} publishes held for a queue of {total}: one segment ({E}) plus \
             the journal ({journal_max}) at most"
        );
    }
}

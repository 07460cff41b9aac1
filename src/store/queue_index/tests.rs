//! Scenario tests of the queue index over `MemDisk` (crash, faults, corruption) and one over
//! the real `FileDisk`. The tests of the streaming recovery's head/rest split are in
//! `streaming_tests.rs`.

use std::path::{Path, PathBuf};

use super::*;
use crate::store::disk::Disk;
use crate::store::mem_disk::MemDisk;

pub(super) fn small_config() -> IndexConfig {
    IndexConfig {
        segment_entry_count: 8,
        journal_max_entries: 5,
        embed_below: 32,
        recover_head_entries: usize::MAX,
        keep_transient: false,
    }
}

pub(super) fn msg(seq: u64, persistent: bool) -> Publish {
    Publish {
        seq,
        msg_id: [seq as u8; 16],
        persistent,
        expires_at_ms: seq.is_multiple_of(3).then_some(1_000 + seq),
        size: 10 + seq as u32,
        embedded: seq
            .is_multiple_of(2)
            .then(|| vec![seq as u8; (seq % 20) as usize]),
    }
}

fn dir() -> PathBuf {
    PathBuf::from("/queues/q1")
}

fn open(disk: &MemDisk) -> (QueueIndex<MemDisk>, Recovered) {
    QueueIndex::open(disk.clone(), &dir(), small_config()).unwrap()
}

/// A journal that never fills, so only explicit syncs make records durable.
fn open_roomy(disk: &MemDisk) -> (QueueIndex<MemDisk>, Recovered) {
    let config = IndexConfig {
        journal_max_entries: 1000,
        ..small_config()
    };
    QueueIndex::open(disk.clone(), &dir(), config).unwrap()
}

/// The whole recovered queue: the head from `rec`, then the live segments from
/// `rec.rest_from` on, read with `read_segment`. Checks what `rec` says of the split: the head
/// is whole segments from the first live one, no longer than the limit requires, and the
/// counts of the rest and the store references are right.
pub(super) fn recovered_all<D: Disk>(ix: &QueueIndex<D>, rec: &Recovered) -> Vec<IndexEntry> {
    let e = ix.config().segment_entry_count;
    let next_seq = ix.bounds().1;
    let (mut head, mut rest) = (Vec::new(), Vec::new());
    for n in ix.segments() {
        let entries = ix.read_segment(n).expect("read segment");
        assert!(!entries.is_empty(), "segment {n} is live");
        if n * e >= rec.rest_from {
            rest.extend(entries);
        } else {
            head.extend(entries);
        }
    }
    assert_eq!(head, rec.entries, "the head is whole segments");
    match rest.first() {
        Some(first) => {
            assert_eq!(rec.rest_from, first.publish.seq / e * e, "rest_from");
            let limit = ix.config().recover_head_entries.max(1);
            let last = rec.entries.last().expect("a head").publish.seq / e;
            let before = rec.entries.iter().filter(|x| x.publish.seq / e < last);
            assert!(rec.entries.len() >= limit && before.count() < limit);
        }
        None => assert_eq!(rec.rest_from, next_seq, "all in the head"),
    }
    let all: Vec<IndexEntry> = head.into_iter().chain(rest.iter().cloned()).collect();
    assert_eq!((rec.live, ix.len()), (all.len() as u64, all.len() as u64));
    let sizes = rest.iter().map(|x| u64::from(x.publish.size));
    assert_eq!(rec.rest_bytes, sizes.sum::<u64>());
    let mut refs = std::collections::BTreeMap::new();
    for x in all.iter().filter(|x| x.publish.embedded.is_none()) {
        *refs.entry(x.publish.msg_id).or_insert(0u32) += 1;
    }
    assert_eq!(rec.store_refs, refs);
    all
}

fn seqs(r: &Recovered) -> Vec<(u64, bool)> {
    r.entries
        .iter()
        .map(|e| (e.publish.seq, e.delivered))
        .collect()
}

fn segment_files<D: Disk>(disk: &D, dir: &Path) -> Vec<String> {
    let names = disk.list(dir).unwrap();
    names.into_iter().filter(|n| n.ends_with(".idx")).collect()
}

#[test]
fn synced_records_survive_a_crash_and_unsynced_ones_may_not() {
    let disk = MemDisk::new();
    let (mut ix, rec) = open_roomy(&disk);
    assert!(rec.entries.is_empty() && !rec.clean);
    for seq in 0..3 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.deliver(1).unwrap();
    ix.sync().unwrap();
    ix.ack(&[0]).unwrap();
    ix.publish(msg(3, true)).unwrap();
    drop(ix);
    disk.crash();
    let (ix, rec) = open(&disk);
    assert_eq!(seqs(&rec), vec![(0, false), (1, true), (2, false)]);
    assert_eq!(rec.entries[0].publish, msg(0, true));
    assert!(!rec.clean && rec.damage.is_empty());
    assert_eq!(ix.bounds(), (0, 3));
}

#[test]
fn a_clean_close_keeps_delivered_flags_and_the_next_seq() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..20 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.deliver(17).unwrap();
    ix.ack(&(0..17).collect::<Vec<_>>()).unwrap();
    ix.close().unwrap();
    let (mut ix, rec) = open(&disk);
    assert!(rec.clean && rec.damage.is_empty());
    assert_eq!(seqs(&rec), vec![(17, true), (18, false), (19, false)]);
    assert_eq!(ix.bounds(), (17, 20));
    ix.ack(&[17, 18, 19]).unwrap();
    ix.close().unwrap();
    let (ix, rec) = open(&disk);
    assert!(rec.entries.is_empty());
    assert_eq!(
        ix.bounds(),
        (20, 20),
        "the marker keeps seqs from being reused"
    );
    assert!(segment_files(&disk, &dir()).is_empty());
}

#[test]
fn fully_acked_segments_are_deleted_at_the_flush() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..20 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.flush_journal().unwrap();
    assert_eq!(segment_files(&disk, &dir()), ["0.idx", "1.idx", "2.idx"]);
    let flushes = ix.stats().flushes;
    ix.ack(&[0, 1, 2, 3, 4, 5, 6, 7, 9]).unwrap();
    assert_eq!(ix.segments(), vec![1, 2]);
    let stats = ix.stats();
    assert_eq!(
        stats.flushes,
        flushes + 1,
        "nine acks passed journal_max_entries"
    );
    assert_eq!((stats.segment_files, stats.journal_records), (2, 0));
    assert_eq!(segment_files(&disk, &dir()), ["1.idx", "2.idx"]);
    let entries = ix.read_segment(1).unwrap();
    let got: Vec<u64> = entries.iter().map(|e| e.publish.seq).collect();
    assert_eq!(got, vec![8, 10, 11, 12, 13, 14, 15]);
    assert_eq!(entries[0].publish, msg(8, true));
    assert!(ix.read_segment(0).unwrap().is_empty());
}

#[test]
fn transient_messages_are_dropped_at_recovery() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..4 {
        ix.publish(msg(seq, seq.is_multiple_of(2))).unwrap();
    }
    ix.close().unwrap();
    let (ix, rec) = open(&disk);
    assert_eq!(seqs(&rec), vec![(0, false), (2, false)]);
    assert_eq!(rec.dropped_transient, 2);
    assert_eq!(ix.len(), 2);
    drop(ix);
    let (_, rec) = open(&disk);
    assert_eq!(rec.dropped_transient, 0, "the drop was recorded with acks");
}

#[test]
fn a_corrupt_segment_byte_is_reported_and_the_rest_kept() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..16 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.close().unwrap();
    let seg0 = dir().join("0.idx");
    let len = disk.len(&seg0).unwrap().unwrap() as usize;
    disk.corrupt(&seg0, len / 2);
    let (ix, rec) = open(&disk);
    assert!(matches!(
        rec.damage[..],
        [
            Damage::Segment { segment: 0, .. },
            Damage::CleanCountMismatch {
                recorded: 16,
                found: 15
            }
        ]
    ));
    assert_eq!(rec.entries.len(), 15, "one record lost, the others kept");
    assert!(!rec.clean, "the files no longer match the clean marker");
    let kept: Vec<u64> = rec.entries.iter().map(|e| e.publish.seq).collect();
    assert!(kept.contains(&0) && kept.contains(&7) && kept.contains(&15));
    drop(ix);
    let (_, again) = open(&disk);
    assert!(again.damage.is_empty(), "the damaged segment was rewritten");
    assert_eq!(again.entries, rec.entries);
}

#[test]
fn a_torn_journal_tail_is_cut() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    ix.publish(msg(0, true)).unwrap();
    ix.sync().unwrap();
    ix.publish(msg(1, true)).unwrap();
    disk.short_next_write();
    assert!(matches!(ix.sync(), Err(QueueIndexError::Disk(_))));
    assert!(matches!(ix.sync(), Err(QueueIndexError::Poisoned)));
    drop(ix);
    let (_, rec) = open(&disk);
    assert_eq!(seqs(&rec), vec![(0, false)]);
    assert!(rec.journal_torn_bytes > 0 && rec.damage.is_empty());
}

#[test]
fn a_failed_fsync_is_an_error_and_poisons_the_index() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    ix.publish(msg(0, true)).unwrap();
    ix.sync().unwrap();
    ix.publish(msg(1, true)).unwrap();
    disk.fail_next_sync();
    assert!(matches!(ix.sync(), Err(QueueIndexError::Disk(_))));
    assert!(matches!(ix.ack(&[0]), Err(QueueIndexError::Poisoned)));
    assert!(matches!(ix.read_segment(0), Err(QueueIndexError::Poisoned)));
    assert!(ix.close().is_err());
    disk.crash();
    let (_, rec) = open(&disk);
    assert_eq!(seqs(&rec), vec![(0, false)]);
}

#[test]
fn a_full_disk_during_a_flush_is_an_error() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    ix.publish(msg(0, true)).unwrap();
    disk.set_capacity(Some(0));
    assert!(matches!(ix.flush_journal(), Err(QueueIndexError::Disk(_))));
    assert!(matches!(ix.sync(), Err(QueueIndexError::Poisoned)));
}

#[test]
fn invalid_calls_are_refused_without_poisoning() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    let mut big = msg(0, true);
    big.embedded = Some(vec![0; 32]);
    assert!(matches!(
        ix.publish(big),
        Err(QueueIndexError::EmbedTooLarge { len: 32, limit: 32 })
    ));
    ix.publish(msg(4, true)).unwrap();
    assert!(matches!(
        ix.publish(msg(4, true)),
        Err(QueueIndexError::State(_))
    ));
    assert!(matches!(ix.ack(&[3]), Err(QueueIndexError::State(_))));
    assert!(matches!(ix.deliver(5), Err(QueueIndexError::State(_))));
    ix.ack(&[4]).unwrap();
    let bad = IndexConfig {
        segment_entry_count: 0,
        ..small_config()
    };
    let err = QueueIndex::open(disk.clone(), Path::new("/q2"), bad).unwrap_err();
    assert!(matches!(err, QueueIndexError::Config(_)));
}

#[test]
fn the_folder_keeps_its_segment_size() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..10 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.close().unwrap();
    let wider = IndexConfig {
        segment_entry_count: 64,
        ..small_config()
    };
    let (ix, rec) = QueueIndex::open(disk.clone(), &dir(), wider).unwrap();
    assert_eq!(rec.entries.len(), 10);
    assert_eq!(ix.config().segment_entry_count, 8);
    assert_eq!(ix.segments(), vec![0, 1]);
}

#[test]
fn a_damaged_clean_marker_means_a_crash_recovery() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    ix.publish(msg(0, true)).unwrap();
    ix.close().unwrap();
    disk.corrupt(&dir().join(CLEAN_FILE), 9);
    let (_, rec) = open(&disk);
    assert!(!rec.clean);
    assert_eq!(rec.damage, vec![Damage::CleanMarker]);
    assert_eq!(rec.entries.len(), 1);
}

/// The `store` fuzz target's crash (`fuzz/regressions/store/`): a checksummed journal
/// record of seq `u64::MAX` overflowed the next seq at open. It is damage now, and a segment
/// file numbered past the seq limit is not the index's.
#[test]
fn a_record_or_segment_past_the_seq_limit_is_not_taken() {
    let disk = MemDisk::new();
    let (mut ix, _) = open_roomy(&disk);
    ix.publish(msg(0, true)).unwrap();
    ix.publish(msg(1, true)).unwrap();
    ix.sync().unwrap();
    drop(ix);
    let journal = dir().join(JOURNAL_FILE);
    let mut bytes = disk.read(&journal).unwrap();
    codec::encode_ack(&mut bytes, u64::MAX);
    codec::encode_deliver(&mut bytes, codec::SEQ_LIMIT);
    disk.write_file(&journal, &bytes).unwrap();
    let far = dir().join(format!("{}{SEGMENT_SUFFIX}", u64::MAX));
    disk.write_file(&far, &bytes).unwrap();
    let (ix, rec) = open(&disk);
    assert_eq!(seqs(&rec), vec![(0, false), (1, false)]);
    assert_eq!(ix.bounds().1, 2, "the next seq is the intact records' next");
    assert!(
        disk.read(&far).is_ok(),
        "a file not the index's is left alone"
    );
}

#[test]
fn delete_all_removes_every_index_file() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk);
    for seq in 0..12 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.sync().unwrap();
    disk.write_file(&dir().join("unrelated"), b"x").unwrap();
    ix.delete_all().unwrap();
    assert_eq!(disk.list(&dir()).unwrap(), ["unrelated"]);
}

#[test]
fn works_on_the_real_file_disk() {
    use crate::runtime::file_disk::FileDisk;
    let dir = std::env::temp_dir().join(format!("warren-qi-{}", std::process::id()));
    // A leftover of an earlier run with the same pid must not leak into this one.
    let (stale, _) = QueueIndex::open(FileDisk::new(), &dir, small_config()).unwrap();
    stale.delete_all().unwrap();
    let (mut ix, rec) = QueueIndex::open(FileDisk::new(), &dir, small_config()).unwrap();
    assert!(rec.entries.is_empty());
    for seq in 0..20 {
        ix.publish(msg(seq, true)).unwrap();
    }
    ix.deliver(19).unwrap();
    ix.ack(&[0, 1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    ix.sync().unwrap();
    drop(ix);
    let (ix, rec) = QueueIndex::open(FileDisk::new(), &dir, small_config()).unwrap();
    assert!(!rec.clean);
    let got: Vec<u64> = rec.entries.iter().map(|e| e.publish.seq).collect();
    assert_eq!(got, (9..20).collect::<Vec<_>>());
    assert!(rec.entries[10].delivered);
    assert_eq!(rec.entries[1].publish, msg(10, true));
    ix.close().unwrap();
    let (ix, rec) = QueueIndex::open(FileDisk::new(), &dir, small_config()).unwrap();
    assert!(rec.clean && rec.entries.len() == 11);
    assert_eq!(segment_files(&FileDisk::new(), &dir), ["1.idx", "2.idx"]);
    ix.delete_all().unwrap();
    assert!(FileDisk::new().list(&dir).unwrap().is_empty());
    FileDisk::new()
        .remove_dir(&dir)
        .expect("remove the test's folder");
}

#[path = "streaming_tests.rs"]
mod streaming;

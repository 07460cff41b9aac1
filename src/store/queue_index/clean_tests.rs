//! Tests of the clean path of [`QueueIndex::open`]: after a clean close the summary replaces
//! the scan and only the head segments are read; a summary that is stale, damaged or that
//! disagrees with the folder is never used (the open scans). That the clean path recovers
//! exactly what the scan does is checked at every clean reopen of the model test
//! (`model_tests.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::model_tests::{copy_folder, folder_files};
use super::open::LAST_OPEN_CLEAN_PATH;
use super::tests::{msg, recovered_all, small_config};
use super::*;
use crate::store::disk::{Disk, DiskError};
use crate::store::mem_disk::MemDisk;

/// A `MemDisk` that logs every operation as `"op file-name"`.
#[derive(Debug, Clone, Default)]
struct LoggingDisk {
    mem: MemDisk,
    log: Arc<Mutex<Vec<String>>>,
}

impl LoggingDisk {
    fn note(&self, op: &str, path: &Path) {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        self.log.lock().expect("log").push(format!("{op} {name}"));
    }

    /// The log so far, emptied.
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().expect("log"))
    }

    /// The files read since the last `take`, emptying the log.
    fn take_reads(&self) -> BTreeSet<String> {
        let log = self.take().into_iter();
        let reads = log.filter_map(|l| l.strip_prefix("read ").map(str::to_string));
        reads.collect()
    }
}

impl Disk for LoggingDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        self.mem.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        self.mem.list(dir)
    }
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        self.note("read", path);
        self.mem.read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        self.note("read", path);
        self.mem.read_at(path, offset, len)
    }
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.note("append", path);
        self.mem.append(path, data)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.note("write", path);
        self.mem.write_file(path, data)
    }
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        self.note("truncate", path);
        self.mem.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        self.note("rename", to);
        self.mem.rename(from, to)
    }
    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        self.note("remove", path);
        self.mem.remove(path)
    }
    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        self.note("sync", path);
        self.mem.sync(path)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.note("sync_dir", dir);
        self.mem.sync_dir(dir)
    }
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        self.mem.len(path)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.mem.remove_dir(dir)
    }
}

const E: u64 = 8;

fn dir() -> PathBuf {
    PathBuf::from("/queues/clean")
}

fn open<D: Disk + Clone>(disk: &D, head: usize) -> (QueueIndex<D>, Recovered) {
    let config = IndexConfig {
        recover_head_entries: head,
        ..small_config()
    };
    QueueIndex::open(disk.clone(), &dir(), config).expect("open")
}

fn clean_path() -> bool {
    LAST_OPEN_CLEAN_PATH.with(|c| c.get())
}

fn transient(seq: u64) -> bool {
    seq % 7 == 3
}

/// Publishes seqs 0..100 (13 segments; those with `seq % 7 == 3` transient), delivers and
/// acks a few; returns what a reopen must bring back (no transient message).
fn fill<D: Disk>(ix: &mut QueueIndex<D>) -> BTreeMap<u64, IndexEntry> {
    let mut model = BTreeMap::new();
    for seq in 0..100 {
        let p = msg(seq, !transient(seq));
        ix.publish(p.clone()).expect("publish");
        model.insert(
            seq,
            IndexEntry {
                publish: p,
                delivered: false,
            },
        );
    }
    for seq in [5, 20, 41, 50] {
        ix.deliver(seq).expect("deliver");
        model.get_mut(&seq).expect("live").delivered = true;
    }
    let acked = [0, 1, 2, 9, 50, 51];
    ix.ack(&acked).expect("ack");
    model.retain(|seq, _| !acked.contains(seq) && !transient(*seq));
    model
}

fn names<D: Disk>(disk: &D) -> Vec<String> {
    disk.list(&dir()).expect("list")
}

fn segment_names(segments: impl IntoIterator<Item = u64>) -> BTreeSet<String> {
    segments.into_iter().map(|n| format!("{n}.idx")).collect()
}

#[test]
fn a_clean_open_reads_only_the_head_segments() {
    let disk = LoggingDisk::default();
    let (mut ix, _) = open(&disk, 1);
    let expected = fill(&mut ix);
    ix.close().expect("close");
    disk.take();

    let (ix, rec) = open(&disk, 10);
    assert!(clean_path() && rec.clean && rec.damage.is_empty());
    // Segment 0 keeps 4 messages (0..3 acked, 3 transient), segment 1 brings the head to 10.
    let head: BTreeSet<u64> = rec.entries.iter().map(|x| x.publish.seq / E).collect();
    assert_eq!(head, BTreeSet::from([0, 1]));
    assert_eq!(rec.rest_from, 2 * E);
    let mut wanted: BTreeSet<String> = [META_FILE, CLEAN_FILE, SUMMARY_FILE]
        .map(String::from)
        .into();
    wanted.extend(segment_names(head));
    assert_eq!(disk.take_reads(), wanted, "only the head segments are read");
    let all = recovered_all(&ix, &rec);
    assert_eq!(all, expected.values().cloned().collect::<Vec<_>>());
    assert_eq!(rec.dropped_transient, 14);

    // A crash recovery, for contrast, reads every segment.
    drop(ix);
    disk.mem.crash();
    disk.take();
    let (ix, rec) = open(&disk, 10);
    assert!(!clean_path() && !rec.clean);
    let reads = disk.take_reads();
    assert!(reads.is_superset(&segment_names(0..13)), "{reads:?}");
    assert_eq!(recovered_all(&ix, &rec), all);
}

#[test]
fn close_writes_the_summary_before_the_marker_and_open_removes_both_first() {
    let disk = LoggingDisk::default();
    let (mut ix, _) = open(&disk, 1);
    fill(&mut ix);
    disk.take();
    ix.close().expect("close");
    let log = disk.take();
    let at = |op: &str| {
        let found = log.iter().position(|l| l == op);
        found.unwrap_or_else(|| panic!("no {op:?} in {log:?}"))
    };
    let dir_sync = format!(
        "sync_dir {}",
        dir().file_name().expect("name").to_string_lossy()
    );
    let summary_synced = at(&format!("sync {SUMMARY_FILE}"));
    assert!(at(&format!("write {SUMMARY_FILE}")) < summary_synced);
    let named = log[summary_synced..].iter().position(|l| *l == dir_sync);
    let named = summary_synced + named.expect("the summary's name is made durable");
    assert!(named < at(&format!("write {CLEAN_FILE}")));
    assert!(at(&format!("write {CLEAN_FILE}")) < at(&format!("sync {CLEAN_FILE}")));

    let (_ix, rec) = open(&disk, 1);
    assert!(clean_path() && rec.dropped_transient == 14);
    let log = disk.take();
    let changes = |l: &&String| !l.starts_with("read ") && !l.starts_with("sync_dir ");
    let first_change = log
        .iter()
        .filter(changes)
        .take(2)
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(
        first_change,
        [
            format!("remove {CLEAN_FILE}"),
            format!("remove {SUMMARY_FILE}")
        ]
    );
    let removed = at_in(&log, &format!("remove {SUMMARY_FILE}"));
    assert_eq!(
        log[removed + 1],
        dir_sync,
        "the removals are durable at once"
    );
    assert!(!names(&disk)
        .iter()
        .any(|n| n == CLEAN_FILE || n == SUMMARY_FILE));
}

fn at_in(log: &[String], op: &str) -> usize {
    let found = log.iter().position(|l| l == op);
    found.unwrap_or_else(|| panic!("no {op:?} in {log:?}"))
}

#[test]
fn a_stale_summary_is_never_used() {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk, 1);
    let mut model = fill(&mut ix);
    ix.close().expect("close");
    let (ix, rec) = open(&disk, 1);
    assert!(clean_path() && rec.clean);
    let after_clean = recovered_all(&ix, &rec);

    // A crash right after the clean open is a crash, and finds the same queue.
    drop(ix);
    disk.crash();
    let (ix, rec) = open(&disk, 1);
    assert!(!clean_path() && !rec.clean && rec.damage.is_empty());
    assert_eq!(recovered_all(&ix, &rec), after_clean);

    // Another clean cycle, then writes (synced) and a crash.
    ix.close().expect("close");
    let (mut ix, rec) = open(&disk, 3);
    assert!(clean_path() && rec.clean);
    let p = msg(100, true);
    ix.publish(p.clone()).expect("publish");
    ix.deliver(30).expect("deliver");
    ix.ack(&[4, 60]).expect("ack");
    ix.flush_journal().expect("flush");
    ix.ack(&[99]).expect("ack");
    ix.sync().expect("sync");
    model.insert(
        100,
        IndexEntry {
            publish: p,
            delivered: false,
        },
    );
    model.get_mut(&30).expect("live").delivered = true;
    for seq in [4, 60, 99] {
        model.remove(&seq).expect("live");
    }
    drop(ix);
    disk.crash();
    let (ix, rec) = open(&disk, 3);
    assert!(!clean_path() && !rec.clean && rec.damage.is_empty());
    let all = recovered_all(&ix, &rec);
    assert_eq!(all, model.values().cloned().collect::<Vec<_>>());
}

#[test]
fn a_summary_without_its_marker_is_ignored_and_removed() {
    // A crash in the close after the summary was written, before the marker was.
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk, 1);
    let model = fill(&mut ix);
    ix.close().expect("close");
    disk.remove(&dir().join(CLEAN_FILE)).expect("remove");
    disk.sync_dir(&dir()).expect("sync dir");
    let (ix, rec) = open(&disk, 1);
    assert!(!clean_path() && !rec.clean && rec.damage.is_empty());
    assert!(!names(&disk).iter().any(|n| n == SUMMARY_FILE));
    let all = recovered_all(&ix, &rec);
    assert_eq!(all, model.values().cloned().collect::<Vec<_>>());
}

#[test]
fn a_close_that_cannot_sum_up_a_segment_leaves_no_summary() {
    let (disk, _) = closed();
    let (mut ix, _) = open(&disk, 1);
    assert!(clean_path());
    // An ack drops segment 5's tally; then its file loses its first record (publish 40), so
    // the close cannot tally it again.
    ix.ack(&[44]).expect("ack");
    disk.corrupt(&dir().join("5.idx"), 10);
    ix.close().expect("close");
    let names = names(&disk);
    assert!(names.iter().any(|n| n == CLEAN_FILE));
    assert!(!names.iter().any(|n| n == SUMMARY_FILE));
    let (_, rec) = open(&disk, 1);
    assert!(!clean_path());
    assert!(
        matches!(rec.damage[..], [Damage::Segment { segment: 5, .. }, ..]),
        "{:?}",
        rec.damage
    );
}

/// A cleanly closed folder (see `fill`) and what it holds.
fn closed() -> (MemDisk, Vec<IndexEntry>) {
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk, 1);
    let model = fill(&mut ix);
    ix.close().expect("close");
    (disk, model.into_values().collect())
}

/// A copy of `disk`'s folder, changed by `change`, opened.
fn open_changed(
    disk: &MemDisk,
    head: usize,
    change: impl FnOnce(&MemDisk),
) -> (QueueIndex<MemDisk>, Recovered) {
    let copy = MemDisk::new();
    copy_folder(disk, &copy, &dir(), &[]);
    change(&copy);
    open(&copy, head)
}

/// A change made to a copy of a folder.
type Change = Box<dyn Fn(&MemDisk)>;

#[test]
fn a_damaged_summary_means_a_scan() {
    let (disk, expected) = closed();
    let path = dir().join(SUMMARY_FILE);
    let len = disk.len(&path).expect("len").expect("a summary") as usize;
    let mut cases: Vec<Change> = Vec::new();
    for at in [0, 5, 9, 30, len / 2, len - 1] {
        let path = path.clone();
        cases.push(Box::new(move |d| d.corrupt(&path, at)));
    }
    for keep in [0, 40, len - 1] {
        let path = path.clone();
        cases.push(Box::new(move |d| {
            let bytes = d.read(&path).expect("read");
            d.write_file(&path, &bytes[..keep]).expect("write");
            d.sync(&path).expect("sync");
        }));
    }
    for change in cases {
        let (ix, rec) = open_changed(&disk, 2, change);
        assert!(!clean_path());
        assert!(
            matches!(rec.damage[..], [Damage::Summary { .. }]),
            "{:?}",
            rec.damage
        );
        assert!(rec.clean, "the scan still finds what clean.dot says");
        assert_eq!(recovered_all(&ix, &rec), expected);
    }
}

#[test]
fn a_summary_that_disagrees_with_the_folder_means_a_scan() {
    let (disk, expected) = closed();
    let journal = dir().join(JOURNAL_FILE);
    let put = |d: &MemDisk, name: &str, bytes: &[u8]| {
        let path = dir().join(name);
        d.write_file(&path, bytes).expect("write");
        d.sync(&path).expect("sync");
        d.sync_dir(&dir()).expect("sync dir");
    };

    // A deliver in the journal after the close.
    let (ix, rec) = open_changed(&disk, 2, |d| {
        let mut bytes = Vec::new();
        codec::encode_deliver(&mut bytes, 7);
        put(d, JOURNAL_FILE, &bytes);
    });
    let reason = "the journal is not empty";
    assert_eq!(rec.damage, [Damage::Summary { reason }]);
    assert!(!clean_path() && rec.clean);
    let mut delivered = expected.clone();
    delivered
        .iter_mut()
        .find(|e| e.publish.seq == 7)
        .expect("7")
        .delivered = true;
    assert_eq!(recovered_all(&ix, &rec), delivered);
    assert_eq!(
        disk.len(&journal).expect("len"),
        Some(0),
        "the original is intact"
    );

    // A segment file more, and one less.
    let (ix, rec) = open_changed(&disk, 2, |d| {
        let mut bytes = Vec::new();
        codec::encode_publish(&mut bytes, &msg(20 * E, true));
        put(d, "20.idx", &bytes);
    });
    let reason = "segment files differ";
    assert_eq!(rec.damage[0], Damage::Summary { reason });
    assert!(!clean_path() && !rec.clean);
    assert_eq!(recovered_all(&ix, &rec).len(), expected.len() + 1);
    assert_eq!(ix.bounds().1, 20 * E + 1);
    let (ix, rec) = open_changed(&disk, 2, |d| {
        d.remove(&dir().join("5.idx")).expect("remove");
    });
    assert_eq!(rec.damage[0], Damage::Summary { reason });
    assert!(!clean_path() && !rec.clean);
    let lost = expected.iter().filter(|e| e.publish.seq / E == 5).count();
    assert_eq!(recovered_all(&ix, &rec).len(), expected.len() - lost);

    // A marker of another close, and another segment size.
    let (ix, rec) = open_changed(&disk, 2, |d| {
        let m = codec::CleanMarker {
            next_seq: 100,
            unacked: 80,
        };
        put(d, CLEAN_FILE, &codec::encode_clean(m));
    });
    let reason = "does not match clean.dot";
    assert_eq!(rec.damage[0], Damage::Summary { reason });
    assert!(!clean_path() && !rec.clean);
    assert_eq!(recovered_all(&ix, &rec), expected);
    let (_, rec) = open_changed(&disk, 2, |d| put(d, META_FILE, &codec::encode_meta(16)));
    let reason = "segment size differs from the folder's";
    assert_eq!(rec.damage[0], Damage::Summary { reason });
    assert!(!clean_path());
}

#[test]
fn a_damaged_head_segment_sends_the_open_to_the_scan() {
    let (disk, expected) = closed();
    let seg0 = dir().join("0.idx");
    let len = disk.len(&seg0).expect("len").expect("segment 0") as usize;
    let (ix, rec) = open_changed(&disk, 1, |d| d.corrupt(&seg0, len - 2));
    assert!(!clean_path());
    assert!(matches!(rec.damage[0], Damage::Segment { segment: 0, .. }));
    assert!(!rec
        .damage
        .iter()
        .any(|d| matches!(d, Damage::Summary { .. })));
    let all = recovered_all(&ix, &rec);
    assert_ne!(all, expected, "a record of segment 0 is lost");

    // Damage in a segment the clean open does not read waits for the next scan, which
    // reports and repairs it.
    let copy = MemDisk::new();
    copy_folder(&disk, &copy, &dir(), &[]);
    let seg9 = dir().join("9.idx");
    let len = copy.len(&seg9).expect("len").expect("segment 9") as usize;
    copy.corrupt(&seg9, len - 2);
    let (ix, rec) = open(&copy, 1);
    assert!(clean_path() && rec.damage.is_empty());
    drop(ix);
    let (_, rec) = open(&copy, 1);
    assert!(!clean_path());
    assert!(matches!(
        rec.damage[..],
        [Damage::Segment { segment: 9, .. }]
    ));
}

#[test]
fn transient_messages_are_dropped_as_the_scan_drops_them() {
    let (disk, expected) = closed();
    let scanned = MemDisk::new();
    copy_folder(&disk, &scanned, &dir(), &[SUMMARY_FILE]);
    let (a, rec_a) = open(&disk, 4);
    assert!(clean_path());
    let (b, rec_b) = open(&scanned, 4);
    assert!(!clean_path());
    assert_eq!(rec_a, rec_b);
    assert_eq!(rec_a.dropped_transient, 14);
    assert_eq!(a.state.live_view(), b.state.live_view());
    assert_eq!(folder_files(&disk, &dir()), folder_files(&scanned, &dir()));
    assert_eq!(recovered_all(&a, &rec_a), expected);
    // The drops are on disk: the next opens drop nothing.
    a.close().expect("close");
    let (_, rec) = open(&disk, 4);
    assert!(clean_path() && rec.dropped_transient == 0);
    drop(b);
    let (_, rec) = open(&scanned, 4);
    assert_eq!(rec.dropped_transient, 0);
}

#[test]
fn a_segment_acked_after_the_open_is_tallied_again_at_the_close() {
    let (disk, mut expected) = closed();
    let (mut ix, _) = open(&disk, 1);
    assert!(clean_path());
    // Acks drop the tallies of segments 3 and 7; a publish adds to segment 12's.
    ix.ack(&[25, 58]).expect("ack");
    expected.retain(|e| ![25, 58].contains(&e.publish.seq));
    let p = msg(100, true);
    ix.publish(p.clone()).expect("publish");
    expected.push(IndexEntry {
        publish: p,
        delivered: false,
    });
    ix.close().expect("close");
    let scanned = MemDisk::new();
    copy_folder(&disk, &scanned, &dir(), &[SUMMARY_FILE]);
    let (ix, rec) = open(&disk, 1);
    assert!(clean_path());
    let (ix_b, rec_b) = open(&scanned, 1);
    assert_eq!(rec, rec_b);
    assert_eq!(ix.state.live_view(), ix_b.state.live_view());
    assert_eq!(recovered_all(&ix, &rec), expected);
}

#[test]
fn an_open_that_keeps_transient_messages_keeps_them_on_both_paths() {
    // fill()'s model leaves the transient messages out: here they stay.
    let disk = MemDisk::new();
    let (mut ix, _) = open(&disk, 1);
    fill(&mut ix);
    let acked = [0, 1, 2, 9, 50, 51];
    ix.close().expect("close");
    let scanned = MemDisk::new();
    copy_folder(&disk, &scanned, &dir(), &[SUMMARY_FILE]);
    let keep = IndexConfig {
        keep_transient: true,
        ..small_config()
    };
    let (a, rec_a) = QueueIndex::open(disk.clone(), &dir(), keep.clone()).expect("open");
    assert!(clean_path());
    let (b, rec_b) = QueueIndex::open(scanned.clone(), &dir(), keep).expect("open");
    assert!(!clean_path());
    assert_eq!(rec_a.dropped_transient, 0);
    assert_eq!(rec_b.dropped_transient, 0);
    let live: Vec<(u64, bool)> = (0..100)
        .filter(|s| !acked.contains(s))
        .map(|s| (s, !transient(s)))
        .collect();
    for (ix, rec) in [(&a, &rec_a), (&b, &rec_b)] {
        let got: Vec<(u64, bool)> = recovered_all(ix, rec)
            .iter()
            .map(|e| (e.publish.seq, e.publish.persistent))
            .collect();
        assert_eq!(got, live);
    }
    // A later ordinary open drops them, as a node's start does.
    a.close().expect("close");
    let (_, rec) = open(&disk, 100);
    assert_eq!(rec.dropped_transient, 14);
    drop(b);
    let (_, rec) = open(&scanned, 100);
    assert_eq!(rec.dropped_transient, 14);
}

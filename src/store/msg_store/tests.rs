//! Driver tests: the store over [`MemDisk`] (group commit, cancelled writes, faults, crashes
//! at every step of compaction and close, corruption), and one run on the real `FileDisk`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;
use crate::store::disk::{Disk, DiskError};
use crate::store::mem_disk::MemDisk;

pub(super) fn id(n: u32) -> MsgId {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    MsgId(b)
}

/// A body that differs per id, so a mixed-up read shows.
pub(super) fn body(n: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (n as usize * 31 + i) as u8).collect()
}

pub(super) fn dir() -> PathBuf {
    PathBuf::from("/vhost/msg_store_persistent")
}

pub(super) fn config(limit: u64) -> MsgStoreConfig {
    MsgStoreConfig {
        file_size_limit: limit,
        ..MsgStoreConfig::default()
    }
}

fn open<D: Disk>(disk: D, cfg: MsgStoreConfig) -> (MsgStore<D>, RecoveryReport) {
    MsgStore::open(disk, dir(), cfg).expect("open")
}

fn read(store: &MsgStore<impl Disk>, n: u32) -> Option<Vec<u8>> {
    store.read(id(n)).expect("read")
}

/// A disk that counts mutating calls, fsyncs and bytes read, and can "die" after a budget of
/// mutating calls (every later one fails), to stop the store at any step.
#[derive(Debug, Clone)]
struct Probe {
    inner: MemDisk,
    writes: Arc<AtomicUsize>,
    syncs: Arc<AtomicUsize>,
    read_bytes: Arc<AtomicUsize>,
    budget: Arc<AtomicI64>,
}

impl Probe {
    fn new(inner: MemDisk) -> Probe {
        Probe {
            inner,
            writes: Arc::default(),
            syncs: Arc::default(),
            read_bytes: Arc::default(),
            budget: Arc::new(AtomicI64::new(i64::MAX)),
        }
    }

    fn counts(&self) -> (usize, usize) {
        (
            self.writes.load(Ordering::SeqCst),
            self.syncs.load(Ordering::SeqCst),
        )
    }

    fn reset(&self) {
        self.writes.store(0, Ordering::SeqCst);
        self.syncs.store(0, Ordering::SeqCst);
    }

    fn step(&self, path: &Path, sync: bool) -> Result<(), DiskError> {
        if self.budget.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(DiskError::Io {
                op: "probe",
                path: path.to_path_buf(),
                source: std::io::Error::other("the process died here"),
            });
        }
        let counter = if sync { &self.syncs } else { &self.writes };
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Disk for Probe {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        self.inner.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        self.inner.list(dir)
    }
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        let data = self.inner.read(path)?;
        self.read_bytes.fetch_add(data.len(), Ordering::SeqCst);
        Ok(data)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        let data = self.inner.read_at(path, offset, len)?;
        self.read_bytes.fetch_add(data.len(), Ordering::SeqCst);
        Ok(data)
    }
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.step(path, false)?;
        self.inner.append(path, data)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.step(path, false)?;
        self.inner.write_file(path, data)
    }
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        self.step(path, false)?;
        self.inner.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        self.step(from, false)?;
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        self.step(path, false)?;
        self.inner.remove(path)
    }
    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        self.step(path, true)?;
        self.inner.sync(path)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.step(dir, true)?;
        self.inner.sync_dir(dir)
    }
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        self.inner.len(path)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.inner.remove_dir(dir)
    }
}

#[test]
fn file_names_sort_numerically_and_parse_back() {
    assert_eq!(file_name(42), "00000000000000000042.rdq");
    assert_eq!(parse_file_name(&file_name(u64::MAX)), Some(u64::MAX));
    for bad in [
        "42.rdq",
        "clean.dot",
        "0000000000000000004x.rdq",
        "00000000000000000042",
    ] {
        assert_eq!(parse_file_name(bad), None, "{bad}");
    }
}

#[test]
fn encode_record_is_the_record_framing_of_id_and_body() {
    let mut ours = Vec::new();
    encode_record(&mut ours, id(7), b"hello");
    let mut framed = Vec::new();
    crate::store::record::encode(&mut framed, &[&id(7).0[..], b"hello"].concat());
    assert_eq!(ours, framed);
    assert_eq!(ours.len() as u32, record_size(5).expect("small"));
    assert_eq!(decode_record(&ours, id(7)), Some(&b"hello"[..]));
    assert_eq!(decode_record(&ours, id(8)), None);
}

#[test]
fn write_read_remove_with_reference_counts() {
    let disk = MemDisk::new();
    let (mut s, report) = open(disk.clone(), config(1 << 20));
    assert!(!report.clean && report.files == 0);
    s.write(id(1), &body(1, 50)).expect("write");
    s.write(id(1), &body(1, 50)).expect("write");
    assert_eq!(s.ref_count(id(1)), 2);
    assert_eq!(read(&s, 1), Some(body(1, 50)), "served from the cache");
    s.flush().expect("flush");
    assert_eq!(read(&s, 1), Some(body(1, 50)), "served from the file");
    assert_eq!(
        s.remove(id(1)).expect("remove"),
        Removed::Decremented { ref_count: 1 }
    );
    assert!(matches!(
        s.remove(id(1)).expect("remove"),
        Removed::Garbage { file: 0, .. }
    ));
    assert!(!s.contains(id(1)));
    assert_eq!(read(&s, 1), None);
    assert_eq!(s.remove(id(1)).expect("remove"), Removed::Unknown);
}

#[test]
fn a_body_written_in_pieces_is_stored_as_the_whole_body() {
    let (whole, pieces) = (MemDisk::new(), MemDisk::new());
    let (mut a, _) = open(whole.clone(), config(1 << 20));
    let (mut b, _) = open(pieces.clone(), config(1 << 20));
    let full = body(3, 5000);
    a.write(id(3), &full).expect("write");
    let (head, tail) = full.split_at(17);
    b.write_pieces(
        id(3),
        bytes::Bytes::copy_from_slice(head),
        bytes::Bytes::copy_from_slice(tail),
    )
    .expect("write");
    assert_eq!(read(&b, 3), Some(full.clone()), "served from the cache");
    a.sync().expect("sync");
    b.sync().expect("sync");
    assert_eq!(read(&b, 3), Some(full), "served from the file");
    let file = dir().join(file_name(0));
    assert_eq!(
        pieces.read(&file).expect("file"),
        whole.read(&file).expect("file")
    );
}

#[test]
fn a_write_removed_before_its_flush_costs_no_io() {
    let probe = Probe::new(MemDisk::new());
    let (mut s, _) = open(probe.clone(), config(1 << 20));
    probe.reset();
    for n in 0..10 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    for n in 0..10 {
        assert_eq!(s.remove(id(n)).expect("remove"), Removed::Cancelled);
    }
    s.sync().expect("sync");
    assert_eq!(probe.counts(), (0, 0), "no append, no fsync");
    s.write(id(1), &body(1, 10)).expect("write");
    s.write(id(2), &body(2, 10)).expect("write");
    s.remove(id(2)).expect("remove");
    s.sync().expect("sync");
    assert_eq!(
        probe.counts(),
        (1, 2),
        "one append; fsync of the file and the folder"
    );
    let len = probe.inner.len(&dir().join(file_name(0))).expect("len");
    assert_eq!(len, Some(u64::from(record_size(10).expect("small"))));
}

#[test]
fn many_writes_share_one_append_and_one_fsync() {
    let probe = Probe::new(MemDisk::new());
    let (mut s, _) = open(probe.clone(), config(1 << 20));
    probe.reset();
    for n in 0..100 {
        s.write(id(n), &body(n, 64)).expect("write");
    }
    s.sync().expect("sync");
    assert_eq!(probe.counts(), (1, 2));
    probe.reset();
    for n in 100..200 {
        s.write(id(n), &body(n, 64)).expect("write");
    }
    s.sync().expect("sync");
    assert_eq!(probe.counts(), (1, 1), "the file exists: no folder sync");
}

#[test]
fn a_full_write_buffer_flushes_by_itself() {
    let disk = MemDisk::new();
    let cfg = MsgStoreConfig {
        write_buffer_max_bytes: 1000,
        ..config(1 << 20)
    };
    let (mut s, _) = open(disk, cfg);
    // 124-byte records: eight stay below the bound, the ninth reaches it.
    for n in 0..8 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    assert_eq!(s.buffered_bytes(), 8 * 124);
    s.write(id(8), &body(8, 100)).expect("write");
    assert_eq!(s.buffered_bytes(), 0);
}

#[test]
fn files_roll_over_at_the_size_limit() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    for n in 0..20 {
        s.write(id(n), &body(n, 200)).expect("write");
    }
    s.sync().expect("sync");
    let files = disk.list(&dir()).expect("list");
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        assert!(disk.len(&dir().join(f)).expect("len").unwrap_or(0) <= 1024);
    }
    drop(s);
    disk.crash();
    let (s, report) = open(disk.clone(), config(1024));
    assert_eq!((report.files, report.messages), (files.len(), 20));
    for n in 0..20 {
        assert_eq!(read(&s, n), Some(body(n, 200)));
    }
}

#[test]
fn compaction_reclaims_garbage_and_keeps_live_messages() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    for n in 0..40 {
        s.write(id(n), &body(n, 150)).expect("write");
    }
    s.sync().expect("sync");
    let live: Vec<u32> = (0..40).filter(|n| n % 4 == 0).collect();
    for n in (0..40).filter(|n| n % 4 != 0) {
        s.remove(id(n)).expect("remove");
    }
    assert!(s.compaction_due());
    let before = disk.list(&dir()).expect("list").len();
    let report = s.compact().expect("compact");
    assert!(
        !report.files_removed.is_empty() && report.records_moved > 0,
        "{report:?}"
    );
    assert!(report.corrupt.is_empty());
    assert!(disk.list(&dir()).expect("list").len() < before);
    // Copies may leave the previous current file behind half-empty; repeated runs converge.
    for _ in 0..5 {
        s.compact().expect("compact");
    }
    assert!(!s.compaction_due());
    for &n in &live {
        assert_eq!(read(&s, n), Some(body(n, 150)));
    }
    drop(s);
    disk.crash();
    let (mut s, report) = open(disk.clone(), config(1024));
    assert!(report.damaged.is_empty());
    let refs = s.retain_only(live.iter().map(|n| id(*n))).expect("retain");
    assert!(refs.missing.is_empty(), "{refs:?}");
    for &n in &live {
        assert_eq!(read(&s, n), Some(body(n, 150)));
    }
}

#[test]
fn compaction_reads_only_the_live_records_of_a_mostly_garbage_file() {
    let probe = Probe::new(MemDisk::new());
    let (mut s, _) = open(probe.clone(), config(4096));
    for n in 0..40 {
        s.write(id(n), &body(n, 180)).expect("write");
    }
    s.sync().expect("sync");
    let located = |s: &MsgStore<Probe>, n: u32| match s.index().entry(&id(n)).expect("stored").slot
    {
        Slot::Stored(loc) => loc,
        Slot::Pending { .. } => panic!("{n} not flushed"),
    };
    let first: Vec<u32> = (0..40).filter(|n| located(&s, *n).file == 0).collect();
    assert!(first.len() >= 10, "file 0 holds {first:?}");
    // Three live records in file 0: two adjacent (one read), one apart.
    let keep = [first[2], first[3], first[first.len() - 2]];
    let live_bytes: usize = keep
        .iter()
        .map(|n| located(&s, *n).total_size as usize)
        .sum();
    for &n in first.iter().filter(|n| !keep.contains(n)) {
        s.remove(id(n)).expect("remove");
    }
    assert_eq!(s.index().compaction_candidates(0.5), vec![0]);
    probe.read_bytes.store(0, Ordering::SeqCst);
    let report = s.compact().expect("compact");
    assert_eq!((report.files_removed, report.records_moved), (vec![0], 3));
    assert_eq!(probe.read_bytes.load(Ordering::SeqCst), live_bytes);
    for n in 0..40 {
        let kept = !first.contains(&n) || keep.contains(&n);
        assert_eq!(read(&s, n), kept.then(|| body(n, 180)), "id {n}");
    }

    // A file compacted while mostly live (a lower garbage threshold) is read whole.
    drop(s);
    let probe = Probe::new(MemDisk::new());
    let (mut s, _) = open(
        probe.clone(),
        MsgStoreConfig {
            garbage_fraction: 0.1,
            ..config(4096)
        },
    );
    let file = s.index().current_file();
    for n in 100..140 {
        s.write(id(n), &body(n, 180)).expect("write");
    }
    s.sync().expect("sync");
    let total = s.index().file_summary(file).expect("file").total_bytes as usize;
    let gone: Vec<u32> = (100..140)
        .filter(|n| located(&s, *n).file == file)
        .take(3)
        .collect();
    for &n in &gone {
        s.remove(id(n)).expect("remove");
    }
    probe.read_bytes.store(0, Ordering::SeqCst);
    s.compact().expect("compact");
    assert!(probe.read_bytes.load(Ordering::SeqCst) >= total);
    for n in 100..140 {
        assert_eq!(
            read(&s, n),
            (!gone.contains(&n)).then(|| body(n, 180)),
            "id {n}"
        );
    }
}

/// Builds a store over `probe` with four files of four records: file 0 and 2 mostly garbage,
/// file 1 half, file 2 wholly. Returns the live ids with their counts.
fn garbage_heavy(probe: &Probe) -> (MsgStore<Probe>, Vec<(u32, u32)>) {
    let (mut s, _) = open(probe.clone(), config(600));
    let live = vec![(0, 2), (4, 1), (5, 1), (12, 2)];
    for n in 0..16 {
        s.write(id(n), &body(n, 120)).expect("write");
    }
    s.sync().expect("sync");
    for n in 0..16 {
        let count = live.iter().find(|(l, _)| *l == n).map_or(0, |(_, c)| *c);
        match count {
            0 => drop(s.remove(id(n)).expect("remove")),
            2 => s.write(id(n), &body(n, 120)).expect("write"),
            _ => {}
        }
    }
    assert_eq!(s.index().compaction_candidates(0.5), vec![0, 2]);
    (s, live)
}

fn assert_all_there(disk: &MemDisk, live: &[(u32, u32)]) {
    let (mut s, report) = open(disk.clone(), config(600));
    if !report.clean {
        let refs = s
            .set_ref_counts(live.iter().map(|(n, c)| (id(*n), *c)))
            .expect("set counts");
        assert!(refs.missing.is_empty(), "lost {:?}", refs.missing);
    }
    assert_eq!(s.len(), live.len());
    for &(n, c) in live {
        assert_eq!(s.ref_count(id(n)), c);
        assert_eq!(read(&s, n), Some(body(n, 120)), "id {n}");
    }
}

#[test]
fn a_crash_at_any_step_of_compaction_loses_nothing() {
    for budget in 0.. {
        let disk = MemDisk::new();
        let probe = Probe::new(disk.clone());
        let (mut s, live) = garbage_heavy(&probe);
        probe.budget.store(budget, Ordering::SeqCst);
        let done = s.compact().is_ok();
        drop(s);
        disk.crash();
        assert_all_there(&disk, &live);
        if done {
            assert!(budget > 3, "compaction did some work");
            break;
        }
    }
}

#[test]
fn a_crash_at_any_step_of_close_loses_nothing() {
    for budget in 0.. {
        let disk = MemDisk::new();
        let probe = Probe::new(disk.clone());
        let (s, live) = garbage_heavy(&probe);
        probe.budget.store(budget, Ordering::SeqCst);
        let done = s.close().is_ok();
        disk.crash();
        assert_all_there(&disk, &live);
        if done {
            let (_, report) = open(disk.clone(), config(600));
            assert!(
                !report.clean,
                "the marker was consumed by the previous open"
            );
            break;
        }
    }
}

#[test]
fn a_clean_shutdown_is_trusted_once() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    for n in 0..10 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    s.write(id(3), &body(3, 100)).expect("write");
    s.close().expect("close");
    let (s, report) = open(disk.clone(), config(1024));
    assert!(report.clean && report.records_scanned == 0, "{report:?}");
    assert_eq!(s.ref_count(id(3)), 2, "counts survive a clean shutdown");
    assert_eq!(read(&s, 9), Some(body(9, 100)));
    let names = disk.list(&dir()).expect("list");
    assert!(
        !names.iter().any(|n| n == CLEAN_MARKER || n == SAVED_INDEX),
        "{names:?}"
    );
    drop(s);
    let (s, report) = open(disk.clone(), config(1024));
    assert!(!report.clean);
    assert_eq!((s.len(), s.ref_count(id(3))), (10, 1));
}

#[test]
fn dirty_recovery_counts_one_until_the_owner_sets_counts() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    for n in 0..3 {
        s.write(id(n), &body(n, 10)).expect("write");
        s.write(id(n), &body(n, 10)).expect("write");
    }
    s.sync().expect("sync");
    drop(s);
    disk.crash();
    let (mut s, report) = open(disk.clone(), config(1024));
    assert_eq!((report.messages, s.ref_count(id(0))), (3, 1));
    let refs = s.retain_only([id(0), id(0), id(1), id(9)]).expect("retain");
    assert_eq!(refs.dropped, vec![id(2)]);
    assert_eq!(refs.missing, vec![id(9)]);
    assert_eq!((s.ref_count(id(0)), s.ref_count(id(1))), (2, 1));
    assert!(!s.contains(id(2)));
}

#[test]
fn the_transient_store_is_wiped_on_open() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    s.write(id(1), b"transient").expect("write");
    s.close().expect("close");
    let cfg = MsgStoreConfig {
        wipe_on_open: true,
        ..config(1024)
    };
    let (s, report) = open(disk.clone(), cfg);
    assert!(report.wiped && s.is_empty());
    assert!(disk.list(&dir()).expect("list").is_empty());
}

#[test]
fn stray_files_are_reported_and_left_alone() {
    let disk = MemDisk::new();
    disk.write_file(&dir().join("README"), b"hi")
        .expect("write");
    let (_, report) = open(disk.clone(), config(1024));
    assert_eq!(report.ignored, vec!["README".to_string()]);
    assert!(disk.read(&dir().join("README")).is_ok());
}

#[test]
fn oversized_messages_are_refused() {
    let (mut s, _) = open(MemDisk::new(), config(1024));
    let size = crate::store::record::RECORD_PAYLOAD_MAX;
    assert!(matches!(
        record_size(size),
        Err(MsgStoreError::TooLarge { .. })
    ));
    assert!(record_size(size - MsgId::LEN).is_ok());
    s.write(id(1), b"fine").expect("write");
}

#[path = "fault_tests.rs"]
mod faults;

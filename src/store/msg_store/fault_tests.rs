//! Fault tests: failed fsync, short write, full disk, corrupt bytes; and the real `FileDisk`.

use super::*;

#[test]
fn a_failed_fsync_is_fatal() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    s.write(id(1), &body(1, 100)).expect("write");
    s.sync().expect("sync");
    s.write(id(2), &body(2, 100)).expect("write");
    disk.fail_next_sync();
    assert!(matches!(s.sync(), Err(MsgStoreError::Disk(_))));
    assert!(s.is_failed());
    assert!(matches!(s.write(id(3), b"x"), Err(MsgStoreError::Failed)));
    assert!(matches!(s.remove(id(1)), Err(MsgStoreError::Failed)));
    assert!(matches!(s.flush(), Err(MsgStoreError::Failed)));
    assert!(matches!(s.sync(), Err(MsgStoreError::Failed)));
    assert!(matches!(s.compact(), Err(MsgStoreError::Failed)));
    assert_eq!(read(&s, 1), Some(body(1, 100)), "reads still work");
    assert!(matches!(s.close(), Err(MsgStoreError::Failed)));
    let names = disk.list(&dir()).expect("list");
    assert!(!names.iter().any(|n| n == CLEAN_MARKER), "{names:?}");
    disk.crash();
    let (s, report) = open(disk.clone(), config(1024));
    assert!(!report.clean);
    assert_eq!(read(&s, 1), Some(body(1, 100)));
}

#[test]
fn a_short_write_is_cut_back_and_retried() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1 << 20));
    s.write(id(1), &body(1, 100)).expect("write");
    s.sync().expect("sync");
    let path = dir().join(file_name(0));
    let synced_len = disk.len(&path).expect("len");
    s.write(id(2), &body(2, 100)).expect("write");
    disk.short_next_write();
    assert!(matches!(
        s.flush(),
        Err(MsgStoreError::Disk(DiskError::ShortWrite { .. }))
    ));
    assert!(!s.is_failed());
    assert_eq!(disk.len(&path).expect("len"), synced_len, "half record cut");
    assert_eq!(read(&s, 2), Some(body(2, 100)), "still cached");
    s.sync().expect("the retry succeeds");
    drop(s);
    disk.crash();
    let (s, report) = open(disk.clone(), config(1 << 20));
    assert!(report.damaged.is_empty(), "{report:?}");
    assert_eq!(read(&s, 1), Some(body(1, 100)));
    assert_eq!(read(&s, 2), Some(body(2, 100)));
}

#[test]
fn a_full_disk_refuses_the_flush_and_keeps_what_was_synced() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    for n in 0..3 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    s.sync().expect("sync");
    disk.set_capacity(Some(500));
    for n in 3..8 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    assert!(matches!(
        s.sync(),
        Err(MsgStoreError::Disk(DiskError::Full { .. }))
    ));
    assert!(!s.is_failed());
    for n in 0..8 {
        assert_eq!(read(&s, n), Some(body(n, 100)));
    }
    disk.set_capacity(None);
    s.sync().expect("space again");
    drop(s);
    disk.crash();
    let (s, report) = open(disk.clone(), config(1024));
    assert!(report.damaged.is_empty());
    for n in 0..8 {
        assert_eq!(read(&s, n), Some(body(n, 100)));
    }
}

#[test]
fn a_corrupt_byte_mid_file_is_cut_and_reported() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1 << 20));
    for n in 0..10 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    s.sync().expect("sync");
    drop(s);
    let rec = u64::from(record_size(100).expect("small"));
    let path = dir().join(file_name(0));
    disk.corrupt(&path, (5 * rec + 30) as usize);
    let (mut s, report) = open(disk.clone(), config(1 << 20));
    assert_eq!(
        report.damaged,
        vec![DamagedFile {
            file: 0,
            bytes_cut: 5 * rec,
            records_kept: 5
        }]
    );
    assert_eq!(report.messages, 5);
    for n in 0..5 {
        assert_eq!(read(&s, n), Some(body(n, 100)));
    }
    assert!(!s.contains(id(7)));
    s.write(id(20), &body(20, 100)).expect("write");
    s.sync().expect("sync");
    drop(s);
    disk.crash();
    let (s, report) = open(disk.clone(), config(1 << 20));
    assert!(report.damaged.is_empty());
    assert_eq!(read(&s, 20), Some(body(20, 100)));
}

#[test]
fn a_torn_tail_of_any_length_is_cut() {
    let rec = record_size(50).expect("small") as usize;
    for cut in 1..rec {
        let disk = MemDisk::new();
        let (mut s, _) = open(disk.clone(), config(1 << 20));
        s.write(id(1), &body(1, 50)).expect("write");
        s.write(id(2), &body(2, 50)).expect("write");
        s.sync().expect("sync");
        drop(s);
        let path = dir().join(file_name(0));
        disk.truncate(&path, (2 * rec - cut) as u64)
            .expect("truncate");
        let (s, report) = open(disk.clone(), config(1 << 20));
        assert_eq!(report.damaged[0].bytes_cut, (rec - cut) as u64);
        assert_eq!((read(&s, 1), s.contains(id(2))), (Some(body(1, 50)), false));
    }
}

#[test]
fn corruption_after_a_clean_shutdown_surfaces_on_read() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(400));
    for n in 0..4 {
        s.write(id(n), &body(n, 100)).expect("write");
    }
    s.close().expect("close");
    // Records 0 to 2 are in file 0; flip a byte of record 1's body.
    let rec = u64::from(record_size(100).expect("small"));
    disk.corrupt(&dir().join(file_name(0)), (rec + 50) as usize);
    let (mut s, report) = open(disk.clone(), config(400));
    assert!(report.clean);
    assert!(matches!(s.read(id(1)), Err(MsgStoreError::Corrupt { .. })));
    assert_eq!(read(&s, 0), Some(body(0, 100)));
    // Compaction refuses to copy the bad record and drops it.
    s.remove(id(0)).expect("remove");
    s.remove(id(2)).expect("remove");
    let report = s.compact().expect("compact");
    assert_eq!(report.corrupt, vec![id(1)]);
    assert_eq!(report.files_removed, vec![0]);
    assert_eq!(read(&s, 1), None);
}

#[test]
fn a_marker_for_another_index_is_not_trusted() {
    let disk = MemDisk::new();
    let (mut s, _) = open(disk.clone(), config(1024));
    s.write(id(1), b"one").expect("write");
    s.close().expect("close");
    disk.write_file(&dir().join(SAVED_INDEX), b"stale")
        .expect("write");
    let (s, report) = open(disk.clone(), config(1024));
    assert!(!report.clean);
    assert_eq!(read(&s, 1), Some(b"one".to_vec()));
}

/// One run on the real file system, through the `Disk` trait only.
#[test]
fn the_real_file_disk_keeps_messages_across_reopen() {
    use crate::runtime::file_disk::FileDisk;
    let dir = std::env::temp_dir().join(format!("warren-msg-store-{}", std::process::id()));
    let disk = FileDisk::new();
    disk.create_dir_all(&dir).expect("mkdir");
    // A leftover of an earlier run with the same pid would change the reports.
    for name in disk.list(&dir).expect("list") {
        disk.remove(&dir.join(name)).expect("remove");
    }
    let (mut s, _) = MsgStore::open(FileDisk::new(), &dir, config(1024)).expect("open");
    for n in 0..20 {
        s.write(id(n), &body(n, 150)).expect("write");
    }
    s.sync().expect("sync");
    for n in (0..20).filter(|n| n % 2 == 1) {
        s.remove(id(n)).expect("remove");
    }
    let compacted = s.compact().expect("compact");
    assert!(!compacted.files_removed.is_empty());
    s.close().expect("close");
    let (s, report) = MsgStore::open(FileDisk::new(), &dir, config(1024)).expect("reopen");
    assert!(report.clean);
    for n in 0..20 {
        let want = (n % 2 == 0).then(|| body(n, 150));
        assert_eq!(s.read(id(n)).expect("read"), want);
    }
    drop(s);
    let (s, report) = MsgStore::open(FileDisk::new(), &dir, config(1024)).expect("reopen");
    assert!(!report.clean && report.damaged.is_empty());
    assert_eq!(read(&s, 4), Some(body(4, 150)));
    drop(s);
    for name in disk.list(&dir).expect("list") {
        disk.remove(&dir.join(name)).expect("remove");
    }
    disk.remove_dir(&dir).expect("remove the test's folder");
}

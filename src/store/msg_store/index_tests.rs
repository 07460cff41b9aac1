//! Unit tests of [`StoreIndex`]: the bookkeeping alone, no disk.

use super::*;

fn id(n: u8) -> MsgId {
    MsgId([n; 16])
}

/// Plans and commits everything pending, as a flush that succeeds.
fn flush(ix: &mut StoreIndex) -> Vec<AppendBatch> {
    let batches = ix.plan_append(&ix.pending());
    for b in &batches {
        ix.commit_append(b);
    }
    batches
}

#[test]
fn a_second_write_only_counts() {
    let mut ix = StoreIndex::new(1000);
    assert_eq!(ix.write(id(1), 100), WriteDecision::Buffer);
    assert_eq!(ix.write(id(1), 100), WriteDecision::Dedup { ref_count: 2 });
    assert_eq!(ix.pending(), vec![(id(1), 100)]);
    assert_eq!(ix.pending_bytes(), 100);
    assert_eq!(ix.remove(id(1)), Removed::Decremented { ref_count: 1 });
    assert_eq!(ix.ref_count(&id(1)), 1);
}

#[test]
fn removing_an_unflushed_write_cancels_it() {
    let mut ix = StoreIndex::new(1000);
    ix.write(id(1), 100);
    ix.write(id(2), 50);
    assert_eq!(ix.remove(id(1)), Removed::Cancelled);
    assert_eq!(ix.pending(), vec![(id(2), 50)]);
    assert_eq!(ix.pending_bytes(), 50);
    assert_eq!(ix.remove(id(1)), Removed::Unknown);
}

#[test]
fn flushing_places_records_back_to_back_and_rolls_over() {
    let mut ix = StoreIndex::new(250);
    for n in 0..5 {
        ix.write(id(n), 100);
    }
    let batches = flush(&mut ix);
    let shape: Vec<(u64, u64, bool, usize)> = batches
        .iter()
        .map(|b| (b.file, b.start, b.new_file, b.records.len()))
        .collect();
    assert_eq!(
        shape,
        vec![(0, 0, true, 2), (1, 0, true, 2), (2, 0, true, 1)]
    );
    assert_eq!(ix.current_file(), 2);
    assert_eq!(ix.current_len(), 100);
    assert_eq!(
        ix.entry(&id(3)).map(|e| e.slot),
        Some(Slot::Stored(Location {
            file: 1,
            offset: 100,
            total_size: 100
        }))
    );
    assert_eq!(ix.pending_bytes(), 0);
    // The next flush continues the current file.
    ix.write(id(9), 100);
    let next = ix.plan_append(&ix.pending());
    assert_eq!(
        (next[0].file, next[0].start, next[0].new_file),
        (2, 100, false)
    );
}

#[test]
fn a_record_larger_than_the_limit_gets_a_file_of_its_own() {
    let mut ix = StoreIndex::new(100);
    ix.write(id(1), 500);
    ix.write(id(2), 10);
    let batches = flush(&mut ix);
    assert_eq!(batches.len(), 2);
    assert_eq!((batches[0].file, batches[0].len()), (0, 500));
    assert_eq!((batches[1].file, batches[1].len()), (1, 10));
}

#[test]
fn removes_turn_bytes_into_garbage_and_make_candidates() {
    let mut ix = StoreIndex::new(300);
    for n in 0..6 {
        ix.write(id(n), 100);
    }
    flush(&mut ix);
    // Files 0 and 1 hold three records each; file 1 is current.
    assert_eq!(ix.compaction_candidates(0.5), Vec::<u64>::new());
    assert_eq!(
        ix.remove(id(0)),
        Removed::Garbage {
            file: 0,
            garbage_fraction: 1.0 - 200.0 / 300.0
        }
    );
    assert_eq!(ix.compaction_candidates(0.5), Vec::<u64>::new());
    ix.remove(id(1));
    assert_eq!(ix.compaction_candidates(0.5), vec![0]);
    // The current file is never a candidate, however empty.
    for n in 3..6 {
        ix.remove(id(n));
    }
    assert_eq!(ix.compaction_candidates(0.5), vec![0]);
    let live = ix.live_records(&[0]);
    assert_eq!(
        live[&0].iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![id(2)]
    );
}

#[test]
fn compaction_moves_live_records_and_frees_the_file() {
    let mut ix = StoreIndex::new(300);
    for n in 0..4 {
        ix.write(id(n), 100);
    }
    flush(&mut ix);
    ix.remove(id(0));
    ix.remove(id(1));
    let live = ix.live_records(&[0]);
    let copies: Vec<(MsgId, u32)> = live[&0].iter().map(|(i, l)| (*i, l.total_size)).collect();
    let batches = ix.plan_append(&copies);
    assert_eq!((batches[0].file, batches[0].start), (1, 100));
    ix.commit_append(&batches[0]);
    assert_eq!(ix.file_summary(0).map(|s| s.valid_bytes), Some(0));
    assert_eq!(
        ix.file_summary(1),
        Some(FileSummary {
            valid_bytes: 200,
            total_bytes: 200
        })
    );
    assert!(ix.forget_file(0).is_some());
    assert_eq!(ix.files().map(|(f, _)| f).collect::<Vec<_>>(), vec![1]);
}

#[test]
#[should_panic(expected = "planned at")]
fn committing_a_stale_plan_is_a_bug() {
    let mut ix = StoreIndex::new(1000);
    ix.write(id(1), 10);
    let plan = ix.plan_append(&ix.pending());
    ix.commit_append(&plan[0]);
    ix.commit_append(&plan[0]);
}

#[test]
fn set_ref_counts_drops_the_unreferenced_and_reports_the_missing() {
    let mut ix = StoreIndex::new(1000);
    for n in 0..4 {
        ix.insert_stored(
            id(n),
            1,
            Location {
                file: 0,
                offset: u64::from(n) * 10,
                total_size: 10,
            },
        );
    }
    ix.add_file(0, 40);
    let report = ix.set_ref_counts([(id(1), 2), (id(3), 1), (id(3), 1), (id(7), 1), (id(2), 0)]);
    assert_eq!(report.dropped, vec![id(0), id(2)]);
    assert_eq!(report.missing, vec![id(7)]);
    assert_eq!(ix.ref_count(&id(1)), 2);
    assert_eq!(ix.ref_count(&id(3)), 2);
    assert_eq!(ix.len(), 2);
    assert_eq!(ix.file_summary(0).map(|s| s.valid_bytes), Some(20));
}

#[test]
fn recovery_keeps_the_first_copy_of_a_duplicate() {
    let mut ix = StoreIndex::new(1000);
    let loc = |file, offset| Location {
        file,
        offset,
        total_size: 10,
    };
    ix.add_file(0, 10);
    ix.add_file(3, 20);
    assert!(ix.insert_stored(id(1), 1, loc(0, 0)));
    assert!(!ix.insert_stored(id(1), 1, loc(3, 10)));
    assert_eq!(ix.current_file(), 3);
    assert_eq!(ix.file_summary(3).map(|s| s.valid_bytes), Some(0));
    assert_eq!(ix.snapshot(), vec![(id(1), 1, loc(0, 0))]);
}

#[test]
fn pending_writes_keep_their_order_across_cancellations() {
    let mut ix = StoreIndex::new(1000);
    for n in [5, 1, 9, 3] {
        ix.write(id(n), 10);
    }
    ix.remove(id(9));
    ix.write(id(9), 10);
    let order: Vec<MsgId> = ix.pending().into_iter().map(|(i, _)| i).collect();
    assert_eq!(order, vec![id(5), id(1), id(3), id(9)]);
}

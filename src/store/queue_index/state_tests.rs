//! Unit tests of the sans-IO index bookkeeping.

use super::*;

fn publish(seq: u64) -> Publish {
    Publish {
        seq,
        msg_id: [seq as u8; 16],
        persistent: true,
        expires_at_ms: None,
        size: 100,
        embedded: None,
    }
}

fn state_with(seqs: std::ops::Range<u64>) -> IndexState {
    let mut s = IndexState::new(4);
    for seq in seqs {
        s.publish(publish(seq)).unwrap();
    }
    s
}

#[test]
fn records_are_routed_to_the_segment_of_their_seq() {
    let mut s = state_with(0..6);
    s.deliver(5).unwrap();
    let plan = s.take_flush();
    assert!(plan.deletes.is_empty());
    assert_eq!(plan.writes.len(), 2);
    let (a, b) = (&plan.writes[0], &plan.writes[1]);
    assert_eq!((a.segment, a.records.len(), a.creates), (0, 4, true));
    assert_eq!((b.segment, b.creates), (1, true));
    let b_records = vec![
        Record::Publish(publish(4)),
        Record::Publish(publish(5)),
        Record::Deliver { seq: 5 },
    ];
    assert_eq!(b.records, b_records);
    assert_eq!(s.journal_records(), 0);
    assert_eq!(s.segments_on_disk(), 2);
}

#[test]
fn counts_and_bounds_follow_publish_deliver_and_ack() {
    let mut s = state_with(0..6);
    assert_eq!((s.unacked(), s.low_seq(), s.next_seq()), (6, 0, 6));
    assert_eq!(s.deliver(1), Ok(true));
    assert_eq!(s.deliver(1), Ok(false), "a second deliver writes nothing");
    s.ack(&[0, 1]).unwrap();
    assert_eq!((s.unacked(), s.low_seq()), (4, 2));
    let seg0 = s.segment(0).unwrap();
    assert_eq!((seg0.pubs, seg0.delivers, seg0.acks), (4, 1, 2));
    assert_eq!(s.journal_records(), 6 + 1 + 2);
    assert!(s.is_delivered(1) && !s.is_live(1) && s.is_live(2));
    assert_eq!(s.live_segments(), vec![0, 1]);
}

#[test]
fn invalid_calls_are_refused_without_changing_anything() {
    let mut s = state_with(0..3);
    let next = 3;
    let err = s.publish(publish(2)).unwrap_err();
    assert_eq!(err, StateError::OutOfOrder { seq: 2, next });
    assert_eq!(s.deliver(7), Err(StateError::NotLive(7)));
    assert_eq!(s.ack(&[0, 0]), Err(StateError::DuplicateAck(0)));
    assert_eq!(s.ack(&[1, 9]), Err(StateError::NotLive(9)));
    assert!(s.is_live(1), "a refused batch acks nothing");
    s.ack(&[1]).unwrap();
    assert_eq!(s.ack(&[1]), Err(StateError::NotLive(1)));
    assert_eq!(s.deliver(1), Err(StateError::NotLive(1)));
    assert_eq!(s.journal_records(), 4);
}

#[test]
fn gaps_in_seqs_are_allowed() {
    let mut s = state_with(0..1);
    s.publish(publish(10)).unwrap();
    assert_eq!((s.next_seq(), s.unacked()), (11, 2));
    assert_eq!(s.live_segments(), vec![0, 2]);
}

#[test]
fn publish_and_ack_in_one_journal_generation_cancel_out() {
    let mut s = state_with(0..3);
    s.ack(&[1]).unwrap();
    let plan = s.take_flush();
    let records = vec![Record::Publish(publish(0)), Record::Publish(publish(2))];
    assert_eq!(plan.writes[0].records, records);
}

#[test]
fn an_ack_of_a_flushed_publish_is_appended_without_its_deliver() {
    let mut s = state_with(0..2);
    s.take_flush();
    s.deliver(0).unwrap();
    s.ack(&[0]).unwrap();
    s.deliver(1).unwrap();
    let plan = s.take_flush();
    let w = &plan.writes[0];
    assert!(!w.creates);
    assert_eq!(
        w.records,
        vec![Record::Ack { seq: 0 }, Record::Deliver { seq: 1 }]
    );
}

#[test]
fn a_fully_acked_segment_is_deleted_and_its_records_never_written() {
    let mut s = state_with(0..6);
    s.take_flush();
    s.publish(publish(6)).unwrap();
    s.deliver(5).unwrap();
    s.ack(&[0, 1, 2, 3]).unwrap();
    let plan = s.take_flush();
    assert_eq!(plan.deletes, vec![0]);
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(plan.writes[0].segment, 1);
    let records = vec![Record::Deliver { seq: 5 }, Record::Publish(publish(6))];
    assert_eq!(plan.writes[0].records, records);
    assert!(s.segment(0).is_none());
    assert_eq!(s.low_seq(), 4);
    assert_eq!(s.ack(&[2]), Err(StateError::NotLive(2)));
}

#[test]
fn a_segment_acked_before_it_reached_the_disk_is_neither_written_nor_deleted() {
    let mut s = state_with(0..2);
    s.ack(&[0, 1]).unwrap();
    assert_eq!(s.take_flush(), FlushPlan::default());
    assert_eq!(s.live_segments(), Vec::<u64>::new());
    assert_eq!((s.low_seq(), s.next_seq()), (2, 2));
    s.publish(publish(2)).unwrap();
    assert!(s.take_flush().writes[0].creates);
}

#[test]
fn the_flush_threshold_counts_journal_records() {
    let mut s = state_with(0..3);
    assert!(!s.needs_flush(5));
    s.deliver(0).unwrap();
    s.ack(&[1]).unwrap();
    assert!(s.needs_flush(5));
    s.take_flush();
    assert!(!s.needs_flush(5));
}

#[test]
fn pending_publishes_are_listed_per_segment() {
    let mut s = state_with(0..2);
    s.take_flush();
    s.publish(publish(2)).unwrap();
    s.publish(publish(5)).unwrap();
    let seg0: Vec<u64> = s.pending_publishes(0).map(|p| p.seq).collect();
    let seg1: Vec<u64> = s.pending_publishes(1).map(|p| p.seq).collect();
    assert_eq!((seg0, seg1), (vec![2], vec![5]));
}

#[test]
fn the_low_bound_is_found_across_bitset_words_and_segments() {
    let mut s = IndexState::new(130);
    for seq in 0..300 {
        s.publish(publish(seq)).unwrap();
    }
    s.ack(&(0..71).collect::<Vec<_>>()).unwrap();
    assert_eq!((s.low_seq(), s.unacked()), (71, 229));
    s.ack(&(71..130).collect::<Vec<_>>()).unwrap();
    s.ack(&[131]).unwrap();
    assert_eq!(s.low_seq(), 130);
    s.take_flush();
    s.ack(&[130]).unwrap();
    assert_eq!((s.low_seq(), s.unacked()), (132, 168));
}

/// A message published, delivered and acked within one journal generation leaves nothing
/// in RAM (its embedded body went with it) though its records still count towards the
/// flush; one published before the last flush keeps its ack, which the next flush writes.
#[test]
fn a_publish_acked_before_the_flush_leaves_nothing_pending() {
    let mut s = IndexState::new(16);
    s.publish(publish(0)).unwrap();
    s.take_flush();
    for seq in 1..200 {
        let mut p = publish(seq);
        p.embedded = Some(vec![7; 1024]);
        s.publish(p).unwrap();
        s.deliver(seq).unwrap();
        s.ack(&[seq]).unwrap();
    }
    s.ack(&[0]).unwrap();
    assert_eq!(s.pending_len(), 1, "only seq 0's ack is left to write");
    assert_eq!(s.journal_records(), 199 * 3 + 1);
    assert_eq!(s.unacked(), 0);
    assert!(s.pending_publishes(0).next().is_none());
    let plan = s.take_flush();
    let records: Vec<&Record> = plan.writes.iter().flat_map(|w| &w.records).collect();
    assert!(records.is_empty(), "segment 0 is fully acked: {records:?}");
    assert_eq!(plan.deletes, vec![0]);
}

//! Kept copies (issue 16, *Mirrors keep their data*): a restarted mirror catches up only
//! what it missed, and a copy that cannot be trusted starts empty.

use super::copies::{capture_rounds, open_mirror, write_shipped};
use super::*;

/// Issue 16, *Mirrors keep their data*: a mirror's copy survives its node's crash, and
/// the next sync compares it with the master's digest instead of copying it whole. What
/// the master acked meanwhile leaves the copy, deliveries are recorded, and only the
/// messages published while the mirror was down are sent (from the copy's next seq); the
/// copy promoted then is the master's queue. A copy that differs below its end (a message
/// the master holds that the copy does not, or another one at the same seq) is refused,
/// and one with seqs past the master's start is started empty.
#[test]
fn a_kept_copy_catches_up_only_what_it_missed() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let shipped = capture_rounds(&s);
    let body = |i: u32| {
        let mut v = i.to_be_bytes().to_vec();
        // Every fourth one stored in the message store, the rest in the index.
        if i.is_multiple_of(4) {
            v.resize(10_000, i as u8);
        }
        v
    };
    for i in 0..30u32 {
        publish(&b, &body(i));
    }
    assert!(s.step());
    let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
    mirror
        .start_copy("/", "q", incarnation, next_generation())
        .expect("a copy starts");
    write_shipped(&mirror, incarnation, &shipped);
    // The mirror's node dies; meanwhile the master delivers ten, acks five of them, and
    // takes ten more.
    mirror_disk.crash();
    let delivered = deliver(&b, 10);
    ack(&b, &delivered[..5]);
    for i in 30..40u32 {
        publish(&b, &body(i));
    }
    assert!(s.step());
    let from_seq = s.at_next_seq("/", "q", |next| next);
    assert_eq!(from_seq, 40);

    // Restarted: the copy is kept, joining leaves it as it is, and the sync resumes it.
    let (_, mirror, _) = open_mirror(&mirror_disk, false);
    mirror
        .begin_copy("/", "q", incarnation, next_generation())
        .expect("the kept copy stays");
    let copy_next = mirror
        .resume_copy("/", "q", incarnation, from_seq, next_generation())
        .expect("resume")
        .expect("the copy kept from the last run is resumed");
    assert_eq!(copy_next, 30);
    // The master summarises what the copy may hold, [0, copy_next), in spans of seven.
    let summary = |from: u64| {
        s.sync_summary("/", "q", from, copy_next, 7, |summary, next| {
            (summary, next)
        })
        .expect("a summary")
    };
    // Another message at a seq the copy holds (another hash): refused, nothing changed.
    let (mut forged, _) = summary(0);
    forged.hash[0] ^= 1;
    assert!(!mirror
        .reconcile_summary("/", "q", incarnation, &forged)
        .expect("compare"));
    // The real summaries.
    let (mut lo, mut batches) = (0, 0);
    loop {
        let (range, next) = summary(lo);
        assert_eq!((range.lo, range.hi), (lo, next.unwrap_or(copy_next)));
        batches += 1;
        assert!(
            mirror
                .reconcile_summary("/", "q", incarnation, &range)
                .expect("compare"),
            "the copy holds everything the master holds below {copy_next}"
        );
        match next {
            Some(n) => lo = n,
            None => break,
        }
    }
    assert_eq!(batches, 30usize.div_ceil(7));
    // Only what the mirror missed is sent.
    let mut cursor = SyncCursor::default();
    let (ops, next) = s
        .sync_batch("/", "q", (copy_next, from_seq), 1000, &mut cursor)
        .expect("a batch");
    assert_eq!(next, None);
    let sent: Vec<u64> = ops
        .iter()
        .filter_map(|o| match o {
            IndexOp::Publish { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect();
    assert_eq!(sent, (30..40).collect::<Vec<u64>>());
    mirror
        .apply_mirrored("/", "q", incarnation, ops)
        .expect("the mirror writes");
    mirror_disk.crash();
    let (promoted, storage, _) = open_mirror(&mirror_disk, true);
    promoted.set_pager(storage);
    let got: Vec<Vec<u8>> = contents(&promoted).into_iter().map(|(b, _)| b).collect();
    let expected: Vec<Vec<u8>> = (5..40u32).map(body).collect();
    assert_eq!(got, expected, "the caught-up copy is the master's queue");
}

/// A kept copy is resumed only by its own incarnation's sync, and only when it holds no
/// seq the master has not given yet (the master restarted without rounds the copy has):
/// otherwise the copy starts empty. An empty queue's summary is one empty range.
#[test]
fn a_kept_copy_past_the_masters_start_or_of_another_incarnation_starts_empty() {
    for case in ["past the start", "another incarnation"] {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let shipped = capture_rounds(&s);
        for i in 0..5u32 {
            publish(&b, &i.to_be_bytes());
        }
        assert!(s.step());
        let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
        mirror
            .start_copy("/", "q", incarnation, next_generation())
            .expect("a copy starts");
        write_shipped(&mirror, incarnation, &shipped);
        mirror_disk.crash();
        let (_, mirror, _) = open_mirror(&mirror_disk, false);
        let (inc, from_seq) = match case {
            "past the start" => (incarnation, 4),
            _ => (incarnation + 1, 5),
        };
        assert_eq!(
            mirror
                .resume_copy("/", "q", inc, from_seq, next_generation())
                .expect("resume"),
            None,
            "{case}: the copy starts empty"
        );
        // Empty: it matches a range with nothing live, and no range with a message.
        let nothing = crate::mirror::digest::SummaryBuilder::new(0, 5).finish();
        assert!(
            mirror
                .reconcile_summary("/", "q", inc, &nothing)
                .expect("compare"),
            "{case}: nothing held"
        );
        let mut one = crate::mirror::digest::SummaryBuilder::new(0, 5);
        one.add(0, 1, false);
        assert!(
            !mirror
                .reconcile_summary("/", "q", inc, &one.finish())
                .expect("compare"),
            "{case}: a message the empty copy lacks"
        );
        assert_eq!(mirror.low_seq("/", "q"), None, "{case}: nothing kept");
    }
    let (_, _, s, _) = open(&MemDisk::new());
    assert!(s
        .sync_summary("/", "q", 0, 1, 7, |summary, next| summary.live == vec![0]
            && next.is_none())
        .expect("an empty queue's summary"));
}

/// A mirror promoted before its first sync after a restart (`ha-promote-on-failure:
/// always`, or `force_promote_mirror`): the copy kept from its last run, left as it is by
/// joining, is adopted as it is. It becomes the queue with every message it held, each
/// flagged redelivered (any adoption does that); a kept copy emptied at the start would
/// bring the queue up empty.
#[test]
fn a_kept_copy_promoted_before_its_first_sync_becomes_the_queue() {
    let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
    let (b, _, s, _) = open(&master_disk);
    let shipped = capture_rounds(&s);
    let big = vec![9u8; 10_000];
    let bodies = [b"a".to_vec(), big.clone(), b"c".to_vec()];
    for body in &bodies {
        publish(&b, body);
    }
    assert!(s.step());
    let (_, mirror, incarnation) = open_mirror(&mirror_disk, false);
    mirror
        .start_copy("/", "q", incarnation, next_generation())
        .expect("a copy starts");
    write_shipped(&mirror, incarnation, &shipped);
    mirror_disk.crash();

    // Restarted: the copy is kept, and joining leaves it as it is.
    let (mb, mirror, _) = open_mirror(&mirror_disk, false);
    let key = ("/".to_string(), "q".to_string());
    assert_eq!(mirror.kept_copies(), vec![(key, incarnation)]);
    mirror
        .begin_copy("/", "q", incarnation, next_generation())
        .expect("the kept copy stays");
    // The master's node dies before any sync: this mirror is promoted.
    let mut state = (*mb.snapshot()).clone();
    state
        .apply(&Command::PromoteMirror {
            vhost: "/".into(),
            queue: "q".into(),
            expected_epoch: 0,
            node: 1,
        })
        .expect("promote");
    mb.follow(Arc::new(state), Instant::default());
    let adopted = mb
        .adopt_queue("/", "q", Instant::default(), |h| {
            mirror.adopt(h, incarnation).map(|_| ())
        })
        .expect("the queue is this node's now");
    adopted.expect("the kept copy is adopted");
    mb.set_pager(mirror.clone());
    let expected: Vec<(Vec<u8>, bool)> = bodies.iter().map(|b| (b.clone(), true)).collect();
    assert_eq!(contents(&mb), expected, "the promoted copy is the queue");
    assert!(
        mirror.kept_copies().is_empty(),
        "no longer kept once adopted"
    );
}

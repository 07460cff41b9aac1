//! The mirror role's sync protocol, stepped message by message with scripted storage.

use bytes::Bytes;
use proptest::prelude::*;

use super::{Action, MirrorRole, Mode, Why};
use crate::gm::MemberId;
use crate::mirror::digest::SummaryBuilder;
use crate::mirror::message::MirrorMsg;

const ME: MemberId = MemberId { node: 2, since: 5 };
const OTHER: MemberId = MemberId { node: 3, since: 6 };

fn drain(r: &mut MirrorRole) -> Vec<Action> {
    std::iter::from_fn(|| r.poll_action()).collect()
}

fn ops(b: u8) -> MirrorMsg {
    MirrorMsg::Ops {
        epoch: 1,
        ops: Bytes::from(vec![b]),
    }
}

fn start(active: bool, sync: u64) -> MirrorMsg {
    MirrorMsg::SyncStart {
        epoch: 1,
        target: ME,
        from_seq: 10,
        active,
        sync,
    }
}

fn batch(target: MemberId, sync: u64, b: u8) -> MirrorMsg {
    MirrorMsg::SyncBatch {
        epoch: 1,
        target,
        sync,
        ops: Bytes::from(vec![b]),
    }
}

fn end(sync: u64) -> MirrorMsg {
    MirrorMsg::SyncEnd {
        epoch: 1,
        target: ME,
        sync,
    }
}

/// The backlog batch `b` of sync `sync`, the `n`th, to write and then report.
fn written(sync: u64, b: u8, n: u64) -> Action {
    Action::WriteBatch {
        ops: Bytes::from(vec![b]),
        then: MirrorMsg::SyncWritten {
            epoch: 1,
            sync,
            batches: n,
        },
    }
}

fn ack(sync: u64) -> Action {
    Action::Broadcast(MirrorMsg::SyncAck { epoch: 1, sync })
}

fn want(sync: u64, from: u64) -> Action {
    Action::Broadcast(MirrorMsg::SyncWant {
        epoch: 1,
        sync,
        from,
    })
}

fn summary(lo: u64, hi: u64) -> MirrorMsg {
    MirrorMsg::SyncSummary {
        epoch: 1,
        target: ME,
        sync: 1,
        summary: SummaryBuilder::new(lo, hi).finish(),
    }
}

/// A member asked to start its copy for passive sync 1 (not answered yet).
fn passive_start() -> MirrorRole {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(false, 1));
    assert_eq!(
        drain(&mut r),
        [Action::StartCopy {
            kept_copy_differs: false
        }]
    );
    r
}

/// A member in active sync 1 with a kept copy below seq 100 (announced).
fn keeping_100() -> MirrorRole {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(true, 1));
    drain(&mut r);
    r.handle_resumed(Some(Some(100)));
    drain(&mut r);
    r
}

#[test]
fn a_waiting_mirror_writes_nothing_and_leaves_on_a_sync_it_missed_the_start_of() {
    let mut r = MirrorRole::new(ME);
    r.handle_message(ops(1));
    assert_eq!(
        drain(&mut r),
        [],
        "released unwritten: the copy is not the queue's"
    );
    r.handle_message(batch(OTHER, 1, 9));
    assert_eq!(drain(&mut r), [], "another member's sync");
    r.handle_message(batch(ME, 1, 9));
    assert_eq!(drain(&mut r), [Action::Leave(Why::MissedSyncStart)]);
    r.handle_message(start(true, 2));
    assert_eq!(drain(&mut r), [], "a member that left does nothing more");
}

#[test]
fn a_passive_sync_makes_the_copy_live_and_acknowledges_its_end() {
    let mut r = passive_start();
    r.handle_copy_started(true);
    assert_eq!(r.mode(), Mode::Live);
    r.handle_message(ops(1));
    assert_eq!(drain(&mut r), [Action::Write(Bytes::from_static(&[1]))]);
    r.handle_message(end(2));
    assert_eq!(drain(&mut r), [], "not the sync it follows");
    r.handle_message(end(1));
    assert_eq!(drain(&mut r), [ack(1)]);
}

#[test]
fn an_active_sync_holds_rounds_and_acknowledges_only_after_writing_them() {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(true, 1));
    assert_eq!(drain(&mut r), [Action::ResumeCopy { from_seq: 10 }]);
    r.handle_resumed(Some(None));
    assert_eq!(drain(&mut r), [want(1, 0), Action::BeginHold]);
    r.handle_message(ops(1));
    assert_eq!(drain(&mut r), [Action::Hold(Bytes::from_static(&[1]))]);
    r.handle_message(batch(ME, 0, 7));
    assert_eq!(drain(&mut r), [], "an aborted sync's batch");
    r.handle_message(batch(ME, 1, 8));
    r.handle_message(batch(ME, 1, 9));
    assert_eq!(
        drain(&mut r),
        [written(1, 8, 1), written(1, 9, 2)],
        "each batch written beside the loop and reported with the count so far"
    );
    r.handle_message(end(1));
    assert_eq!(drain(&mut r), [Action::ApplyHeld, ack(1)]);
    r.handle_message(ops(2));
    assert_eq!(drain(&mut r), [Action::Write(Bytes::from_static(&[2]))]);
}

#[test]
fn a_new_sync_counts_its_batches_from_one() {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(true, 1));
    r.handle_resumed(Some(None));
    r.handle_message(batch(ME, 1, 8));
    drain(&mut r);
    // The master starts over (say the first sync's end never made its lap).
    r.handle_message(start(true, 2));
    r.handle_resumed(Some(None));
    r.handle_message(batch(ME, 1, 7));
    r.handle_message(batch(ME, 2, 9));
    assert_eq!(
        drain(&mut r),
        [
            Action::ResumeCopy { from_seq: 10 },
            want(2, 0),
            Action::BeginHold,
            written(2, 9, 1)
        ]
    );
}

#[test]
fn a_kept_copy_is_compared_range_by_range_and_restarted_when_it_differs() {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(true, 1));
    drain(&mut r);
    r.handle_resumed(Some(Some(100)));
    assert_eq!(
        drain(&mut r),
        [
            Action::Broadcast(MirrorMsg::SyncHave {
                epoch: 1,
                sync: 1,
                copy_next: 100
            }),
            Action::BeginHold
        ]
    );
    r.handle_message(summary(0, 60));
    assert_eq!(
        drain(&mut r),
        [Action::Reconcile(SummaryBuilder::new(0, 60).finish())]
    );
    r.handle_reconciled(Some(true));
    assert_eq!(drain(&mut r), []);
    r.handle_message(summary(60, 100));
    drain(&mut r);
    r.handle_reconciled(Some(true));
    assert_eq!(
        drain(&mut r),
        [want(1, 100)],
        "the rest from the copy's end"
    );

    // A range that does not follow: the copy starts empty and asks for everything.
    let mut r = keeping_100();
    r.handle_message(summary(10, 60));
    assert_eq!(
        drain(&mut r),
        [Action::StartCopy {
            kept_copy_differs: true
        }]
    );
    r.handle_copy_started(true);
    assert_eq!(drain(&mut r), [want(1, 0)]);
    assert_eq!(r.mode(), Mode::Syncing((1, 1)), "still holding rounds back");

    // A range the copy cannot hold: the same.
    let mut r = keeping_100();
    r.handle_message(summary(0, 100));
    drain(&mut r);
    r.handle_reconciled(Some(false));
    assert_eq!(
        drain(&mut r),
        [Action::StartCopy {
            kept_copy_differs: true
        }]
    );
}

#[test]
fn a_sync_ending_before_the_comparison_drops_the_uncompared_rest_first() {
    let mut r = keeping_100();
    r.handle_message(summary(0, 40));
    drain(&mut r);
    r.handle_reconciled(Some(true));
    r.handle_message(end(1));
    assert_eq!(
        drain(&mut r),
        [Action::Reconcile(SummaryBuilder::new(40, 100).finish())]
    );
    r.handle_reconciled(Some(true));
    assert_eq!(drain(&mut r), [Action::ApplyHeld, ack(1)]);
}

#[test]
fn every_storage_failure_leaves() {
    let mut r = MirrorRole::new(ME);
    r.handle_message(start(true, 1));
    drain(&mut r);
    r.handle_resumed(None);
    assert_eq!(drain(&mut r), [Action::Leave(Why::Storage)]);

    let mut r = passive_start();
    r.handle_copy_started(false);
    assert_eq!(drain(&mut r), [Action::Leave(Why::Storage)]);

    let mut r = keeping_100();
    r.handle_message(end(1));
    drain(&mut r);
    r.handle_reconciled(Some(false));
    assert_eq!(
        drain(&mut r),
        [Action::Leave(Why::Storage)],
        "the rest could not be dropped"
    );
}

/// A message the group may deliver to the member, small ids so they collide.
fn message() -> impl Strategy<Value = MirrorMsg> {
    let target = prop_oneof![4 => Just(ME), 1 => Just(OTHER)];
    prop_oneof![
        4 => any::<u8>().prop_map(ops),
        2 => (target.clone(), any::<bool>(), 1u64..3).prop_map(|(target, active, sync)| {
            MirrorMsg::SyncStart { epoch: 1, target, from_seq: 10, active, sync }
        }),
        2 => (target.clone(), 1u64..3, any::<u8>()).prop_map(|(target, sync, b)| {
            MirrorMsg::SyncBatch { epoch: 1, target, sync, ops: Bytes::from(vec![b]) }
        }),
        2 => (target.clone(), 1u64..3).prop_map(|(target, sync)| MirrorMsg::SyncEnd {
            epoch: 1, target, sync
        }),
        1 => (target, 1u64..3, 0u64..4, 1u64..4).prop_map(|(target, sync, lo, len)| {
            MirrorMsg::SyncSummary {
                epoch: 1,
                target,
                sync,
                summary: SummaryBuilder::new(lo * 25, lo * 25 + len * 25).finish(),
            }
        }),
    ]
}

/// Storage answers: fails now and then, a kept copy of 0..=100.
#[derive(Debug, Clone)]
struct Storage {
    ok: bool,
    kept: u64,
    matches: bool,
}

fn storage() -> impl Strategy<Value = Storage> {
    (
        prop::bool::weighted(0.95),
        prop_oneof![Just(0u64), Just(50), Just(100)],
        prop::bool::weighted(0.8),
    )
        .prop_map(|(ok, kept, matches)| Storage { ok, kept, matches })
}

proptest! {
    /// Against a model of the copy: a sync is acknowledged only when the copy holds the
    /// whole queue as of that sync (its start was handled, every storage step since
    /// succeeded, and every round held back was written first); nothing is written while
    /// waiting; rounds held are never written before their sync's backlog.
    #[test]
    fn a_mirror_acknowledges_a_sync_only_with_the_whole_queue(
        steps in proptest::collection::vec((message(), storage()), 1..60)
    ) {
        let mut r = MirrorRole::new(ME);
        // The model: the sync whose start restarted the copy and whether the copy is the
        // queue's through it (passive: at once; active: at its end).
        let mut following: Option<(u64, u64)> = None;
        let mut holding = false;
        let mut held = 0usize;
        let mut left = false;
        for (msg, st) in steps {
            let was_waiting = r.mode() == Mode::Waiting;
            let passive_start = match &msg {
                MirrorMsg::SyncStart { target, active: false, sync, epoch, .. } if *target == ME =>
                    Some((*epoch, *sync)),
                _ => None,
            };
            let active_start = match &msg {
                MirrorMsg::SyncStart { target, active: true, sync, epoch, .. } if *target == ME =>
                    Some((*epoch, *sync)),
                _ => None,
            };
            r.handle_message(msg.clone());
            while let Some(a) = r.poll_action() {
                prop_assert!(!left, "nothing after leaving: {:?}", a);
                match a {
                    Action::Write(_) => {
                        prop_assert!(!was_waiting || !matches!(msg, MirrorMsg::Ops { .. }),
                            "a waiting member wrote a round");
                        prop_assert!(!holding || !matches!(msg, MirrorMsg::Ops { .. }),
                            "a round written while rounds are held");
                    }
                    Action::WriteBatch { then, .. } => {
                        prop_assert!(holding, "a backlog batch outside an active sync");
                        let report = matches!(then, MirrorMsg::SyncWritten { .. });
                        prop_assert!(report, "a batch reported as written");
                    }
                    Action::Hold(_) => { prop_assert!(holding); held += 1; }
                    Action::BeginHold => { holding = true; held = 0; }
                    Action::ApplyHeld | Action::DiscardHeld => {
                        prop_assert!(holding);
                        holding = false;
                        held = 0;
                    }
                    Action::ResumeCopy { .. } => {
                        following = None;
                        r.handle_resumed(st.ok.then_some((st.kept > 0).then_some(st.kept)));
                        if st.ok { following = active_start; }
                    }
                    Action::StartCopy { .. } => {
                        r.handle_copy_started(st.ok);
                        if st.ok && passive_start.is_some() { following = passive_start; }
                    }
                    Action::Reconcile(_) => {
                        r.handle_reconciled(st.ok.then_some(st.matches));
                    }
                    Action::Broadcast(MirrorMsg::SyncAck { epoch, sync }) => {
                        prop_assert_eq!(following, Some((epoch, sync)),
                            "acknowledged a sync the copy does not follow");
                        prop_assert!(!holding && held == 0, "acknowledged with rounds still held");
                        prop_assert_eq!(r.mode(), Mode::Live);
                    }
                    Action::Broadcast(_) => {}
                    Action::Leave(_) => left = true,
                }
            }
            prop_assert!(!r.is_waiting(), "every storage request answered");
        }
    }
}

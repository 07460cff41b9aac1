//! The master's side of the sync protocol, stepped event by event with explicit time.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::{Action, Answer, Look, MasterRole, SetView, Why, SYNC_ACK_WAIT_MS};
use crate::gm::MemberId;
use crate::mirror::message::MirrorMsg;
use crate::time::Instant;

const ME: MemberId = MemberId { node: 1, since: 1 };
const M2: MemberId = MemberId { node: 2, since: 5 };
const M3: MemberId = MemberId { node: 3, since: 6 };
const EPOCH: u64 = 4;

fn drain(r: &mut MasterRole) -> Vec<Action> {
    std::iter::from_fn(|| r.poll_action()).collect()
}

/// What a restart of `target`'s sync `sync` looks like: the old one dropped, a new start.
fn restart(target: MemberId, sync: u64, why: Why, active: bool) -> [Action; 2] {
    [
        Action::Abort {
            target,
            id: (EPOCH, sync),
            why,
        },
        Action::StartSync { target, active },
    ]
}

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

/// A view of the metadata at index 100.
fn view(automatic: bool, synced: &[(u64, bool)]) -> SetView {
    SetView {
        mirrors: synced.iter().map(|&(n, s)| (n, s)).collect(),
        automatic,
        requests: (0, 0),
        applied: 100,
    }
}

/// Where the tests' records land: before the views of [`view`].
const RECORDED: Option<u64> = Some(50);

fn members(ms: &[MemberId]) -> BTreeSet<MemberId> {
    ms.iter().copied().collect()
}

fn look(low_seq: Option<u64>) -> Look {
    Look {
        low_seq,
        unindexed: false,
    }
}

fn ack(sync: u64) -> MirrorMsg {
    MirrorMsg::SyncAck { epoch: EPOCH, sync }
}

/// A master alone whose mirror member `M2` (node 2, unsynchronised) joins and whose sync
/// (number 7) starts at seq 100.
fn joined(automatic: bool) -> MasterRole {
    let mut r = MasterRole::new(
        ME,
        EPOCH,
        members(&[ME]),
        view(automatic, &[(2, false)]),
        false,
    );
    assert_eq!(drain(&mut r), []);
    r.handle_members(&members(&[ME, M2]));
    assert_eq!(
        drain(&mut r),
        [Action::StartSync {
            target: M2,
            active: automatic
        }]
    );
    r.handle_sync_started(M2, 7, 100);
    r
}

/// [`joined`], then M2's sync (its copy, or its closing lap) over, acknowledged and
/// recorded at `at`.
fn recorded(automatic: bool, at_index: Option<u64>) -> MasterRole {
    let mut r = joined(automatic);
    drain(&mut r);
    if automatic {
        r.handle_copy_done(M2, (EPOCH, 7), true);
    } else {
        // The backlog is gone: the closing lap goes out, and completes.
        r.handle_tick(at(0), look(None));
        drain(&mut r);
        r.handle_end_lap(M2, (EPOCH, 7), true);
    }
    r.handle_message(M2, &ack(7));
    r.handle_tick(at(10), look(None));
    assert_eq!(
        drain(&mut r).last(),
        Some(&Action::Record {
            target: M2,
            id: (EPOCH, 7)
        })
    );
    r.handle_recorded(M2, (EPOCH, 7), at_index);
    r
}

#[test]
fn a_passive_sync_ends_once_the_backlog_is_gone_and_is_recorded_only_once_acknowledged() {
    let mut r = joined(false);
    assert_eq!(drain(&mut r), []);
    // Messages below the start remain: no end yet.
    r.handle_tick(at(0), look(Some(99)));
    assert_eq!(drain(&mut r), []);
    r.handle_tick(at(200), look(Some(100)));
    assert_eq!(
        drain(&mut r),
        [Action::SendEnd {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
    // The lap is out: not sent twice.
    r.handle_tick(at(400), look(None));
    assert_eq!(drain(&mut r), []);
    r.handle_end_lap(M2, (EPOCH, 7), true);
    assert_eq!(drain(&mut r), [Action::TickNow]);
    r.handle_tick(at(450), look(None));
    assert_eq!(drain(&mut r), [], "not acknowledged yet");
    r.handle_message(M2, &ack(7));
    assert_eq!(drain(&mut r), [Action::TickNow]);
    r.handle_tick(at(460), look(None));
    assert_eq!(
        drain(&mut r),
        [Action::Record {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
    // Proposed: not again while it is out.
    r.handle_tick(at(660), look(None));
    assert_eq!(drain(&mut r), []);
    r.handle_recorded(M2, (EPOCH, 7), RECORDED);
    assert!(!r.syncing());
    r.handle_tick(at(860), look(None));
    assert_eq!(drain(&mut r), []);
}

#[test]
fn an_active_sync_copies_hands_each_answer_once_and_ends_with_its_copy() {
    let mut r = joined(true);
    assert_eq!(
        drain(&mut r),
        [Action::Copy {
            target: M2,
            id: (EPOCH, 7),
            below: 100
        }]
    );
    assert!(r.copying(M2));
    let have = MirrorMsg::SyncHave {
        epoch: EPOCH,
        sync: 7,
        copy_next: 50,
    };
    let want = MirrorMsg::SyncWant {
        epoch: EPOCH,
        sync: 7,
        from: 40,
    };
    let written = |batches| MirrorMsg::SyncWritten {
        epoch: EPOCH,
        sync: 7,
        batches,
    };
    r.handle_message(M2, &have);
    r.handle_message(M2, &have);
    r.handle_message(M2, &want);
    r.handle_message(M2, &written(1));
    r.handle_message(M2, &written(2));
    // Another sync's answers, or another member's, are not this copy's.
    r.handle_message(M3, &want);
    r.handle_message(M3, &written(3));
    r.handle_message(
        M2,
        &MirrorMsg::SyncWant {
            epoch: EPOCH,
            sync: 6,
            from: 0,
        },
    );
    assert_eq!(
        drain(&mut r),
        [
            Action::Answer {
                target: M2,
                id: (EPOCH, 7),
                answer: Answer::Have(50)
            },
            Action::Answer {
                target: M2,
                id: (EPOCH, 7),
                answer: Answer::Want(40)
            },
            Action::Answer {
                target: M2,
                id: (EPOCH, 7),
                answer: Answer::Written(1)
            },
            Action::Answer {
                target: M2,
                id: (EPOCH, 7),
                answer: Answer::Written(2)
            },
        ]
    );
    // The backlog is still there: an active sync does not wait for it to drain.
    r.handle_message(M2, &ack(7));
    assert_eq!(drain(&mut r), [Action::TickNow]);
    r.handle_tick(at(10), look(Some(0)));
    assert_eq!(drain(&mut r), [], "the copy is still running");
    r.handle_copy_done(M2, (EPOCH, 7), true);
    assert_eq!(drain(&mut r), [Action::TickNow]);
    assert!(!r.copying(M2));
    r.handle_tick(at(20), look(Some(0)));
    assert_eq!(
        drain(&mut r),
        [Action::Record {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
}

#[test]
fn a_failed_copy_falls_back_to_the_backlog_draining() {
    let mut r = joined(true);
    drain(&mut r);
    r.handle_copy_done(M2, (EPOCH, 7), false);
    drain(&mut r);
    r.handle_tick(at(0), look(Some(3)));
    assert_eq!(drain(&mut r), []);
    r.handle_tick(at(200), look(None));
    assert_eq!(
        drain(&mut r),
        [Action::SendEnd {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
    // Its lap failed: sent again at the next tick.
    r.handle_end_lap(M2, (EPOCH, 7), false);
    drain(&mut r);
    r.handle_tick(at(400), look(None));
    assert_eq!(
        drain(&mut r),
        [Action::SendEnd {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
}

#[test]
fn nothing_is_recorded_while_the_queue_holds_a_message_outside_its_index() {
    let mut r = joined(true);
    drain(&mut r);
    r.handle_copy_done(M2, (EPOCH, 7), true);
    r.handle_message(M2, &ack(7));
    drain(&mut r);
    r.handle_tick(
        at(0),
        Look {
            low_seq: None,
            unindexed: true,
        },
    );
    assert_eq!(drain(&mut r), []);
    r.handle_tick(at(200), look(None));
    assert_eq!(
        drain(&mut r),
        [Action::Record {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
    // A record that did not commit is proposed again.
    r.handle_recorded(M2, (EPOCH, 7), None);
    r.handle_tick(at(400), look(None));
    assert_eq!(
        drain(&mut r),
        [Action::Record {
            target: M2,
            id: (EPOCH, 7)
        }]
    );
}

#[test]
fn a_sync_its_mirror_never_acknowledges_starts_over_in_its_mode() {
    let mut r = joined(true);
    drain(&mut r);
    r.handle_copy_done(M2, (EPOCH, 7), true);
    drain(&mut r);
    r.handle_tick(at(1_000), look(None));
    r.handle_tick(at(1_000 + SYNC_ACK_WAIT_MS), look(None));
    assert_eq!(drain(&mut r), [], "waited exactly the limit");
    // A stale acknowledgement (an older sync) does not count.
    r.handle_message(M2, &ack(6));
    r.handle_tick(at(1_001 + SYNC_ACK_WAIT_MS), look(None));
    assert_eq!(drain(&mut r), restart(M2, 7, Why::Unacknowledged, true));
    r.handle_sync_started(M2, 8, 120);
    assert_eq!(
        drain(&mut r),
        [Action::Copy {
            target: M2,
            id: (EPOCH, 8),
            below: 120
        }]
    );
    // The old sync's late reports change nothing.
    r.handle_message(M2, &ack(7));
    r.handle_copy_done(M2, (EPOCH, 7), true);
    assert_eq!(drain(&mut r), []);
}

#[test]
fn a_member_that_leaves_takes_its_sync_and_the_ones_of_other_nodes_wait_their_turn() {
    let mut r = MasterRole::new(
        ME,
        EPOCH,
        members(&[ME]),
        view(false, &[(2, false), (3, false)]),
        false,
    );
    r.handle_members(&members(&[ME, M2, M3]));
    // One start out at a time: the next once the first is answered.
    assert_eq!(
        drain(&mut r),
        [Action::StartSync {
            target: M2,
            active: false
        }]
    );
    r.handle_sync_started(M2, 1, 10);
    assert_eq!(
        drain(&mut r),
        [Action::StartSync {
            target: M3,
            active: false
        }]
    );
    r.handle_sync_started(M3, 2, 10);
    r.handle_members(&members(&[ME, M3]));
    assert_eq!(
        drain(&mut r),
        [Action::Abort {
            target: M2,
            id: (EPOCH, 1),
            why: Why::Left
        }]
    );
    // A member of a node outside the set gets no sync.
    let m4 = MemberId { node: 4, since: 9 };
    r.handle_members(&members(&[ME, M3, m4]));
    assert_eq!(drain(&mut r), []);
}

#[test]
fn a_promoted_master_syncs_the_members_the_metadata_does_not_hold_synchronised() {
    let mut r = MasterRole::new(
        ME,
        EPOCH,
        members(&[ME, M2, M3]),
        view(false, &[(2, true), (3, false)]),
        true,
    );
    assert_eq!(
        drain(&mut r),
        [Action::StartSync {
            target: M3,
            active: false
        }]
    );
    // A fresh master syncs only the members that join after it.
    let mut fresh = MasterRole::new(
        ME,
        EPOCH,
        members(&[ME, M2, M3]),
        view(false, &[(2, false), (3, false)]),
        false,
    );
    assert_eq!(drain(&mut fresh), []);
}

#[test]
fn the_metadata_restarts_syncs_it_unsynchronised_and_the_sync_requests_switch_their_mode() {
    let mut r = recorded(false, RECORDED);
    r.handle_view(view(false, &[(2, true)]));
    assert_eq!(drain(&mut r), []);
    // Recorded unsynchronised again while the member stayed: synced again.
    r.handle_view(view(false, &[(2, false)]));
    assert_eq!(drain(&mut r), restart(M2, 7, Why::Unsynchronised, false));
    r.handle_sync_started(M2, 8, 30);
    // A passive sync running: the view repeating itself changes nothing.
    r.handle_view(view(false, &[(2, false)]));
    assert_eq!(drain(&mut r), []);
    // sync_queue: the passive sync becomes an active one.
    let mut v = view(false, &[(2, false)]);
    v.requests = (1, 0);
    r.handle_view(v.clone());
    assert_eq!(drain(&mut r), restart(M2, 8, Why::Requested, true));
    r.handle_sync_started(M2, 9, 30);
    drain(&mut r);
    // cancel_sync_queue: the copying sync falls back to a passive one.
    v.requests = (1, 1);
    r.handle_view(v.clone());
    assert_eq!(drain(&mut r), restart(M2, 9, Why::Requested, false));
    r.handle_sync_started(M2, 10, 30);
    // Cancelling again finds nothing copying.
    v.requests = (1, 2);
    r.handle_view(v);
    assert_eq!(drain(&mut r), []);
}

/// Bug 29 (simulation seed 4733): a record returns once the leader applied it, and the
/// view the master then handles may be this node's older one, showing the mirror still
/// unsynchronised. Taken at its word, it restarted the sync, which empties the mirror's
/// copy while the metadata vouched for it; the master died and that mirror was promoted
/// without the messages confirmed since.
#[test]
fn a_view_older_than_the_record_does_not_restart_the_synchronised_mirror() {
    let mut r = recorded(true, Some(120));
    // The view before the record: nothing to do.
    r.handle_view(view(true, &[(2, false)]));
    assert_eq!(drain(&mut r), []);
    // Nor does a `sync_queue` counted in it restart the mirror as an unsynchronised one.
    let mut v = view(true, &[(2, false)]);
    v.requests = (1, 0);
    v.applied = 110;
    r.handle_view(v.clone());
    assert_eq!(drain(&mut r), []);
    // A view older than the last one seen is no news at all.
    let mut older = v.clone();
    older.applied = 105;
    older.requests = (0, 0);
    r.handle_view(older);
    assert_eq!(drain(&mut r), []);
    // The record's own view, then a later unsync: that one counts.
    v.applied = 120;
    v.mirrors.insert(2, true);
    r.handle_view(v.clone());
    assert_eq!(drain(&mut r), []);
    v.applied = 121;
    v.mirrors.insert(2, false);
    r.handle_view(v);
    // In its mode: the policy syncs automatically.
    assert_eq!(drain(&mut r), restart(M2, 7, Why::Unsynchronised, true));
}

/// The property test's first find: a recorded mirror unsynchronised by the metadata in the
/// same change as a `sync_queue` restarts twice (passive, then active, as before the core);
/// the first sync is dropped before the second starts, so a member never has two.
#[test]
fn a_restart_asked_for_while_a_start_is_out_replaces_that_sync_before_it_starts() {
    let mut r = recorded(false, RECORDED);
    let mut v = view(false, &[(2, false)]);
    v.requests = (1, 0);
    r.handle_view(v);
    assert_eq!(drain(&mut r), restart(M2, 7, Why::Unsynchronised, false));
    r.handle_sync_started(M2, 8, 40);
    assert_eq!(drain(&mut r), restart(M2, 8, Why::Replaced, true));
    r.handle_sync_started(M2, 9, 40);
    assert_eq!(
        drain(&mut r),
        [Action::Copy {
            target: M2,
            id: (EPOCH, 9),
            below: 40
        }]
    );
}

/// One step of the property test.
#[derive(Debug, Clone)]
enum Step {
    Members(Vec<bool>),
    Ack {
        who: usize,
        stale: bool,
    },
    Answer {
        who: usize,
        want: bool,
    },
    CopyDone {
        who: usize,
        ok: bool,
    },
    EndLap {
        who: usize,
        ok: bool,
    },
    Recorded {
        who: usize,
        ok: bool,
    },
    /// This node applies the metadata up to `ahead` entries further (at most to the last):
    /// views reach the master late, and records commit before this node has applied them.
    Deliver {
        ahead: usize,
    },
    View {
        who: usize,
        synced: bool,
        request: u8,
    },
    Tick {
        advance: u64,
        low: Option<u64>,
        unindexed: bool,
    },
}

const OTHERS: [MemberId; 3] = [M2, M3, MemberId { node: 4, since: 8 }];

fn step() -> impl Strategy<Value = Step> {
    let who = 0..OTHERS.len();
    prop_oneof![
        proptest::collection::vec(any::<bool>(), OTHERS.len()).prop_map(Step::Members),
        (who.clone(), any::<bool>()).prop_map(|(who, stale)| Step::Ack { who, stale }),
        (who.clone(), any::<bool>()).prop_map(|(who, want)| Step::Answer { who, want }),
        (who.clone(), any::<bool>()).prop_map(|(who, ok)| Step::CopyDone { who, ok }),
        (who.clone(), any::<bool>()).prop_map(|(who, ok)| Step::EndLap { who, ok }),
        (who.clone(), any::<bool>()).prop_map(|(who, ok)| Step::Recorded { who, ok }),
        (0usize..4).prop_map(|ahead| Step::Deliver { ahead }),
        (who, any::<bool>(), 0u8..3).prop_map(|(who, synced, request)| Step::View {
            who,
            synced,
            request
        }),
        (
            prop_oneof![Just(0u64), 1..500u64, Just(SYNC_ACK_WAIT_MS + 1)],
            proptest::option::of(0..200u64),
            any::<bool>()
        )
            .prop_map(|(advance, low, unindexed)| Step::Tick {
                advance,
                low,
                unindexed
            }),
    ]
}

/// What the model knows of a sync the master started.
#[derive(Debug, Default, Clone)]
struct Known {
    acked: bool,
    /// Its end completed its lap: its copy did, or its closing `SyncEnd` did.
    ended: bool,
    copy_out: bool,
    end_out: bool,
    record_out: bool,
    aborted: bool,
    active: bool,
}

proptest! {
    /// Against a model of the syncs: the master records a mirror synchronised only for a
    /// member of its group, for a sync it started and did not abort, whose end completed
    /// its lap and whose mirror acknowledged that very sync, at a tick where the queue held
    /// nothing outside its index; every start is answered before the next, a member has at
    /// most one sync, nothing is aborted twice, and no sync starts over for a mirror the
    /// metadata holds synchronised by the master's own record, however late the views
    /// reach it (bug 29).
    #[test]
    fn the_master_vouches_only_for_a_mirror_that_acknowledged_a_sync_that_ended(
        steps in proptest::collection::vec(step(), 1..80)
    ) {
        let mut view = SetView {
            mirrors: OTHERS.iter().map(|m| (m.node, false)).collect(),
            automatic: false,
            requests: (0, 0),
            applied: 0,
        };
        let mut r = MasterRole::new(ME, EPOCH, members(&[ME]), view.clone(), false);
        // The metadata: every view it went through (index = applied), and how far this
        // node has applied it.
        let mut history = vec![view.clone()];
        let mut delivered = 0usize;
        // Members whose sync the master recorded, while the metadata still holds that
        // record: their copy is what the metadata vouches for.
        let mut vouched: BTreeSet<MemberId> = BTreeSet::new();
        let mut group = members(&[ME]);
        let mut now = 0u64;
        let mut next_sync = 1u64;
        let mut known: BTreeMap<(u64, u64), Known> = BTreeMap::new();
        // The live sync of each member, as the actions told.
        let mut live: BTreeMap<MemberId, (u64, u64)> = BTreeMap::new();
        for s in steps {
            let mut tick_look = None;
            match s {
                Step::Members(inn) => {
                    group = std::iter::once(ME)
                        .chain(OTHERS.iter().zip(&inn).filter(|(_, i)| **i).map(|(m, _)| *m))
                        .collect();
                    vouched.retain(|m| group.contains(m));
                    r.handle_members(&group);
                }
                Step::Ack { who, stale } => {
                    let m = OTHERS[who];
                    if let Some(&id) = live.get(&m) {
                        let sync = if stale { id.1 - 1 } else { id.1 };
                        if !stale {
                            known.get_mut(&id).unwrap().acked = true;
                        }
                        r.handle_message(m, &MirrorMsg::SyncAck { epoch: EPOCH, sync });
                    }
                }
                Step::Answer { who, want } => {
                    let m = OTHERS[who];
                    if let Some(&id) = live.get(&m) {
                        let msg = if want {
                            MirrorMsg::SyncWant { epoch: EPOCH, sync: id.1, from: 3 }
                        } else {
                            MirrorMsg::SyncHave { epoch: EPOCH, sync: id.1, copy_next: 9 }
                        };
                        r.handle_message(m, &msg);
                    }
                }
                Step::CopyDone { who, ok } => {
                    let m = OTHERS[who];
                    if let Some(&id) = live.get(&m) {
                        let k = known.get_mut(&id).unwrap();
                        if k.copy_out {
                            k.copy_out = false;
                            k.ended |= ok;
                            r.handle_copy_done(m, id, ok);
                        }
                    }
                }
                Step::EndLap { who, ok } => {
                    let m = OTHERS[who];
                    if let Some(&id) = live.get(&m) {
                        let k = known.get_mut(&id).unwrap();
                        if k.end_out {
                            k.end_out = false;
                            k.ended |= ok;
                            r.handle_end_lap(m, id, ok);
                        }
                    }
                }
                Step::Recorded { who, ok } => {
                    let m = OTHERS[who];
                    if let Some(&id) = live.get(&m) {
                        let k = known.get_mut(&id).unwrap();
                        if !k.record_out {
                            continue;
                        }
                        k.record_out = false;
                        if ok {
                            // Committed at the next index, which this node has not
                            // applied yet.
                            view.mirrors.insert(m.node, true);
                            view.applied += 1;
                            history.push(view.clone());
                            vouched.insert(m);
                            r.handle_recorded(m, id, Some(view.applied));
                        } else {
                            r.handle_recorded(m, id, None);
                        }
                    }
                }
                Step::Deliver { ahead } => {
                    delivered = (delivered + ahead).min(history.len() - 1);
                    r.handle_view(history[delivered].clone());
                }
                Step::View { who, synced, request } => {
                    view.mirrors.insert(OTHERS[who].node, synced);
                    if !synced {
                        vouched.remove(&OTHERS[who]);
                    }
                    match request {
                        1 => view.requests.0 += 1,
                        2 => view.requests.1 += 1,
                        _ => {}
                    }
                    view.applied += 1;
                    history.push(view.clone());
                    delivered = history.len() - 1;
                    r.handle_view(view.clone());
                }
                Step::Tick { advance, low, unindexed } => {
                    now += advance;
                    let look = Look { low_seq: low, unindexed };
                    tick_look = Some(look);
                    r.handle_tick(at(now), look);
                }
            }
            while let Some(a) = r.poll_action() {
                match a {
                    Action::StartSync { target, active } => {
                        prop_assert!(group.contains(&target) && target != ME);
                        prop_assert!(!vouched.contains(&target),
                            "{:?}'s copy emptied by a new sync while the metadata vouches for it",
                            target);
                        prop_assert!(!live.contains_key(&target),
                            "a second sync for {:?} while one runs", target);
                        let id = (EPOCH, next_sync);
                        next_sync += 1;
                        known.insert(id, Known { active, ..Known::default() });
                        live.insert(target, id);
                        r.handle_sync_started(target, id.1, 100);
                    }
                    Action::Copy { target, id, below } => {
                        prop_assert_eq!(live.get(&target), Some(&id));
                        prop_assert_eq!(below, 100);
                        let k = known.get_mut(&id).unwrap();
                        prop_assert!(k.active && !k.copy_out);
                        k.copy_out = true;
                    }
                    Action::Answer { target, id, .. } => {
                        prop_assert_eq!(live.get(&target), Some(&id));
                        prop_assert!(known[&id].copy_out, "an answer for no running copy");
                    }
                    Action::SendEnd { target, id } => {
                        prop_assert_eq!(live.get(&target), Some(&id));
                        let k = known.get_mut(&id).unwrap();
                        prop_assert!(!k.copy_out && !k.end_out);
                        prop_assert!(tick_look.is_some_and(|l| l.low_seq.is_none_or(|s| s >= 100)),
                            "a passive sync ended with its backlog still there");
                        k.end_out = true;
                    }
                    Action::Record { target, id } => {
                        prop_assert!(group.contains(&target));
                        prop_assert_eq!(live.get(&target), Some(&id));
                        let k = &known[&id];
                        prop_assert!(k.acked, "recorded before its mirror acknowledged it");
                        prop_assert!(k.ended, "recorded before its end completed its lap");
                        prop_assert!(!k.aborted);
                        prop_assert!(tick_look.is_some_and(|l| !l.unindexed),
                            "recorded while the queue held a message outside its index");
                        prop_assert!(!k.record_out, "recorded twice at once");
                        known.get_mut(&id).unwrap().record_out = true;
                    }
                    Action::Abort { target, id, .. } => {
                        prop_assert_eq!(live.remove(&target), Some(id));
                        let k = known.get_mut(&id).unwrap();
                        prop_assert!(!k.aborted);
                        k.aborted = true;
                        k.copy_out = false;
                        k.end_out = false;
                        k.record_out = false;
                    }
                    Action::TickNow => {}
                }
            }
            // A member that left has no sync.
            for m in live.keys() {
                prop_assert!(group.contains(m), "{:?} left but its sync runs", m);
            }
        }
    }
}

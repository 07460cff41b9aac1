//! The promotion's steps over metadata built by applying commands: the exact actions for
//! each path, and a property test over random orders of the runtime's reports.

use proptest::prelude::*;

use super::{Action, Adoption, Follower, Opened, Outcome, OPEN_WAIT_MS};
use crate::gm::{MemberId, Slot};
use crate::meta::state::MetaState;
use crate::meta::Command;
use crate::mirror::lease::tests::{apply, declare, mirrored, M2, M3, MASTER};
use crate::mirror::message::group_name;
use crate::time::Instant;

const T0: Instant = Instant::from_millis(10_000);

fn key() -> (String, String) {
    ("/".to_string(), "ha.q".to_string())
}

/// `ha.q` promoted from node 1 to node 2, its group holding `slots`.
fn promoted(slots: Vec<Slot>) -> (MetaState, u64) {
    let (mut s, incarnation) = mirrored(slots);
    let set = s.mirror_sets[&key()].clone();
    apply(&mut s, Command::promote("/", "ha.q", &set, 2));
    (s, incarnation)
}

fn set_group(s: &mut MetaState, incarnation: u64, slots: Vec<Slot>) {
    let name = group_name("/", "ha.q", incarnation);
    let expected_version = s.gm_groups.get(&name).map_or(0, |g| g.version);
    apply(
        s,
        Command::GmGroup {
            name,
            expected_version,
            members: slots,
        },
    );
}

fn follower(incarnation: u64, master_member: Option<MemberId>) -> Follower {
    Follower {
        incarnation,
        master: 1,
        master_member,
    }
}

/// The promotion of `ha.q` to node 2 in `s`, with `f` as its member's.
fn start(s: &MetaState, f: Option<Follower>) -> Adoption {
    Adoption::start(s, "/", "ha.q", 2, f, T0)
}

/// [`start`] with the member of a mirror that delivered from the old master, its flush
/// lap come round.
fn flushed(s: &MetaState, incarnation: u64) -> Adoption {
    let mut a = start(s, Some(follower(incarnation, Some(MASTER))));
    drain(&mut a);
    a.handle_flushed(true, s, T0);
    a
}

fn drain(a: &mut Adoption) -> Vec<Action> {
    std::iter::from_fn(|| a.poll_action()).collect()
}

#[test]
fn a_queue_homed_here_without_a_member_is_opened_and_served_without_one() {
    let (s, incarnation) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M3)]);
    let mut a = start(&s, None);
    assert_eq!(drain(&mut a), vec![Action::Open { incarnation }]);
    a.handle_open(Opened::Yes, &s, T0);
    assert_eq!(
        drain(&mut a),
        vec![Action::Finish(Outcome::Serving { member: false })]
    );
    assert!(a.is_done());
}

#[test]
fn a_followers_copy_of_a_deleted_incarnation_is_dropped_and_its_member_abandoned() {
    let (s, incarnation) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M2)]);
    let mut a = start(&s, Some(follower(incarnation - 1, None)));
    assert_eq!(
        drain(&mut a),
        vec![
            Action::DropCopy {
                incarnation: incarnation - 1
            },
            Action::Finish(Outcome::Stale)
        ]
    );
}

#[test]
fn a_follower_flushes_then_ships_before_the_copy_opens() {
    let (s, incarnation) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let epoch = s.mirror_sets[&key()].epoch;
    assert!(epoch > 0, "the promotion moved the epoch on");
    let mut a = start(&s, Some(follower(incarnation, Some(MASTER))));
    assert_eq!(drain(&mut a), vec![Action::Flush { epoch }]);
    // Nothing opens before the lap comes round.
    a.handle_view(&s, T0);
    a.handle_tick(T0.plus_millis(60_000));
    assert_eq!(drain(&mut a), vec![]);
    a.handle_flushed(true, &s, T0);
    assert_eq!(
        drain(&mut a),
        vec![
            Action::Ship { epoch, incarnation },
            Action::Open { incarnation }
        ]
    );
    a.handle_open(Opened::Yes, &s, T0);
    assert_eq!(
        drain(&mut a),
        vec![Action::Finish(Outcome::Serving { member: true })]
    );
}

#[test]
fn a_flush_that_fails_serves_the_copy_as_it_is_without_the_member() {
    let (s, incarnation) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M2)]);
    let mut a = start(&s, Some(follower(incarnation, None)));
    drain(&mut a);
    a.handle_flushed(false, &s, T0);
    assert_eq!(drain(&mut a), vec![Action::Open { incarnation }]);
    a.handle_open(Opened::Yes, &s, T0);
    assert_eq!(
        drain(&mut a),
        vec![Action::Finish(Outcome::Serving { member: false })]
    );
}

#[test]
fn a_planned_move_waits_for_the_old_masters_member_to_leave() {
    let (mut s, incarnation) =
        promoted(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let mut a = flushed(&s, incarnation);
    assert_eq!(
        drain(&mut a),
        vec![],
        "the old master may still ship rounds"
    );
    // Another metadata change that leaves it alive: still waiting.
    set_group(
        &mut s,
        incarnation,
        vec![Slot::Alive(MASTER), Slot::Alive(M2)],
    );
    a.handle_view(&s, T0);
    assert_eq!(drain(&mut a), vec![]);
    // It left; the node rejoined as a mirror under a new member: that one is not waited for.
    let rejoined = MemberId { node: 1, since: 7 };
    set_group(
        &mut s,
        incarnation,
        vec![Slot::Alive(M2), Slot::Alive(rejoined)],
    );
    a.handle_view(&s, T0);
    let epoch = s.mirror_sets[&key()].epoch;
    assert_eq!(
        drain(&mut a),
        vec![
            Action::Ship { epoch, incarnation },
            Action::Open { incarnation }
        ]
    );
}

#[test]
fn without_the_old_masters_member_known_any_live_member_on_its_node_is_waited_for() {
    let rejoined = MemberId { node: 1, since: 7 };
    let (mut s, incarnation) = promoted(vec![Slot::Alive(rejoined), Slot::Alive(M2)]);
    let mut a = start(&s, Some(follower(incarnation, None)));
    drain(&mut a);
    a.handle_flushed(true, &s, T0);
    assert_eq!(drain(&mut a), vec![]);
    // Delivered from the old master's member (dead by now): only that one counts.
    a.set_master_member(MASTER);
    a.handle_view(&s, T0);
    assert_eq!(drain(&mut a).last(), Some(&Action::Open { incarnation }));
    // A member on another node is not taken for the master's.
    let mut b = start(&s, Some(follower(incarnation, None)));
    b.set_master_member(M3);
    drain(&mut b);
    b.handle_flushed(true, &s, T0);
    assert_eq!(drain(&mut b), vec![]);
    set_group(&mut s, incarnation, vec![Slot::Alive(M2)]);
    b.handle_view(&s, T0);
    assert_eq!(drain(&mut b).last(), Some(&Action::Open { incarnation }));
}

#[test]
fn the_metadata_moving_on_while_the_old_master_leaves_ends_the_promotion() {
    // Another home.
    let (mut s, incarnation) =
        promoted(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let mut a = flushed(&s, incarnation);
    let set = s.mirror_sets[&key()].clone();
    apply(&mut s, Command::promote("/", "ha.q", &set, 3));
    a.handle_view(&s, T0);
    assert_eq!(drain(&mut a), vec![Action::Finish(Outcome::Moved)]);

    // Deleted and declared again, homed here: another incarnation, not this copy's.
    let (mut s, incarnation) =
        promoted(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let mut a = flushed(&s, incarnation);
    apply(
        &mut s,
        Command::DeleteQueue {
            vhost: "/".into(),
            name: "ha.q".into(),
        },
    );
    declare(&mut s, 2);
    a.handle_view(&s, T0);
    assert_eq!(drain(&mut a), vec![Action::Finish(Outcome::Moved)]);
}

#[test]
fn the_broker_is_asked_again_on_each_change_until_it_opens_or_the_wait_runs_out() {
    let (s, incarnation) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M2)]);
    let mut a = start(&s, None);
    drain(&mut a);
    assert_eq!(a.deadline(), Some(T0.plus_millis(OPEN_WAIT_MS)));
    a.handle_open(Opened::NotYet { exists: false }, &s, T0);
    assert_eq!(
        drain(&mut a),
        vec![],
        "asked again on the broker's next change"
    );
    a.handle_broker_changed(&s, T0.plus_millis(100));
    assert_eq!(drain(&mut a), vec![Action::Open { incarnation }]);
    // A change while the question is out asks nothing more.
    a.handle_broker_changed(&s, T0.plus_millis(150));
    assert_eq!(drain(&mut a), vec![]);
    a.handle_open(Opened::NotYet { exists: false }, &s, T0.plus_millis(200));
    a.handle_tick(T0.plus_millis(OPEN_WAIT_MS - 1));
    assert_eq!(drain(&mut a), vec![]);
    a.handle_tick(T0.plus_millis(OPEN_WAIT_MS));
    assert_eq!(drain(&mut a), vec![Action::Finish(Outcome::Moved)]);
    assert_eq!(a.deadline(), None);

    // A queue the broker serves already is served; storage failing ends it.
    let mut b = start(&s, None);
    drain(&mut b);
    b.handle_open(Opened::NotYet { exists: true }, &s, T0);
    assert_eq!(
        drain(&mut b),
        vec![Action::Finish(Outcome::Serving { member: false })]
    );
    let mut c = start(&s, None);
    drain(&mut c);
    c.handle_open(Opened::Failed, &s, T0);
    assert_eq!(drain(&mut c), vec![Action::Finish(Outcome::Failed)]);
}

#[test]
fn a_broker_not_ready_while_the_queue_moved_elsewhere_ends_the_promotion() {
    let (mut s, _) = promoted(vec![Slot::Dead(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let mut a = start(&s, None);
    drain(&mut a);
    let set = s.mirror_sets[&key()].clone();
    apply(&mut s, Command::promote("/", "ha.q", &set, 3));
    a.handle_open(Opened::NotYet { exists: false }, &s, T0);
    assert_eq!(drain(&mut a), vec![Action::Finish(Outcome::Moved)]);
}

#[test]
fn a_member_that_stops_before_the_copy_opens() {
    let (s, incarnation) = promoted(vec![Slot::Alive(MASTER), Slot::Alive(M2)]);
    // While flushing: served without it.
    let mut a = start(&s, Some(follower(incarnation, Some(MASTER))));
    drain(&mut a);
    a.handle_member_stopped(T0);
    assert_eq!(drain(&mut a), vec![Action::Open { incarnation }]);
    // While the old master leaves: not served (the old master may have shipped more).
    let mut b = flushed(&s, incarnation);
    b.handle_member_stopped(T0);
    assert_eq!(drain(&mut b), vec![Action::Finish(Outcome::Moved)]);
}

/// A report the runtime may make.
#[derive(Debug, Clone)]
enum Report {
    Flushed(bool),
    OldMasterLeft,
    Moved,
    Opened(Opened),
    BrokerChanged,
    Tick(u64),
    MemberStopped,
}

fn report() -> impl Strategy<Value = Report> {
    prop_oneof![
        any::<bool>().prop_map(Report::Flushed),
        Just(Report::OldMasterLeft),
        Just(Report::Moved),
        prop_oneof![
            Just(Opened::Yes),
            Just(Opened::Failed),
            any::<bool>().prop_map(|exists| Opened::NotYet { exists }),
        ]
        .prop_map(Report::Opened),
        Just(Report::BrokerChanged),
        (0..8_000u64).prop_map(Report::Tick),
        Just(Report::MemberStopped),
    ]
}

proptest! {
    /// Whatever the runtime reports, in whatever order: one `Finish` and nothing after
    /// it; an `Open` only once the flush lap and the old master's leave are over (or the
    /// member is gone); `Ship` only with the member, before its first `Open`; `Serving`
    /// only after an `Open` answered `Yes` (or found the queue served), with the member
    /// exactly when it shipped.
    #[test]
    fn a_promotion_ends_once_and_opens_only_after_its_flush_and_the_old_masters_leave(
        with_follower in any::<bool>(),
        reports in proptest::collection::vec(report(), 0..24),
    ) {
        let (mut s, incarnation) =
            promoted(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
        let f = with_follower.then(|| follower(incarnation, Some(MASTER)));
        let mut a = start(&s, f);
        let mut now = T0;
        let (mut flushed, mut left, mut stopped) = (!with_follower, false, false);
        let (mut shipped, mut opens, mut answered_yes) = (false, 0, false);
        let mut finished = None;
        let mut check = |a: &mut Adoption, flushed: bool, left: bool, stopped: bool,
                         answered_yes: bool| -> Result<(), TestCaseError> {
            while let Some(action) = a.poll_action() {
                prop_assert!(finished.is_none(), "{action:?} after {finished:?}");
                match action {
                    Action::Flush { .. } => prop_assert!(with_follower),
                    Action::DropCopy { .. } => prop_assert!(false, "the copy is current"),
                    Action::Ship { .. } => {
                        prop_assert!(with_follower && !stopped && !shipped && opens == 0);
                        prop_assert!(flushed && left);
                        shipped = true;
                    }
                    Action::Open { .. } => {
                        prop_assert!(!with_follower || stopped || (flushed && left));
                        opens += 1;
                    }
                    Action::Finish(o) => {
                        if let Outcome::Serving { member } = o {
                            prop_assert!(opens > 0 && answered_yes);
                            prop_assert_eq!(member, shipped);
                        }
                        finished = Some(o);
                    }
                }
            }
            Ok(())
        };
        check(&mut a, flushed, left, stopped, answered_yes)?;
        for r in reports {
            match r {
                Report::Flushed(ok) => {
                    if !flushed { flushed = true; left |= !ok; }
                    a.handle_flushed(ok, &s, now);
                }
                Report::OldMasterLeft => {
                    set_group(&mut s, incarnation, vec![Slot::Alive(M2), Slot::Alive(M3)]);
                    left = true;
                    a.handle_view(&s, now);
                }
                Report::Moved => {
                    if s.vhosts["/"].queues["ha.q"].home == 2 {
                        let set = s.mirror_sets[&key()].clone();
                        apply(&mut s, Command::promote("/", "ha.q", &set, 3));
                    }
                    a.handle_view(&s, now);
                    a.handle_broker_changed(&s, now);
                }
                Report::Opened(o) => {
                    answered_yes |= matches!(o, Opened::Yes | Opened::NotYet { exists: true });
                    a.handle_open(o, &s, now);
                }
                Report::BrokerChanged => a.handle_broker_changed(&s, now),
                Report::Tick(ms) => {
                    now = now.plus_millis(ms);
                    a.handle_tick(now);
                }
                Report::MemberStopped => {
                    stopped = true;
                    a.handle_member_stopped(now);
                }
            }
            check(&mut a, flushed, left, stopped, answered_yes)?;
        }
        prop_assert_eq!(finished.is_some(), a.is_done());
    }
}

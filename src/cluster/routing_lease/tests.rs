use super::*;
use proptest::prelude::*;

const LEASE: u64 = 1500;

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

/// Starts the read due at `now` and returns when it began.
fn read(l: &mut RoutingLease, now: u64) -> Instant {
    match l.poll_action(at(now)) {
        Some(Action::Read { began, within_ms }) => {
            assert_eq!(within_ms, LEASE);
            began
        }
        None => panic!("no read due at {now}"),
    }
}

#[test]
fn a_node_routes_nothing_before_its_first_renewal() {
    let mut l = RoutingLease::new(LEASE);
    assert!(!l.routes(at(0)));
    let began = read(&mut l, 0);
    assert!(!l.routes(at(10)), "a read under way grants nothing");
    l.handle_read(at(20), began, true);
    assert!(l.routes(at(20)));
}

#[test]
fn a_renewal_runs_from_when_its_read_began() {
    let mut l = RoutingLease::new(LEASE);
    let began = read(&mut l, 100);
    l.handle_read(at(900), began, true);
    assert_eq!(l.valid_until(), Some(at(100 + LEASE)));
    assert!(l.routes(at(100 + LEASE - 1)));
    assert!(
        !l.routes(at(100 + LEASE)),
        "the lease ends at began + lease"
    );
}

#[test]
fn a_failed_read_renews_nothing_and_is_tried_again_soon() {
    let mut l = RoutingLease::new(LEASE);
    let began = read(&mut l, 0);
    l.handle_read(at(5), began, true);
    let began = read(&mut l, LEASE / 6);
    l.handle_read(at(LEASE / 6 + 40), began, false);
    assert_eq!(l.valid_until(), Some(at(LEASE)), "unchanged");
    assert_eq!(l.deadline(), Some(at(LEASE / 6 + 40 + RETRY_MS)));
    assert!(l.poll_action(at(LEASE / 6 + 40 + RETRY_MS - 1)).is_none());
    read(&mut l, LEASE / 6 + 40 + RETRY_MS);
}

#[test]
fn one_read_at_a_time_every_sixth_of_the_lease() {
    let mut l = RoutingLease::new(LEASE);
    let began = read(&mut l, 0);
    assert_eq!(l.deadline(), None, "a read is under way");
    assert!(l.poll_action(at(10_000)).is_none());
    l.handle_read(at(30), began, true);
    assert_eq!(l.deadline(), Some(at(LEASE / 6)));
    assert!(l.poll_action(at(LEASE / 6 - 1)).is_none());
    read(&mut l, LEASE / 6);
}

#[test]
fn a_report_for_another_read_is_ignored_and_the_lease_never_shrinks() {
    let mut l = RoutingLease::new(LEASE);
    let first = read(&mut l, 0);
    l.handle_read(at(10), at(7), true);
    assert_eq!(l.valid_until(), None, "not the read under way");
    l.handle_read(at(10), first, true);
    let second = read(&mut l, LEASE / 6);
    // Reports out of order cannot happen with one read at a time, but a renewal from an
    // earlier start than the current lease's must not pull it back.
    l.handle_read(at(LEASE / 6 + 1), second, true);
    assert_eq!(l.valid_until(), Some(at(LEASE / 6 + LEASE)));
}

#[test]
fn the_committing_node_waits_past_the_lease_with_room_for_drift_and_slack() {
    assert_eq!(lapse_after_ms(1500), 3750 + ROUTE_SLACK_MS);
}

/// One step of the model: time passes, then some of these happen.
#[derive(Debug, Clone)]
struct Step {
    dt: u64,
    commit: bool,
    apply: bool,
    serve: u8,
}

fn step() -> impl Strategy<Value = Step> {
    (1u64..400, any::<bool>(), any::<bool>(), 0u8..4).prop_map(|(dt, commit, apply, serve)| Step {
        dt,
        commit,
        apply,
        serve,
    })
}

proptest! {
    /// The safety rule, against a model of the leader and a broker that follows late (or
    /// never, for long stretches): whenever the node routes, it has followed every change
    /// committed a lease or more before. A read's index is the leader's commit index when
    /// it serves the read, at or after the read began.
    #[test]
    fn a_node_that_routes_has_followed_every_change_a_lease_old(
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let mut l = RoutingLease::new(LEASE);
        let mut now = 0u64;
        let mut commits: Vec<u64> = Vec::new(); // commit times; index = position + 1
        let mut applied = 0usize;
        // The read under way: when it began and, once served, its index.
        let mut pending: Option<(Instant, Option<usize>)> = None;
        for s in steps {
            now += s.dt;
            if s.commit {
                commits.push(now);
            }
            if s.apply && applied < commits.len() {
                applied += 1;
            }
            if pending.is_none() {
                if let Some(Action::Read { began, .. }) = l.poll_action(at(now)) {
                    pending = Some((began, None));
                }
            }
            if let Some((began, served)) = pending {
                let late = now - began.as_millis() > LEASE;
                match served {
                    _ if late => {
                        l.handle_read(at(now), began, false);
                        pending = None;
                    }
                    None => match s.serve {
                        0 => {
                            l.handle_read(at(now), began, false);
                            pending = None;
                        }
                        1 => pending = Some((began, Some(commits.len()))),
                        _ => {}
                    },
                    Some(index) if applied >= index => {
                        l.handle_read(at(now), began, true);
                        pending = None;
                    }
                    Some(_) => {}
                }
            }
            if l.routes(at(now)) {
                let due = commits.iter().filter(|&&t| t + LEASE <= now).count();
                prop_assert!(
                    applied >= due,
                    "routes at {} with {} applied, {} committed a lease before",
                    now, applied, due
                );
            }
        }
    }
}

//! Two masters never deliver at once (`docs/mirroring.md`): the lease rule
//! ([`super::renewal`]), the failure detector (`cluster::detector`) and the leader's read
//! fence (`cluster::read_fence`) together, against a timed model of one master `A` (node 1)
//! and the Raft leader (node 2) over a link that random cuts, both ways and one way, and
//! random delays disturb, with `A`'s clock running at 0.55–1.5 of the leader's.
//!
//! - `A` sends a frame every 100 ms of its clock, and starts a lease read every
//!   `lease / 3`; a read that reaches the leader counts as hearing `A`, is refused while the
//!   fence holds `A` (on arrival and again after the quorum round), and is served from the
//!   metadata as it stands then: before `NodeDown(A)` commits, `A` home with its member
//!   alive; after, its member dead. `A` keeps `t0 + lease` (its clock) from a served read
//!   that reaches it, and delivers only while its clock is below that.
//! - The leader ticks its detector every 50 ms; a node it offers to record down is fenced
//!   and its `NodeDown` proposed at once, committing 5–100 ms later. From the commit a
//!   mirror is promoted and delivers.
//!
//! The checker: every delivery of `A` comes before the commit. One leader for the whole
//! run (a new leader first watches for a full timeout, and its first entry ends the old
//! fences: the detector's and the fence's own tests) and no refused connections (the
//! shortcut needs `A`'s process gone).

use std::collections::VecDeque;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::tests::{mirrored, M2, M3, MASTER};
use super::{renewal, Claim};
use crate::cluster::detector::Detector;
use crate::cluster::read_fence::ReadFence;
use crate::gm::Slot;
use crate::time::Instant;

const PEER_TIMEOUT_MS: u64 = 1_000;
/// Half the timeout, as the node's default (`runtime::mirror_host::DEFAULT_LEASE`).
const LEASE_MS: u64 = PEER_TIMEOUT_MS / 2;
const TERM: u64 = 3;
const RUN_MS: u64 = 8_000;

/// A cut of the link between `A` and the leader.
#[derive(Debug, Clone, Copy)]
struct Cut {
    from: u64,
    until: u64,
    /// Frames from `A` are lost.
    to_leader: bool,
    /// Frames to `A` are lost.
    to_a: bool,
}

#[derive(Debug)]
enum ToLeader {
    Frame,
    /// A lease read `A` started at `t0` on its clock.
    Read {
        t0: u64,
    },
}

/// The two metadata states `A`'s reads can see.
struct Metadata {
    before: crate::meta::state::MetaState,
    after: crate::meta::state::MetaState,
    claim: Claim,
}

impl Metadata {
    fn new() -> Metadata {
        let (before, incarnation) =
            mirrored(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
        let (after, _) = mirrored(vec![Slot::Dead(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
        Metadata {
            before,
            after,
            claim: Claim {
                node: 1,
                incarnation,
                member: MASTER,
            },
        }
    }

    /// Until when (on `A`'s clock) a read `A` began at `t0` lets it serve.
    fn renew(&self, down: bool, t0: u64) -> Option<u64> {
        let state = if down { &self.after } else { &self.before };
        renewal(
            state,
            "/",
            "ha.q",
            &self.claim,
            Instant::from_millis(t0),
            LEASE_MS,
        )
        .map(Instant::as_millis)
    }
}

/// Runs one schedule; the real times of `A`'s deliveries and of the `NodeDown` commit.
fn run(rate_pct: u64, cuts: &[Cut], seed: u64) -> (Vec<u64>, Option<u64>) {
    let meta = Metadata::new();
    let mut rng = StdRng::seed_from_u64(seed);
    let a_clock = |t: u64| t * rate_pct / 100;
    let cut = |t: u64, to_leader: bool| {
        cuts.iter()
            .any(|c| c.from <= t && t < c.until && if to_leader { c.to_leader } else { c.to_a })
    };
    let mut detector = Detector::new(2, PEER_TIMEOUT_MS, 0);
    let mut fence = ReadFence::new();
    // In flight, by arrival (real ms): to the leader, reads after their quorum round, to A.
    let mut to_leader: VecDeque<(u64, ToLeader)> = VecDeque::new();
    let mut quorum: VecDeque<(u64, u64)> = VecDeque::new();
    let mut to_a: VecDeque<(u64, u64)> = VecDeque::new();
    let mut heard_a: Option<u64> = None;
    let (mut next_frame, mut next_read) = (0u64, 0u64);
    let mut lease_until: Option<u64> = None;
    let mut proposed: Option<u64> = None;
    let mut committed: Option<u64> = None;
    let mut deliveries = Vec::new();
    for t in 0..RUN_MS {
        let a_now = a_clock(t);
        // A: frames, lease reads, deliveries.
        if a_now >= next_frame {
            next_frame = a_now + 100;
            if !cut(t, true) {
                to_leader.push_back((t + rng.gen_range(0..40), ToLeader::Frame));
            }
        }
        if a_now >= next_read {
            next_read = a_now + LEASE_MS / 3;
            if !cut(t, true) {
                to_leader.push_back((t + rng.gen_range(0..40), ToLeader::Read { t0: a_now }));
            }
        }
        if lease_until.is_some_and(|u| a_now < u) && rng.gen_bool(0.2) {
            deliveries.push(t);
        }
        // The leader: what arrived, reads whose quorum round is over, its detector.
        let down = committed.is_some_and(|c| c <= t);
        let mut arrived: Vec<ToLeader> = Vec::new();
        to_leader.make_contiguous().sort_by_key(|(at, _)| *at);
        while to_leader.front().is_some_and(|(at, _)| *at <= t) {
            arrived.push(to_leader.pop_front().expect("front").1);
        }
        for msg in arrived {
            heard_a = Some(t);
            if let ToLeader::Read { t0 } = msg {
                if !fence.refuses(1, TERM) {
                    quorum.push_back((t + rng.gen_range(1..30), t0));
                }
            }
        }
        quorum.make_contiguous().sort_by_key(|(at, _)| *at);
        while quorum.front().is_some_and(|(at, _)| *at <= t) {
            let (_, t0) = quorum.pop_front().expect("front");
            if fence.refuses(1, TERM) {
                continue;
            }
            if let Some(until) = meta.renew(down, t0) {
                if !cut(t, false) {
                    to_a.push_back((t + rng.gen_range(0..40), until));
                }
            }
        }
        if committed == Some(t) {
            fence.handle_recorded(1);
            detector.handle_declared(1);
        }
        if t % 50 == 0 {
            let verdict = detector.handle_tick(
                t,
                true,
                [1, 3],
                |n| if n == 1 { heard_a } else { Some(t) },
                |_| false,
            );
            fence.handle_tick(TERM, &verdict.to_declare);
            if proposed.is_none() && verdict.to_declare.contains(&1) {
                fence.handle_proposed(1);
                proposed = Some(t);
                committed = Some(t + rng.gen_range(5..100));
            }
        }
        // A takes the answers that reached it.
        to_a.make_contiguous().sort_by_key(|(at, _)| *at);
        while to_a.front().is_some_and(|(at, _)| *at <= t) {
            let (_, until) = to_a.pop_front().expect("front");
            lease_until = lease_until.max(Some(until));
        }
    }
    (deliveries, committed)
}

fn cut() -> impl Strategy<Value = Cut> {
    (0..RUN_MS, 1..3_000u64, 0u8..3).prop_map(|(from, len, way)| Cut {
        from,
        until: from + len,
        to_leader: way != 2,
        to_a: way != 1,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// `A` delivers nothing once the `NodeDown` that lets a mirror be promoted has
    /// committed, whatever the cuts, the delays and `A`'s clock (down to 0.55 of the
    /// leader's; the lease is half the timeout).
    #[test]
    fn a_deposed_master_stops_delivering_before_its_successor_starts(
        rate_pct in 55u64..=150,
        cuts in proptest::collection::vec(cut(), 0..4),
        seed in any::<u64>(),
    ) {
        let (deliveries, committed) = run(rate_pct, &cuts, seed);
        if let Some(c) = committed {
            let late: Vec<u64> = deliveries.iter().copied().filter(|&d| d >= c).collect();
            prop_assert!(late.is_empty(), "A delivered at {late:?} after NodeDown committed at {c}");
        }
    }
}

/// The model's check can fail: with `A`'s clock at a third of the leader's (beyond what
/// the lease allows), a long cut makes `A` deliver after its successor began.
#[test]
fn a_master_whose_clock_runs_too_slow_is_caught() {
    let cuts = [Cut {
        from: 2_000,
        until: 6_000,
        to_leader: true,
        to_a: true,
    }];
    let (deliveries, committed) = run(33, &cuts, 7);
    let c = committed.expect("A recorded down during the cut");
    assert!(
        deliveries.iter().any(|&d| d >= c),
        "A should deliver past the commit at {c}"
    );
}

//! The confirm rules over metadata built by applying commands.

use super::{confirms, refuse_unshipped, Shipped};
use crate::gm::Slot;
use crate::meta::state::MetaState;
use crate::meta::Command;
use crate::mirror::lease::tests::{apply, mirrored, synchronise, M2, M3, MASTER};

fn ha_q() -> (String, String) {
    ("/".to_string(), "ha.q".to_string())
}

fn epoch(s: &MetaState) -> u64 {
    s.mirror_sets[&ha_q()].epoch
}

/// `ha.q` homed on node 1, mirrored on 2 and 3, every member alive; node 2's synchronised.
fn synchronised_on_2() -> (MetaState, u64) {
    let (mut s, incarnation) =
        mirrored(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    synchronise(&mut s, incarnation, M2);
    (s, incarnation)
}

fn promote_2(s: &mut MetaState) {
    let expected_epoch = epoch(s);
    apply(
        s,
        Command::PromoteMirror {
            vhost: "/".into(),
            queue: "ha.q".into(),
            expected_epoch,
            node: 2,
        },
    );
}

#[test]
fn a_shipped_round_is_confirmed_only_with_its_laps_done_by_the_master_of_its_epoch() {
    let (s, _) = synchronised_on_2();
    let shipped = Shipped {
        node: 1,
        epoch: epoch(&s),
        laps_done: true,
        handing_over: false,
    };
    assert!(confirms(&s, "/", "ha.q", &shipped));
    for refused in [
        Shipped {
            laps_done: false,
            ..shipped
        },
        Shipped {
            handing_over: true,
            ..shipped
        },
        Shipped {
            epoch: shipped.epoch + 1,
            ..shipped
        },
        Shipped { node: 2, ..shipped },
    ] {
        assert!(!confirms(&s, "/", "ha.q", &refused), "{refused:?}");
    }
    assert!(
        !confirms(&s, "/", "other.q", &shipped),
        "a queue not mirrored"
    );
}

#[test]
fn a_promotion_committed_while_the_laps_ran_voids_the_round() {
    let (mut s, _) = synchronised_on_2();
    let shipped = Shipped {
        node: 1,
        epoch: epoch(&s),
        laps_done: true,
        handing_over: false,
    };
    promote_2(&mut s);
    assert_ne!(epoch(&s), shipped.epoch, "the promotion starts an epoch");
    assert!(!confirms(&s, "/", "ha.q", &shipped));
    // The new master's own rounds, in the new epoch, are confirmed.
    let new = Shipped {
        node: 2,
        epoch: epoch(&s),
        ..shipped
    };
    assert!(confirms(&s, "/", "ha.q", &new));
}

#[test]
fn an_unshipped_round_is_refused_while_a_mirror_could_be_promoted_without_it() {
    // No mirror synchronised, homed here, not fenced: the queue's own disk confirms.
    let (s, incarnation) = mirrored(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    assert!(!refuse_unshipped(&s, "/", "ha.q", 1, None));
    // A mirror recorded synchronised could be promoted without the round.
    let (synced, _) = synchronised_on_2();
    assert!(refuse_unshipped(&synced, "/", "ha.q", 1, None));
    // Not homed here: a deposed master confirms nothing.
    assert!(refuse_unshipped(&s, "/", "ha.q", 2, None));
    // Fenced at the current incarnation and epoch; a fence of an older epoch is stale.
    let now = (incarnation, epoch(&s));
    assert!(refuse_unshipped(&s, "/", "ha.q", 1, Some(now)));
    assert!(!refuse_unshipped(
        &s,
        "/",
        "ha.q",
        1,
        Some((incarnation, now.1 + 1))
    ));
    assert!(!refuse_unshipped(
        &s,
        "/",
        "ha.q",
        1,
        Some((incarnation + 1, now.1))
    ));
    // A queue that is not mirrored is never refused here.
    assert!(!refuse_unshipped(&s, "/", "plain.q", 2, None));
}

#[test]
fn after_a_promotion_the_deposed_master_refuses_and_the_new_one_until_a_mirror_syncs() {
    let (mut s, incarnation) = synchronised_on_2();
    promote_2(&mut s);
    // Node 1 is deposed; node 2 masters with node 3's mirror, not synchronised.
    assert!(refuse_unshipped(&s, "/", "ha.q", 1, None));
    assert!(!refuse_unshipped(&s, "/", "ha.q", 2, None));
    synchronise(&mut s, incarnation, M3);
    assert!(refuse_unshipped(&s, "/", "ha.q", 2, None));
}

//! The lease and hand-over rules over metadata built by applying commands.

use super::{hand_over_after_restart, renewal, Claim};
use crate::gm::{MemberId, Slot};
use crate::meta::state::{MetaState, MirrorRecord, NodeRecord, QueueDef};
use crate::meta::Command;
use crate::mirror::message::group_name;
use crate::time::Instant;

pub(in crate::mirror) const MASTER: MemberId = MemberId { node: 1, since: 1 };
pub(in crate::mirror) const M2: MemberId = MemberId { node: 2, since: 2 };
pub(in crate::mirror) const M3: MemberId = MemberId { node: 3, since: 3 };

pub(in crate::mirror) fn apply(s: &mut MetaState, c: Command) {
    s.apply(&c).expect("applies");
}

/// Declares the durable queue `ha.q` homed on `home`.
pub(in crate::mirror) fn declare(s: &mut MetaState, home: u64) {
    apply(
        s,
        Command::DeclareQueue(QueueDef {
            vhost: "/".into(),
            name: "ha.q".into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Default::default(),
            home,
        }),
    );
}

/// `ha.q` homed on node 1, mirrored on nodes 2 and 3, with a group of `slots`.
pub(in crate::mirror) fn mirrored(slots: Vec<Slot>) -> (MetaState, u64) {
    let mut s = MetaState::default();
    apply(&mut s, Command::AddVhost { name: "/".into() });
    for id in 1..=3 {
        apply(
            &mut s,
            Command::RegisterNode(NodeRecord {
                id,
                name: format!("warren{id}@h"),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }),
        );
    }
    declare(&mut s, 1);
    let mirror = |node| MirrorRecord {
        node,
        since: 0,
        synchronised: false,
    };
    // Node 3's mirror first: the older one (the state dates each mirror by its change).
    for mirrors in [vec![mirror(3)], vec![mirror(2), mirror(3)]] {
        let expected_version = s
            .mirror_sets
            .get(&("/".to_string(), "ha.q".to_string()))
            .map_or(0, |set| set.version);
        apply(
            &mut s,
            Command::SetMirrors {
                vhost: "/".into(),
                queue: "ha.q".into(),
                expected_version,
                mirrors,
            },
        );
    }
    let incarnation = s.mirror_sets[&("/".to_string(), "ha.q".to_string())].incarnation;
    apply(
        &mut s,
        Command::GmGroup {
            name: group_name("/", "ha.q", incarnation),
            expected_version: 0,
            members: slots,
        },
    );
    (s, incarnation)
}

pub(in crate::mirror) fn synchronise(s: &mut MetaState, incarnation: u64, member: MemberId) {
    let epoch = s.mirror_sets[&("/".to_string(), "ha.q".to_string())].epoch;
    apply(
        s,
        Command::MarkSynchronised {
            vhost: "/".into(),
            queue: "ha.q".into(),
            incarnation,
            epoch,
            member,
        },
    );
}

#[test]
fn a_lease_is_renewed_from_the_reads_start_only_while_the_metadata_names_the_master() {
    let (s, incarnation) = mirrored(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    let claim = Claim {
        node: 1,
        incarnation,
        member: MASTER,
    };
    let began = Instant::from_millis(1_000);
    assert_eq!(
        renewal(&s, "/", "ha.q", &claim, began, 2_500),
        Some(Instant::from_millis(3_500))
    );
    // Another node's claim, another incarnation's, another member's: no lease.
    for other in [
        Claim { node: 2, ..claim },
        Claim {
            incarnation: incarnation + 1,
            ..claim
        },
        Claim {
            member: MemberId { node: 1, since: 9 },
            ..claim
        },
    ] {
        assert_eq!(renewal(&s, "/", "ha.q", &other, began, 2_500), None);
    }
    assert_eq!(renewal(&s, "/", "gone", &claim, began, 2_500), None);
    // Its member recorded dead: no lease, whatever else holds.
    let (dead, incarnation) = mirrored(vec![Slot::Dead(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    assert_eq!(
        renewal(
            &dead,
            "/",
            "ha.q",
            &Claim {
                incarnation,
                ..claim
            },
            began,
            2_500
        ),
        None
    );
}

#[test]
fn a_restarted_master_hands_over_to_the_oldest_synchronised_mirror_alive_on_a_running_node() {
    // Node 1's member is dead: a restart the metadata knows of.
    let (mut s, incarnation) = mirrored(vec![Slot::Dead(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    assert_eq!(
        hand_over_after_restart(&s, "/", "ha.q", 1, |_| true),
        None,
        "no mirror is synchronised"
    );
    synchronise(&mut s, incarnation, M2);
    assert_eq!(
        hand_over_after_restart(&s, "/", "ha.q", 1, |_| true),
        Some(2)
    );
    assert_eq!(
        hand_over_after_restart(&s, "/", "ha.q", 1, |n| n != 2),
        None,
        "the synchronised mirror's node is down"
    );
    synchronise(&mut s, incarnation, M3);
    assert_eq!(
        hand_over_after_restart(&s, "/", "ha.q", 1, |_| true),
        Some(3),
        "both synchronised: the oldest"
    );
    assert_eq!(
        hand_over_after_restart(&s, "/", "ha.q", 1, |n| n != 3),
        Some(2)
    );
    assert_eq!(hand_over_after_restart(&s, "/", "nope", 1, |_| true), None);
}

#[test]
fn a_master_whose_member_still_lives_in_the_metadata_does_not_hand_over() {
    let (mut s, incarnation) =
        mirrored(vec![Slot::Alive(MASTER), Slot::Alive(M2), Slot::Alive(M3)]);
    synchronise(&mut s, incarnation, M2);
    assert_eq!(hand_over_after_restart(&s, "/", "ha.q", 1, |_| true), None);
}

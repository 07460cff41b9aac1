//! The group record (as the metadata keeps it) and the view a member derives from it: the
//! ring of live members in record order, each one's neighbours, and which live member
//! inherits each dead one (gm.erl's aliases).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// A GM member: the node it runs on and the group version at which it joined, which tells
/// incarnations on the same node apart (gm.erl's `{Version, Pid}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MemberId {
    /// Cluster node.
    pub node: u64,
    /// Group version when it joined.
    pub since: u64,
}

/// One entry of the ring: a live member, or a dead one whose in-flight messages its
/// inheritor still carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Slot {
    /// A live member.
    Alive(MemberId),
    /// A dead member not yet erased.
    Dead(MemberId),
}

impl Slot {
    /// The member either way.
    pub fn id(&self) -> MemberId {
        match self {
            Slot::Alive(id) | Slot::Dead(id) => *id,
        }
    }
}

/// The canonical group record: the ring order and a version that every change increments
/// (through Raft: a compare-and-set on the version, so changes are totally ordered).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// Incremented by every change.
    pub version: u64,
    /// Ring order.
    pub members: Vec<Slot>,
}

impl GroupRecord {
    /// Whether a member on `node` is alive in the group.
    pub fn has_live_member_on(&self, node: u64) -> bool {
        self.members
            .iter()
            .any(|s| matches!(s, Slot::Alive(id) if id.node == node))
    }
}

/// What became of a join of `me` that its joiner gave up on without learning the outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LateJoin {
    /// It may still commit: the group (`record`, `None` when forgotten) has not passed the
    /// version the join expected.
    Pending,
    /// It committed: the record names `me` alive, with no member behind it.
    Named,
    /// It never can: the record moved past the version the join expected without it.
    Never,
}

/// Whether the abandoned join of `me` committed. The join is a compare-and-set from version
/// `me.since - 1` to `me.since`, and a record never goes back (a forgotten group aside), so
/// once the record is at `me.since` or later the answer is final. A proposal forwarded to
/// the leader can reach its log after the joiner gave up, even after a quorum read that did
/// not show it (bug 26), so the joiner cannot settle this when it gives up.
pub fn late_join(record: Option<&GroupRecord>, me: MemberId) -> LateJoin {
    match record {
        Some(r) if r.members.contains(&Slot::Alive(me)) => LateJoin::Named,
        Some(r) if r.version >= me.since => LateJoin::Never,
        _ => LateJoin::Pending,
    }
}

/// A member's view of the group at one record version.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The record version it was built from.
    pub version: u64,
    /// Live members, in ring order.
    pub ring: Vec<MemberId>,
    /// Dead member → the live member that inherits it (the nearest live one after it).
    pub inheritor: BTreeMap<MemberId, MemberId>,
}

impl View {
    /// Builds the view of `record`.
    pub fn of(record: &GroupRecord) -> View {
        let ring: Vec<MemberId> = record
            .members
            .iter()
            .filter_map(|s| match s {
                Slot::Alive(id) => Some(*id),
                Slot::Dead(_) => None,
            })
            .collect();
        let mut inheritor = BTreeMap::new();
        let n = record.members.len();
        if !ring.is_empty() {
            for (i, slot) in record.members.iter().enumerate() {
                let Slot::Dead(dead) = slot else { continue };
                // The nearest live member downstream (after it, wrapping round).
                let heir = (1..=n)
                    .map(|k| record.members[(i + k) % n])
                    .find_map(|s| match s {
                        Slot::Alive(id) => Some(id),
                        Slot::Dead(_) => None,
                    });
                if let Some(heir) = heir {
                    inheritor.insert(*dead, heir);
                }
            }
        }
        View {
            version: record.version,
            ring,
            inheritor,
        }
    }

    /// Whether `id` is a live member.
    pub fn is_alive(&self, id: MemberId) -> bool {
        self.ring.contains(&id)
    }

    /// The live member upstream of `id` (itself when alone).
    pub fn left(&self, id: MemberId) -> Option<MemberId> {
        let i = self.ring.iter().position(|m| *m == id)?;
        Some(self.ring[(i + self.ring.len() - 1) % self.ring.len()])
    }

    /// The live member downstream of `id` (itself when alone).
    pub fn right(&self, id: MemberId) -> Option<MemberId> {
        let i = self.ring.iter().position(|m| *m == id)?;
        Some(self.ring[(i + 1) % self.ring.len()])
    }

    /// Who carries `id`'s messages: itself when alive, its inheritor when dead.
    pub fn owner(&self, id: MemberId) -> Option<MemberId> {
        if self.is_alive(id) {
            Some(id)
        } else {
            self.inheritor.get(&id).copied()
        }
    }

    /// The dead members `id` inherits.
    pub fn aliases_of(&self, id: MemberId) -> BTreeSet<MemberId> {
        self.inheritor
            .iter()
            .filter(|(_, heir)| **heir == id)
            .map(|(dead, _)| *dead)
            .collect()
    }

    /// Every member the view knows of, live or dead.
    pub fn known(&self) -> BTreeSet<MemberId> {
        self.ring
            .iter()
            .copied()
            .chain(self.inheritor.keys().copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abandoned_join_is_settled_once_the_record_reaches_its_version() {
        let me = MemberId { node: 4, since: 7 };
        let other = MemberId { node: 4, since: 8 };
        let at = |version, members: Vec<Slot>| GroupRecord { version, members };
        let six = at(6, vec![Slot::Alive(m(1))]);
        assert_eq!(late_join(None, me), LateJoin::Pending, "a forgotten group");
        assert_eq!(late_join(Some(&six), me), LateJoin::Pending);
        let named = at(7, vec![Slot::Alive(m(1)), Slot::Alive(me)]);
        assert_eq!(late_join(Some(&named), me), LateJoin::Named);
        let later = at(
            8,
            vec![Slot::Alive(m(1)), Slot::Alive(me), Slot::Alive(other)],
        );
        assert_eq!(late_join(Some(&later), me), LateJoin::Named);
        let without = at(7, vec![Slot::Alive(m(1)), Slot::Alive(other)]);
        assert_eq!(late_join(Some(&without), me), LateJoin::Never);
        let dead = at(9, vec![Slot::Alive(m(1)), Slot::Dead(me)]);
        assert_eq!(
            late_join(Some(&dead), me),
            LateJoin::Never,
            "already buried"
        );
    }

    fn m(node: u64) -> MemberId {
        MemberId { node, since: 0 }
    }

    #[test]
    fn dead_runs_are_inherited_by_the_next_live_member_downstream() {
        let record = GroupRecord {
            version: 7,
            members: vec![
                Slot::Alive(m(1)),
                Slot::Dead(m(2)),
                Slot::Dead(m(3)),
                Slot::Alive(m(4)),
                Slot::Dead(m(5)),
            ],
        };
        let v = View::of(&record);
        assert_eq!(v.ring, [m(1), m(4)]);
        assert_eq!(v.owner(m(2)), Some(m(4)));
        assert_eq!(v.owner(m(3)), Some(m(4)));
        assert_eq!(v.owner(m(5)), Some(m(1)), "the ring wraps round");
        assert_eq!(v.aliases_of(m(4)), BTreeSet::from([m(2), m(3)]));
        assert_eq!((v.left(m(1)), v.right(m(1))), (Some(m(4)), Some(m(4))));
        let alone = View::of(&GroupRecord {
            version: 1,
            members: vec![Slot::Alive(m(9))],
        });
        assert_eq!(
            (alone.left(m(9)), alone.right(m(9))),
            (Some(m(9)), Some(m(9)))
        );
        assert_eq!(alone.left(m(1)), None, "not a member");
    }
}

//! Where a mirrored queue's master and mirrors belong, and who takes over from a master
//! that failed. Pure functions of the policy, the cluster's nodes and the queue's current
//! mirrors (RabbitMQ's `rabbit_mirror_queue_mode_*:suggested_queue_nodes` and
//! `rabbit_mirror_queue_misc:promote_slave`, made deterministic and safe).
//!
//! - `all`: a mirror on every running node.
//! - `exactly N`: N copies in all; existing mirrors are kept (oldest first); missing ones go
//!   to the running nodes that follow the master in node order (so masters spread evenly
//!   spread their mirrors evenly; RabbitMQ picks at random). A node going down leaves the
//!   count short, and another running node gets a mirror.
//! - `nodes [names]`: mirrors on the listed running nodes. A master outside the list stays
//!   until a listed mirror is synchronised, then moves there (never to an unsynchronised
//!   one: that would lose the backlog). No listed node running: no mirrors.
//!
//! Mirrors exist only on running nodes: a mirror whose node went down is gone (its GM member
//! is dead); when the node returns it gets a new, unsynchronised one.

use std::collections::{BTreeMap, BTreeSet};

use super::ha_policy::{HaMode, PromoteRule};
use super::state::MirrorRecord;
use super::NodeId;

/// Where the queue should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The master's node.
    pub master: NodeId,
    /// Mirror nodes, in the order they are (or should be) added: existing ones first.
    pub mirrors: Vec<NodeId>,
}

/// `current` mirrors that are still running, oldest first.
fn live_mirrors(
    master: NodeId,
    current: &[MirrorRecord],
    running: &BTreeSet<NodeId>,
) -> Vec<MirrorRecord> {
    let mut live: Vec<MirrorRecord> = current
        .iter()
        .copied()
        .filter(|m| m.node != master && running.contains(&m.node))
        .collect();
    live.sort_by_key(|m| (m.since, m.node));
    live
}

/// Running nodes other than `master`, in node order starting after it (wrapping round).
fn after(master: NodeId, running: &BTreeSet<NodeId>) -> Vec<NodeId> {
    let (before, rest): (Vec<NodeId>, Vec<NodeId>) = running
        .iter()
        .copied()
        .filter(|n| *n != master)
        .partition(|n| *n < master);
    rest.into_iter().chain(before).collect()
}

/// Where a queue whose master is on `master`, with mirrors `current`, belongs under `mode`.
/// `nodes` are the cluster's registered nodes and their names, `running` the ones up.
pub fn suggested(
    mode: &HaMode,
    master: NodeId,
    current: &[MirrorRecord],
    nodes: &BTreeMap<NodeId, String>,
    running: &BTreeSet<NodeId>,
) -> Placement {
    let live = live_mirrors(master, current, running);
    match mode {
        HaMode::All => {
            let mut mirrors: Vec<NodeId> = live.iter().map(|m| m.node).collect();
            for n in after(master, running) {
                if !mirrors.contains(&n) {
                    mirrors.push(n);
                }
            }
            Placement { master, mirrors }
        }
        HaMode::Exactly(count) => {
            let want = count.saturating_sub(1);
            let mut mirrors: Vec<NodeId> = live.iter().map(|m| m.node).take(want).collect();
            for n in after(master, running) {
                if mirrors.len() >= want {
                    break;
                }
                if !mirrors.contains(&n) {
                    mirrors.push(n);
                }
            }
            Placement { master, mirrors }
        }
        HaMode::Nodes(names) => {
            let listed: BTreeSet<NodeId> = nodes
                .iter()
                .filter(|(id, name)| names.contains(name) && running.contains(id))
                .map(|(id, _)| *id)
                .collect();
            if listed.is_empty() {
                return Placement {
                    master,
                    mirrors: Vec::new(),
                };
            }
            let new_master = if listed.contains(&master) {
                master
            } else {
                // The oldest synchronised mirror on a listed node takes over; until one
                // is synchronised the master stays where it is.
                live.iter()
                    .find(|m| m.synchronised && listed.contains(&m.node))
                    .map_or(master, |m| m.node)
            };
            let mut mirrors: Vec<NodeId> = live
                .iter()
                .map(|m| m.node)
                .filter(|n| *n != new_master && listed.contains(n))
                .collect();
            for n in after(new_master, &listed) {
                if !mirrors.contains(&n) {
                    mirrors.push(n);
                }
            }
            Placement {
                master: new_master,
                mirrors,
            }
        }
    }
}

/// Which mirror takes over from a master that failed (or stopped): the oldest synchronised
/// one on a running node; with [`PromoteRule::Always`] and none synchronised, the oldest
/// one; otherwise none (the queue stays unavailable).
pub fn promotion(
    current: &[MirrorRecord],
    running: &BTreeSet<NodeId>,
    rule: PromoteRule,
) -> Option<NodeId> {
    let mut live: Vec<&MirrorRecord> = current
        .iter()
        .filter(|m| running.contains(&m.node))
        .collect();
    live.sort_by_key(|m| (m.since, m.node));
    live.iter()
        .find(|m| m.synchronised)
        .or_else(|| match rule {
            PromoteRule::Always => live.first(),
            PromoteRule::WhenSynced => None,
        })
        .map(|m| m.node)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: u64) -> BTreeMap<NodeId, String> {
        (1..=n).map(|id| (id, format!("n{id}"))).collect()
    }

    fn up(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    fn mirror(node: NodeId, since: u64, synchronised: bool) -> MirrorRecord {
        MirrorRecord {
            node,
            since,
            synchronised,
        }
    }

    fn place(master: NodeId, mirrors: &[NodeId]) -> Placement {
        Placement {
            master,
            mirrors: mirrors.to_vec(),
        }
    }

    #[test]
    fn all_mirrors_on_every_running_node_keeping_the_existing_ones_first() {
        let p = suggested(&HaMode::All, 2, &[], &nodes(4), &up(&[1, 2, 3, 4]));
        assert_eq!(p, place(2, &[3, 4, 1]), "in node order after the master");
        let current = [mirror(4, 10, true), mirror(1, 5, false)];
        let p = suggested(&HaMode::All, 2, &current, &nodes(4), &up(&[1, 2, 3, 4]));
        assert_eq!(
            p,
            place(2, &[1, 4, 3]),
            "existing mirrors (oldest first), then new"
        );
        let p = suggested(&HaMode::All, 2, &current, &nodes(4), &up(&[2, 3, 4]));
        assert_eq!(p, place(2, &[4, 3]), "no mirror on a down node");
    }

    #[test]
    fn exactly_counts_the_master_and_replaces_a_mirror_whose_node_went_down() {
        let all_up = up(&[1, 2, 3, 4, 5]);
        assert_eq!(
            suggested(&HaMode::Exactly(3), 4, &[], &nodes(5), &all_up),
            place(4, &[5, 1])
        );
        assert_eq!(
            suggested(
                &HaMode::Exactly(1),
                4,
                &[mirror(5, 1, true)],
                &nodes(5),
                &all_up
            ),
            place(4, &[]),
            "exactly 1 is the master alone"
        );
        let current = [mirror(2, 1, true), mirror(3, 2, false)];
        assert_eq!(
            suggested(
                &HaMode::Exactly(3),
                1,
                &current,
                &nodes(5),
                &up(&[1, 3, 4, 5])
            ),
            place(1, &[3, 4]),
            "2 is down: 3 stays, 4 is added"
        );
        assert_eq!(
            suggested(&HaMode::Exactly(2), 1, &current, &nodes(5), &all_up),
            place(1, &[2]),
            "too many: the newest goes"
        );
        assert_eq!(
            suggested(&HaMode::Exactly(5), 1, &[], &nodes(3), &up(&[1, 2, 3])),
            place(1, &[2, 3]),
            "fewer nodes than asked: all of them"
        );
    }

    #[test]
    fn nodes_moves_the_master_only_to_a_synchronised_listed_mirror() {
        let names = HaMode::Nodes(vec!["n2".into(), "n3".into(), "n9".into()]);
        let all_up = up(&[1, 2, 3]);
        assert_eq!(
            suggested(&names, 2, &[], &nodes(3), &all_up),
            place(2, &[3]),
            "unknown names are ignored"
        );
        assert_eq!(
            suggested(&names, 1, &[], &nodes(3), &all_up),
            place(1, &[2, 3]),
            "a master outside the list stays until a listed mirror is synchronised"
        );
        let current = [mirror(2, 1, false), mirror(3, 2, true)];
        assert_eq!(
            suggested(&names, 1, &current, &nodes(3), &all_up),
            place(3, &[2]),
            "then it moves to the oldest synchronised one"
        );
        assert_eq!(
            suggested(&names, 1, &current, &nodes(3), &up(&[1])),
            place(1, &[]),
            "no listed node running: no mirrors"
        );
    }

    #[test]
    fn promotion_takes_the_oldest_synchronised_mirror_and_only_it_unless_always() {
        let current = [mirror(2, 3, true), mirror(3, 1, false), mirror(4, 2, true)];
        let running = up(&[2, 3, 4]);
        assert_eq!(
            promotion(&current, &running, PromoteRule::WhenSynced),
            Some(4)
        );
        assert_eq!(
            promotion(&current, &up(&[2, 3]), PromoteRule::WhenSynced),
            Some(2)
        );
        let unsynced = [mirror(3, 1, false), mirror(2, 0, false)];
        assert_eq!(
            promotion(&unsynced, &running, PromoteRule::WhenSynced),
            None,
            "when-synced: no synchronised mirror, no promotion"
        );
        assert_eq!(
            promotion(&unsynced, &running, PromoteRule::Always),
            Some(2),
            "always: the oldest"
        );
        assert_eq!(promotion(&current, &up(&[]), PromoteRule::Always), None);
    }
}

//! Group commit's bookkeeping, sans-IO: which tickets a round makes durable, which it
//! refuses, and in what order rounds complete.
//!
//! A round drains every dirty queue's operations, writes and fsyncs them once for all
//! publishers (the storage driver, `runtime::storage`, does that part). Its *ticket* is the
//! highest [`super::durability::Durability`] ticket issued when it took the dirty queues;
//! operations that got a later ticket but were drained all the same raise the round's
//! *drained* mark. A round of a mirrored queue also waits for its batches' GM laps before
//! its confirms may go out, so rounds are pipelined: the next one is written while laps are
//! out. This core keeps them in order:
//! - a round completes only after every round written before it, so a confirm never
//!   overtakes an earlier one, and no ticket becomes durable before a round that might
//!   still refuse it;
//! - a round whose lap failed (its master was deposed) refuses every ticket it drained and
//!   any issued since the previous round: refusing too many is safe, confirming one whose
//!   lap failed is not;
//! - with nothing to write, every ticket issued so far belongs to an operation an earlier
//!   round wrote, so it is durable now, or once the rounds still out complete.
//!
//! Inputs are `handle_*` calls; outputs are [`Effect`]s from [`GroupCommit::poll_effect`],
//! which the driver applies to `Durability` in the order given.

use std::collections::VecDeque;

/// Rounds written but not completed at most: the driver writes no more until one completes.
pub const PIPELINE_DEPTH: usize = 8;

/// What the driver does to the tickets, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Refuse (nack) the tickets in `after+1..=upto`.
    Void {
        /// The previous round's ticket.
        after: u64,
        /// The highest ticket the failed round drained.
        upto: u64,
    },
    /// Every ticket up to this one is durable (those refused stay refused).
    Durable(u64),
}

/// A round the driver is writing.
#[derive(Debug, PartialEq, Eq)]
pub struct Round {
    /// Its number, for [`GroupCommit::handle_laps`].
    pub id: u64,
    after: u64,
    ticket: u64,
}

/// What became of a written round.
#[derive(Debug, PartialEq, Eq)]
pub enum Written {
    /// Complete: its effects are queued.
    Done,
    /// Waits: for its own laps (report them with [`GroupCommit::handle_laps`]) or for
    /// earlier rounds.
    Pending,
}

#[derive(Debug)]
struct Out {
    id: u64,
    after: u64,
    ticket: u64,
    drained: u64,
    /// `None` while its laps are out; whether they all completed.
    laps_ok: Option<bool>,
}

/// The group-commit bookkeeping of one node's storage.
#[derive(Debug)]
pub struct GroupCommit {
    /// Confirm a round with no laps before its fsync (`fsync_interval_ms` > 0: RocketMQ-like
    /// async flush, documented as lossy).
    async_flush: bool,
    /// The last round's ticket: a failed round refuses the tickets above it.
    last_ticket: u64,
    next_id: u64,
    /// Rounds written and not completed, oldest first.
    out: VecDeque<Out>,
    effects: VecDeque<Effect>,
}

impl GroupCommit {
    /// Bookkeeping for a storage whose rounds confirm after their fsync, or (`async_flush`)
    /// before it when no lap is out.
    pub fn new(async_flush: bool) -> GroupCommit {
        GroupCommit {
            async_flush,
            last_ticket: 0,
            next_id: 0,
            out: VecDeque::new(),
            effects: VecDeque::new(),
        }
    }

    /// The driver took the dirty queues at `ticket` and none had anything to write.
    pub fn handle_idle(&mut self, ticket: u64) {
        if self.out.is_empty() {
            self.last_ticket = ticket;
            self.effects.push_back(Effect::Durable(ticket));
        }
        // Otherwise the rounds out might refuse these tickets: the next round (or idle
        // call) after they complete settles them.
    }

    /// The driver took the dirty queues at `ticket` and writes what they hold.
    pub fn handle_start(&mut self, ticket: u64) -> Round {
        let after = std::mem::replace(&mut self.last_ticket, ticket);
        let id = self.next_id;
        self.next_id += 1;
        Round { id, after, ticket }
    }

    /// `round` is written to the OS (not yet fsynced); `laps` says whether mirrors' laps
    /// are out for it. In async-flush mode a round with nothing before it is durable now.
    pub fn handle_flushed(&mut self, round: &Round, laps: bool) {
        if self.async_flush && !laps && self.out.is_empty() {
            self.effects.push_back(Effect::Durable(round.ticket));
        }
    }

    /// `round` is fsynced; `drained` is the highest ticket of an operation it drained and
    /// `laps` whether its mirrors' laps are out.
    pub fn handle_written(&mut self, round: Round, drained: u64, laps: bool) -> Written {
        if !laps && self.out.is_empty() {
            self.effects.push_back(Effect::Durable(round.ticket));
            return Written::Done;
        }
        self.out.push_back(Out {
            id: round.id,
            after: round.after,
            ticket: round.ticket,
            drained: drained.max(round.ticket),
            laps_ok: if laps { None } else { Some(true) },
        });
        Written::Pending
    }

    /// Round `id`'s laps are over: all completed (`ok`), or at least one never will.
    /// Completes every round, in order, that no longer waits.
    pub fn handle_laps(&mut self, id: u64, ok: bool) {
        if let Some(o) = self.out.iter_mut().find(|o| o.id == id) {
            o.laps_ok = Some(ok);
        }
        while let Some(ok) = self.out.front().and_then(|o| o.laps_ok) {
            let Some(o) = self.out.pop_front() else { break };
            if !ok {
                self.effects.push_back(Effect::Void {
                    after: o.after,
                    upto: o.drained,
                });
            }
            self.effects.push_back(Effect::Durable(o.ticket));
        }
    }

    /// The next effect to apply.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// Rounds written and not completed.
    pub fn in_flight(&self) -> usize {
        self.out.len()
    }

    /// Whether the driver must wait for a round to complete before it writes another.
    pub fn pipeline_full(&self) -> bool {
        self.out.len() >= PIPELINE_DEPTH
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn effects(g: &mut GroupCommit) -> Vec<Effect> {
        std::iter::from_fn(|| g.poll_effect()).collect()
    }

    #[test]
    fn a_round_without_laps_and_nothing_out_is_durable_at_its_fsync() {
        let mut g = GroupCommit::new(false);
        let r = g.handle_start(5);
        g.handle_flushed(&r, false);
        assert_eq!(effects(&mut g), []);
        assert_eq!(g.handle_written(r, 7, false), Written::Done);
        assert_eq!(effects(&mut g), [Effect::Durable(5)]);
        assert_eq!(g.in_flight(), 0);
    }

    #[test]
    fn async_flush_confirms_at_the_write_unless_laps_or_rounds_are_out() {
        let mut g = GroupCommit::new(true);
        let r = g.handle_start(5);
        g.handle_flushed(&r, false);
        assert_eq!(effects(&mut g), [Effect::Durable(5)]);
        g.handle_written(r, 5, false);
        assert_eq!(effects(&mut g), [Effect::Durable(5)]);
        let r = g.handle_start(9);
        g.handle_flushed(&r, true);
        assert_eq!(effects(&mut g), [], "laps out: after them, never before");
    }

    #[test]
    fn rounds_complete_in_the_order_written_whatever_order_their_laps_end() {
        let mut g = GroupCommit::new(false);
        let first = g.handle_start(3);
        let first_id = first.id;
        assert_eq!(g.handle_written(first, 3, true), Written::Pending);
        let second = g.handle_start(6);
        let second_id = second.id;
        g.handle_written(second, 6, true);
        // A round with no laps of its own still waits for those before it.
        let third = g.handle_start(8);
        assert_eq!(g.handle_written(third, 8, false), Written::Pending);
        assert_eq!(g.in_flight(), 3);
        g.handle_laps(second_id, true);
        assert_eq!(effects(&mut g), [], "the first round is still out");
        g.handle_laps(first_id, true);
        assert_eq!(
            effects(&mut g),
            [Effect::Durable(3), Effect::Durable(6), Effect::Durable(8)]
        );
        assert_eq!(g.in_flight(), 0);
    }

    #[test]
    fn a_failed_lap_refuses_its_round_and_what_it_drained_early_only() {
        let mut g = GroupCommit::new(false);
        let r = g.handle_start(4);
        g.handle_written(r, 4, false);
        effects(&mut g);
        let failed = g.handle_start(10);
        let id = failed.id;
        g.handle_written(failed, 12, true);
        let next = g.handle_start(15);
        let next_id = next.id;
        g.handle_written(next, 15, true);
        g.handle_laps(id, false);
        g.handle_laps(next_id, true);
        assert_eq!(
            effects(&mut g),
            [
                Effect::Void { after: 4, upto: 12 },
                Effect::Durable(10),
                Effect::Durable(15)
            ]
        );
    }

    #[test]
    fn idle_with_rounds_out_settles_nothing_until_they_complete() {
        let mut g = GroupCommit::new(false);
        let r = g.handle_start(2);
        let id = r.id;
        g.handle_written(r, 5, true);
        g.handle_idle(5);
        assert_eq!(effects(&mut g), []);
        g.handle_laps(id, false);
        assert_eq!(
            effects(&mut g),
            [Effect::Void { after: 0, upto: 5 }, Effect::Durable(2)]
        );
        g.handle_idle(5);
        assert_eq!(effects(&mut g), [Effect::Durable(5)]);
        // The next round refuses from the ticket an idle call settled, not before it.
        let r = g.handle_start(7);
        let id = r.id;
        g.handle_written(r, 7, true);
        g.handle_laps(id, false);
        assert_eq!(effects(&mut g)[0], Effect::Void { after: 5, upto: 7 });
    }

    #[test]
    fn the_pipeline_is_full_at_its_depth() {
        let mut g = GroupCommit::new(false);
        for t in 1..=PIPELINE_DEPTH as u64 {
            assert!(!g.pipeline_full());
            let r = g.handle_start(t);
            g.handle_written(r, t, true);
        }
        assert!(g.pipeline_full());
        g.handle_laps(0, true);
        assert!(!g.pipeline_full());
    }

    #[derive(Clone, Debug)]
    enum Step {
        /// Tickets issued by publishers.
        Issue(u8),
        /// A round: it drains the tickets issued so far and maybe some issued while it
        /// runs; it has laps or not.
        Round { late: u8, laps: bool },
        /// The laps of the `n`th oldest round out end.
        Laps { nth: u8, ok: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u8..4).prop_map(Step::Issue),
            (0u8..3, any::<bool>()).prop_map(|(late, laps)| Step::Round { late, laps }),
            (0u8..4, prop::bool::weighted(0.8)).prop_map(|(nth, ok)| Step::Laps { nth, ok }),
        ]
    }

    proptest! {
        /// Against a model of what each ticket's operation went through: a ticket is
        /// confirmed (durable and not refused) only if the round that drained it was
        /// written and its laps (if any) all completed, and every round before it did too;
        /// a refused ticket is never confirmed; once everything completes and an idle
        /// round runs, every ticket is settled one way or the other.
        #[test]
        fn confirms_follow_completed_rounds_in_order(
            steps in prop::collection::vec(step(), 1..60),
            async_flush in any::<bool>(),
        ) {
            let mut g = GroupCommit::new(async_flush);
            let mut issued = 0u64;
            // The round that drained each ticket (index = ticket - 1).
            let mut drained_by: Vec<Option<u64>> = Vec::new();
            // Round id -> (laps done, ok); rounds in written order.
            let mut rounds: Vec<(u64, Option<bool>)> = Vec::new();
            let mut ids_out: Vec<u64> = Vec::new();
            let mut durable = 0u64;
            let mut refused = std::collections::BTreeSet::new();
            let apply = |g: &mut GroupCommit, durable: &mut u64, refused: &mut std::collections::BTreeSet<u64>| {
                while let Some(e) = g.poll_effect() {
                    match e {
                        Effect::Void { after, upto } => refused.extend(after + 1..=upto),
                        Effect::Durable(t) => *durable = (*durable).max(t),
                    }
                }
            };
            for s in steps {
                match s {
                    Step::Issue(n) => {
                        for _ in 0..n {
                            issued += 1;
                            drained_by.push(None);
                        }
                    }
                    Step::Round { late, laps } => {
                        let ticket = issued;
                        let undrained: Vec<usize> =
                            (0..drained_by.len()).filter(|&i| drained_by[i].is_none()).collect();
                        if undrained.is_empty() {
                            g.handle_idle(ticket);
                        } else {
                            let r = g.handle_start(ticket);
                            let id = r.id;
                            for i in &undrained {
                                drained_by[*i] = Some(id);
                            }
                            // Operations whose tickets come after the take but are drained.
                            for _ in 0..late {
                                issued += 1;
                                drained_by.push(Some(id));
                            }
                            g.handle_flushed(&r, laps);
                            g.handle_written(r, issued, laps);
                            rounds.push((id, if laps { None } else { Some(true) }));
                            if laps {
                                ids_out.push(id);
                            }
                        }
                    }
                    Step::Laps { nth, ok } => {
                        if !ids_out.is_empty() {
                            let id = ids_out.remove(nth as usize % ids_out.len());
                            g.handle_laps(id, ok);
                            if let Some(r) = rounds.iter_mut().find(|r| r.0 == id) {
                                r.1 = Some(ok);
                            }
                        }
                    }
                }
                apply(&mut g, &mut durable, &mut refused);
                for t in 1..=durable {
                    if refused.contains(&t) {
                        continue;
                    }
                    let Some(by) = drained_by[t as usize - 1] else {
                        prop_assert!(false, "ticket {t} confirmed before any round drained it");
                        unreachable!()
                    };
                    // Its round and every earlier one completed, and its own laps succeeded.
                    for (id, done) in &rounds {
                        if *id > by {
                            break;
                        }
                        prop_assert!(done.is_some(), "ticket {t} confirmed before round {id} completed");
                    }
                    let own = rounds.iter().find(|r| r.0 == by).and_then(|r| r.1);
                    prop_assert_eq!(own, Some(true), "ticket {} confirmed though its round's lap failed", t);
                }
                prop_assert!(g.in_flight() >= ids_out.len());
                prop_assert!(g.in_flight() <= rounds.len());
            }
            // Everything ends: every lap completes, then an idle round.
            for id in std::mem::take(&mut ids_out) {
                g.handle_laps(id, true);
            }
            apply(&mut g, &mut durable, &mut refused);
            prop_assert_eq!(g.in_flight(), 0);
            if drained_by.iter().any(Option::is_none) {
                let r = g.handle_start(issued);
                g.handle_written(r, issued, false);
            } else {
                g.handle_idle(issued);
            }
            apply(&mut g, &mut durable, &mut refused);
            prop_assert_eq!(durable, issued, "every ticket settled at the end");
        }
    }
}

//! Judges a run's history once the queues are drained.
//!
//! Rules applied:
//! - **Lost**: every acked publish must have been delivered at least once (to a consumer, a
//!   `basic.get` or the drain), except
//!   - messages of a queue incarnation deleted by request: a publish sent before the
//!     declare-ok of a later re-declare of its queue (it went to the old queue, which was
//!     deleted, or to no queue at all while the name was free) is not required;
//!   - transient messages (delivery mode 1) whose queue's master node was restarted (kill -9,
//!     SIGTERM, or the whole cluster) after they were sent: `docs/mirroring.md` ("Transient
//!     messages and non-durable queues", "Limits") lets a node's start drop its own queues'
//!     transient records, as RabbitMQ does; a promoted mirror keeps them, so a pause or a
//!     partition of the master does not excuse a lost transient message.
//! - **Duplicates**: at most one delivery of a message may have `redelivered` unset.
//! - **Order**: within one client stream (a consumer's or a getter's connection), the
//!   first deliveries (`redelivered` unset) of one publisher session come in increasing
//!   sequence order.
//! - Neither duplicates nor order are judged for the dead-letter stream (`--dead-letters`):
//!   a dead letter in flight when its node stops is dead-lettered again after the restart
//!   (`docs/clustering.md`), as a new message without `redelivered`. Its losses count.
//! - **Liveness after the faults**: every publisher gets an ack within `peer_timeout_ms + 3 s`
//!   of the moment the faults were over and every node served again.
//! - **Liveness under a minority partition**: a publisher whose session sat on a majority
//!   node for the whole cut, publishing to a queue whose master or a synchronised mirror was
//!   on the majority side, must see no gap longer than [`MAJORITY_GAP`] without an ack after
//!   the cut settled (a majority node lists the queues mastered on its side and no mirror on
//!   the minority synchronised: the minority recorded down and promotions done); a cut of
//!   more than `peer_timeout_ms + 10 s` that never settles fails too.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::cluster::PEER_TIMEOUT_MS;
use super::history::{Inner, Outcome, Published};
use super::workload::DL_SOURCE;

/// The longest a majority publisher may go without an ack once a minority cut settled.
pub const MAJORITY_GAP: Duration = Duration::from_secs(3);

#[derive(Default, Debug)]
pub struct Verdict {
    pub published: u64,
    pub confirmed: u64,
    pub returned: u64,
    pub delivered: u64,
    pub lost: u64,
    pub lost_transient_allowed: u64,
    pub dup_unflagged: u64,
    /// Dead letters delivered more than once without `redelivered` (allowed).
    pub dup_dead_letters: u64,
    pub order_errors: u64,
    pub liveness_errors: u64,
    pub reasons: Vec<String>,
    /// Measurements worth a line in the run's log (majority gaps under partitions).
    pub notes: Vec<String>,
}

/// Whether `m` was sent before the declare-ok of a later re-declare of its queue: it went to
/// the old incarnation (deleted by request) or to no queue, so nothing has to keep it.
pub fn excused_by_redeclare(h: &Inner, m: &Published) -> bool {
    h.redeclares
        .iter()
        .filter(|r| r.queue == m.queue)
        .map(|r| r.done.unwrap_or_else(Instant::now))
        .max()
        .is_some_and(|r| m.sent <= r)
}

/// Whether publisher `p`'s message `seq` went to the dead-letter stream's source.
fn dead_letter(h: &Inner, p: u32, seq: u64) -> bool {
    h.published
        .get(&p)
        .and_then(|ms| ms.get(seq as usize))
        .is_some_and(|m| m.queue == DL_SOURCE)
}

pub fn check(h: &Inner) -> Verdict {
    let mut v = Verdict {
        delivered: h.deliveries.len() as u64,
        ..Default::default()
    };
    for e in &h.errors {
        v.reasons.push(format!("workload: {e}"));
    }
    // Deliveries per message: (count, unflagged count).
    let mut seen: HashMap<(u32, u64), (u32, u32)> = HashMap::new();
    for d in &h.deliveries {
        let e = seen.entry((d.publisher, d.seq)).or_default();
        e.0 += 1;
        if !d.redelivered {
            e.1 += 1;
        }
    }
    for (&(p, s), &(_, unflagged)) in &seen {
        if unflagged > 1 && dead_letter(h, p, s) {
            v.dup_dead_letters += 1;
        } else if unflagged > 1 {
            v.dup_unflagged += 1;
            if v.dup_unflagged <= 3 {
                v.reasons.push(format!(
                    "publisher {p} seq {s} delivered {unflagged} times without redelivered"
                ));
            }
        }
    }
    let last_redeclare = |q: usize| {
        h.redeclares
            .iter()
            .filter(|r| r.queue == q)
            .map(|r| r.done.unwrap_or_else(Instant::now))
            .max()
    };
    let mut returned_delivered: Vec<String> = Vec::new();
    let mut lost_examples: Vec<String> = Vec::new();
    let mut last_lost = None;
    let mut pubs: Vec<_> = h.published.iter().collect();
    pubs.sort_by_key(|(p, _)| **p);
    for (&p, msgs) in pubs {
        for (seq, m) in msgs.iter().enumerate() {
            v.published += 1;
            if m.outcome == Outcome::Returned {
                v.returned += 1;
                // Returned means no queue took it (one queue per routing key here).
                if seen.contains_key(&(p, seq as u64)) {
                    returned_delivered.push(format!("p{p}/s{}/#{seq}", m.session));
                }
            }
            if !matches!(m.outcome, Outcome::Ack(_)) {
                continue;
            }
            v.confirmed += 1;
            if seen.contains_key(&(p, seq as u64)) {
                continue;
            }
            if excused_by_redeclare(h, m) {
                continue;
            }
            if !m.persistent
                && h.master_restarts
                    .iter()
                    .any(|&(q, at)| q == m.queue && at >= m.sent)
            {
                v.lost_transient_allowed += 1;
                continue;
            }
            v.lost += 1;
            if lost_examples.len() < 3 || v.lost == 1 {
                let node = h
                    .sessions
                    .iter()
                    .find(|s| s.publisher == p && s.session == m.session)
                    .map_or(0, |s| s.node + 1);
                let acked = match m.outcome {
                    Outcome::Ack(t) => h.at(t),
                    _ => "?".into(),
                };
                let example = format!(
                    "p{p}/s{}/#{seq}{} to ha.q{} via node{node} sent {} acked {acked}",
                    m.session,
                    if m.persistent { "" } else { "(transient)" },
                    m.queue,
                    h.at(m.sent),
                );
                if lost_examples.len() < 3 {
                    lost_examples.push(example);
                } else {
                    lost_examples[2] = example;
                }
            }
            last_lost = Some(format!("p{p}/s{}/#{seq} sent {}", m.session, h.at(m.sent)));
        }
    }
    if !returned_delivered.is_empty() {
        v.reasons.push(format!(
            "{} publishes came back unroutable and were delivered too, e.g. {}",
            returned_delivered.len(),
            returned_delivered[..returned_delivered.len().min(3)].join(", ")
        ));
    }
    let late_returns = h
        .published
        .values()
        .flatten()
        .filter(|m| {
            m.outcome == Outcome::Returned && last_redeclare(m.queue).is_some_and(|r| m.sent > r)
        })
        .count();
    if late_returns > 0 {
        v.notes.push(format!(
            "{late_returns} publishes returned unroutable although sent after their queue's last re-declare-ok"
        ));
    }
    if v.lost > 0 {
        let redeclares: Vec<String> = h
            .redeclares
            .iter()
            .map(|r| format!("ha.q{} {}", r.queue, r.done.map_or("?".into(), |t| h.at(t))))
            .collect();
        v.reasons.push(format!(
            "{} confirmed messages lost, e.g. {}; last {}; re-declare-oks: [{}]",
            v.lost,
            lost_examples.join(", "),
            last_lost.unwrap_or_default(),
            redeclares.join(", ")
        ));
    }
    // Order: per stream, per publisher session, first deliveries increasing.
    let mut last: HashMap<(u64, u32, u32), u64> = HashMap::new();
    for d in h
        .deliveries
        .iter()
        .filter(|d| !d.redelivered && !dead_letter(h, d.publisher, d.seq))
    {
        let k = (d.stream, d.publisher, d.session);
        if let Some(&prev) = last.get(&k) {
            if d.seq <= prev {
                v.order_errors += 1;
                if v.order_errors <= 3 {
                    let about = |seq: u64| {
                        h.published
                            .get(&d.publisher)
                            .and_then(|ms| ms.get(seq as usize))
                            .map_or("?".to_string(), |m| {
                                let outcome = match m.outcome {
                                    Outcome::Ack(t) => format!("acked {}", h.at(t)),
                                    o => format!("{o:?}"),
                                };
                                format!("sent {} {outcome}", h.at(m.sent))
                            })
                    };
                    let stream = h
                        .streams
                        .get(&d.stream)
                        .map_or(String::new(), |(n, w)| format!(" ({w} on node{})", n + 1));
                    let session = h
                        .sessions
                        .iter()
                        .find(|s| s.publisher == d.publisher && s.session == d.session)
                        .map_or(String::new(), |s| format!(" (on node{})", s.node + 1));
                    let at = d.at.map_or(String::new(), |t| format!(" at {}", h.at(t)));
                    v.reasons.push(format!(
                        "order: stream {}{stream} got p{}/s{}{session} #{} ({}){at} after #{prev} ({})",
                        d.stream,
                        d.publisher,
                        d.session,
                        d.seq,
                        about(d.seq),
                        about(prev)
                    ));
                }
            }
        }
        last.insert(k, d.seq);
    }
    liveness(h, &mut v);
    v
}

fn acks_of(h: &Inner, p: u32) -> Vec<Instant> {
    let mut acks: Vec<Instant> = h.published[&p]
        .iter()
        .filter_map(|m| match m.outcome {
            Outcome::Ack(t) => Some(t),
            _ => None,
        })
        .collect();
    acks.sort();
    acks
}

fn liveness(h: &Inner, v: &mut Verdict) {
    let bound = Duration::from_millis(PEER_TIMEOUT_MS) + Duration::from_secs(3);
    if let Some(end) = h.faults_end {
        for &p in h.published.keys() {
            let first = acks_of(h, p).into_iter().find(|&t| t > end);
            if first.is_none_or(|t| t - end > bound) {
                v.liveness_errors += 1;
                v.reasons.push(format!(
                    "liveness: publisher {p}'s first ack after the faults came {} (bound {bound:?})",
                    first.map_or("never".to_string(), |t| format!("after {:?}", t - end))
                ));
            }
        }
    }
    for (i, part) in h.partitions.iter().enumerate() {
        let Some(heal) = part.heal else { continue };
        let Some(settled) = part.settled else {
            if heal - part.cut > Duration::from_millis(PEER_TIMEOUT_MS + 10_000)
                && !part.eligible_queues.is_empty()
            {
                v.liveness_errors += 1;
                v.reasons.push(format!(
                    "liveness: partition #{i} of {:?} never settled in {:?}",
                    part.minority,
                    heal - part.cut
                ));
            }
            continue;
        };
        for s in &h.sessions {
            let whole = s.start < part.cut && s.end.is_none_or(|e| e > heal);
            let queue = h.published[&s.publisher]
                .iter()
                .find(|m| m.session == s.session)
                .map(|m| m.queue);
            if !whole
                || part.minority.contains(&s.node)
                || !queue.is_some_and(|q| part.eligible_queues.contains(&q))
            {
                continue;
            }
            let acks: Vec<Instant> = acks_of(h, s.publisher)
                .into_iter()
                .filter(|&t| t > settled && t < heal)
                .collect();
            let mut prev = settled;
            let mut gap = Duration::ZERO;
            for t in acks.iter().copied().chain([heal]) {
                gap = gap.max(t - prev);
                prev = t;
            }
            v.notes.push(format!(
                "partition #{i} of {:?}: settled {:?} after the cut; publisher {} on node{}: longest gap without an ack after that {gap:?}",
                part.minority.iter().map(|m| m + 1).collect::<Vec<_>>(),
                settled - part.cut,
                s.publisher,
                s.node + 1
            ));
            if gap > MAJORITY_GAP {
                v.liveness_errors += 1;
                v.reasons.push(format!(
                    "liveness: partition #{i} of {:?}: publisher {} on node{} went {gap:?} without an ack after the cut settled ({:?} after the cut)",
                    part.minority.iter().map(|m| m + 1).collect::<Vec<_>>(),
                    s.publisher,
                    s.node + 1,
                    settled - part.cut
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::history::{Delivery, Published, Redeclare};
    use super::*;

    fn msg(queue: usize, persistent: bool, sent: Instant, outcome: Outcome) -> Published {
        Published {
            session: 1,
            queue,
            persistent,
            sent,
            outcome,
        }
    }

    fn got(seq: u64, stream: u64, redelivered: bool) -> Delivery {
        Delivery {
            publisher: 0,
            session: 1,
            seq,
            stream,
            redelivered,
            at: None,
        }
    }

    #[test]
    fn a_confirmed_message_never_delivered_is_lost_unless_excused() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(10);
        let mut h = Inner::default();
        h.published.insert(
            0,
            vec![
                msg(0, true, t0, Outcome::Ack(t1)),  // delivered
                msg(0, true, t0, Outcome::Ack(t1)),  // lost
                msg(0, true, t0, Outcome::Unknown),  // may be lost
                msg(1, true, t0, Outcome::Ack(t1)),  // its queue re-declared after
                msg(0, false, t0, Outcome::Ack(t1)), // transient, master restarted
                msg(0, false, t1, Outcome::Ack(t1)), // transient, sent after: lost
            ],
        );
        h.deliveries.push(got(0, 0, false));
        h.redeclares.push(Redeclare {
            queue: 1,
            done: Some(t1),
        });
        h.master_restarts.push((0, t0));
        let v = check(&h);
        assert_eq!((v.confirmed, v.lost, v.lost_transient_allowed), (5, 2, 1));
    }

    #[test]
    fn a_returned_publish_that_was_delivered_fails_the_run() {
        let t0 = Instant::now();
        let mut h = Inner::default();
        h.published.insert(
            0,
            vec![
                msg(0, true, t0, Outcome::Returned), // delivered: a contradiction
                msg(0, true, t0, Outcome::Returned), // not delivered: fine
            ],
        );
        h.deliveries.push(got(0, 0, false));
        let v = check(&h);
        assert_eq!(v.returned, 2);
        assert_eq!(v.reasons.len(), 1, "{:?}", v.reasons);
        assert!(v.reasons[0].contains("p0/s1/#0"), "{:?}", v.reasons);
    }

    #[test]
    fn duplicates_need_the_flag_and_first_deliveries_keep_order() {
        let t0 = Instant::now();
        let mut h = Inner::default();
        h.published
            .insert(0, (0..3).map(|_| msg(0, true, t0, Outcome::Nack)).collect());
        h.deliveries.extend([
            got(0, 0, false),
            got(0, 1, true), // flagged: fine
            got(1, 0, false),
            got(1, 1, false), // unflagged twice
            got(2, 2, false),
            got(0, 2, false), // a third unflagged delivery of 0, and out of order on stream 2
        ]);
        let v = check(&h);
        assert_eq!((v.dup_unflagged, v.order_errors), (2, 1));
    }

    #[test]
    fn dead_letters_may_come_twice_and_out_of_order_but_not_go_missing() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(10);
        let mut h = Inner::default();
        h.published.insert(
            0,
            (0..4)
                .map(|_| msg(DL_SOURCE, true, t0, Outcome::Ack(t1)))
                .collect(),
        );
        h.deliveries.extend([
            got(1, 0, false),
            got(0, 0, false), // out of order
            got(1, 1, false), // unflagged twice
            got(2, 1, false),
        ]);
        let v = check(&h);
        assert_eq!(
            (v.dup_unflagged, v.dup_dead_letters, v.order_errors),
            (0, 1, 0)
        );
        assert_eq!(v.lost, 1, "#3 was confirmed and never delivered");
    }
}

//! GM scenarios on an in-memory ring: every message a member emits goes into a FIFO link to
//! its addressee, links are pumped one message at a time in a fixed order, the group record
//! changes only through the harness (as the metadata would change it), and a killed member
//! loses what was addressed to it. Checked: exact messages of a lap, deliveries (each once,
//! per-origin order, identical on members that stay), confirmations, inheritance and alias
//! erasure, joins and leaves; and a property test over random schedules.

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;

use super::*;

fn m(node: u64) -> MemberId {
    MemberId { node, since: 0 }
}

/// A group record at `version`.
fn record(version: u64, members: Vec<Slot>) -> GroupRecord {
    GroupRecord { version, members }
}

/// Births and deaths one `MembersChanged` reported.
type Change = (Vec<MemberId>, Vec<MemberId>);

#[derive(Default)]
struct Ring {
    record: GroupRecord,
    members: BTreeMap<MemberId, Member<String>>,
    links: BTreeMap<(MemberId, MemberId), VecDeque<GmMsg<String>>>,
    /// Every message sent, in order: (from, to, message).
    trace: Vec<(MemberId, MemberId, GmMsg<String>)>,
    delivered: BTreeMap<MemberId, Vec<(MemberId, String)>>,
    confirmed: BTreeMap<MemberId, Vec<u64>>,
    changes: BTreeMap<MemberId, Vec<Change>>,
    stopped: Vec<MemberId>,
    /// Members run with durable acks.
    durable: bool,
    /// Per member and origin: the highest publish number delivered, and released.
    seen: BTreeMap<MemberId, BTreeMap<MemberId, PubNum>>,
    released: BTreeMap<MemberId, BTreeMap<MemberId, PubNum>>,
    /// Broadcasts so far (a clock for "ready before"), when each member got its state (a
    /// joiner with its first catch-up: what was in flight then is backlog, not delivered to
    /// it), and each confirmed broadcast's (origin, token = publish number) time.
    clock: usize,
    ready: BTreeMap<MemberId, usize>,
    sent_at: BTreeMap<(MemberId, u64), usize>,
    /// Confirmations that came while a member there before the broadcast had not released.
    violations: Vec<String>,
}

impl Ring {
    /// Member 1 alone, then 2, 3, ... each joining on the right of the previous one.
    fn new(n: u64) -> Ring {
        Ring::build(n, false)
    }

    fn build(n: u64, durable: bool) -> Ring {
        let mut r = Ring {
            record: GroupRecord {
                version: 1,
                members: vec![Slot::Alive(m(1))],
            },
            durable,
            ..Ring::default()
        };
        let first = r.member(m(1));
        r.members.insert(m(1), first);
        for node in 2..=n {
            r.join(m(node), m(node - 1));
        }
        r.pump();
        r
    }

    fn member(&mut self, id: MemberId) -> Member<String> {
        let member = Member::new(id, &self.record);
        if self.durable {
            member.with_durable_acks()
        } else {
            member
        }
    }

    /// `id` releases everything it delivered (durable acks: it is on disk now).
    fn release(&mut self, id: MemberId) {
        let seen = self.seen.get(&id).cloned().unwrap_or_default();
        if let Some(member) = self.members.get_mut(&id) {
            for (origin, n) in seen {
                member.release(origin, n);
                self.released.entry(id).or_default().insert(origin, n);
            }
        }
        self.collect();
    }

    fn bump(&mut self) {
        self.record.version += 1;
        let record = self.record.clone();
        for member in self.members.values_mut() {
            member.handle_view(&record);
        }
        self.collect();
    }

    /// `id` joins on the right of `left`.
    fn join(&mut self, id: MemberId, left: MemberId) {
        let at = self
            .record
            .members
            .iter()
            .position(|s| s.id() == left)
            .expect("left is a member");
        self.record.members.insert(at + 1, Slot::Alive(id));
        self.record.version += 1;
        let member = self.member(id);
        self.members.insert(id, member);
        self.record.version -= 1;
        self.bump();
    }

    /// `id` dies: what was on its way to it is lost; with `lose_sent`, so is what it had
    /// sent and its neighbour had not read yet.
    fn kill(&mut self, id: MemberId, lose_sent: bool) {
        self.members.remove(&id);
        self.links
            .retain(|(from, to), _| *to != id && !(lose_sent && *from == id));
        for s in &mut self.record.members {
            if *s == Slot::Alive(id) {
                *s = Slot::Dead(id);
            }
        }
        self.bump();
    }

    /// Takes every member's output into the links and its events into the records.
    fn collect(&mut self) {
        let mut erase = Vec::new();
        let mut confirmed = Vec::new();
        for (id, member) in self.members.iter_mut() {
            if member.is_ready() {
                self.ready.entry(*id).or_insert(self.clock);
            }
            while let Some((to, msg)) = member.poll_transmit() {
                self.trace.push((*id, to, msg.clone()));
                self.links.entry((*id, to)).or_default().push_back(msg);
            }
            while let Some(e) = member.poll_event() {
                match e {
                    Event::Deliver { from, num, msg } => {
                        self.delivered.entry(*id).or_default().push((from, msg));
                        self.seen.entry(*id).or_default().insert(from, num);
                    }
                    Event::Confirmed(t) => {
                        self.confirmed.entry(*id).or_default().push(t);
                        confirmed.push((*id, t));
                    }
                    Event::MembersChanged { births, deaths } => {
                        self.changes.entry(*id).or_default().push((births, deaths))
                    }
                    Event::EraseAliases(ids) => erase.extend(ids),
                    Event::Stopped => self.stopped.push(*id),
                    Event::Joined { .. } => {}
                }
            }
        }
        {
            // G7: a confirmed publish was delivered (with durable acks: released) on every
            // live member that had its state before it was sent (when the origin is left
            // alone, the others are dead and owe nothing).
            let held = if self.durable {
                &self.released
            } else {
                &self.seen
            };
            for (origin, t) in confirmed {
                let Some(at) = self.sent_at.get(&(origin, t)).copied() else {
                    continue;
                };
                for id in self.members.keys() {
                    let released = held.get(id).and_then(|r| r.get(&origin));
                    if self.ready.get(id).is_some_and(|b| *b < at)
                        && released.is_none_or(|r| *r < t)
                    {
                        self.violations.push(format!(
                            "{origin:?}'s {t} confirmed before {id:?} released it"
                        ));
                    }
                }
            }
        }
        if !erase.is_empty() {
            // The metadata erases them (one compare-and-set per request in the node).
            self.record
                .members
                .retain(|s| !matches!(s, Slot::Dead(id) if erase.contains(id)));
            self.bump();
        }
    }

    /// Delivers one pending message (the first non-empty link in order); false when none.
    fn step(&mut self) -> bool {
        let Some((&(from, to), _)) = self.links.iter().find(|(_, q)| !q.is_empty()) else {
            return false;
        };
        let msg = self
            .links
            .get_mut(&(from, to))
            .and_then(|q| q.pop_front())
            .expect("non-empty");
        if let Some(member) = self.members.get_mut(&to) {
            member.handle_message(msg);
        }
        self.collect();
        true
    }

    /// Orphaned members (every source of their state died first) stop, and their owner
    /// records them dead, as the GM host does (`docs/gm.md`, *orphaned joiners*).
    /// Whether it reaped any.
    fn reap_orphans(&mut self) -> bool {
        let orphans: Vec<MemberId> = self
            .members
            .iter()
            .filter(|(_, m)| m.is_orphaned())
            .map(|(id, _)| *id)
            .collect();
        for id in &orphans {
            self.kill(*id, false);
        }
        !orphans.is_empty()
    }

    fn pump(&mut self) {
        for member in self.members.values_mut() {
            member.flush();
        }
        self.collect();
        let mut n = 0;
        loop {
            while self.step() {
                n += 1;
                assert!(n < 100_000, "the ring does not settle");
            }
            if self.reap_orphans() {
                // The others see the new view: they may have work again.
                continue;
            }
            if !self.durable || self.all_quiet() {
                break;
            }
            // Durable acks: everyone writes what it has, and the ring moves on.
            let ids: Vec<MemberId> = self.members.keys().copied().collect();
            for id in ids {
                self.release(id);
            }
            n += 1;
            assert!(
                n < 100_000,
                "the durable ring does not settle: {:#?}",
                self.members
                    .values()
                    .filter(|m| !m.is_quiet())
                    .collect::<Vec<_>>()
            );
        }
    }

    /// Delivers every pending message, releasing nothing.
    fn pump_without_release(&mut self) {
        for member in self.members.values_mut() {
            member.flush();
        }
        self.collect();
        while self.step() {}
    }

    fn broadcast(&mut self, id: MemberId, msg: &str) {
        self.clock += 1;
        self.members
            .get_mut(&id)
            .expect("member")
            .broadcast(msg.into());
        self.collect();
    }

    /// A confirmed broadcast whose token is its publish number (`k`-th of `id`).
    fn confirmed_broadcast(&mut self, id: MemberId, msg: &str, k: u64) {
        self.clock += 1;
        self.sent_at.insert((id, k), self.clock);
        self.members
            .get_mut(&id)
            .expect("member")
            .confirmed_broadcast(msg.into(), k);
        self.collect();
    }

    /// Messages `id` delivered from `origin`, in order.
    fn from(&self, id: MemberId, origin: MemberId) -> Vec<String> {
        self.delivered
            .get(&id)
            .map(|d| {
                d.iter()
                    .filter(|(o, _)| *o == origin)
                    .map(|(_, s)| s.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn all_quiet(&self) -> bool {
        self.members.values().all(|m| m.is_quiet())
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_publish_travels_one_lap_with_its_body_and_one_as_an_ack_and_its_origin_gets_back_only_its_number(
) {
    let mut r = Ring::new(3);
    r.trace.clear();
    r.members
        .get_mut(&m(1))
        .expect("member")
        .confirmed_broadcast("x".into(), 7);
    r.collect();
    assert!(!r.confirmed.contains_key(&m(1)), "not before the lap");
    r.pump();
    let item = |id: MemberId, pubs: &[(u64, &str)], acks: &[u64]| Item {
        id,
        pubs: pubs.iter().map(|(n, s)| (*n, s.to_string())).collect(),
        acks: acks.to_vec(),
    };
    let hops: Vec<(MemberId, MemberId, Vec<Item<String>>)> = r
        .trace
        .iter()
        .map(|(f, t, msg)| match msg {
            GmMsg::Activity { items, .. } => (*f, *t, items.clone()),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let v = r.record.version;
    assert!(r
        .trace
        .iter()
        .all(|(_, _, msg)| matches!(msg, GmMsg::Activity { version, .. } if *version == v)));
    assert_eq!(
        hops,
        vec![
            (m(1), m(2), vec![item(m(1), &[(0, "x")], &[])]),
            (m(2), m(3), vec![item(m(1), &[(0, "x")], &[])]),
            // The last hop brings back the number only: 1 holds the body.
            (m(3), m(1), vec![item(m(1), &[(0, "")], &[])]),
            (m(1), m(2), vec![item(m(1), &[], &[0])]),
            (m(2), m(3), vec![item(m(1), &[], &[0])]),
            (m(3), m(1), vec![item(m(1), &[], &[0])]),
        ]
    );
    assert_eq!(r.confirmed[&m(1)], [7]);
    for id in [m(1), m(2), m(3)] {
        assert_eq!(r.from(id, m(1)), strings(&["x"]), "{id:?}");
    }
    assert!(r.all_quiet());
}

#[test]
fn every_member_delivers_every_message_once_in_per_origin_order() {
    let mut r = Ring::new(4);
    for i in 0..5 {
        for id in 1..=4 {
            r.broadcast(m(id), &format!("{id}-{i}"));
        }
        if i % 2 == 0 {
            r.pump();
        }
    }
    r.pump();
    for to in 1..=4 {
        for origin in 1..=4 {
            let expect: Vec<String> = (0..5).map(|i| format!("{origin}-{i}")).collect();
            assert_eq!(r.from(m(to), m(origin)), expect, "{to} from {origin}");
        }
    }
    assert!(r.all_quiet());
}

#[test]
fn a_member_dying_with_messages_on_its_way_loses_none_of_them() {
    let mut r = Ring::new(4);
    r.broadcast(m(1), "a");
    r.broadcast(m(1), "b");
    r.members.get_mut(&m(1)).expect("member").flush();
    r.collect();
    // 2 reads the activity (and forwards it) but 3 never gets it: 2 dies with it unread.
    assert!(r.step());
    r.kill(m(2), true);
    r.pump();
    for id in [1, 3, 4] {
        assert_eq!(r.from(m(id), m(1)), strings(&["a", "b"]), "{id}");
    }
    assert!(r.all_quiet());
    // The death is reported once to each survivor, after its birth.
    for id in [1, 3, 4] {
        let deaths: Vec<&MemberId> = r.changes[&m(id)]
            .iter()
            .flat_map(|(_, d)| d.iter())
            .collect();
        assert_eq!(deaths, [&m(2)], "{id}");
    }
}

#[test]
fn the_next_member_downstream_inherits_a_dead_origin_and_then_erases_it() {
    let mut r = Ring::new(4);
    r.broadcast(m(2), "p");
    r.broadcast(m(2), "q");
    r.members.get_mut(&m(2)).expect("member").flush();
    r.collect();
    // 3 gets them; 2 dies before they reach 4 and 1.
    assert!(r.step());
    r.kill(m(2), false);
    r.pump();
    for id in [1, 3, 4] {
        assert_eq!(r.from(m(id), m(2)), strings(&["p", "q"]), "{id}");
    }
    assert!(r.all_quiet());
    assert!(
        r.record.members.iter().all(|s| s.id() != m(2)),
        "the inheritor had 2 erased once nothing was in flight: {:?}",
        r.record
    );
}

#[test]
fn chained_deaths_pass_the_inheritance_on() {
    let mut r = Ring::new(5);
    r.broadcast(m(2), "two");
    r.broadcast(m(1), "one");
    for id in [1, 2] {
        r.members.get_mut(&m(id)).expect("member").flush();
    }
    r.collect();
    assert!(r.step());
    // 3 (the inheritor of 2) dies too, before anything settles.
    r.kill(m(2), false);
    r.kill(m(3), true);
    r.pump();
    for id in [1, 4, 5] {
        assert_eq!(r.from(m(id), m(1)), strings(&["one"]), "{id}");
        let from_two = r.from(m(id), m(2));
        assert!(from_two.len() <= 1, "no duplicates at {id}: {from_two:?}");
    }
    // What reached any survivor reached every survivor.
    let reached = r.from(m(4), m(2));
    for id in [1, 5] {
        assert_eq!(r.from(m(id), m(2)), reached, "{id}");
    }
    assert!(r.all_quiet());
    assert_eq!(
        r.record.members.len(),
        3,
        "both dead members erased: {:?}",
        r.record
    );
}

#[test]
fn a_joiner_gets_messages_published_after_it_joined_and_no_duplicates() {
    let mut r = Ring::new(3);
    r.broadcast(m(1), "before");
    r.members.get_mut(&m(1)).expect("member").flush();
    r.collect();
    assert!(r.step(), "in flight when 4 joins");
    r.join(m(4), m(3));
    r.broadcast(m(2), "after");
    r.pump();
    assert_eq!(r.from(m(4), m(2)), strings(&["after"]));
    assert!(r.from(m(4), m(1)).len() <= 1, "at most once");
    for id in [1, 2, 3] {
        assert_eq!(r.from(m(id), m(1)), strings(&["before"]));
        assert_eq!(r.from(m(id), m(2)), strings(&["after"]));
    }
    assert!(r.all_quiet());
    // G5: each member saw 4's birth.
    for id in [1, 2, 3] {
        assert!(
            r.changes[&m(id)].iter().any(|(b, _)| b.contains(&m(4))),
            "{id}"
        );
    }
}

#[test]
fn a_member_left_out_of_the_record_stops_and_the_rest_carry_on() {
    let mut r = Ring::new(3);
    r.broadcast(m(3), "pending");
    r.members.get_mut(&m(3)).expect("member").flush();
    r.collect();
    // 3 is recorded dead while its member still runs (it was cut off): it stops.
    for s in &mut r.record.members {
        if *s == Slot::Alive(m(3)) {
            *s = Slot::Dead(m(3));
        }
    }
    r.bump();
    assert_eq!(r.stopped, [m(3)]);
    r.members.remove(&m(3));
    r.links.retain(|(_, to), _| *to != m(3));
    r.pump();
    let one = r.from(m(1), m(3));
    assert_eq!(r.from(m(2), m(3)), one, "survivors agree");
    assert!(r.all_quiet());
}

#[test]
fn a_lone_member_confirms_at_once_and_a_stale_view_is_held() {
    let record = GroupRecord {
        version: 1,
        members: vec![Slot::Alive(m(1))],
    };
    let mut a: Member<String> = Member::new(m(1), &record);
    a.confirmed_broadcast("solo".into(), 1);
    let events: Vec<Event<String>> = std::iter::from_fn(|| a.poll_event()).collect();
    assert!(events.contains(&Event::Confirmed(1)), "{events:?}");
    assert!(a.poll_transmit().is_none());
    // A message stamped with a newer view waits for it.
    let two = GroupRecord {
        version: 2,
        members: vec![Slot::Alive(m(2)), Slot::Alive(m(1))],
    };
    a.handle_message(GmMsg::Activity {
        version: 2,
        from: m(2),
        items: vec![Item {
            id: m(2),
            pubs: vec![(0, "late".into())],
            acks: vec![],
        }],
    });
    assert!(std::iter::from_fn(|| a.poll_event()).all(|e| !matches!(e, Event::Deliver { .. })));
    a.handle_view(&two);
    let delivered: Vec<Event<String>> = std::iter::from_fn(|| a.poll_event()).collect();
    assert!(
        delivered.contains(&Event::Deliver {
            from: m(2),
            num: 0,
            msg: "late".into()
        }),
        "{delivered:?}"
    );
}

/// One step of a random schedule.
#[derive(Clone, Debug)]
enum Op {
    Broadcast(u64),
    Flush(u64),
    Step,
    Kill(u64, bool),
    /// A new member joins on the right of this one.
    Join(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..=5).prop_map(Op::Broadcast),
        2 => (1u64..=5).prop_map(Op::Flush),
        8 => Just(Op::Step),
        1 => ((1u64..=5), any::<bool>()).prop_map(|(n, lose)| Op::Kill(n, lose)),
        1 => (1u64..=5).prop_map(Op::Join),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any schedule of broadcasts, deliveries, deaths (at least two members left) and joins:
    /// once the ring settles, no member delivered anything twice, each origin's messages
    /// arrived in order (G3) without gaps (G2), the first members that survive delivered
    /// the same per-origin sequences and a joiner a suffix of them, every survivor's
    /// messages reached every survivor, and nothing is left in flight.
    #[test]
    fn random_schedules_keep_the_guarantees(ops in prop::collection::vec(op(), 1..120)) {
        let mut r = Ring::new(5);
        let mut sent: BTreeMap<MemberId, u64> = BTreeMap::new();
        let mut next = 6;
        for op in ops {
            match op {
                Op::Join(n) if r.members.contains_key(&m(n)) && next < 9 => {
                    r.join(m(next), m(n));
                    next += 1;
                }
                Op::Broadcast(n) if r.members.contains_key(&m(n)) => {
                    let k = sent.entry(m(n)).or_default();
                    let this = *k;
                    *k += 1;
                    // Every third one is a confirmed broadcast (token = publish number).
                    if this.is_multiple_of(3) {
                        r.confirmed_broadcast(m(n), &format!("{n}-{this}"), this);
                    } else {
                        r.broadcast(m(n), &format!("{n}-{this}"));
                    }
                }
                Op::Flush(n) => {
                    if let Some(member) = r.members.get_mut(&m(n)) {
                        member.flush();
                    }
                    r.collect();
                }
                Op::Step => { r.step(); }
                Op::Kill(n, lose) if r.members.len() > 2 && r.members.contains_key(&m(n)) => {
                    r.kill(m(n), lose);
                }
                _ => {}
            }
        }
        r.pump();
        prop_assert!(r.violations.is_empty(), "G7: {:?}", r.violations);
        let survivors: Vec<MemberId> = r.members.keys().copied().collect();
        let founders: Vec<MemberId> = survivors.iter().copied().filter(|id| id.node <= 5).collect();
        for origin in (1..next).map(m) {
            let reference = founders.first().map(|f| r.from(*f, origin));
            for id in &survivors {
                let got = r.from(*id, origin);
                // In order, no gaps, no duplicates: a contiguous run of what origin sent,
                // from its first message for members there from the start.
                let first = got.first().map(|s| {
                    s.rsplit('-').next().and_then(|k| k.parse::<usize>().ok()).unwrap_or(0)
                });
                let start = if id.node <= 5 { 0 } else { first.unwrap_or(0) };
                let expect: Vec<String> =
                    (start..start + got.len()).map(|k| format!("{}-{}", origin.node, k)).collect();
                prop_assert_eq!(&got, &expect, "{:?} from {:?}", id, origin);
                if let Some(reference) = &reference {
                    if id.node <= 5 {
                        prop_assert_eq!(&got, reference, "{:?} and the first founder disagree on {:?}", id, origin);
                    } else {
                        prop_assert!(reference.ends_with(&got), "{:?} got no suffix of {:?}", id, origin);
                    }
                }
            }
            if survivors.contains(&origin) {
                let all = sent.get(&origin).copied().unwrap_or(0) as usize;
                for id in &survivors {
                    if id.node <= 5 || origin == *id {
                        prop_assert_eq!(r.from(*id, origin).len(), all, "{:?}'s messages reach {:?}", origin, id);
                    }
                }
            }
        }
        prop_assert!(r.all_quiet());
    }
}

#[test]
fn durable_acks_hold_each_hop_until_released_and_the_confirm_until_the_origin_released() {
    let mut r = Ring::build(3, true);
    r.confirmed_broadcast(m(1), "p", 0);
    // The publish travels its lap at once, so every member writes it in parallel.
    assert!(r.step(), "1 → 2");
    assert_eq!(r.from(m(2), m(1)), strings(&["p"]));
    assert!(r.step(), "2 → 3 before 2 released it");
    assert_eq!(r.from(m(3), m(1)), strings(&["p"]));
    assert!(r.step(), "3 → 1: the publish lap is done");
    assert!(r.step(), "1 → 2: its ack");
    assert!(!r.step(), "2 holds the ack until it released the publish");
    assert!(r.confirmed.is_empty());
    r.release(m(2));
    assert!(r.step(), "2 → 3 once released");
    assert!(!r.step(), "3 holds the ack until released");
    r.release(m(3));
    assert!(r.step(), "3 → 1: the ack lap is done");
    assert!(
        !r.confirmed.contains_key(&m(1)),
        "no confirm before the origin itself released"
    );
    r.release(m(1));
    assert_eq!(r.confirmed.get(&m(1)), Some(&vec![0]));
    r.pump();
    assert!(r.all_quiet());
    assert!(r.violations.is_empty(), "{:?}", r.violations);
}

#[test]
fn a_catchup_cannot_complete_a_lap_past_a_member_that_has_not_released() {
    let mut r = Ring::build(3, true);
    r.confirmed_broadcast(m(1), "p", 0);
    assert!(r.step(), "1 → 2");
    // 2 has "p" (not released) when 3 dies: its catch-up to 1 completes the publish lap,
    // but the ack must wait at 2, or 1 would confirm what 2 may not hold.
    r.kill(m(3), false);
    r.pump_without_release();
    assert!(!r.confirmed.contains_key(&m(1)), "{:?}", r.confirmed);
    r.release(m(1));
    r.pump_without_release();
    assert!(!r.confirmed.contains_key(&m(1)), "2 has not released it");
    r.release(m(2));
    r.pump_without_release();
    assert_eq!(r.confirmed.get(&m(1)), Some(&vec![0]));
    assert!(r.violations.is_empty(), "{:?}", r.violations);
}

/// One step of a random schedule with durable acks.
#[derive(Clone, Debug)]
enum DurableOp {
    Confirmed(u64),
    Release(u64),
    Step,
    Kill(u64, bool),
    Join(u64),
}

fn durable_op() -> impl Strategy<Value = DurableOp> {
    prop_oneof![
        4 => (1u64..=5).prop_map(DurableOp::Confirmed),
        3 => (1u64..=8).prop_map(DurableOp::Release),
        8 => Just(DurableOp::Step),
        1 => ((1u64..=5), any::<bool>()).prop_map(|(n, lose)| DurableOp::Kill(n, lose)),
        1 => (1u64..=5).prop_map(DurableOp::Join),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// With durable acks, under any schedule: no confirm reaches an origin while a live
    /// member born before the publish has not released it; once everyone releases, every
    /// surviving origin's confirms all come, in order, and nothing is left in flight; no
    /// member delivers anything twice.
    #[test]
    fn durable_acks_confirm_only_what_every_member_released(
        ops in prop::collection::vec(durable_op(), 1..120)
    ) {
        let mut r = Ring::build(5, true);
        let mut sent: BTreeMap<MemberId, u64> = BTreeMap::new();
        let mut next = 6;
        for op in ops {
            match op {
                DurableOp::Join(n) if r.members.contains_key(&m(n)) && next < 9 => {
                    r.join(m(next), m(n));
                    next += 1;
                }
                DurableOp::Confirmed(n) if r.members.contains_key(&m(n)) => {
                    let k = sent.entry(m(n)).or_default();
                    let token = *k;
                    *k += 1;
                    r.confirmed_broadcast(m(n), &format!("{n}-{token}"), token);
                }
                DurableOp::Release(n) => r.release(m(n)),
                DurableOp::Step => { r.step(); }
                DurableOp::Kill(n, lose) if r.members.len() > 2 && r.members.contains_key(&m(n)) => {
                    r.kill(m(n), lose);
                }
                _ => {}
            }
            prop_assert!(r.violations.is_empty(), "{:?}", r.violations);
        }
        r.pump();
        prop_assert!(r.violations.is_empty(), "{:?}", r.violations);
        prop_assert!(r.all_quiet());
        for (origin, k) in &sent {
            if r.members.contains_key(origin) {
                let expect: Vec<u64> = (0..*k).collect();
                prop_assert_eq!(r.confirmed.get(origin).cloned().unwrap_or_default(), expect);
            }
        }
        for (id, got) in &r.delivered {
            let mut seen = std::collections::BTreeSet::new();
            for d in got {
                prop_assert!(seen.insert(d.clone()), "{:?} delivered {:?} twice", id, d);
            }
        }
    }
}

#[test]
fn a_member_left_alone_and_joined_again_confirms_only_after_a_real_lap() {
    let mut r = Ring::new(2);
    r.kill(m(2), false);
    r.pump();
    r.join(m(3), m(1));
    r.pump();
    r.confirmed_broadcast(m(1), "a", 0);
    r.confirmed_broadcast(m(1), "b", 1);
    assert!(!r.confirmed.contains_key(&m(1)));
    // "a" comes back first: only "a" has made its lap then.
    while !r.confirmed.contains_key(&m(1)) {
        assert!(r.step(), "the lap completes");
    }
    assert_eq!(
        r.confirmed.get(&m(1)),
        Some(&vec![0]),
        "being alone once does not confirm later broadcasts early"
    );
    r.pump();
    assert_eq!(r.confirmed.get(&m(1)), Some(&vec![0, 1]));
    assert_eq!(r.from(m(3), m(1)), strings(&["a", "b"]));
}

/// The messages sent since `from` in the trace.
fn sent_since(r: &Ring, from: usize) -> Vec<(MemberId, MemberId, GmMsg<String>)> {
    r.trace[from..].to_vec()
}

fn pending(pubs: &[(u64, &str)], last_pub: Option<u64>, last_ack: Option<u64>) -> Pending<String> {
    Pending {
        pending_ack: pubs.iter().map(|(n, s)| (*n, s.to_string())).collect(),
        last_pub,
        last_ack,
    }
}

#[test]
fn a_joiner_gets_its_left_neighbours_state_and_passes_it_on_exactly() {
    let mut r = Ring::new(2);
    r.broadcast(m(1), "a");
    r.members.get_mut(&m(1)).expect("member").flush();
    r.collect();
    assert!(r.step(), "1 → 2: 'a' in flight at 2 when 3 joins");
    let mark = r.trace.len();
    r.join(m(3), m(2));
    let v = r.record.version;
    let state = BTreeMap::from([
        // 2 has forwarded 'a' (to 1, its right until now) and holds it until the ack.
        (m(1), pending(&[(0, "a")], Some(0), None)),
        (m(2), Pending::default()),
        (m(3), Pending::default()),
    ]);
    assert_eq!(
        sent_since(&r, mark),
        vec![
            // 2's right changed to the joiner: its whole state goes there...
            (
                m(2),
                m(3),
                GmMsg::Catchup {
                    version: v,
                    from: m(2),
                    state: state.clone()
                }
            ),
        ]
    );
    let catchup = r
        .links
        .get_mut(&(m(2), m(3)))
        .and_then(|q| q.pop_front())
        .expect("the catch-up");
    r.members
        .get_mut(&m(3))
        .expect("joiner")
        .handle_message(catchup);
    r.collect();
    // ...and the joiner adopts it and forwards the same state to its right.
    assert_eq!(
        sent_since(&r, mark + 1),
        vec![(
            m(3),
            m(1),
            GmMsg::Catchup {
                version: v,
                from: m(3),
                state
            }
        )]
    );
    r.pump();
    assert_eq!(
        r.from(m(3), m(1)),
        Vec::<String>::new(),
        "'a' was sent before 3 had its state"
    );
    assert!(r.all_quiet());
}

#[test]
fn the_death_of_the_right_makes_a_catchup_and_the_new_right_gets_exactly_what_it_missed() {
    let mut r = Ring::new(3);
    r.broadcast(m(1), "a");
    r.members.get_mut(&m(1)).expect("member").flush();
    r.collect();
    assert!(r.step(), "1 → 2");
    // 2 dies with 'a' forwarded but unread by 3.
    let mark = r.trace.len();
    let before = r.record.version;
    r.kill(m(2), true);
    // The death is version before + 1, at which 1 sends its catch-up.
    let v = before + 1;
    let item = |pubs: &[(u64, &str)], acks: &[u64]| Item {
        id: m(1),
        pubs: pubs.iter().map(|(n, s)| (*n, s.to_string())).collect(),
        acks: acks.to_vec(),
    };
    r.pump();
    // 3 inherits 2, which it never saw carry anything: its erasure bumps the version once
    // more (at once) before 3 reads the catch-up.
    let after = r.record.version;
    assert_eq!(after, v + 1);
    let sent = sent_since(&r, mark);
    assert_eq!(
        sent[..4],
        [
            (
                m(1),
                m(3),
                GmMsg::Catchup {
                    version: v,
                    from: m(1),
                    state: BTreeMap::from([
                        (m(1), pending(&[(0, "a")], Some(0), None)),
                        (m(2), Pending::default()),
                        (m(3), Pending::default()),
                    ]),
                }
            ),
            // 3 computes that it missed 'a', delivers it and sends it on its lap's end (its
            // number: 1 holds the body)...
            (
                m(3),
                m(1),
                GmMsg::Activity {
                    version: after,
                    from: m(3),
                    items: vec![item(&[(0, "")], &[])]
                }
            ),
            // ...which turns it into an ack that travels its own lap.
            (
                m(1),
                m(3),
                GmMsg::Activity {
                    version: after,
                    from: m(1),
                    items: vec![item(&[], &[0])]
                }
            ),
            (
                m(3),
                m(1),
                GmMsg::Activity {
                    version: after,
                    from: m(3),
                    items: vec![item(&[], &[0])]
                }
            ),
        ]
    );
    assert_eq!(r.from(m(3), m(1)), strings(&["a"]));
    assert!(r.all_quiet());
}

#[test]
fn a_leave_with_messages_pending_drains_first_then_the_rest_carry_on() {
    let mut r = Ring::new(3);
    r.confirmed_broadcast(m(2), "last", 0);
    // The owner asks to leave: it may only be recorded dead once quiet (G11).
    assert!(!r.members[&m(2)].is_quiet(), "its broadcast is on its lap");
    assert!(r.step(), "2 → 3");
    assert!(!r.members[&m(2)].is_quiet());
    r.pump();
    assert!(r.members[&m(2)].is_quiet(), "lap and ack lap done");
    assert_eq!(r.confirmed.get(&m(2)), Some(&vec![0]));
    // Recorded dead (GmHandle::leave's compare-and-set): it stops; nothing is in flight
    // of it, so its inheritor (3) has it erased at once; no catch-up carries anything of it.
    let mark = r.trace.len();
    for s in &mut r.record.members {
        if *s == Slot::Alive(m(2)) {
            *s = Slot::Dead(m(2));
        }
    }
    r.bump();
    assert_eq!(r.stopped, [m(2)]);
    r.members.remove(&m(2));
    assert!(
        r.record.members.iter().all(|s| s.id() != m(2)),
        "erased: {:?}",
        r.record
    );
    // 1's right is now 3: the catch-up holds no publish of anyone.
    let sent = sent_since(&r, mark);
    assert!(
        matches!(
            sent.first(),
            Some((from, to, GmMsg::Catchup { state, .. }))
                if *from == m(1) && *to == m(3)
                    && state.values().all(|p| p.pending_ack.is_empty())
        ),
        "{sent:?}"
    );
    r.broadcast(m(1), "after");
    r.pump();
    assert_eq!(r.from(m(3), m(1)), strings(&["after"]));
    for id in [1, 3] {
        assert_eq!(r.from(m(id), m(2)), strings(&["last"]), "{id}");
    }
    assert!(r.all_quiet());
}

/// After a whole-cluster restart two joiners came in while the record still listed a
/// restarted node's old member alive (`docs/reliability.md`, bug 5). When that member is
/// recorded dead, no one in the ring holds state: the first joiner, whose only possible
/// source of state is gone, stops (orphaned) rather than wait for ever; once it is recorded
/// dead the second is alone and starts afresh. A joiner whose source lives keeps waiting,
/// and a member with state never orphans.
#[test]
fn joiners_whose_every_source_of_state_died_stop_and_the_ring_starts_afresh() {
    let (ghost, j1, j2, old) = (m(3), m(1), m(2), m(4));
    let v1 = record(1, vec![Slot::Alive(ghost), Slot::Alive(j1)]);
    let mut a: Member<String> = Member::new(j1, &v1);
    assert!(!a.is_ready());
    let v2 = record(
        2,
        vec![Slot::Alive(ghost), Slot::Alive(j1), Slot::Alive(j2)],
    );
    a.handle_view(&v2);
    let mut b: Member<String> = Member::new(j2, &v2);
    // The ghost is recorded dead: a ring of two joiners, neither with state.
    let v3 = record(3, vec![Slot::Dead(ghost), Slot::Alive(j1), Slot::Alive(j2)]);
    a.handle_view(&v3);
    b.handle_view(&v3);
    assert!(a.is_stopped() && a.is_orphaned(), "j1's only source died");
    assert!(
        std::iter::from_fn(|| a.poll_event()).any(|e| e == Event::Stopped),
        "its owner hears it stopped"
    );
    assert!(!b.is_stopped(), "j2 may still get state from j1");
    // j1 recorded dead: j2 is alone, and has state.
    let v4 = record(4, vec![Slot::Dead(ghost), Slot::Dead(j1), Slot::Alive(j2)]);
    b.handle_view(&v4);
    assert!(!b.is_stopped() && b.is_ready());
    b.confirmed_broadcast("after".into(), 7);
    assert!(
        std::iter::from_fn(|| b.poll_event()).any(|e| e == Event::Confirmed(7)),
        "a lone member confirms"
    );
    // A member with state is never orphaned by its peers' deaths.
    let w1 = record(1, vec![Slot::Alive(old)]);
    let mut c: Member<String> = Member::new(old, &w1);
    let w2 = record(2, vec![Slot::Alive(old), Slot::Alive(j1), Slot::Alive(j2)]);
    c.handle_view(&w2);
    let w3 = record(3, vec![Slot::Alive(old), Slot::Dead(j1), Slot::Alive(j2)]);
    c.handle_view(&w3);
    assert!(!c.is_stopped() && !c.is_orphaned());
}

/// Bug 32 (mirror simulation seed 1838, `docs/reliability.md`): after a whole-cluster
/// crash, `j1` joined behind the old member `ghost` of a node not yet restarted, and `j2`
/// behind `j1`; `j1`'s member was made only once `j2`'s join was in the record too. Once
/// `ghost` is recorded dead, neither joiner has a state or a live member older than
/// itself to get one from, so `j1` must stop as orphaned (its owner records it dead and
/// joins again), and then `j2` too. `Member::new` counted every member of the record it
/// was made with as a source of state, `j2` included, and both waited on each other for
/// ever.
#[test]
fn a_joiner_made_after_a_later_join_does_not_wait_on_that_joiner_for_its_state() {
    let ghost = MemberId { node: 4, since: 4 };
    let j1 = MemberId { node: 1, since: 11 };
    let j2 = MemberId { node: 2, since: 12 };
    let v12 = record(
        12,
        vec![Slot::Alive(ghost), Slot::Alive(j1), Slot::Alive(j2)],
    );
    let mut a: Member<String> = Member::new(j1, &v12);
    let mut b: Member<String> = Member::new(j2, &v12);
    let v13 = record(
        13,
        vec![Slot::Dead(ghost), Slot::Alive(j1), Slot::Alive(j2)],
    );
    a.handle_view(&v13);
    b.handle_view(&v13);
    assert!(
        a.is_stopped() && a.is_orphaned(),
        "j1's only older source of state died"
    );
    assert!(
        !b.is_stopped(),
        "j2 may still get state from j1 until j1 is dead"
    );
    let v14 = record(14, vec![Slot::Dead(ghost), Slot::Dead(j1), Slot::Alive(j2)]);
    b.handle_view(&v14);
    assert!(
        !b.is_stopped() && b.is_ready(),
        "j2 is alone and starts afresh"
    );
}

/// What the GM host does (`GmHost::start_member`): a member is made from the record its
/// join committed and then handed the newer one applied by the time it starts. A founder
/// whose task starts after two later joins is recorded seeds the ring (made from the newer
/// record alone it waited for a state nobody would send); the ring confirms.
#[test]
fn a_founder_started_after_later_joins_seeds_the_ring_from_its_join_record() {
    let a = MemberId { node: 1, since: 1 };
    let b = MemberId { node: 2, since: 2 };
    let c = MemberId { node: 3, since: 3 };
    let v1 = record(1, vec![Slot::Alive(a)]);
    let v2 = record(2, vec![Slot::Alive(a), Slot::Alive(b)]);
    let v3 = record(3, vec![Slot::Alive(a), Slot::Alive(b), Slot::Alive(c)]);
    let late: Member<String> = Member::new(a, &v3);
    assert!(
        !late.is_ready(),
        "made from v3 alone, a founder cannot tell it founded"
    );
    let mut ma: Member<String> = Member::new(a, &v1);
    ma.handle_view(&v3);
    assert!(ma.is_ready() && !ma.is_stopped());
    let mut mb: Member<String> = Member::new(b, &v2);
    mb.handle_view(&v3);
    let mut mc: Member<String> = Member::new(c, &v3);
    assert!(!mb.is_ready() && !mc.is_ready());
    ma.confirmed_broadcast("first".into(), 1);
    let mut confirmed = false;
    for _ in 0..20 {
        let mut sent = Vec::new();
        for member in [&mut ma, &mut mb, &mut mc] {
            member.flush();
            while let Some(out) = member.poll_transmit() {
                sent.push(out);
            }
        }
        for (to, msg) in sent {
            let target = [&mut ma, &mut mb, &mut mc]
                .into_iter()
                .find(|x| x.id() == to)
                .expect("a member of the ring");
            target.handle_message(msg);
        }
        confirmed |= std::iter::from_fn(|| ma.poll_event()).any(|e| e == Event::Confirmed(1));
    }
    assert!(
        mb.is_ready() && mc.is_ready(),
        "the founder's catch-up seeded both"
    );
    assert!(confirmed, "a lap completes");
}

/// The rest of bug 32: a joiner whose every older peer died before its task started (the
/// host hands it the record of its join, then the newer one) stops as orphaned at once,
/// rather than wait for a record that may not come for long.
#[test]
fn a_joiner_whose_older_peers_died_before_it_started_is_orphaned_at_once() {
    let ghost = MemberId { node: 4, since: 4 };
    let j1 = MemberId { node: 1, since: 11 };
    let j2 = MemberId { node: 2, since: 12 };
    let v11 = record(11, vec![Slot::Alive(ghost), Slot::Alive(j1)]);
    let v13 = record(
        13,
        vec![Slot::Dead(ghost), Slot::Alive(j1), Slot::Alive(j2)],
    );
    let mut a: Member<String> = Member::new(j1, &v11);
    a.handle_view(&v13);
    assert!(a.is_stopped() && a.is_orphaned());
    assert!(std::iter::from_fn(|| a.poll_event()).any(|e| e == Event::Stopped));
}

/// The property test's find (bug 30): 7 joins behind 5 while 5's publish `5-0` is on its
/// way from 5 to 1, and 5 dies before its catch-up reaches 7. 7 inherits 5 knowing nothing
/// of `5-0`, and its catch-up to 1 held nothing of 5. 1 took that for the lap of `5-0`
/// being over and sent its ack, which retired it ahead of 6 and 4, which never delivered
/// it. Now a member retires only what its left saw (a publish or an ack that far).
#[test]
fn a_joiner_behind_a_dead_origin_does_not_end_the_lap_of_a_publish_it_never_saw() {
    let mut r = Ring::new(5);
    r.join(m(6), m(3));
    r.step();
    r.confirmed_broadcast(m(2), "2-0", 0);
    r.step();
    r.step();
    r.confirmed_broadcast(m(5), "5-0", 0);
    r.step();
    r.join(m(7), m(5));
    r.confirmed_broadcast(m(1), "1-0", 0);
    r.join(m(8), m(2));
    r.step();
    r.step();
    // 5 dies; its catch-up to 7 is lost with it.
    r.kill(m(5), true);
    for _ in 0..10 {
        r.step();
    }
    r.kill(m(3), false);
    r.pump();
    for id in [m(1), m(2), m(4), m(6)] {
        assert_eq!(r.from(id, m(5)), strings(&["5-0"]), "{id:?} from 5");
    }
    assert!(r.all_quiet());
}

//! One GM member as a sans-IO state machine (gm.erl §1.4–1.8 of the reference notes).
//!
//! In: [`Member::broadcast`], [`Member::confirmed_broadcast`], [`Member::flush`] (the owner
//! calls it when idle or on its timer), [`Member::handle_view`] (a newer group record from
//! the metadata), [`Member::handle_message`] (from the left neighbour). Out:
//! [`Member::poll_transmit`] (messages for the right neighbour) and [`Member::poll_event`]
//! (deliveries, confirmations, membership changes).
//!
//! A message stamped with a view newer than the member's is held until the metadata catches
//! up (a message sent at view N is only interpreted with a view ≥ N); an activity or catch-up
//! from anyone but the current left neighbour is ignored (the catch-up that follows every
//! change of neighbour repairs the gap). Deaths are not detected here: they arrive as newer
//! records, recorded through Raft by the node failure detector, so a member cut off from
//! the majority keeps its old view and its laps cannot complete.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::view::{GroupRecord, MemberId, View};

/// A member's publish sequence number.
pub type PubNum = u64;

/// What one member tracks about the messages of one origin (itself, another member, or a
/// dead member it inherited).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending<M> {
    /// Messages seen whose ack has not come by yet, oldest first.
    pub pending_ack: VecDeque<(PubNum, M)>,
    /// Highest publish number seen.
    pub last_pub: Option<PubNum>,
    /// Highest ack number seen.
    pub last_ack: Option<PubNum>,
}

impl<M> Default for Pending<M> {
    fn default() -> Self {
        Pending {
            pending_ack: VecDeque::new(),
            last_pub: None,
            last_ack: None,
        }
    }
}

/// One origin's part of an activity: new publishes, and acks of earlier ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item<M> {
    /// The origin.
    pub id: MemberId,
    /// Publishes travelling their first lap.
    pub pubs: Vec<(PubNum, M)>,
    /// Acks travelling their second lap.
    pub acks: Vec<PubNum>,
}

/// What travels from a member to its right neighbour.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GmMsg<M> {
    /// Batched publishes and acks.
    Activity {
        /// The sender's view version.
        version: u64,
        /// The sender (must be the receiver's left).
        from: MemberId,
        /// Per origin.
        items: Vec<Item<M>>,
    },
    /// The sender's whole bookkeeping, sent to a new right neighbour.
    Catchup {
        /// The sender's view version.
        version: u64,
        /// The sender (must be the receiver's left).
        from: MemberId,
        /// Per origin.
        state: BTreeMap<MemberId, Pending<M>>,
    },
}

impl<M> GmMsg<M> {
    /// The same message with each payload turned by `f` (a wire decode's payload type
    /// into the one the members hold).
    pub fn map<N>(self, mut f: impl FnMut(M) -> N) -> GmMsg<N> {
        match self {
            GmMsg::Activity {
                version,
                from,
                items,
            } => GmMsg::Activity {
                version,
                from,
                items: items
                    .into_iter()
                    .map(|i| Item {
                        id: i.id,
                        pubs: i.pubs.into_iter().map(|(n, m)| (n, f(m))).collect(),
                        acks: i.acks,
                    })
                    .collect(),
            },
            GmMsg::Catchup {
                version,
                from,
                state,
            } => GmMsg::Catchup {
                version,
                from,
                state: state
                    .into_iter()
                    .map(|(id, p)| {
                        let pending_ack = p.pending_ack.into_iter().map(|(n, m)| (n, f(m)));
                        let pending = Pending {
                            pending_ack: pending_ack.collect(),
                            last_pub: p.last_pub,
                            last_ack: p.last_ack,
                        };
                        (id, pending)
                    })
                    .collect(),
            },
        }
    }

    fn version(&self) -> u64 {
        match self {
            GmMsg::Activity { version, .. } | GmMsg::Catchup { version, .. } => *version,
        }
    }
}

/// What the member tells its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event<M> {
    /// The member is in the group with these members (the joiner's first event).
    Joined {
        /// Live members.
        members: Vec<MemberId>,
    },
    /// A message to hand to the application (its own ones at once, at broadcast). With
    /// durable acks the owner calls [`Member::release`] with `num` once it is durable.
    Deliver {
        /// The origin.
        from: MemberId,
        /// Its publish number (per origin, increasing).
        num: PubNum,
        /// The message.
        msg: M,
    },
    /// A `confirmed_broadcast` completed its lap (or the member became alone).
    Confirmed(u64),
    /// Members were born or died (G5: a birth before any of its messages; G6: no death of a
    /// member not seen born).
    MembersChanged {
        /// New members.
        births: Vec<MemberId>,
        /// Dead members.
        deaths: Vec<MemberId>,
    },
    /// These dead members this one inherited have nothing in flight: the owner should
    /// erase them from the group record (a compare-and-set through the metadata).
    EraseAliases(Vec<MemberId>),
    /// The record no longer lists this member alive: it has stopped.
    Stopped,
}

/// One GM member.
#[derive(Debug)]
pub struct Member<M> {
    me: MemberId,
    view: View,
    /// `None` until a joiner gets its first catch-up.
    state: Option<BTreeMap<MemberId, Pending<M>>>,
    next_pub: PubNum,
    buffer: Vec<(PubNum, M)>,
    confirms: VecDeque<(PubNum, u64)>,
    held: Vec<GmMsg<M>>,
    erasing: BTreeSet<MemberId>,
    /// Members seen alive while this one had its state. Only those may it have erased when
    /// it inherits them: a member whose state came after a death (a joiner whose left died
    /// before its catch-up) cannot know what of the dead member is still in flight.
    seen_alive: BTreeSet<MemberId>,
    out: VecDeque<(MemberId, GmMsg<M>)>,
    events: VecDeque<Event<M>>,
    stopped: bool,
    /// Durable acks: publishes travel at once, but an ack (the second lap) leaves a member
    /// only once the owner released what that member delivered of it; `held_out` keeps the
    /// acks that wait, in order, and whether forwarding them retires publishes here.
    durable_acks: bool,
    released: BTreeMap<MemberId, PubNum>,
    /// Per origin, the highest publish delivered here (what a release must cover).
    delivered: BTreeMap<MemberId, PubNum>,
    held_out: VecDeque<(Item<M>, bool)>,
    /// Highest own publish whose lap has completed (with durable acks, the ack lap; confirms
    /// also wait for own release).
    lap_done: Option<PubNum>,
    /// The members alive when it joined that joined before it (none when it joined
    /// alone): its state can only come from them, by a catch-up from its left neighbour,
    /// or through a chain starting there.
    join_peers: BTreeSet<MemberId>,
    /// Stopped because every member it could get its state from died before it got it.
    orphaned: bool,
}

impl<M: Clone + Default> Member<M> {
    /// The member `me` of the group `record` lists it in. The first member starts with an
    /// empty state; a joiner waits for the catch-up of its left neighbour (which sends it
    /// when it sees the record with the joiner on its right).
    pub fn new(me: MemberId, record: &GroupRecord) -> Member<M> {
        let view = View::of(record);
        let alone = view.ring == [me];
        let mut m = Member {
            me,
            view,
            state: None,
            next_pub: 0,
            buffer: Vec::new(),
            confirms: VecDeque::new(),
            held: Vec::new(),
            erasing: BTreeSet::new(),
            seen_alive: BTreeSet::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            stopped: false,
            durable_acks: false,
            released: BTreeMap::new(),
            delivered: BTreeMap::new(),
            held_out: VecDeque::new(),
            lap_done: None,
            join_peers: BTreeSet::new(),
            orphaned: false,
        };
        if !m.view.is_alive(me) {
            m.stopped = true;
            m.events.push_back(Event::Stopped);
            return m;
        }
        if alone {
            m.state = Some(BTreeMap::from([(me, Pending::default())]));
            m.seen_alive.insert(me);
        } else {
            // Only members that joined before it can hand it a state: a later joiner gets
            // its own through it. Counting one (a member made from a record that already
            // lists a later join) left two stateless joiners waiting on each other for
            // ever once the last older member died (bug 32). `since` is the group version
            // at the join, so it orders joins.
            m.join_peers = m
                .view
                .ring
                .iter()
                .copied()
                .filter(|id| *id != me && id.since <= me.since)
                .collect();
        }
        m.events.push_back(Event::Joined {
            members: m.view.ring.clone(),
        });
        m
    }

    /// Durable acks: no ack of a publish leaves this member, and no own publish is
    /// confirmed, before the owner [`Member::release`]s it (say, once it is on disk). A
    /// publish still travels its first lap at once, so every member writes it in parallel;
    /// the confirm waits for the second (ack) lap, which passes only members that hold it
    /// durably, so a `confirmed_broadcast` means every member holds it durably.
    pub fn with_durable_acks(mut self) -> Member<M> {
        self.durable_acks = true;
        self
    }

    /// Durable acks: the publishes of `origin` up to `upto` are durable here. Acks waiting
    /// on them move on; own confirms whose lap is done are answered.
    pub fn release(&mut self, origin: MemberId, upto: PubNum) {
        if self.stopped || !self.durable_acks {
            return;
        }
        let r = self.released.entry(origin).or_insert(upto);
        *r = (*r).max(upto);
        if origin == self.me {
            self.release_confirms(self.lap_done);
        }
        self.drain_held();
    }

    /// This member.
    pub fn id(&self) -> MemberId {
        self.me
    }

    /// The view it acts on.
    pub fn view(&self) -> &View {
        &self.view
    }

    /// Its right neighbour in the view it acts on (itself when alone).
    pub fn right(&self) -> Option<MemberId> {
        self.view.right(self.me)
    }

    /// The view version it acts on.
    pub fn version(&self) -> u64 {
        self.view.version
    }

    /// Whether it has stopped (lost membership).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Whether it stopped because everyone it could get its state from died first (see
    /// [`Member::handle_view`]); its owner must record it dead.
    pub fn is_orphaned(&self) -> bool {
        self.orphaned
    }

    /// Whether it has its state (a joiner gets it with its first catch-up).
    pub fn is_ready(&self) -> bool {
        self.state.is_some()
    }

    /// Whether nothing is buffered, nothing is held for anyone, and every publish of its
    /// own (and of the members it inherited) has had its ack back and been confirmed
    /// (drain before stop).
    pub fn is_quiet(&self) -> bool {
        let me = self.me;
        self.buffer.is_empty()
            && self.held_out.is_empty()
            && self.confirms.is_empty()
            && self.state.as_ref().is_none_or(|s| {
                s.iter().all(|(id, p)| {
                    p.pending_ack.is_empty()
                        && (self.view.owner(*id) != Some(me) || p.last_ack >= p.last_pub)
                })
            })
    }

    /// The bookkeeping of `id` (tests and diagnostics).
    pub fn pending(&self, id: MemberId) -> Option<&Pending<M>> {
        self.state.as_ref()?.get(&id)
    }

    /// Broadcasts `msg`: delivered here at once (G4), buffered until [`Member::flush`].
    pub fn broadcast(&mut self, msg: M) {
        if self.stopped {
            return;
        }
        let n = self.next_pub;
        self.next_pub += 1;
        self.events.push_back(Event::Deliver {
            from: self.me,
            num: n,
            msg: msg.clone(),
        });
        self.buffer.push((n, msg));
    }

    /// Broadcasts `msg` and flushes; [`Event::Confirmed`] with `token` follows once it has
    /// completed a lap (G7).
    pub fn confirmed_broadcast(&mut self, msg: M, token: u64) {
        self.confirmed_broadcast_buffered(msg, token);
        self.flush();
    }

    /// As [`Member::confirmed_broadcast`], but buffered like [`Member::broadcast`]: it
    /// leaves with the next [`Member::flush`], so an owner that flushes once per batch of
    /// commands sends many confirmed broadcasts in one activity.
    pub fn confirmed_broadcast_buffered(&mut self, msg: M, token: u64) {
        if self.stopped {
            return;
        }
        let n = self.next_pub;
        self.broadcast(msg);
        self.confirms.push_back((n, token));
    }

    /// Sends what was broadcast since the last flush to the right neighbour, as one
    /// activity.
    pub fn flush(&mut self) {
        if self.stopped || self.buffer.is_empty() || self.state.is_none() {
            return;
        }
        let pubs = std::mem::take(&mut self.buffer);
        let me = self.me;
        if self.view.ring == [me] {
            // Alone: the lap is complete at once.
            self.lap_completed(pubs.last().map(|p| p.0));
            return;
        }
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let own = state.entry(me).or_default();
        own.last_pub = pubs.last().map(|p| p.0).or(own.last_pub);
        own.pending_ack.extend(pubs.iter().cloned());
        self.send_right(vec![Item {
            id: me,
            pubs,
            acks: Vec::new(),
        }]);
    }

    /// The next message for a neighbour.
    pub fn poll_transmit(&mut self) -> Option<(MemberId, GmMsg<M>)> {
        self.out.pop_front()
    }

    /// The next event for the owner.
    pub fn poll_event(&mut self) -> Option<Event<M>> {
        self.events.pop_front()
    }

    /// A newer group record: neighbours, births and deaths, inheritance; a catch-up to a new
    /// right neighbour; held messages that the new view makes interpretable.
    pub fn handle_view(&mut self, record: &GroupRecord) {
        if self.stopped || record.version <= self.view.version {
            return;
        }
        let new = View::of(record);
        let old = std::mem::replace(&mut self.view, new);
        if !self.view.is_alive(self.me) {
            self.stopped = true;
            self.events.push_back(Event::Stopped);
            return;
        }
        if self.state.is_none()
            && self.view.ring != [self.me]
            && self.join_peers.iter().all(|p| !self.view.is_alive(*p))
        {
            // Every member that could catch it up died before doing so, and the others in
            // the ring are joiners too: none of them may ever hold state (after a
            // whole-cluster restart, all of them joined while a restarted node's old member
            // still counted as alive), and a ring without state completes no lap. It has
            // delivered nothing, so it stops; its owner marks it dead and joins again, and
            // a ring emptied this way starts afresh with whoever joins first, alone.
            self.stopped = true;
            self.orphaned = true;
            self.events.push_back(Event::Stopped);
            return;
        }
        let known = old.known();
        let births: Vec<MemberId> = self
            .view
            .ring
            .iter()
            .copied()
            .filter(|id| !known.contains(id))
            .collect();
        let deaths: Vec<MemberId> = old
            .ring
            .iter()
            .copied()
            .filter(|id| !self.view.is_alive(*id))
            .collect();
        if !births.is_empty() || !deaths.is_empty() {
            self.events
                .push_back(Event::MembersChanged { births, deaths });
        }
        let me = self.me;
        if self.view.ring == [me] {
            // Alone: nothing can be in flight any more.
            self.state = Some(BTreeMap::from([(me, Pending::default())]));
            self.held_out.clear();
            // Everything broadcast so far has completed its lap (not more: a later
            // broadcast, once others join, must make its own).
            self.lap_completed(self.next_pub.checked_sub(1));
            let buffered = std::mem::take(&mut self.buffer);
            drop(buffered);
        } else if let Some(state) = self.state.as_mut() {
            let known = self.view.known();
            // Members erased from the record had nothing in flight.
            state.retain(|id, _| known.contains(id));
            self.delivered.retain(|id, _| known.contains(id));
            self.released.retain(|id, _| known.contains(id));
            for id in known {
                state.entry(id).or_default();
            }
        }
        self.erasing
            .retain(|id| self.view.inheritor.contains_key(id));
        if self.state.is_some() {
            self.seen_alive.extend(self.view.ring.iter().copied());
        }
        // A catch-up to a new right; and to the same right after skipped versions (a member
        // applies the newest record, not each one): at a version this member skipped, the
        // right may have had another left and dropped what came from us meanwhile, and it
        // only learns what it missed from a catch-up. An extra catch-up adds nothing at a
        // right that missed nothing.
        let skipped = record.version > old.version + 1;
        if (old.right(me) != self.view.right(me) || skipped) && self.view.ring != [me] {
            if let (Some(state), Some(right)) = (self.state.as_ref(), self.view.right(me)) {
                self.out.push_back((
                    right,
                    GmMsg::Catchup {
                        version: self.view.version,
                        from: me,
                        state: state.clone(),
                    },
                ));
            }
        }
        self.maybe_erase_aliases();
        let held = std::mem::take(&mut self.held);
        for msg in held {
            self.handle_message(msg);
        }
    }

    /// A message from a neighbour.
    pub fn handle_message(&mut self, msg: GmMsg<M>) {
        if self.stopped {
            return;
        }
        if msg.version() > self.view.version {
            // Lemma 3: interpret it only with a view at least as new as the sender's.
            self.held.push(msg);
            return;
        }
        let left = self.view.left(self.me);
        match msg {
            GmMsg::Activity { from, items, .. } => {
                if Some(from) != left || self.state.is_none() {
                    return;
                }
                self.process(items);
            }
            GmMsg::Catchup { from, state, .. } => {
                if Some(from) != left {
                    return;
                }
                self.catchup(state);
            }
        }
    }

    /// Queues items for the right neighbour. With durable acks, publishes go at once and
    /// acks wait, in order, until what they ack is released here; `retire` says whether
    /// forwarding them retires publishes here (an ack passing through; an owner's own acks
    /// retired their publishes already). Until then this member's state still lists those
    /// publishes pending, so a catch-up it sends cannot let a lap complete past it.
    fn emit(&mut self, items: Vec<Item<M>>, retire: &[bool]) {
        if !self.durable_acks {
            self.send_right(items);
            return;
        }
        let mut now = Vec::new();
        for (item, retire) in items.into_iter().zip(retire.iter().copied()) {
            let Item { id, pubs, acks } = item;
            if !pubs.is_empty() {
                now.push(Item {
                    id,
                    pubs,
                    acks: Vec::new(),
                });
            }
            if !acks.is_empty() {
                self.held_out.push_back((
                    Item {
                        id,
                        pubs: Vec::new(),
                        acks,
                    },
                    retire,
                ));
            }
        }
        self.send_right(now);
        self.drain_held();
    }

    /// Forwards the held acks whose publishes are released here, in order.
    fn drain_held(&mut self) {
        let mut ready = Vec::new();
        while let Some((item, _)) = self.held_out.front() {
            // Only what this member delivered needs its release: a joiner adopted older
            // publishes without delivering them, and holds none of them.
            let need = match (item.acks.iter().max(), self.delivered.get(&item.id)) {
                (Some(a), Some(d)) => Some((*a).min(*d)),
                _ => None,
            };
            let ok = item.id == self.me
                || need.is_none_or(|n| self.released.get(&item.id).is_some_and(|r| *r >= n));
            if !ok {
                break;
            }
            let Some((item, retire)) = self.held_out.pop_front() else {
                break;
            };
            if retire {
                if let Some(entry) = self.state.as_mut().and_then(|s| s.get_mut(&item.id)) {
                    retire_acked(entry, &item.acks);
                }
            }
            ready.push(item);
        }
        if !ready.is_empty() {
            self.send_right(ready);
            self.maybe_erase_aliases();
        }
    }

    fn send_right(&mut self, items: Vec<Item<M>>) {
        let me = self.me;
        match self.view.right(me) {
            Some(right) if right != me && !items.is_empty() => {
                let items = items
                    .into_iter()
                    .map(|mut item| {
                        // A live member's own publishes back from their lap: it keeps
                        // them itself and takes only their numbers (the owner's branch of
                        // `process`), so their bodies stay here. gm.erl sends them whole;
                        // with large messages that return was a third of a 3-node ring's
                        // traffic. Not for an inherited member's: those the receiver may
                        // not hold.
                        if item.id == right {
                            for (_, msg) in &mut item.pubs {
                                *msg = M::default();
                            }
                        }
                        item
                    })
                    .collect();
                self.out.push_back((
                    right,
                    GmMsg::Activity {
                        version: self.view.version,
                        from: me,
                        items,
                    },
                ))
            }
            _ => {}
        }
    }

    /// Own publishes up to `upto` completed their lap.
    fn lap_completed(&mut self, upto: Option<PubNum>) {
        self.lap_done = self.lap_done.max(upto);
        self.release_confirms(self.lap_done);
    }

    /// Answers `confirmed_broadcast`s up to publish `upto` (with durable acks, no further
    /// than what the owner released of its own).
    fn release_confirms(&mut self, upto: Option<PubNum>) {
        let Some(mut upto) = upto else { return };
        if self.durable_acks {
            match self.released.get(&self.me) {
                Some(r) => upto = upto.min(*r),
                None => return,
            }
        }
        while self.confirms.front().is_some_and(|(n, _)| *n <= upto) {
            if let Some((_, token)) = self.confirms.pop_front() {
                self.events.push_back(Event::Confirmed(token));
            }
        }
    }

    /// Applies an activity from the left (or one a catch-up made), forwards what it changed,
    /// then delivers the new publishes (forwarding first pipelines the ring).
    fn process(&mut self, items: Vec<Item<M>>) {
        let me = self.me;
        let durable = self.durable_acks;
        let mut emitted = Vec::new();
        let mut retire = Vec::new();
        let mut deliveries = Vec::new();
        let mut confirmed = None;
        let Some(state) = self.state.as_mut() else {
            return;
        };
        for item in items {
            let Some(owner) = self.view.owner(item.id) else {
                // Neither alive nor inherited: erased, which happens only once nothing of
                // it was in flight at its inheritor, so this is a leftover of a completed
                // lap (births are in the view before any message of theirs, Lemma 3).
                state.remove(&item.id);
                continue;
            };
            let entry = state.entry(item.id).or_default();
            if owner == me {
                // Our own (or an inherited) publishes back from their lap: they become acks.
                let mut acks = Vec::new();
                for (n, _) in &item.pubs {
                    if entry.pending_ack.front().is_some_and(|(p, _)| p == n) {
                        entry.pending_ack.pop_front();
                        acks.push(*n);
                    } else if item.id != me && entry.last_pub.is_none_or(|l| *n > l) {
                        // A publish of a member we inherited that went round without passing
                        // us (we joined behind it after it passed): its lap is complete all
                        // the same, and only its ack will free the others' copies.
                        entry.last_pub = Some(*n);
                        acks.push(*n);
                    }
                }
                // Acks back from their lap are absorbed.
                if let Some(last) = item.acks.last() {
                    entry.last_ack = entry.last_ack.max(Some(*last));
                }
                if item.id == me {
                    // With durable acks the lap that counts is the acks' one: each member
                    // let them pass only once it held the publishes durably.
                    confirmed = confirmed.max(if durable {
                        item.acks.last().copied()
                    } else {
                        acks.last().copied()
                    });
                }
                if !acks.is_empty() {
                    emitted.push(Item {
                        id: item.id,
                        pubs: Vec::new(),
                        acks,
                    });
                    retire.push(false);
                }
            } else {
                let mut item = item;
                // A publish seen before (a catch-up and a held activity can both carry it)
                // is neither delivered nor forwarded twice.
                item.pubs
                    .retain(|(n, _)| entry.last_pub.is_none_or(|l| *n > l));
                // Nor one past a gap: an origin's publishes come numbered one by one, so a
                // gap means an earlier activity from this sender was dropped while it was
                // not our left (it left the ring position and came back). Taking these would
                // lose the missing ones for good (a catch-up only adds what is past our
                // last publish); the sender's catch-up brings them all, in order.
                if let (Some(l), Some((n, _))) = (entry.last_pub, item.pubs.first()) {
                    if *n != l + 1 {
                        tracing::debug!(origin = ?item.id, expected = l + 1, got = n, "gm: publishes past a gap wait for a catch-up");
                        item.pubs.clear();
                    }
                }
                for (n, msg) in &item.pubs {
                    entry.pending_ack.push_back((*n, msg.clone()));
                    entry.last_pub = entry.last_pub.max(Some(*n));
                    deliveries.push((item.id, *n, msg.clone()));
                }
                // Acks retire publishes in order, up to the highest acked (with durable
                // acks, when they leave: `drain_held`).
                if !durable {
                    retire_acked(entry, &item.acks);
                }
                if !item.pubs.is_empty() || !item.acks.is_empty() {
                    emitted.push(item);
                    retire.push(true);
                }
            }
        }
        self.lap_completed(confirmed);
        for (from, num, _) in &deliveries {
            let d = self.delivered.entry(*from).or_insert(*num);
            *d = (*d).max(*num);
        }
        self.emit(emitted, &retire);
        for (from, num, msg) in deliveries {
            self.events.push_back(Event::Deliver { from, num, msg });
        }
        self.maybe_erase_aliases();
    }

    /// The left neighbour's state: a joiner adopts it; an initialised member computes what
    /// it missed (publishes to deliver, publishes the left already retired, own publishes
    /// that completed their lap) and processes that as an activity.
    fn catchup(&mut self, left_state: BTreeMap<MemberId, Pending<M>>) {
        let me = self.me;
        let Some(state) = self.state.as_mut() else {
            let mut adopted = left_state;
            for id in self.view.known() {
                adopted.entry(id).or_default();
            }
            // Acks of what the left no longer holds may have left it before we existed: we
            // will never see them pass, and hold nothing they would retire.
            for p in adopted.values_mut() {
                let settled = match p.pending_ack.front() {
                    None => p.last_pub,
                    Some((first, _)) => first.checked_sub(1),
                };
                p.last_ack = p.last_ack.max(settled);
            }
            adopted.retain(|id, _| self.view.known().contains(id) || *id == me);
            // Members we inherit already (our left died before its catch-up reached us): what
            // our new left holds of theirs has completed its lap up to us.
            let inherited: Vec<Item<M>> = adopted
                .iter()
                .filter(|(id, p)| {
                    **id != me && self.view.owner(**id) == Some(me) && !p.pending_ack.is_empty()
                })
                .map(|(id, p)| Item {
                    id: *id,
                    pubs: p.pending_ack.iter().cloned().collect(),
                    acks: Vec::new(),
                })
                .collect();
            self.state = Some(adopted.clone());
            self.seen_alive.extend(self.view.ring.iter().copied());
            // The right neighbour gets the same state (gm.erl forwards it).
            if let Some(right) = self.view.right(me).filter(|r| *r != me) {
                self.out.push_back((
                    right,
                    GmMsg::Catchup {
                        version: self.view.version,
                        from: me,
                        state: adopted,
                    },
                ));
            }
            self.process(inherited);
            self.flush();
            return;
        };
        let known = self.view.known();
        let ids: BTreeSet<MemberId> = state
            .keys()
            .chain(left_state.keys())
            .copied()
            .filter(|id| known.contains(id))
            .collect();
        let mut items = Vec::new();
        let mut own_acked = None;
        for id in ids {
            let theirs = left_state.get(&id).cloned().unwrap_or_default();
            let ours = state.entry(id).or_default();
            if self.view.owner(id) == Some(me) {
                // What the new left still holds of ours has passed everyone between us; the
                // acks it passed on went through everyone between us (with durable acks, each
                // holding the publishes durably: their lap is done).
                ours.last_ack = ours.last_ack.max(theirs.last_ack);
                if id == me {
                    own_acked = ours.last_ack;
                }
                // An ack that went round means its publish did (with durable acks the
                // publish may have passed us before we had our state).
                ours.last_pub = ours.last_pub.max(ours.last_ack);
                let pubs: Vec<(PubNum, M)> = theirs.pending_ack.into_iter().collect();
                if !pubs.is_empty() {
                    items.push(Item {
                        id,
                        pubs,
                        acks: Vec::new(),
                    });
                }
            } else {
                let (retired, missed) = prefix_and_suffix(
                    &ours.pending_ack,
                    ours.last_pub,
                    &theirs.pending_ack,
                    theirs.last_pub.max(theirs.last_ack),
                );
                if !retired.is_empty() || !missed.is_empty() {
                    items.push(Item {
                        id,
                        pubs: missed,
                        acks: retired,
                    });
                }
            }
        }
        if self.durable_acks {
            self.lap_completed(own_acked);
        }
        self.process(items);
    }

    /// Asks for the erasure of inherited members with nothing in flight (once each).
    fn maybe_erase_aliases(&mut self) {
        let Some(state) = self.state.as_ref() else {
            return;
        };
        let done: Vec<MemberId> = self
            .view
            .aliases_of(self.me)
            .into_iter()
            .filter(|id| !self.erasing.contains(id) && self.seen_alive.contains(id))
            .filter(|id| {
                state
                    .get(id)
                    .is_none_or(|p| p.pending_ack.is_empty() && p.last_ack >= p.last_pub)
            })
            .collect();
        if !done.is_empty() {
            self.erasing.extend(done.iter().copied());
            self.events.push_back(Event::EraseAliases(done));
        }
    }
}

/// Retires the publishes `acks` acknowledges (in order, up to the highest).
fn retire_acked<M>(entry: &mut Pending<M>, acks: &[PubNum]) {
    if let Some(last) = acks.iter().max() {
        while entry.pending_ack.front().is_some_and(|(n, _)| n <= last) {
            entry.pending_ack.pop_front();
        }
    }
    if let Some(last) = acks.last() {
        entry.last_ack = entry.last_ack.max(Some(*last));
    }
}

/// `ours = P ++ C` and `theirs = C ++ S` (pending lists of one origin, oldest first, numbers
/// increasing): the numbers of `P` (publishes the left has retired: to ack) and the entries
/// of `S` (publishes the left saw that we did not: to deliver). What we saw before (up to
/// `our_last_pub`, retired or not) is never in `S`: it was delivered here already. `P`
/// holds only what the left saw, a publish or an ack (up to `their_seen`): a joiner behind
/// a dead origin may never have seen publishes that passed us, and their lap goes on.
fn prefix_and_suffix<M: Clone>(
    ours: &VecDeque<(PubNum, M)>,
    our_last_pub: Option<PubNum>,
    theirs: &VecDeque<(PubNum, M)>,
    their_seen: Option<PubNum>,
) -> (Vec<PubNum>, Vec<(PubNum, M)>) {
    // Retired upstream: what the left saw (it saw that far a publish or an ack) and no
    // longer holds. What it never saw is still on its lap: it reached us by a way that
    // did not pass the left (its origin died between us, and the left joined behind it).
    let retired: Vec<PubNum> = ours
        .iter()
        .map(|(n, _)| *n)
        .take_while(|n| {
            theirs.front().is_none_or(|(first, _)| n < first)
                && their_seen.is_some_and(|last| *n <= last)
        })
        .collect();
    let missed: Vec<(PubNum, M)> = theirs
        .iter()
        .filter(|(n, _)| our_last_pub.is_none_or(|last| *n > last))
        .cloned()
        .collect();
    (retired, missed)
}

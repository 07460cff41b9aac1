//! The mirror role: join the queue's group, write each delivered round into this node's
//! copy (`Storage::apply_mirrored`) and fsync it before releasing it, hold rounds back
//! while a sync fills the copy (its backlog batches released at once and written beside
//! the loop by `batch_writer`), and acknowledge a completed sync to the master.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;

use super::batch_writer::{write_copy, BatchWriter};
use super::held::Held;
use super::{
    incarnation_of, is_synchronised, role_of, Followed, Inner, Key, Membership, Role, StorageDisk,
};
use crate::gm::Event;
use crate::gm::MemberId;
use crate::mirror::digest::RangeSummary;
use crate::mirror::message::group_name;
use crate::mirror::message::MirrorMsg;
use crate::mirror::role::{Action, MirrorRole, Mode, Why};
use crate::runtime::gm_host::GmNet;
use crate::runtime::storage::{Storage, StorageError, SYNC_BATCH_BYTES};

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    pub(super) async fn apply(&self, key: &Key, incarnation: u64, batch: &Bytes) -> bool {
        self.apply_all(key, incarnation, std::slice::from_ref(batch))
            .await
    }

    /// Writes several rounds (in order) with one fsync.
    pub(super) async fn apply_all(&self, key: &Key, incarnation: u64, batches: &[Bytes]) -> bool {
        write_copy(
            self.storage.clone(),
            self.inline,
            key,
            incarnation,
            batches.to_vec(),
        )
        .await
    }

    /// Drops this node's copy of incarnation `incarnation` (nothing else of the name).
    pub(super) async fn drop_copy(&self, key: &Key, incarnation: u64) {
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        if let Some(Err(e)) = self
            .offload(move || storage.drop_copy(&vhost, &name, incarnation))
            .await
        {
            tracing::error!(queue = %key.1, error = %e, "cannot drop a mirror copy");
        }
    }

    /// Runs `f` on this node's storage for `key` (off the runtime), logging a failure as
    /// "cannot {what}"; `None` when it failed.
    async fn on_copy<T: Send + 'static>(
        &self,
        key: &Key,
        what: &'static str,
        f: impl FnOnce(&Storage<D>, &str, &str) -> Result<T, StorageError> + Send + 'static,
    ) -> Option<T> {
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        match self.offload(move || f(&storage, &vhost, &name)).await? {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(queue = %key.1, error = %e, "cannot {what}");
                None
            }
        }
    }

    /// Starts an empty copy of incarnation `incarnation`; `false` if it cannot.
    pub(super) async fn start_copy(&self, key: &Key, incarnation: u64, since: u64) -> bool {
        self.on_copy(key, "start a mirror copy", move |s, v, n| {
            s.start_copy(v, n, incarnation, since)
        })
        .await
        .is_some()
    }

    /// The copy before joining: the one kept from the last run stays (for the first active
    /// sync to compare), anything else starts empty; `false` if it cannot.
    pub(super) async fn begin_copy(&self, key: &Key, incarnation: u64, since: u64) -> bool {
        self.on_copy(key, "start a mirror copy", move |s, v, n| {
            s.begin_copy(v, n, incarnation, since)
        })
        .await
        .is_some()
    }

    /// The copy at an active sync's start: `Some(Some(next))` when the kept copy stays
    /// (it holds seqs below `next` only), `Some(None)` when it starts empty, `None` when
    /// neither could be done.
    async fn resume_copy(
        &self,
        key: &Key,
        incarnation: u64,
        from_seq: u64,
        since: u64,
    ) -> Option<Option<u64>> {
        self.on_copy(key, "start a mirror copy", move |s, v, n| {
            s.resume_copy(v, n, incarnation, from_seq, since)
        })
        .await
    }

    /// Compares the kept copy with the master's summary of a range (see
    /// `Storage::reconcile_summary`): `Some(true)` matched (and made to match),
    /// `Some(false)` the copy cannot hold it, `None` the copy could not be read or written.
    async fn reconcile(&self, key: &Key, incarnation: u64, summary: RangeSummary) -> Option<bool> {
        self.on_copy(key, "compare a kept mirror copy", move |s, v, n| {
            s.reconcile_summary(v, n, incarnation, &summary)
        })
        .await
    }

    /// A mirror's handling of one delivered message: its role decides
    /// ([`MirrorRole`]), this carries that out; `false`: its copy cannot be trusted any
    /// more (it must leave and start again).
    pub(super) async fn on_message(&self, key: &Key, m: &mut Membership, msg: &Bytes) -> bool {
        let Some(msg) = MirrorMsg::decode(msg) else {
            tracing::warn!(queue = %key.1, "not a mirror message; ignored");
            return true;
        };
        if let MirrorMsg::SyncStart {
            target,
            from_seq,
            active,
            ..
        } = &msg
        {
            if *target == m.handle.id() {
                if !active {
                    tracing::info!(queue = %key.1, from_seq, active, "mirror sync starts");
                }
                m.compare_time = Duration::ZERO;
            }
        }
        m.role.handle_message(msg);
        while let Some(action) = m.role.poll_action() {
            // The backlog batches being written go first for whatever reads or writes the
            // copy (`Action::Write`'s rule).
            let beside = matches!(
                action,
                Action::WriteBatch { .. }
                    | Action::Hold(_)
                    | Action::BeginHold
                    | Action::DiscardHeld
                    | Action::Broadcast(_)
            );
            if !beside && !finish_batches(m).await {
                return false;
            }
            let done = match action {
                Action::Write(ops) => self.apply(key, m.incarnation, &ops).await,
                Action::WriteBatch { ops, then } => {
                    let writer = m.writer.get_or_insert_with(|| {
                        BatchWriter::start(
                            self.storage.clone(),
                            self.inline,
                            key.clone(),
                            m.incarnation,
                            m.handle.sender(),
                        )
                    });
                    writer.write(ops, then)
                }
                Action::Hold(ops) => match m.held.as_mut().map(|h| h.push(ops)) {
                    Some(Ok(())) => true,
                    Some(Err(e)) => {
                        tracing::error!(queue = %key.1, error = %e, "cannot hold a round during sync");
                        false
                    }
                    None => false,
                },
                Action::BeginHold => {
                    m.held = Some(Held::new(self.hold_path(key)));
                    true
                }
                Action::DiscardHeld => {
                    m.held = None;
                    true
                }
                Action::ApplyHeld => self.apply_held(key, m).await,
                Action::ResumeCopy { from_seq } => {
                    let resumed = self
                        .resume_copy(key, m.incarnation, from_seq, m.since)
                        .await;
                    match resumed {
                        Some(Some(copy_next)) if copy_next > 0 => {
                            tracing::info!(queue = %key.1, from_seq, copy_next, "mirror sync starts with the copy kept from the last run");
                        }
                        Some(_) => {
                            tracing::info!(queue = %key.1, from_seq, active = true, "mirror sync starts");
                        }
                        None => {}
                    }
                    m.role.handle_resumed(resumed);
                    true
                }
                Action::StartCopy { kept_copy_differs } => {
                    if kept_copy_differs {
                        tracing::info!(queue = %key.1, "the kept mirror copy differs from the master's queue: copying the whole backlog");
                    }
                    let started = self.start_copy(key, m.incarnation, m.since).await;
                    m.role.handle_copy_started(started);
                    true
                }
                Action::Reconcile(summary) => {
                    let started = std::time::Instant::now();
                    let matched = self.reconcile(key, m.incarnation, summary).await;
                    m.compare_time += started.elapsed();
                    m.role.handle_reconciled(matched);
                    true
                }
                Action::Broadcast(msg) => {
                    if let MirrorMsg::SyncWant { from, .. } = &msg {
                        if *from > 0 {
                            let compare_ms = m.compare_time.as_millis() as u64;
                            tracing::info!(queue = %key.1, from, compare_ms, "the kept mirror copy matches the master's queue below its end");
                        }
                    }
                    // Not confirmed: a lost one makes the master fall back to waiting for
                    // the old messages to go, or start the sync again.
                    if let Err(e) = m.handle.sender().broadcast(Bytes::from(msg.encode())) {
                        tracing::debug!(error = %e, "cannot send a sync message");
                    }
                    true
                }
                Action::Leave(Why::MissedSyncStart) => {
                    tracing::warn!(queue = %key.1, "a sync for this mirror whose start it missed: starting over");
                    false
                }
                Action::Leave(Why::Storage) => false,
            };
            if !done {
                return false;
            }
        }
        true
    }

    /// Writes the rounds an active sync held back, after its backlog.
    async fn apply_held(&self, key: &Key, m: &mut Membership) -> bool {
        let Some(held) = m.held.take() else {
            return true;
        };
        let held = match held.drain() {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(queue = %key.1, error = %e, "cannot read the held rounds back");
                return false;
            }
        };
        // Written in runs of up to a sync batch's bytes, one fsync each, not one per
        // round: a sync that held thousands of rounds would otherwise stall the queue
        // for as many fsyncs at its end.
        let rounds = held.len();
        let mut run: Vec<Bytes> = Vec::new();
        let mut bytes = 0usize;
        for batch in held {
            if !run.is_empty() && bytes + batch.len() > SYNC_BATCH_BYTES {
                if !self.apply_all(key, m.incarnation, &run).await {
                    return false;
                }
                run.clear();
                bytes = 0;
            }
            bytes += batch.len();
            run.push(batch);
        }
        if !run.is_empty() && !self.apply_all(key, m.incarnation, &run).await {
            return false;
        }
        tracing::info!(queue = %key.1, rounds, "mirror holds the backlog");
        true
    }

    /// A mirror's handling of one event: a delivered message is written, then released
    /// (never released when it could not be written).
    pub(super) async fn follow_event(
        &self,
        key: &Key,
        m: &mut Membership,
        event: Option<Event<Bytes>>,
    ) -> Followed {
        match event {
            None | Some(Event::Stopped) => Followed::Stopped,
            Some(Event::Deliver { from, num, msg }) => {
                if from.node == m.master {
                    m.master_member = Some(from);
                }
                if !self.on_message(key, m, &msg).await {
                    return Followed::WriteFailed;
                }
                m.handle.release(from, num);
                Followed::Going
            }
            Some(ev) => {
                Self::track(m, &ev);
                Followed::Going
            }
        }
    }

    /// [`Self::follow_event`] for `first` and the events already waiting behind it: a run
    /// of rounds a live mirror writes is written with one fsync, then released (a mirror
    /// that falls behind catches up in fewer, larger writes instead of one fsync a round).
    pub(super) async fn follow_events(
        &self,
        key: &Key,
        m: &mut Membership,
        first: Option<Event<Bytes>>,
    ) -> Followed {
        if first.is_none() {
            return Followed::Stopped;
        }
        let mut next = first;
        loop {
            // (origin, publish number, the round's operations)
            let mut run: Vec<(MemberId, crate::gm::PubNum, Bytes)> = Vec::new();
            while m.role.mode() == Mode::Live {
                let (from, num, msg) = match next.take() {
                    Some(Event::Deliver { from, num, msg }) => (from, num, msg),
                    other => {
                        // Not a round (or nothing): handled below, in order.
                        next = other;
                        break;
                    }
                };
                match MirrorMsg::decode(&msg) {
                    Some(MirrorMsg::Ops { ops, .. }) => run.push((from, num, ops)),
                    _ => {
                        next = Some(Event::Deliver { from, num, msg });
                        break;
                    }
                }
                if run.len() >= 64 {
                    break;
                }
                next = m.handle.try_event();
            }
            if !run.is_empty() {
                let batches: Vec<Bytes> = run.iter().map(|(_, _, ops)| ops.clone()).collect();
                if !self.apply_all(key, m.incarnation, &batches).await {
                    return Followed::WriteFailed;
                }
                for (from, num, _) in run {
                    if from.node == m.master {
                        m.master_member = Some(from);
                    }
                    m.handle.release(from, num);
                }
                if next.is_none() {
                    return Followed::Going;
                }
            }
            let Some(ev) = next.take() else {
                return Followed::Going;
            };
            match self.follow_event(key, m, Some(ev)).await {
                Followed::Going => {}
                other => return other,
            }
            next = m.handle.try_event();
            if next.is_none() {
                return Followed::Going;
            }
        }
    }

    pub(super) fn track(m: &mut Membership, event: &Event<Bytes>) {
        match event {
            Event::Joined { members } => m.members = members.iter().copied().collect(),
            Event::MembersChanged { births, deaths } => {
                m.members.extend(births.iter().copied());
                for d in deaths {
                    m.members.remove(d);
                }
            }
            _ => {}
        }
    }

    pub(super) async fn join(&self, key: &Key, incarnation: u64, since: u64) -> Option<Membership> {
        match self
            .gm
            .join(&group_name(&key.0, &key.1, incarnation), true)
            .await
        {
            Ok(handle) => Some(Membership {
                role: MirrorRole::new(handle.id()),
                handle,
                members: BTreeSet::new(),
                held: None,
                master: 0,
                master_member: None,
                incarnation,
                since,
                compare_time: Duration::ZERO,
                writer: None,
            }),
            Err(e) => {
                tracing::warn!(queue = %key.1, error = %e, "cannot join the queue's GM group");
                None
            }
        }
    }

    /// The mirror's life: a fresh, empty copy (or the one kept from the last run, until its
    /// first sync compares it); every round written before it is released.
    /// Returns the membership when this node became the queue's home (a promotion).
    pub(super) async fn run_mirror(&self, key: &Key) -> Option<Membership> {
        // Taken before the metadata is read: a queue handle of this name made before it is
        // a deposed master's, whose last operations must not touch the copy
        // (`Storage::start_copy`).
        let since = crate::broker::queue::next_generation();
        let (incarnation, first_master) = {
            // Not held through the mirror's life (see `tasks::queue_task`).
            let state = self.raft.snapshot();
            (
                incarnation_of(&state, key),
                self.home_of(&state, key).unwrap_or(0),
            )
        };
        // The copy starts empty (or as kept from the last run, not yet compared), and a
        // member releases what it cannot write yet (before its sync starts): while the metadata still counts this mirror synchronised (a
        // write failed and recording that did not get through), its releases would let
        // confirms count on a copy that does not hold them, and it could be promoted.
        // So that is recorded first, however long it takes.
        while is_synchronised(&self.raft.snapshot(), key, self.node) {
            let now = self.raft.snapshot();
            if incarnation_of(&now, key) != incarnation
                || role_of(&now, &self.broker, key, self.node) != Role::Mirror
            {
                return None;
            }
            if self
                .set_synchronised(key, incarnation, None, self.node, false, None)
                .await
                .is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !self.begin_copy(key, incarnation, since).await {
            return None;
        }
        let Some(mut m) = self.join(key, incarnation, since).await else {
            self.drop_copy(key, incarnation).await;
            return None;
        };
        tracing::debug!(queue = %key.1, member = ?m.handle.id(), "mirror joined the queue's group");
        let mut views = self.raft.subscribe();
        m.master = first_master;
        loop {
            tokio::select! {
                _ = writer_stopped(&mut m.writer) => {
                    // A backlog batch could not be written: as a round that could not be.
                    m.writer = None;
                    self.set_synchronised(key, m.incarnation, None, self.node, false, None)
                        .await;
                    abandon(&mut m).await;
                    return None;
                }
                ev = m.handle.next_event() => match self.follow_events(key, &mut m, ev).await {
                    Followed::Going => {}
                    Followed::Stopped => {
                        tracing::info!(queue = %key.1, "mirror's GM member stopped");
                        finish_batches(&mut m).await;
                        return None;
                    }
                    Followed::WriteFailed => {
                        finish_batches(&mut m).await;
                        self.set_synchronised(key, m.incarnation, None, self.node, false, None)
                            .await;
                        // It held back the release of the round it could not take: a
                        // draining leave would wait for that forever (bug 22).
                        abandon(&mut m).await;
                        return None;
                    }
                },
                changed = views.changed() => {
                    if changed.is_err() {
                        finish_batches(&mut m).await;
                        return None;
                    }
                    let state = self.raft.snapshot();
                    if incarnation_of(&state, key) != m.incarnation {
                        // The queue was deleted (and maybe declared again): this copy is
                        // of a queue that is gone. Abandoned, not left: a draining leave
                        // releases what comes round unwritten until the ring is quiet, and
                        // a master whose log is behind the delete (cut off, catching up)
                        // would count those releases and confirm publishes it took after
                        // the delete, into a queue nobody keeps (simulation seed 8930).
                        // Nor does it release while its death is being recorded: those
                        // laps stall and are voided with it.
                        finish_batches(&mut m).await;
                        abandon_holding(&mut m).await;
                        self.drop_copy(key, m.incarnation).await;
                        return None;
                    }
                    let home = self.home_of(&state, key);
                    if home == Some(self.node) {
                        // Promoted: the copy is opened as the queue once its writes are done.
                        if !finish_batches(&mut m).await {
                            abandon(&mut m).await;
                            return None;
                        }
                        return Some(m);
                    }
                    if let Some(h) = home {
                        m.master = h;
                    }
                    if role_of(&state, &self.broker, key, self.node) != Role::Mirror {
                        finish_batches(&mut m).await;
                        leave(&mut m).await;
                        self.drop_copy(key, m.incarnation).await;
                        return None;
                    }
                }
            }
        }
    }
}

/// Waits for the backlog batches being written, if any: `false` if one could not be (the
/// copy cannot be trusted any more).
async fn finish_batches(m: &mut Membership) -> bool {
    match m.writer.take() {
        None => true,
        Some(writer) => writer.finish().await,
    }
}

/// Returns when the batch writer, if there is one, stopped on a failed write; never
/// otherwise.
async fn writer_stopped(writer: &mut Option<BatchWriter>) {
    match writer {
        Some(w) => w.stopped().await,
        None => std::future::pending().await,
    }
}

/// Leaves the group, releasing what is delivered meanwhile (the drain waits for the
/// releases of a member with durable acks; nothing is written any more).
pub(super) async fn leave(m: &mut Membership) {
    let done = m.handle.sender().leave();
    wait_gone(m, done, true).await
}

/// Leaves the group at once, as a crash would (`GmSender::abandon`): for a mirror that
/// held back a release (a round it could not write, a sync whose start it missed).
pub(super) async fn abandon(m: &mut Membership) {
    let done = m.handle.sender().abandon();
    wait_gone(m, done, true).await
}

/// [`abandon`], releasing nothing until the death is recorded: for a copy of a deleted
/// queue, whose releases would let a master behind the delete confirm into it.
pub(super) async fn abandon_holding(m: &mut Membership) {
    let done = m.handle.sender().abandon();
    wait_gone(m, done, false).await
}

/// Follows the group until the member is gone, releasing what is delivered meanwhile when
/// `release` is set.
async fn wait_gone(
    m: &mut Membership,
    done: impl std::future::Future<Output = Result<(), crate::runtime::gm_host::GmError>>,
    release: bool,
) {
    tokio::pin!(done);
    loop {
        tokio::select! {
            _ = &mut done => return,
            ev = m.handle.next_event() => match ev {
                None | Some(Event::Stopped) => return,
                Some(Event::Deliver { from, num, .. }) if release => m.handle.release(from, num),
                Some(_) => {}
            }
        }
    }
}

//! One GM member's task: it drives the sans-IO [`crate::gm::Member`] with the host's
//! commands, the messages its neighbours send, and the views the metadata records; it
//! records dead members through Raft and sends to each neighbour in order.

use std::collections::BTreeMap;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::{lock, Cmd, GmError, GmHost, GmNet, FLUSH_AFTER};
use crate::gm::{
    Batch, Event, GmFrame, GmMsg, GmReply, GroupRecord, Member, MemberId, Outbox, Slot,
};
use crate::runtime::raft::MetaView;

/// One member's task: the state machine, its commands, its inbound messages, its views.
pub(super) struct MemberTask<N> {
    pub(super) host: GmHost<N>,
    pub(super) group: String,
    pub(super) me: MemberId,
    pub(super) member: Member<Bytes>,
    pub(super) senders: BTreeMap<MemberId, (mpsc::UnboundedSender<GmMsg<Bytes>>, JoinHandle<()>)>,
    /// Confirmed broadcasts whose lap is not over, with when they were taken.
    pub(super) confirms:
        BTreeMap<u64, (oneshot::Sender<Result<(), GmError>>, tokio::time::Instant)>,
    pub(super) next_token: u64,
    pub(super) leaving: Option<oneshot::Sender<Result<(), GmError>>>,
    /// Whether the leave waits until nothing of this member is in flight.
    pub(super) drain: bool,
    pub(super) events: mpsc::UnboundedSender<Event<Bytes>>,
}

impl<N: GmNet + Clone> MemberTask<N> {
    pub(super) async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        mut inbound: mpsc::UnboundedReceiver<Vec<GmMsg<Bytes>>>,
        mut views: watch::Receiver<MetaView>,
    ) {
        // A view newer than the one it was built with may already be applied.
        self.on_view(&views.borrow_and_update());
        self.pump();
        let mut cmds_open = true;
        while !self.member.is_stopped() {
            tokio::select! {
                cmd = cmds.recv(), if cmds_open => match cmd {
                    Some(cmd) => {
                        let mut bytes = self.on_cmd(cmd);
                        // Everything else that is ready goes in the same flush, up to a
                        // count (so a steady stream still flushes); an activity that
                        // reached its byte size leaves at once (it must fit a frame).
                        let mut taken = 1;
                        while taken < FLUSH_AFTER {
                            if bytes >= self.host.inner.cfg.max_activity_bytes {
                                self.member.flush();
                                bytes = 0;
                            }
                            let Ok(cmd) = cmds.try_recv() else { break };
                            bytes += self.on_cmd(cmd);
                            taken += 1;
                        }
                        self.member.flush();
                    }
                    // The handle is gone: keep carrying the others' traffic until the
                    // metadata drops us.
                    None => cmds_open = false,
                },
                msgs = inbound.recv() => match msgs {
                    Some(msgs) => {
                        for msg in msgs {
                            self.member.handle_message(msg);
                        }
                        while let Ok(msgs) = inbound.try_recv() {
                            for msg in msgs {
                                self.member.handle_message(msg);
                            }
                        }
                    }
                    None => break,
                },
                changed = views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    self.on_view(&views.borrow_and_update());
                }
            }
            self.pump();
            self.maybe_leave();
        }
        if self.member.is_orphaned() {
            // Still alive in the record: dead there, or it would hold the others up.
            tracing::info!("member orphaned (everyone who could catch it up died first): leaving");
            let record = record_dead(self.host.clone(), self.group.clone(), self.me);
            tokio::spawn(async move {
                if let Err(e) = record.await {
                    tracing::warn!(error = %e, "cannot record an orphaned member dead");
                }
            });
        }
        self.stop();
    }

    /// Takes a command; returns the bytes it broadcast (buffered until the next flush).
    pub(super) fn on_cmd(&mut self, cmd: Cmd) -> usize {
        match cmd {
            Cmd::Broadcast(msg) => {
                let n = msg.len();
                self.member.broadcast(msg);
                n
            }
            Cmd::Confirmed(msg, tx) => {
                let n = msg.len();
                let token = self.next_token;
                self.next_token += 1;
                self.confirms
                    .insert(token, (tx, tokio::time::Instant::now()));
                // Flushed with the rest of the batch (see `run`).
                self.member.confirmed_broadcast_buffered(msg, token);
                n
            }
            Cmd::Release(origin, upto) => {
                self.member.release(origin, upto);
                0
            }
            Cmd::Leave { tx, drain } => {
                self.leaving = Some(tx);
                self.drain = drain;
                0
            }
        }
    }

    pub(super) fn on_view(&mut self, view: &MetaView) {
        match view.state.gm_groups.get(&self.group) {
            Some(record) => {
                self.member.handle_view(record);
                // Alive, or newer than this record (joined in a view not seen here yet).
                let alive = |id: MemberId| {
                    id.since > record.version || record.members.contains(&Slot::Alive(id))
                };
                lock(&self.host.inner.inbox).drop_parts_unless(&self.group, alive);
            }
            // The group was forgotten: as good as dropped from it.
            None => self.member.handle_view(&GroupRecord {
                version: u64::MAX,
                members: Vec::new(),
            }),
        }
    }

    /// Moves the member's output: messages to their streams, events to the owner.
    pub(super) fn pump(&mut self) {
        while let Some((to, msg)) = self.member.poll_transmit() {
            self.sender(to).0.send(msg).ok();
        }
        while let Some(event) = self.member.poll_event() {
            match event {
                Event::Confirmed(token) => {
                    if let Some((tx, taken)) = self.confirms.remove(&token) {
                        if let Some(h) = &self.host.inner.cfg.lap_latency {
                            h.observe(taken.elapsed().as_secs_f64());
                        }
                        let _ = tx.send(Ok(()));
                    }
                }
                Event::EraseAliases(ids) => {
                    let host = self.host.clone();
                    let group = self.group.clone();
                    tokio::spawn(async move {
                        let gone = |r: &GroupRecord| {
                            !r.members
                                .iter()
                                .any(|s| matches!(s, Slot::Dead(id) if ids.contains(id)))
                        };
                        let erase = |r: &GroupRecord| {
                            r.members
                                .iter()
                                .copied()
                                .filter(|s| !matches!(s, Slot::Dead(id) if ids.contains(id)))
                                .collect()
                        };
                        if let Err(e) = host.change_record(&group, gone, erase).await {
                            tracing::warn!(%group, "cannot erase dead GM members: {e}");
                        }
                    });
                }
                other => {
                    let _ = self.events.send(other);
                }
            }
        }
        // A stream lives as long as its receiver: a member that was our right neighbour
        // and becomes it again must get the rest of the same numbered stream (a new one
        // would restart at 1 and be taken for a resend). Streams to dead members go.
        let view = self.member.view();
        self.senders.retain(|to, (_, task)| {
            let keep = view.is_alive(*to);
            if !keep {
                task.abort();
            }
            keep
        });
    }

    pub(super) fn sender(
        &mut self,
        to: MemberId,
    ) -> &(mpsc::UnboundedSender<GmMsg<Bytes>>, JoinHandle<()>) {
        let host = self.host.clone();
        let group = self.group.clone();
        let me = self.me;
        self.senders.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(run_sender(host, group, me, to, rx));
            (tx, task)
        })
    }

    pub(super) fn maybe_leave(&mut self) {
        if self.leaving.is_none() || (self.drain && !self.member.is_quiet()) {
            return;
        }
        let Some(tx) = self.leaving.take() else {
            return;
        };
        let record = record_dead(self.host.clone(), self.group.clone(), self.me);
        tokio::spawn(async move {
            let _ = tx.send(record.await);
        });
    }

    pub(super) fn stop(&mut self) {
        for (_, (_, task)) in std::mem::take(&mut self.senders) {
            task.abort();
        }
        for (_, (tx, _)) in std::mem::take(&mut self.confirms) {
            let _ = tx.send(Err(GmError::Stopped));
        }
        let inner = &self.host.inner;
        lock(&inner.routes).remove(&(self.group.clone(), self.me));
        lock(&inner.inbox).forget(&self.group, self.me);
        let _ = self.events.send(Event::Stopped);
    }
}

/// Marks member `me` dead in `group`'s record (a leave, or an orphaned member's exit).
pub(super) async fn record_dead<N: GmNet + Clone>(
    host: GmHost<N>,
    group: String,
    me: MemberId,
) -> Result<(), GmError> {
    let gone = |r: &GroupRecord| !r.members.contains(&Slot::Alive(me));
    let dead = |r: &GroupRecord| {
        r.members
            .iter()
            .map(|s| {
                if *s == Slot::Alive(me) {
                    Slot::Dead(me)
                } else {
                    *s
                }
            })
            .collect()
    };
    host.change_record(&group, gone, dead).await
}

/// One stream: sends `rx`'s messages to member `to`, one batch in flight, resending until
/// accepted.
pub(super) async fn run_sender<N: GmNet + Clone>(
    host: GmHost<N>,
    group: String,
    from: MemberId,
    to: MemberId,
    mut rx: mpsc::UnboundedReceiver<GmMsg<Bytes>>,
) {
    let inner = &host.inner;
    let mut outbox = Outbox::new();
    // Halved after a failed send, so a batch too large for a frame gets through in parts.
    let mut max_batch = inner.cfg.max_batch;
    loop {
        if outbox.is_empty() {
            match rx.recv().await {
                Some(msg) => outbox.push(msg),
                None => return,
            }
        }
        while let Ok(msg) = rx.try_recv() {
            outbox.push(msg);
        }
        let Some(batch) = outbox.batch(max_batch, inner.cfg.max_batch_bytes) else {
            // Nothing to send (or an unencodable message, logged): wait for more.
            match rx.recv().await {
                Some(msg) => outbox.push(msg),
                None => return,
            }
            continue;
        };
        let (first_seq, msgs, part) = match batch {
            Batch::Msgs { first_seq, msgs } => (first_seq, msgs, None),
            Batch::Part { seq, part } => (seq, Vec::new(), Some(part)),
        };
        let frame = GmFrame {
            group: group.clone(),
            from,
            to,
            first_seq,
            msgs,
            part,
        };
        let Ok(bytes) = bincode::serialize(&frame) else {
            tracing::error!(%group, "cannot encode a GM frame");
            return;
        };
        // A member on this node (two members of one group on one node) needs no link.
        let sent = if to.node == inner.node {
            Ok(host.handle_frame(&bytes::Bytes::from(bytes)))
        } else {
            inner.net.call(to.node, bytes, inner.cfg.call_timeout).await
        };
        let reply = match sent {
            Ok(r) => bincode::deserialize::<GmReply>(&r).ok(),
            Err(e) => {
                tracing::debug!(%group, to = to.node, "gm send: {e}");
                None
            }
        };
        match reply {
            Some(GmReply::Accepted { upto }) => {
                outbox.accepted(upto);
                max_batch = inner.cfg.max_batch;
            }
            Some(GmReply::Partial { upto, have }) => outbox.partial(upto, have),
            Some(GmReply::NoMember) => tokio::time::sleep(inner.cfg.retry_after).await,
            None => {
                max_batch = (max_batch / 2).max(1);
                tokio::time::sleep(inner.cfg.retry_after).await;
            }
        }
    }
}

//! Joining a group: the compare-and-set that adds a member at the end of the ring, the
//! settling of a join whose outcome is unknown (a quorum read, then following the record
//! for a late commit: `gm::late_join`), the start of the member's task, and the
//! compare-and-set every change of the group record goes through (joins, leaves, erasures).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::member_task::{self, MemberTask};
use super::{lock, GmError, GmHandle, GmHost, GmNet, SETTLE_ATTEMPT, SETTLE_WITHIN};
use crate::gm::{late_join, GmMsg, GroupRecord, LateJoin, Member, MemberId, Slot};
use crate::meta::Command;
use crate::runtime::raft::ProposeError;

impl<N: GmNet + Clone> GmHost<N> {
    /// Joins `group` (creating it when it does not exist) as a new member at the end of the
    /// ring, and starts the member. With `durable_acks`, the owner must
    /// [`release`](GmHandle::release) what it delivers (see [`Member::with_durable_acks`]).
    pub async fn join(&self, group: &str, durable_acks: bool) -> Result<GmHandle, GmError> {
        let inner = &self.inner;
        let _one_at_a_time = inner.joining.lock().await;
        for _ in 0..inner.cfg.cas_attempts {
            let current = inner
                .raft
                .snapshot()
                .gm_groups
                .get(group)
                .cloned()
                .unwrap_or_default();
            let me = MemberId {
                node: inner.node,
                since: current.version + 1,
            };
            let mut members = current.members.clone();
            members.push(Slot::Alive(me));
            // The route exists before the record names us: the left neighbour's catch-up
            // may arrive before the member task starts, and waits in the channel.
            let (route_tx, route_rx) = mpsc::unbounded_channel();
            lock(&inner.routes).insert((group.to_string(), me), route_tx);
            // If it commits, this is the record at version `me.since`: only this
            // compare-and-set can name `me`.
            let joined = GroupRecord {
                version: me.since,
                members: members.clone(),
            };
            let cmd = Command::GmGroup {
                name: group.to_string(),
                expected_version: current.version,
                members,
            };
            match inner.raft.propose(cmd).await {
                Ok(resp) if resp.outcome.is_ok() => {
                    match self.wait_for_version(group, me.since).await {
                        Ok(record) => {
                            return Ok(self.start_member(
                                group,
                                me,
                                &joined,
                                &record,
                                durable_acks,
                                route_rx,
                            ))
                        }
                        Err(e) => {
                            lock(&inner.routes).remove(&(group.to_string(), me));
                            self.bury_late_join(group, me);
                            return Err(e);
                        }
                    }
                }
                Ok(_) => {}
                Err(e) if !e.outcome_unknown() => {
                    tracing::debug!(group, "gm join: {e}");
                }
                Err(e) => {
                    // It may have committed, or may yet: a quorum read settles which. Waiting
                    // for our version instead waited for ever when the entry died with its
                    // leader (bug 20).
                    tracing::debug!(group, "gm join, outcome unknown: {e}");
                    match self.settled_record(group).await {
                        Ok(record) if record.members.contains(&Slot::Alive(me)) => {
                            return Ok(self.start_member(
                                group,
                                me,
                                &joined,
                                &record,
                                durable_acks,
                                route_rx,
                            ));
                        }
                        // Not committed when read, but it may commit yet (bug 26).
                        Ok(_) => self.bury_late_join(group, me),
                        Err(e) => {
                            lock(&inner.routes).remove(&(group.to_string(), me));
                            self.bury_late_join(group, me);
                            return Err(e);
                        }
                    }
                }
            }
            lock(&inner.routes).remove(&(group.to_string(), me));
            tokio::time::sleep(inner.cfg.cas_retry).await;
        }
        Err(GmError::Membership {
            group: group.to_string(),
            reason: "too many lost compare-and-set races".into(),
        })
    }

    /// `group`'s record as of a read index from a leader, applied here: it shows a join
    /// that committed. One it does not show can still commit: a proposal forwarded to the
    /// leader may reach its log after the read (bug 26), which
    /// [`GmHost::bury_late_join`] answers. Retried while no leader answers, for as long as
    /// [`GmHost::wait_for_version`] would wait.
    async fn settled_record(&self, group: &str) -> Result<GroupRecord, GmError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + SETTLE_WITHIN;
        loop {
            match inner.raft.quorum_snapshot(SETTLE_ATTEMPT).await {
                Ok(state) => return Ok(state.gm_groups.get(group).cloned().unwrap_or_default()),
                Err(ProposeError::Stopped(reason)) => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason,
                    })
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason: format!("could not learn whether a join committed: {e}"),
                    })
                }
                Err(e) => {
                    tracing::debug!(group, "gm join, settling an unknown outcome: {e}");
                    tokio::time::sleep(inner.cfg.cas_retry).await;
                }
            }
        }
    }

    /// Follows `group`'s record until the join of `me` this host gave up on is settled
    /// ([`late_join`]), and records `me` dead if it committed: no task runs behind it, and
    /// a live member that nobody runs stalls every lap of the ring (bug 26).
    fn bury_late_join(&self, group: &str, me: MemberId) {
        let host = self.clone();
        let group = group.to_string();
        let mut views = self.inner.raft.subscribe();
        tokio::spawn(async move {
            loop {
                let record = views
                    .borrow_and_update()
                    .state
                    .gm_groups
                    .get(&group)
                    .cloned();
                match late_join(record.as_ref(), me) {
                    LateJoin::Never => return,
                    LateJoin::Named => break,
                    LateJoin::Pending => {
                        if views.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
            {
                // A later attempt made while the record had not moved proposes the same id,
                // and owns it if it committed. Joins hold this lock until they are done.
                let _joins = host.inner.joining.lock().await;
                if lock(&host.inner.routes).contains_key(&(group.clone(), me)) {
                    return;
                }
            }
            tracing::info!(%group, since = me.since, "a join given up on committed late: recording it dead");
            if let Err(e) = member_task::record_dead(host, group.clone(), me).await {
                tracing::warn!(%group, "cannot record a late join dead: {e}");
            }
        });
    }

    /// Waits until the local metadata has `group` at `version` or later (bounded).
    async fn wait_for_version(&self, group: &str, version: u64) -> Result<GroupRecord, GmError> {
        let mut views = self.inner.raft.subscribe();
        let wait = async {
            loop {
                if let Some(r) = views.borrow_and_update().state.gm_groups.get(group) {
                    if r.version >= version {
                        return Some(r.clone());
                    }
                }
                if views.changed().await.is_err() {
                    return None;
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(30), wait).await {
            Ok(Some(r)) => Ok(r),
            _ => Err(GmError::Membership {
                group: group.to_string(),
                reason: "the metadata did not reach the new record".into(),
            }),
        }
    }

    /// Starts the member `me` made from `joined`, the record its join committed, then
    /// moved on to `record`, the newer one applied here by now. Made from `record` alone,
    /// a member could not tell who it joined behind: a founder whose record already lists
    /// later joiners waited for a state nobody would send, and a joiner whose older peers
    /// had all died by then waited for the next record to learn it was orphaned (bug 32).
    fn start_member(
        &self,
        group: &str,
        me: MemberId,
        joined: &GroupRecord,
        record: &GroupRecord,
        durable_acks: bool,
        route_rx: mpsc::UnboundedReceiver<Vec<GmMsg<Bytes>>>,
    ) -> GmHandle {
        let member = Member::new(me, joined);
        let mut member = if durable_acks {
            member.with_durable_acks()
        } else {
            member
        };
        member.handle_view(record);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let task = MemberTask {
            host: self.clone(),
            group: group.to_string(),
            me,
            member,
            senders: BTreeMap::new(),
            confirms: BTreeMap::new(),
            next_token: 0,
            leaving: None,
            drain: true,
            events: ev_tx,
        };
        // The span is the task's (`instrument`), not entered across its awaits: an entered
        // guard would stay on the worker thread and label other tasks' logs with it.
        let span = tracing::info_span!("gm", node = me.node, group = %group, since = me.since);
        tokio::spawn(
            task.run(cmd_rx, route_rx, self.inner.raft.subscribe())
                .instrument(span),
        );
        GmHandle {
            id: me,
            group: group.to_string(),
            cmds: cmd_tx,
            events: ev_rx,
        }
    }

    /// Commits `change` to `group`'s record by compare-and-set, retrying on lost races,
    /// until `done` says the record no longer needs it.
    pub(super) async fn change_record(
        &self,
        group: &str,
        done: impl Fn(&GroupRecord) -> bool,
        change: impl Fn(&GroupRecord) -> Vec<Slot>,
    ) -> Result<(), GmError> {
        let inner = &self.inner;
        let mut last = String::new();
        for _ in 0..inner.cfg.cas_attempts {
            let Some(current) = inner.raft.snapshot().gm_groups.get(group).cloned() else {
                return Ok(());
            };
            if done(&current) {
                return Ok(());
            }
            let cmd = Command::GmGroup {
                name: group.to_string(),
                expected_version: current.version,
                members: change(&current),
            };
            match inner.raft.propose(cmd).await {
                Ok(resp) => {
                    if let Err(r) = resp.outcome {
                        last = format!("{r:?}");
                    }
                }
                Err(ProposeError::Stopped(e)) => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason: e,
                    })
                }
                Err(e) => last = e.to_string(),
            }
            // Let the local metadata catch up with whatever won.
            tokio::time::sleep(inner.cfg.cas_retry).await;
        }
        Err(GmError::Membership {
            group: group.to_string(),
            reason: last,
        })
    }
}

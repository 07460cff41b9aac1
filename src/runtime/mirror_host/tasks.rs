//! The host's tasks: one per queue this node has a part in (master or mirror), the
//! supervisor that starts them, the master's lease renewal, and the leader's reconciler.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::mirror::leave;
use super::{group_of, incarnation_of, lock, role_of, Inner, Key, Role, StorageDisk};
use crate::broker::Broker;
use crate::meta::{Command, MetaState, NodeId};
use crate::mirror::lease::{self, Claim};
use crate::runtime::gm_host::GmNet;

/// One task per queue this node has a part in.
///
/// No snapshot of the metadata is held across a role's run: each such task would pin the
/// version it read for as long as the role lasts, and a node with N mirrored queues
/// declared one after another held N versions of a metadata that grows with N (about
/// 320 KiB per idle mirrored queue per node at 1,000 queues; `docs/performance.md`).
pub(super) async fn queue_task<N: GmNet + Clone, D: StorageDisk>(
    inner: Arc<Inner<N, D>>,
    key: Key,
) {
    loop {
        let role = role_of(&inner.raft.snapshot(), &inner.broker, &key, inner.node);
        match role {
            Role::None => return,
            Role::Adopt => {
                if let Some(m) = inner.adopt(&key, None).await {
                    drop(m);
                }
                if inner.broker.queue(&key.0, &key.1).is_none() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            Role::Master => inner.run_master(&key, None).await,
            Role::Mirror => {
                if let Some(m) = inner.run_mirror(&key).await {
                    let member = inner.adopt(&key, Some(m)).await;
                    let role = role_of(&inner.raft.snapshot(), &inner.broker, &key, inner.node);
                    match (member, role) {
                        (Some(m), Role::Master) => inner.run_master(&key, Some(m)).await,
                        (Some(mut m), _) => {
                            inner.masters.remove(&key);
                            leave(&mut m).await;
                        }
                        (None, _) => {
                            inner.masters.remove(&key);
                        }
                    }
                } else {
                    // Left, stopped or failed: look again shortly (a restart rejoins).
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Starts a queue task for every queue this node has a part in.
pub(super) async fn supervise<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>) {
    let mut views = inner.raft.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let started = std::time::Instant::now();
    loop {
        let state = inner.raft.snapshot();
        drop_unused_copies(&inner, &state, started.elapsed()).await;
        {
            let mut tasks = lock(&inner.tasks);
            tasks.retain(|_, t| !t.is_finished());
            for key in state.mirror_sets.keys() {
                if tasks.contains_key(key) {
                    continue;
                }
                if role_of(&state, &inner.broker, key, inner.node) != Role::None {
                    let span = tracing::info_span!("mirror", node = inner.node, vhost = %key.0, queue = %key.1);
                    let task = tokio::spawn(tracing::Instrument::instrument(
                        queue_task(inner.clone(), key.clone()),
                        span,
                    ));
                    tasks.insert(key.clone(), task);
                }
            }
        }
        tokio::select! {
            r = views.changed() => if r.is_err() { return },
            _ = tick.tick() => {}
        }
    }
}

/// How long a copy kept from the last run waits for this node to mirror its queue again
/// (the leader's reconciler adds a restarted node back within a second or so).
const KEPT_COPY_GRACE: Duration = Duration::from_secs(30);

/// Drops copies kept from the last run that no mirror will use: of a queue deleted or
/// declared again since, or, after [`KEPT_COPY_GRACE`], of one this node does not mirror.
async fn drop_unused_copies<N: GmNet + Clone, D: StorageDisk>(
    inner: &Arc<Inner<N, D>>,
    state: &MetaState,
    running_for: Duration,
) {
    for (key, incarnation) in inner.storage.kept_copies() {
        let gone = incarnation_of(state, &key) != incarnation;
        let unused = running_for > KEPT_COPY_GRACE
            && role_of(state, &inner.broker, &key, inner.node) == Role::None
            && !lock(&inner.tasks).contains_key(&key);
        if gone || unused {
            tracing::info!(queue = %key.1, "dropping a mirror copy kept from the last run: unused");
            inner.drop_copy(&key, incarnation).await;
        }
    }
}

/// Delivers what consumers can take now (after a lease was renewed or lifted).
pub(super) fn kick(
    broker: &Broker,
    h: &Arc<crate::broker::QueueHandle>,
    now: crate::time::Instant,
) {
    let mut dead = Vec::new();
    h.lock().deliver(h, now, &mut dead);
    if !dead.is_empty() {
        broker.dead_letter(h, dead, now);
    }
}

/// Renews the leases of the queues this node masters. A quorum read started at `t0`
/// (`MetaRaft::quorum_snapshot`: the leader confirms its leadership with heartbeats sent
/// after the request reached it) that still shows this node as the queue's home and its
/// member alive in the group means no promotion had committed at `t0`. One needs the node
/// recorded down first, which a leader does only after the failure detector's timeout
/// without hearing from it (the read request was heard at or after `t0`), and a new leader
/// only after leading that long. So the master may serve until `t0 + lease`, the lease
/// being under that timeout.
pub(super) async fn keep_leases<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>) {
    let lease_ms = inner.lease.as_millis() as u64;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(inner.lease / 3) => {}
            _ = inner.lease_wake.notified() => {}
        }
        if inner.masters.is_empty() {
            continue;
        }
        let t0 = inner.clock.now();
        let Ok(state) = inner.raft.quorum_snapshot(inner.lease).await else {
            continue;
        };
        let shipping = inner.masters.all();
        let mut renewed = Vec::new();
        for (key, shipping) in shipping {
            let claim = Claim {
                node: inner.node,
                incarnation: shipping.incarnation,
                member: shipping.member,
            };
            let Some(until) = lease::renewal(&state, &key.0, &key.1, &claim, t0, lease_ms) else {
                continue;
            };
            if let Some(h) = inner.broker.queue(&key.0, &key.1) {
                let mut q = h.lock();
                // Checked under the queue's lock: a master that stopped meanwhile (and
                // fenced the queue after leaving the map) is not renewed.
                let current = inner
                    .masters
                    .get(&key)
                    .is_some_and(|s| s.member == shipping.member && s.epoch == shipping.epoch);
                if current {
                    q.set_lease(Some(until));
                    drop(q);
                    renewed.push(h);
                }
            }
        }
        // Consumers that waited while the lease ran out get their messages now.
        let now = inner.clock.now();
        for h in renewed {
            kick(&inner.broker, &h, now);
        }
    }
}

/// On the leader: mirror sets follow policies and running nodes; a master recorded down
/// hands over to a mirror (`mirror::reconcile::plan`).
pub(super) async fn reconcile<N: GmNet + Clone, D: StorageDisk>(
    inner: Arc<Inner<N, D>>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    let mut views = inner.raft.subscribe();
    loop {
        // On every metadata change (a node recorded down: promote now) and on the tick
        // (the failure detector's view of running nodes is not in the metadata).
        tokio::select! {
            _ = tick.tick() => {}
            changed = views.changed() => if changed.is_err() { return },
        }
        if !inner.raft.is_leader() {
            continue;
        }
        let running = |state: &MetaState| -> BTreeSet<NodeId> {
            state
                .nodes
                .keys()
                .copied()
                .filter(|id| *id == inner.node || !inner.broker.node_is_down(*id))
                .collect()
        };
        if crate::mirror::reconcile::plan(&inner.raft.snapshot(), &running(&inner.raft.snapshot()))
            .is_empty()
        {
            continue;
        }
        // Decisions are taken from state a quorum confirmed this node leads.
        let Ok(state) = inner.raft.linearizable_snapshot().await else {
            continue;
        };
        let running = running(&state);
        for cmd in crate::mirror::reconcile::plan(&state, &running) {
            if let Command::PromoteMirror { vhost, queue, .. }
            | Command::PromoteSyncedMirror { vhost, queue, .. } = &cmd
            {
                // Only once the old master's member is dead in the group (its node recorded
                // down or restarted): a master that still counts as a member could still
                // complete laps, and two masters must never both confirm.
                let old = state
                    .vhosts
                    .get(vhost)
                    .and_then(|v| v.queues.get(queue))
                    .map_or(0, |d| d.home);
                let key = (vhost.clone(), queue.clone());
                let still_member = !running.contains(&old)
                    && state
                        .gm_groups
                        .get(&group_of(&state, &key))
                        .is_some_and(|g| g.has_live_member_on(old));
                if still_member {
                    continue;
                }
                tracing::warn!(vhost = %vhost, queue = %queue, command = ?cmd, "promoting a mirror");
            }
            if let Command::SetMirrors { queue, mirrors, .. } = &cmd {
                tracing::debug!(queue = %queue, mirrors = ?mirrors.iter().map(|m| m.node).collect::<Vec<_>>(), "setting a queue's mirrors");
            }
            if let Err(e) = inner.raft.propose(cmd).await {
                tracing::debug!(error = %e, "mirror reconciliation step not applied");
            }
        }
    }
}

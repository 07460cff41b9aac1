//! [`RaftMeta`], a clustered node's [`MetaCommit`]: places new queues
//! (`queue-master-locator`: [`Locator`]) and proposes commands through Raft, answering once
//! this node runs the applied state.

use std::collections::BTreeMap;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use tokio::sync::watch;

use crate::broker::Broker;
use crate::cluster::read_log::Readers;
use crate::meta::state::{Applied, Removed};
use crate::meta::{Command, MetaError, MetaState, QueueDef};
use crate::runtime::clock::Clock;
use crate::runtime::conn_task::{MetaCommit, MetaFuture};
use crate::runtime::raft::{MetaRaft, NodeId};
use crate::runtime::relay::Relay;
use crate::time::Instant;

/// How long a routing barrier that failed at once waits before it asks the node again.
const BARRIER_RETRY: Duration = Duration::from_millis(50);

/// A clustered node's [`MetaCommit`]: places new queues, proposes through Raft (a follower
/// forwards to the leader), and resolves once this node's broker has followed the entry.
pub struct RaftMeta {
    pub(super) raft: MetaRaft,
    pub(super) broker: Arc<Broker>,
    pub(super) relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
    pub(super) applied: watch::Receiver<u64>,
    pub(super) commit_timeout: Duration,
    /// The nodes' routing lease (`cluster::routing_lease`), when they keep one, and the
    /// node clock: a routing change waits for a node that has not followed it only until
    /// the lease it may hold from before has lapsed.
    pub(super) routing_lease: Option<(Duration, Clock)>,
    pub(super) rng: Mutex<StdRng>,
}

impl std::fmt::Debug for RaftMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftMeta").finish_non_exhaustive()
    }
}

/// Where `queue-master-locator` puts new queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locator {
    /// The node the declaring client is connected to (RabbitMQ's default).
    ClientLocal,
    /// The live node running the fewest queues.
    MinMasters,
    /// A live node at random.
    Random,
}

impl Locator {
    /// The locator for `def`: its `x-queue-master-locator` argument, else its effective
    /// policy's `queue-master-locator`, else client-local. Exclusive queues are always local.
    pub fn of(def: &QueueDef, state: &MetaState) -> Locator {
        if def.exclusive_owner.is_some() {
            return Locator::ClientLocal;
        }
        let arg = def
            .arguments
            .inner()
            .get("x-queue-master-locator")
            .and_then(crate::meta::args::string);
        let policy = || {
            let v = state.vhost(&def.vhost)?;
            match v
                .effective_policy(&def.name, true)
                .definition
                .get("queue-master-locator")
            {
                Some(crate::meta::policy::PolicyValue::Str(s)) => Some(s.clone()),
                _ => None,
            }
        };
        match arg.or_else(policy).as_deref() {
            Some("min-masters") => Locator::MinMasters,
            Some("random") => Locator::Random,
            _ => Locator::ClientLocal,
        }
    }

    /// The home for a new queue: `local` for client-local; otherwise among `live` nodes
    /// (which include `local`), by queue count or at random.
    pub fn place(
        self,
        local: NodeId,
        live: &[NodeId],
        state: &MetaState,
        rng: &mut impl Rng,
    ) -> NodeId {
        if live.is_empty() {
            return local;
        }
        match self {
            Locator::ClientLocal => local,
            Locator::Random => live[rng.gen_range(0..live.len())],
            Locator::MinMasters => {
                let mut counts: BTreeMap<NodeId, usize> = live.iter().map(|&n| (n, 0)).collect();
                for v in state.vhosts.values() {
                    for q in v.queues.values() {
                        if let Some(c) = counts.get_mut(&q.home) {
                            *c += 1;
                        }
                    }
                }
                counts
                    .into_iter()
                    .min_by_key(|&(n, c)| (c, n))
                    .map_or(local, |(n, _)| n)
            }
        }
    }
}

impl RaftMeta {
    /// Commits through `raft` for `broker`'s node: a result once `applied` (the follower's
    /// index, [`super::follow_metadata`]) reaches the entry, a queue's declare once its
    /// home node runs it too (through `relay`, once installed); `seed` draws random homes.
    pub fn new(
        raft: MetaRaft,
        broker: Arc<Broker>,
        relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
        applied: watch::Receiver<u64>,
        commit_timeout: Duration,
        seed: u64,
    ) -> RaftMeta {
        RaftMeta {
            raft,
            broker,
            relay,
            applied,
            commit_timeout,
            routing_lease: None,
            rng: Mutex::new(rand::SeedableRng::seed_from_u64(seed)),
        }
    }

    /// The nodes keep a routing lease of `lease` (`runtime::cluster::keep_routing_lease`):
    /// a routing change stops waiting for a node that has not followed it once the lease
    /// it may have held from before the change has lapsed.
    pub fn with_routing_lease(mut self, lease: Duration, clock: Clock) -> RaftMeta {
        self.routing_lease = Some((lease, clock));
        self
    }

    pub(super) fn place(&self, def: &QueueDef) -> NodeId {
        let me = self.broker.node_id();
        let state = self.raft.snapshot();
        if let Some(existing) = state
            .vhost(&def.vhost)
            .and_then(|v| v.queues.get(&def.name))
        {
            return existing.home;
        }
        let live: Vec<NodeId> = state
            .nodes
            .keys()
            .copied()
            .filter(|&n| n == me || !self.broker.node_is_down(n))
            .collect();
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        Locator::of(def, &state).place(me, &live, &state, &mut *rng)
    }
}

impl MetaCommit for RaftMeta {
    fn commit(&self, mut command: Command, _now: Instant) -> MetaFuture {
        let declares: Vec<&mut QueueDef> = match &mut command {
            Command::DeclareQueue(def) => vec![def],
            Command::Batch(commands) => commands
                .iter_mut()
                .filter_map(|c| match c {
                    Command::DeclareQueue(def) => Some(def),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        // A queue created on another node must exist there before declare-ok: the client
        // may publish to it or consume from it at once.
        let mut remote_homes = Vec::new();
        for def in declares {
            if def.home == 0 {
                def.home = self.place(def);
            }
            if def.home != self.broker.node_id() && !remote_homes.contains(&def.home) {
                remote_homes.push(def.home);
            }
        }
        let routing = command.parts().iter().any(changes_routing);
        let binds = command
            .parts()
            .iter()
            .any(|c| matches!(c, Command::Bind(_) | Command::Unbind(_)));
        let broker = self.broker.clone();
        let relay = self.relay.get().cloned();
        let raft = self.raft.clone();
        let mut applied = self.applied.clone();
        let timeout = self.commit_timeout;
        let lapse = self.routing_lease.map(|(lease, clock)| {
            (
                crate::cluster::routing_lease::lapse_after_ms(lease.as_millis() as u64),
                clock,
            )
        });
        Box::pin(async move {
            // A routing change asks the leader which nodes it served reads to within the
            // lapse (`cluster::read_log`): no other node can route by what it had.
            let proposed = match lapse.filter(|_| routing) {
                Some((lapse_ms, _)) => {
                    let window = Duration::from_millis(lapse_ms);
                    raft.propose_routing(command, window).await
                }
                None => raft.propose(command).await.map(|r| (r, Readers::Unknown)),
            };
            let (response, readers) = proposed.map_err(|e| MetaError::Unavailable {
                maybe_applied: e.outcome_unknown(),
                reason: e.to_string(),
            })?;
            // This node's broker follows the entry before the session reads it (declare-ok
            // counts, the consumer a basic.consume adds to the new queue).
            let _ = tokio::time::timeout(timeout, applied.wait_for(|i| *i >= response.index)).await;
            if let (Some(relay), true) = (relay, response.outcome.is_ok()) {
                // A change of routing (not a declare of what exists) is answered once every
                // live node routes by it, as mnesia's transactions are on every running node
                // before they return: a client told a queue exists (or is gone) may publish
                // through any node at once, and one whose metadata is behind would return
                // the message as unroutable (simulation seeds 108, 274) or, into a deleted
                // queue it mastered alone, confirm it. With the routing lease, a node that
                // has not followed within `lapse` of the commit routes nothing until it
                // does (`cluster::routing_lease`), so the wait ends there; and a node the
                // leader has served no read within the lapse holds no lease now, so it is
                // not waited for at all. The commit timeout bounds it all.
                let committed = lapse.map(|(_, clock)| clock.now());
                let changed = response.outcome.as_ref().is_ok_and(|s| {
                    binds
                        || s.created
                        || !s.removed_queues.is_empty()
                        || !s.removed_exchanges.is_empty()
                });
                let nodes = if routing && changed {
                    let state = broker.snapshot();
                    let me = broker.node_id();
                    // Without the lease, a node the failure detector has given up is not
                    // waited for: until it catches up it routes by what it had.
                    state
                        .nodes
                        .keys()
                        .copied()
                        .filter(|&n| n != me && (lapse.is_some() || !broker.node_is_down(n)))
                        .collect()
                } else {
                    remote_homes.clone()
                };
                let mut barriers = tokio::task::JoinSet::new();
                for node in nodes {
                    let (relay, broker, index) = (relay.clone(), broker.clone(), response.index);
                    // A queue's own node must run it before declare-ok (a consume goes
                    // there), so the lease does not end the wait for that one.
                    let lease = lapse
                        .zip(committed)
                        .filter(|_| !remote_homes.contains(&node));
                    let may_hold_lease = readers.may_hold_lease(node);
                    barriers.spawn(async move {
                        // A barrier that fails at once (the link to a node that is cut off
                        // one way cannot be opened) is asked again while the detector still
                        // hears the node: answering before it follows would let a publish
                        // through it come back unroutable (simulation seed 6510).
                        loop {
                            let ask = relay.barrier(node, index);
                            let Some(((lapse_ms, clock), committed)) = lease else {
                                if ask.await {
                                    break (node, true);
                                }
                                if broker.node_is_down(node) {
                                    break (node, false);
                                }
                                tokio::time::sleep(BARRIER_RETRY).await;
                                continue;
                            };
                            // The lease the node may hold from before the commit lapses
                            // `lapse_ms` after it; one the leader has not served within
                            // the lapse holds none. Whether this node's failure detector
                            // gave it up says nothing: the leader may still hear it.
                            let lapsed = committed.plus_millis(lapse_ms);
                            if !may_hold_lease || clock.now() >= lapsed {
                                tracing::debug!(
                                    node,
                                    "a node has not followed a routing change: its routing \
                                     lease has lapsed"
                                );
                                break (node, false);
                            }
                            match tokio::time::timeout_at(clock.to_tokio(lapsed), ask).await {
                                Ok(true) => break (node, true),
                                Ok(false) => tokio::time::sleep(BARRIER_RETRY).await,
                                Err(_) => {}
                            }
                        }
                    });
                }
                let all = async {
                    while let Some(done) = barriers.join_next().await {
                        if let Ok((node, false)) = done {
                            if remote_homes.contains(&node) {
                                tracing::warn!(
                                    node,
                                    "the queue's node did not confirm the declare"
                                );
                            } else {
                                tracing::debug!(node, "a node did not confirm a routing change");
                            }
                        }
                    }
                };
                if tokio::time::timeout(timeout, all).await.is_err() {
                    tracing::warn!("a routing change was not confirmed by every node in time");
                }
            }
            match response.outcome {
                Ok(s) => Ok(Applied {
                    created: s.created,
                    removed: Removed {
                        queues: s.removed_queues,
                        exchanges: s.removed_exchanges,
                    },
                }),
                Err(r) => Err(MetaError::Replicated {
                    code: r.code,
                    text: r.text,
                }),
            }
        })
    }
}

/// Whether `command` changes where a publish goes: which queues and exchanges exist and
/// how they are bound.
fn changes_routing(command: &Command) -> bool {
    matches!(
        command,
        Command::DeclareQueue(_)
            | Command::DeleteQueue { .. }
            | Command::DeclareExchange(_)
            | Command::DeleteExchange { .. }
            | Command::Bind(_)
            | Command::Unbind(_)
    )
}

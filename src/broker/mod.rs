//! The broker domain: metadata snapshots, queue registry, routing and dead-lettering.
//!
//! [`Broker`] is shared by every connection of a node. It is sans-IO: it holds state behind
//! std locks and takes `now` as an argument. Lock order, to rule out deadlock: the metadata
//! writer lock, then the queue registry, then one queue at a time. No queue lock is held while
//! another queue is locked: routing results and dead letters are collected first and
//! published after the lock is released.

pub mod alarm;
pub mod dead_letter;
pub mod direct_reply;
pub mod durability;
pub mod exchange;
pub mod group_commit;
pub mod login_throttle;
pub mod message;
pub mod node_stats;
pub mod outbox;
pub mod queue;
pub mod registry;
pub mod remote;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::Config;
use crate::meta::args::QueueArgs;
use crate::meta::definitions::Definitions;
use crate::meta::state::Applied;
use crate::meta::{Command, MetaError, MetaState, Permission, QueueDef, User, Vhost};
use crate::time::Instant;
use imbl::ordmap::DiffItem;

pub use durability::Durability;
pub use message::Message;
pub use outbox::{ChannelLink, Delivery, OutItem, Outbox};
pub use queue::{Consumer, DeadLetter, Queue, QueueFigures, QueueHandle};
pub use remote::{
    ChannelKey, QueueRef, RemoteConsumer, RemoteLink, RemoteOutcomes, RemoteQueue, Settle,
};

/// How a publish went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PublishOutcome {
    /// Queues the message was routed to.
    pub routed: usize,
    /// Whether some queue refused it (overflow reject-publish): the confirm is a nack.
    pub rejected: bool,
    /// The group-commit ticket its confirm waits for (0: nothing to wait for).
    pub ticket: u64,
    /// The [`RemoteOutcomes`] id its confirm waits for, when it went to queues of other
    /// nodes (0: none).
    pub remote: u64,
}

/// Where durable definitions go after every change that affects them (the runtime writes
/// them to disk with fsync). An error refuses the command that caused it.
pub type DefinitionsSink = Box<dyn Fn(&Definitions) -> Result<(), String> + Send + Sync>;

/// The node's broker state.
pub struct Broker {
    definitions_sink: Option<DefinitionsSink>,
    /// Group commit; `Some` when persistent messages in durable queues are written to disk.
    durability: Option<Arc<Durability>>,
    message_id_prefix: u64,
    next_message_id: AtomicU64,
    saved_definitions: Mutex<Option<Definitions>>,
    meta: Mutex<MetaState>,
    snapshot: RwLock<Arc<MetaState>>,
    version: AtomicU64,
    /// Called once at the next change of the metadata or of the queues running here
    /// ([`Broker::on_next_change`]).
    on_change: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    /// vhost → name → queue; nested so a lookup by `&str` allocates nothing.
    queues: RwLock<HashMap<String, HashMap<String, Arc<QueueHandle>>>>,
    memory: Arc<AtomicI64>,
    memory_high_watermark: u64,
    paging: queue::PagingConfig,
    /// Reads paged messages back; set once storage is open.
    pager: std::sync::OnceLock<Arc<dyn queue::Pager>>,
    rng: Mutex<StdRng>,
    next_conn_id: AtomicU64,
    epoch_unix_ms: u64,
    /// This node's id in the cluster; 0 when not clustered.
    node_id: u64,
    /// Cluster nodes the failure detector considers down, and since when (node clock).
    down_nodes: RwLock<std::collections::BTreeMap<u64, Instant>>,
    /// Whether publishes need the routing lease (a clustered node,
    /// `cluster::routing_lease`); a single node routes by the metadata it owns.
    routing_leased: std::sync::atomic::AtomicBool,
    /// Until when (exclusive, in ms of the node clock) the routing lease runs.
    routing_until: AtomicU64,
    /// Other nodes' resource alarms ([`alarm`] bits), as their heartbeats said.
    peer_alarms: RwLock<std::collections::BTreeMap<u64, u8>>,
    /// Reaches queues of other nodes; set once in cluster mode.
    remote: std::sync::OnceLock<Arc<dyn RemoteLink>>,
    /// Outcomes of publishes forwarded to other nodes.
    remote_outcomes: RemoteOutcomes,
    /// Live connections, channels and consumers, for the admin listings.
    sessions: Arc<registry::Registry>,
    /// The direct reply-to consumers of this node's channels.
    direct_replies: Arc<direct_reply::DirectReplies>,
    /// What the node counts for its Prometheus endpoint.
    metrics: Arc<crate::metrics::Metrics>,
    login_throttle: Mutex<login_throttle::LoginThrottle>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// A broker with the vhosts, users and permissions of `config`.
    ///
    /// `seed` drives server-generated names; `memory_high_watermark` is in bytes;
    /// `epoch_unix_ms` is the wall-clock time at `Instant` 0 (for x-death timestamps).
    pub fn new(
        config: &Config,
        seed: u64,
        memory_high_watermark: u64,
        epoch_unix_ms: u64,
    ) -> Broker {
        let mut meta = MetaState::default();
        let commands = config_commands(config);
        for c in &commands {
            if let Err(e) = meta.apply(c) {
                // The config was validated; a failure here means the config checks missed it.
                tracing::error!(error = %e, command = ?c, "config command refused");
            }
        }
        let snapshot = Arc::new(meta.clone());
        Broker {
            definitions_sink: None,
            durability: None,
            message_id_prefix: seed.rotate_left(17) ^ 0x5741_5252_454e,
            next_message_id: AtomicU64::new(1),
            saved_definitions: Mutex::new(None),
            version: AtomicU64::new(meta.version),
            on_change: Mutex::new(Vec::new()),
            meta: Mutex::new(meta),
            snapshot: RwLock::new(snapshot),
            queues: RwLock::new(HashMap::new()),
            memory: Arc::new(AtomicI64::new(0)),
            memory_high_watermark,
            paging: queue::PagingConfig {
                threshold: (memory_high_watermark as f64 * config.limits.memory_paging_ratio)
                    as u64,
                keep_entries: config.storage.queue_paging_head_messages,
                embed_below: config.storage.queue_index_embed_msgs_below,
            },
            pager: std::sync::OnceLock::new(),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            next_conn_id: AtomicU64::new(1),
            epoch_unix_ms,
            node_id: 0,
            down_nodes: RwLock::new(Default::default()),
            routing_leased: std::sync::atomic::AtomicBool::new(false),
            routing_until: AtomicU64::new(0),
            peer_alarms: RwLock::new(Default::default()),
            remote: std::sync::OnceLock::new(),
            remote_outcomes: RemoteOutcomes::default(),
            sessions: Arc::default(),
            direct_replies: Arc::default(),
            metrics: Arc::default(),
            login_throttle: Mutex::new(login_throttle::LoginThrottle::new(
                config.limits.max_failed_logins,
                config.limits.failed_login_window_ms,
            )),
        }
    }

    /// Failed logins per source address ([`login_throttle`]).
    pub fn login_throttle(&self) -> std::sync::MutexGuard<'_, login_throttle::LoginThrottle> {
        self.login_throttle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Makes this the broker of cluster node `id`: its connection ids carry the id, and it
    /// runs the queues whose home is `id` (before the broker is shared).
    pub fn with_node_id(mut self, id: u64) -> Broker {
        self.node_id = id;
        self
    }

    /// This node's id in the cluster (0: not clustered).
    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    /// Sets the relay that reaches queues of other nodes (cluster mode, once).
    pub fn set_remote_link(&self, link: Arc<dyn RemoteLink>) {
        let _ = self.remote.set(link);
    }

    /// The relay to other nodes (cluster mode).
    pub fn remote_link(&self) -> Option<&Arc<dyn RemoteLink>> {
        self.remote.get()
    }

    /// Outcomes of publishes forwarded to other nodes.
    pub fn remote_outcomes(&self) -> &RemoteOutcomes {
        &self.remote_outcomes
    }

    /// The queue `name` of `vhost` when another live node runs it (and the relay is set).
    pub fn remote_queue(&self, vhost: &str, name: &str) -> Option<Arc<RemoteQueue>> {
        let link = self.remote.get()?;
        let snapshot = self.snapshot();
        let def = snapshot.vhost(vhost)?.queues.get(name)?;
        if def.home == self.node_id || self.node_is_down(def.home) {
            return None;
        }
        Some(Arc::new(RemoteQueue {
            node: def.home,
            vhost: vhost.to_string(),
            name: name.to_string(),
            instance: 0,
            link: link.clone(),
        }))
    }

    /// From now on this node routes publishes only under the routing lease, which
    /// [`Broker::extend_routing_lease`] renews (`cluster::routing_lease`).
    pub fn require_routing_lease(&self) {
        self.routing_leased.store(true, Ordering::Release);
    }

    /// The routing lease runs until `until` (exclusive); never shortened.
    pub fn extend_routing_lease(&self, until: Instant) {
        self.routing_until
            .fetch_max(until.as_millis(), Ordering::AcqRel);
    }

    /// Whether this node may route a publish at `now`: a single node always; a clustered
    /// one while its routing lease runs (its metadata is recent).
    pub fn routes_at(&self, now: Instant) -> bool {
        !self.routing_leased.load(Ordering::Acquire)
            || now.as_millis() < self.routing_until.load(Ordering::Acquire)
    }

    /// Records which cluster nodes the failure detector considers down at `now`.
    pub fn set_down_nodes(&self, down: std::collections::BTreeSet<u64>, now: Instant) {
        let mut nodes = self.down_nodes.write().unwrap_or_else(|e| e.into_inner());
        nodes.retain(|id, _| down.contains(id));
        for id in down {
            nodes.entry(id).or_insert(now);
        }
    }

    /// Whether the failure detector considers cluster node `id` down.
    pub fn node_is_down(&self, id: u64) -> bool {
        self.down_since(id).is_some()
    }

    /// Since when the failure detector has considered cluster node `id` down (this time).
    pub fn down_since(&self, id: u64) -> Option<Instant> {
        self.down_nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }

    /// The node's live connections, channels and consumers, which sessions register.
    pub fn sessions(&self) -> &Arc<registry::Registry> {
        &self.sessions
    }

    /// What the node counts for its Prometheus endpoint.
    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// Whether free disk space is below `disk_free_limit_bytes` (as last measured).
    pub fn disk_alarm(&self) -> bool {
        self.metrics.disk_alarm.load(Ordering::Relaxed) != 0
    }

    /// The memory high watermark, in bytes.
    pub fn memory_high_watermark(&self) -> u64 {
        self.memory_high_watermark
    }

    /// Sets what reads paged messages back, for existing and future queues (once, when
    /// storage is open).
    pub fn set_pager(&self, pager: Arc<dyn queue::Pager>) {
        if self.pager.set(pager.clone()).is_ok() {
            for h in self.all_queues() {
                h.lock().set_pager(pager.clone());
            }
        }
    }

    /// Installs the sink durable definitions are written to (before the broker is shared).
    pub fn with_definitions_sink(mut self, sink: DefinitionsSink) -> Broker {
        self.definitions_sink = Some(sink);
        self
    }

    /// Makes durable queues record persistent messages for the syncer (storage on).
    pub fn with_durability(mut self, durability: Arc<Durability>) -> Broker {
        self.durability = Some(durability);
        self
    }

    /// The group-commit state, when storage is on.
    pub fn durability(&self) -> Option<&Arc<Durability>> {
        self.durability.as_ref()
    }

    /// A node-unique message id (a per-boot random prefix and a counter).
    pub fn next_message_id(&self) -> u128 {
        ((self.message_id_prefix as u128) << 64)
            | self.next_message_id.fetch_add(1, Ordering::Relaxed) as u128
    }

    /// Replaces a declared queue's state with one recovered from disk.
    pub fn install_recovered_queue(
        &self,
        vhost: &str,
        name: &str,
        queue: Queue,
    ) -> Option<Arc<QueueHandle>> {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        let slot = queues.get_mut(vhost)?.get_mut(name)?;
        let handle = QueueHandle::new(vhost, name, queue);
        *slot = handle.clone();
        Some(handle)
    }

    /// Wall-clock milliseconds (Unix) at the broker's `Instant` 0. Storage writes expiry
    /// times as wall-clock values, since the monotonic origin changes with every start.
    pub fn epoch_unix_ms(&self) -> u64 {
        self.epoch_unix_ms
    }

    /// A fresh connection id, unique in the cluster: the node id above bit 40 (see
    /// [`crate::meta::owner_node`]), so an exclusive queue's owner names its node.
    pub fn next_connection_id(&self) -> u64 {
        (self.node_id << 40) | self.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The current metadata snapshot.
    pub fn snapshot(&self) -> Arc<MetaState> {
        self.snapshot
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The version of the current snapshot; cheap to poll.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Counts `delta` bytes of messages held for other nodes' queues (publishes forwarded
    /// to a queue's node until it answers, dead letters until their queue's node has taken
    /// them) in [`Broker::memory_used`], so the memory alarm sees a node link that stopped
    /// draining.
    pub fn count_relayed(&self, delta: i64) {
        self.memory.fetch_add(delta, Ordering::Relaxed);
    }

    /// Message bytes held by queues, and by the relay for other nodes' queues.
    pub fn memory_used(&self) -> u64 {
        self.memory.load(Ordering::Relaxed).max(0) as u64
    }

    /// Whether memory use is above the high watermark (publishers must be blocked).
    pub fn memory_alarm(&self) -> bool {
        self.memory_used() > self.memory_high_watermark
    }

    /// This node's resource alarms ([`alarm`] bits).
    pub fn local_alarms(&self) -> u8 {
        let mut bits = 0;
        if self.memory_alarm() {
            bits |= alarm::MEMORY;
        }
        if self.disk_alarm() {
            bits |= alarm::DISK;
        }
        bits
    }

    /// Records the other nodes' resource alarms (their last heartbeats').
    pub fn set_peer_alarms(&self, alarms: std::collections::BTreeMap<u64, u8>) {
        *self.peer_alarms.write().unwrap_or_else(|e| e.into_inner()) = alarms;
    }

    /// The alarms of other nodes that are up (a node recorded down no longer counts), by
    /// node id; nodes without an alarm are left out.
    pub fn peer_alarms(&self) -> std::collections::BTreeMap<u64, u8> {
        let alarms = self.peer_alarms.read().unwrap_or_else(|e| e.into_inner());
        alarms
            .iter()
            .filter(|(id, bits)| **bits != 0 && **id != self.node_id && !self.node_is_down(**id))
            .map(|(id, bits)| (*id, *bits))
            .collect()
    }

    /// Whether another node that is up has a resource alarm: as in RabbitMQ, publishers
    /// on every node are blocked then (`rabbit_alarm` is cluster-wide).
    pub fn remote_alarm(&self) -> bool {
        !self.peer_alarms().is_empty()
    }

    /// A fresh salt for a password hash ([`User::hash_password`]), from the broker's
    /// generator (seeded from the OS by the runtime).
    pub fn new_salt(&self) -> [u8; 4] {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).gen()
    }

    /// A server-generated queue name, `amq.gen-` and 22 URL-safe base64 characters.
    pub fn generate_queue_name(&self) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        let s: String = (0..22)
            .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
            .collect();
        format!("amq.gen-{s}")
    }

    /// A server-generated consumer tag.
    pub fn generate_consumer_tag(&self) -> String {
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        format!(
            "amq.ctag-{:016x}{:06x}",
            rng.gen::<u64>(),
            rng.gen::<u32>() & 0xff_ffff
        )
    }

    /// The queue `name` in `vhost`.
    pub fn queue(&self, vhost: &str, name: &str) -> Option<Arc<QueueHandle>> {
        self.queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(vhost)
            .and_then(|v| v.get(name))
            .cloned()
    }

    /// Every queue handle, sorted by (vhost, name).
    pub fn all_queues(&self) -> Vec<Arc<QueueHandle>> {
        let mut v: Vec<_> = self
            .queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flat_map(|v| v.values().cloned())
            .collect();
        v.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        v
    }

    /// Applies a metadata command, creating or tearing down queue state to match.
    pub fn apply(&self, command: &Command, now: Instant) -> Result<Applied, MetaError> {
        let mut meta = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        // Only commands that can change durable definitions pay for recomputing them.
        let before = self
            .definitions_sink
            .as_ref()
            .filter(|_| may_touch_durable(command))
            .map(|_| meta.clone());
        let applied = meta.apply(command)?;
        if let (Some(sink), Some(before)) = (&self.definitions_sink, before) {
            // Durable definitions are on disk before the client hears declare-ok; if they
            // cannot be written the command is undone and refused.
            let defs = Definitions::from_state(&meta);
            let mut saved = self
                .saved_definitions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if saved.as_ref() != Some(&defs) {
                if let Err(e) = sink(&defs) {
                    *meta = before;
                    return Err(MetaError::Storage(e));
                }
                *saved = Some(defs);
            }
        }
        let mut dead = Vec::new();
        {
            let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
            for part in command.parts() {
                let Command::DeclareQueue(def) = part else {
                    continue;
                };
                // New here, and not deleted again later in the same batch.
                let exists = meta
                    .vhost(&def.vhost)
                    .is_some_and(|v| v.queues.contains_key(&def.name));
                let runs = queues
                    .get(&def.vhost)
                    .is_some_and(|m| m.contains_key(&def.name));
                if exists && !runs {
                    let args = match meta.vhost(&def.vhost) {
                        Some(v) => def.effective_args(v)?,
                        None => def.args()?,
                    };
                    queues
                        .entry(def.vhost.clone())
                        .or_default()
                        .insert(def.name.clone(), self.new_queue(def, args, now));
                }
            }
            for (vhost, name) in &applied.removed.queues {
                if let Some(h) = queues.get_mut(vhost).and_then(|v| v.remove(name)) {
                    h.lock().delete(&h);
                    self.metrics.queues_deleted.inc();
                }
            }
            // A policy change reshapes every live queue of its vhost.
            let mut policy_vhosts: Vec<&str> = command
                .parts()
                .iter()
                .filter_map(|part| match part {
                    Command::SetPolicy { policy, .. } => Some(policy.vhost.as_str()),
                    Command::ClearPolicy { vhost, .. } => Some(vhost.as_str()),
                    _ => None,
                })
                .collect();
            policy_vhosts.sort_unstable();
            policy_vhosts.dedup();
            for (vname, v) in policy_vhosts
                .into_iter()
                .filter_map(|n| meta.vhost(n).map(|v| (n, v)))
            {
                for (name, def) in &v.queues {
                    let Some(h) = queues.get(vname).and_then(|m| m.get(name)) else {
                        continue;
                    };
                    match def.effective_args(v) {
                        Ok(args) => {
                            let mut letters = Vec::new();
                            h.lock().set_args(args, &mut letters);
                            if !letters.is_empty() {
                                dead.push((h.clone(), letters));
                            }
                        }
                        Err(e) => tracing::warn!(queue = %name, error = %e, "policy not applied"),
                    }
                }
            }
        }
        *self.snapshot.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(meta.clone());
        self.version.store(meta.version, Ordering::Release);
        drop(meta);
        self.changed();
        // Messages a new length limit dropped, routed through the new metadata.
        for (handle, letters) in dead {
            self.dead_letter(&handle, letters, now);
        }
        Ok(applied)
    }

    /// A queue's runtime state, with its arguments combined with its effective policy.
    fn new_queue(&self, def: &QueueDef, args: QueueArgs, now: Instant) -> Arc<QueueHandle> {
        self.metrics.queues_created.inc();
        let mut q = Queue::new(
            args,
            def.exclusive_owner,
            def.auto_delete,
            self.memory.clone(),
            now,
        );
        if let Some(d) = &self.durability {
            // Every queue can page; only durable ones keep persistent messages.
            let durable = def.durable && def.exclusive_owner.is_none();
            q = q.with_persistence(d.clone(), durable, self.paging);
            if let Some(p) = self.pager.get() {
                q.set_pager(p.clone());
            }
        }
        QueueHandle::new(&def.vhost, &def.name, q)
    }

    /// Takes `state`, the metadata as the cluster's Raft group has applied it, in place of
    /// the broker's own, and brings the queues this node runs in line with it: queues homed
    /// here that are new get their runtime state, queues that are gone (or moved) are torn
    /// down, and a vhost whose policies changed reshapes its live queues.
    ///
    /// Vhosts the new state shares (by pointer) with the previous one are skipped, so a
    /// command costs the queues of the vhost it touched, not of the whole broker. Several
    /// applied commands may arrive as one state: only the result matters.
    pub fn follow(&self, state: Arc<MetaState>, now: Instant) {
        let mut meta = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        let old = std::mem::replace(&mut *meta, (*state).clone());
        let home = self.node_id;
        let mut dead = Vec::new();
        {
            let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
            // Vhosts that went, with every queue in them.
            let gone: Vec<String> = queues
                .keys()
                .filter(|v| !state.vhosts.contains_key(*v))
                .cloned()
                .collect();
            for vname in gone {
                for (_, h) in queues.remove(&vname).unwrap_or_default() {
                    h.lock().delete(&h);
                    self.metrics.queues_deleted.inc();
                }
            }
            for (vname, v) in &state.vhosts {
                let before = old.vhosts.get(vname);
                if before.is_some_and(|b| Arc::ptr_eq(b, v)) {
                    continue;
                }
                let reshaped = before.is_none_or(|b| {
                    b.policies != v.policies || b.operator_policies != v.operator_policies
                });
                let args_of = |name: &str, def: &QueueDef| match def.effective_args(v) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        // Validated when declared; a policy may still make it invalid.
                        tracing::warn!(queue = %name, error = %e, "policy not applied");
                        def.args().ok()
                    }
                };
                let local = queues.entry(vname.clone()).or_default();
                // The queues that changed: the persistent maps share what did not, so the
                // walk costs the changes, not the vhost's size.
                let changed: Vec<(&String, Option<&QueueDef>)> = match before {
                    Some(b) => b
                        .queues
                        .diff(&v.queues)
                        .map(|d| match d {
                            DiffItem::Add(k, def) => (k, Some(def)),
                            DiffItem::Update { new: (k, def), .. } => (k, Some(def)),
                            DiffItem::Remove(k, _) => (k, None),
                        })
                        .collect(),
                    None => v.queues.iter().map(|(k, d)| (k, Some(d))).collect(),
                };
                for (name, def) in changed {
                    match def.filter(|d| d.home == home) {
                        None => {
                            if let Some(h) = local.remove(name) {
                                tracing::debug!(vhost = %vname, queue = %name, moved = def.is_some(), "queue no longer runs here");
                                if def.is_some() {
                                    // Moved to another node: its consumers follow it.
                                    h.lock().move_away(&h);
                                } else {
                                    h.lock().delete(&h);
                                    self.metrics.queues_deleted.inc();
                                }
                            }
                        }
                        Some(def) => {
                            // A queue that moved here (a mirror promoted) is not created
                            // empty: the mirror runtime adopts this node's copy
                            // ([`Broker::adopt_queue`]) once it holds everything. The same
                            // queue, that is: one deleted and declared again in between
                            // (several commands can arrive as one state) is another
                            // incarnation, new here, whatever node the old one lived on.
                            let key = (vname.clone(), name.clone());
                            let incarnation =
                                |s: &MetaState| s.mirror_sets.get(&key).map(|m| m.incarnation);
                            let moved_in = self.durability.is_some()
                                && def.exclusive_owner.is_none()
                                && before
                                    .and_then(|b| b.queues.get(name))
                                    .is_some_and(|old| old.home != home)
                                && incarnation(&old).is_some()
                                && incarnation(&old) == incarnation(&state);
                            if !local.contains_key(name) && !moved_in {
                                if let Some(args) = args_of(name, def) {
                                    tracing::debug!(vhost = %vname, queue = %name, "queue runs here");
                                    local.insert(name.clone(), self.new_queue(def, args, now));
                                }
                            }
                        }
                    }
                }
                if reshaped && before.is_some() {
                    for (name, h) in local.iter() {
                        if let Some(args) = v.queues.get(name).and_then(|d| args_of(name, d)) {
                            let mut letters = Vec::new();
                            h.lock().set_args(args, &mut letters);
                            if !letters.is_empty() {
                                dead.push((h.clone(), letters));
                            }
                        }
                    }
                }
            }
        }
        self.version.store(meta.version, Ordering::Release);
        *self.snapshot.write().unwrap_or_else(|e| e.into_inner()) = state;
        drop(meta);
        self.changed();
        // Messages a new length limit dropped, routed through the new metadata.
        for (handle, letters) in dead {
            self.dead_letter(&handle, letters, now);
        }
    }

    /// Calls `f` once, at the next change of the metadata snapshot or of the queues running
    /// here (a promoted queue adopted), so a driver can wait for a queue to appear without
    /// polling. `f` runs under the broker's locks: it must only signal (wake a task).
    pub fn on_next_change(&self, f: Box<dyn FnOnce() + Send>) {
        self.on_change
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(f);
    }

    fn changed(&self) {
        let waiting =
            std::mem::take(&mut *self.on_change.lock().unwrap_or_else(|e| e.into_inner()));
        for f in waiting {
            f();
        }
    }

    /// Promotion: makes the queue `vhost/name`, which moved to this node, serve here. `fill`
    /// puts this node's copy of its messages into the new queue before anyone can reach it.
    /// Returns `None` (and changes nothing) when the queue is no longer homed here or
    /// already runs.
    pub fn adopt_queue<E>(
        &self,
        vhost: &str,
        name: &str,
        now: Instant,
        fill: impl FnOnce(&Arc<QueueHandle>) -> Result<(), E>,
    ) -> Option<Result<Arc<QueueHandle>, E>> {
        let state = self.snapshot();
        let v = state.vhosts.get(vhost)?;
        let def = v.queues.get(name).filter(|d| d.home == self.node_id)?;
        let args = def.effective_args(v).or_else(|_| def.args()).ok()?;
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        let local = queues.entry(vhost.to_string()).or_default();
        if local.contains_key(name) {
            return None;
        }
        let handle = self.new_queue(def, args, now);
        if let Err(e) = fill(&handle) {
            return Some(Err(e));
        }
        local.insert(name.to_string(), handle.clone());
        drop(queues);
        self.changed();
        Some(Ok(handle))
    }

    /// Routes and enqueues a message. `vhost` is the caller's snapshot of the vhost.
    pub fn publish(
        &self,
        vhost: &Vhost,
        exchange: &str,
        message: Arc<Message>,
        now: Instant,
    ) -> PublishOutcome {
        self.publish_with_bcc(vhost, exchange, message, &[], now)
    }

    /// [`Broker::publish`], also routed by `bcc`: the keys of the `BCC` header the
    /// publisher's channel removed from the message (RabbitMQ's sender-selected
    /// distribution: blind-copy keys route but are not delivered).
    pub fn publish_with_bcc(
        &self,
        vhost: &Vhost,
        exchange: &str,
        message: Arc<Message>,
        bcc: &[String],
        now: Instant,
    ) -> PublishOutcome {
        if !self.routes_at(now) {
            // The node's metadata may be behind a routing change already answered (a queue
            // deleted and declared again elsewhere): routing by it could confirm into a
            // deleted queue. A nack, and no return: the message was not judged unroutable.
            return PublishOutcome {
                rejected: true,
                ..PublishOutcome::default()
            };
        }
        if exchange.is_empty() {
            // Never counted as routed, as in RabbitMQ (see `deliver_replies`).
            self.deliver_replies(&message, bcc);
        }
        let targets = exchange::route(
            vhost,
            exchange,
            &message.routing_key,
            message.properties.headers().as_ref(),
            bcc,
        );
        let mut outcome = PublishOutcome::default();
        let mut dead = Vec::new();
        let mut remote: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
        for name in &targets {
            let Some(handle) = self.queue(&vhost.name, name) else {
                if let Some(def) = vhost.queues.get(name) {
                    outcome.routed += 1;
                    if def.home != self.node_id && self.remote.get().is_some() {
                        // Another node runs it: forwarded below, one message per node.
                        remote.entry(def.home).or_default().push(name.clone());
                    } else {
                        // Its node is unknown or the queue is going away: a nack, never an
                        // ack for a message no queue took.
                        outcome.rejected = true;
                    }
                }
                continue;
            };
            let r = handle.lock().publish(&handle, message.clone(), now);
            outcome.routed += 1;
            if !r.accepted {
                outcome.rejected = true;
            }
            outcome.ticket = outcome.ticket.max(r.ticket);
            if !r.dead.is_empty() {
                dead.push((handle.clone(), r.dead));
            }
        }
        for (handle, letters) in dead {
            self.dead_letter(&handle, letters, now);
        }
        if let (Some(link), false) = (self.remote.get(), remote.is_empty()) {
            let id = self.remote_outcomes.issue(remote.len() as u32);
            for (node, queues) in remote {
                link.publish(node, &vhost.name, queues, message.clone(), id);
            }
            outcome.remote = id;
        }
        outcome
    }

    /// Enqueues a message forwarded by another node into queues of this one (already
    /// routed there). Returns whether every queue took it and the group-commit ticket to
    /// wait for before saying so.
    pub fn publish_forwarded(
        &self,
        vhost: &str,
        queues: &[String],
        message: Arc<Message>,
        now: Instant,
    ) -> (bool, u64) {
        let mut taken = true;
        let mut ticket = 0;
        let mut dead = Vec::new();
        for name in queues {
            let Some(handle) = self.queue(vhost, name) else {
                // Deleted meanwhile (or not ours any more).
                taken = false;
                continue;
            };
            let r = handle.lock().publish(&handle, message.clone(), now);
            taken &= r.accepted;
            ticket = ticket.max(r.ticket);
            if !r.dead.is_empty() {
                dead.push((handle.clone(), r.dead));
            }
        }
        for (handle, letters) in dead {
            self.dead_letter(&handle, letters, now);
        }
        (taken, ticket)
    }

    /// Republishes dead letters of `from` to its dead-letter exchange. A letter's source
    /// ack ([`DeadLetter::held`]) is recorded once every queue it is routed to has it: for
    /// another node's queue, when the home node answered; for this node's, in a cluster,
    /// once the group-commit round that writes it is durable (sent again if the round is
    /// voided: the queue's master deposed before the lap), and at once on a single node.
    pub fn dead_letter(&self, from: &Arc<QueueHandle>, letters: Vec<DeadLetter>, now: Instant) {
        let mut written = Vec::new();
        self.dead_letter_hops(from, letters, now, &mut written);
        if let (Some(link), false) = (self.remote.get(), written.is_empty()) {
            link.dead_letters_written(written);
        }
    }

    fn dead_letter_hops(
        &self,
        from: &Arc<QueueHandle>,
        letters: Vec<DeadLetter>,
        now: Instant,
        written: &mut Vec<dead_letter::WrittenLetter>,
    ) {
        let mut work = vec![(from.clone(), letters)];
        // Each round is one hop; bounded so a misconfigured DLX cycle cannot spin.
        for _ in 0..16 {
            let Some((queue, letters)) = work.pop() else {
                return;
            };
            let holds = |letters: Vec<DeadLetter>| {
                letters
                    .into_iter()
                    .map(|l| (dead_letter::LetterHold::new(&queue, l.held.clone()), l))
            };
            let (dlx, dlrk) = {
                let q = queue.lock();
                let a = q.args();
                (
                    a.dead_letter_exchange.clone(),
                    a.dead_letter_routing_key.clone(),
                )
            };
            let snapshot = self.snapshot();
            let vhost = snapshot.vhost(&queue.vhost);
            let (Some(dlx), Some(vhost)) = (dlx, vhost) else {
                // Nowhere to go: dropped, as RabbitMQ drops them.
                holds(letters).for_each(|(hold, _)| hold.taken());
                continue;
            };
            if !vhost.exchanges.contains_key(&dlx) {
                holds(letters).for_each(|(hold, _)| hold.taken());
                continue;
            }
            for (hold, letter) in holds(letters) {
                let wall_ms = self.epoch_unix_ms + now.as_millis();
                let message = dead_letter::rewrite(
                    &letter,
                    &queue.name,
                    &dlx,
                    dlrk.as_deref(),
                    wall_ms,
                    self.next_message_id(),
                );
                let targets = exchange::route(
                    vhost,
                    &dlx,
                    &message.routing_key,
                    message.properties.headers().as_ref(),
                    &[],
                );
                let message = Arc::new(message);
                if dlx.is_empty() {
                    // RabbitMQ dead-letters through the same routing as a publish.
                    self.deliver_replies(&message, &[]);
                }
                for name in targets {
                    if dead_letter::is_cycle(&message, &name) {
                        continue;
                    }
                    let Some(handle) = self.queue(&vhost.name, &name) else {
                        // A queue another node runs: forwarded there, and again until its
                        // node has taken it; the source ack waits for that (RabbitMQ's
                        // classic queues send and forget). So is one recorded as this
                        // node's that does not run here yet (a mirror promoted here, not
                        // adopted yet): dropping the letter would ack a message no queue
                        // holds.
                        if let (Some(link), Some(_)) = (self.remote.get(), vhost.queues.get(&name))
                        {
                            link.dead_letter(&vhost.name, name, message.clone(), hold.clone());
                        }
                        continue;
                    };
                    let r = handle.lock().publish(&handle, message.clone(), now);
                    if r.accepted && r.ticket != 0 && self.remote.get().is_some() {
                        written.push(dead_letter::WrittenLetter {
                            vhost: vhost.name.clone(),
                            queue: name.clone(),
                            message: message.clone(),
                            hold: hold.clone(),
                            ticket: r.ticket,
                        });
                    }
                    if !r.dead.is_empty() {
                        work.push((handle.clone(), r.dead));
                    }
                }
                hold.taken();
            }
        }
        // Past the bound: what is left is dropped.
        for (queue, letters) in work {
            for l in letters {
                dead_letter::LetterHold::new(&queue, l.held).taken();
            }
        }
    }

    /// Puts a dead letter forwarded again ([`RemoteLink::dead_letter`]) into this node's
    /// queue `name`, now that the queue lives here (a mirror promoted on this node): the
    /// group-commit ticket that writes it (0: none), or `None` when this node does not run
    /// the queue (yet).
    pub fn dead_letter_here(
        &self,
        vhost: &str,
        name: &str,
        message: Arc<Message>,
        now: Instant,
    ) -> Option<u64> {
        let handle = self.queue(vhost, name)?;
        let r = handle.lock().publish(&handle, message, now);
        if !r.dead.is_empty() {
            self.dead_letter(&handle, r.dead, now);
        }
        Some(if r.accepted { r.ticket } else { 0 })
    }

    /// Periodic work: message TTL at queue heads. Returns the commands that delete queues
    /// whose `x-expires` passed, for the caller to commit.
    pub fn tick(&self, now: Instant) -> Vec<Command> {
        let mut expired = Vec::new();
        for handle in self.all_queues() {
            let mut dead = Vec::new();
            {
                let mut q = handle.lock();
                q.tick(&handle, now, &mut dead);
                if q.is_expired(now) {
                    expired.push((handle.vhost.clone(), handle.name.clone()));
                }
            }
            if !dead.is_empty() {
                self.dead_letter(&handle, dead, now);
            }
        }
        expired
            .into_iter()
            .map(|(vhost, name)| Command::DeleteQueue { vhost, name })
            .collect()
    }
}

/// The salt of a configured user's password hash: derived from its name and password.
fn config_salt(name: &str, password: &str) -> [u8; 4] {
    use sha2::Digest;
    let d = sha2::Sha256::new()
        .chain_update(name.as_bytes())
        .chain_update([0])
        .chain_update(password.as_bytes())
        .finalize();
    [d[0], d[1], d[2], d[3]]
}

/// The config's vhosts, users and permissions as metadata commands: applied by a single
/// node at start, proposed once by the node that creates a cluster.
pub fn config_commands(config: &Config) -> Vec<Command> {
    let mut c: Vec<Command> = config
        .vhosts
        .iter()
        .map(|v| Command::AddVhost {
            name: v.name.clone(),
        })
        .collect();
    c.extend(config.users.iter().map(|u| {
        Command::PutUser(User {
            name: u.name.clone(),
            // Salted from the user itself, so every start stores the same hash (the file
            // holds the password anyway).
            password: User::hash_password(&u.password, config_salt(&u.name, &u.password)),
            tags: u.tags.clone(),
        })
    }));
    c.extend(config.permissions.iter().map(|p| {
        Command::SetPermissions(Permission {
            user: p.user.clone(),
            vhost: p.vhost.clone(),
            configure: p.configure.clone(),
            write: p.write.clone(),
            read: p.read.clone(),
        })
    }));
    c
}

/// Whether applying `command` can change the durable definitions.
fn may_touch_durable(command: &Command) -> bool {
    match command {
        Command::Batch(commands) => commands.iter().any(may_touch_durable),
        Command::DeclareQueue(def) => def.durable && def.exclusive_owner.is_none(),
        Command::DeclareExchange(def) => def.durable,
        Command::DeleteExclusiveQueues { .. } => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::reply_code::AmqpError;
    use crate::meta::QueueDef;
    use amq_protocol::types::FieldTable;

    fn durable_queue(name: &str) -> Command {
        Command::DeclareQueue(QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: FieldTable::default(),
            home: 0,
        })
    }

    fn max_length_policy(n: i64) -> Command {
        use crate::meta::policy::{ApplyTo, Policy, PolicyValue};
        Command::SetPolicy {
            policy: Policy {
                vhost: "/".into(),
                name: "cap".into(),
                pattern: "^capped".into(),
                compiled: Default::default(),
                apply_to: ApplyTo::Queues,
                priority: 1,
                definition: [("max-length".to_string(), PolicyValue::Int(n))].into(),
            },
            operator: false,
        }
    }

    /// A policy `max-length: 1` with `overflow` for the queues matching `pattern`.
    fn x_overflow_policy(overflow: &str, pattern: &str) -> Command {
        use crate::meta::policy::{ApplyTo, Policy, PolicyValue};
        Command::SetPolicy {
            policy: Policy {
                vhost: "/".into(),
                name: "overflow".into(),
                pattern: pattern.into(),
                compiled: Default::default(),
                apply_to: ApplyTo::Queues,
                priority: 2,
                definition: [
                    ("max-length".to_string(), PolicyValue::Int(1)),
                    ("overflow".to_string(), PolicyValue::Str(overflow.into())),
                ]
                .into(),
            },
            operator: false,
        }
    }

    fn publish_n(broker: &Broker, queue: &str, n: usize) {
        use amq_protocol::protocol::basic::AMQPProperties;
        for i in 0..n {
            let snap = broker.snapshot();
            let m = Arc::new(Message {
                id: broker.next_message_id(),
                exchange: String::new(),
                routing_key: queue.into(),
                properties_raw: bytes::Bytes::from_static(&[0, 0]),
                properties: AMQPProperties::default(),
                body: bytes::Bytes::from(format!("m{i}")),
            });
            broker.publish(snap.vhost("/").unwrap(), "", m, Instant::default());
        }
    }

    #[test]
    fn setting_and_clearing_a_policy_reshapes_live_queues() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        broker
            .apply(&durable_queue("capped.q"), Instant::default())
            .unwrap();
        broker
            .apply(&durable_queue("free.q"), Instant::default())
            .unwrap();
        broker
            .apply(&max_length_policy(2), Instant::default())
            .unwrap();
        publish_n(&broker, "capped.q", 5);
        publish_n(&broker, "free.q", 5);
        let count = |q: &str| broker.queue("/", q).unwrap().lock().message_count();
        assert_eq!(
            (count("capped.q"), count("free.q")),
            (2, 5),
            "only matching queues are capped"
        );
        // A queue declared after the policy gets it too.
        broker
            .apply(&durable_queue("capped.late"), Instant::default())
            .unwrap();
        publish_n(&broker, "capped.late", 4);
        assert_eq!(count("capped.late"), 2);
        broker
            .apply(
                &Command::ClearPolicy {
                    vhost: "/".into(),
                    name: "cap".into(),
                    operator: false,
                },
                Instant::default(),
            )
            .unwrap();
        publish_n(&broker, "capped.q", 3);
        assert_eq!(count("capped.q"), 5, "the limit went with the policy");
    }

    /// As RabbitMQ's `init_max_length`: a new drop-head limit drops the oldest messages at
    /// once, and they are dead-lettered; a reject-publish limit keeps what is there.
    #[test]
    fn a_new_length_limit_drops_from_the_head_at_once_and_dead_letters() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        let mut args = FieldTable::default();
        for (k, v) in [
            ("x-dead-letter-exchange", ""),
            ("x-dead-letter-routing-key", "dlq"),
        ] {
            args.insert(
                k.into(),
                amq_protocol::types::AMQPValue::LongString(v.into()),
            );
        }
        for (name, arguments) in [
            ("dlq", FieldTable::default()),
            ("capped.q", args),
            ("capped.r", FieldTable::default()),
        ] {
            let declare = Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable: false,
                exclusive_owner: None,
                auto_delete: false,
                arguments,
                home: 0,
            });
            broker.apply(&declare, Instant::default()).unwrap();
        }
        publish_n(&broker, "capped.q", 5);
        let mut reject = x_overflow_policy("reject-publish", "^capped\\.r");
        publish_n(&broker, "capped.r", 5);
        broker.apply(&reject, Instant::default()).unwrap();
        broker
            .apply(&max_length_policy(2), Instant::default())
            .unwrap();
        let count = |q: &str| broker.queue("/", q).unwrap().lock().message_count();
        assert_eq!(
            (count("capped.q"), count("dlq"), count("capped.r")),
            (2, 3, 5),
            "drop-head trims and dead-letters; reject-publish keeps"
        );
        let mut dead = Vec::new();
        let first =
            broker
                .queue("/", "dlq")
                .unwrap()
                .lock()
                .get(Instant::default(), true, &mut dead);
        assert_eq!(
            first.map(|(e, _)| e.message.body.clone()),
            Some(bytes::Bytes::from("m0"))
        );
        // The policy's own drop-head applies as its limit rises and falls.
        if let Command::SetPolicy { policy, .. } = &mut reject {
            policy.definition.insert(
                "overflow".into(),
                crate::meta::policy::PolicyValue::Str("drop-head".into()),
            );
        }
        broker.apply(&reject, Instant::default()).unwrap();
        assert_eq!(count("capped.r"), 1);
    }

    #[test]
    fn an_invalid_policy_is_refused_and_changes_nothing() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        let before = broker.snapshot();
        let err = broker
            .apply(&max_length_policy(-3), Instant::default())
            .unwrap_err();
        assert!(matches!(err, MetaError::Invalid(_)), "{err:?}");
        assert_eq!(*broker.snapshot(), *before);
    }

    #[test]
    fn policies_are_durable_definitions() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        broker
            .apply(&max_length_policy(3), Instant::default())
            .unwrap();
        broker
            .apply(&durable_queue("capped.q"), Instant::default())
            .unwrap();
        let defs = Definitions::from_state(&broker.snapshot());
        assert_eq!(defs.policies.len(), 1);
        let restored = Broker::new(&Config::default(), 2, 1 << 30, 0);
        for c in Definitions::decode(&defs.encode()).unwrap().commands() {
            restored.apply(&c, Instant::default()).unwrap();
        }
        publish_n(&restored, "capped.q", 6);
        assert_eq!(
            restored
                .queue("/", "capped.q")
                .unwrap()
                .lock()
                .message_count(),
            3
        );
    }

    #[test]
    fn a_definition_that_cannot_be_stored_is_refused_and_undone() {
        let config = Config::default();
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = fail.clone();
        let broker =
            Broker::new(&config, 1, 1 << 30, 0).with_definitions_sink(Box::new(move |_| {
                if f.load(Ordering::SeqCst) {
                    Err("disk full".into())
                } else {
                    Ok(())
                }
            }));
        broker
            .apply(&durable_queue("kept"), Instant::default())
            .unwrap();
        fail.store(true, Ordering::SeqCst);
        let err = broker
            .apply(&durable_queue("lost"), Instant::default())
            .unwrap_err();
        assert!(matches!(err, MetaError::Storage(_)));
        assert_eq!(
            AmqpError::from(err).code,
            crate::amqp::ReplyCode::InternalError
        );
        let snap = broker.snapshot();
        let v = snap.vhost("/").unwrap();
        assert!(v.queues.contains_key("kept"));
        assert!(
            !v.queues.contains_key("lost"),
            "the refused declare left no trace"
        );
        assert!(broker.queue("/", "lost").is_none());
    }

    /// A definitions import's batch: every queue runs, the policy in it shapes them, the
    /// durable definitions are written once; a batch with a refused command leaves no
    /// trace of any of its commands.
    #[test]
    fn a_batch_applies_as_one_command_or_not_at_all() {
        let writes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let w = writes.clone();
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0).with_definitions_sink(
            Box::new(move |_| {
                w.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }),
        );
        let batch = Command::Batch(vec![
            durable_queue("capped.a"),
            max_length_policy(2),
            durable_queue("capped.b"),
            durable_queue("gone"),
            Command::DeleteQueue {
                vhost: "/".into(),
                name: "gone".into(),
            },
        ]);
        let applied = broker.apply(&batch, Instant::default()).unwrap();
        assert!(applied.created);
        assert_eq!(writes.load(Ordering::SeqCst), 1, "one definitions write");
        for q in ["capped.a", "capped.b"] {
            publish_n(&broker, q, 5);
            let h = broker.queue("/", q).expect("the queue runs");
            assert_eq!(h.lock().message_count(), 2, "{q} has the batch's policy");
        }
        assert!(broker.queue("/", "gone").is_none());
        let version = broker.snapshot().version;
        let refused = Command::Batch(vec![
            durable_queue("never"),
            Command::DeleteQueue {
                vhost: "/".into(),
                name: "no-such-queue".into(),
            },
        ]);
        assert!(broker.apply(&refused, Instant::default()).is_err());
        let snap = broker.snapshot();
        assert_eq!(snap.version, version, "nothing applied");
        assert!(!snap.vhost("/").unwrap().queues.contains_key("never"));
        assert!(broker.queue("/", "never").is_none());
        assert_eq!(writes.load(Ordering::SeqCst), 1);
    }

    /// A mirrored queue promoted to this node is not created empty (the mirror runtime
    /// adopts its copy); one deleted and declared again here, even when both changes come
    /// as one state, is a new queue and runs at once (issue 16: the old check took it for
    /// a promotion, and the node served the old queue's mirror copy as the new queue).
    #[test]
    fn a_queue_declared_again_is_created_and_a_promoted_one_is_adopted() {
        use crate::meta::state::{MirrorRecord, NodeRecord};
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0)
            .with_node_id(1)
            .with_durability(Arc::new(Durability::default()));
        let mut state = MetaState::default();
        let apply = |state: &mut MetaState, c: Command| {
            state.apply(&c).unwrap();
        };
        apply(&mut state, Command::AddVhost { name: "/".into() });
        for id in [1, 2, 3] {
            apply(
                &mut state,
                Command::RegisterNode(NodeRecord {
                    id,
                    name: format!("n{id}"),
                    amqp: String::new(),
                    admin: String::new(),
                    link: String::new(),
                    incarnation: 0,
                }),
            );
        }
        let declare = |state: &mut MetaState, name: &str, home| {
            let Command::DeclareQueue(mut def) = durable_queue(name) else {
                unreachable!()
            };
            def.home = home;
            state.apply(&Command::DeclareQueue(def)).unwrap();
            let mirrors = [1, 2, 3]
                .into_iter()
                .filter(|n| *n != home)
                .map(|node| MirrorRecord {
                    node,
                    since: 0,
                    synchronised: true,
                })
                .collect();
            state
                .apply(&Command::SetMirrors {
                    vhost: "/".into(),
                    queue: name.into(),
                    expected_version: 0,
                    mirrors,
                })
                .unwrap();
        };
        declare(&mut state, "again", 3);
        declare(&mut state, "promoted", 3);
        broker.follow(Arc::new(state.clone()), Instant::default());
        assert!(broker.queue("/", "again").is_none(), "homed on node 3");
        // One state: `again` deleted and declared here; `promoted` moved here.
        apply(
            &mut state,
            Command::DeleteQueue {
                vhost: "/".into(),
                name: "again".into(),
            },
        );
        declare(&mut state, "again", 1);
        apply(
            &mut state,
            Command::PromoteMirror {
                vhost: "/".into(),
                queue: "promoted".into(),
                expected_epoch: 0,
                node: 1,
            },
        );
        // Whoever waits for a queue to appear (the relay, for a consumer following the
        // promotion) is woken by each change: the new metadata, then the adoption.
        let woken = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let watch = |broker: &Broker| {
            let w = woken.clone();
            broker.on_next_change(Box::new(move || {
                w.fetch_add(1, Ordering::SeqCst);
            }));
        };
        watch(&broker);
        broker.follow(Arc::new(state.clone()), Instant::default());
        assert_eq!(woken.load(Ordering::SeqCst), 1, "woken by the new metadata");
        assert!(
            broker.queue("/", "again").is_some(),
            "a new queue, created at once"
        );
        assert!(
            broker.queue("/", "promoted").is_none(),
            "left for the mirror runtime to adopt"
        );
        watch(&broker);
        let adopted = broker.adopt_queue::<()>("/", "promoted", Instant::default(), |_| Ok(()));
        assert!(matches!(adopted, Some(Ok(_))));
        assert_eq!(woken.load(Ordering::SeqCst), 2, "woken by the adoption");
        broker.follow(Arc::new(state.clone()), Instant::default());
        assert_eq!(
            woken.load(Ordering::SeqCst),
            2,
            "a watcher is called at the next change only"
        );
    }

    #[test]
    fn following_a_replicated_state_runs_exactly_the_queues_homed_here() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(1);
        let mut state = MetaState::default();
        let mut follow = |c: &Command| {
            state.apply(c).unwrap();
            broker.follow(Arc::new(state.clone()), Instant::default());
        };
        follow(&Command::AddVhost { name: "/".into() });
        for (name, home) in [("capped.here", 1), ("there", 2), ("free.here", 1)] {
            let mut def = match durable_queue(name) {
                Command::DeclareQueue(d) => d,
                _ => unreachable!(),
            };
            def.home = home;
            follow(&Command::DeclareQueue(def));
        }
        let local =
            |b: &Broker| -> Vec<String> { b.all_queues().iter().map(|h| h.name.clone()).collect() };
        assert_eq!(local(&broker), ["capped.here", "free.here"]);
        assert_eq!(broker.snapshot().vhost("/").unwrap().queues.len(), 3);
        // A policy reshapes the live queue it matches.
        follow(&max_length_policy(2));
        publish_n(&broker, "capped.here", 5);
        publish_n(&broker, "free.here", 5);
        let count = |q: &str| broker.queue("/", q).unwrap().lock().message_count();
        assert_eq!((count("capped.here"), count("free.here")), (2, 5));
        // Deleting tears the local queue down; another node's queue never ran here.
        follow(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "free.here".into(),
        });
        follow(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "there".into(),
        });
        assert_eq!(local(&broker), ["capped.here"]);
        // Several commands folded into one state are followed as one.
        state
            .apply(&Command::DeleteVhost { name: "/".into() })
            .unwrap();
        state
            .apply(&Command::AddVhost { name: "/".into() })
            .unwrap();
        broker.follow(Arc::new(state.clone()), Instant::default());
        assert!(local(&broker).is_empty());
    }
}

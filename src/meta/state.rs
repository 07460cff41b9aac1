//! The metadata itself and the pure `apply` of commands to it.
//!
//! Collections are ordered maps so every iteration (listing, deletion cascades) is in a fixed
//! order on every node. Vhosts sit behind `Arc` so a command copies only the vhost it changes,
//! and a vhost's exchanges, queues and bindings are persistent maps ([`OrdMap`]), so copying a
//! vhost costs O(1) and a change O(log n), however many queues it holds.

use std::collections::{BTreeMap, BTreeSet};

/// A persistent (structurally shared) ordered map: every applied command publishes a new
/// metadata snapshot, and copying a vhost's maps for it must not cost O(queues).
pub use imbl::OrdMap;
use std::sync::Arc;

use amq_protocol::types::FieldTable;
use serde::{Deserialize, Serialize};

use super::args::QueueArgs;
use super::command::Command;
use super::error::MetaError;
use super::limits::{self, LimitScope, Limits};
use super::policy::{effective, Effective, Policy};

/// The four exchange types (plus RabbitMQ's names for them).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExchangeKind {
    /// Routes on routing-key equality.
    Direct,
    /// Routes to every binding.
    Fanout,
    /// Routes on dotted patterns with `*` and `#`.
    Topic,
    /// Routes on header values (`x-match` all / any).
    Headers,
}

impl ExchangeKind {
    /// Parses the type name a client sends.
    pub fn parse(s: &str) -> Option<ExchangeKind> {
        Some(match s {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            _ => return None,
        })
    }

    /// The type name.
    pub fn name(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// An exchange definition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExchangeDef {
    /// Vhost.
    pub vhost: String,
    /// Name (`""` is the default exchange).
    pub name: String,
    /// Type.
    pub kind: ExchangeKind,
    /// Survives a restart.
    pub durable: bool,
    /// Deleted when its last binding (as source) goes.
    pub auto_delete: bool,
    /// Clients may not publish to it directly.
    pub internal: bool,
    /// Declared arguments (`alternate-exchange`).
    pub arguments: FieldTable,
}

impl ExchangeDef {
    /// The `alternate-exchange` argument, if set to a string.
    pub fn alternate_exchange(&self) -> Option<String> {
        match self.arguments.inner().get("alternate-exchange") {
            Some(amq_protocol::types::AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            Some(amq_protocol::types::AMQPValue::ShortString(s)) => Some(s.to_string()),
            _ => None,
        }
    }
}

/// A queue definition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueDef {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Survives a restart.
    pub durable: bool,
    /// The connection that owns an exclusive queue.
    pub exclusive_owner: Option<u64>,
    /// Deleted when its last consumer goes (after it had one).
    pub auto_delete: bool,
    /// Declared arguments.
    pub arguments: FieldTable,
    /// The node the queue lives on (its process and its messages); 0 on a node that is not
    /// clustered. Chosen once, when the queue is created, by `queue-master-locator`; not
    /// part of the equivalence check, so a redeclaration from any node matches.
    pub home: NodeId,
}

/// A node id, as the metadata Raft group numbers its members (0: not clustered).
pub type NodeId = u64;

/// The node part of a connection id: connection ids are `node << 40 | counter`, so an
/// exclusive queue's owner names the node its connection lives on.
pub fn owner_node(connection_id: u64) -> NodeId {
    connection_id >> 40
}

/// A member of the cluster, as registered by the node itself when it starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Raft id.
    pub id: NodeId,
    /// The node's name (`[node] name`).
    pub name: String,
    /// Its AMQP listener.
    pub amqp: String,
    /// Its admin endpoint.
    pub admin: String,
    /// Its node-link listener.
    pub link: String,
    /// Drawn at each start: a new value tells the other nodes that the node restarted (and
    /// lost its channels and consumers), however quickly.
    pub incarnation: u64,
}

impl QueueDef {
    /// The validated `x-` arguments.
    pub fn args(&self) -> Result<QueueArgs, MetaError> {
        QueueArgs::parse(&self.arguments)
    }

    /// The arguments combined with the queue's effective policy in `vhost`.
    pub fn effective_args(&self, vhost: &Vhost) -> Result<QueueArgs, MetaError> {
        QueueArgs::with_policy(&self.arguments, &vhost.effective_policy(&self.name, true))
    }
}

/// Where a binding leads.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Destination {
    /// A queue.
    Queue(String),
    /// An exchange (exchange-to-exchange binding).
    Exchange(String),
}

impl Destination {
    /// The destination's name.
    pub fn name(&self) -> &str {
        match self {
            Destination::Queue(n) | Destination::Exchange(n) => n,
        }
    }

    /// `queue` or `exchange`.
    pub fn kind(&self) -> &'static str {
        match self {
            Destination::Queue(_) => "queue",
            Destination::Exchange(_) => "exchange",
        }
    }
}

/// A binding from an exchange to a queue or exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// Vhost.
    pub vhost: String,
    /// Source exchange.
    pub source: String,
    /// Destination.
    pub destination: Destination,
    /// Routing key (pattern for topic exchanges).
    pub routing_key: String,
    /// Arguments (header matches for headers exchanges).
    pub arguments: FieldTable,
}

impl Binding {
    fn same_as(&self, other: &Binding) -> bool {
        self.source == other.source
            && self.destination == other.destination
            && self.routing_key == other.routing_key
            && self.arguments == other.arguments
    }
}

/// A user.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    /// Name.
    pub name: String,
    /// The stored password: a RabbitMQ salted hash ([`User::hash_password`],
    /// [`User::stored_hash`]). A plain password is still read from metadata written before
    /// passwords were hashed, and never written now.
    pub password: String,
    /// Tags.
    pub tags: Vec<String>,
}

/// RabbitMQ's password hashing algorithms (`rabbit_password_hashing_*`): a 4-byte salt,
/// then the digest of salt ‖ password, in base64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hashing {
    /// `rabbit_password_hashing_sha256`, RabbitMQ's default and what Warren writes.
    Sha256,
    /// `rabbit_password_hashing_sha512`, accepted from imports.
    Sha512,
}

impl Hashing {
    /// RabbitMQ's name for the algorithm (`hashing_algorithm` in definitions).
    pub fn name(self) -> &'static str {
        match self {
            Hashing::Sha256 => "rabbit_password_hashing_sha256",
            Hashing::Sha512 => "rabbit_password_hashing_sha512",
        }
    }

    /// The algorithm RabbitMQ calls `name`.
    pub fn named(name: &str) -> Option<Hashing> {
        [Hashing::Sha256, Hashing::Sha512]
            .into_iter()
            .find(|h| h.name() == name)
    }

    fn digest(self, salt: &[u8], password: &str) -> Vec<u8> {
        use sha2::Digest;
        match self {
            Hashing::Sha256 => {
                let mut h = sha2::Sha256::new();
                h.update(salt);
                h.update(password.as_bytes());
                h.finalize().to_vec()
            }
            Hashing::Sha512 => {
                let mut h = sha2::Sha512::new();
                h.update(salt);
                h.update(password.as_bytes());
                h.finalize().to_vec()
            }
        }
    }

    /// Salt and digest bytes.
    fn hash_len(self) -> usize {
        4 + match self {
            Hashing::Sha256 => 32,
            Hashing::Sha512 => 64,
        }
    }

    /// How a stored password hashed this way begins: a NUL, which no configured or typed
    /// password contains, then the algorithm's name and a colon.
    fn prefix(self) -> String {
        format!("\u{0}{}:", self.name())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl User {
    /// The stored form of `password`: salt, then SHA-256(salt ‖ password), as RabbitMQ
    /// stores it (`rabbit_password_hashing_sha256`). The salt should be fresh and random
    /// (`Broker::new_salt`).
    pub fn hash_password(password: &str, salt: [u8; 4]) -> String {
        use base64::Engine;
        let mut raw = salt.to_vec();
        raw.extend(Hashing::Sha256.digest(&salt, password));
        format!(
            "{}{}",
            Hashing::Sha256.prefix(),
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }

    /// The algorithm and base64 hash of a hashed stored password.
    fn stored(&self) -> Option<(Hashing, &str)> {
        [Hashing::Sha256, Hashing::Sha512]
            .into_iter()
            .find_map(|h| self.password.strip_prefix(&h.prefix()).map(|b64| (h, b64)))
    }

    /// Whether `password` is this user's password, compared in constant time: the one check
    /// the AMQP login, the admin endpoint and the management API all make.
    pub fn password_matches(&self, password: &str) -> bool {
        use base64::Engine;
        match self.stored() {
            None => constant_time_eq(self.password.as_bytes(), password.as_bytes()),
            Some((h, b64)) => match base64::engine::general_purpose::STANDARD.decode(b64) {
                Ok(raw) if raw.len() == h.hash_len() => {
                    constant_time_eq(&raw[4..], &h.digest(&raw[..4], password))
                }
                _ => false,
            },
        }
    }

    /// What to store as the password of a user given by its RabbitMQ `password_hash`
    /// (base64 of a 4-byte salt and the digest) made with `hashing`; none when it is not
    /// such a hash.
    pub fn stored_hash(password_hash: &str, hashing: Hashing) -> Option<String> {
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(password_hash)
            .ok()?;
        (raw.len() == hashing.hash_len()).then(|| format!("{}{password_hash}", hashing.prefix()))
    }

    /// What to store for a user that cannot log in with a password (RabbitMQ's empty
    /// `password_hash`): a hash of no bytes, which no password matches.
    pub fn no_password() -> String {
        Hashing::Sha256.prefix()
    }

    /// The user's password as a RabbitMQ `password_hash` and its `hashing_algorithm` (for
    /// exports). A plain password from older metadata is hashed with a salt derived from
    /// the user's name and password, so the same user exports the same hash every time.
    pub fn password_hash(&self) -> (String, Hashing) {
        if let Some((h, b64)) = self.stored() {
            return (b64.to_string(), h);
        }
        let derived = Hashing::Sha256.digest(self.name.as_bytes(), &self.password);
        let salt = [derived[0], derived[1], derived[2], derived[3]];
        let stored = Self::hash_password(&self.password, salt);
        let b64 = stored
            .strip_prefix(&Hashing::Sha256.prefix())
            .unwrap_or_default();
        (b64.to_string(), Hashing::Sha256)
    }
}

/// A user's permissions in one vhost: regexes over resource names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permission {
    /// User.
    pub user: String,
    /// Vhost.
    pub vhost: String,
    /// Resources the user may declare and delete.
    pub configure: String,
    /// Resources the user may publish or bind to.
    pub write: String,
    /// Resources the user may consume from or bind from.
    pub read: String,
}

/// One vhost's exchanges, queues and bindings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Vhost {
    /// Name.
    pub name: String,
    /// Exchanges by name.
    pub exchanges: OrdMap<String, ExchangeDef>,
    /// Queues by name.
    pub queues: OrdMap<String, QueueDef>,
    /// Bindings by source exchange, in creation order.
    pub bindings: OrdMap<String, Vec<Binding>>,
    /// Policies by name.
    pub policies: BTreeMap<String, Policy>,
    /// Operator policies by name.
    pub operator_policies: BTreeMap<String, Policy>,
}

impl Vhost {
    /// The effective policy of a queue (`queue`) or exchange named `name`.
    pub fn effective_policy(&self, name: &str, queue: bool) -> Effective {
        effective(&self.policies, &self.operator_policies, name, queue)
    }
}

impl Vhost {
    fn new(name: &str) -> Vhost {
        let mut v = Vhost {
            name: name.to_string(),
            ..Vhost::default()
        };
        let std = [
            ("", ExchangeKind::Direct, false),
            ("amq.direct", ExchangeKind::Direct, false),
            ("amq.fanout", ExchangeKind::Fanout, false),
            ("amq.topic", ExchangeKind::Topic, false),
            ("amq.headers", ExchangeKind::Headers, false),
            ("amq.match", ExchangeKind::Headers, false),
            ("amq.rabbitmq.trace", ExchangeKind::Topic, true),
        ];
        for (n, kind, internal) in std {
            v.exchanges.insert(
                n.to_string(),
                ExchangeDef {
                    vhost: name.to_string(),
                    name: n.to_string(),
                    kind,
                    durable: true,
                    auto_delete: false,
                    internal,
                    arguments: FieldTable::default(),
                },
            );
        }
        v
    }

    /// Bindings whose source is `exchange`.
    pub fn bindings_from(&self, exchange: &str) -> &[Binding] {
        self.bindings
            .get(exchange)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Every binding whose destination is `dest`.
    pub fn bindings_to(&self, dest: &Destination) -> Vec<&Binding> {
        self.bindings
            .values()
            .flatten()
            .filter(|b| &b.destination == dest)
            .collect()
    }

    fn not_found(&self, kind: &'static str, name: &str) -> MetaError {
        MetaError::NotFound {
            kind,
            name: name.to_string(),
            vhost: self.name.clone(),
        }
    }

    /// Removes every binding to `dest`, then auto-delete exchanges left without bindings.
    fn remove_bindings_to(&mut self, dest: &Destination, removed: &mut Removed) {
        // Only the lists that change are touched (copied, if a snapshot shares them).
        let sources: Vec<String> = self
            .bindings
            .iter()
            .filter(|(_, list)| list.iter().any(|b| &b.destination == dest))
            .map(|(s, _)| s.clone())
            .collect();
        let mut emptied = Vec::new();
        for source in sources {
            if let Some(list) = self.bindings.get_mut(&source) {
                list.retain(|b| &b.destination != dest);
                if list.is_empty() {
                    emptied.push(source);
                }
            }
        }
        for source in emptied {
            self.bindings.remove(&source);
            self.maybe_auto_delete_exchange(&source, removed);
        }
    }

    fn maybe_auto_delete_exchange(&mut self, name: &str, removed: &mut Removed) {
        let auto = self.exchanges.get(name).is_some_and(|e| e.auto_delete);
        if auto && self.bindings_from(name).is_empty() {
            self.delete_exchange(name, removed);
        }
    }

    fn delete_exchange(&mut self, name: &str, removed: &mut Removed) {
        self.exchanges.remove(name);
        self.bindings.remove(name);
        removed.exchanges.push(name.to_string());
        self.remove_bindings_to(&Destination::Exchange(name.to_string()), removed);
    }

    fn delete_queue(&mut self, name: &str, removed: &mut Removed) {
        if self.queues.remove(name).is_some() {
            removed.queues.push((self.name.clone(), name.to_string()));
            self.remove_bindings_to(&Destination::Queue(name.to_string()), removed);
        }
    }
}

/// What an applied command created or removed, for the broker to act on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Queues deleted, as (vhost, name); their runtime state must go too.
    pub queues: Vec<(String, String)>,
    /// Exchanges deleted (auto-delete cascades included).
    pub exchanges: Vec<String>,
}

/// The outcome of an applied command.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Whether a declare created something new (false: it already existed).
    pub created: bool,
    /// Deletions, including cascades.
    pub removed: Removed,
}

/// A mirror of a queue, as the metadata records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorRecord {
    /// Its node.
    pub node: NodeId,
    /// The metadata version when it was added: older mirrors come first (promotion takes
    /// the oldest synchronised one). Set by the state machine.
    pub since: u64,
    /// Whether it holds everything the master holds.
    pub synchronised: bool,
}

/// What every mirrored queue's GM group name starts with.
pub const MIRROR_GROUP_PREFIX: &str = "mirror:";

/// The GM group of one incarnation of a mirrored queue ([`MirrorSet::incarnation`]): a
/// queue declared again under the same name has a group of its own.
pub fn mirror_group_name(vhost: &str, queue: &str, incarnation: u64) -> String {
    format!(
        "{MIRROR_GROUP_PREFIX}{}:{vhost}:{incarnation}:{queue}",
        vhost.len()
    )
}

/// A mirrored queue's mirrors (its master is the queue's home node).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorSet {
    /// Incremented by every change (compare-and-set, [`Command::SetMirrors`]).
    pub version: u64,
    /// Incremented by every promotion: the master's term. A deposed master that sees a
    /// newer epoch stands down.
    pub epoch: u64,
    /// The mirrors.
    pub mirrors: Vec<MirrorRecord>,
    /// `sync_queue` requests so far (the master syncs when this goes up).
    pub sync_requests: u64,
    /// `cancel_sync_queue` requests so far.
    pub cancel_requests: u64,
    /// Which queue this set belongs to: the metadata version that created the set (never 0
    /// once created). A queue deleted and declared again under the same name gets a new
    /// set, so a new incarnation: its GM group, its mirrors' copies and its epochs are
    /// never confused with the old queue's (an old master or mirror still running sees
    /// the change and stops).
    pub incarnation: u64,
}

/// A vhost's description and tags, as RabbitMQ's vhost metadata (`PUT /api/vhosts/{name}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostMetadata {
    /// Free text.
    pub description: String,
    /// Tags, in the order given.
    pub tags: Vec<String>,
}

/// The whole metadata.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetaState {
    /// Vhosts by name.
    pub vhosts: BTreeMap<String, Arc<Vhost>>,
    /// Users by name.
    pub users: BTreeMap<String, User>,
    /// Permissions by (user, vhost).
    pub permissions: BTreeMap<(String, String), Permission>,
    /// Cluster members that registered themselves, by id.
    pub nodes: BTreeMap<NodeId, NodeRecord>,
    /// Ids of forgotten nodes: they leave the Raft membership and may not register again
    /// (node ids are never reused).
    pub forgotten: std::collections::BTreeSet<NodeId>,
    /// GM group records by group name: the ring order each group's members follow, changed
    /// only by compare-and-set on its version ([`Command::GmGroup`]).
    pub gm_groups: BTreeMap<String, crate::gm::GroupRecord>,
    /// Mirror sets of mirrored queues by (vhost, queue); gone with their queue.
    pub mirror_sets: BTreeMap<(String, String), MirrorSet>,
    /// Vhost limits by vhost name ([`super::limits`]); gone with their vhost, never empty.
    pub vhost_limits: BTreeMap<String, Limits>,
    /// User limits by user name; gone with their user, never empty.
    pub user_limits: BTreeMap<String, Limits>,
    /// Vhost descriptions and tags by vhost name; gone with their vhost, never empty.
    pub vhost_metadata: BTreeMap<String, VhostMetadata>,
    /// Number of commands applied.
    pub version: u64,
}

impl MetaState {
    /// The vhost named `name`.
    pub fn vhost(&self, name: &str) -> Option<&Arc<Vhost>> {
        self.vhosts.get(name)
    }

    /// The permissions of `user` in `vhost`.
    pub fn permission(&self, user: &str, vhost: &str) -> Option<&Permission> {
        self.permissions.get(&(user.to_string(), vhost.to_string()))
    }

    /// The limit `name` of vhost `vhost` when it limits anything (0 or more).
    pub fn vhost_limit(&self, vhost: &str, name: &str) -> Option<u64> {
        limits::effective(self.vhost_limits.get(vhost), name)
    }

    /// The limit `name` of user `user` when it limits anything (0 or more).
    pub fn user_limit(&self, user: &str, name: &str) -> Option<u64> {
        limits::effective(self.user_limits.get(user), name)
    }

    fn limits_mut(
        &mut self,
        scope: &LimitScope,
    ) -> Result<&mut BTreeMap<String, Limits>, MetaError> {
        match scope {
            LimitScope::Vhost(v) if self.vhosts.contains_key(v) => Ok(&mut self.vhost_limits),
            LimitScope::Vhost(v) => Err(MetaError::NoVhost(v.clone())),
            LimitScope::User(u) if self.users.contains_key(u) => Ok(&mut self.user_limits),
            LimitScope::User(u) => Err(MetaError::Admin(format!("no user '{u}'"))),
        }
    }

    fn set_limits(
        &mut self,
        scope: &LimitScope,
        given: &Limits,
        replace: bool,
    ) -> Result<bool, MetaError> {
        scope.validate(given)?;
        let (LimitScope::Vhost(key) | LimitScope::User(key)) = scope;
        let map = self.limits_mut(scope)?;
        let created = !map.contains_key(key);
        let mut next = if replace {
            Limits::new()
        } else {
            map.get(key).cloned().unwrap_or_default()
        };
        next.extend(given.iter().map(|(k, v)| (k.clone(), *v)));
        if next.is_empty() {
            map.remove(key);
        } else {
            map.insert(key.clone(), next);
        }
        Ok(created)
    }

    fn clear_limits(&mut self, scope: &LimitScope, name: Option<&str>) -> Result<(), MetaError> {
        let (LimitScope::Vhost(key) | LimitScope::User(key)) = scope;
        let map = self.limits_mut(scope)?;
        match name {
            None => {
                map.remove(key);
            }
            Some(n) => {
                if let Some(l) = map.get_mut(key) {
                    l.remove(n);
                    if l.is_empty() {
                        map.remove(key);
                    }
                }
            }
        }
        Ok(())
    }

    fn vhost_mut(&mut self, name: &str) -> Result<&mut Vhost, MetaError> {
        self.vhosts
            .get_mut(name)
            .map(Arc::make_mut)
            .ok_or_else(|| MetaError::NoVhost(name.to_string()))
    }

    /// Validates and applies one command. A refused command changes nothing.
    pub fn apply(&mut self, command: &Command) -> Result<Applied, MetaError> {
        // Validate against a copy of the affected vhost only; commit on success.
        let applied = self.apply_inner(command)?;
        for q in &applied.removed.queues {
            self.mirror_sets.remove(q);
        }
        self.version += 1;
        Ok(applied)
    }

    fn apply_inner(&mut self, command: &Command) -> Result<Applied, MetaError> {
        let mut applied = Applied::default();
        match command {
            Command::Batch(commands) => {
                // On a copy: a refused command leaves the state as it was.
                let mut next = self.clone();
                for c in commands {
                    let a = next.apply(c)?;
                    applied.created |= a.created;
                    applied.removed.queues.extend(a.removed.queues);
                    applied.removed.exchanges.extend(a.removed.exchanges);
                }
                *self = next;
            }
            Command::AddVhost { name } => {
                if !self.vhosts.contains_key(name) {
                    self.vhosts.insert(name.clone(), Arc::new(Vhost::new(name)));
                    applied.created = true;
                }
            }
            Command::DeleteVhost { name } => {
                let v = self
                    .vhosts
                    .remove(name)
                    .ok_or_else(|| MetaError::NoVhost(name.clone()))?;
                for q in v.queues.keys() {
                    applied.removed.queues.push((name.clone(), q.clone()));
                }
                self.permissions.retain(|(_, vh), _| vh != name);
                self.vhost_limits.remove(name);
                self.vhost_metadata.remove(name);
            }
            Command::PutUser(user) => {
                applied.created = self.users.insert(user.name.clone(), user.clone()).is_none();
            }
            Command::DeleteUser { name } => {
                if self.users.remove(name).is_none() {
                    return Err(MetaError::Admin(format!("no user '{name}'")));
                }
                self.permissions.retain(|(u, _), _| u != name);
                self.user_limits.remove(name);
            }
            Command::SetPermissions(p) => {
                if !self.users.contains_key(&p.user) {
                    return Err(MetaError::Admin(format!("no user '{}'", p.user)));
                }
                if !self.vhosts.contains_key(&p.vhost) {
                    return Err(MetaError::NoVhost(p.vhost.clone()));
                }
                for re in [&p.configure, &p.write, &p.read] {
                    regex::Regex::new(re)
                        .map_err(|e| MetaError::Admin(format!("bad regex '{re}': {e}")))?;
                }
                self.permissions
                    .insert((p.user.clone(), p.vhost.clone()), p.clone());
            }
            Command::ClearPermissions { user, vhost } => {
                self.permissions.remove(&(user.clone(), vhost.clone()));
            }
            Command::SetLimits {
                scope,
                limits,
                replace,
            } => {
                applied.created = self.set_limits(scope, limits, *replace)?;
            }
            Command::ClearLimits { scope, name } => {
                self.clear_limits(scope, name.as_deref())?;
            }
            Command::SetVhostMetadata { name, metadata } => {
                if !self.vhosts.contains_key(name) {
                    return Err(MetaError::NoVhost(name.clone()));
                }
                if *metadata == VhostMetadata::default() {
                    self.vhost_metadata.remove(name);
                } else {
                    self.vhost_metadata.insert(name.clone(), metadata.clone());
                }
            }
            Command::DeclareExchange(def) => {
                applied.created = self.declare_exchange(def)?;
            }
            Command::DeleteExchange {
                vhost,
                name,
                if_unused,
            } => {
                let v = self.vhost_mut(vhost)?;
                if !v.exchanges.contains_key(name) {
                    return Err(v.not_found("exchange", name));
                }
                if *if_unused && !v.bindings_from(name).is_empty() {
                    return Err(MetaError::InUse(format!(
                        "exchange '{name}' in vhost '{vhost}' in use"
                    )));
                }
                v.delete_exchange(name, &mut applied.removed);
            }
            Command::DeclareQueue(def) => {
                applied.created = self.declare_queue(def)?;
            }
            Command::DeleteQueue { vhost, name } => {
                let v = self.vhost_mut(vhost)?;
                if !v.queues.contains_key(name) {
                    return Err(v.not_found("queue", name));
                }
                v.delete_queue(name, &mut applied.removed);
            }
            Command::DeleteExclusiveQueues { owner } => {
                self.delete_queues_where(&mut applied, |q| q.exclusive_owner == Some(*owner))?;
            }
            Command::RegisterNode(node) => {
                if node.id == 0 {
                    return Err(MetaError::Admin("node id 0 is reserved".into()));
                }
                if self.forgotten.contains(&node.id) {
                    return Err(MetaError::Admin(format!(
                        "node {} was forgotten; node ids are never reused",
                        node.id
                    )));
                }
                let previous = self.nodes.insert(node.id, node.clone());
                applied.created = previous.is_none();
                if previous.is_some_and(|p| p.incarnation != node.incarnation) {
                    // A new incarnation: the node restarted, and its GM members with it.
                    self.gm_node_died(node.id);
                }
            }
            Command::ForgetNode { id } => {
                if self.nodes.remove(id).is_none() {
                    return Err(MetaError::Admin(format!("no cluster node {id}")));
                }
                self.forgotten.insert(*id);
                // Its mirrored queues move to a mirror the policy may promote, as RabbitMQ's
                // forget_cluster_node does; the rest of its queues go with it, durable or
                // not: their messages were on its disk.
                self.promote_mirrored_of(*id, true)?;
                self.delete_queues_where(&mut applied, |q| {
                    q.home == *id || q.exclusive_owner.is_some_and(|o| owner_node(o) == *id)
                })?;
                // Its GM members are dead, as after NodeDown: no NodeDown will come for a
                // node that is no longer a member, and a ring that still counted them would
                // carry nothing round again.
                self.gm_node_died(*id);
            }
            Command::NodeDown { id } => {
                // As RabbitMQ when a node goes down (or restarts): its connections are gone,
                // and with them their exclusive queues; its non-durable queues go too,
                // except mirrored ones with a mirror to promote (their master's copy was in
                // its RAM, so they cannot wait for it as durable queues do). Its durable
                // queues stay, unavailable until it is back or the reconciler promotes a
                // mirror (it knows which nodes run; this command does not).
                self.promote_mirrored_of(*id, false)?;
                self.delete_queues_where(&mut applied, |q| {
                    q.exclusive_owner.is_some_and(|o| owner_node(o) == *id)
                        || (q.home == *id && !q.durable)
                })?;
                // Its GM members are dead: their inheritors carry their messages on. A
                // member that was only cut off finds itself dead when it hears of this
                // record, and stops (its owner may join again as a new member).
                self.gm_node_died(*id);
            }
            Command::GmGroup {
                name,
                expected_version,
                members,
            } => {
                let current = self.gm_groups.get(name).map_or(0, |g| g.version);
                if current != *expected_version {
                    return Err(MetaError::Admin(format!(
                        "gm group '{name}' is at version {current}, not {expected_version}"
                    )));
                }
                let mut seen = BTreeSet::new();
                if !members.iter().all(|s| seen.insert(s.id())) {
                    return Err(MetaError::Invalid(format!(
                        "gm group '{name}' lists a member twice"
                    )));
                }
                applied.created = current == 0;
                let record = crate::gm::GroupRecord {
                    version: current + 1,
                    members: members.clone(),
                };
                let before = self.gm_groups.insert(name.clone(), record.clone());
                self.unsynchronise_changed_members(name, before.as_ref(), &record);
            }
            Command::SetMirrors {
                vhost,
                queue,
                expected_version,
                mirrors,
            } => self.set_mirrors(vhost, queue, *expected_version, mirrors)?,
            Command::PromoteMirror {
                vhost,
                queue,
                expected_epoch,
                node,
            } => self.promote_mirror(vhost, queue, *expected_epoch, *node)?,
            Command::MarkSynchronised {
                vhost,
                queue,
                incarnation,
                epoch,
                member,
            } => self.mark_synchronised(vhost, queue, *incarnation, *epoch, *member)?,
            Command::PromoteSyncedMirror {
                vhost,
                queue,
                expected_epoch,
                node,
            } => {
                let key = (vhost.clone(), queue.clone());
                let synced = self
                    .mirror_sets
                    .get(&key)
                    .is_some_and(|s| s.mirrors.iter().any(|m| m.node == *node && m.synchronised));
                if !synced {
                    return Err(MetaError::Admin(format!(
                        "node {node}'s mirror of queue '{queue}' in vhost '{vhost}' is no longer synchronised"
                    )));
                }
                self.promote_mirror(vhost, queue, *expected_epoch, *node)?
            }
            Command::SyncQueue {
                vhost,
                queue,
                cancel,
            } => {
                let key = (vhost.clone(), queue.clone());
                let Some(set) = self
                    .mirror_sets
                    .get_mut(&key)
                    .filter(|s| !s.mirrors.is_empty())
                else {
                    return Err(MetaError::Admin(format!(
                        "queue '{queue}' in vhost '{vhost}' is not mirrored"
                    )));
                };
                if *cancel {
                    set.cancel_requests += 1;
                } else {
                    set.sync_requests += 1;
                }
            }
            Command::GmForget { name } => {
                if self.gm_groups.remove(name).is_none() {
                    return Err(MetaError::Admin(format!("no gm group '{name}'")));
                }
            }
            Command::SetPolicy { policy, operator } => {
                policy.validate(*operator)?;
                let v = self.vhost_mut(&policy.vhost)?;
                let set = if *operator {
                    &mut v.operator_policies
                } else {
                    &mut v.policies
                };
                applied.created = set.insert(policy.name.clone(), policy.clone()).is_none();
            }
            Command::ClearPolicy {
                vhost,
                name,
                operator,
            } => {
                let v = self.vhost_mut(vhost)?;
                let set = if *operator {
                    &mut v.operator_policies
                } else {
                    &mut v.policies
                };
                if set.remove(name).is_none() {
                    return Err(MetaError::Admin(format!(
                        "policy '{name}' not found in vhost '{vhost}'"
                    )));
                }
            }
            Command::Bind(b) => {
                let v = self.vhost_mut(&b.vhost)?;
                check_binding_ends(v, b)?;
                let list = v.bindings.entry(b.source.clone()).or_default();
                if !list.iter().any(|x| x.same_as(b)) {
                    list.push(b.clone());
                    applied.created = true;
                }
            }
            Command::Unbind(b) => {
                let v = self.vhost_mut(&b.vhost)?;
                // As RabbitMQ 3.10: unbinding from or to an object that is gone (teardown
                // after an auto-delete) is a harmless no-op, not 404.
                match check_binding_ends(v, b) {
                    Err(MetaError::DefaultExchange) => return Err(MetaError::DefaultExchange),
                    Err(_) => return Ok(applied),
                    Ok(()) => {}
                }
                let mut emptied = false;
                if let Some(list) = v.bindings.get_mut(&b.source) {
                    list.retain(|x| !x.same_as(b));
                    emptied = list.is_empty();
                }
                if emptied {
                    v.bindings.remove(&b.source);
                    v.maybe_auto_delete_exchange(&b.source, &mut applied.removed);
                }
            }
        }
        Ok(applied)
    }

    /// Deletes, in every vhost, the queues `doomed` picks (with their bindings).
    /// [`Command::SetMirrors`]: compare-and-set of a queue's mirrors.
    fn set_mirrors(
        &mut self,
        vhost: &str,
        queue: &str,
        expected_version: u64,
        mirrors: &[MirrorRecord],
    ) -> Result<(), MetaError> {
        let v = self
            .vhosts
            .get(vhost)
            .ok_or_else(|| MetaError::NoVhost(vhost.to_string()))?;
        let def = v
            .queues
            .get(queue)
            .ok_or_else(|| v.not_found("queue", queue))?;
        if def.exclusive_owner.is_some() {
            return Err(MetaError::Invalid(format!(
                "exclusive queue '{queue}' in vhost '{vhost}' cannot be mirrored"
            )));
        }
        let key = (vhost.to_string(), queue.to_string());
        let current = self
            .mirror_sets
            .get(&key)
            .cloned()
            .unwrap_or_else(|| MirrorSet {
                incarnation: self.version + 1,
                ..MirrorSet::default()
            });
        if current.version != expected_version {
            return Err(MetaError::Admin(format!(
                "mirrors of queue '{queue}' in vhost '{vhost}' are at version {}, not {expected_version}",
                current.version
            )));
        }
        let mut seen = BTreeSet::new();
        for m in mirrors {
            if m.node == def.home {
                return Err(MetaError::Invalid(format!(
                    "node {} is the master of queue '{queue}', not a mirror",
                    m.node
                )));
            }
            if !self.nodes.contains_key(&m.node) {
                return Err(MetaError::Invalid(format!("no cluster node {}", m.node)));
            }
            if !seen.insert(m.node) {
                return Err(MetaError::Invalid(format!(
                    "node {} listed twice as a mirror of queue '{queue}'",
                    m.node
                )));
            }
        }
        // A mirror keeps its age; a new one is as old as this change.
        let mirrors = mirrors
            .iter()
            .map(|m| MirrorRecord {
                since: current
                    .mirrors
                    .iter()
                    .find(|old| old.node == m.node)
                    .map_or(self.version, |old| old.since),
                ..*m
            })
            .collect();
        self.mirror_sets.insert(
            key,
            MirrorSet {
                version: current.version + 1,
                mirrors,
                ..current
            },
        );
        Ok(())
    }

    /// [`Command::PromoteMirror`]: a mirror becomes the master under a new epoch.
    fn promote_mirror(
        &mut self,
        vhost: &str,
        queue: &str,
        expected_epoch: u64,
        node: NodeId,
    ) -> Result<(), MetaError> {
        let key = (vhost.to_string(), queue.to_string());
        let Some(set) = self.mirror_sets.get(&key).cloned() else {
            return Err(MetaError::Admin(format!(
                "queue '{queue}' in vhost '{vhost}' is not mirrored"
            )));
        };
        if set.epoch != expected_epoch {
            return Err(MetaError::Admin(format!(
                "queue '{queue}' in vhost '{vhost}' is at epoch {}, not {expected_epoch}",
                set.epoch
            )));
        }
        if !set.mirrors.iter().any(|m| m.node == node) {
            return Err(MetaError::Invalid(format!(
                "node {node} holds no mirror of queue '{queue}' in vhost '{vhost}'"
            )));
        }
        let v = self.vhost_mut(vhost)?;
        let Some(def) = v.queues.get(queue).cloned() else {
            return Err(v.not_found("queue", queue));
        };
        v.queues
            .insert(queue.to_string(), QueueDef { home: node, ..def });
        self.mirror_sets.insert(
            key,
            MirrorSet {
                version: set.version + 1,
                epoch: set.epoch + 1,
                mirrors: set
                    .mirrors
                    .iter()
                    .filter(|m| m.node != node)
                    .copied()
                    .collect(),
                ..set
            },
        );
        Ok(())
    }

    /// The non-durable mirrored queues mastered on `node`, which is down (or restarting),
    /// and with `durable_too` the durable ones as well (`node` is forgotten: its disk will
    /// never serve again): each moves at once to the mirror `ha-promote-on-failure` allows
    /// (the oldest synchronised one by default), since waiting for the node is no use (it
    /// comes back without them, or not at all); those that cannot move are deleted after
    /// this. The chosen mirror's node may be down too without a record of it yet (a whole
    /// cluster restarting): a non-durable copy is then empty, which loses nothing the
    /// deletion would not. Durable queues of a node that is only down are not moved here
    /// for that reason: their master's disk may hold more than such a mirror, and the
    /// reconciler, which knows which nodes run, promotes them.
    fn promote_mirrored_of(&mut self, node: NodeId, durable_too: bool) -> Result<(), MetaError> {
        let mut moves = Vec::new();
        for (vname, v) in &self.vhosts {
            for (name, def) in &v.queues {
                if def.home != node
                    || (def.durable && !durable_too)
                    || def.exclusive_owner.is_some()
                {
                    continue;
                }
                let Some(set) = self.mirror_sets.get(&(vname.clone(), name.clone())) else {
                    continue;
                };
                let Some(policy) = super::HaPolicy::of(&v.effective_policy(name, true), false)
                else {
                    continue;
                };
                let others: BTreeSet<NodeId> = set
                    .mirrors
                    .iter()
                    .map(|m| m.node)
                    .filter(|n| *n != node)
                    .collect();
                let rule = policy.promote_on_failure;
                if let Some(to) = super::placement::promotion(&set.mirrors, &others, rule) {
                    moves.push((vname.clone(), name.clone(), set.epoch, to));
                }
            }
        }
        for (vhost, queue, epoch, to) in moves {
            self.promote_mirror(&vhost, &queue, epoch, to)?;
        }
        Ok(())
    }

    /// Marks every live GM member on `node` dead, one version step per group it was in, and
    /// its mirrors unsynchronised: a mirror that lost its member misses what the group
    /// carries from then on, so it must sync again before it may be promoted.
    /// [`Command::MarkSynchronised`].
    fn mark_synchronised(
        &mut self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        epoch: u64,
        member: crate::gm::MemberId,
    ) -> Result<(), MetaError> {
        let key = (vhost.to_string(), queue.to_string());
        let refused = |why: &str| {
            Err(MetaError::Admin(format!(
                "mirror on node {} of queue '{queue}' in vhost '{vhost}' not recorded synchronised: {why}",
                member.node
            )))
        };
        let Some(set) = self.mirror_sets.get(&key) else {
            return refused("the queue is not mirrored");
        };
        if set.incarnation != incarnation {
            return refused("the queue was declared again");
        }
        if set.epoch != epoch {
            return refused("its master was replaced");
        }
        if !set.mirrors.iter().any(|m| m.node == member.node) {
            return refused("its node is not a mirror");
        }
        let alive = self
            .gm_groups
            .get(&mirror_group_name(vhost, queue, incarnation))
            .is_some_and(|g| g.members.contains(&crate::gm::Slot::Alive(member)));
        if !alive {
            return refused("the member that acknowledged the sync is gone");
        }
        let Some(set) = self.mirror_sets.get_mut(&key) else {
            return refused("the queue is not mirrored");
        };
        for m in &mut set.mirrors {
            if m.node == member.node {
                m.synchronised = true;
            }
        }
        set.version += 1;
        Ok(())
    }

    /// A mirror is synchronised only while the member that made it so lives: when a
    /// node's live members in a mirrored queue's group change (one recorded dead, or a
    /// new one joined), that node's mirror of the queue is unsynchronised.
    fn unsynchronise_changed_members(
        &mut self,
        group: &str,
        before: Option<&crate::gm::GroupRecord>,
        after: &crate::gm::GroupRecord,
    ) {
        use crate::gm::Slot;
        if !group.starts_with(MIRROR_GROUP_PREFIX) {
            return;
        }
        let live =
            |r: Option<&crate::gm::GroupRecord>, node: NodeId| -> BTreeSet<crate::gm::MemberId> {
                r.into_iter()
                    .flat_map(|r| r.members.iter())
                    .filter_map(|s| match s {
                        Slot::Alive(id) if id.node == node => Some(*id),
                        _ => None,
                    })
                    .collect()
            };
        for ((vhost, queue), set) in self.mirror_sets.iter_mut() {
            if mirror_group_name(vhost, queue, set.incarnation) != group {
                continue;
            }
            let mut changed = false;
            for m in &mut set.mirrors {
                if m.synchronised && live(before, m.node) != live(Some(after), m.node) {
                    m.synchronised = false;
                    changed = true;
                }
            }
            if changed {
                set.version += 1;
            }
            return;
        }
    }

    fn gm_node_died(&mut self, node: NodeId) {
        use crate::gm::Slot;
        for set in self.mirror_sets.values_mut() {
            let mut changed = false;
            for m in &mut set.mirrors {
                if m.node == node && m.synchronised {
                    m.synchronised = false;
                    changed = true;
                }
            }
            if changed {
                set.version += 1;
            }
        }
        for record in self.gm_groups.values_mut() {
            let mut changed = false;
            for slot in &mut record.members {
                if let Slot::Alive(id) = *slot {
                    if id.node == node {
                        *slot = Slot::Dead(id);
                        changed = true;
                    }
                }
            }
            if changed {
                record.version += 1;
            }
        }
    }

    fn delete_queues_where(
        &mut self,
        applied: &mut Applied,
        doomed: impl Fn(&QueueDef) -> bool,
    ) -> Result<(), MetaError> {
        let names: Vec<String> = self.vhosts.keys().cloned().collect();
        for vname in names {
            let picked: Vec<String> = self.vhosts[&vname]
                .queues
                .values()
                .filter(|q| doomed(q))
                .map(|q| q.name.clone())
                .collect();
            if picked.is_empty() {
                continue;
            }
            let v = self.vhost_mut(&vname)?;
            for q in picked {
                v.delete_queue(&q, &mut applied.removed);
            }
        }
        Ok(())
    }

    fn declare_exchange(&mut self, def: &ExchangeDef) -> Result<bool, MetaError> {
        let v = self.vhost_mut(&def.vhost)?;
        if let Some(cur) = v.exchanges.get(&def.name) {
            let checks = [
                (
                    "type",
                    cur.kind.name().to_string(),
                    def.kind.name().to_string(),
                ),
                ("durable", cur.durable.to_string(), def.durable.to_string()),
                (
                    "auto_delete",
                    cur.auto_delete.to_string(),
                    def.auto_delete.to_string(),
                ),
                (
                    "internal",
                    cur.internal.to_string(),
                    def.internal.to_string(),
                ),
            ];
            let ineq = |arg: &str, received: String, current: String| MetaError::Inequivalent {
                kind: "exchange",
                name: def.name.clone(),
                vhost: def.vhost.clone(),
                arg: arg.to_string(),
                received,
                current,
            };
            for (arg, current, received) in checks {
                if current != received {
                    return Err(ineq(arg, format!("'{received}'"), format!("'{current}'")));
                }
            }
            // RabbitMQ compares one exchange argument (`rabbit_exchange:declare_args/0`).
            if let Some((arg, received, current)) = super::equivalence::first_difference(
                &["alternate-exchange"],
                &def.arguments,
                &cur.arguments,
            ) {
                return Err(ineq(arg, received, current));
            }
            return Ok(false);
        }
        v.exchanges.insert(def.name.clone(), def.clone());
        Ok(true)
    }

    fn declare_queue(&mut self, def: &QueueDef) -> Result<bool, MetaError> {
        QueueArgs::parse_for(&def.arguments, &def.name, &def.vhost)?;
        let limit = self.vhost_limit(&def.vhost, limits::MAX_QUEUES);
        let v = self.vhost_mut(&def.vhost)?;
        if let Some(cur) = v.queues.get(&def.name) {
            // RabbitMQ checks exclusivity first: a queue declared exclusive by another
            // connection, or an existing one redeclared as exclusive, is locked (405).
            if cur.exclusive_owner != def.exclusive_owner {
                return Err(MetaError::Locked {
                    name: def.name.clone(),
                    vhost: def.vhost.clone(),
                });
            }
            let ineq = |arg: &str, received: String, current: String| MetaError::Inequivalent {
                kind: "queue",
                name: def.name.clone(),
                vhost: def.vhost.clone(),
                arg: arg.to_string(),
                received,
                current,
            };
            if cur.durable != def.durable {
                return Err(ineq(
                    "durable",
                    format!("'{}'", def.durable),
                    format!("'{}'", cur.durable),
                ));
            }
            if cur.auto_delete != def.auto_delete {
                return Err(ineq(
                    "auto_delete",
                    format!("'{}'", def.auto_delete),
                    format!("'{}'", cur.auto_delete),
                ));
            }
            if let Some((arg, received, current)) =
                QueueArgs::inequivalence(&def.arguments, &cur.arguments)
            {
                return Err(ineq(arg, received, current));
            }
            return Ok(false);
        }
        // Checked here, where queues are counted, so the limit holds across the cluster:
        // every node applies declares in the same order.
        if let Some(limit) = limits::reached(limit, v.queues.len()) {
            return Err(MetaError::QueueLimit {
                queue: def.name.clone(),
                vhost: def.vhost.clone(),
                limit,
            });
        }
        v.queues.insert(def.name.clone(), def.clone());
        Ok(true)
    }
}

fn check_binding_ends(v: &Vhost, b: &Binding) -> Result<(), MetaError> {
    if b.source.is_empty() || b.destination == Destination::Exchange(String::new()) {
        return Err(MetaError::DefaultExchange);
    }
    if !v.exchanges.contains_key(&b.source) {
        return Err(v.not_found("exchange", &b.source));
    }
    let exists = match &b.destination {
        Destination::Queue(q) => v.queues.contains_key(q),
        Destination::Exchange(e) => v.exchanges.contains_key(e),
    };
    if !exists {
        return Err(v.not_found(b.destination.kind(), b.destination.name()));
    }
    Ok(())
}

/// Every queue name in the state, sorted, for listings.
pub fn queue_names(state: &MetaState) -> BTreeSet<(String, String)> {
    state
        .vhosts
        .values()
        .flat_map(|v| v.queues.keys().map(|q| (v.name.clone(), q.clone())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> MetaState {
        let mut s = MetaState::default();
        s.apply(&Command::AddVhost { name: "/".into() }).unwrap();
        s
    }

    fn queue(name: &str) -> QueueDef {
        QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable: false,
            exclusive_owner: None,
            auto_delete: false,
            arguments: FieldTable::default(),
            home: 0,
        }
    }

    fn exchange(name: &str, auto_delete: bool) -> ExchangeDef {
        ExchangeDef {
            vhost: "/".into(),
            name: name.into(),
            kind: ExchangeKind::Fanout,
            durable: false,
            auto_delete,
            internal: false,
            arguments: FieldTable::default(),
        }
    }

    fn bind(source: &str, queue: &str) -> Binding {
        Binding {
            vhost: "/".into(),
            source: source.into(),
            destination: Destination::Queue(queue.into()),
            routing_key: String::new(),
            arguments: FieldTable::default(),
        }
    }

    #[test]
    fn new_vhost_has_the_standard_exchanges() {
        let s = state();
        let v = s.vhost("/").unwrap();
        for n in [
            "",
            "amq.direct",
            "amq.fanout",
            "amq.topic",
            "amq.headers",
            "amq.match",
        ] {
            assert!(v.exchanges.contains_key(n), "{n}");
        }
    }

    fn set_limits(scope: LimitScope, name: &str, value: i64, replace: bool) -> Command {
        Command::SetLimits {
            scope,
            limits: [(name.to_string(), value)].into(),
            replace,
        }
    }

    #[test]
    fn max_queues_refuses_new_queues_only_with_rabbitmqs_text() {
        let mut s = state();
        s.apply(&Command::DeclareQueue(queue("a"))).unwrap();
        let vhost = || LimitScope::Vhost("/".into());
        s.apply(&set_limits(vhost(), limits::MAX_QUEUES, 1, true))
            .unwrap();
        let err = s.apply(&Command::DeclareQueue(queue("b"))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot declare queue 'b': queue limit in vhost '/' (1) is reached"
        );
        assert_eq!(
            crate::amqp::AmqpError::from(err).code,
            crate::amqp::ReplyCode::PreconditionFailed
        );
        // Redeclaring an existing queue is no new queue.
        assert!(!s.apply(&Command::DeclareQueue(queue("a"))).unwrap().created);
        // Negative: no limit. Zero: none at all.
        s.apply(&set_limits(vhost(), limits::MAX_QUEUES, -1, false))
            .unwrap();
        s.apply(&Command::DeclareQueue(queue("b"))).unwrap();
        s.apply(&set_limits(vhost(), limits::MAX_QUEUES, 0, false))
            .unwrap();
        let err = s.apply(&Command::DeclareQueue(queue("c"))).unwrap_err();
        assert!(err.to_string().ends_with("(0) is reached"), "{err}");
    }

    #[test]
    fn limits_merge_replace_clear_and_go_with_their_owner() {
        let mut s = state();
        s.apply(&Command::PutUser(User {
            name: "u".into(),
            password: "pw".into(),
            tags: Vec::new(),
        }))
        .unwrap();
        let user = || LimitScope::User("u".into());
        s.apply(&set_limits(user(), limits::MAX_CHANNELS, 5, false))
            .unwrap();
        s.apply(&set_limits(user(), limits::MAX_CONNECTIONS, 2, false))
            .unwrap();
        assert_eq!(s.user_limits["u"].len(), 2, "updates merge");
        s.apply(&Command::ClearLimits {
            scope: user(),
            name: Some(limits::MAX_CHANNELS.into()),
        })
        .unwrap();
        assert_eq!(s.user_limit("u", limits::MAX_CHANNELS), None);
        assert_eq!(s.user_limit("u", limits::MAX_CONNECTIONS), Some(2));
        s.apply(&set_limits(user(), limits::MAX_CHANNELS, 1, true))
            .unwrap();
        assert_eq!(s.user_limits["u"].len(), 1, "replace drops the others");
        assert!(s
            .apply(&set_limits(user(), limits::MAX_QUEUES, 1, false))
            .is_err());
        assert!(s
            .apply(&set_limits(
                LimitScope::User("nobody".into()),
                limits::MAX_CHANNELS,
                1,
                false
            ))
            .is_err());
        assert!(matches!(
            s.apply(&set_limits(
                LimitScope::Vhost("nope".into()),
                limits::MAX_QUEUES,
                1,
                false
            )),
            Err(MetaError::NoVhost(_))
        ));
        s.apply(&Command::DeleteUser { name: "u".into() }).unwrap();
        assert!(s.user_limits.is_empty());
        s.apply(&Command::AddVhost { name: "v".into() }).unwrap();
        s.apply(&set_limits(
            LimitScope::Vhost("v".into()),
            limits::MAX_CONNECTIONS,
            3,
            true,
        ))
        .unwrap();
        s.apply(&Command::DeleteVhost { name: "v".into() }).unwrap();
        assert!(s.vhost_limits.is_empty());
    }

    #[test]
    fn clear_permissions_removes_one_users_permissions_on_one_vhost() {
        let mut s = state();
        s.apply(&Command::AddVhost { name: "v2".into() }).unwrap();
        s.apply(&Command::PutUser(User {
            name: "u".into(),
            password: "pw".into(),
            tags: Vec::new(),
        }))
        .unwrap();
        for vhost in ["/", "v2"] {
            s.apply(&Command::SetPermissions(Permission {
                user: "u".into(),
                vhost: vhost.into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }))
            .unwrap();
        }
        let clear = Command::ClearPermissions {
            user: "u".into(),
            vhost: "v2".into(),
        };
        s.apply(&clear).unwrap();
        assert!(s.permission("u", "v2").is_none());
        assert!(s.permission("u", "/").is_some());
        // None left there: nothing to do, as `rabbitmqctl clear_permissions`.
        s.apply(&clear).unwrap();
        assert_eq!(s.permissions.len(), 1);
    }

    #[test]
    fn refused_command_changes_nothing() {
        let mut s = state();
        s.apply(&Command::DeclareQueue(queue("q"))).unwrap();
        let before = s.clone();
        let mut q = queue("q");
        q.durable = true;
        let err = s.apply(&Command::DeclareQueue(q)).unwrap_err();
        assert!(matches!(err, MetaError::Inequivalent { .. }), "{err:?}");
        assert_eq!(s, before);
        let err = s.apply(&Command::Bind(bind("nope", "q"))).unwrap_err();
        assert!(matches!(
            err,
            MetaError::NotFound {
                kind: "exchange",
                ..
            }
        ));
        assert_eq!(s, before);
    }

    #[test]
    fn exclusive_queue_of_another_owner_is_locked() {
        let mut s = state();
        let mut q = queue("x");
        q.exclusive_owner = Some(1);
        s.apply(&Command::DeclareQueue(q.clone())).unwrap();
        q.exclusive_owner = Some(2);
        let err = s.apply(&Command::DeclareQueue(q)).unwrap_err();
        assert!(matches!(err, MetaError::Locked { .. }));
        let applied = s
            .apply(&Command::DeleteExclusiveQueues { owner: 1 })
            .unwrap();
        assert_eq!(
            applied.removed.queues,
            vec![("/".to_string(), "x".to_string())]
        );
    }

    #[test]
    fn deleting_a_queue_cascades_to_auto_delete_exchanges() {
        let mut s = state();
        s.apply(&Command::DeclareQueue(queue("q"))).unwrap();
        s.apply(&Command::DeclareExchange(exchange("ad", true)))
            .unwrap();
        s.apply(&Command::Bind(bind("ad", "q"))).unwrap();
        let applied = s
            .apply(&Command::DeleteQueue {
                vhost: "/".into(),
                name: "q".into(),
            })
            .unwrap();
        assert_eq!(applied.removed.exchanges, vec!["ad".to_string()]);
        assert!(!s.vhost("/").unwrap().exchanges.contains_key("ad"));
    }

    #[test]
    fn delete_exchange_if_unused_refuses_a_bound_exchange() {
        let mut s = state();
        s.apply(&Command::DeclareQueue(queue("q"))).unwrap();
        s.apply(&Command::DeclareExchange(exchange("e", false)))
            .unwrap();
        s.apply(&Command::Bind(bind("e", "q"))).unwrap();
        let cmd = Command::DeleteExchange {
            vhost: "/".into(),
            name: "e".into(),
            if_unused: true,
        };
        assert!(matches!(s.apply(&cmd), Err(MetaError::InUse(_))));
    }

    #[test]
    fn bind_is_idempotent() {
        let mut s = state();
        s.apply(&Command::DeclareQueue(queue("q"))).unwrap();
        assert!(
            s.apply(&Command::Bind(bind("amq.fanout", "q")))
                .unwrap()
                .created
        );
        assert!(
            !s.apply(&Command::Bind(bind("amq.fanout", "q")))
                .unwrap()
                .created
        );
        assert_eq!(s.vhost("/").unwrap().bindings_from("amq.fanout").len(), 1);
    }

    fn node(id: NodeId) -> NodeRecord {
        NodeRecord {
            id,
            name: format!("n{id}"),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        }
    }

    /// Queues on nodes 1 and 2: durable, transient, and exclusive to a connection of node 1
    /// (but homed on node 2, as a client-local declare on node 1 never is; the owner counts).
    fn two_node_state() -> MetaState {
        let mut s = state();
        for id in [1, 2] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        for (name, durable, owner, home) in [
            ("d1", true, None, 1),
            ("t1", false, None, 1),
            ("d2", true, None, 2),
            ("t2", false, None, 2),
            ("x", false, Some((1u64 << 40) | 5), 2),
        ] {
            let mut q = queue(name);
            q.durable = durable;
            q.exclusive_owner = owner;
            q.home = home;
            s.apply(&Command::DeclareQueue(q)).unwrap();
        }
        s.apply(&Command::Bind(bind("amq.fanout", "t1"))).unwrap();
        s
    }

    fn queue_names(s: &MetaState) -> Vec<&str> {
        s.vhost("/")
            .unwrap()
            .queues
            .keys()
            .map(|k| k.as_str())
            .collect()
    }

    #[test]
    fn a_node_going_down_takes_its_transient_and_exclusive_queues() {
        let mut s = two_node_state();
        let applied = s.apply(&Command::NodeDown { id: 1 }).unwrap();
        assert_eq!(queue_names(&s), ["d1", "d2", "t2"]);
        let mut removed: Vec<&str> = applied
            .removed
            .queues
            .iter()
            .map(|(_, q)| q.as_str())
            .collect();
        removed.sort();
        assert_eq!(removed, ["t1", "x"]);
        assert!(s.vhost("/").unwrap().bindings_from("amq.fanout").is_empty());
        assert!(s.nodes.contains_key(&1), "a down node is still a member");
    }

    #[test]
    fn forgetting_a_node_takes_every_queue_on_it() {
        let mut s = two_node_state();
        s.apply(&Command::ForgetNode { id: 2 }).unwrap();
        assert_eq!(queue_names(&s), ["d1", "t1"]);
        assert_eq!(s.nodes.keys().copied().collect::<Vec<_>>(), [1]);
        let before = s.clone();
        assert!(s.apply(&Command::ForgetNode { id: 2 }).is_err());
        assert!(s.apply(&Command::RegisterNode(node(0))).is_err());
        assert!(
            s.apply(&Command::RegisterNode(node(2))).is_err(),
            "a forgotten id is not reused"
        );
        assert_eq!(s, before, "refused commands change nothing");
    }

    #[test]
    fn the_home_node_is_not_part_of_queue_equivalence() {
        let mut s = two_node_state();
        let mut again = queue("d2");
        again.durable = true;
        again.home = 1;
        assert!(!s.apply(&Command::DeclareQueue(again)).unwrap().created);
        assert_eq!(s.vhost("/").unwrap().queues["d2"].home, 2);
    }

    #[test]
    fn gm_group_records_change_only_by_compare_and_set() {
        use crate::gm::{MemberId, Slot};
        let a = MemberId { node: 1, since: 0 };
        let b = MemberId { node: 2, since: 1 };
        let set = |expected_version: u64, members: Vec<Slot>| Command::GmGroup {
            name: "q".into(),
            expected_version,
            members,
        };
        let mut s = state();
        assert!(s.apply(&set(0, vec![Slot::Alive(a)])).unwrap().created);
        assert_eq!(s.gm_groups["q"].version, 1);
        // Two members computed a change from version 1; only the first one applies.
        s.apply(&set(1, vec![Slot::Alive(a), Slot::Alive(b)]))
            .unwrap();
        let before = s.clone();
        assert!(s
            .apply(&set(1, vec![Slot::Dead(a), Slot::Alive(b)]))
            .is_err());
        assert!(s
            .apply(&set(2, vec![Slot::Alive(a), Slot::Alive(a)]))
            .is_err());
        assert_eq!(s, before, "refused changes change nothing");
        s.apply(&set(2, vec![Slot::Dead(a), Slot::Alive(b)]))
            .unwrap();
        assert_eq!(s.gm_groups["q"].version, 3);
        assert_eq!(s.gm_groups["q"].members, [Slot::Dead(a), Slot::Alive(b)]);
        s.apply(&Command::GmForget { name: "q".into() }).unwrap();
        assert!(s.gm_groups.is_empty());
        assert!(s.apply(&Command::GmForget { name: "q".into() }).is_err());
    }

    #[test]
    fn mirror_sets_change_by_compare_and_set_and_promotion_moves_the_home() {
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        let mut q = queue("m");
        q.durable = true;
        q.home = 1;
        s.apply(&Command::DeclareQueue(q)).unwrap();
        let mirror = |node, synchronised| MirrorRecord {
            node,
            since: 0,
            synchronised,
        };
        let set = |expected_version, mirrors: Vec<MirrorRecord>| Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version,
            mirrors,
        };
        let key = ("/".to_string(), "m".to_string());
        let before = s.version;
        s.apply(&set(0, vec![mirror(2, false)])).unwrap();
        assert_eq!(s.mirror_sets[&key].version, 1);
        assert_eq!(
            s.mirror_sets[&key].mirrors[0].since, before,
            "age set by the state"
        );
        // Refused: a stale version, the master as a mirror, an unknown node, a duplicate.
        for bad in [
            set(0, vec![mirror(3, false)]),
            set(1, vec![mirror(1, false)]),
            set(1, vec![mirror(9, false)]),
            set(1, vec![mirror(3, false), mirror(3, true)]),
        ] {
            let copy = s.clone();
            assert!(s.apply(&bad).is_err(), "{bad:?}");
            assert_eq!(s, copy, "a refused change changes nothing");
        }
        s.apply(&set(1, vec![mirror(2, true), mirror(3, false)]))
            .unwrap();
        let m = &s.mirror_sets[&key];
        assert_eq!(
            m.mirrors[0].since, before,
            "an existing mirror keeps its age"
        );
        assert!(m.mirrors[1].since > before);
        assert!(m.mirrors[0].synchronised);
        // Promotion: only at the current epoch, only a mirror; the home moves.
        let promote = |expected_epoch, node| Command::PromoteMirror {
            vhost: "/".into(),
            queue: "m".into(),
            expected_epoch,
            node,
        };
        assert!(s.apply(&promote(0, 1)).is_err(), "node 1 is the master");
        assert!(s.apply(&promote(1, 2)).is_err(), "stale epoch");
        s.apply(&promote(0, 2)).unwrap();
        assert_eq!(s.vhost("/").unwrap().queues["m"].home, 2);
        let m = &s.mirror_sets[&key];
        assert_eq!((m.epoch, m.version), (1, 3));
        assert_eq!(m.mirrors.iter().map(|r| r.node).collect::<Vec<_>>(), [3]);
        assert!(
            s.apply(&promote(0, 3)).is_err(),
            "a second promotion decided at the old epoch is refused"
        );
        // Exclusive queues are never mirrored; a deleted queue's set goes with it.
        let mut x = queue("x");
        x.exclusive_owner = Some((1u64 << 40) | 1);
        x.home = 1;
        s.apply(&Command::DeclareQueue(x)).unwrap();
        let refused = Command::SetMirrors {
            vhost: "/".into(),
            queue: "x".into(),
            expected_version: 0,
            mirrors: vec![mirror(2, false)],
        };
        assert!(s.apply(&refused).is_err());
        s.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "m".into(),
        })
        .unwrap();
        assert!(s.mirror_sets.is_empty());
    }

    /// Nodes 1-3 and the durable queue `m` mastered on node 1 with mirrors on nodes 2 and 3
    /// (both `synchronised` or neither); the state and the queue's key.
    fn mirrored_m(synchronised: bool) -> (MetaState, (String, String)) {
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        let mut q = queue("m");
        q.durable = true;
        q.home = 1;
        s.apply(&Command::DeclareQueue(q)).unwrap();
        let mirror = |node| MirrorRecord {
            node,
            since: 0,
            synchronised,
        };
        s.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version: 0,
            mirrors: vec![mirror(2), mirror(3)],
        })
        .unwrap();
        (s, ("/".to_string(), "m".to_string()))
    }

    /// A promotion decided because the mirror was synchronised is refused if, by the time
    /// it commits, the mirror's node restarted (a new incarnation: its copy is gone).
    #[test]
    fn a_synced_promotion_is_refused_once_the_mirrors_node_restarted() {
        let (mut s, key) = mirrored_m(true);
        // Decided while both mirrors are synchronised.
        let to2 = Command::promote("/", "m", &s.mirror_sets[&key], 2);
        let to3 = Command::promote("/", "m", &s.mirror_sets[&key], 3);
        assert!(matches!(to2, Command::PromoteSyncedMirror { node: 2, .. }));
        // Node 2 restarts before the promotion commits.
        s.apply(&Command::RegisterNode(NodeRecord {
            incarnation: 7,
            ..node(2)
        }))
        .unwrap();
        let copy = s.clone();
        let err = s.apply(&to2).expect_err("node 2's copy is gone");
        assert!(err.to_string().contains("no longer synchronised"), "{err}");
        assert_eq!(s, copy, "a refused promotion changes nothing");
        // Node 3 still is synchronised: its promotion goes through.
        s.apply(&to3).unwrap();
        assert_eq!(s.vhost("/").unwrap().queues["m"].home, 3);
        // A deliberate promotion of an unsynchronised mirror stays possible.
        let set = &s.mirror_sets[&key];
        assert!(matches!(
            Command::promote("/", "m", set, 2),
            Command::PromoteMirror { node: 2, .. }
        ));
        s.apply(&Command::promote("/", "m", set, 2)).unwrap();
        assert_eq!(s.vhost("/").unwrap().queues["m"].home, 2);
    }

    #[test]
    fn a_mirror_is_synchronised_only_while_the_member_that_acknowledged_its_sync_lives() {
        use crate::gm::{MemberId, Slot};
        let (mut s, key) = mirrored_m(false);
        let incarnation = s.mirror_sets[&key].incarnation;
        let group = mirror_group_name("/", "m", incarnation);
        let (master, old, new, three) = (
            MemberId { node: 1, since: 1 },
            MemberId { node: 2, since: 2 },
            MemberId { node: 2, since: 5 },
            MemberId { node: 3, since: 3 },
        );
        let ring = |s: &mut MetaState, members: Vec<Slot>| {
            let expected_version = s.gm_groups.get(&group).map_or(0, |g| g.version);
            s.apply(&Command::GmGroup {
                name: group.clone(),
                expected_version,
                members,
            })
            .unwrap();
        };
        ring(
            &mut s,
            vec![Slot::Alive(master), Slot::Alive(old), Slot::Alive(three)],
        );
        let mark = |member, epoch| Command::MarkSynchronised {
            vhost: "/".into(),
            queue: "m".into(),
            incarnation,
            epoch,
            member,
        };
        let synced = |s: &MetaState, node| {
            s.mirror_sets[&key]
                .mirrors
                .iter()
                .any(|m| m.node == node && m.synchronised)
        };
        // The master vouches for node 2's member `old` (the one that acknowledged).
        let late = mark(old, 0);
        s.apply(&mark(three, 0)).unwrap();
        assert!(s.apply(&mark(old, 1)).is_err(), "another epoch's master");
        s.apply(&late).unwrap();
        assert!(synced(&s, 2) && synced(&s, 3));
        // Erasing a dead alias changes no node's live members.
        ring(
            &mut s,
            vec![
                Slot::Alive(master),
                Slot::Alive(old),
                Slot::Alive(three),
                Slot::Dead(MemberId { node: 3, since: 0 }),
            ],
        );
        ring(
            &mut s,
            vec![Slot::Alive(master), Slot::Alive(old), Slot::Alive(three)],
        );
        assert!(synced(&s, 2) && synced(&s, 3));
        // `old`'s copy failed: it leaves (recorded dead), and node 2 joins again.
        ring(
            &mut s,
            vec![Slot::Alive(master), Slot::Dead(old), Slot::Alive(three)],
        );
        assert!(!synced(&s, 2), "its member died: no longer synchronised");
        assert!(synced(&s, 3), "another node's mirror is untouched");
        ring(
            &mut s,
            vec![
                Slot::Alive(master),
                Slot::Dead(old),
                Slot::Alive(three),
                Slot::Alive(new),
            ],
        );
        // The master's proposal for `old`, whose outcome it never learnt, commits now.
        let copy = s.clone();
        let err = s.apply(&late).expect_err("`old` is dead");
        assert!(err.to_string().contains("is gone"), "{err}");
        assert_eq!(s, copy, "a refused record changes nothing");
        assert!(!synced(&s, 2), "node 2's new member holds nothing yet");
        // Once `new` acknowledges its own sync, it is synchronised again.
        s.apply(&mark(new, 0)).unwrap();
        assert!(synced(&s, 2));
        // A second member of the node joining (a late join nobody runs) unsynchronises too.
        let zombie = MemberId { node: 2, since: 9 };
        ring(
            &mut s,
            vec![
                Slot::Alive(master),
                Slot::Alive(three),
                Slot::Alive(new),
                Slot::Alive(zombie),
            ],
        );
        assert!(!synced(&s, 2));
        // Another queue's group changes nothing here.
        let mut other = s.clone();
        other
            .apply(&Command::GmGroup {
                name: mirror_group_name("/", "n", incarnation),
                expected_version: 0,
                members: vec![Slot::Alive(three)],
            })
            .unwrap();
        assert_eq!(other.mirror_sets, s.mirror_sets);
    }

    #[test]
    fn a_queue_declared_again_is_a_new_incarnation_with_its_own_epochs() {
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        let key = ("/".to_string(), "m".to_string());
        let declare = |s: &mut MetaState, home| {
            let mut q = queue("m");
            q.durable = true;
            q.home = home;
            s.apply(&Command::DeclareQueue(q)).unwrap();
        };
        let set = |expected_version| Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version,
            mirrors: vec![MirrorRecord {
                node: 2,
                since: 0,
                synchronised: true,
            }],
        };
        declare(&mut s, 3);
        s.apply(&set(0)).unwrap();
        let first = s.mirror_sets[&key].incarnation;
        assert_ne!(first, 0, "a created set has an incarnation");
        s.apply(&Command::PromoteMirror {
            vhost: "/".into(),
            queue: "m".into(),
            expected_epoch: 0,
            node: 2,
        })
        .unwrap();
        assert_eq!(
            s.mirror_sets[&key].incarnation, first,
            "a promotion keeps the incarnation"
        );
        s.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "m".into(),
        })
        .unwrap();
        declare(&mut s, 1);
        s.apply(&set(0)).unwrap();
        let again = &s.mirror_sets[&key];
        assert!(
            again.incarnation > first,
            "the queue declared again is another incarnation"
        );
        assert_eq!(
            (again.epoch, again.version),
            (0, 1),
            "its epochs start over: only the incarnation tells them apart"
        );
    }

    #[test]
    fn forgetting_a_node_kills_its_gm_members_and_moves_its_mirrored_queues() {
        use crate::gm::{MemberId, Slot};
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        s.apply(&Command::SetPolicy {
            policy: crate::meta::policy::Policy {
                vhost: "/".into(),
                name: "ha".into(),
                pattern: "^m".into(),
                compiled: Default::default(),
                apply_to: crate::meta::policy::ApplyTo::Queues,
                priority: 0,
                definition: [(
                    "ha-mode".to_string(),
                    crate::meta::policy::PolicyValue::Str("all".into()),
                )]
                .into_iter()
                .collect(),
            },
            operator: false,
        })
        .unwrap();
        let mut q = queue("m");
        q.durable = true;
        q.home = 3;
        s.apply(&Command::DeclareQueue(q)).unwrap();
        let mirror = |node, synchronised| MirrorRecord {
            node,
            since: 0,
            synchronised,
        };
        s.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version: 0,
            mirrors: vec![mirror(1, false), mirror(2, true)],
        })
        .unwrap();
        let m = |node| MemberId { node, since: 1 };
        s.apply(&Command::GmGroup {
            name: "g".into(),
            expected_version: 0,
            members: vec![Slot::Alive(m(1)), Slot::Alive(m(3))],
        })
        .unwrap();
        s.apply(&Command::ForgetNode { id: 3 }).unwrap();
        assert_eq!(
            s.vhost("/").unwrap().queues["m"].home,
            2,
            "the durable queue moved to its synchronised mirror instead of going"
        );
        assert_eq!(
            s.gm_groups["g"].members,
            [Slot::Alive(m(1)), Slot::Dead(m(3))],
            "the forgotten node's member is dead: no NodeDown will come for it"
        );
    }

    #[test]
    fn a_node_down_or_restarted_kills_its_gm_members_in_every_group() {
        use crate::gm::{MemberId, Slot};
        let m = |node, since| MemberId { node, since };
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        let group = |name: &str, members: Vec<Slot>| Command::GmGroup {
            name: name.into(),
            expected_version: 0,
            members,
        };
        s.apply(&group(
            "a",
            vec![Slot::Alive(m(1, 1)), Slot::Alive(m(2, 1))],
        ))
        .unwrap();
        s.apply(&group("b", vec![Slot::Alive(m(3, 1))])).unwrap();
        s.apply(&Command::NodeDown { id: 2 }).unwrap();
        assert_eq!(s.gm_groups["a"].version, 2);
        assert_eq!(
            s.gm_groups["a"].members,
            [Slot::Alive(m(1, 1)), Slot::Dead(m(2, 1))]
        );
        assert_eq!(
            s.gm_groups["b"].version, 1,
            "untouched groups keep their version"
        );
        // Registering the same incarnation again changes nothing; a new one is a restart.
        s.apply(&Command::RegisterNode(node(3))).unwrap();
        assert_eq!(s.gm_groups["b"].members, [Slot::Alive(m(3, 1))]);
        let mut restarted = node(3);
        restarted.incarnation = 7;
        s.apply(&Command::RegisterNode(restarted)).unwrap();
        assert_eq!(s.gm_groups["b"].members, [Slot::Dead(m(3, 1))]);
        assert_eq!(s.gm_groups["b"].version, 2);
    }

    #[test]
    fn a_mirror_whose_node_goes_down_or_restarts_is_no_longer_synchronised() {
        let mut s = state();
        for id in [1, 2, 3] {
            s.apply(&Command::RegisterNode(node(id))).unwrap();
        }
        let mut q = queue("m");
        q.durable = true;
        q.home = 1;
        s.apply(&Command::DeclareQueue(q)).unwrap();
        let synced = |node| MirrorRecord {
            node,
            since: 0,
            synchronised: true,
        };
        s.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version: 0,
            mirrors: vec![synced(2), synced(3)],
        })
        .unwrap();
        let key = ("/".to_string(), "m".to_string());
        let flags = |s: &MetaState| {
            s.mirror_sets[&key]
                .mirrors
                .iter()
                .map(|m| (m.node, m.synchronised))
                .collect::<Vec<_>>()
        };
        s.apply(&Command::NodeDown { id: 2 }).unwrap();
        assert_eq!(flags(&s), [(2, false), (3, true)]);
        assert_eq!(s.mirror_sets[&key].version, 2, "a change other CAS see");
        let mut restarted = node(3);
        restarted.incarnation = 9;
        s.apply(&Command::RegisterNode(restarted)).unwrap();
        assert_eq!(flags(&s), [(2, false), (3, false)]);
        // The master's node going down leaves its mirrors as they were (they are the
        // candidates for its promotion).
        s.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version: 3,
            mirrors: vec![synced(2), synced(3)],
        })
        .unwrap();
        s.apply(&Command::NodeDown { id: 1 }).unwrap();
        assert_eq!(flags(&s), [(2, true), (3, true)]);
    }

    #[test]
    fn a_rabbitmq_password_hash_checks_like_the_password() {
        let plain = User {
            name: "alice".into(),
            password: "s3cret".into(),
            tags: vec![],
        };
        let (hash, algorithm) = plain.password_hash();
        assert_eq!(algorithm, Hashing::Sha256);
        assert_eq!(hash, plain.password_hash().0, "the export is stable");
        let hashed = User {
            password: User::stored_hash(&hash, Hashing::Sha256).expect("a valid hash"),
            ..plain.clone()
        };
        assert!(hashed.password_matches("s3cret"));
        assert!(!hashed.password_matches("s3cres"));
        assert!(!hashed.password_matches(&hashed.password));
        assert_eq!(hashed.password_hash(), (hash.clone(), Hashing::Sha256));
        assert_eq!(User::stored_hash("not base64!", Hashing::Sha256), None);
        assert_eq!(User::stored_hash("c2hvcnQ=", Hashing::Sha256), None);
        assert_eq!(User::stored_hash(&hash, Hashing::Sha512), None, "too short");
        let none = User {
            password: User::no_password(),
            ..plain
        };
        assert!(!none.password_matches("") && !none.password_matches(&User::no_password()));
        assert_eq!(none.password_hash().0, "");
    }

    /// The stored form is RabbitMQ's: a fresh 4-byte salt, then SHA-256(salt ‖ password),
    /// in base64 (checked against a digest computed here, not by the code under test).
    #[test]
    fn passwords_are_stored_salted_and_hashed_never_plain() {
        let stored = User::hash_password("guest", [7, 7, 7, 7]);
        assert!(!stored.contains("guest"));
        assert_ne!(stored, User::hash_password("guest", [7, 7, 7, 8]), "salted");
        let user = User {
            name: "guest".into(),
            password: stored,
            tags: vec![],
        };
        assert!(user.password_matches("guest") && !user.password_matches("Guest"));
        use base64::Engine;
        let fixed = User::hash_password("guest", [1, 2, 3, 4]);
        let b64 = fixed.rsplit(':').next().expect("a hash");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64");
        assert_eq!(&raw[..4], &[1, 2, 3, 4]);
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update([1u8, 2, 3, 4]);
        h.update(b"guest");
        assert_eq!(&raw[4..], h.finalize().as_slice());
    }

    #[test]
    fn a_sha512_hash_from_rabbitmq_is_accepted() {
        use base64::Engine;
        use sha2::Digest;
        let salt = [9u8, 8, 7, 6];
        let mut h = sha2::Sha512::new();
        h.update(salt);
        h.update(b"s3cret");
        let mut raw = salt.to_vec();
        raw.extend(h.finalize());
        let b64 = base64::engine::general_purpose::STANDARD.encode(raw);
        let user = User {
            name: "bob".into(),
            password: User::stored_hash(&b64, Hashing::Sha512).expect("a sha512 hash"),
            tags: vec![],
        };
        assert!(user.password_matches("s3cret") && !user.password_matches("s3cre"));
        assert_eq!(user.password_hash(), (b64, Hashing::Sha512));
        assert_eq!(
            Hashing::named("rabbit_password_hashing_sha512"),
            Some(Hashing::Sha512)
        );
        assert_eq!(Hashing::named("rabbit_password_hashing_md5"), None);
    }
}

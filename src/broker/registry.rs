//! The node's live sessions — open connections, their channels and consumers — as the
//! sessions that own them publish them, so `warrenctl list_connections`, `list_channels` and
//! `list_consumers` can read them without asking the connection tasks.
//!
//! Each session writes only its own entry and the admin side only reads, so what changes
//! rarely (a connection opening, a channel opening or closing, a consumer added or
//! cancelled) goes through a mutex, while the counters that move with traffic (unacked,
//! unconfirmed) are relaxed atomics the channel stores when they change: the per-message path
//! takes no lock and never waits for a reader. A listing is a consistent view per channel
//! at best, like RabbitMQ's, which also asks each channel process in turn.
//!
//! Entries are removed by dropping their handle ([`ConnectionHandle`], [`ChannelHandle`]),
//! so a session that ends any way at all leaves nothing behind.
//!
//! The registry also enforces RabbitMQ's connection and channel limits of vhosts and users
//! ([`Registry::register_within`], [`ConnectionHandle::open_channel_within`]): it counts and
//! adds under one lock, so two sessions opening at once cannot both take the last place.
//! The counts are this node's sessions plus what the other nodes of a cluster last reported
//! ([`Registry::set_elsewhere`], refreshed by the runtime about every second while a
//! connection or channel limit exists), so across a cluster a limit can be passed by the
//! connections opened during one refresh (see `docs/security.md`).
//!
//! Locks here are leaves: nothing else is locked while one is held, except that a channel
//! open under a user limit holds the connections lock while it reads each connection's
//! channels (always in that order; nothing locks a connection's channels and then the
//! connections).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::outbox::{OutItem, Outbox};
use amq_protocol::types::FieldTable;
use serde::{Deserialize, Serialize};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Entries are plain data replaced whole; a panic elsewhere cannot leave one half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a connection is, fixed once it is open.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConnectionInfo {
    /// Connection id (unique in the cluster, see [`super::Broker::next_connection_id`]).
    pub id: u64,
    /// Authenticated user.
    pub user: String,
    /// Vhost it opened.
    pub vhost: String,
    /// Client address (IP text, IPv6 without brackets).
    pub peer_host: String,
    /// Client port.
    pub peer_port: u16,
    /// The node's end of the socket (IP text).
    pub host: String,
    /// The node's port.
    pub port: u16,
    /// Negotiated heartbeat (seconds, 0: none).
    pub timeout_s: u16,
    /// Negotiated frame_max.
    pub frame_max: u32,
    /// Negotiated channel_max.
    pub channel_max: u16,
    /// What the client sent in connection.start-ok.
    pub client_properties: FieldTable,
    /// The SASL mechanism it logged in with (`PLAIN`, `AMQPLAIN`, `EXTERNAL`).
    pub auth_mechanism: String,
    /// The TLS session, for a client on the TLS listener.
    pub ssl: Option<SslInfo>,
    /// When the socket was accepted, in milliseconds since the Unix epoch (RabbitMQ's
    /// `connected_at`).
    pub connected_at: u64,
}

/// A connection's socket traffic, counted by the task that reads and writes the socket
/// (relaxed atomics: one add per read or write call, never per message).
#[derive(Debug, Default)]
pub struct SocketCounters {
    recv_oct: AtomicU64,
    recv_cnt: AtomicU64,
    send_oct: AtomicU64,
    send_cnt: AtomicU64,
}

impl SocketCounters {
    /// One read of `n` bytes.
    pub fn received(&self, n: usize) {
        self.recv_oct.fetch_add(n as u64, Ordering::Relaxed);
        self.recv_cnt.fetch_add(1, Ordering::Relaxed);
    }

    /// One write of `n` bytes.
    pub fn sent(&self, n: usize) {
        self.send_oct.fetch_add(n as u64, Ordering::Relaxed);
        self.send_cnt.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn stats(&self) -> SocketStats {
        SocketStats {
            recv_oct: self.recv_oct.load(Ordering::Relaxed),
            recv_cnt: self.recv_cnt.load(Ordering::Relaxed),
            send_oct: self.send_oct.load(Ordering::Relaxed),
            send_cnt: self.send_cnt.load(Ordering::Relaxed),
        }
    }
}

/// A connection's socket traffic as a listing reads it, in RabbitMQ's terms: octets and
/// socket operations received and sent since the connection was accepted (the handshake,
/// and TLS's own records for a TLS client, included: these count the decrypted stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketStats {
    /// Bytes read.
    pub recv_oct: u64,
    /// Reads that returned bytes.
    pub recv_cnt: u64,
    /// Bytes written.
    pub send_oct: u64,
    /// Writes.
    pub send_cnt: u64,
}

/// A connection's TLS session, as the listings show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SslInfo {
    /// `tlsv1.3` or `tlsv1.2`.
    pub protocol: String,
    /// The bulk cipher (`aes_256_gcm`).
    pub cipher: String,
    /// The key exchange (`ecdhe_rsa`; `any` under TLS 1.3).
    pub key_exchange: String,
    /// The MAC (`aead`).
    pub hash: String,
    /// The verified client certificate's subject, if the client gave one.
    pub peer_cert_subject: Option<String>,
    /// Its issuer.
    pub peer_cert_issuer: Option<String>,
    /// Its validity (`{not before} - {not after}`).
    pub peer_cert_validity: Option<String>,
}

impl ConnectionInfo {
    /// RabbitMQ's connection name: `PEER:PORT -> HOST:PORT`, IPv6 addresses in brackets.
    pub fn name(&self) -> String {
        fn addr(host: &str, port: u16) -> String {
            if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            }
        }
        format!(
            "{} -> {}",
            addr(&self.peer_host, self.peer_port),
            addr(&self.host, self.port)
        )
    }
}

/// A connection's flow state, as `list_connections` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConnectionState {
    /// Open and read.
    Running,
    /// The memory alarm is on, but the connection has not published since: still read.
    Blocking,
    /// It published under the alarm: not read until the alarm clears.
    Blocked,
}

impl ConnectionState {
    /// The name RabbitMQ uses.
    pub fn name(self) -> &'static str {
        match self {
            ConnectionState::Running => "running",
            ConnectionState::Blocking => "blocking",
            ConnectionState::Blocked => "blocked",
        }
    }

    fn from_u8(v: u8) -> ConnectionState {
        match v {
            1 => ConnectionState::Blocking,
            2 => ConnectionState::Blocked,
            _ => ConnectionState::Running,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            ConnectionState::Running => 0,
            ConnectionState::Blocking => 1,
            ConnectionState::Blocked => 2,
        }
    }
}

/// One consumer, as `list_consumers` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConsumerInfo {
    /// Consumer tag.
    pub tag: String,
    /// Queue consumed from (in the connection's vhost).
    pub queue: String,
    /// Whether deliveries must be acknowledged (not no-ack).
    pub ack_required: bool,
    /// The channel's per-consumer prefetch when it subscribed (0: unlimited).
    pub prefetch: u32,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// basic.consume arguments.
    pub arguments: FieldTable,
}

#[derive(Debug)]
struct ChannelEntry {
    number: u16,
    prefetch: AtomicU32,
    global_prefetch: AtomicU32,
    unacked: AtomicU64,
    unconfirmed: AtomicU64,
    confirm: AtomicBool,
    transactional: AtomicBool,
    consumers: Mutex<BTreeMap<String, ConsumerInfo>>,
}

#[derive(Debug)]
struct ConnectionEntry {
    info: ConnectionInfo,
    state: AtomicU8,
    socket: Arc<SocketCounters>,
    channels: Mutex<BTreeMap<u16, Arc<ChannelEntry>>>,
    /// Where an operator's close is sent ([`Registry::close`]).
    outbox: Weak<Outbox>,
}

/// A channel as read by a listing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChannelView {
    /// Channel number.
    pub number: u16,
    /// `basic.qos` per-consumer prefetch.
    pub prefetch: u32,
    /// `basic.qos global=true` prefetch.
    pub global_prefetch: u32,
    /// Delivered, not yet acknowledged.
    pub unacked: u64,
    /// Published in confirm mode, not yet confirmed.
    pub unconfirmed: u64,
    /// In confirm mode.
    pub confirm: bool,
    /// In tx mode.
    pub transactional: bool,
    /// Its consumers, by tag.
    pub consumers: Vec<ConsumerInfo>,
}

/// A connection as read by a listing.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConnectionView {
    /// What it is.
    pub info: ConnectionInfo,
    /// Flow state.
    pub state: ConnectionState,
    /// Its socket's traffic so far.
    pub socket: SocketStats,
    /// Its open channels, by number.
    pub channels: Vec<ChannelView>,
}

/// The connection limits in force when a connection opens ([`Registry::register_within`]):
/// its vhost's and its user's `max-connections`, when they limit anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The vhost's `max-connections`.
    pub vhost_max: Option<u64>,
    /// The user's `max-connections`.
    pub user_max: Option<u64>,
}

/// Which limit refused a connection, with its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitReached {
    /// The vhost's `max-connections` (checked first, as RabbitMQ does).
    Vhost(u64),
    /// The user's `max-connections`.
    User(u64),
}

/// Connections and channels on the other nodes of a cluster, as they last reported them:
/// what the limits count besides this node's own sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElsewhereCounts {
    /// Connections by vhost.
    pub connections_by_vhost: BTreeMap<String, u64>,
    /// Connections by user.
    pub connections_by_user: BTreeMap<String, u64>,
    /// Open channels by user.
    pub channels_by_user: BTreeMap<String, u64>,
}

impl ElsewhereCounts {
    /// The counts of `views` (other nodes' connections).
    pub fn of<'a>(views: impl IntoIterator<Item = &'a ConnectionView>) -> ElsewhereCounts {
        let mut c = ElsewhereCounts::default();
        for v in views {
            *c.connections_by_vhost
                .entry(v.info.vhost.clone())
                .or_default() += 1;
            *c.connections_by_user
                .entry(v.info.user.clone())
                .or_default() += 1;
            *c.channels_by_user.entry(v.info.user.clone()).or_default() += v.channels.len() as u64;
        }
        c
    }
}

fn count(map: &BTreeMap<String, u64>, key: &str) -> u64 {
    map.get(key).copied().unwrap_or(0)
}

/// The node's live connections, by id.
#[derive(Debug, Default)]
pub struct Registry {
    connections: Mutex<BTreeMap<u64, Arc<ConnectionEntry>>>,
    /// The other nodes' sessions, for the limits.
    elsewhere: Mutex<ElsewhereCounts>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Lists `info` until the returned handle is dropped. A second registration of the same
    /// id replaces the first. `outbox` is the connection's, for [`Registry::close`];
    /// `socket` is what its driver counts.
    pub fn register(
        self: &Arc<Self>,
        info: ConnectionInfo,
        state: ConnectionState,
        outbox: Weak<Outbox>,
        socket: Arc<SocketCounters>,
    ) -> ConnectionHandle {
        let entry = Arc::new(ConnectionEntry {
            info,
            state: AtomicU8::new(state.to_u8()),
            socket,
            channels: Mutex::new(BTreeMap::new()),
            outbox,
        });
        lock(&self.connections).insert(entry.info.id, entry.clone());
        ConnectionHandle {
            registry: self.clone(),
            entry,
        }
    }

    /// [`Registry::register`], unless the node already has `limits.vhost_max` connections
    /// to the connection's vhost or `limits.user_max` of its user (other than `info.id`);
    /// counted and added under one lock.
    pub fn register_within(
        self: &Arc<Self>,
        info: ConnectionInfo,
        state: ConnectionState,
        outbox: Weak<Outbox>,
        socket: Arc<SocketCounters>,
        limits: ConnectionLimits,
    ) -> Result<ConnectionHandle, LimitReached> {
        let mut conns = lock(&self.connections);
        let elsewhere = lock(&self.elsewhere).clone();
        let others = || conns.values().filter(|e| e.info.id != info.id);
        if let Some(max) = limits.vhost_max {
            let here = others().filter(|e| e.info.vhost == info.vhost).count() as u64;
            if here + count(&elsewhere.connections_by_vhost, &info.vhost) >= max {
                return Err(LimitReached::Vhost(max));
            }
        }
        if let Some(max) = limits.user_max {
            let here = others().filter(|e| e.info.user == info.user).count() as u64;
            if here + count(&elsewhere.connections_by_user, &info.user) >= max {
                return Err(LimitReached::User(max));
            }
        }
        let entry = Arc::new(ConnectionEntry {
            info,
            state: AtomicU8::new(state.to_u8()),
            socket,
            channels: Mutex::new(BTreeMap::new()),
            outbox,
        });
        conns.insert(entry.info.id, entry.clone());
        drop(conns);
        Ok(ConnectionHandle {
            registry: self.clone(),
            entry,
        })
    }

    /// Every live connection with its channels and consumers, in id order.
    pub fn connections(&self) -> Vec<ConnectionView> {
        // Copy the entries out first so no session waits on this lock while channels are read.
        let entries: Vec<Arc<ConnectionEntry>> =
            lock(&self.connections).values().cloned().collect();
        entries
            .iter()
            .map(|e| {
                let channels: Vec<Arc<ChannelEntry>> =
                    lock(&e.channels).values().cloned().collect();
                ConnectionView {
                    info: e.info.clone(),
                    state: ConnectionState::from_u8(e.state.load(Ordering::Relaxed)),
                    socket: e.socket.stats(),
                    channels: channels.iter().map(|c| c.view()).collect(),
                }
            })
            .collect()
    }

    /// Asks connection `id` to close with 320 `CONNECTION_FORCED - {reason}`; false when no
    /// such connection is listed (or it is already going).
    pub fn close(&self, id: u64, reason: &str) -> bool {
        let outbox = lock(&self.connections)
            .get(&id)
            .and_then(|e| e.outbox.upgrade());
        outbox.is_some_and(|o| {
            o.push(OutItem::Close {
                reason: reason.to_string(),
            })
            .is_ok()
        })
    }

    /// Records what the other nodes of the cluster last reported (replacing the previous
    /// report; an empty one when not clustered or when no limit needs it).
    pub fn set_elsewhere(&self, counts: ElsewhereCounts) {
        *lock(&self.elsewhere) = counts;
    }

    /// How many connections are listed.
    pub fn len(&self) -> usize {
        lock(&self.connections).len()
    }

    /// Whether no connection is listed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ChannelEntry {
    fn new(number: u16) -> ChannelEntry {
        ChannelEntry {
            number,
            prefetch: AtomicU32::new(0),
            global_prefetch: AtomicU32::new(0),
            unacked: AtomicU64::new(0),
            unconfirmed: AtomicU64::new(0),
            confirm: AtomicBool::new(false),
            transactional: AtomicBool::new(false),
            consumers: Mutex::new(BTreeMap::new()),
        }
    }

    fn view(&self) -> ChannelView {
        ChannelView {
            number: self.number,
            prefetch: self.prefetch.load(Ordering::Relaxed),
            global_prefetch: self.global_prefetch.load(Ordering::Relaxed),
            unacked: self.unacked.load(Ordering::Relaxed),
            unconfirmed: self.unconfirmed.load(Ordering::Relaxed),
            confirm: self.confirm.load(Ordering::Relaxed),
            transactional: self.transactional.load(Ordering::Relaxed),
            consumers: lock(&self.consumers).values().cloned().collect(),
        }
    }
}

/// A session's hold on its connection's entry; dropping it removes the entry.
#[derive(Debug)]
pub struct ConnectionHandle {
    registry: Arc<Registry>,
    entry: Arc<ConnectionEntry>,
}

impl ConnectionHandle {
    /// Sets the flow state.
    pub fn set_state(&self, state: ConnectionState) {
        self.entry.state.store(state.to_u8(), Ordering::Relaxed);
    }

    /// [`ConnectionHandle::open_channel`], unless the connection's user already has
    /// `user_max` channels open on this node (`Err` with the limit); counted and added
    /// under the registry's lock, so concurrent opens of one user cannot pass it together.
    pub fn open_channel_within(
        &self,
        number: u16,
        user_max: Option<u64>,
    ) -> Result<ChannelHandle, u64> {
        let Some(max) = user_max else {
            return Ok(self.open_channel(number));
        };
        let conns = lock(&self.registry.connections);
        let user = &self.entry.info.user;
        let open: usize = conns
            .values()
            .filter(|e| &e.info.user == user)
            .map(|e| lock(&e.channels).len())
            .sum();
        let elsewhere = count(&lock(&self.registry.elsewhere).channels_by_user, user);
        if open as u64 + elsewhere >= max {
            return Err(max);
        }
        let handle = self.open_channel(number);
        drop(conns);
        Ok(handle)
    }

    /// Lists channel `number` until the returned handle is dropped or deregistered.
    pub fn open_channel(&self, number: u16) -> ChannelHandle {
        let entry = Arc::new(ChannelEntry::new(number));
        lock(&self.entry.channels).insert(number, entry.clone());
        ChannelHandle {
            entry,
            conn: Some(self.entry.clone()),
        }
    }
}

impl Drop for ConnectionHandle {
    fn drop(&mut self) {
        let mut conns = lock(&self.registry.connections);
        // Only our own entry: a later registration under the same id is not ours to remove.
        if conns
            .get(&self.entry.info.id)
            .is_some_and(|e| Arc::ptr_eq(e, &self.entry))
        {
            conns.remove(&self.entry.info.id);
        }
    }
}

/// A channel's entry, written by the channel that owns it. Dropping it (or
/// [`ChannelHandle::deregister`]) removes the channel from its connection's listing; writes
/// after that go nowhere.
#[derive(Debug)]
pub struct ChannelHandle {
    entry: Arc<ChannelEntry>,
    /// The connection it is listed under; `None` once deregistered (or never listed).
    conn: Option<Arc<ConnectionEntry>>,
}

impl ChannelHandle {
    /// A handle listed nowhere, for a channel of a connection that is not registered.
    pub fn detached(number: u16) -> ChannelHandle {
        ChannelHandle {
            entry: Arc::new(ChannelEntry::new(number)),
            conn: None,
        }
    }

    /// Removes the channel from the listing (idempotent).
    pub fn deregister(&mut self) {
        if let Some(conn) = self.conn.take() {
            let mut channels = lock(&conn.channels);
            if channels
                .get(&self.entry.number)
                .is_some_and(|e| Arc::ptr_eq(e, &self.entry))
            {
                channels.remove(&self.entry.number);
            }
        }
    }

    /// `basic.qos` per-consumer prefetch.
    pub fn set_prefetch(&self, n: u32) {
        self.entry.prefetch.store(n, Ordering::Relaxed);
    }

    /// `basic.qos global=true` prefetch.
    pub fn set_global_prefetch(&self, n: u32) {
        self.entry.global_prefetch.store(n, Ordering::Relaxed);
    }

    /// Deliveries awaiting an ack. A relaxed store: the owner calls it whenever its count
    /// changes, so it must cost no more than that.
    pub fn set_unacked(&self, n: usize) {
        self.entry.unacked.store(n as u64, Ordering::Relaxed);
    }

    /// Publishes awaiting a confirm.
    pub fn set_unconfirmed(&self, n: usize) {
        self.entry.unconfirmed.store(n as u64, Ordering::Relaxed);
    }

    /// confirm.select.
    pub fn set_confirm(&self) {
        self.entry.confirm.store(true, Ordering::Relaxed);
    }

    /// tx.select.
    pub fn set_transactional(&self) {
        self.entry.transactional.store(true, Ordering::Relaxed);
    }

    /// A consumer was added.
    pub fn add_consumer(&self, consumer: ConsumerInfo) {
        lock(&self.entry.consumers).insert(consumer.tag.clone(), consumer);
    }

    /// A consumer went (cancelled by the client or the broker).
    pub fn remove_consumer(&self, tag: &str) {
        lock(&self.entry.consumers).remove(tag);
    }
}

impl Drop for ChannelHandle {
    fn drop(&mut self) {
        self.deregister();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: u64) -> ConnectionInfo {
        ConnectionInfo {
            id,
            user: "guest".into(),
            vhost: "/".into(),
            peer_host: "::1".into(),
            peer_port: 40000,
            host: "127.0.0.1".into(),
            port: 5672,
            timeout_s: 60,
            frame_max: 131_072,
            channel_max: 2047,
            client_properties: FieldTable::default(),
            auth_mechanism: "PLAIN".into(),
            ssl: None,
            connected_at: 1_700_000_000_000,
        }
    }

    fn consumer(tag: &str) -> ConsumerInfo {
        ConsumerInfo {
            tag: tag.into(),
            queue: "q".into(),
            ack_required: true,
            prefetch: 5,
            exclusive: false,
            arguments: FieldTable::default(),
        }
    }

    #[test]
    fn an_operator_close_reaches_the_connections_outbox() {
        let reg = Arc::new(Registry::new());
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let _conn = reg.register(
            info(7),
            ConnectionState::Running,
            Arc::downgrade(&outbox),
            Default::default(),
        );
        assert!(!reg.close(8, "no such"), "an unknown id");
        assert!(reg.close(7, "Closed via management plugin"));
        let mut items = Vec::new();
        outbox.drain(&mut items);
        assert!(matches!(
            items.as_slice(),
            [OutItem::Close { reason }] if reason == "Closed via management plugin"
        ));
        drop(outbox);
        assert!(!reg.close(7, "gone"), "a connection whose outbox is gone");
    }

    #[test]
    fn connection_limits_count_the_vhosts_and_the_users_connections() {
        let reg = Arc::new(Registry::new());
        let open = |id: u64, user: &str, vhost: &str, limits: ConnectionLimits| {
            let mut i = info(id);
            i.user = user.into();
            i.vhost = vhost.into();
            reg.register_within(
                i,
                ConnectionState::Running,
                Weak::new(),
                Default::default(),
                limits,
            )
        };
        let vhost_max = |n| ConnectionLimits {
            vhost_max: Some(n),
            user_max: None,
        };
        assert!(matches!(
            open(1, "a", "/", vhost_max(0)),
            Err(LimitReached::Vhost(0))
        ));
        let first = open(1, "a", "/", vhost_max(2)).unwrap();
        let _other_vhost = open(2, "a", "v", vhost_max(1)).unwrap();
        let _second = open(3, "b", "/", vhost_max(2)).unwrap();
        assert!(matches!(
            open(4, "c", "/", vhost_max(2)),
            Err(LimitReached::Vhost(2))
        ));
        // The vhost limit is checked before the user's, as RabbitMQ does.
        let both = ConnectionLimits {
            vhost_max: Some(2),
            user_max: Some(1),
        };
        assert!(matches!(
            open(4, "a", "/", both),
            Err(LimitReached::Vhost(2))
        ));
        let user_max = ConnectionLimits {
            vhost_max: None,
            user_max: Some(2),
        };
        assert!(matches!(
            open(4, "a", "w", user_max),
            Err(LimitReached::User(2))
        ));
        drop(first);
        assert!(
            open(4, "a", "w", user_max).is_ok(),
            "a closed connection frees its place"
        );
    }

    #[test]
    fn channel_limits_count_the_users_channels_on_every_connection() {
        let reg = Arc::new(Registry::new());
        let conn = |id: u64, user: &str| {
            let mut i = info(id);
            i.user = user.into();
            reg.register(i, ConnectionState::Running, Weak::new(), Default::default())
        };
        let (a1, a2, b) = (conn(1, "a"), conn(2, "a"), conn(3, "b"));
        let _c1 = a1.open_channel_within(1, Some(2)).unwrap();
        let _b1 = b.open_channel(1);
        let mut c2 = a2.open_channel_within(1, Some(2)).unwrap();
        assert_eq!(a2.open_channel_within(2, Some(2)).err(), Some(2));
        assert!(a2.open_channel_within(2, None).is_ok(), "no limit");
        c2.deregister();
        let _c3 = a1.open_channel_within(2, Some(3)).unwrap();
        assert_eq!(b.open_channel_within(2, Some(0)).err(), Some(0));
    }

    #[test]
    fn limits_count_what_the_other_nodes_reported_too() {
        let reg = Arc::new(Registry::new());
        let mut remote = info(1 << 40);
        remote.user = "a".into();
        let view = ConnectionView {
            info: remote,
            state: ConnectionState::Running,
            socket: SocketStats::default(),
            channels: vec![],
        };
        let mut counts = ElsewhereCounts::of([&view]);
        counts.channels_by_user.insert("a".into(), 1);
        reg.set_elsewhere(counts);
        let mut mine = info(2);
        mine.user = "a".into();
        let one = |vhost_max, user_max| ConnectionLimits {
            vhost_max,
            user_max,
        };
        assert!(matches!(
            reg.register_within(
                mine.clone(),
                ConnectionState::Running,
                Weak::new(),
                Default::default(),
                one(Some(1), None)
            ),
            Err(LimitReached::Vhost(1))
        ));
        assert!(matches!(
            reg.register_within(
                mine.clone(),
                ConnectionState::Running,
                Weak::new(),
                Default::default(),
                one(None, Some(1))
            ),
            Err(LimitReached::User(1))
        ));
        let conn = reg
            .register_within(
                mine,
                ConnectionState::Running,
                Weak::new(),
                Default::default(),
                one(Some(2), Some(2)),
            )
            .unwrap();
        assert_eq!(conn.open_channel_within(1, Some(1)).err(), Some(1));
        assert!(conn.open_channel_within(1, Some(2)).is_ok());
        reg.set_elsewhere(ElsewhereCounts::default());
        assert!(
            conn.open_channel_within(2, Some(1)).is_ok(),
            "the report is gone"
        );
    }

    #[test]
    fn sessions_appear_and_disappear_with_their_handles() {
        let reg = Arc::new(Registry::new());
        let conn = reg.register(
            info(7),
            ConnectionState::Running,
            Weak::new(),
            Default::default(),
        );
        let mut ch1 = conn.open_channel(1);
        let ch2 = conn.open_channel(2);
        ch1.set_prefetch(5);
        ch1.set_unacked(3);
        ch1.set_confirm();
        ch1.add_consumer(consumer("a"));
        ch1.add_consumer(consumer("b"));
        ch1.remove_consumer("a");
        conn.set_state(ConnectionState::Blocked);

        let list = reg.connections();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].info.id, 7);
        assert_eq!(list[0].info.name(), "[::1]:40000 -> 127.0.0.1:5672");
        assert_eq!(list[0].state, ConnectionState::Blocked);
        let chans = &list[0].channels;
        assert_eq!(chans.iter().map(|c| c.number).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((chans[0].prefetch, chans[0].unacked), (5, 3));
        assert!(chans[0].confirm && !chans[0].transactional);
        assert_eq!(chans[0].consumers, vec![consumer("b")]);

        ch1.deregister();
        ch1.set_unacked(9); // goes nowhere
        assert_eq!(reg.connections()[0].channels.len(), 1);
        drop(ch2);
        assert!(reg.connections()[0].channels.is_empty());
        drop(conn);
        assert!(reg.is_empty());
    }

    #[test]
    fn a_listing_reads_the_socket_counters_the_driver_adds_to() {
        let reg = Arc::new(Registry::new());
        let socket = Arc::new(SocketCounters::default());
        let _conn = reg.register(
            info(3),
            ConnectionState::Running,
            Weak::new(),
            socket.clone(),
        );
        socket.received(8);
        socket.received(100);
        socket.sent(7);
        let view = &reg.connections()[0];
        assert_eq!(
            view.socket,
            SocketStats {
                recv_oct: 108,
                recv_cnt: 2,
                send_oct: 7,
                send_cnt: 1
            }
        );
        assert_eq!(view.info.connected_at, 1_700_000_000_000);
        socket.sent(5);
        assert_eq!(
            reg.connections()[0].socket.send_oct,
            12,
            "read live, not copied once"
        );
    }

    #[test]
    fn a_stale_handle_does_not_remove_its_successor() {
        let reg = Arc::new(Registry::new());
        let conn = reg.register(
            info(1),
            ConnectionState::Running,
            Weak::new(),
            Default::default(),
        );
        let old = conn.open_channel(1);
        let new = conn.open_channel(1);
        drop(old);
        assert_eq!(reg.connections()[0].channels.len(), 1);
        drop(new);
        let again = reg.register(
            info(1),
            ConnectionState::Running,
            Weak::new(),
            Default::default(),
        );
        drop(conn);
        assert_eq!(reg.len(), 1, "the older handle left the newer entry alone");
        drop(again);
        assert!(reg.is_empty());
    }
}

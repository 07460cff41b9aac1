//! A running node: the AMQP listeners (plaintext, and AMQPS with `[amqp.tls]`), the memory
//! monitor, the broker ticker, and shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::clock::Clock;
use super::cluster::Cluster;
use super::conn_task::{self, ConnContext, LocalMeta, MetaCommit};
use super::file_disk::FileDisk;
use super::storage::{Storage, StorageError};
use super::transport::{Listener, TokioTransport, Transport};
use crate::broker::registry::ElsewhereCounts;
use crate::broker::Broker;
use crate::config::Config;
use crate::meta::definitions::Definitions;
use crate::session::SessionConfig;
use crate::store::Disk;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The data folder could not be created.
    #[error("cannot create data folder {path}: {source}")]
    DataDir {
        /// The folder.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Storage could not be opened.
    #[error("storage: {0}")]
    Storage(#[from] StorageError),
    /// Cluster mode could not start.
    #[error("cluster: {0}")]
    Cluster(#[from] super::cluster::ClusterError),
    /// `[definitions] load_file` could not be read or imported.
    #[error("definitions file {path}: {reason}")]
    Definitions {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// A TLS listener's certificate, key or CA file is unusable.
    #[error("TLS: {0}")]
    Tls(#[from] super::tls::TlsError),
    /// The listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A running node.
pub struct Node {
    addr: SocketAddr,
    amqps_addr: Option<SocketAddr>,
    admin_addr: SocketAddr,
    mgmt_addr: Option<SocketAddr>,
    mgmt_tls_addr: Option<SocketAddr>,
    prometheus_addr: Option<SocketAddr>,
    broker: Arc<Broker>,
    shutdown: watch::Sender<bool>,
    /// Set once the node can no longer keep what it confirms ([`Node::failed`]).
    failed: watch::Receiver<Option<String>>,
    tracker: TaskTracker,
    tasks: Vec<JoinHandle<()>>,
    syncer: Option<(Arc<Storage>, std::thread::JoinHandle<()>)>,
    syncer_stop: Arc<std::sync::atomic::AtomicBool>,
    cluster: Option<Cluster>,
    /// Mirrored queues (clustered, with storage): the host and its tasks.
    mirror: Option<(
        super::mirror_host::MirrorHost<super::node_link::TcpTransport>,
        Vec<JoinHandle<()>>,
    )>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Total physical memory from /proc/meminfo, if readable.
fn physical_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

const DEFINITIONS_FILE: &str = "definitions";

/// How often a clustered node asks the others for their sessions while a connection or
/// channel limit exists.
const ELSEWHERE_REFRESH: Duration = Duration::from_secs(1);

/// Whether any limit counts connections or channels (vhost `max-connections`, any user
/// limit): only then are the other nodes' sessions worth asking for.
fn counts_sessions(meta: &crate::meta::MetaState) -> bool {
    !meta.user_limits.is_empty()
        || meta
            .vhost_limits
            .values()
            .any(|l| l.contains_key(crate::meta::limits::MAX_CONNECTIONS))
}

/// Replays the durable definitions saved in `data_dir`, then installs the sink that keeps
/// that file current (write to a temporary file, fsync, rename, fsync the folder).
fn recover_definitions(broker: Broker, data_dir: &std::path::Path) -> Broker {
    let disk = FileDisk::new();
    let path = data_dir.join(DEFINITIONS_FILE);
    match disk.len(&path) {
        Ok(Some(_)) => match disk
            .read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| Definitions::decode(&b).map_err(|e| e.to_string()))
        {
            Ok(defs) => {
                let mut applied = 0;
                for c in defs.commands() {
                    match broker.apply(&c, crate::time::Instant::from_millis(0)) {
                        Ok(_) => applied += 1,
                        Err(e) => tracing::warn!(error = %e, "cannot restore a definition"),
                    }
                }
                tracing::info!(definitions = applied, "durable definitions restored");
            }
            // A damaged file must not stop the node: report and start without them.
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "definitions file unreadable; starting without durable definitions")
            }
        },
        Ok(None) => {}
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "cannot stat definitions file")
        }
    }
    let dir = data_dir.to_path_buf();
    broker.with_definitions_sink(Box::new(move |defs: &Definitions| {
        let tmp = dir.join("definitions.tmp");
        let target = dir.join(DEFINITIONS_FILE);
        disk.write_file(&tmp, &defs.encode())
            .and_then(|()| disk.sync(&tmp))
            .and_then(|()| disk.rename(&tmp, &target))
            .and_then(|()| disk.sync_dir(&dir))
            .map_err(|e| e.to_string())
    }))
}

impl Node {
    /// Starts a node over real TCP.
    pub async fn start(config: Config) -> Result<Node, NodeError> {
        Self::start_with(config, TokioTransport).await
    }

    /// Starts a node over `transport`.
    pub async fn start_with<T: Transport>(config: Config, transport: T) -> Result<Node, NodeError> {
        std::fs::create_dir_all(&config.node.data_dir).map_err(|source| NodeError::DataDir {
            path: config.node.data_dir.clone(),
            source,
        })?;
        // TLS material first: an unusable file stops the start before anything listens.
        let amqps_config = match &config.amqp.tls {
            Some(t) => Some(super::tls::server_config(
                t,
                crate::config::TlsUse::Amqp,
                &[],
            )?),
            None => None,
        };
        let mgmt_tls_config = match &config.management.tls {
            Some(t) => Some(super::tls::server_config(
                t,
                crate::config::TlsUse::Management,
                &[b"http/1.1"],
            )?),
            None => None,
        };
        // `[admin.tls]`: the endpoint's own TLS, and the client side `join_cluster` uses to
        // reach a seed's endpoint (only with a CA to check the seed against).
        let (admin_acceptor, admin_connector) = match &config.admin.tls {
            Some(t) => {
                let server = super::tls::server_config(t, crate::config::TlsUse::Admin, &[])?;
                let client = match &t.cacertfile {
                    Some(_) => Some(tokio_rustls::TlsConnector::from(super::tls::client_config(
                        t,
                        crate::config::TlsUse::Admin,
                    )?)),
                    None => None,
                };
                (Some(tokio_rustls::TlsAcceptor::from(server)), client)
            }
            None => (None, None),
        };
        let watermark = if config.limits.memory_high_watermark_bytes > 0 {
            config.limits.memory_high_watermark_bytes
        } else {
            let total = physical_memory_bytes().unwrap_or(4 << 30);
            (total as f64 * config.limits.memory_high_watermark_fraction) as u64
        };
        let epoch_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let seed = rand::random::<u64>();
        let mut broker = Broker::new(&config, seed, watermark, epoch_unix_ms);
        let durability = config
            .storage
            .enabled
            .then(|| Arc::new(crate::broker::Durability::default()));
        if let Some(d) = &durability {
            broker = broker.with_durability(d.clone());
        }
        let clock = Clock::start();
        let facts = Arc::new(super::node_stats::NodeFacts {
            started: std::time::Instant::now(),
            disk_free_limit: config.limits.disk_free_limit_bytes,
            config_file: config.source.as_ref().map(|p| p.display().to_string()),
            data_dir: config.node.data_dir.display().to_string(),
        });
        let mut listener =
            transport
                .bind(config.amqp.listen)
                .await
                .map_err(|source| NodeError::Bind {
                    addr: config.amqp.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| NodeError::Bind {
            addr: config.amqp.listen,
            source,
        })?;
        let admin_listener = super::admin::bind(config.admin.listen)
            .await
            .map_err(|source| NodeError::Bind {
                addr: config.admin.listen,
                source,
            })?;
        let admin_addr = admin_listener
            .local_addr()
            .map_err(|source| NodeError::Bind {
                addr: config.admin.listen,
                source,
            })?;
        let mgmt_listener = match config.management.listen_addr() {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|source| NodeError::Bind { addr: a, source })?,
            ),
            None => None,
        };
        let mgmt_addr = match &mgmt_listener {
            Some(l) => Some(l.local_addr().map_err(|source| NodeError::Bind {
                addr: admin_addr,
                source,
            })?),
            None => None,
        };
        let (prometheus_listener, prometheus_addr) =
            bind_optional(config.prometheus.listen_addr()).await?;
        let (amqps_listener, amqps_addr) = bind_optional(
            config
                .amqp
                .tls
                .as_ref()
                .map(|t| t.listen_addr(crate::config::AMQPS_PORT)),
        )
        .await?;
        let (mgmt_tls_listener, mgmt_tls_addr) = bind_optional(
            config
                .management
                .tls
                .as_ref()
                .map(|t| t.listen_addr(crate::config::MANAGEMENT_HTTPS_PORT)),
        )
        .await?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let tracker = TaskTracker::new();
        let mut tasks = Vec::new();

        // A single node keeps its durable definitions in a file; a clustered one gets them
        // from the metadata Raft group (and must catch up with it before storage opens).
        let (broker, meta, cluster): (Arc<Broker>, Arc<dyn MetaCommit>, Option<Cluster>) =
            match &config.cluster {
                None => {
                    let broker = Arc::new(recover_definitions(broker, &config.node.data_dir));
                    (broker.clone(), Arc::new(LocalMeta::new(broker)), None)
                }
                Some(cc) => {
                    let broker = Arc::new(broker.with_node_id(cc.node_id));
                    let cluster = Cluster::start(&config, cc, broker.clone(), clock).await?;
                    let meta: Arc<dyn MetaCommit> = cluster.meta();
                    (broker, meta, Some(cluster))
                }
            };
        let record = cluster.as_ref().map(|c| crate::meta::NodeRecord {
            id: c.node_id(),
            name: config.node.name.clone(),
            amqp: addr.to_string(),
            admin: admin_addr.to_string(),
            link: c.transport().local_addr().to_string(),
            incarnation: rand::random(),
        });
        // The admin endpoint serves while a clustered node waits for its cluster
        // (`join_cluster` is how a new node gets one).
        tracing::info!(addr = %admin_addr, tls = admin_acceptor.is_some(), "admin listening");
        tasks.push(tokio::spawn(super::admin::serve(
            admin_listener,
            super::admin::AdminContext {
                broker: broker.clone(),
                node: crate::admin::NodeInfo {
                    name: config.node.name.clone(),
                },
                clock,
                meta: meta.clone(),
                cluster: cluster
                    .as_ref()
                    .zip(record.clone())
                    .map(|(c, r)| c.control(r, admin_connector)),
            },
            tracker.clone(),
            shutdown_rx.clone(),
            admin_acceptor,
        )));
        let mgmt_ctx = super::mgmt::MgmtContext {
            broker: broker.clone(),
            node: crate::admin::NodeInfo {
                name: config.node.name.clone(),
            },
            clock,
            meta: meta.clone(),
            loopback_users: Arc::new(config.amqp.loopback_users.clone()),
            listeners: Arc::new(
                [
                    Some(("amqp", addr.port())),
                    amqps_addr.map(|a| ("amqp/ssl", a.port())),
                    mgmt_addr.map(|a| ("http", a.port())),
                    mgmt_tls_addr.map(|a| ("https", a.port())),
                    prometheus_addr.map(|a| ("http/prometheus", a.port())),
                    cluster
                        .as_ref()
                        .map(|c| ("clustering", c.transport().local_addr().port())),
                    Some(("warren/admin", admin_addr.port())),
                ]
                .into_iter()
                .flatten()
                .collect(),
            ),
            amqp: addr,
            facts: facts.clone(),
        };
        if let (Some(listener), Some(mgmt)) = (mgmt_listener, mgmt_addr) {
            tracing::info!(addr = %mgmt, "management API listening");
            tasks.push(tokio::spawn(super::mgmt::serve(
                listener,
                mgmt_ctx.clone(),
                shutdown_rx.clone(),
            )));
        }
        if let (Some(listener), Some(https), Some(tls)) =
            (mgmt_tls_listener, mgmt_tls_addr, mgmt_tls_config)
        {
            tracing::info!(addr = %https, "management API listening (HTTPS)");
            let listener =
                super::tls::https::TlsListener::start(listener, https, tls, shutdown_rx.clone());
            tasks.push(tokio::spawn(super::mgmt::serve_tls(
                listener,
                mgmt_ctx,
                shutdown_rx.clone(),
            )));
        }
        if let (Some(listener), Some(addr)) = (prometheus_listener, prometheus_addr) {
            tracing::info!(%addr, "prometheus metrics listening");
            tasks.push(tokio::spawn(super::prometheus::serve(
                listener,
                super::prometheus::PrometheusContext {
                    broker: broker.clone(),
                    node: config.node.name.clone(),
                    cluster: config
                        .cluster
                        .as_ref()
                        .map_or_else(|| config.node.name.clone(), |c| c.cluster_id.clone()),
                    raft: cluster.as_ref().map(|c| c.raft().clone()),
                    facts: facts.clone(),
                },
                shutdown_rx.clone(),
            )));
        }
        let mut cluster = cluster;
        if let (Some(c), Some(record)) = (&mut cluster, record) {
            let id = record.id;
            tracing::info!(node_id = id, "waiting to catch up with the cluster");
            c.wait_ready().await;
            c.install_relay(meta.clone(), clock, facts.clone());
            c.join_metadata(&config, record).await;
            c.start_watchers();
            tracing::info!(node_id = id, "caught up with the cluster");
        }
        let storage = match &durability {
            Some(d) => {
                let (storage, summary) = Storage::open(
                    &broker,
                    d.clone(),
                    &config.node.data_dir,
                    &config.storage,
                    clock.now(),
                )?;
                tracing::info!(
                    queues = summary.queues,
                    messages = summary.messages,
                    lost = summary.lost,
                    clean = summary.clean,
                    "storage recovered"
                );
                Some(storage)
            }
            None => None,
        };
        if let Some(storage) = &storage {
            // Queues read paged-out messages back through storage.
            broker.set_pager(storage.clone());
        }
        if let Some(c) = &cluster {
            // Only now do forwarded publishes find the queues' recovered sequence numbers.
            c.serve_queues();
        }
        let mirror = match (&cluster, &storage) {
            (Some(c), Some(storage)) => {
                let host = super::mirror_host::MirrorHost::new(
                    broker.clone(),
                    storage.clone(),
                    c.gm().clone(),
                    c.raft().clone(),
                    clock,
                    config.node.data_dir.join("mirror_hold"),
                )
                // Under the failure detector's timeout: a master stops serving before a
                // mirror can be promoted in its place.
                .with_lease(Duration::from_millis(
                    config
                        .cluster
                        .as_ref()
                        .map_or(5_000, |cc| cc.peer_timeout_ms)
                        / 2,
                ));
                let tasks = host.start(Duration::from_millis(500));
                Some((host, tasks))
            }
            _ => None,
        };
        let syncer_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let syncer = match storage {
            Some(storage) => {
                let (s, stop) = (storage.clone(), syncer_stop.clone());
                let rt = tokio::runtime::Handle::current();
                let thread = std::thread::Builder::new()
                    .name("warren-syncer".into())
                    .spawn(move || s.run_syncer(stop, rt))
                    .map_err(|source| NodeError::DataDir {
                        path: config.node.data_dir.clone(),
                        source,
                    })?;
                Some((storage, thread))
            }
            None => None,
        };
        if !config.definitions.load_file.is_empty() {
            let path = config.definitions.load_file.clone();
            let fail = |reason: String| NodeError::Definitions {
                path: path.clone(),
                reason,
            };
            let json = std::fs::read(&path).map_err(|e| fail(e.to_string()))?;
            let importer = super::admin::AdminContext {
                broker: broker.clone(),
                node: crate::admin::NodeInfo {
                    name: config.node.name.clone(),
                },
                clock,
                meta: meta.clone(),
                cluster: None,
            };
            let r = super::admin::import_definitions(&importer, &json).await;
            if !r.ok {
                return Err(fail(r.message));
            }
            tracing::info!(%path, "{}", r.message);
        }
        let (alarm_tx, alarm_rx) = watch::channel(false);
        let ctx = ConnContext {
            broker: broker.clone(),
            session: SessionConfig::from_config(&config),
            clock,
            shutdown: shutdown_rx.clone(),
            alarm: alarm_rx,
            outbound_bytes_max: config.limits.connection_outbound_bytes_max,
            node_span: tracing::info_span!("node", name = %config.node.name),
            meta: meta.clone(),
        };
        tracing::info!(%addr, node = %config.node.name, memory_high_watermark = watermark, "node listening");
        if let (Some(listener), Some(amqps), Some(tls)) = (amqps_listener, amqps_addr, amqps_config)
        {
            let login_from = config
                .amqp
                .tls
                .as_ref()
                .map(|t| t.cert_login_from())
                .unwrap_or_default();
            tracing::info!(addr = %amqps, "AMQPS listening");
            let amqps = super::tls::amqps::Amqps {
                listener,
                addr: amqps,
                config: tls,
                login_from,
                handshake_timeout: Duration::from_millis(config.amqp.handshake_timeout_ms),
            };
            tasks.push(amqps.spawn(ctx.clone(), tracker.clone(), shutdown_rx.clone()));
        }

        let accept_tracker = tracker.clone();
        let mut accept_shutdown = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    _ = accept_shutdown.changed() => break,
                    r = listener.accept() => match r {
                        Ok((stream, peer)) => {
                            let ctx = ctx.clone();
                            let local = listener.stream_local_addr(&stream).unwrap_or(addr);
                            accept_tracker.spawn(conn_task::run(stream, peer, local, None, ctx));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }
        }));

        // The resource monitor: flips the alarm that blocks publishers, and says when the node
        // can no longer keep what it confirms (its storage or its Raft log failed).
        let (failed_tx, failed_rx) = watch::channel(None::<String>);
        let monitor_raft = cluster.as_ref().map(|c| c.raft().clone());
        let monitor_broker = broker.clone();
        let mut monitor_shutdown = shutdown_rx.clone();
        let disk_free_limit = config.limits.disk_free_limit_bytes;
        let data_dir = config.node.data_dir.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            let mut disk_low = false;
            let mut ticks = 0u64;
            loop {
                tokio::select! {
                    biased;
                    _ = monitor_shutdown.changed() => break,
                    _ = tick.tick() => {
                        // The disk alarm: free space is asked for every 500 ms.
                        if ticks.is_multiple_of(10) {
                            let free = super::disk_free::available_bytes(&data_dir);
                            let low = free.is_some_and(|f| f < disk_free_limit);
                            let m = monitor_broker.metrics();
                            let bytes = free.map_or(-1, |f| i64::try_from(f).unwrap_or(i64::MAX));
                            m.disk_free_bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
                            m.disk_alarm.store(i64::from(low), std::sync::atomic::Ordering::Relaxed);
                            if low != disk_low {
                                if low {
                                    tracing::warn!(free = ?free, limit = disk_free_limit, "disk alarm set: free space below disk_free_limit_bytes");
                                } else {
                                    tracing::info!(free = ?free, "disk alarm cleared");
                                }
                                disk_low = low;
                            }
                        }
                        ticks += 1;
                        // A storage failure (full disk, failed fsync) blocks publishers too.
                        let memory = monitor_broker.memory_alarm();
                        let storage_failed = monitor_broker.durability().is_some_and(|d| d.has_failed());
                        // Another node's alarm blocks publishers here too, as in RabbitMQ.
                        let remote = monitor_broker.remote_alarm();
                        let on = memory || disk_low || storage_failed || remote;
                        if *alarm_tx.borrow() != on {
                            if on {
                                tracing::warn!(memory, disk = disk_low, storage_failed, remote = ?monitor_broker.peer_alarms(), used = monitor_broker.memory_used(), "resource alarm set: blocking publishers");
                            } else {
                                tracing::info!(used = monitor_broker.memory_used(), "resource alarm cleared");
                            }
                            let _ = alarm_tx.send(on);
                        }
                        if failed_tx.borrow().is_none() {
                            let why = if storage_failed {
                                Some("message storage failed".to_string())
                            } else {
                                monitor_raft.as_ref().and_then(|r| r.fatal()).map(|f| format!("the metadata Raft core stopped: {f}"))
                            };
                            if why.is_some() {
                                let _ = failed_tx.send(why);
                            }
                        }
                    }
                }
            }
        }));

        // What the other nodes' sessions count against the connection and channel limits:
        // asked about every second, only while the node is clustered and such a limit
        // exists (a limit is then cluster-wide, give or take the last second's opens).
        let limits_broker = broker.clone();
        let mut limits_shutdown = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(ELSEWHERE_REFRESH);
            // A slow answer (up to the node call's deadline) delays the next ask rather than
            // bunching the missed ones.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut reported = false;
            loop {
                tokio::select! {
                    biased;
                    _ = limits_shutdown.changed() => break,
                    _ = tick.tick() => {
                        let wanted = limits_broker.remote_link().is_some()
                            && counts_sessions(&limits_broker.snapshot());
                        if wanted {
                            let nodes = super::mgmt::remote_sessions(&limits_broker).await;
                            let views = nodes.iter().flat_map(|n| n.connections.iter());
                            limits_broker.sessions().set_elsewhere(ElsewhereCounts::of(views));
                            reported = true;
                        } else if reported {
                            limits_broker.sessions().set_elsewhere(ElsewhereCounts::default());
                            reported = false;
                        }
                    }
                }
            }
        }));

        // The ticker: message TTL at queue heads, queue expiry (committed like any command).
        let tick_broker = broker.clone();
        let tick_meta = meta;
        let mut tick_shutdown = shutdown_rx;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    biased;
                    _ = tick_shutdown.changed() => break,
                    _ = tick.tick() => {
                        for c in tick_broker.tick(clock.now()) {
                            if let Err(e) = tick_meta.commit(c, clock.now()).await {
                                tracing::debug!(error = %e, "expired queue not deleted");
                            }
                        }
                    }
                }
            }
        }));

        Ok(Node {
            addr,
            amqps_addr,
            admin_addr,
            mgmt_addr,
            mgmt_tls_addr,
            prometheus_addr,
            broker,
            shutdown: shutdown_tx,
            failed: failed_rx,
            tracker,
            tasks,
            syncer,
            syncer_stop,
            cluster,
            mirror,
        })
    }

    /// The AMQP listener's address.
    pub fn amqp_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The AMQPS listener's address, when `[amqp.tls]` is configured.
    pub fn amqps_addr(&self) -> Option<SocketAddr> {
        self.amqps_addr
    }

    /// The management API's HTTPS address, when `[management.tls]` is configured.
    pub fn mgmt_tls_addr(&self) -> Option<SocketAddr> {
        self.mgmt_tls_addr
    }

    /// The admin listener's address (`warrenctl --node`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The management HTTP API's address, when it is on.
    pub fn mgmt_addr(&self) -> Option<SocketAddr> {
        self.mgmt_addr
    }

    /// The Prometheus endpoint's address, when it is on.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.prometheus_addr
    }

    /// The broker (for inspection in tests and admin tools).
    pub fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    /// Waits until the node can no longer keep what it confirms: its message storage failed
    /// (a write or fsync error: the files may not hold what memory says they do) or its
    /// metadata Raft core stopped on a log write error. Either lasts until the process
    /// restarts and recovers from its files, so `warren` exits then for its supervisor to
    /// restart it ([`crate::runtime::EXIT_STORAGE_FAILED`]); why, in words.
    pub async fn failed(&self) -> String {
        let mut rx = self.failed.clone();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone(),
            // The monitor is gone only when the node shuts down: nothing failed.
            Err(_) => None,
        };
        match why {
            Some(why) => why,
            None => std::future::pending().await,
        }
    }

    /// Closes every client connection with 320 CONNECTION_FORCED and stops the node.
    pub async fn shutdown(self) {
        if let Some((host, _)) = &self.mirror {
            // Before clients go: mirrored queues move to a mirror while everything still
            // runs (their master must make its in-flight rounds' laps).
            host.hand_over(Duration::from_secs(10)).await;
        }
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.tracker.close();
        // Clients get a few seconds to answer close-ok; the session's own deadline ends
        // connections that do not.
        if tokio::time::timeout(Duration::from_secs(5), self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("connections still open after 5 s; stopping anyway");
        }
        if let Some((host, tasks)) = self.mirror {
            host.stop();
            for t in tasks {
                t.abort();
            }
        }
        if let Some(cluster) = self.cluster {
            cluster.shutdown().await;
        }
        if let Some((storage, thread)) = self.syncer {
            // Last round, then clean markers, so the next start skips the scans.
            self.syncer_stop
                .store(true, std::sync::atomic::Ordering::Release);
            storage.wake();
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        tracing::info!("node stopped");
    }
}

/// Binds `addr` when a listener is configured there: (listener, its bound address).
async fn bind_optional(
    addr: Option<SocketAddr>,
) -> Result<(Option<tokio::net::TcpListener>, Option<SocketAddr>), NodeError> {
    let Some(a) = addr else {
        return Ok((None, None));
    };
    let bind = |source| NodeError::Bind { addr: a, source };
    let listener = tokio::net::TcpListener::bind(a).await.map_err(bind)?;
    let local = listener.local_addr().map_err(bind)?;
    Ok((Some(listener), Some(local)))
}

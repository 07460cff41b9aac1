//! A running node: started from its configuration in a fixed order (TLS material, listeners,
//! metadata, endpoints, storage, AMQP, periodic tasks), and shut down.
//!
//! - `listeners`: TLS configurations, every bound listener, the AMQP accept loops.
//! - `definitions`: the durable definitions file and `[definitions] load_file`.
//! - `endpoints`: the admin endpoint, the management API and the Prometheus endpoint.
//! - `durable`: message storage, the mirrored-queue host and the syncer thread.
//! - `monitor`: the resource alarms and the `failed` signal.
//! - `tickers`: the limits' session-count refresh and the broker ticker.

mod definitions;
mod durable;
mod endpoints;
mod listeners;
mod monitor;
mod tickers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::clock::Clock;
use super::cluster::Cluster;
use super::conn_task::{ConnContext, LocalMeta, MetaCommit};
use super::storage::StorageError;
use super::transport::{TokioTransport, Transport};
use crate::broker::Broker;
use crate::config::Config;
use crate::session::SessionConfig;

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
    addrs: listeners::Addrs,
    broker: Arc<Broker>,
    shutdown: watch::Sender<bool>,
    /// Set once the node can no longer keep what it confirms ([`Node::failed`]).
    failed: watch::Receiver<Option<String>>,
    tracker: TaskTracker,
    tasks: Vec<JoinHandle<()>>,
    syncer: Option<durable::Syncer>,
    cluster: Option<Cluster>,
    mirror: Option<durable::Mirror>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("addr", &self.addrs.amqp)
            .finish_non_exhaustive()
    }
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
        let tls = listeners::load_tls(&config)?;
        let watermark = monitor::memory_watermark(&config);
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
            listeners: std::sync::OnceLock::new(),
            links: std::sync::OnceLock::new(),
        });
        let listeners = listeners::bind(&config, &transport).await?;
        let addrs = listeners.addrs;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let tracker = TaskTracker::new();
        let mut tasks = Vec::new();

        // A single node keeps its durable definitions in a file; a clustered one gets them
        // from the metadata Raft group (and must catch up with it before storage opens).
        let (broker, meta, mut cluster): (Arc<Broker>, Arc<dyn MetaCommit>, Option<Cluster>) =
            match &config.cluster {
                None => {
                    let broker = Arc::new(definitions::recover_definitions(
                        broker,
                        &config.node.data_dir,
                    ));
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
            amqp: addrs.amqp.to_string(),
            admin: addrs.admin.to_string(),
            link: c.transport().local_addr().to_string(),
            incarnation: rand::random(),
        });
        let endpoints = endpoints::Endpoints {
            config: &config,
            broker: &broker,
            clock,
            meta: &meta,
            cluster: cluster.as_ref(),
            facts: &facts,
            addrs,
            shutdown: &shutdown_rx,
        };
        // The admin endpoint serves while a clustered node waits for its cluster
        // (`join_cluster` is how a new node gets one).
        tasks.push(endpoints.serve_admin(listeners.admin, tls.admin, record.clone(), &tracker));
        tasks.extend(endpoints.serve_http(
            listeners.mgmt,
            listeners.mgmt_tls.zip(tls.mgmt),
            listeners.prometheus,
        ));
        if let (Some(c), Some(record)) = (&mut cluster, record) {
            let id = record.id;
            tracing::info!(node_id = id, "waiting to catch up with the cluster");
            c.wait_ready().await;
            let _ = facts.links.set(c.transport().clone());
            c.install_relay(meta.clone(), clock, facts.clone());
            c.join_metadata(&config, record).await;
            c.start_watchers();
            c.wait_routing().await;
            tracing::info!(node_id = id, "caught up with the cluster");
        }
        let storage = durable::open(&broker, durability.as_ref(), &config, clock)?;
        if let Some(c) = &cluster {
            // Only now do forwarded publishes find the queues' recovered sequence numbers.
            c.serve_queues();
        }
        let mirror =
            durable::start_mirror(cluster.as_ref(), storage.as_ref(), &broker, &config, clock);
        let syncer = match storage {
            Some(storage) => Some(durable::Syncer::start(storage, &config)?),
            None => None,
        };
        definitions::load_file(&config, &broker, &meta, clock).await?;
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
        tracing::info!(addr = %addrs.amqp, node = %config.node.name, memory_high_watermark = watermark, "node listening");
        tasks.extend(listeners::accept(
            &config,
            listeners.amqp,
            listeners.amqps.zip(tls.amqps),
            addrs,
            ctx,
            &tracker,
            &shutdown_rx,
        ));
        let raft = cluster.as_ref().map(|c| c.raft().clone());
        let (monitor, failed) =
            monitor::spawn(&config, broker.clone(), raft, alarm_tx, shutdown_rx.clone());
        tasks.push(monitor);
        tasks.push(tickers::spawn_elsewhere_refresh(
            broker.clone(),
            shutdown_rx.clone(),
        ));
        tasks.push(tickers::spawn_ticker(
            broker.clone(),
            meta,
            clock,
            shutdown_rx,
        ));

        Ok(Node {
            addrs,
            broker,
            shutdown: shutdown_tx,
            failed,
            tracker,
            tasks,
            syncer,
            cluster,
            mirror,
        })
    }

    /// The AMQP listener's address.
    pub fn amqp_addr(&self) -> SocketAddr {
        self.addrs.amqp
    }

    /// The AMQPS listener's address, when `[amqp.tls]` is configured.
    pub fn amqps_addr(&self) -> Option<SocketAddr> {
        self.addrs.amqps
    }

    /// The management API's HTTPS address, when `[management.tls]` is configured.
    pub fn mgmt_tls_addr(&self) -> Option<SocketAddr> {
        self.addrs.mgmt_tls
    }

    /// The admin listener's address (`warrenctl --node`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.addrs.admin
    }

    /// The management HTTP API's address, when it is on.
    pub fn mgmt_addr(&self) -> Option<SocketAddr> {
        self.addrs.mgmt
    }

    /// The Prometheus endpoint's address, when it is on.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.addrs.prometheus
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
        if let Some(syncer) = self.syncer {
            syncer.stop().await;
        }
        tracing::info!("node stopped");
    }
}

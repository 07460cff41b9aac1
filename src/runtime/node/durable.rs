//! Message storage at start (`[storage] enabled`): opened once the node has its metadata,
//! the mirrored-queue host on a clustered node, and the syncer thread; the syncer's stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::NodeError;
use crate::broker::{Broker, Durability};
use crate::config::Config;
use crate::runtime::clock::Clock;
use crate::runtime::cluster::Cluster;
use crate::runtime::mirror_host::MirrorHost;
use crate::runtime::node_link::TcpTransport;
use crate::runtime::storage::Storage;

/// Mirrored queues (clustered, with storage): the host and its tasks.
pub(super) type Mirror = (MirrorHost<TcpTransport>, Vec<JoinHandle<()>>);

/// Opens storage, recovering the queues' messages, when the node has it; queues then read
/// paged-out messages back through it.
pub(super) fn open(
    broker: &Broker,
    durability: Option<&Arc<Durability>>,
    config: &Config,
    clock: Clock,
) -> Result<Option<Arc<Storage>>, NodeError> {
    let Some(d) = durability else {
        return Ok(None);
    };
    let (storage, summary) = Storage::open(
        broker,
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
    broker.set_pager(storage.clone());
    Ok(Some(storage))
}

/// Starts the mirrored-queue host when the node is clustered and has storage.
pub(super) fn start_mirror(
    cluster: Option<&Cluster>,
    storage: Option<&Arc<Storage>>,
    broker: &Arc<Broker>,
    config: &Config,
    clock: Clock,
) -> Option<Mirror> {
    let (c, storage) = cluster.zip(storage)?;
    let host = MirrorHost::new(
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

/// The storage syncer: a thread of its own, stopped at shutdown.
pub(super) struct Syncer {
    storage: Arc<Storage>,
    thread: std::thread::JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl Syncer {
    /// Starts the syncer thread on `storage`.
    pub fn start(storage: Arc<Storage>, config: &Config) -> Result<Syncer, NodeError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, thread_stop) = (storage.clone(), stop.clone());
        let rt = tokio::runtime::Handle::current();
        let thread = std::thread::Builder::new()
            .name("warren-syncer".into())
            .spawn(move || s.run_syncer(thread_stop, rt))
            .map_err(|source| NodeError::DataDir {
                path: config.node.data_dir.clone(),
                source,
            })?;
        Ok(Syncer {
            storage,
            thread,
            stop,
        })
    }

    /// Stops the syncer: a last round, then clean markers, so the next start skips the
    /// scans.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.storage.wake();
        let thread = self.thread;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

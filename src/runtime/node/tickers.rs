//! The node's periodic tasks: the refresh of other nodes' session counts for the connection
//! and channel limits, and the broker ticker (message TTL, queue expiry).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::broker::registry::ElsewhereCounts;
use crate::broker::Broker;
use crate::runtime::clock::Clock;
use crate::runtime::conn_task::MetaCommit;

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

/// Spawns the task that keeps what the other nodes' sessions count against the connection
/// and channel limits: asked about every second, only while the node is clustered and such
/// a limit exists (a limit is then cluster-wide, give or take the last second's opens).
pub(super) fn spawn_elsewhere_refresh(
    broker: Arc<Broker>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ELSEWHERE_REFRESH);
        // A slow answer (up to the node call's deadline) delays the next ask rather than
        // bunching the missed ones.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reported = false;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                _ = tick.tick() => {
                    let wanted = broker.remote_link().is_some()
                        && counts_sessions(&broker.snapshot());
                    if wanted {
                        let nodes = crate::runtime::mgmt::remote_sessions(&broker).await;
                        let views = nodes.iter().flat_map(|n| n.connections.iter());
                        broker.sessions().set_elsewhere(ElsewhereCounts::of(views));
                        reported = true;
                    } else if reported {
                        broker.sessions().set_elsewhere(ElsewhereCounts::default());
                        reported = false;
                    }
                }
            }
        }
    })
}

/// Spawns the broker ticker: message TTL at queue heads and queue expiry, every 100 ms;
/// an expired queue's deletion is committed like any command.
pub(super) fn spawn_ticker(
    broker: Arc<Broker>,
    meta: Arc<dyn MetaCommit>,
    clock: Clock,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                _ = tick.tick() => {
                    for c in broker.tick(clock.now()) {
                        if let Err(e) = meta.commit(c, clock.now()).await {
                            tracing::debug!(error = %e, "expired queue not deleted");
                        }
                    }
                }
            }
        }
    })
}

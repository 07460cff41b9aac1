//! Drives the node's routing lease (`cluster::routing_lease`, whose rules these are):
//! quorum reads through the leader, the broker following to their index, and the lease
//! handed to the broker, which routes publishes only while it runs.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::broker::Broker;
use crate::cluster::routing_lease::{Action, RoutingLease};
use crate::runtime::clock::Clock;
use crate::runtime::raft::MetaRaft;

/// Keeps `broker`'s routing lease of `lease` renewed: reads the leader's read index through
/// `raft`, waits for `applied` (the follower's index, `follow_metadata`) to reach it, and
/// extends the lease from when the read began. Runs until aborted. The node and the
/// simulation run this one.
pub async fn keep_routing_lease(
    raft: MetaRaft,
    broker: Arc<Broker>,
    mut applied: watch::Receiver<u64>,
    clock: Clock,
    lease: Duration,
) {
    broker.require_routing_lease();
    let mut core = RoutingLease::new(lease.as_millis() as u64);
    let mut routing = false;
    loop {
        let now = clock.now();
        if core.routes(now) != routing {
            routing = !routing;
            if routing {
                tracing::info!(
                    node = broker.node_id(),
                    "routing lease held: this node routes publishes"
                );
            } else {
                tracing::warn!(
                    node = broker.node_id(),
                    "routing lease lapsed: this node nacks publishes until it follows the \
                     metadata again"
                );
            }
        }
        let Some(Action::Read { began, within_ms }) = core.poll_action(now) else {
            let next = core.deadline().unwrap_or(now).max(now.plus_millis(1));
            tokio::time::sleep_until(clock.to_tokio(next)).await;
            continue;
        };
        let within = Duration::from_millis(within_ms);
        let read = async {
            match raft.read_index(within).await {
                Ok(index) => applied.wait_for(|i| *i >= index).await.is_ok(),
                Err(e) => {
                    tracing::debug!(error = %e, "routing lease not renewed");
                    false
                }
            }
        };
        let followed = tokio::time::timeout(within, read).await.unwrap_or(false);
        core.handle_read(clock.now(), began, followed);
        if let Some(until) = core.valid_until() {
            broker.extend_routing_lease(until);
        }
    }
}

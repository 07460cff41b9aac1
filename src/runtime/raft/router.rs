//! [`Router`]: an in-process [`RaftTransport`] connecting nodes of one process, with
//! partitions, for tests. Nodes use the TCP node links (`runtime::node_link`).
//!
//! A call is delivered by running the target's [`RpcServer`] in the caller's task. A cut link
//! fails fast as *unreachable*, like a refused connection; a link cut while the call runs
//! loses the reply, like a partition that eats the response.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::network::{RaftTransport, RpcServer, TransportError};
use super::types::NodeId;

#[derive(Default)]
struct Links {
    servers: BTreeMap<NodeId, RpcServer>,
    /// Nodes cut off from everyone.
    isolated: BTreeSet<NodeId>,
    /// Cut pairs, stored both ways round.
    cut: BTreeSet<(NodeId, NodeId)>,
}

impl Links {
    fn connected(&self, a: NodeId, b: NodeId) -> bool {
        !self.isolated.contains(&a) && !self.isolated.contains(&b) && !self.cut.contains(&(a, b))
    }
}

/// The switchboard shared by every node of an in-process cluster. Clones share it.
#[derive(Clone, Default)]
pub struct Router {
    links: Arc<Mutex<Links>>,
}

impl Router {
    /// An empty router.
    pub fn new() -> Router {
        Router::default()
    }

    fn lock(&self) -> MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The transport node `me` sends through.
    pub fn transport(&self, me: NodeId) -> RouterTransport {
        RouterTransport {
            me,
            router: self.clone(),
        }
    }

    /// Delivers calls for `node` to `server` (replacing a previous one: a restart).
    pub fn serve(&self, node: NodeId, server: RpcServer) {
        self.lock().servers.insert(node, server);
    }

    /// Stops delivering to `node`, as if its process died.
    pub fn remove(&self, node: NodeId) {
        self.lock().servers.remove(&node);
    }

    /// Cuts `node` off from every other node.
    pub fn isolate(&self, node: NodeId) {
        self.lock().isolated.insert(node);
    }

    /// Cuts every link between a node of `a` and a node of `b`.
    pub fn partition(&self, a: &[NodeId], b: &[NodeId]) {
        let mut links = self.lock();
        for &x in a {
            for &y in b {
                links.cut.insert((x, y));
                links.cut.insert((y, x));
            }
        }
    }

    /// Restores every link.
    pub fn heal(&self) {
        let mut links = self.lock();
        links.isolated.clear();
        links.cut.clear();
    }
}

/// One node's side of the [`Router`].
#[derive(Clone)]
pub struct RouterTransport {
    me: NodeId,
    router: Router,
}

impl RaftTransport for RouterTransport {
    async fn call(
        &self,
        target: NodeId,
        _addr: &str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let unreachable = |reason: &str| TransportError::Unreachable {
            node: target,
            reason: reason.to_string(),
        };
        let server = {
            let links = self.router.lock();
            if !links.connected(self.me, target) {
                return Err(unreachable("partitioned"));
            }
            links.servers.get(&target).cloned()
        };
        let server = server.ok_or_else(|| unreachable("not running"))?;
        let reply = tokio::time::timeout(deadline, server.handle(&frame))
            .await
            .map_err(|_| TransportError::Timeout)?;
        if !self.router.lock().connected(self.me, target) {
            // Cut while the call ran: the reply is lost and the caller sees no answer.
            return Err(TransportError::Timeout);
        }
        Ok(reply)
    }
}

//! [`ClusterControl`]: what `warrenctl` and the management API do to the cluster (join,
//! forget, status) on a clustered node.

use std::sync::Arc;

use crate::broker::Broker;
use crate::meta::NodeRecord;
use crate::runtime::node_link::TcpTransport;

use crate::runtime::raft::{MetaRaft, NodeId};

/// The admin endpoint's view of the cluster: `cluster_status` and `join_cluster`.
#[derive(Clone)]
pub struct ClusterControl {
    pub(super) raft: MetaRaft,
    pub(super) transport: TcpTransport,
    pub(super) broker: Arc<Broker>,
    pub(super) record: NodeRecord,
    /// How `join_cluster` reaches the seed's admin endpoint: TLS when this node's
    /// `[admin.tls]` names a `cacertfile` (the seed's endpoint is then expected to speak
    /// TLS too), plaintext otherwise.
    pub(super) admin_tls: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for ClusterControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterControl")
            .field("node", &self.record.id)
            .finish_non_exhaustive()
    }
}

impl ClusterControl {
    /// `cluster_status`: every registered node, whether it runs (as the failure detector
    /// sees it from here), its Raft role and addresses; then members not registered yet.
    pub fn status(&self) -> crate::admin::Response {
        let state = self.raft.snapshot();
        let m = self.raft.membership();
        let leader = self.raft.leader();
        let role = |id: NodeId| {
            if leader == Some(id) {
                "leader"
            } else if m.voters.contains_key(&id) {
                "voter"
            } else if m.learners.contains_key(&id) {
                "learner"
            } else {
                "joining"
            }
        };
        let me = self.record.id;
        let mut rows: Vec<Vec<String>> = state
            .nodes
            .values()
            .map(|n| {
                let running = n.id == me || !self.broker.node_is_down(n.id);
                vec![
                    n.name.clone(),
                    n.id.to_string(),
                    running.to_string(),
                    role(n.id).into(),
                    n.amqp.clone(),
                    n.link.clone(),
                ]
            })
            .collect();
        for (id, link) in m.voters.iter().chain(m.learners.iter()) {
            if !state.nodes.contains_key(id) {
                rows.push(vec![
                    String::new(),
                    id.to_string(),
                    self.transport.peer_alive(*id).to_string(),
                    role(*id).into(),
                    String::new(),
                    link.clone(),
                ]);
            }
        }
        crate::admin::Response::table(
            ["node", "id", "running", "raft", "amqp", "link"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            rows,
        )
    }

    /// `join_cluster SEED`: registers this node with the cluster `seed` (an admin address)
    /// belongs to, using the caller's credentials, and learns its members' link addresses.
    /// The leader then adds this node as a learner (a voter while there are fewer than
    /// five); this node serves clients once it has caught up.
    pub async fn join(&self, seed: &str, auth: &crate::admin::Auth) -> crate::admin::Response {
        use crate::admin::{Request, Response};
        let members = self.raft.membership();
        if !members.voters.is_empty() || self.raft.leader().is_some() {
            return Response::refused(
                "this node already belongs to a cluster (forget it there and start afresh)",
            );
        }
        let requests = [
            Request::RegisterMember(self.record.clone()),
            Request::ClusterStatus,
        ];
        let tls = self.admin_tls.as_ref();
        let replies = match crate::runtime::admin::call(seed, auth, &requests, tls).await {
            Ok(r) => r,
            Err(e) => return Response::refused(format!("cannot reach {seed}: {e}")),
        };
        if let Some(refusal) = replies.iter().find(|r| !r.ok) {
            return Response::refused(format!("{seed} refused: {}", refusal.message));
        }
        let status = &replies[1];
        let id_col = status.columns.iter().position(|c| c == "id");
        let link_col = status.columns.iter().position(|c| c == "link");
        if let (Some(i), Some(l)) = (id_col, link_col) {
            for row in &status.rows {
                if let Ok(id) = row[i].parse::<NodeId>() {
                    if id != self.record.id && !row[l].is_empty() {
                        self.transport.set_peer(id, row[l].clone());
                    }
                }
            }
        }
        Response::done(format!(
            "node {} registered with the cluster of {seed}; it serves clients once it has caught up",
            self.record.id
        ))
    }
}

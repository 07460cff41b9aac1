//! The node's endpoints besides AMQP: the admin endpoint (`warrenctl`), the management API
//! over HTTP and HTTPS, and the Prometheus metrics endpoint, served on bound listeners.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::listeners::{Addrs, AdminTls};
use crate::broker::node_stats::ListenerInfo;
use crate::broker::Broker;
use crate::config::Config;
use crate::runtime::clock::Clock;
use crate::runtime::cluster::Cluster;
use crate::runtime::conn_task::MetaCommit;
use crate::runtime::node_stats::{endpoint, NodeFacts};
use crate::runtime::{admin, mgmt, prometheus, tls};

/// What every endpoint serves from.
pub(super) struct Endpoints<'a> {
    pub config: &'a Config,
    pub broker: &'a Arc<Broker>,
    pub clock: Clock,
    pub meta: &'a Arc<dyn MetaCommit>,
    pub cluster: Option<&'a Cluster>,
    pub facts: &'a Arc<NodeFacts>,
    pub addrs: Addrs,
    pub shutdown: &'a watch::Receiver<bool>,
}

impl Endpoints<'_> {
    /// Spawns the admin endpoint, with `[admin.tls]` when configured; on a clustered node
    /// (`record` given) it also answers cluster status and `join_cluster`.
    pub fn serve_admin(
        &self,
        listener: TcpListener,
        tls: AdminTls,
        record: Option<crate::meta::NodeRecord>,
        tracker: &TaskTracker,
    ) -> JoinHandle<()> {
        let AdminTls {
            acceptor,
            connector,
        } = tls;
        tracing::info!(addr = %self.addrs.admin, tls = acceptor.is_some(), "admin listening");
        tokio::spawn(admin::serve(
            listener,
            admin::AdminContext {
                broker: self.broker.clone(),
                node: crate::admin::NodeInfo {
                    name: self.config.node.name.clone(),
                },
                clock: self.clock,
                meta: self.meta.clone(),
                cluster: self
                    .cluster
                    .zip(record)
                    .map(|(c, r)| c.control(r, connector)),
            },
            tracker.clone(),
            self.shutdown.clone(),
            acceptor,
        ))
    }

    /// The node's listeners; recorded in its facts too, for other nodes that ask.
    fn listeners(&self) -> Vec<ListenerInfo> {
        let addrs = self.addrs;
        let list: Vec<ListenerInfo> = [
            Some(("amqp", addrs.amqp)),
            addrs.amqps.map(|a| ("amqp/ssl", a)),
            addrs.mgmt.map(|a| ("http", a)),
            addrs.mgmt_tls.map(|a| ("https", a)),
            addrs.prometheus.map(|a| ("http/prometheus", a)),
            self.cluster
                .map(|c| ("clustering", c.transport().local_addr())),
            Some(("warren/admin", addrs.admin)),
        ]
        .into_iter()
        .flatten()
        .map(|(protocol, addr)| ListenerInfo {
            protocol: protocol.to_string(),
            addr: endpoint(addr),
        })
        .collect();
        let _ = self.facts.listeners.set(list.clone());
        list
    }

    /// Spawns the management API (HTTP, and HTTPS with `[management.tls]`) and the
    /// Prometheus endpoint, each only when its listener is configured.
    pub fn serve_http(
        &self,
        mgmt_listener: Option<TcpListener>,
        mgmt_tls: Option<(TcpListener, Arc<rustls::ServerConfig>)>,
        prometheus_listener: Option<TcpListener>,
    ) -> Vec<JoinHandle<()>> {
        let (config, addrs) = (self.config, self.addrs);
        let mut tasks = Vec::new();
        let mgmt_ctx = mgmt::MgmtContext {
            broker: self.broker.clone(),
            node: crate::admin::NodeInfo {
                name: config.node.name.clone(),
            },
            clock: self.clock,
            meta: self.meta.clone(),
            loopback_users: Arc::new(config.amqp.loopback_users.clone()),
            listeners: Arc::new(self.listeners()),
            amqp: addrs.amqp,
            facts: self.facts.clone(),
        };
        if let (Some(listener), Some(mgmt)) = (mgmt_listener, addrs.mgmt) {
            tracing::info!(addr = %mgmt, "management API listening");
            tasks.push(tokio::spawn(mgmt::serve(
                listener,
                mgmt_ctx.clone(),
                self.shutdown.clone(),
            )));
        }
        if let (Some((listener, tls)), Some(https)) = (mgmt_tls, addrs.mgmt_tls) {
            tracing::info!(addr = %https, "management API listening (HTTPS)");
            let listener =
                tls::https::TlsListener::start(listener, https, tls, self.shutdown.clone());
            tasks.push(tokio::spawn(mgmt::serve_tls(
                listener,
                mgmt_ctx,
                self.shutdown.clone(),
            )));
        }
        if let (Some(listener), Some(addr)) = (prometheus_listener, addrs.prometheus) {
            tracing::info!(%addr, "prometheus metrics listening");
            tasks.push(tokio::spawn(prometheus::serve(
                listener,
                prometheus::PrometheusContext {
                    broker: self.broker.clone(),
                    node: config.node.name.clone(),
                    cluster: config
                        .cluster
                        .as_ref()
                        .map_or_else(|| config.node.name.clone(), |c| c.cluster_id.clone()),
                    raft: self.cluster.map(|c| c.raft().clone()),
                    facts: self.facts.clone(),
                },
                self.shutdown.clone(),
            )));
        }
        tasks
    }
}

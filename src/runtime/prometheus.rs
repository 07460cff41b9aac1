//! The Prometheus listener: axum serves `/metrics` and `/metrics/per-object` (RabbitMQ's
//! paths); each scrape reads a [`Sample`] of the node (sessions, local queues, Raft,
//! process figures from `/proc`) and renders it with the counters through the sans-IO
//! [`crate::metrics`].

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response as HttpResponse;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::broker::Broker;
use crate::metrics::{self, Detail, Format, QueueSample, Sample};
use crate::runtime::node_stats::{self, NodeFacts};
use crate::runtime::raft::MetaRaft;

/// What every scrape reads.
#[derive(Clone)]
pub struct PrometheusContext {
    /// The broker.
    pub broker: Arc<Broker>,
    /// This node's name.
    pub node: String,
    /// The cluster's name (`rabbitmq_cluster`).
    pub cluster: String,
    /// The metadata Raft group (cluster mode).
    pub raft: Option<MetaRaft>,
    /// What the node knows of itself from its start.
    pub facts: Arc<NodeFacts>,
}

/// Serves `listener` until `shutdown` flips.
pub async fn serve(listener: TcpListener, ctx: PrometheusContext, shutdown: watch::Receiver<bool>) {
    let app = axum::Router::new().fallback(handler).with_state(ctx);
    super::http::serve(listener, app, shutdown, "prometheus").await;
}

async fn handler(
    State(ctx): State<PrometheusContext>,
    uri: Uri,
    headers: HeaderMap,
) -> HttpResponse {
    let detail = match uri.path() {
        "/metrics" => Detail::Aggregated,
        "/metrics/per-object" => Detail::PerObject,
        _ => return status(StatusCode::NOT_FOUND),
    };
    let format = Format::from_accept(headers.get("accept").and_then(|v| v.to_str().ok()));
    let text = metrics::render(ctx.broker.metrics(), &sample(&ctx), detail, format);
    let mut out = HttpResponse::new(Body::from(text));
    out.headers_mut().insert(
        "content-type",
        HeaderValue::from_static(format.content_type()),
    );
    out
}

fn status(code: StatusCode) -> HttpResponse {
    let mut out = HttpResponse::new(Body::empty());
    *out.status_mut() = code;
    out
}

/// What the node holds now.
fn sample(ctx: &PrometheusContext) -> Sample {
    let broker = &ctx.broker;
    let conns = broker.sessions().connections();
    let channels = conns.iter().map(|c| c.channels.len() as u64).sum();
    let consumers = conns
        .iter()
        .flat_map(|c| c.channels.iter())
        .map(|ch| ch.consumers.len() as u64)
        .sum();
    let meta = broker.snapshot();
    let queues = broker
        .all_queues()
        .iter()
        .map(|h| {
            let (ready, unacked, consumers, ready_bytes) = {
                let q = h.lock();
                (
                    u64::from(q.message_count()),
                    u64::from(q.unacked_count()),
                    u64::from(q.consumer_count()),
                    q.ready_bytes(),
                )
            };
            let set = meta.mirror_sets.get(&(h.vhost.clone(), h.name.clone()));
            QueueSample {
                vhost: h.vhost.clone(),
                name: h.name.clone(),
                ready,
                unacked,
                consumers,
                ready_bytes,
                mirrors: set.map_or(0, |s| s.mirrors.len() as u64),
                synchronised_mirrors: set.map_or(0, |s| {
                    s.mirrors.iter().filter(|m| m.synchronised).count() as u64
                }),
            }
        })
        .collect();
    let (open_fds, max_fds) = node_stats::fds();
    Sample {
        node: ctx.node.clone(),
        cluster: ctx.cluster.clone(),
        version: env!("CARGO_PKG_VERSION"),
        rabbitmq_version: crate::mgmt::definitions::RABBIT_VERSION,
        connections: conns.len() as u64,
        channels,
        consumers,
        queues,
        resident_memory_bytes: node_stats::resident_memory().unwrap_or(0),
        memory_limit_bytes: broker.memory_high_watermark(),
        memory_alarm: broker.memory_alarm(),
        open_fds,
        max_fds,
        disk_free_limit_bytes: ctx.facts.disk_free_limit,
        uptime_seconds: ctx.facts.started.elapsed().as_secs_f64(),
        raft: ctx.raft.as_ref().map(MetaRaft::progress),
    }
}

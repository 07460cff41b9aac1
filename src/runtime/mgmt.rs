//! The management HTTP listener: axum serves HTTP/1.1 (and HTTPS with `[management.tls]`)
//! and hands every request to the sans-IO [`crate::mgmt`] core (the web console's files,
//! [`crate::mgmt::console`], or the API). Changes it plans are committed through the node's
//! `MetaCommit`. What other nodes hold is asked of them before the core answers: queue
//! counts the way `warrenctl list_queues` fetches them ([`super::admin::remote_counts`]),
//! and sessions and node figures over the node links (`NodeCall`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, Method as HttpMethod, StatusCode, Uri};
use axum::response::Response as HttpResponse;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::clock::Clock;
use super::conn_task::MetaCommit;
use super::node_stats::NodeFacts;
use crate::admin::NodeInfo;
use crate::broker::node_stats::NodeStats;
use crate::broker::remote::{NodeCall, NodeReply};
use crate::broker::Broker;
use crate::meta::Command;
use crate::mgmt::{
    self, Context, CountsScope, Handled, Method, NodeSessions, RemoteCountsByVhost, Request,
    Response,
};

/// What every management request shares.
#[derive(Clone)]
pub struct MgmtContext {
    /// The broker.
    pub broker: Arc<Broker>,
    /// This node.
    pub node: NodeInfo,
    /// The node's clock.
    pub clock: Clock,
    /// Where metadata changes are committed.
    pub meta: Arc<dyn MetaCommit>,
    /// `[amqp] loopback_users`.
    pub loopback_users: Arc<Vec<String>>,
    /// The node's listeners, for the listener health checks.
    pub listeners: Arc<Vec<mgmt::health::Listener>>,
    /// The AMQP listener, for the work done over a channel ([`super::direct`]).
    pub amqp: SocketAddr,
    /// What this node knows of itself, for its figures in `GET /api/nodes`.
    pub facts: Arc<NodeFacts>,
}

/// Serves `listener` until `shutdown` flips.
pub async fn serve(listener: TcpListener, ctx: MgmtContext, shutdown: watch::Receiver<bool>) {
    super::http::serve(listener, router(ctx), shutdown, "management").await;
}

/// Serves the same API over HTTPS (`[management.tls]`) until `shutdown` flips.
pub async fn serve_tls(
    listener: super::tls::https::TlsListener,
    ctx: MgmtContext,
    shutdown: watch::Receiver<bool>,
) {
    super::http::serve_tls(listener, router(ctx), shutdown, "management HTTPS").await;
}

fn router(ctx: MgmtContext) -> axum::Router {
    axum::Router::new().fallback(handler).with_state(ctx)
}

async fn handler(
    State(ctx): State<MgmtContext>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: HttpMethod,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> HttpResponse {
    let req = Request {
        method: match method {
            HttpMethod::GET | HttpMethod::HEAD => Method::Get,
            HttpMethod::PUT => Method::Put,
            HttpMethod::POST => Method::Post,
            HttpMethod::DELETE => Method::Delete,
            _ => Method::Other,
        },
        path: uri.path().to_string(),
        query: uri.query().unwrap_or("").to_string(),
        body: body.to_vec(),
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(String::from),
        peer_loopback: peer.ip().is_loopback(),
        x_reason: headers
            .get("x-reason")
            .and_then(|v| v.to_str().ok())
            .map(String::from),
    };
    if let Some(asset) = mgmt::console::asset(&req) {
        return asset_http(asset);
    }
    let response = answer(&ctx, &req).await;
    if response.status >= 400 {
        tracing::debug!(path = %req.path, status = response.status, "management request refused");
    }
    to_http(response)
}

async fn answer(ctx: &MgmtContext, req: &Request) -> Response {
    let mut counts = RemoteCountsByVhost::new();
    let scope = (req.method == Method::Get)
        .then(|| mgmt::counts_scope(&req.path))
        .flatten();
    match scope {
        Some(CountsScope::All) => {
            for vhost in ctx.broker.snapshot().vhosts.keys() {
                counts.insert(
                    vhost.clone(),
                    super::admin::remote_counts(&ctx.broker, vhost).await,
                );
            }
        }
        Some(CountsScope::Vhost(vhost)) => {
            let c = super::admin::remote_counts(&ctx.broker, &vhost).await;
            counts.insert(vhost, c);
        }
        Some(CountsScope::Queue(vhost, name)) => {
            let c = super::admin::remote_counts_of(&ctx.broker, &vhost, Some(&name)).await;
            counts.insert(vhost, c);
        }
        None => {}
    }
    let sessions = if live_path(&req.method, &req.path) {
        remote_sessions(&ctx.broker).await
    } else {
        Vec::new()
    };
    let node_stats = if req.method == Method::Get && nodes_path(&req.path) {
        node_stats(ctx).await
    } else {
        BTreeMap::new()
    };
    let core = Context {
        broker: &ctx.broker,
        node: &ctx.node,
        loopback_users: &ctx.loopback_users,
        remote_counts: &counts,
        listeners: &ctx.listeners,
        remote_sessions: &sessions,
        node_stats: &node_stats,
    };
    let planned = mgmt::plan(&core, req);
    match planned {
        Handled::Reply(r) => r,
        Handled::Commit { commands, ok } => {
            // A definitions import's many commands go in batches: one log entry and one
            // definitions write per batch.
            for c in Command::batched(commands) {
                if let Err(e) = ctx.meta.commit(c, ctx.clock.now()).await {
                    return Response::bad_request(e.to_string());
                }
            }
            ok
        }
        Handled::CloseConnection {
            node: None,
            id,
            reason,
        } => mgmt::close_connection(&ctx.broker, id, &reason),
        Handled::CloseConnection {
            node: Some(node),
            id,
            reason,
        } => {
            let Some(link) = ctx.broker.remote_link() else {
                return Response::not_found();
            };
            let call = link.node_call(node, NodeCall::CloseConnection { id, reason });
            match tokio::time::timeout(NODE_CALL_DEADLINE, call).await {
                Ok(NodeReply::Closed(true)) => Response::empty(204),
                Ok(NodeReply::Closed(false)) => Response::not_found(),
                _ => Response::error(
                    503,
                    "service_unavailable",
                    "the connection's node did not answer",
                ),
            }
        }
        Handled::Direct(d) => {
            let outcome = super::direct::run(ctx.amqp, &d).await;
            mgmt::direct::reply(&d.op, outcome)
        }
    }
}

/// How long a listing waits for another node's sessions.
const NODE_CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether the request lists (or closes) connections, channels or consumers.
fn live_path(method: &Method, path: &str) -> bool {
    let p = path.trim_end_matches('/');
    p.starts_with("/api/connections")
        || p.starts_with("/api/channels")
        || p.starts_with("/api/consumers")
        || (p.starts_with("/api/vhosts/")
            && (p.ends_with("/connections") || p.ends_with("/channels")))
        // One queue's object: its `consumer_details` (names are percent-encoded, so a
        // queue's path has exactly three segments).
        || (*method == Method::Get
            && p.strip_prefix("/api/queues/").is_some_and(|r| r.split('/').count() == 2))
}

/// Whether the path shows what nodes report of themselves: node objects, or the
/// overview's listeners and contexts of every node.
fn nodes_path(path: &str) -> bool {
    let path = path.trim_end_matches('/');
    path == "/api/nodes" || path.starts_with("/api/nodes/") || path == "/api/overview"
}

/// This node's figures and those of every other node not recorded down that answers
/// within [`NODE_CALL_DEADLINE`], by name.
async fn node_stats(ctx: &MgmtContext) -> BTreeMap<String, NodeStats> {
    let mut out = BTreeMap::new();
    out.insert(
        ctx.node.name.clone(),
        super::node_stats::read(&ctx.broker, &ctx.facts),
    );
    let Some(link) = ctx.broker.remote_link() else {
        return out;
    };
    let me = ctx.broker.node_id();
    let mut calls = tokio::task::JoinSet::new();
    for (id, record) in ctx.broker.snapshot().nodes.iter() {
        if *id == me || ctx.broker.node_is_down(*id) {
            continue;
        }
        let name = record.name.clone();
        let call = link.node_call(*id, NodeCall::Stats);
        calls.spawn(async move {
            match tokio::time::timeout(NODE_CALL_DEADLINE, call).await {
                Ok(NodeReply::Stats(stats)) => Some((name, *stats)),
                _ => None,
            }
        });
    }
    while let Some(r) = calls.join_next().await {
        if let Ok(Some((name, stats))) = r {
            out.insert(name, stats);
        }
    }
    out
}

/// The sessions of every other node not recorded down, asked at once; a node that does not
/// answer within [`NODE_CALL_DEADLINE`] is left out.
pub(crate) async fn remote_sessions(broker: &Broker) -> Vec<NodeSessions> {
    let Some(link) = broker.remote_link() else {
        return Vec::new();
    };
    let me = broker.node_id();
    let mut calls = tokio::task::JoinSet::new();
    for (id, record) in broker.snapshot().nodes.iter() {
        if *id == me || broker.node_is_down(*id) {
            continue;
        }
        let (id, name) = (*id, record.name.clone());
        let call = link.node_call(id, NodeCall::Sessions);
        calls.spawn(async move {
            match tokio::time::timeout(NODE_CALL_DEADLINE, call).await {
                Ok(NodeReply::Sessions(connections)) => Some(NodeSessions {
                    id,
                    name,
                    connections,
                }),
                _ => None,
            }
        });
    }
    let mut out = Vec::new();
    while let Some(r) = calls.join_next().await {
        if let Ok(Some(s)) = r {
            out.push(s);
        }
    }
    out.sort_by_key(|s| s.id);
    out
}

/// A console file (`mgmt::console`): the bytes, their type, and no caching, so a page
/// loaded after an upgrade is the new binary's.
fn asset_http(asset: mgmt::console::Asset) -> HttpResponse {
    let mut out = HttpResponse::new(Body::from(asset.body));
    let h = out.headers_mut();
    h.insert("content-type", HeaderValue::from_static(asset.content_type));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    out
}

fn to_http(r: Response) -> HttpResponse {
    let json = r.body.is_some() || r.raw.is_some();
    let body = match (r.raw, &r.body) {
        (Some(raw), _) => Body::from(raw),
        (None, Some(v)) => Body::from(serde_json::to_vec(v).unwrap_or_default()),
        (None, None) => Body::empty(),
    };
    let mut out = HttpResponse::new(body);
    *out.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = out.headers_mut();
    if json {
        h.insert("content-type", HeaderValue::from_static("application/json"));
    }
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    for (name, value) in r.headers {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    out
}

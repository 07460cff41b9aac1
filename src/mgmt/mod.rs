//! RabbitMQ's management HTTP API, sans-IO: a [`Request`] (method, path, query, body, the
//! `Authorization` header) becomes a [`Response`] (status, JSON body, headers), or the
//! metadata commands to commit first ([`Handled::Commit`]).
//!
//! Paths, JSON field names, status codes and error bodies follow RabbitMQ 3.10's management
//! plugin (`docs/management.md` lists what is built and the deliberate differences). The
//! listings reuse the admin protocol's ([`crate::admin`], what `warrenctl` shows) and turn
//! its rows into RabbitMQ's JSON, but the queues' (written as JSON text from their typed
//! rows, [`queue_object`]: there can be tens of thousands); changes are checked here and
//! committed by the driver
//! ([`crate::runtime::mgmt`]) through the node's `MetaCommit`, like `warrenctl`'s.
//!
//! Authentication is HTTP basic auth against Warren's users, with the password check of the
//! AMQP login ([`crate::meta::state::User::password_matches`]). A user needs one of the
//! tags `management`, `policymaker`, `monitoring` or `administrator`, each granting what it
//! grants in RabbitMQ (see [`Tags`]).
//!
//! - [`resources`]: one function per endpoint.
//! - [`bindings`]: the binding endpoints.
//! - [`convert`]: JSON to AMQP argument tables, admin rows to JSON.
//! - [`definitions`]: RabbitMQ's definitions export and import, whole or per vhost.
//! - [`direct`]: publish, get, purge and the aliveness test, done over an AMQP channel.
//! - [`health`]: the health checks.
//! - [`live`]: this node's connections, channels and consumers.
//! - [`parameters`]: runtime parameters (operator policies), global parameters, limits.
//! - [`query`]: `columns`, `sort` and pagination of listings.
//! - [`ring`]: Warren's `gm_ring` of a single queue, for the console.
//! - [`console`]: the web console's static files, served outside `/api/`.

pub mod bindings;
pub mod console;
pub mod convert;
pub mod definitions;
pub mod direct;
pub mod health;
pub mod listeners;
pub mod live;
pub mod parameters;
pub mod query;
pub mod queue_object;
pub mod resources;
pub mod ring;

use base64::Engine;
use serde_json::{json, Value};

use crate::admin::{NodeInfo, RemoteCounts};
use crate::broker::Broker;
use crate::meta::state::User;
use crate::meta::{Command, MetaState};
use crate::time::Instant;

/// The realm RabbitMQ names in `WWW-Authenticate`.
pub const REALM: &str = "RabbitMQ Management";

/// The HTTP method of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// GET (and HEAD).
    Get,
    /// PUT.
    Put,
    /// POST.
    Post,
    /// DELETE.
    Delete,
    /// Anything else: 405.
    Other,
}

/// One HTTP request, as the driver read it.
#[derive(Clone, Debug)]
pub struct Request {
    /// Method.
    pub method: Method,
    /// The path as sent (percent-encoded), e.g. `/api/queues/%2F/q1`.
    pub path: String,
    /// The query string without `?` (may be empty).
    pub query: String,
    /// The body.
    pub body: Vec<u8>,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// Whether the peer is on a loopback address (for `loopback_users`).
    pub peer_loopback: bool,
    /// The `X-Reason` header (the text a closed connection is given).
    pub x_reason: Option<String>,
}

impl Request {
    /// A request with no body from a loopback peer (tests, tools).
    pub fn new(method: Method, path: &str, authorization: Option<String>) -> Request {
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        Request {
            method,
            path: path.to_string(),
            query: query.to_string(),
            body: Vec::new(),
            authorization,
            peer_loopback: true,
            x_reason: None,
        }
    }

    /// With a body.
    pub fn with_body(mut self, body: &[u8]) -> Request {
        self.body = body.to_vec();
        self
    }

    /// The value of query parameter `key`, if present (not percent-decoded beyond `+`).
    pub fn query_value(&self, key: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k == key).then(|| decode(&v.replace('+', " ")))
        })
    }
}

/// The `Authorization` header value for basic auth (for clients and tests).
pub fn basic_auth(user: &str, password: &str) -> String {
    let raw = format!("{user}:{password}");
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

/// One HTTP response.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// JSON body (none: an empty body, unless `raw` holds it).
    pub body: Option<Value>,
    /// A JSON body already written as text (a listing large enough that building it as
    /// values would take most of its time); `body` is then `None`.
    pub raw: Option<Vec<u8>>,
    /// Extra headers (`WWW-Authenticate`, `Location`).
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    /// 200 with a JSON body.
    pub fn ok(body: Value) -> Response {
        Response {
            status: 200,
            body: Some(body),
            raw: None,
            headers: Vec::new(),
        }
    }

    /// 200 with a body written as JSON text.
    pub fn ok_raw(json: Vec<u8>) -> Response {
        Response {
            status: 200,
            body: None,
            raw: Some(json),
            headers: Vec::new(),
        }
    }

    /// A status with no body (201, 204, 405).
    pub fn empty(status: u16) -> Response {
        Response {
            status,
            body: None,
            raw: None,
            headers: Vec::new(),
        }
    }

    /// RabbitMQ's error body, `{"error": ..., "reason": ...}`.
    pub fn error(status: u16, error: &str, reason: impl Into<String>) -> Response {
        Response {
            status,
            body: Some(json!({"error": error, "reason": reason.into()})),
            raw: None,
            headers: Vec::new(),
        }
    }

    /// 404 as RabbitMQ sends it for a missing object.
    pub fn not_found() -> Response {
        Response::error(404, "Object Not Found", "Not Found")
    }

    /// 400 `bad_request`.
    pub fn bad_request(reason: impl Into<String>) -> Response {
        Response::error(400, "bad_request", reason)
    }

    /// 401 `not_authorised` (RabbitMQ 3.10 answers 401, not 403, to a user that lacks a tag
    /// or access to a vhost).
    pub fn not_authorised(reason: impl Into<String>) -> Response {
        Response::error(401, "not_authorised", reason)
    }

    /// The same error with a structured `reason` (RabbitMQ prints some Erlang terms as lists).
    pub fn with_reason(mut self, reason: Value) -> Response {
        if let Some(Value::Object(o)) = self.body.as_mut() {
            o.insert("reason".to_string(), reason);
        }
        self
    }

    fn with_header(mut self, name: &'static str, value: String) -> Response {
        self.headers.push((name, value));
        self
    }

    /// The body as text (empty when none).
    pub fn body_text(&self) -> String {
        match (&self.raw, &self.body) {
            (Some(raw), _) => String::from_utf8_lossy(raw).into_owned(),
            (None, body) => body.as_ref().map(Value::to_string).unwrap_or_default(),
        }
    }
}

/// What a request needs: an answer now, or metadata commands to commit first.
#[derive(Debug)]
pub enum Handled {
    /// The answer.
    Reply(Response),
    /// Commit `commands` in order (through the node's `MetaCommit`); when all succeed answer
    /// `ok`, on the first refusal 400 with its text.
    Commit {
        /// The changes.
        commands: Vec<Command>,
        /// The answer on success.
        ok: Response,
    },
    /// Carry out the work over an AMQP connection to this node as the caller, and answer
    /// with [`direct::reply`].
    Direct(Box<direct::Direct>),
    /// Close connection `id` with 320 `CONNECTION_FORCED - {reason}`
    /// ([`crate::broker::registry::Registry::close`]) on this node (`node: None`) or through
    /// the relay on another, then answer 204 (404 if it is gone).
    CloseConnection {
        /// The connection's node, when not this one.
        node: Option<crate::meta::NodeId>,
        /// The connection's id.
        id: u64,
        /// The reply text.
        reason: String,
    },
}

/// Counts of other nodes' queues by vhost (what their nodes answered; see
/// [`crate::admin::RemoteCounts`]).
pub type RemoteCountsByVhost = std::collections::BTreeMap<String, RemoteCounts>;

/// What every request is answered from.
pub struct Context<'a> {
    /// The broker.
    pub broker: &'a Broker,
    /// This node.
    pub node: &'a NodeInfo,
    /// Users that may only log in from a loopback address (`[amqp] loopback_users`).
    pub loopback_users: &'a [String],
    /// Counts of queues other nodes run.
    pub remote_counts: &'a RemoteCountsByVhost,
    /// This node's listeners (the listener health checks).
    pub listeners: &'a [health::Listener],
    /// The other running nodes' connections (for the live listings; empty otherwise).
    pub remote_sessions: &'a [NodeSessions],
    /// The figures of the nodes that answered, by name, this node's among them (for
    /// `GET /api/nodes`; empty otherwise).
    pub node_stats: &'a std::collections::BTreeMap<String, crate::broker::node_stats::NodeStats>,
}

/// Another node's connections, as it answered.
#[derive(Clone, Debug)]
pub struct NodeSessions {
    /// Its id.
    pub id: crate::meta::NodeId,
    /// Its name.
    pub name: String,
    /// Its connections.
    pub connections: Vec<crate::broker::registry::ConnectionView>,
}

/// The management tags a user has, and what they grant (RabbitMQ's meanings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    /// `administrator`: everything.
    pub administrator: bool,
    /// `monitoring` (or administrator): every vhost's objects, nodes.
    pub monitoring: bool,
    /// `policymaker` (or administrator): policies in the vhosts the user can access.
    pub policymaker: bool,
    /// Any of the four: the API at all.
    pub management: bool,
}

impl Tags {
    /// The tags of `user`.
    pub fn of(user: &User) -> Tags {
        let has = |t: &str| user.tags.iter().any(|x| x == t);
        let administrator = has("administrator");
        let monitoring = administrator || has("monitoring");
        let policymaker = administrator || has("policymaker");
        Tags {
            administrator,
            monitoring,
            policymaker,
            management: monitoring || policymaker || has("management"),
        }
    }
}

/// The authenticated user of a request.
#[derive(Clone, Debug)]
pub struct Caller {
    /// The user.
    pub user: User,
    /// Its tags.
    pub tags: Tags,
}

impl Caller {
    /// Whether the caller may see `vhost`'s objects: monitoring users see every vhost,
    /// others the vhosts they have permissions in.
    pub fn sees_vhost(&self, meta: &MetaState, vhost: &str) -> bool {
        self.tags.monitoring || self.can_access(meta, vhost)
    }

    /// Whether the caller has permissions in `vhost` (RabbitMQ's "login vhosts").
    pub fn can_access(&self, meta: &MetaState, vhost: &str) -> bool {
        meta.permissions
            .contains_key(&(self.user.name.clone(), vhost.to_string()))
    }
}

fn unauthenticated() -> Response {
    Response::empty(401).with_header("www-authenticate", format!("Basic realm=\"{REALM}\""))
}

/// Checks the basic-auth credentials and the management tags (RabbitMQ's
/// `rabbit_mgmt_util:is_authorized`): no credentials 401 with `WWW-Authenticate`; wrong
/// ones 401 "Login failed"; no management tag 401 "Not management user".
pub fn authenticate(
    meta: &MetaState,
    req: &Request,
    loopback_users: &[String],
) -> Result<Caller, Response> {
    let Some((name, password)) = req.authorization.as_deref().and_then(parse_basic) else {
        return Err(unauthenticated());
    };
    let Some(user) = meta
        .users
        .get(&name)
        .filter(|u| u.password_matches(&password))
    else {
        // RabbitMQ spells this one error `not_authorized` (its other 401s `not_authorised`).
        return Err(Response::error(401, "not_authorized", "Login failed")
            .with_header("www-authenticate", format!("Basic realm=\"{REALM}\"")));
    };
    if !req.peer_loopback && loopback_users.contains(&name) {
        return Err(Response::not_authorised(
            "User can only log in via localhost",
        ));
    }
    let tags = Tags::of(user);
    if !tags.management {
        return Err(Response::not_authorised("Not management user"));
    }
    Ok(Caller {
        user: user.clone(),
        tags,
    })
}

fn parse_basic(header: &str) -> Option<(String, String)> {
    let (scheme, rest) = header.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

/// Whose queue counts a GET shows, so the driver fetches those of other nodes' queues
/// first ([`Context::remote_counts`]), and only those.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CountsScope {
    /// Every vhost's queues (the queue listing, the overview, the vhost listing).
    All,
    /// One vhost's queues (its queue listing, its vhost page).
    Vhost(String),
    /// One queue (its page): vhost, name.
    Queue(String, String),
}

/// The queue counts a GET of `path` shows, if any.
pub fn counts_scope(path: &str) -> Option<CountsScope> {
    let rest = path.trim_end_matches('/').strip_prefix("/api/")?;
    let segments: Vec<String> = rest.split('/').map(decode).collect();
    match segments.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["queues"] | ["overview"] | ["vhosts"] => Some(CountsScope::All),
        ["queues", vhost] | ["vhosts", vhost] => Some(CountsScope::Vhost(vhost.to_string())),
        ["queues", vhost, name] => Some(CountsScope::Queue(vhost.to_string(), name.to_string())),
        _ => None,
    }
}

/// Percent-decodes one path segment or query value.
pub fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// Answers `req` up to the metadata change it makes, if any.
pub fn plan(ctx: &Context<'_>, req: &Request) -> Handled {
    // Outside /api/ only the console's files exist (served before this): a mistyped page
    // is 404, not a 401 that would make a browser prompt for a password.
    let Some(rest) = req.path.strip_prefix("/api/") else {
        return Handled::Reply(Response::not_found());
    };
    let meta = ctx.broker.snapshot();
    let caller = match authenticate(&meta, req, ctx.loopback_users) {
        Ok(c) => c,
        Err(r) => return Handled::Reply(r),
    };
    let segments: Vec<String> = rest.trim_end_matches('/').split('/').map(decode).collect();
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    if req.method != Method::Get {
        return resources::route(ctx, &meta, &caller, req, &segments);
    }
    let listing = match query::ListQuery::parse(req) {
        Ok(q) => q,
        Err(r) => return Handled::Reply(r),
    };
    match resources::route(ctx, &meta, &caller, req, &segments) {
        Handled::Reply(Response {
            status: 200,
            body: Some(body),
            raw: None,
            headers,
        }) if !listing.is_plain() => Handled::Reply(match listing.apply(body) {
            Ok(body) => Response {
                status: 200,
                body: Some(body),
                raw: None,
                headers,
            },
            Err(r) => r,
        }),
        other => other,
    }
}

/// Answers `req` on a single node: changes are applied to the broker at once (tests).
pub fn handle(ctx: &Context<'_>, req: &Request, now: Instant) -> Response {
    match plan(ctx, req) {
        Handled::Reply(r) => r,
        Handled::Commit { commands, ok } => {
            for c in &Command::batched(commands) {
                if let Err(e) = ctx.broker.apply(c, now) {
                    return Response::bad_request(e.to_string());
                }
            }
            ok
        }
        Handled::CloseConnection {
            node: None,
            id,
            reason,
        } => close_connection(ctx.broker, id, &reason),
        Handled::CloseConnection { node: Some(_), .. } => Response::error(
            501,
            "not_implemented",
            "another node's connection is closed through the relay (the HTTP driver)",
        ),
        Handled::Direct(d) => Response::error(
            501,
            "not_implemented",
            format!("{:?} needs an AMQP channel (the HTTP driver)", d.op),
        ),
    }
}

/// Carries out [`Handled::CloseConnection`].
pub fn close_connection(broker: &Broker, id: u64, reason: &str) -> Response {
    if broker.sessions().close(id, reason) {
        Response::empty(204)
    } else {
        Response::not_found()
    }
}

/// The user and password of a request's basic auth.
pub fn credentials(req: &Request) -> Option<(String, String)> {
    req.authorization.as_deref().and_then(parse_basic)
}

#[cfg(test)]
mod tests;

//! `GET /api/definitions` and `POST /api/definitions`: RabbitMQ's definitions JSON (users
//! with `password_hash`, vhosts, permissions, policies, and the durable queues, exchanges
//! and bindings), exported from the metadata and imported as metadata commands.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::resources::stored_hash;
use super::{convert, Handled, Request, Response};
use crate::admin::{self, json as admin_json, NodeInfo, Request as AdminRequest};
use crate::broker::Broker;
use crate::meta::definitions::Definitions;
use crate::meta::policy::ApplyTo;
use crate::meta::state::{Binding, Destination, ExchangeDef, ExchangeKind, QueueDef, User};
use crate::meta::{Command, MetaState};

/// The RabbitMQ version whose format this is.
pub const RABBIT_VERSION: &str = "3.10.8";

pub(super) fn table_json(t: &amq_protocol::types::FieldTable) -> Value {
    serde_json::from_str(&admin::format_table(t)).unwrap_or(json!({}))
}

fn apply_to_name(a: ApplyTo) -> &'static str {
    match a {
        ApplyTo::Queues => "queues",
        ApplyTo::Exchanges => "exchanges",
        ApplyTo::All => "all",
    }
}

/// The export.
pub fn export(meta: &MetaState) -> Value {
    let d = Definitions::from_state(meta);
    let users: Vec<Value> = meta
        .users
        .values()
        .map(|u| {
            let (hash, algorithm) = u.password_hash();
            json!({"name": u.name, "password_hash": hash,
                       "hashing_algorithm": algorithm.name(),
                       "tags": u.tags, "limits": {}})
        })
        .collect();
    let vhosts: Vec<Value> = meta
        .vhosts
        .keys()
        .map(|n| json!({"name": n, "limits": [], "metadata": {"description": "", "tags": []}}))
        .collect();
    let permissions: Vec<Value> = meta
        .permissions
        .values()
        .map(|p| {
            json!({"user": p.user, "vhost": p.vhost, "configure": p.configure,
                   "write": p.write, "read": p.read})
        })
        .collect();
    let policies: Vec<Value> = d
        .policies
        .iter()
        .filter(|(_, operator)| !operator)
        .map(|(p, _)| {
            let definition: Value =
                serde_json::from_str(&admin_json::write_definition(&p.definition))
                    .unwrap_or(json!({}));
            json!({"vhost": p.vhost, "name": p.name, "pattern": p.pattern,
                   "apply-to": apply_to_name(p.apply_to), "definition": definition,
                   "priority": p.priority})
        })
        .collect();
    let queues: Vec<Value> = d
        .queues
        .iter()
        .map(|q| {
            json!({"name": q.name, "vhost": q.vhost, "durable": q.durable,
                   "auto_delete": q.auto_delete, "arguments": table_json(&q.arguments)})
        })
        .collect();
    let exchanges: Vec<Value> = d
        .exchanges
        .iter()
        .map(|x| {
            json!({"name": x.name, "vhost": x.vhost, "type": x.kind.name(),
                   "durable": x.durable, "auto_delete": x.auto_delete,
                   "internal": x.internal, "arguments": table_json(&x.arguments)})
        })
        .collect();
    let bindings: Vec<Value> = d
        .bindings
        .iter()
        .map(|b| {
            json!({"source": b.source, "vhost": b.vhost,
                   "destination": b.destination.name(),
                   "destination_type": b.destination.kind(),
                   "routing_key": b.routing_key, "arguments": table_json(&b.arguments)})
        })
        .collect();
    json!({
        "rabbit_version": RABBIT_VERSION,
        "rabbitmq_version": RABBIT_VERSION,
        "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "users": users,
        "vhosts": vhosts,
        "permissions": permissions,
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [],
        "policies": policies,
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    })
}

/// The parts of a definitions file Warren imports; other members are ignored.
#[derive(Deserialize, Default)]
#[serde(default)]
struct File {
    users: Vec<Map<String, Value>>,
    vhosts: Vec<NameOnly>,
    permissions: Vec<PermissionDef>,
    policies: Vec<PolicyDef>,
    queues: Vec<Map<String, Value>>,
    exchanges: Vec<Map<String, Value>>,
    bindings: Vec<Map<String, Value>>,
}

#[derive(Deserialize)]
struct NameOnly {
    name: String,
}

#[derive(Deserialize)]
struct PermissionDef {
    user: String,
    vhost: String,
    configure: String,
    write: String,
    read: String,
}

#[derive(Deserialize)]
struct PolicyDef {
    vhost: String,
    name: String,
    pattern: String,
    #[serde(rename = "apply-to", default = "all")]
    apply_to: String,
    definition: Value,
    #[serde(default)]
    priority: i64,
}

fn all() -> String {
    "all".into()
}

fn text(o: &Map<String, Value>, key: &str) -> Result<String, String> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(format!("`{key}` must be a string")),
    }
}

fn flag(o: &Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("`{key}` must be a boolean")),
    }
}

fn user(o: &Map<String, Value>, salt: [u8; 4]) -> Result<User, String> {
    let name = text(o, "name")?;
    let password = match (o.get("password"), o.get("password_hash")) {
        (Some(Value::String(p)), _) => User::hash_password(p, salt),
        (_, Some(Value::String(h))) if h.is_empty() => User::no_password(),
        (_, Some(Value::String(h))) => stored_hash(o, h).map_err(|r| r.body_text())?,
        _ => return Err(format!("user `{name}` needs password or password_hash")),
    };
    let tags = match o.get("tags") {
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(String::from)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    };
    Ok(User {
        name,
        password,
        tags,
    })
}

fn exchange(o: &Map<String, Value>) -> Result<ExchangeDef, String> {
    let kind = text(o, "type")?;
    Ok(ExchangeDef {
        vhost: text(o, "vhost")?,
        name: text(o, "name")?,
        kind: ExchangeKind::parse(&kind).ok_or(format!("unknown exchange type `{kind}`"))?,
        durable: flag(o, "durable", true)?,
        auto_delete: flag(o, "auto_delete", false)?,
        internal: flag(o, "internal", false)?,
        arguments: convert::arguments(o)?,
    })
}

fn queue(o: &Map<String, Value>) -> Result<QueueDef, String> {
    Ok(QueueDef {
        vhost: text(o, "vhost")?,
        name: text(o, "name")?,
        durable: flag(o, "durable", true)?,
        exclusive_owner: None,
        auto_delete: flag(o, "auto_delete", false)?,
        arguments: convert::arguments(o)?,
        home: 0,
    })
}

fn binding(o: &Map<String, Value>) -> Result<Binding, String> {
    let destination = text(o, "destination")?;
    Ok(Binding {
        vhost: text(o, "vhost")?,
        source: text(o, "source")?,
        destination: match text(o, "destination_type")?.as_str() {
            "queue" => Destination::Queue(destination),
            "exchange" => Destination::Exchange(destination),
            other => return Err(format!("unknown destination_type `{other}`")),
        },
        routing_key: text(o, "routing_key").unwrap_or_default(),
        arguments: convert::arguments(o)?,
    })
}

/// Plans an import: every definition checked first, then the commands in dependency order
/// (vhosts, users, permissions, policies, exchanges, queues, bindings). A definition that
/// already exists and is equivalent is applied again harmlessly (declarations are
/// idempotent), as in RabbitMQ.
pub fn import(ctx: &super::Context<'_>, req: &Request) -> Handled {
    match plan_json(ctx.broker, ctx.node, &req.body) {
        Ok(commands) => Handled::Commit {
            commands,
            ok: Response::empty(204),
        },
        Err(e) => Handled::Reply(Response::bad_request(e)),
    }
}

/// Plans the import of a definitions file's text (the API's `POST /api/definitions`,
/// `warrenctl import_definitions`, `[definitions] load_file`).
pub fn plan_json(broker: &Broker, node: &NodeInfo, json: &[u8]) -> Result<Vec<Command>, String> {
    let file: File =
        serde_json::from_slice(json).map_err(|e| format!("invalid definitions: {e}"))?;
    plan_import(&(broker, node), &file)
}

fn via_admin(ctx: &(&Broker, &NodeInfo), request: &AdminRequest) -> Result<Command, String> {
    match admin::plan(ctx.0, ctx.1, request) {
        admin::Handled::Commit { command, .. } => Ok(command),
        admin::Handled::Reply(r) => Err(r.message),
    }
}

fn plan_import(ctx: &(&Broker, &NodeInfo), f: &File) -> Result<Vec<Command>, String> {
    let mut c = Vec::new();
    for v in &f.vhosts {
        c.push(Command::AddVhost {
            name: v.name.clone(),
        });
    }
    for u in &f.users {
        c.push(Command::PutUser(user(u, ctx.0.new_salt())?));
    }
    for p in &f.permissions {
        c.push(via_admin(
            ctx,
            &AdminRequest::SetPermissions {
                vhost: p.vhost.clone(),
                user: p.user.clone(),
                configure: p.configure.clone(),
                write: p.write.clone(),
                read: p.read.clone(),
            },
        )?);
    }
    for p in &f.policies {
        c.push(via_admin(
            ctx,
            &AdminRequest::SetPolicy {
                vhost: p.vhost.clone(),
                name: p.name.clone(),
                pattern: p.pattern.clone(),
                definition: p.definition.to_string(),
                priority: p.priority,
                apply_to: p.apply_to.clone(),
                operator: false,
            },
        )?);
    }
    for x in &f.exchanges {
        c.push(Command::DeclareExchange(exchange(x)?));
    }
    for q in &f.queues {
        c.push(Command::DeclareQueue(queue(q)?));
    }
    for b in &f.bindings {
        c.push(Command::Bind(binding(b)?));
    }
    Ok(c)
}

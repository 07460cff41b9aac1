//! RabbitMQ's definitions JSON: `GET` and `POST /api/definitions` (the whole broker: users
//! with `password_hash`, vhosts, permissions, policies, operator policies as `parameters` of
//! component `operator_policy`, queues, exchanges and bindings), and `GET` and `POST
//! /api/definitions/{vhost}` (one vhost's policies, operator policies, queues, exchanges and
//! bindings, without `vhost` fields on the last three), exported from the metadata and
//! imported as metadata commands, as RabbitMQ 3.10 does them. Vhost limits travel as
//! `parameters` of component `vhost-limits` (name `limits`), user limits as each user's
//! `limits` object, as in RabbitMQ 3.10.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::convert::{self, definition_json, table_json};
use super::resources::stored_hash;
use super::{Handled, Request, Response};
use crate::admin::{self, NodeInfo, Request as AdminRequest};
use crate::broker::Broker;
use crate::meta::limits::{self, LimitScope};
use crate::meta::policy::{ApplyTo, Policy};
use crate::meta::state::{
    Binding, Destination, ExchangeDef, ExchangeKind, QueueDef, User, Vhost, VhostMetadata,
};
use crate::meta::{Command, MetaState};

/// RabbitMQ's runtime-parameter component holding a vhost's limits.
const VHOST_LIMITS: &str = "vhost-limits";

/// The RabbitMQ version whose format this is.
pub const RABBIT_VERSION: &str = "3.10.8";

fn apply_to_name(a: ApplyTo) -> &'static str {
    match a {
        ApplyTo::Queues => "queues",
        ApplyTo::Exchanges => "exchanges",
        ApplyTo::All => "all",
    }
}

/// A policy as the policy endpoints and the definitions show it.
pub fn policy_json(p: &Policy) -> Value {
    let definition = definition_json(&p.definition);
    json!({"vhost": p.vhost, "name": p.name, "pattern": p.pattern,
           "apply-to": apply_to_name(p.apply_to), "definition": definition,
           "priority": p.priority})
}

/// An operator policy as RabbitMQ keeps it: a runtime parameter of component
/// `operator_policy` (`/api/parameters`, the definitions' `parameters`).
pub fn operator_policy_parameter(p: &Policy) -> Value {
    let mut value = policy_json(p);
    if let Some(o) = value.as_object_mut() {
        o.remove("vhost");
        o.remove("name");
    }
    json!({"vhost": p.vhost, "component": "operator_policy", "name": p.name, "value": value})
}

fn builtin_exchange(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

/// One vhost's exported objects. As RabbitMQ 3.10 exports them: every queue but exclusive
/// ones (durable or not), every exchange but the built-in ones, and the bindings between
/// exported objects (and from built-in exchanges); `vhost` fields only when `with_vhost`.
struct VhostObjects {
    policies: Vec<Value>,
    parameters: Vec<Value>,
    queues: Vec<Value>,
    exchanges: Vec<Value>,
    bindings: Vec<Value>,
}

impl VhostObjects {
    fn of(meta: &MetaState, v: &Vhost, with_vhost: bool) -> VhostObjects {
        let tag = |mut o: Value| {
            if with_vhost {
                o["vhost"] = json!(v.name);
            }
            o
        };
        let exported_queue = |name: &str| {
            v.queues
                .get(name)
                .is_some_and(|q| q.exclusive_owner.is_none())
        };
        VhostObjects {
            policies: v.policies.values().map(policy_json).collect(),
            parameters: v
                .operator_policies
                .values()
                .map(operator_policy_parameter)
                .chain(meta.vhost_limits.get(&v.name).map(|l| {
                    // RabbitMQ keeps a vhost's limits as its parameter `limits` of
                    // component `vhost-limits`.
                    tag(json!({"component": VHOST_LIMITS, "name": "limits",
                               "value": limits::to_json(l)}))
                }))
                .collect(),
            queues: v
                .queues
                .values()
                .filter(|q| q.exclusive_owner.is_none())
                .map(|q| {
                    tag(json!({"name": q.name, "durable": q.durable,
                               "auto_delete": q.auto_delete,
                               "arguments": table_json(&q.arguments)}))
                })
                .collect(),
            exchanges: v
                .exchanges
                .values()
                .filter(|x| !builtin_exchange(&x.name))
                .map(|x| {
                    tag(
                        json!({"name": x.name, "type": x.kind.name(), "durable": x.durable,
                               "auto_delete": x.auto_delete, "internal": x.internal,
                               "arguments": table_json(&x.arguments)}),
                    )
                })
                .collect(),
            bindings: v
                .bindings
                .values()
                .flatten()
                .filter(|b| !b.source.is_empty())
                .filter(|b| match &b.destination {
                    Destination::Queue(q) => exported_queue(q),
                    Destination::Exchange(_) => true,
                })
                .map(|b| {
                    tag(
                        json!({"source": b.source, "destination": b.destination.name(),
                               "destination_type": b.destination.kind(),
                               "routing_key": b.routing_key,
                               "arguments": table_json(&b.arguments)}),
                    )
                })
                .collect(),
        }
    }
}

/// The whole broker's export (`GET /api/definitions`, `warrenctl export_definitions`).
pub fn export(meta: &MetaState) -> Value {
    let users: Vec<Value> = meta
        .users
        .values()
        .map(|u| {
            let (hash, algorithm) = u.password_hash();
            json!({"name": u.name, "password_hash": hash,
                       "hashing_algorithm": algorithm.name(),
                       "tags": u.tags,
                       "limits": super::resources::user_limits_json(meta, &u.name)})
        })
        .collect();
    // RabbitMQ 3.10 exports a vhost's name only.
    let vhosts: Vec<Value> = meta.vhosts.keys().map(|n| json!({"name": n})).collect();
    let permissions: Vec<Value> = meta
        .permissions
        .values()
        .map(|p| {
            json!({"user": p.user, "vhost": p.vhost, "configure": p.configure,
                   "write": p.write, "read": p.read})
        })
        .collect();
    let (mut parameters, mut policies, mut queues, mut exchanges, mut bindings) =
        (vec![], vec![], vec![], vec![], vec![]);
    for v in meta.vhosts.values() {
        let o = VhostObjects::of(meta, v, true);
        parameters.extend(o.parameters);
        policies.extend(o.policies);
        queues.extend(o.queues);
        exchanges.extend(o.exchanges);
        bindings.extend(o.bindings);
    }
    json!({
        "rabbit_version": RABBIT_VERSION,
        "rabbitmq_version": RABBIT_VERSION,
        "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "users": users,
        "vhosts": vhosts,
        "permissions": permissions,
        "topic_permissions": [],
        "parameters": parameters,
        "global_parameters": [],
        "policies": policies,
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    })
}

/// One vhost's export (`GET /api/definitions/{vhost}`); `None` when it does not exist.
pub fn export_vhost(meta: &MetaState, vhost: &str) -> Option<Value> {
    let o = VhostObjects::of(meta, meta.vhost(vhost)?, false);
    Some(json!({
        "rabbit_version": RABBIT_VERSION,
        "parameters": o.parameters,
        "policies": o.policies,
        "queues": o.queues,
        "exchanges": o.exchanges,
        "bindings": o.bindings,
    }))
}

/// The parts of a definitions file Warren imports; other members (`topic_permissions`,
/// `global_parameters`, parameters of components other than `operator_policy` and
/// `vhost-limits`) are ignored.
#[derive(Deserialize, Default)]
#[serde(default)]
struct File {
    users: Vec<Map<String, Value>>,
    vhosts: Vec<VhostDef>,
    permissions: Vec<PermissionDef>,
    parameters: Vec<ParameterDef>,
    policies: Vec<PolicyDef>,
    queues: Vec<Map<String, Value>>,
    exchanges: Vec<Map<String, Value>>,
    bindings: Vec<Map<String, Value>>,
}

/// A vhost: its name, and from files of RabbitMQ 3.11 on its description and tags (at the
/// top and in `metadata`; 3.10 exports the name alone).
#[derive(Deserialize)]
struct VhostDef {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    metadata: Option<VhostMetadataDef>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct VhostMetadataDef {
    description: Option<String>,
    tags: Option<Vec<String>>,
}

impl VhostDef {
    /// Its description and tags, when the file gives either.
    fn metadata(&self) -> Option<VhostMetadata> {
        let m = self.metadata.as_ref();
        let description = self
            .description
            .clone()
            .or_else(|| m.and_then(|m| m.description.clone()));
        let tags = self.tags.clone().or_else(|| m.and_then(|m| m.tags.clone()));
        (description.is_some() || tags.is_some()).then(|| VhostMetadata {
            description: description.unwrap_or_default(),
            tags: tags.unwrap_or_default(),
        })
    }
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
    /// Absent from a vhost's definitions (the vhost is the path's).
    #[serde(default)]
    vhost: String,
    #[serde(default)]
    name: String,
    pattern: String,
    #[serde(rename = "apply-to", default = "all")]
    apply_to: String,
    definition: Value,
    #[serde(default)]
    priority: i64,
}

/// A runtime parameter; Warren knows one component, `operator_policy`.
#[derive(Deserialize)]
struct ParameterDef {
    component: String,
    name: String,
    #[serde(default)]
    vhost: String,
    value: Value,
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

/// `POST /api/definitions`: plans the import of a whole broker's definitions.
pub fn import(ctx: &super::Context<'_>, req: &Request) -> Handled {
    answer(plan_json(ctx.broker, ctx.node, &req.body))
}

/// `POST /api/definitions/{vhost}`: imports a vhost's definitions (its policies, operator
/// policies, queues, exchanges and bindings) into `vhost`, whatever vhost the file names;
/// users, vhosts and permissions in the file are ignored, as in RabbitMQ. A missing vhost is
/// RabbitMQ's 404 `vhost_not_found`.
pub fn import_vhost(ctx: &super::Context<'_>, req: &Request, vhost: &str) -> Handled {
    if ctx.broker.snapshot().vhost(vhost).is_none() {
        return Handled::Reply(Response::error(404, "not_found", "vhost_not_found"));
    }
    let file = match parse(&req.body) {
        Ok(f) => f,
        Err(e) => return Handled::Reply(Response::bad_request(e)),
    };
    answer(plan_import(
        &(ctx.broker, ctx.node),
        &into_vhost(file, vhost),
    ))
}

/// `GET /api/definitions/{vhost}`: RabbitMQ answers 400 `vhost_not_found` for a missing
/// vhost (and 404 to a POST).
pub fn get_vhost(meta: &MetaState, vhost: &str) -> Response {
    match export_vhost(meta, vhost) {
        Some(d) => Response::ok(d),
        None => Response::bad_request("vhost_not_found"),
    }
}

fn answer(planned: Result<Vec<Command>, String>) -> Handled {
    match planned {
        Ok(commands) => Handled::Commit {
            commands,
            ok: Response::empty(204),
        },
        Err(e) => Handled::Reply(Response::bad_request(e)),
    }
}

fn parse(json: &[u8]) -> Result<File, String> {
    serde_json::from_slice(json).map_err(|e| format!("invalid definitions: {e}"))
}

/// A file's vhost objects moved into `vhost`; its users, vhosts and permissions dropped.
fn into_vhost(mut f: File, vhost: &str) -> File {
    let here = json!(vhost);
    for o in f
        .queues
        .iter_mut()
        .chain(&mut f.exchanges)
        .chain(&mut f.bindings)
    {
        o.insert("vhost".into(), here.clone());
    }
    for p in &mut f.policies {
        p.vhost = vhost.to_string();
    }
    for p in &mut f.parameters {
        p.vhost = vhost.to_string();
    }
    File {
        users: Vec::new(),
        vhosts: Vec::new(),
        permissions: Vec::new(),
        ..f
    }
}

/// Plans the import of a definitions file's text (the API's `POST /api/definitions`,
/// `warrenctl import_definitions`, `[definitions] load_file`).
pub fn plan_json(broker: &Broker, node: &NodeInfo, json: &[u8]) -> Result<Vec<Command>, String> {
    plan_import(&(broker, node), &parse(json)?)
}

fn via_admin(ctx: &(&Broker, &NodeInfo), request: &AdminRequest) -> Result<Command, String> {
    match admin::plan(ctx.0, ctx.1, request) {
        admin::Handled::Commit { command, .. } => Ok(command),
        admin::Handled::Reply(r) => Err(r.message),
    }
}

/// Every definition checked first, then the commands in dependency order (vhosts, users,
/// permissions, policies and operator policies, exchanges, queues, bindings). As in
/// RabbitMQ, a queue or exchange that already exists is kept as it is, even when the file
/// declares it differently; other definitions are applied again harmlessly (bindings are
/// idempotent) or replace what exists (users, permissions, policies).
fn plan_import(ctx: &(&Broker, &NodeInfo), f: &File) -> Result<Vec<Command>, String> {
    let meta = ctx.0.snapshot();
    let mut c = Vec::new();
    for v in &f.vhosts {
        c.push(Command::AddVhost {
            name: v.name.clone(),
        });
        if let Some(metadata) = v.metadata() {
            c.push(Command::SetVhostMetadata {
                name: v.name.clone(),
                metadata,
            });
        }
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
    let operator_policies = f
        .parameters
        .iter()
        .filter(|p| p.component == "operator_policy")
        .map(|p| {
            let mut def: PolicyDef = serde_json::from_value(p.value.clone())
                .map_err(|e| format!("operator policy `{}`: {e}", p.name))?;
            def.vhost.clone_from(&p.vhost);
            def.name.clone_from(&p.name);
            Ok((def, true))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let policies = f.policies.iter().map(|p| (p, false));
    for (p, operator) in policies.chain(operator_policies.iter().map(|(p, o)| (p, *o))) {
        c.push(via_admin(
            ctx,
            &AdminRequest::SetPolicy {
                vhost: p.vhost.clone(),
                name: p.name.clone(),
                pattern: p.pattern.clone(),
                definition: p.definition.to_string(),
                priority: p.priority,
                apply_to: p.apply_to.clone(),
                operator,
            },
        )?);
    }
    let exists = |vhost: &str, f: &dyn Fn(&Vhost) -> bool| meta.vhost(vhost).is_some_and(|v| f(v));
    for x in &f.exchanges {
        let x = exchange(x)?;
        if !exists(&x.vhost, &|v| v.exchanges.contains_key(&x.name)) {
            c.push(Command::DeclareExchange(x));
        }
    }
    for q in &f.queues {
        let q = queue(q)?;
        if !exists(&q.vhost, &|v| v.queues.contains_key(&q.name)) {
            c.push(Command::DeclareQueue(q));
        }
    }
    for b in &f.bindings {
        c.push(Command::Bind(binding(b)?));
    }
    // Limits after the queues (RabbitMQ imports parameters first, but does not hold an
    // import's queues to max-queues; Warren checks every new queue, so the order keeps
    // an import that fits in RabbitMQ from failing here).
    for p in f.parameters.iter().filter(|p| p.component == VHOST_LIMITS) {
        let given = limits::parse_json(&p.value).map_err(|e| format!("vhost-limits: {e}"))?;
        let scope = LimitScope::Vhost(p.vhost.clone());
        scope.validate(&given).map_err(|e| e.to_string())?;
        c.push(Command::SetLimits {
            scope,
            limits: given,
            replace: true,
        });
    }
    for u in &f.users {
        let Some(value) = u.get("limits") else {
            continue;
        };
        let given = limits::parse_json(value).map_err(|e| format!("user limits: {e}"))?;
        if given.is_empty() {
            continue;
        }
        let scope = LimitScope::User(text(u, "name")?);
        scope.validate(&given).map_err(|e| e.to_string())?;
        // As RabbitMQ's put_user: the file's limits update the user's.
        c.push(Command::SetLimits {
            scope,
            limits: given,
            replace: false,
        });
    }
    Ok(c)
}

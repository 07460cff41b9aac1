//! Bindings: the listings (`/api/bindings[/{vhost}]`), the bindings between two objects
//! (`/api/bindings/{vhost}/e/{source}/q/{queue}` and `.../e/{source}/e/{exchange}`, GET and
//! POST), one binding (`.../{props}`, GET and DELETE), and the bindings of one exchange or
//! queue (`/api/exchanges/{vhost}/{name}/bindings/source` and `/destination`,
//! `/api/queues/{vhost}/{name}/bindings`), with RabbitMQ 3.10's fields and codes.

use serde_json::{json, Map, Value};

use super::convert::{self, table_json, Kind};
use super::resources::{
    admin_table, body_object, check_permission, commit, listed_vhosts, reply, str_field,
    writable_vhost,
};
use super::{Caller, Context, Handled, Method, Request, Response};
use crate::admin::Request as AdminRequest;
use crate::meta::state::{Binding, Destination};
use crate::meta::{Command, MetaState};
use crate::session::permissions::Access;

const BINDING_FIELDS: &[(&str, &str, Kind)] = &[
    ("source_name", "source", Kind::Str),
    ("destination_name", "destination", Kind::Str),
    ("destination_kind", "destination_type", Kind::Str),
    ("routing_key", "routing_key", Kind::Str),
    ("arguments", "arguments", Kind::Json),
];

/// Characters a `properties_key` keeps as they are (RabbitMQ quotes the routing key like
/// `quote_plus`: letters, digits and `-_.~`).
const PROPERTIES_KEY_SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// RabbitMQ's `properties_key`: `~` for an empty key without arguments, the quoted key
/// otherwise (bindings with arguments add `~` and a hash in RabbitMQ; Warren adds `~` and
/// the arguments' JSON length, enough to tell them apart in a listing).
fn properties_key(routing_key: &str, arguments: &Value) -> String {
    let empty_args = arguments.as_object().is_none_or(Map::is_empty);
    let key = percent_encoding::utf8_percent_encode(routing_key, PROPERTIES_KEY_SET).to_string();
    match (routing_key.is_empty(), empty_args) {
        (true, true) => "~".into(),
        (false, true) => key,
        (_, false) => format!("{key}~{}", arguments.to_string().len()),
    }
}

/// Which of a vhost's bindings a listing shows.
#[derive(Clone, Copy, Debug)]
pub enum Filter<'a> {
    /// Every binding.
    All,
    /// From exchange `source` to `destination`.
    Between(&'a str, &'a Destination),
    /// From this exchange (`/api/exchanges/{vhost}/{name}/bindings/source`).
    Source(&'a str),
    /// To this exchange (`.../bindings/destination`).
    ToExchange(&'a str),
    /// To this queue, the default exchange's implicit binding first
    /// (`/api/queues/{vhost}/{name}/bindings`).
    ToQueue(&'a str),
}

impl Filter<'_> {
    fn keeps(&self, b: &Value) -> bool {
        let (src, dst, kind) = (&b["source"], &b["destination"], &b["destination_type"]);
        match *self {
            Filter::All => true,
            Filter::Between(s, d) => src == s && dst == d.name() && kind == d.kind(),
            Filter::Source(s) => src == s,
            Filter::ToExchange(d) => dst == d && kind == "exchange",
            Filter::ToQueue(d) => dst == d && kind == "queue",
        }
    }
}

/// A destination named in a path: `q` for a queue, `e` for an exchange.
pub fn destination(kind: &str, name: &str) -> Destination {
    if kind == "e" {
        Destination::Exchange(name.to_string())
    } else {
        Destination::Queue(name.to_string())
    }
}

/// Whether `vhost` (which exists) has the exchange or queue `d`.
fn exists(meta: &MetaState, vhost: &str, d: &Destination) -> bool {
    meta.vhost(vhost).is_some_and(|v| match d {
        Destination::Queue(q) => v.queues.contains_key(q),
        Destination::Exchange(x) => v.exchanges.contains_key(x),
    })
}

/// RabbitMQ's 404 for a binding's missing end: `no exchange 'x' in vhost 'v'`.
fn missing(kind: &str, name: &str, vhost: &str) -> Response {
    Response::error(
        404,
        "not_found",
        format!("no {kind} '{name}' in vhost '{vhost}'"),
    )
}

/// The bindings of `vhost` (or of every vhost the caller sees) that `filter` keeps; 404 when
/// an object the filter names does not exist.
pub fn list(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    vhost: Option<&str>,
    filter: Filter<'_>,
) -> Response {
    let vhosts = match listed_vhosts(meta, caller, vhost) {
        Ok(v) => v,
        Err(r) => return r,
    };
    if let Some(v) = vhost {
        let named: Vec<Destination> = match filter {
            Filter::All => vec![],
            Filter::Between(s, d) => vec![Destination::Exchange(s.into()), d.clone()],
            Filter::Source(x) | Filter::ToExchange(x) => vec![Destination::Exchange(x.into())],
            Filter::ToQueue(q) => vec![Destination::Queue(q.into())],
        };
        if !named.iter().all(|d| exists(meta, v, d)) {
            return Response::not_found();
        }
    }
    let mut list = Vec::new();
    for v in vhosts {
        let request = AdminRequest::ListBindings {
            vhost: v.clone(),
            columns: convert::columns(BINDING_FIELDS),
        };
        // RabbitMQ lists every queue's implicit binding to the default exchange first.
        let implicit = meta
            .vhost(&v)
            .into_iter()
            .flat_map(|x| x.queues.keys())
            .map(|q| {
                json!({"source": "", "destination": q, "destination_type": "queue",
                   "routing_key": q, "arguments": {}, "vhost": v})
            });
        if let Ok(t) = admin_table(ctx, &request) {
            let rows = convert::objects(&t, BINDING_FIELDS, &[("vhost", json!(v))]);
            for mut b in implicit.chain(rows).filter(|b| filter.keeps(b)) {
                let pk = properties_key(b["routing_key"].as_str().unwrap_or(""), &b["arguments"]);
                b["properties_key"] = json!(pk);
                list.push(b);
            }
        }
    }
    Response::ok(Value::Array(list))
}

/// `POST /api/bindings/{vhost}/e/{source}/q|e/{destination}`: binds, answering 201 with the
/// new binding's `Location`. A missing end is RabbitMQ's 404 `not_found` naming it.
pub fn add(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    src: &str,
    dst: &Destination,
) -> Handled {
    if let Err(r) = writable_vhost(meta, caller, vhost) {
        return reply(r);
    }
    let source = Destination::Exchange(src.to_string());
    for end in [&source, dst] {
        if !exists(meta, vhost, end) {
            return reply(missing(end.kind(), end.name(), vhost));
        }
    }
    if let Err(r) = may_bind(meta, caller, vhost, src, dst) {
        return reply(r);
    }
    let body = match body_object(req) {
        Ok(b) => b,
        Err(r) => return reply(r),
    };
    let routing_key = match str_field(&body, "routing_key") {
        Ok(k) => k.unwrap_or_default(),
        Err(r) => return reply(r),
    };
    let arguments = match convert::arguments(&body) {
        Ok(a) => a,
        Err(e) => return reply(Response::bad_request(e)),
    };
    let args_json = body.get("arguments").cloned().unwrap_or(json!({}));
    let location = format!(
        "/api/bindings/{}/e/{}/{}/{}/{}",
        encode(vhost),
        encode(src),
        if matches!(dst, Destination::Exchange(_)) {
            "e"
        } else {
            "q"
        },
        encode(dst.name()),
        encode(&properties_key(&routing_key, &args_json))
    );
    let mut ok = Response::empty(201);
    ok.headers.push(("location", location));
    commit(
        vec![Command::Bind(Binding {
            vhost: vhost.to_string(),
            source: src.to_string(),
            destination: dst.clone(),
            routing_key,
            arguments,
        })],
        ok,
    )
}

/// Binding and unbinding need write access to the destination and read access to the
/// source, as `queue.bind` and `exchange.bind` do.
fn may_bind(
    meta: &MetaState,
    caller: &Caller,
    vhost: &str,
    src: &str,
    dst: &Destination,
) -> Result<(), Response> {
    check_permission(meta, caller, vhost, Access::Write, dst.kind(), dst.name())
        .and_then(|()| check_permission(meta, caller, vhost, Access::Read, "exchange", src))
}

fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// `GET` and `DELETE /api/bindings/{vhost}/e/{source}/q|e/{destination}/{props}`.
pub fn one(
    meta: &MetaState,
    caller: &Caller,
    m: Method,
    vhost: &str,
    src: &str,
    dst: &Destination,
    props: &str,
) -> Handled {
    if let Err(r) = writable_vhost(meta, caller, vhost) {
        return reply(r);
    }
    let v = meta.vhost(vhost).expect("checked");
    let found = v.bindings.values().flatten().find(|b| {
        b.source == src
            && b.destination == *dst
            && (properties_key(&b.routing_key, &table_json(&b.arguments)) == props
                // The key decoded once more (a client that encoded it only once).
                || (b.arguments.inner().is_empty() && b.routing_key == props))
    });
    let Some(b) = found else {
        return reply(Response::not_found());
    };
    match m {
        Method::Get => {
            let arguments = table_json(&b.arguments);
            reply(Response::ok(json!({
                "source": b.source, "vhost": vhost, "destination": dst.name(),
                "destination_type": dst.kind(), "routing_key": b.routing_key,
                "properties_key": properties_key(&b.routing_key, &arguments),
                "arguments": arguments,
            })))
        }
        Method::Delete => {
            if let Err(r) = may_bind(meta, caller, vhost, src, dst) {
                return reply(r);
            }
            commit(vec![Command::Unbind(b.clone())], Response::empty(204))
        }
        _ => reply(Response::empty(405)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_key_quotes_the_routing_key_and_marks_arguments() {
        assert_eq!(properties_key("", &json!({})), "~");
        assert_eq!(properties_key("b.*", &json!({})), "b.%2A");
        assert_eq!(properties_key("a.#", &json!({})), "a.%23");
        // `{"x-match":"all"}` is 17 bytes of JSON.
        assert_eq!(properties_key("", &json!({"x-match": "all"})), "~17");
    }

    #[test]
    fn filters_keep_what_their_path_names() {
        let to_q = json!({"source": "x", "destination": "q", "destination_type": "queue"});
        let to_x = json!({"source": "x", "destination": "y", "destination_type": "exchange"});
        let q = Destination::Queue("q".into());
        let y = Destination::Exchange("y".into());
        assert!(Filter::Between("x", &q).keeps(&to_q));
        assert!(!Filter::Between("x", &q).keeps(&to_x));
        assert!(Filter::Between("x", &y).keeps(&to_x));
        assert!(Filter::Source("x").keeps(&to_q) && Filter::Source("x").keeps(&to_x));
        assert!(Filter::ToExchange("y").keeps(&to_x));
        assert!(!Filter::ToExchange("q").keeps(&to_q));
        assert!(Filter::ToQueue("q").keeps(&to_q));
    }
}

//! The endpoints RabbitMQ's management plugin answers over an AMQP channel of its own
//! (`rabbit_mgmt_util:with_channel`): `POST /api/exchanges/{vhost}/{name}/publish`,
//! `POST /api/queues/{vhost}/{name}/get`, `DELETE /api/queues/{vhost}/{name}/contents` and
//! `GET /api/aliveness-test/{vhost}`.
//!
//! Warren does the same: the core here parses the request into a [`DirectOp`], the driver
//! ([`crate::runtime::direct`]) carries it out over an AMQP connection to its own node as the
//! request's user, and [`reply`] turns what happened ([`DirectOutcome`]) into RabbitMQ's
//! answer. The work therefore takes the path every client's does: permissions, routing to a
//! queue on any node, a mirrored queue's confirm, and the channel errors AMQP gives.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::ShortString;
use base64::Engine;
use serde_json::{json, Map, Value};

use super::convert::field_table;
use super::convert::table_json;
use super::Response;

/// The aliveness test's queue and message, as RabbitMQ 3.10 names them.
pub const ALIVENESS_QUEUE: &str = "aliveness-test";
/// The aliveness test's payload.
pub const ALIVENESS_PAYLOAD: &[u8] = b"test_message";

/// What a `basic.get` through the API does with the messages it took (RabbitMQ's
/// `ackmode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckMode {
    /// `ack_requeue_true`: taken with acks, left unacked until the channel closes (requeued).
    AckRequeueTrue,
    /// `ack_requeue_false`: taken with `no_ack` (removed).
    AckRequeueFalse,
    /// `reject_requeue_true`: rejected with requeue once all are taken.
    RejectRequeueTrue,
    /// `reject_requeue_false`: rejected without requeue (dead-lettered where configured).
    RejectRequeueFalse,
}

impl AckMode {
    fn parse(s: &str) -> Option<AckMode> {
        Some(match s {
            "ack_requeue_true" => AckMode::AckRequeueTrue,
            "ack_requeue_false" => AckMode::AckRequeueFalse,
            "reject_requeue_true" => AckMode::RejectRequeueTrue,
            "reject_requeue_false" => AckMode::RejectRequeueFalse,
            _ => return None,
        })
    }

    /// Whether the `basic.get`s are sent with `no_ack`.
    pub fn no_ack(self) -> bool {
        self == AckMode::AckRequeueFalse
    }

    /// `Some(requeue)` when the messages are rejected after the gets.
    pub fn reject(self) -> Option<bool> {
        match self {
            AckMode::RejectRequeueTrue => Some(true),
            AckMode::RejectRequeueFalse => Some(false),
            _ => None,
        }
    }
}

/// How a fetched payload is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// As a string when it is UTF-8, else base64.
    Auto,
    /// Always base64.
    Base64,
}

/// One piece of work over the node's own AMQP channel.
#[derive(Clone, Debug, PartialEq)]
pub enum DirectOp {
    /// Publish with `mandatory` in confirm mode; answer `{"routed": bool}`.
    Publish {
        /// The exchange (`""` for the default one).
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// The message's properties.
        properties: Box<BasicProperties>,
        /// The body.
        payload: Vec<u8>,
    },
    /// Up to `count` `basic.get`s.
    Get {
        /// The queue.
        queue: String,
        /// How many at most.
        count: u64,
        /// What happens to them.
        ackmode: AckMode,
        /// How payloads are shown.
        encoding: Encoding,
        /// Payloads cut to this many bytes.
        truncate: Option<usize>,
    },
    /// `queue.purge`.
    Purge {
        /// The queue.
        queue: String,
    },
    /// Declare `aliveness-test`, publish to it and get the message back.
    Aliveness,
}

/// A [`DirectOp`] with the vhost and credentials the driver opens its connection with.
#[derive(Clone, Debug, PartialEq)]
pub struct Direct {
    /// The vhost.
    pub vhost: String,
    /// The request's user.
    pub user: String,
    /// Its password (from the request's basic auth).
    pub password: String,
    /// The work.
    pub op: DirectOp,
}

/// A message a `basic.get` returned.
#[derive(Clone, Debug, PartialEq)]
pub struct Fetched {
    /// `redelivered`.
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Messages left in the queue after it.
    pub message_count: u32,
    /// Its properties.
    pub properties: BasicProperties,
    /// Its body.
    pub payload: Vec<u8>,
}

/// What the driver saw.
#[derive(Clone, Debug, PartialEq)]
pub enum DirectOutcome {
    /// The publish was confirmed; `routed` is false when it came back (`basic.return`).
    Published {
        /// Whether a queue took it.
        routed: bool,
    },
    /// The publish was nacked.
    Rejected,
    /// The messages taken, in order.
    Got(Vec<Fetched>),
    /// The queue was purged.
    Purged,
    /// The aliveness test's `basic.get` gave this payload (`None`: the queue was empty).
    Alive(Option<Vec<u8>>),
    /// The broker closed the channel or the connection.
    Closed {
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The connection could not be made or broke without a close.
    Failed(String),
}

fn missing(key: &str) -> Response {
    Response::bad_request(format!("[{{key_missing,{key}}}]"))
}

fn body_object(body: &[u8]) -> Result<Map<String, Value>, Response> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(Response::bad_request("Not a JSON object")),
        Err(e) => Err(Response::bad_request(e.to_string())),
    }
}

/// An integer given as a number or as a string of digits (RabbitMQ's `parse_int`).
fn int_field(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// `POST /api/exchanges/{vhost}/{exchange}/publish`'s body.
pub fn parse_publish(exchange: &str, body: &[u8]) -> Result<DirectOp, Response> {
    let o = body_object(body)?;
    let routing_key = match o.get("routing_key") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(Response::bad_request("routing_key is not a string")),
        None => return Err(missing("routing_key")),
    };
    let properties = match o.get("properties") {
        Some(Value::Object(p)) => properties(p)?,
        Some(_) => return Err(Response::bad_request("properties is not an object")),
        None => return Err(missing("properties")),
    };
    let payload = match o.get("payload") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(Response::bad_request("payload_not_string")),
        None => return Err(missing("payload")),
    };
    let payload = match o.get("payload_encoding").and_then(Value::as_str) {
        Some("string") => payload.into_bytes(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(payload.as_bytes())
            .map_err(|_| Response::bad_request("not_base64"))?,
        Some(other) => {
            return Err(Response::bad_request(format!(
                "{{unsupported_encoding,{other}}}"
            )))
        }
        None => return Err(missing("payload_encoding")),
    };
    Ok(DirectOp::Publish {
        exchange: exchange.to_string(),
        routing_key,
        properties: Box::new(properties),
        payload,
    })
}

/// A JSON `properties` object as AMQP basic properties (RabbitMQ's
/// `rabbit_mgmt_format:to_basic_properties`: integers for `delivery_mode`, `priority` and
/// `timestamp`, a table for `headers`, strings for the rest; unknown keys ignored).
pub fn properties(p: &Map<String, Value>) -> Result<BasicProperties, Response> {
    let text = |k: &str| -> Result<Option<ShortString>, Response> {
        match p.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str().into())),
            Some(_) => Err(Response::bad_request(format!("{{not_string,{k}}}"))),
        }
    };
    let int = |k: &str| -> Result<Option<u64>, Response> {
        match p.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(_) => Err(Response::bad_request(format!("{{not_int,{k}}}"))),
        }
    };
    let mut props = BasicProperties::default();
    if let Some(v) = text("content_type")? {
        props = props.with_content_type(v);
    }
    if let Some(v) = text("content_encoding")? {
        props = props.with_content_encoding(v);
    }
    match p.get("headers") {
        None | Some(Value::Null) => {}
        Some(Value::Object(h)) => props = props.with_headers(field_table(h)),
        Some(_) => return Err(Response::bad_request("{not_table,headers}")),
    }
    if let Some(v) = int("delivery_mode")? {
        props = props.with_delivery_mode(v.min(255) as u8);
    }
    if let Some(v) = int("priority")? {
        props = props.with_priority(v.min(255) as u8);
    }
    if let Some(v) = text("correlation_id")? {
        props = props.with_correlation_id(v);
    }
    if let Some(v) = text("reply_to")? {
        props = props.with_reply_to(v);
    }
    if let Some(v) = text("expiration")? {
        props = props.with_expiration(v);
    }
    if let Some(v) = text("message_id")? {
        props = props.with_message_id(v);
    }
    if let Some(v) = int("timestamp")? {
        props = props.with_timestamp(v);
    }
    if let Some(v) = text("type")? {
        props = props.with_type(v);
    }
    if let Some(v) = text("user_id")? {
        props = props.with_user_id(v);
    }
    if let Some(v) = text("app_id")? {
        props = props.with_app_id(v);
    }
    if let Some(v) = text("cluster_id")? {
        props = props.with_cluster_id(v);
    }
    Ok(props)
}

/// AMQP basic properties as the API shows them: only the fields set
/// (`rabbit_mgmt_format:basic_properties`).
pub fn properties_json(p: &BasicProperties) -> Value {
    let mut o = Map::new();
    let mut text = |k: &str, v: Option<&ShortString>| {
        if let Some(v) = v {
            o.insert(k.to_string(), json!(v.as_str()));
        }
    };
    text("content_type", p.content_type().as_ref());
    text("content_encoding", p.content_encoding().as_ref());
    text("correlation_id", p.correlation_id().as_ref());
    text("reply_to", p.reply_to().as_ref());
    text("expiration", p.expiration().as_ref());
    text("message_id", p.message_id().as_ref());
    text("type", p.kind().as_ref());
    text("user_id", p.user_id().as_ref());
    text("app_id", p.app_id().as_ref());
    text("cluster_id", p.cluster_id().as_ref());
    if let Some(h) = p.headers() {
        o.insert("headers".to_string(), table_json(h));
    }
    if let Some(v) = p.delivery_mode() {
        o.insert("delivery_mode".to_string(), json!(v));
    }
    if let Some(v) = p.priority() {
        o.insert("priority".to_string(), json!(v));
    }
    if let Some(v) = p.timestamp() {
        o.insert("timestamp".to_string(), json!(v));
    }
    Value::Object(o)
}

/// `POST /api/queues/{vhost}/{queue}/get`'s body.
pub fn parse_get(queue: &str, body: &[u8]) -> Result<DirectOp, Response> {
    let o = body_object(body)?;
    let ackmode = match o.get("ackmode") {
        None => return Err(missing("ackmode")),
        Some(v) => v
            .as_str()
            .and_then(AckMode::parse)
            .ok_or_else(|| Response::bad_request(format!("unknown ackmode {v}")))?,
    };
    let count = match o.get("count") {
        None => return Err(missing("count")),
        Some(v) => {
            int_field(v).ok_or_else(|| Response::bad_request(format!("{{not_integer,{v}}}")))?
        }
    };
    let encoding = match o.get("encoding") {
        None => return Err(missing("encoding")),
        Some(Value::String(s)) if s == "auto" => Encoding::Auto,
        Some(Value::String(s)) if s == "base64" => Encoding::Base64,
        Some(_) => {
            return Err(Response::bad_request(
                "Unsupported encoding. Please use auto or base64.",
            ))
        }
    };
    let truncate = match o.get("truncate") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            int_field(v).ok_or_else(|| Response::bad_request(format!("{{not_integer,{v}}}")))?
                as usize,
        ),
    };
    Ok(DirectOp::Get {
        queue: queue.to_string(),
        count,
        ackmode,
        encoding,
        truncate,
    })
}

fn fetched_json(m: &Fetched, encoding: Encoding, truncate: Option<usize>) -> Value {
    let payload = match truncate {
        Some(n) if m.payload.len() > n => &m.payload[..n],
        _ => &m.payload[..],
    };
    let (text, enc) = match (encoding, std::str::from_utf8(payload)) {
        (Encoding::Auto, Ok(s)) => (s.to_string(), "string"),
        _ => (
            base64::engine::general_purpose::STANDARD.encode(payload),
            "base64",
        ),
    };
    json!({
        "payload_bytes": m.payload.len(),
        "redelivered": m.redelivered,
        "exchange": m.exchange,
        "routing_key": m.routing_key,
        "message_count": m.message_count,
        "properties": properties_json(&m.properties),
        "payload": text,
        "payload_encoding": enc,
    })
}

/// The channel error as RabbitMQ's API shows it: 400 with the code and the text.
fn closed(code: u16, text: &str) -> Response {
    Response::bad_request(format!("{code} {text}"))
}

/// The answer to `op` given what happened.
pub fn reply(op: &DirectOp, outcome: DirectOutcome) -> Response {
    match (op, outcome) {
        (_, DirectOutcome::Closed { code, text }) => closed(code, &text),
        (_, DirectOutcome::Failed(e)) => {
            Response::error(500, "internal_server_error", format!("direct channel: {e}"))
        }
        (DirectOp::Publish { .. }, DirectOutcome::Published { routed }) => {
            Response::ok(json!({ "routed": routed }))
        }
        (DirectOp::Publish { .. }, DirectOutcome::Rejected) => {
            Response::bad_request("rejected Unable to publish message. Check queue limits.")
        }
        (
            DirectOp::Get {
                encoding, truncate, ..
            },
            DirectOutcome::Got(ms),
        ) => Response::ok(Value::Array(
            ms.iter()
                .map(|m| fetched_json(m, *encoding, *truncate))
                .collect(),
        )),
        (DirectOp::Purge { .. }, DirectOutcome::Purged) => Response::empty(204),
        (DirectOp::Aliveness, DirectOutcome::Alive(Some(p))) if p == ALIVENESS_PAYLOAD => {
            Response::ok(json!({"status": "ok"}))
        }
        (DirectOp::Aliveness, DirectOutcome::Alive(got)) => {
            let reason = match got {
                None => "aliveness-test queue is empty".to_string(),
                Some(p) => format!(
                    "aliveness-test queue gave {:?}",
                    String::from_utf8_lossy(&p)
                ),
            };
            Response {
                status: 503,
                ..Response::ok(json!({"status": "failed", "reason": reason}))
            }
        }
        (op, outcome) => Response::error(
            500,
            "internal_server_error",
            format!("direct channel: {outcome:?} does not answer {op:?}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, FieldTable};

    fn header(p: &BasicProperties, key: &str) -> Option<AMQPValue> {
        p.headers()
            .as_ref()
            .and_then(|h: &FieldTable| h.inner().get(&ShortString::from(key)).cloned())
    }

    #[test]
    fn publish_bodies_parse_as_rabbitmq_reads_them() {
        let op = parse_publish(
            "amq.direct",
            br#"{"properties":{"delivery_mode":2,"headers":{"a":1},"content_type":"text/plain"},
                 "routing_key":"k","payload":"aGk=","payload_encoding":"base64"}"#,
        )
        .unwrap();
        let DirectOp::Publish {
            exchange,
            routing_key,
            properties,
            payload,
        } = op
        else {
            panic!("not a publish")
        };
        assert_eq!(exchange, "amq.direct");
        assert_eq!(routing_key, "k");
        assert_eq!(payload, b"hi");
        assert_eq!(*properties.delivery_mode(), Some(2));
        assert_eq!(
            properties.content_type().as_ref().map(|s| s.as_str()),
            Some("text/plain")
        );
        assert_eq!(header(&properties, "a"), Some(AMQPValue::LongLongInt(1)));
    }

    #[test]
    fn publish_bodies_missing_a_key_or_badly_typed_are_400() {
        let r = parse_publish("x", br#"{"properties":{},"routing_key":"k","payload":"p"}"#)
            .unwrap_err();
        assert_eq!(r.status, 400);
        assert!(r.body_text().contains("key_missing,payload_encoding"));
        let r = parse_publish(
            "x",
            br#"{"properties":{"delivery_mode":"2"},"routing_key":"k","payload":"p","payload_encoding":"string"}"#,
        )
        .unwrap_err();
        assert!(r.body_text().contains("not_int,delivery_mode"), "{r:?}");
        let r = parse_publish(
            "x",
            br#"{"properties":{},"routing_key":"k","payload":"p","payload_encoding":"rot13"}"#,
        )
        .unwrap_err();
        assert!(r.body_text().contains("unsupported_encoding"));
        let r = parse_publish(
            "x",
            br#"{"properties":{},"routing_key":"k","payload":5,"payload_encoding":"string"}"#,
        )
        .unwrap_err();
        assert!(r.body_text().contains("payload_not_string"));
    }

    #[test]
    fn get_bodies_parse_and_check_their_keys() {
        let op = parse_get(
            "q",
            br#"{"count":"3","ackmode":"reject_requeue_true","encoding":"auto","truncate":10}"#,
        )
        .unwrap();
        assert_eq!(
            op,
            DirectOp::Get {
                queue: "q".into(),
                count: 3,
                ackmode: AckMode::RejectRequeueTrue,
                encoding: Encoding::Auto,
                truncate: Some(10)
            }
        );
        for (body, text) in [
            (
                &br#"{"count":1,"encoding":"auto"}"#[..],
                "key_missing,ackmode",
            ),
            (
                br#"{"ackmode":"ack_requeue_true","encoding":"auto"}"#,
                "key_missing,count",
            ),
            (
                br#"{"count":1,"ackmode":"ack_requeue_true","encoding":"hex"}"#,
                "Unsupported encoding",
            ),
            (
                br#"{"count":1,"ackmode":"keep","encoding":"auto"}"#,
                "unknown ackmode",
            ),
        ] {
            let r = parse_get("q", body).unwrap_err();
            assert_eq!(r.status, 400);
            assert!(r.body_text().contains(text), "{text}: {r:?}");
        }
    }

    #[test]
    fn ack_modes_map_to_no_ack_and_rejects() {
        assert!(AckMode::AckRequeueFalse.no_ack());
        assert!(!AckMode::AckRequeueTrue.no_ack());
        assert_eq!(AckMode::AckRequeueTrue.reject(), None);
        assert_eq!(AckMode::RejectRequeueTrue.reject(), Some(true));
        assert_eq!(AckMode::RejectRequeueFalse.reject(), Some(false));
        assert!(!AckMode::RejectRequeueFalse.no_ack());
    }

    fn fetched(payload: &[u8]) -> Fetched {
        Fetched {
            redelivered: true,
            exchange: "".into(),
            routing_key: "q".into(),
            message_count: 4,
            properties: BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id("m1".into()),
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn fetched_messages_show_text_or_base64_and_truncate() {
        let op = DirectOp::Get {
            queue: "q".into(),
            count: 2,
            ackmode: AckMode::AckRequeueTrue,
            encoding: Encoding::Auto,
            truncate: Some(3),
        };
        let r = reply(
            &op,
            DirectOutcome::Got(vec![fetched(b"hello"), fetched(&[0xff, 0xfe])]),
        );
        assert_eq!(r.status, 200);
        let body = r.body.unwrap();
        assert_eq!(
            body[0],
            json!({"payload_bytes": 5, "redelivered": true, "exchange": "", "routing_key": "q",
                   "message_count": 4, "properties": {"delivery_mode": 2, "message_id": "m1"},
                   "payload": "hel", "payload_encoding": "string"})
        );
        assert_eq!(body[1]["payload"], "//4=");
        assert_eq!(body[1]["payload_encoding"], "base64");
    }

    #[test]
    fn outcomes_become_rabbitmq_answers() {
        let publish = parse_publish(
            "x",
            br#"{"properties":{},"routing_key":"k","payload":"p","payload_encoding":"string"}"#,
        )
        .unwrap();
        assert_eq!(
            reply(&publish, DirectOutcome::Published { routed: false }).body,
            Some(json!({"routed": false}))
        );
        assert_eq!(reply(&publish, DirectOutcome::Rejected).status, 400);
        let r = reply(
            &publish,
            DirectOutcome::Closed {
                code: 404,
                text: "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
            },
        );
        assert_eq!(
            r.body,
            Some(json!({"error": "bad_request",
                        "reason": "404 NOT_FOUND - no exchange 'x' in vhost '/'"}))
        );
        let purge = DirectOp::Purge { queue: "q".into() };
        assert_eq!(reply(&purge, DirectOutcome::Purged).status, 204);
        assert_eq!(
            reply(
                &DirectOp::Aliveness,
                DirectOutcome::Alive(Some(ALIVENESS_PAYLOAD.to_vec()))
            )
            .body,
            Some(json!({"status": "ok"}))
        );
        assert_eq!(
            reply(&DirectOp::Aliveness, DirectOutcome::Alive(None)).status,
            503
        );
        assert_eq!(
            reply(&purge, DirectOutcome::Failed("refused".into())).status,
            500
        );
    }
}

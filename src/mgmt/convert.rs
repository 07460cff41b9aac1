//! Conversions between the management API's JSON and Warren's types: request arguments to
//! AMQP field tables, and the admin protocol's text rows to typed JSON objects.

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use serde_json::{Map, Number, Value};

use crate::admin::Response as AdminResponse;

/// A JSON value as an AMQP field value (integers as `long long`, strings as long strings,
/// objects as tables), as RabbitMQ's management plugin converts `arguments`.
pub fn amqp_value(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes().to_vec())),
        Value::Array(a) => {
            let mut arr = FieldArray::default();
            for x in a {
                arr.push(amqp_value(x));
            }
            AMQPValue::FieldArray(arr)
        }
        Value::Object(o) => AMQPValue::FieldTable(field_table(o)),
    }
}

/// A JSON object as an AMQP field table.
pub fn field_table(o: &Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in o {
        t.insert(k.as_str().into(), amqp_value(v));
    }
    t
}

/// The `arguments` member of a request body: an object, or absent (an empty table).
pub fn arguments(body: &Map<String, Value>) -> Result<FieldTable, String> {
    match body.get("arguments") {
        None | Some(Value::Null) => Ok(FieldTable::default()),
        Some(Value::Object(o)) => Ok(field_table(o)),
        Some(_) => Err("arguments must be a JSON object".into()),
    }
}

/// How one admin column becomes JSON.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Text as is.
    Str,
    /// Text, `null` when empty.
    OptStr,
    /// An unsigned integer.
    Int,
    /// `true` / `false`.
    Bool,
    /// JSON text (argument tables, policy definitions).
    Json,
    /// `[a, b]`: a list of names.
    List,
}

fn value(kind: Kind, text: &str) -> Value {
    match kind {
        Kind::Str => Value::String(text.to_string()),
        Kind::OptStr if text.is_empty() => Value::Null,
        Kind::OptStr => Value::String(text.to_string()),
        Kind::Int => text
            .parse::<u64>()
            .map(|n| Value::Number(Number::from(n)))
            .unwrap_or(Value::Null),
        Kind::Bool => Value::Bool(text == "true"),
        Kind::Json => serde_json::from_str(text).unwrap_or(Value::String(text.to_string())),
        Kind::List => {
            let inner = text.trim_start_matches('[').trim_end_matches(']');
            Value::Array(
                inner
                    .split(", ")
                    .filter(|s| !s.is_empty())
                    .map(|s| Value::String(s.to_string()))
                    .collect(),
            )
        }
    }
}

/// The admin columns to ask for, from a field map.
pub fn columns(fields: &[(&str, &str, Kind)]) -> Vec<String> {
    fields.iter().map(|(c, _, _)| c.to_string()).collect()
}

/// Turns an admin table into JSON objects: each `(admin column, JSON field, kind)` of
/// `fields` (in the order asked for with [`columns`]), plus `extra` fields on every object.
pub fn objects(
    table: &AdminResponse,
    fields: &[(&str, &str, Kind)],
    extra: &[(&str, Value)],
) -> Vec<Value> {
    table
        .rows
        .iter()
        .map(|row| {
            let mut o = Map::new();
            for ((_, field, kind), text) in fields.iter().zip(row) {
                o.insert(field.to_string(), value(*kind, text));
            }
            for (k, v) in extra {
                o.insert(k.to_string(), v.clone());
            }
            Value::Object(o)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_become_amqp_values() {
        let body = json!({"arguments": {"x-max-length": 10, "x-queue-mode": "lazy"}});
        let t = arguments(body.as_object().unwrap()).unwrap();
        assert_eq!(
            t.inner().get("x-max-length"),
            Some(&AMQPValue::LongLongInt(10))
        );
        assert_eq!(
            crate::meta::args::string(t.inner().get("x-queue-mode").unwrap()).as_deref(),
            Some("lazy")
        );
        let bad = json!({"arguments": 3});
        assert!(arguments(bad.as_object().unwrap()).is_err());
    }

    #[test]
    fn admin_rows_become_typed_json() {
        let table = AdminResponse::table(
            vec!["a".into(), "b".into(), "c".into(), "d".into(), "e".into()],
            vec![vec![
                "q".into(),
                "7".into(),
                "true".into(),
                "{\"k\":1}".into(),
                "[n1, n2]".into(),
            ]],
        );
        let fields = [
            ("a", "name", Kind::Str),
            ("b", "messages", Kind::Int),
            ("c", "durable", Kind::Bool),
            ("d", "arguments", Kind::Json),
            ("e", "slave_nodes", Kind::List),
        ];
        let got = objects(&table, &fields, &[("vhost", json!("/"))]);
        assert_eq!(
            got,
            vec![
                json!({"name": "q", "messages": 7, "durable": true, "arguments": {"k": 1},
                        "slave_nodes": ["n1", "n2"], "vhost": "/"})
            ]
        );
    }
}

//! Conversions between the management API's JSON and Warren's types: request arguments to
//! AMQP field tables, and the admin protocol's text rows to typed JSON objects.

use std::collections::BTreeMap;

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use serde_json::{Map, Number, Value};

use crate::admin::Response as AdminResponse;
use crate::meta::policy::PolicyValue;

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

/// An AMQP field value as the API shows it (an `arguments` member): integers and
/// floats as numbers (a float JSON cannot hold as `null`), strings as strings, tables as
/// objects, arrays as arrays, `void` as `null`, and what JSON has no form for (byte arrays,
/// decimals) as its debug text.
pub fn amqp_json(v: &AMQPValue) -> Value {
    let float = |text: String| {
        text.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map_or(Value::Null, Value::Number)
    };
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(x) => Value::from(*x),
        AMQPValue::ShortShortUInt(x) => Value::from(*x),
        AMQPValue::ShortInt(x) => Value::from(*x),
        AMQPValue::ShortUInt(x) => Value::from(*x),
        AMQPValue::LongInt(x) => Value::from(*x),
        AMQPValue::LongUInt(x) => Value::from(*x),
        AMQPValue::LongLongInt(x) => Value::from(*x),
        AMQPValue::Timestamp(x) => Value::from(*x),
        // Through their shortest text, so a float shows as written (1.1, not 1.100000023…).
        AMQPValue::Float(x) => float(x.to_string()),
        AMQPValue::Double(x) => float(x.to_string()),
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            Value::String(crate::meta::args::string(v).unwrap_or_default())
        }
        AMQPValue::FieldTable(t) => table_json(t),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_json).collect()),
        AMQPValue::Void => Value::Null,
        other => Value::String(format!("{other:?}")),
    }
}

/// An AMQP field table as a JSON object.
pub fn table_json(t: &FieldTable) -> Value {
    Value::Object(
        t.inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), amqp_json(v)))
            .collect(),
    )
}

/// A policy value as JSON.
fn policy_value_json(v: &PolicyValue) -> Value {
    match v {
        PolicyValue::Int(n) => Value::from(*n),
        PolicyValue::Str(s) => Value::String(s.clone()),
        PolicyValue::Bool(b) => Value::Bool(*b),
        PolicyValue::List(items) => Value::Array(items.iter().map(policy_value_json).collect()),
    }
}

/// A policy definition (or an effective one) as a JSON object.
pub fn definition_json(def: &BTreeMap<String, PolicyValue>) -> Value {
    Value::Object(
        def.iter()
            .map(|(k, v)| (k.clone(), policy_value_json(v)))
            .collect(),
    )
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
    fn amqp_values_become_json_values() {
        use amq_protocol::types::{ByteArray, ShortString};
        let mut inner = FieldTable::default();
        inner.insert("n".into(), AMQPValue::ShortInt(-3));
        let mut arr = FieldArray::default();
        arr.push(AMQPValue::Boolean(true));
        arr.push(AMQPValue::ShortString(ShortString::from("s")));
        let mut t = FieldTable::default();
        t.insert("f".into(), AMQPValue::Float(1.1));
        t.insert("nan".into(), AMQPValue::Double(f64::NAN));
        t.insert("t".into(), AMQPValue::FieldTable(inner));
        t.insert("a".into(), AMQPValue::FieldArray(arr));
        t.insert("v".into(), AMQPValue::Void);
        t.insert(
            "s".into(),
            AMQPValue::LongString(LongString::from(b"x\"y".to_vec())),
        );
        t.insert("b".into(), AMQPValue::ByteArray(ByteArray::from(vec![1u8])));
        let j = table_json(&t);
        assert_eq!(
            j["f"],
            serde_json::json!(1.1),
            "a float as written, not widened"
        );
        assert_eq!(j["nan"], Value::Null);
        assert_eq!(j["t"], serde_json::json!({"n": -3}));
        assert_eq!(j["a"], serde_json::json!([true, "s"]));
        assert_eq!(j["v"], Value::Null);
        assert_eq!(j["s"], "x\"y");
        assert!(
            j["b"].as_str().is_some_and(|s| s.contains("ByteArray")),
            "{j}"
        );
        let def = BTreeMap::from([
            ("ha-mode".to_string(), PolicyValue::Str("nodes".into())),
            (
                "ha-params".to_string(),
                PolicyValue::List(vec![PolicyValue::Str("a".into())]),
            ),
            ("max-length".to_string(), PolicyValue::Int(5)),
            ("x".to_string(), PolicyValue::Bool(false)),
        ]);
        assert_eq!(
            definition_json(&def),
            serde_json::json!({"ha-mode": "nodes", "ha-params": ["a"], "max-length": 5, "x": false})
        );
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

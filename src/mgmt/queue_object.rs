//! A queue's object in the management API (`/api/queues*`) with RabbitMQ 3.10's field
//! names, made from its typed listing row ([`QueueInfo`]): written as JSON text straight
//! into a listing's answer, or built as a value for one queue's page. 10,000 queues built
//! as `serde_json` maps, then written and freed, took most of a listing's 200+ ms.

use std::collections::BTreeMap;

use amq_protocol::types::FieldTable;
use serde_json::{Map, Value};

use super::convert::{definition_json, table_json};
use super::query::{write_json, write_str, write_u64, Listed};
use crate::admin::queue_info::QueueInfo;
use crate::meta::policy::PolicyValue;

/// One queue's object.
pub struct QueueObject<'a> {
    vhost: &'a str,
    info: QueueInfo<'a>,
}

/// One field's value, typed; tables become JSON only when shown.
enum Field<'a> {
    Str(&'a str),
    /// A name, `null` when there is none.
    OptStr(Option<&'a str>),
    Int(u64),
    /// A number, `null` when there is none.
    OptInt(Option<u64>),
    Bool(bool),
    Names(Vec<&'a str>),
    Table(&'a FieldTable),
    Definition(&'a BTreeMap<String, PolicyValue>),
}

impl Field<'_> {
    fn to_value(&self) -> Value {
        match self {
            Field::Str(s) | Field::OptStr(Some(s)) => Value::String(s.to_string()),
            Field::OptStr(None) => Value::Null,
            Field::Int(n) | Field::OptInt(Some(n)) => Value::from(*n),
            Field::OptInt(None) => Value::Null,
            Field::Bool(b) => Value::Bool(*b),
            Field::Names(names) => names.iter().map(|n| Value::String(n.to_string())).collect(),
            Field::Table(t) => table_json(t),
            Field::Definition(d) => definition_json(d),
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Field::Str(s) | Field::OptStr(Some(s)) => write_str(out, s),
            Field::Int(n) | Field::OptInt(Some(n)) => write_u64(out, *n),
            Field::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Field::Names(names) => {
                out.push(b'[');
                for (i, n) in names.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_str(out, n);
                }
                out.push(b']');
            }
            Field::Table(t) if t.inner().is_empty() => out.extend_from_slice(b"{}"),
            Field::OptStr(None) | Field::OptInt(None) => out.extend_from_slice(b"null"),
            Field::Table(_) | Field::Definition(_) => write_json(out, &self.to_value()),
        }
    }
}

impl<'a> QueueObject<'a> {
    /// The object of queue `info` in `vhost`.
    pub fn new(vhost: &'a str, info: QueueInfo<'a>) -> QueueObject<'a> {
        QueueObject { vhost, info }
    }

    /// Every field with its value, in name order (the order a map of them is written in).
    fn each(&self, f: &mut dyn FnMut(&'static str, Field<'_>)) {
        let q = self.info.def;
        let n = &self.info.figures;
        let p = &self.info.policy;
        let mirrors = self.info.mirrors.as_ref().map(|m| &m.members);
        f("arguments", Field::Table(&q.arguments));
        f("auto_delete", Field::Bool(q.auto_delete));
        f("consumers", Field::Int(n.consumers));
        f("durable", Field::Bool(q.durable));
        f(
            "effective_policy_definition",
            Field::Definition(&p.definition),
        );
        f("exclusive", Field::Bool(q.exclusive_owner.is_some()));
        f(
            "exclusive_consumer_tag",
            Field::OptStr(n.exclusive_consumer_tag.as_deref()),
        );
        f(
            "head_message_timestamp",
            Field::OptInt(n.head_message_timestamp),
        );
        f("message_bytes", Field::Int(n.bytes()));
        f("message_bytes_paged_out", Field::Int(n.paged_out_bytes));
        f("message_bytes_persistent", Field::Int(n.persistent_bytes));
        f("message_bytes_ram", Field::Int(n.ram_bytes));
        f("message_bytes_ready", Field::Int(n.ready_bytes));
        f("message_bytes_unacknowledged", Field::Int(n.unacked_bytes));
        f("messages", Field::Int(n.messages()));
        f("messages_paged_out", Field::Int(n.paged_out));
        f("messages_persistent", Field::Int(n.persistent));
        f("messages_ram", Field::Int(n.ram()));
        f("messages_ready", Field::Int(n.ready));
        f("messages_ready_ram", Field::Int(n.ready_ram));
        f("messages_unacknowledged", Field::Int(n.unacked));
        f("messages_unacknowledged_ram", Field::Int(n.unacked_ram));
        f("name", Field::Str(&q.name));
        f("node", Field::Str(self.info.node));
        f(
            "operator_policy",
            Field::OptStr(p.operator_policy.as_deref()),
        );
        f("policy", Field::OptStr(p.policy.as_deref()));
        // As RabbitMQ's: the nodes whose mirrors could bring the queue back, every mirror's
        // (Warren's keep their copy across restarts); `null` when there are none.
        match mirrors.filter(|m| !m.is_empty()) {
            Some(members) => {
                let nodes = members.iter().map(|m| m.node.as_str()).collect();
                f("recoverable_slaves", Field::Names(nodes));
            }
            None => f("recoverable_slaves", Field::OptStr(None)),
        }
        // As RabbitMQ: the mirror fields only on a mirrored queue.
        if let Some(members) = mirrors {
            let nodes = members.iter().map(|m| m.node.as_str()).collect();
            f("slave_nodes", Field::Names(nodes));
        }
        f(
            "single_active_consumer_tag",
            Field::OptStr(n.single_active_consumer_tag.as_deref()),
        );
        f("state", Field::Str("running"));
        if let Some(members) = mirrors {
            let synced = members.iter().filter(|m| m.synchronised);
            f(
                "synchronised_slave_nodes",
                Field::Names(synced.map(|m| m.node.as_str()).collect()),
            );
        }
        f("type", Field::Str("classic"));
        f("vhost", Field::Str(self.vhost));
    }

    /// The object as a value.
    pub fn to_value(&self) -> Value {
        let mut o = Map::new();
        self.each(&mut |k, v| {
            o.insert(k.to_string(), v.to_value());
        });
        Value::Object(o)
    }

    /// Writes the object as JSON text, with only `columns` when given.
    pub fn write(&self, columns: Option<&[String]>, out: &mut Vec<u8>) {
        out.push(b'{');
        let mut first = true;
        self.each(&mut |k, v| {
            if columns.is_some_and(|c| !c.iter().any(|c| c == k)) {
                return;
            }
            if !first {
                out.push(b',');
            }
            first = false;
            write_str(out, k);
            out.push(b':');
            v.write(out);
        });
        out.push(b'}');
    }
}

impl Listed for QueueObject<'_> {
    fn field(&self, key: &str) -> Option<Value> {
        let mut found = None;
        self.each(&mut |k, v| {
            if k == key {
                found = Some(v.to_value());
            }
        });
        found
    }

    fn name(&self) -> Option<&str> {
        Some(&self.info.def.name)
    }
}

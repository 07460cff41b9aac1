//! Validation of queue `x-` arguments, with RabbitMQ 3.10's accepted types and ranges.

use amq_protocol::types::{AMQPValue, FieldTable};

use super::equivalence::{integer, type_name};
use super::error::MetaError;

/// What happens when a queue reaches its length limit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Drop (or dead-letter) the oldest message.
    #[default]
    DropHead,
    /// Refuse the new message (nack to confirming publishers).
    RejectPublish,
    /// Refuse the new message and dead-letter it.
    RejectPublishDlx,
}

/// The queue arguments Warren understands, validated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueArgs {
    /// `x-message-ttl` in milliseconds.
    pub message_ttl_ms: Option<u64>,
    /// `x-expires` in milliseconds (queue deleted after being unused this long).
    pub expires_ms: Option<u64>,
    /// `x-max-length` in messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes` in body bytes.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-max-priority`.
    pub max_priority: Option<u8>,
    /// `x-queue-mode: lazy`.
    pub lazy: bool,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// An `ha-mode` policy applies: the queue is mirrored, so its transient messages are
    /// recorded in its index too (that record is what reaches the mirrors; it is dropped
    /// at the node's next start, as a transient message is).
    pub mirrored: bool,
}

/// The text of a string-typed field value.
pub fn string(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// `?MAX_EXPIRY_TIMER`: the largest TTL and expiry RabbitMQ accepts (ms).
const MAX_EXPIRY_MS: i128 = u32::MAX as i128;

/// The keys RabbitMQ checks at a declare, in its order (`rabbit_amqqueue:declare_args/0`),
/// and compares at a redeclare.
pub const DECLARE_ARGS: [&str; 12] = [
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-single-active-consumer",
    "x-queue-type",
    "x-queue-master-locator",
];

/// Why an argument is refused.
enum Refusal {
    /// `invalid arg '<key>' for queue ...: <why>`, `why` printed as Erlang prints the term.
    Arg(&'static str, String),
    /// A whole text of its own.
    Text(String),
}

/// The term RabbitMQ's checks return for a non-integer where an integer is wanted (a
/// string, so Erlang's `~p` prints it quoted).
fn not_integer(v: &AMQPValue) -> String {
    format!("\"expected integer, got {}\"", type_name(v))
}

fn non_negative(v: &AMQPValue) -> Result<i128, String> {
    let n = integer(v).ok_or_else(|| not_integer(v))?;
    if n < 0 {
        return Err(format!("{{value_negative,{n}}}"));
    }
    Ok(n)
}

fn unacceptable(v: &AMQPValue) -> String {
    format!("{{unacceptable_type,{}}}", type_name(v))
}

fn check(table: &FieldTable) -> Result<QueueArgs, Refusal> {
    let mut a = QueueArgs::default();
    for key in DECLARE_ARGS {
        let Some(value) = table.inner().get(key) else {
            continue;
        };
        let arg = |why: String| Refusal::Arg(key, why);
        let text = || string(value).ok_or_else(|| arg(unacceptable(value)));
        match key {
            "x-expires" => {
                let n = non_negative(value).map_err(arg)?;
                if n == 0 {
                    return Err(arg("{value_zero,0}".into()));
                }
                if n > MAX_EXPIRY_MS {
                    return Err(arg(format!("{{value_too_large,{n}}}")));
                }
                a.expires_ms = Some(n as u64);
            }
            "x-message-ttl" => {
                let n = non_negative(value).map_err(arg)?;
                if n > MAX_EXPIRY_MS {
                    return Err(arg(format!("{{value_too_large,{n}}}")));
                }
                a.message_ttl_ms = Some(n as u64);
            }
            "x-dead-letter-exchange" => match string(value) {
                Some(x) => a.dead_letter_exchange = Some(x),
                None => {
                    return Err(Refusal::Text(format!(
                        "invalid type '{}' for arg '{key}'",
                        type_name(value)
                    )))
                }
            },
            "x-dead-letter-routing-key" => {
                a.dead_letter_routing_key = Some(text()?);
                if !table.inner().contains_key("x-dead-letter-exchange") {
                    return Err(arg("routing_key_but_no_dlx_defined".into()));
                }
            }
            "x-max-length" => {
                a.max_length = Some(non_negative(value).map_err(arg)?.min(u64::MAX as i128) as u64)
            }
            "x-max-length-bytes" => {
                a.max_length_bytes =
                    Some(non_negative(value).map_err(arg)?.min(u64::MAX as i128) as u64)
            }
            "x-max-priority" => {
                let n = non_negative(value).map_err(arg)?;
                if n > 255 {
                    return Err(arg(format!("{{max_value_exceeded,{n}}}")));
                }
                a.max_priority = Some(n as u8);
            }
            "x-overflow" => {
                a.overflow = match text()?.as_str() {
                    "drop-head" => Overflow::DropHead,
                    "reject-publish" => Overflow::RejectPublish,
                    "reject-publish-dlx" => Overflow::RejectPublishDlx,
                    _ => return Err(arg("invalid_overflow".into())),
                }
            }
            "x-queue-mode" => {
                a.lazy = match text()?.as_str() {
                    "default" => false,
                    "lazy" => true,
                    other => return Err(arg(format!("\"unsupported queue mode '{other}'\""))),
                }
            }
            "x-single-active-consumer" => match value {
                AMQPValue::Boolean(b) => a.single_active_consumer = *b,
                _ => return Err(arg(unacceptable(value))),
            },
            // Quorum queues and streams are not built: refused like an unknown type.
            "x-queue-type" => match text()?.as_str() {
                "classic" => {}
                other => return Err(arg(format!("\"unsupported queue type '{other}'\""))),
            },
            // RabbitMQ 3.10 takes any value here and fails later (541, the connection
            // closed); Warren refuses an unknown one at once (docs/compatibility.md).
            "x-queue-master-locator" => match text()?.as_str() {
                "client-local" | "min-masters" | "random" => {}
                other => return Err(arg(format!("{{unknown_locator,{other}}}"))),
            },
            _ => {}
        }
    }
    Ok(a)
}

impl QueueArgs {
    /// Validates `x-` arguments; other keys are kept but ignored, as in RabbitMQ. The
    /// error's text leaves the queue out: [`QueueArgs::parse_for`] names it.
    pub fn parse(table: &FieldTable) -> Result<QueueArgs, MetaError> {
        check(table).map_err(|r| match r {
            Refusal::Arg(key, why) => MetaError::Invalid(format!("invalid arg '{key}': {why}")),
            Refusal::Text(t) => MetaError::Invalid(t),
        })
    }

    /// [`QueueArgs::parse`] for queue `name` of `vhost`, with RabbitMQ's texts.
    pub fn parse_for(table: &FieldTable, name: &str, vhost: &str) -> Result<QueueArgs, MetaError> {
        check(table).map_err(|r| {
            MetaError::Invalid(match r {
                Refusal::Arg(key, why) => {
                    format!("invalid arg '{key}' for queue '{name}' in vhost '{vhost}': {why}")
                }
                Refusal::Text(t) => format!("{t} in queue '{name}' in vhost '{vhost}'"),
            })
        })
    }

    /// The first declare argument whose value in `received` is not equivalent to the one in
    /// `current` (RabbitMQ compares the raw values: an argument given at the first declare
    /// must be given again), as (arg, received, current). `x-queue-type` is left out: a
    /// classic queue is classic whether the argument says so or not.
    pub fn inequivalence(
        received: &FieldTable,
        current: &FieldTable,
    ) -> Option<(&'static str, String, String)> {
        let keys: Vec<&'static str> = DECLARE_ARGS
            .iter()
            .copied()
            .filter(|k| *k != "x-queue-type")
            .collect();
        super::equivalence::first_difference(&keys, received, current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(k: &str, v: AMQPValue) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(k.into(), v);
        t
    }

    #[test]
    fn accepts_rabbitmq_arguments() {
        let a = QueueArgs::parse(&table("x-max-length", AMQPValue::LongInt(10))).unwrap();
        assert_eq!(a.max_length, Some(10));
        let a = QueueArgs::parse(&table(
            "x-overflow",
            AMQPValue::LongString("reject-publish".into()),
        ))
        .unwrap();
        assert_eq!(a.overflow, Overflow::RejectPublish);
    }

    #[test]
    fn refuses_wrong_types_and_ranges() {
        for (k, v) in [
            ("x-max-length", AMQPValue::LongString("abc".into())),
            ("x-message-ttl", AMQPValue::LongInt(-1)),
            ("x-expires", AMQPValue::LongInt(0)),
            ("x-max-priority", AMQPValue::LongInt(300)),
            ("x-overflow", AMQPValue::LongString("sideways".into())),
            ("x-queue-type", AMQPValue::LongString("stream".into())),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString("k".into()),
            ),
        ] {
            assert!(QueueArgs::parse(&table(k, v)).is_err(), "{k}");
        }
    }
}

impl QueueArgs {
    /// The arguments a queue runs with: its declared `x-` arguments combined with its
    /// effective policy, by RabbitMQ's rules. For limits (`message-ttl`, `expires`,
    /// `max-length`, `max-length-bytes`) the lower value wins; for the others a declared
    /// argument takes precedence over the policy.
    pub fn with_policy(
        declared: &FieldTable,
        policy: &super::policy::Effective,
    ) -> Result<QueueArgs, MetaError> {
        let mut a = QueueArgs::parse(declared)?;
        let limit = |arg: Option<u64>, key: &str| -> Option<u64> {
            let p = policy.int(key).map(|n| n.max(0) as u64);
            match (arg, p) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            }
        };
        a.message_ttl_ms = limit(a.message_ttl_ms, "message-ttl");
        a.expires_ms = limit(a.expires_ms, "expires");
        a.max_length = limit(a.max_length, "max-length");
        a.max_length_bytes = limit(a.max_length_bytes, "max-length-bytes");
        let declared_has = |k: &str| declared.inner().contains_key(k);
        if !declared_has("x-overflow") {
            if let Some(o) = policy.str("overflow") {
                a.overflow = match o {
                    "reject-publish" => Overflow::RejectPublish,
                    "reject-publish-dlx" => Overflow::RejectPublishDlx,
                    _ => Overflow::DropHead,
                };
            }
        }
        if !declared_has("x-dead-letter-exchange") {
            if let Some(x) = policy.str("dead-letter-exchange") {
                a.dead_letter_exchange = Some(x.to_string());
            }
        }
        if !declared_has("x-dead-letter-routing-key") {
            if let Some(x) = policy.str("dead-letter-routing-key") {
                a.dead_letter_routing_key = Some(x.to_string());
            }
        }
        if !declared_has("x-queue-mode") {
            if let Some(m) = policy.str("queue-mode") {
                a.lazy = m == "lazy";
            }
        }
        a.mirrored = policy.str("ha-mode").is_some();
        Ok(a)
    }
}

#[cfg(test)]
mod policy_tests {
    use super::super::policy::{Effective, PolicyValue};
    use super::*;

    #[test]
    fn limits_take_the_lower_value_and_arguments_win_otherwise() {
        let mut declared = FieldTable::default();
        declared.insert("x-max-length".into(), AMQPValue::LongInt(10));
        declared.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("mine".into()),
        );
        let mut e = Effective::default();
        e.definition
            .insert("max-length".into(), PolicyValue::Int(5));
        e.definition
            .insert("message-ttl".into(), PolicyValue::Int(1000));
        e.definition.insert(
            "dead-letter-exchange".into(),
            PolicyValue::Str("theirs".into()),
        );
        e.definition
            .insert("overflow".into(), PolicyValue::Str("reject-publish".into()));
        let a = QueueArgs::with_policy(&declared, &e).unwrap();
        assert_eq!(a.max_length, Some(5));
        assert_eq!(a.message_ttl_ms, Some(1000));
        assert_eq!(a.dead_letter_exchange.as_deref(), Some("mine"));
        assert_eq!(a.overflow, Overflow::RejectPublish);
    }
}

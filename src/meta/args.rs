//! Validation of queue `x-` arguments, with RabbitMQ 3.10's accepted types and ranges.

use amq_protocol::types::{AMQPValue, FieldTable};

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

fn int(v: &AMQPValue) -> Option<i128> {
    Some(match v {
        AMQPValue::ShortShortInt(x) => *x as i128,
        AMQPValue::ShortShortUInt(x) => *x as i128,
        AMQPValue::ShortInt(x) => *x as i128,
        AMQPValue::ShortUInt(x) => *x as i128,
        AMQPValue::LongInt(x) => *x as i128,
        AMQPValue::LongUInt(x) => *x as i128,
        AMQPValue::LongLongInt(x) => *x as i128,
        AMQPValue::Timestamp(x) => *x as i128,
        _ => return None,
    })
}

/// The text of a string-typed field value.
pub fn string(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => "longstr",
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::Float(_) | AMQPValue::Double(_) => "double",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Void => "void",
        _ => "long",
    }
}

impl QueueArgs {
    /// Validates `x-` arguments; other keys are kept but ignored, as in RabbitMQ.
    pub fn parse(table: &FieldTable) -> Result<QueueArgs, MetaError> {
        let mut a = QueueArgs::default();
        for (key, value) in table.inner() {
            let key = key.as_str();
            let bad = |why: String| MetaError::Invalid(format!("invalid arg '{key}': {why}"));
            let unacceptable = || bad(format!("{{unacceptable_type,{}}}", type_name(value)));
            let non_negative = || -> Result<u64, MetaError> {
                let n = int(value).ok_or_else(unacceptable)?;
                if n < 0 {
                    return Err(bad(format!("{{value_negative,{n}}}")));
                }
                Ok(n.min(u64::MAX as i128) as u64)
            };
            match key {
                "x-message-ttl" => a.message_ttl_ms = Some(non_negative()?),
                "x-expires" => {
                    let n = non_negative()?;
                    if n == 0 {
                        return Err(bad("{value_zero,0}".into()));
                    }
                    a.expires_ms = Some(n);
                }
                "x-max-length" => a.max_length = Some(non_negative()?),
                "x-max-length-bytes" => a.max_length_bytes = Some(non_negative()?),
                "x-max-priority" => {
                    let n = non_negative()?;
                    if n > 255 {
                        return Err(bad(format!("{{value_too_large,{n},255}}")));
                    }
                    a.max_priority = Some(n as u8);
                }
                "x-overflow" => {
                    a.overflow = match string(value).ok_or_else(unacceptable)?.as_str() {
                        "drop-head" => Overflow::DropHead,
                        "reject-publish" => Overflow::RejectPublish,
                        "reject-publish-dlx" => Overflow::RejectPublishDlx,
                        other => return Err(bad(format!("{{unknown_overflow,{other}}}"))),
                    }
                }
                "x-dead-letter-exchange" => {
                    a.dead_letter_exchange = Some(string(value).ok_or_else(unacceptable)?)
                }
                "x-dead-letter-routing-key" => {
                    a.dead_letter_routing_key = Some(string(value).ok_or_else(unacceptable)?)
                }
                "x-queue-mode" => {
                    a.lazy = match string(value).ok_or_else(unacceptable)?.as_str() {
                        "default" => false,
                        "lazy" => true,
                        other => return Err(bad(format!("{{unknown_mode,{other}}}"))),
                    }
                }
                "x-queue-type" => match string(value).ok_or_else(unacceptable)?.as_str() {
                    "classic" => {}
                    other => {
                        return Err(bad(format!(
                            "queue type '{other}' is not supported by Warren (classic only)"
                        )))
                    }
                },
                "x-single-active-consumer" => match value {
                    AMQPValue::Boolean(b) => a.single_active_consumer = *b,
                    _ => return Err(unacceptable()),
                },
                "x-queue-master-locator" => {
                    match string(value).ok_or_else(unacceptable)?.as_str() {
                        "client-local" | "min-masters" | "random" => {}
                        other => return Err(bad(format!("{{unknown_locator,{other}}}"))),
                    }
                }
                _ => {}
            }
        }
        if a.dead_letter_routing_key.is_some() && a.dead_letter_exchange.is_none() {
            return Err(MetaError::Invalid(
                "invalid arg 'x-dead-letter-routing-key': {no_dlx}".into(),
            ));
        }
        Ok(a)
    }

    /// The first argument whose value differs from `current`, as (arg, received, current).
    pub fn inequivalence(&self, current: &QueueArgs) -> Option<(&'static str, String, String)> {
        macro_rules! cmp {
            ($field:ident, $name:literal) => {
                if self.$field != current.$field {
                    return Some((
                        $name,
                        format!("{:?}", self.$field),
                        format!("{:?}", current.$field),
                    ));
                }
            };
        }
        cmp!(message_ttl_ms, "x-message-ttl");
        cmp!(expires_ms, "x-expires");
        cmp!(max_length, "x-max-length");
        cmp!(max_length_bytes, "x-max-length-bytes");
        cmp!(overflow, "x-overflow");
        cmp!(dead_letter_exchange, "x-dead-letter-exchange");
        cmp!(dead_letter_routing_key, "x-dead-letter-routing-key");
        cmp!(max_priority, "x-max-priority");
        cmp!(single_active_consumer, "x-single-active-consumer");
        None
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

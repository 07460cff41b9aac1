//! RabbitMQ's argument equivalence for a redeclare (`rabbit_misc:assert_args_equivalence`):
//! the raw field values of a fixed list of keys are compared, not the parsed settings, so
//! an argument given once must be given again, and the texts name field types as
//! RabbitMQ's codec does (`signedint`, `longstr`, ...).

use amq_protocol::types::{AMQPValue, FieldTable};

/// A field value's type as RabbitMQ names it.
pub fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

/// RabbitMQ's integer argument types (`?INTEGER_ARG_TYPES`): the value, when `v` is one.
pub fn integer(v: &AMQPValue) -> Option<i128> {
    Some(match v {
        AMQPValue::ShortShortInt(x) => *x as i128,
        AMQPValue::ShortShortUInt(x) => *x as i128,
        AMQPValue::ShortInt(x) => *x as i128,
        AMQPValue::ShortUInt(x) => *x as i128,
        AMQPValue::LongInt(x) => *x as i128,
        AMQPValue::LongUInt(x) => *x as i128,
        AMQPValue::LongLongInt(x) => *x as i128,
        _ => return None,
    })
}

/// `rabbit_misc:type_class`: integers of any width compare as one class.
fn class(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Float(_) | AMQPValue::Double(_) => "float",
        _ if integer(v).is_some() || matches!(v, AMQPValue::DecimalValue(_)) => "int",
        _ => type_name(v),
    }
}

/// The value as Erlang's `~s` (strings) or `~p` (the rest) prints it.
pub fn plain(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::Float(f) => f.to_string(),
        AMQPValue::Double(f) => f.to_string(),
        AMQPValue::Timestamp(t) => t.to_string(),
        _ => match integer(v) {
            Some(n) => n.to_string(),
            None => format!("{v:?}"),
        },
    }
}

fn same(a: &AMQPValue, b: &AMQPValue) -> bool {
    if class(a) != class(b) {
        return false;
    }
    match (integer(a), integer(b)) {
        (Some(x), Some(y)) => x == y,
        _ => plain(a) == plain(b) && type_name(a) == type_name(b),
    }
}

/// The first of `keys` whose value in `received` is not equivalent to the one in
/// `current`, as (key, received, current) in RabbitMQ's words (`rabbit_misc:val/1`).
pub fn first_difference(
    keys: &[&'static str],
    received: &FieldTable,
    current: &FieldTable,
) -> Option<(&'static str, String, String)> {
    let whole = |v: Option<&AMQPValue>| match v {
        None => "none".to_string(),
        Some(v) => format!("the value '{}' of type '{}'", plain(v), type_name(v)),
    };
    for &key in keys {
        let (r, c) = (received.inner().get(key), current.inner().get(key));
        match (r, c) {
            (None, None) => {}
            (Some(r), Some(c)) if same(r, c) => {}
            (Some(r), Some(c)) => {
                return Some((key, format!("'{}'", plain(r)), format!("'{}'", plain(c))))
            }
            (r, c) => return Some((key, whole(r), whole(c))),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn integers_of_any_width_are_equivalent_and_the_texts_are_rabbitmqs() {
        let keys = ["x-message-ttl", "x-queue-mode"];
        let int = |n| AMQPValue::LongInt(n);
        assert_eq!(
            first_difference(
                &keys,
                &t(&[("x-message-ttl", AMQPValue::LongLongInt(5))]),
                &t(&[("x-message-ttl", int(5))])
            ),
            None
        );
        assert_eq!(
            first_difference(
                &keys,
                &t(&[("x-message-ttl", int(2000))]),
                &t(&[("x-message-ttl", int(1000))])
            ),
            Some(("x-message-ttl", "'2000'".into(), "'1000'".into()))
        );
        assert_eq!(
            first_difference(
                &keys,
                &t(&[]),
                &t(&[("x-queue-mode", AMQPValue::LongString("lazy".into()))])
            ),
            Some((
                "x-queue-mode",
                "none".into(),
                "the value 'lazy' of type 'longstr'".into()
            ))
        );
        // Keys outside the list are not compared.
        assert_eq!(
            first_difference(&keys, &t(&[("x-foo", int(1))]), &t(&[])),
            None
        );
    }
}

//! RabbitMQ's vhost and user limits: `max-connections` and `max-queues` per vhost (the
//! runtime parameter `vhost-limits`), `max-connections` and `max-channels` per user (the
//! `limits` of an internal user).
//!
//! A limit is a signed integer as RabbitMQ keeps it: a negative value means no limit, `0`
//! allows none. Limits are metadata, set and cleared by [`super::Command::SetLimits`] and
//! [`super::Command::ClearLimits`], so every node of a cluster enforces the same values.
//! Texts of refusals follow `rabbit_parameter_validation` and the reader, channel and queue
//! code of RabbitMQ 3.10.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::MetaError;

/// One object's limits by name (`max-connections` ...). Empty: no limits.
pub type Limits = BTreeMap<String, i64>;

/// `max-connections`, of a vhost or of a user.
pub const MAX_CONNECTIONS: &str = "max-connections";
/// `max-queues`, of a vhost.
pub const MAX_QUEUES: &str = "max-queues";
/// `max-channels`, of a user (across all of the user's connections).
pub const MAX_CHANNELS: &str = "max-channels";

/// What a set of limits belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LimitScope {
    /// A vhost, by name.
    Vhost(String),
    /// A user, by name.
    User(String),
}

impl LimitScope {
    /// The limit names RabbitMQ accepts for this kind of object.
    pub fn known(&self) -> &'static [&'static str] {
        match self {
            LimitScope::Vhost(_) => &[MAX_CONNECTIONS, MAX_QUEUES],
            LimitScope::User(_) => &[MAX_CONNECTIONS, MAX_CHANNELS],
        }
    }

    /// Refuses limit names this kind of object does not have, as
    /// `rabbit_parameter_validation:proplist` does.
    pub fn validate(&self, limits: &Limits) -> Result<(), MetaError> {
        let unknown: Vec<String> = limits
            .iter()
            .filter(|(name, _)| !self.known().contains(&name.as_str()))
            .map(|(name, value)| format!("{{<<\"{name}\">>,{value}}}"))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let what = match self {
            LimitScope::Vhost(_) => "limits",
            LimitScope::User(_) => "user-limits",
        };
        Err(MetaError::Invalid(format!(
            "Unrecognised terms [{}] in {what}",
            unknown.join(",")
        )))
    }
}

/// The limit `name` in `limits` when it limits anything: a value of 0 or more (a negative
/// value means no limit, as RabbitMQ's `get_limit`).
pub fn effective(limits: Option<&Limits>, name: &str) -> Option<u64> {
    limits
        .and_then(|l| l.get(name))
        .and_then(|&v| u64::try_from(v).ok())
}

/// Whether `count` objects already reach `limit` (so one more is refused); with limit 0
/// nothing is allowed.
pub fn reached(limit: Option<u64>, count: usize) -> Option<u64> {
    limit.filter(|&l| count as u64 >= l)
}

/// Parses a JSON object of limits (`set_vhost_limits '{"max-connections": 10}'`, the
/// `value` of a `vhost-limits` parameter, a user's `limits`): every value an integer.
pub fn parse_json(value: &serde_json::Value) -> Result<Limits, String> {
    let serde_json::Value::Object(o) = value else {
        return Err(format!("limits must be a JSON object, not {value}"));
    };
    o.iter()
        .map(|(name, v)| match v.as_i64() {
            Some(n) => Ok((name.clone(), n)),
            None => Err(format!("{name} should be a number, actually was {v}")),
        })
        .collect()
}

/// Limits as a JSON object, RabbitMQ's `value`.
pub fn to_json(limits: &Limits) -> serde_json::Value {
    serde_json::Value::Object(
        limits
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_values_do_not_limit_and_zero_allows_none() {
        let l = Limits::from([(MAX_QUEUES.to_string(), -1), (MAX_CONNECTIONS.into(), 0)]);
        assert_eq!(effective(Some(&l), MAX_QUEUES), None);
        assert_eq!(effective(Some(&l), MAX_CONNECTIONS), Some(0));
        assert_eq!(reached(Some(0), 0), Some(0));
        assert_eq!(reached(Some(2), 1), None);
        assert_eq!(reached(Some(2), 2), Some(2));
        assert_eq!(reached(None, 1000), None);
    }

    #[test]
    fn unknown_names_are_refused_per_scope() {
        let channels = Limits::from([(MAX_CHANNELS.to_string(), 5)]);
        assert!(LimitScope::User("u".into()).validate(&channels).is_ok());
        let err = LimitScope::Vhost("v".into())
            .validate(&channels)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Unrecognised terms [{<<\"max-channels\">>,5}] in limits"
        );
    }

    #[test]
    fn json_values_must_be_integers() {
        let ok = parse_json(&serde_json::json!({"max-queues": 3})).unwrap();
        assert_eq!(ok[MAX_QUEUES], 3);
        assert!(parse_json(&serde_json::json!({"max-queues": "3"})).is_err());
        assert!(parse_json(&serde_json::json!([1])).is_err());
    }
}

//! Policies and operator policies, as RabbitMQ has them.
//!
//! A policy applies to the queues and/or exchanges of one vhost whose name matches its
//! pattern (an unanchored regex, as RabbitMQ's `re:run`). Of the matching policies the one
//! with the highest priority wins (ties: the greatest name, so the choice never depends on
//! insertion order). Operator policies are chosen the same way and then merged: for the
//! numeric limits they may set, the lower of the two values applies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::MetaError;

/// A value in a policy definition (RabbitMQ's are JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyValue {
    /// A number.
    Int(i64),
    /// A string.
    Str(String),
    /// A boolean.
    Bool(bool),
    /// A list (e.g. `ha-params` for `ha-mode: nodes`).
    List(Vec<PolicyValue>),
}

/// What a policy applies to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApplyTo {
    /// Queues only.
    Queues,
    /// Exchanges only.
    Exchanges,
    /// Both.
    All,
}

impl ApplyTo {
    /// Parses RabbitMQ's `--apply-to` values.
    pub fn parse(s: &str) -> Option<ApplyTo> {
        Some(match s {
            "queues" => ApplyTo::Queues,
            "exchanges" => ApplyTo::Exchanges,
            "all" => ApplyTo::All,
            _ => return None,
        })
    }

    fn covers(self, queue: bool) -> bool {
        matches!(
            (self, queue),
            (ApplyTo::All, _) | (ApplyTo::Queues, true) | (ApplyTo::Exchanges, false)
        )
    }
}

/// A policy or operator policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Regex over resource names.
    pub pattern: String,
    /// Queues, exchanges or both.
    pub apply_to: ApplyTo,
    /// Higher wins.
    pub priority: i64,
    /// Keys and values.
    pub definition: BTreeMap<String, PolicyValue>,
    /// `pattern` compiled on first use: every declare, policy change and listing matches
    /// each policy against names, and compiling per match made a policy change over a few
    /// hundred queues take seconds.
    #[serde(skip)]
    pub compiled: CompiledPattern,
}

/// A policy's pattern, compiled once (`None`: it does not compile, and matches nothing).
/// Not part of the policy's value: equal policies may differ in whether it is filled yet.
#[derive(Clone, Default)]
pub struct CompiledPattern(std::sync::OnceLock<Option<regex::Regex>>);

impl PartialEq for CompiledPattern {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for CompiledPattern {}

impl std::fmt::Debug for CompiledPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledPattern")
    }
}

/// Keys whose lower value wins when a policy and an operator policy (or a queue argument)
/// both set them.
pub const LIMIT_KEYS: &[&str] = &["expires", "message-ttl", "max-length", "max-length-bytes"];

/// The HA keys that need `ha-mode` beside them.
const HA_KEYS: &[&str] = &[
    "ha-params",
    "ha-sync-mode",
    "ha-sync-batch-size",
    "ha-promote-on-shutdown",
    "ha-promote-on-failure",
];

fn invalid(msg: String) -> MetaError {
    MetaError::Invalid(format!("Validation failed: {msg}"))
}

fn one_of(key: &str, v: &PolicyValue, allowed: &[&str]) -> Result<(), MetaError> {
    match v {
        PolicyValue::Str(s) if allowed.contains(&s.as_str()) => Ok(()),
        _ => Err(invalid(format!(
            "{v:?} is not a valid {key} (one of {allowed:?})"
        ))),
    }
}

fn non_negative(key: &str, v: &PolicyValue, min: i64) -> Result<(), MetaError> {
    match v {
        PolicyValue::Int(n) if *n >= min => Ok(()),
        _ => Err(invalid(format!(
            "{v:?} is not a valid {key} (an integer >= {min})"
        ))),
    }
}

impl Policy {
    /// Validates the pattern and every definition key (unknown keys are refused, as in
    /// RabbitMQ). `operator` policies may only set limits.
    pub fn validate(&self, operator: bool) -> Result<(), MetaError> {
        regex::Regex::new(&self.pattern)
            .map_err(|e| invalid(format!("pattern '{}': {e}", self.pattern)))?;
        if self.definition.is_empty() {
            return Err(invalid("the definition is empty".into()));
        }
        for (key, v) in &self.definition {
            if operator && !LIMIT_KEYS.contains(&key.as_str()) {
                return Err(invalid(format!(
                    "'{key}' is not allowed in an operator policy"
                )));
            }
            match key.as_str() {
                "expires" => non_negative(key, v, 1)?,
                "message-ttl" | "max-length" | "max-length-bytes" => non_negative(key, v, 0)?,
                "ha-sync-batch-size" => non_negative(key, v, 1)?,
                "overflow" => one_of(
                    key,
                    v,
                    &["drop-head", "reject-publish", "reject-publish-dlx"],
                )?,
                "queue-mode" => one_of(key, v, &["default", "lazy"])?,
                "ha-mode" => one_of(key, v, &["all", "exactly", "nodes"])?,
                "ha-sync-mode" => one_of(key, v, &["manual", "automatic"])?,
                "ha-promote-on-shutdown" | "ha-promote-on-failure" => {
                    one_of(key, v, &["always", "when-synced"])?
                }
                "queue-master-locator" => {
                    one_of(key, v, &["client-local", "min-masters", "random"])?
                }
                "dead-letter-exchange" | "dead-letter-routing-key" | "alternate-exchange" => {
                    if !matches!(v, PolicyValue::Str(_)) {
                        return Err(invalid(format!("{key} must be a string")));
                    }
                }
                "ha-params" => {}
                other => return Err(invalid(format!("'{other}' is not a recognised policy key"))),
            }
        }
        match (
            self.definition.get("ha-mode"),
            self.definition.get("ha-params"),
        ) {
            (Some(PolicyValue::Str(m)), p) if m == "exactly" => match p {
                Some(PolicyValue::Int(n)) if *n >= 1 => {}
                _ => {
                    return Err(invalid(
                        "ha-mode exactly needs ha-params, an integer >= 1".into(),
                    ))
                }
            },
            (Some(PolicyValue::Str(m)), p) if m == "nodes" => match p {
                Some(PolicyValue::List(l))
                    if !l.is_empty() && l.iter().all(|x| matches!(x, PolicyValue::Str(_))) => {}
                _ => {
                    return Err(invalid(
                        "ha-mode nodes needs ha-params, a list of node names".into(),
                    ))
                }
            },
            (Some(_), Some(_)) => return Err(invalid("ha-mode all takes no ha-params".into())),
            _ => {}
        }
        // RabbitMQ's `rabbit_mirror_queue_misc:validate_policy`: the other HA keys only
        // beside `ha-mode`.
        if !self.definition.contains_key("ha-mode") {
            if let Some(key) = HA_KEYS.iter().find(|k| self.definition.contains_key(**k)) {
                return Err(invalid(format!(
                    "ha-mode must be specified to specify {key}"
                )));
            }
        }
        Ok(())
    }

    fn matches(&self, name: &str, queue: bool) -> bool {
        // Validated at set time; a pattern that no longer compiles matches nothing.
        self.apply_to.covers(queue)
            && self
                .compiled
                .0
                .get_or_init(|| regex::Regex::new(&self.pattern).ok())
                .as_ref()
                .is_some_and(|r| r.is_match(name))
    }
}

/// The policy a resource ends up with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Effective {
    /// The winning policy's name.
    pub policy: Option<String>,
    /// The winning operator policy's name.
    pub operator_policy: Option<String>,
    /// The merged definition.
    pub definition: BTreeMap<String, PolicyValue>,
}

impl Effective {
    /// An integer key.
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.definition.get(key) {
            Some(PolicyValue::Int(n)) => Some(*n),
            _ => None,
        }
    }

    /// A string key.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.definition.get(key) {
            Some(PolicyValue::Str(s)) => Some(s),
            _ => None,
        }
    }
}

fn winner<'a>(
    policies: &'a BTreeMap<String, Policy>,
    name: &str,
    queue: bool,
) -> Option<&'a Policy> {
    policies
        .values()
        .filter(|p| p.matches(name, queue))
        .max_by(|a, b| (a.priority, &a.name).cmp(&(b.priority, &b.name)))
}

/// The effective policy of the queue (or exchange) `name`.
pub fn effective(
    policies: &BTreeMap<String, Policy>,
    operator_policies: &BTreeMap<String, Policy>,
    name: &str,
    queue: bool,
) -> Effective {
    let mut e = Effective::default();
    if let Some(p) = winner(policies, name, queue) {
        e.policy = Some(p.name.clone());
        e.definition = p.definition.clone();
    }
    if let Some(op) = winner(operator_policies, name, queue) {
        e.operator_policy = Some(op.name.clone());
        for (k, v) in &op.definition {
            let lower = match (e.definition.get(k), v) {
                (Some(PolicyValue::Int(a)), PolicyValue::Int(b)) => PolicyValue::Int(*a.min(b)),
                _ => v.clone(),
            };
            e.definition.insert(k.clone(), lower);
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, pattern: &str, priority: i64, defs: &[(&str, PolicyValue)]) -> Policy {
        Policy {
            vhost: "/".into(),
            name: name.into(),
            pattern: pattern.into(),
            compiled: Default::default(),
            apply_to: ApplyTo::Queues,
            priority,
            definition: defs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }

    fn map(ps: Vec<Policy>) -> BTreeMap<String, Policy> {
        ps.into_iter().map(|p| (p.name.clone(), p)).collect()
    }

    #[test]
    fn highest_priority_matching_policy_wins() {
        let ps = map(vec![
            policy("low", "^ha\\.", 0, &[("max-length", PolicyValue::Int(10))]),
            policy("high", "^ha\\.", 5, &[("max-length", PolicyValue::Int(20))]),
            policy("other", "^zz", 9, &[("max-length", PolicyValue::Int(30))]),
        ]);
        let e = effective(&ps, &BTreeMap::new(), "ha.one", true);
        assert_eq!(e.policy.as_deref(), Some("high"));
        assert_eq!(e.int("max-length"), Some(20));
        assert_eq!(
            effective(&ps, &BTreeMap::new(), "ha.one", false).policy,
            None,
            "queues only"
        );
        assert_eq!(effective(&ps, &BTreeMap::new(), "plain", true).policy, None);
    }

    #[test]
    fn operator_policy_limits_take_the_lower_value() {
        let ps = map(vec![policy(
            "p",
            ".*",
            0,
            &[
                ("max-length", PolicyValue::Int(100)),
                ("message-ttl", PolicyValue::Int(5)),
            ],
        )]);
        let ops = map(vec![policy(
            "cap",
            ".*",
            0,
            &[
                ("max-length", PolicyValue::Int(50)),
                ("message-ttl", PolicyValue::Int(60)),
            ],
        )]);
        let e = effective(&ps, &ops, "q", true);
        assert_eq!(
            (e.int("max-length"), e.int("message-ttl")),
            (Some(50), Some(5))
        );
        assert_eq!(e.operator_policy.as_deref(), Some("cap"));
    }

    #[test]
    fn validation_follows_rabbitmq() {
        let ok = policy(
            "ha",
            ".*",
            0,
            &[
                ("ha-mode", PolicyValue::Str("exactly".into())),
                ("ha-params", PolicyValue::Int(2)),
                ("ha-sync-mode", PolicyValue::Str("automatic".into())),
            ],
        );
        ok.validate(false).unwrap();
        for bad in [
            policy("x", ".*", 0, &[("no-such-key", PolicyValue::Int(1))]),
            policy(
                "x",
                ".*",
                0,
                &[("ha-mode", PolicyValue::Str("exactly".into()))],
            ),
            policy(
                "x",
                ".*",
                0,
                &[
                    ("ha-mode", PolicyValue::Str("nodes".into())),
                    ("ha-params", PolicyValue::Int(2)),
                ],
            ),
            policy("x", ".*", 0, &[("max-length", PolicyValue::Int(-1))]),
            policy("x", "(", 0, &[("max-length", PolicyValue::Int(1))]),
            policy("x", ".*", 0, &[]),
            policy("x", ".*", 0, &[("ha-params", PolicyValue::Int(2))]),
            policy(
                "x",
                ".*",
                0,
                &[("ha-sync-mode", PolicyValue::Str("automatic".into()))],
            ),
            policy("x", ".*", 0, &[("ha-sync-batch-size", PolicyValue::Int(5))]),
            policy(
                "x",
                ".*",
                0,
                &[("ha-promote-on-failure", PolicyValue::Str("always".into()))],
            ),
        ] {
            assert!(bad.validate(false).is_err(), "{bad:?}");
        }
        assert!(
            ok.validate(true).is_err(),
            "operator policies may only set limits"
        );
    }
}

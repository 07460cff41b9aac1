//! Routing: which queues a message published to an exchange reaches.
//!
//! Direct, fanout, topic and headers matching, exchange-to-exchange bindings (followed with a
//! visited set so cycles terminate), alternate exchanges for unroutable messages (argument
//! or policy), and RabbitMQ's sender-selected distribution: the `CC` and `BCC` headers'
//! routing keys are routed too ([`sender_selected_keys`]).

use std::collections::BTreeSet;

use amq_protocol::types::{AMQPValue, FieldTable};

use crate::meta::{Binding, Destination, ExchangeKind, Vhost};

/// The headers whose routing keys a publisher adds (`BCC`'s are removed before delivery).
pub const SENDER_SELECTED: [&str; 2] = ["CC", "BCC"];

/// The extra routing keys of the `CC` and `BCC` headers: arrays of long strings (other
/// elements are skipped, as RabbitMQ does). A header of another type is an error naming it
/// and its RabbitMQ type, as RabbitMQ's `{unacceptable_type_in_header, Header, Type}`.
pub fn sender_selected_keys(
    headers: Option<&FieldTable>,
) -> Result<Vec<String>, (&'static str, &'static str)> {
    let mut keys = Vec::new();
    for name in SENDER_SELECTED {
        keys.extend(header_keys(headers, name)?);
    }
    Ok(keys)
}

/// The routing keys of one sender-selected header.
pub fn header_keys(
    headers: Option<&FieldTable>,
    name: &'static str,
) -> Result<Vec<String>, (&'static str, &'static str)> {
    match headers.and_then(|h| h.inner().get(name)) {
        None => Ok(Vec::new()),
        Some(AMQPValue::FieldArray(a)) => Ok(a
            .as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::LongString(s) => {
                    Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                _ => None,
            })
            .collect()),
        Some(other) => Err((name, crate::meta::equivalence::type_name(other))),
    }
}

/// Routes a message; returns the destination queue names, sorted and without duplicates.
///
/// The default exchange (`""`) routes to the queue named by the routing key. The `CC` and
/// `BCC` headers' keys are routed as well (checked by the publisher's channel first; a
/// header of the wrong type adds nothing here), and `extra` (the keys of a `BCC` header the
/// channel removed from the message).
pub fn route(
    vhost: &Vhost,
    exchange: &str,
    routing_key: &str,
    headers: Option<&FieldTable>,
    extra: &[String],
) -> Vec<String> {
    // The default exchange binds every queue by its name: with no other keys, a queue
    // of that name is the whole answer (the walk below gives the same, with a dozen
    // allocations per message).
    if exchange.is_empty()
        && extra.is_empty()
        && vhost.queues.contains_key(routing_key)
        && sender_selected_keys(headers).is_ok_and(|k| k.is_empty())
    {
        return vec![routing_key.to_string()];
    }
    route_walk(vhost, exchange, routing_key, headers, extra)
}

/// Routes by walking the exchange graph from `exchange` for every key, then the
/// alternate-exchange chain.
fn route_walk(
    vhost: &Vhost,
    exchange: &str,
    routing_key: &str,
    headers: Option<&FieldTable>,
    extra: &[String],
) -> Vec<String> {
    let mut keys = vec![routing_key.to_string()];
    keys.extend(sender_selected_keys(headers).unwrap_or_default());
    keys.extend(extra.iter().cloned());
    let mut queues = BTreeSet::new();
    let mut visited = BTreeSet::new();
    let mut current = Some(exchange.to_string());
    // Alternate exchanges chain: an exchange that routes nowhere hands the message to its AE.
    while let Some(name) = current.take() {
        // Each key walks the exchange graph from here afresh (a walk's visited set stops
        // its cycles); the alternate-exchange chain then skips what any walk visited.
        let before = visited.clone();
        for key in &keys {
            let mut walked = before.clone();
            route_from(vhost, &name, key, headers, &mut queues, &mut walked);
            visited.extend(walked);
        }
        if !queues.is_empty() {
            break;
        }
        // The argument wins over a policy's `alternate-exchange`, as in RabbitMQ.
        current = vhost
            .exchanges
            .get(&name)
            .and_then(|e| {
                e.alternate_exchange().or_else(|| {
                    vhost
                        .effective_policy(&name, false)
                        .str("alternate-exchange")
                        .map(String::from)
                })
            })
            .filter(|ae| !visited.contains(ae) && vhost.exchanges.contains_key(ae));
    }
    queues.into_iter().collect()
}

fn route_from(
    vhost: &Vhost,
    exchange: &str,
    routing_key: &str,
    headers: Option<&FieldTable>,
    queues: &mut BTreeSet<String>,
    visited: &mut BTreeSet<String>,
) {
    let mut pending = vec![exchange.to_string()];
    while let Some(name) = pending.pop() {
        if !visited.insert(name.clone()) {
            continue;
        }
        if name.is_empty() {
            if vhost.queues.contains_key(routing_key) {
                queues.insert(routing_key.to_string());
            }
            continue;
        }
        let Some(def) = vhost.exchanges.get(&name) else {
            continue;
        };
        for b in vhost.bindings_from(&name) {
            if matches(def.kind, b, routing_key, headers) {
                match &b.destination {
                    Destination::Queue(q) => {
                        queues.insert(q.clone());
                    }
                    Destination::Exchange(e) => pending.push(e.clone()),
                }
            }
        }
    }
}

fn matches(
    kind: ExchangeKind,
    b: &Binding,
    routing_key: &str,
    headers: Option<&FieldTable>,
) -> bool {
    match kind {
        ExchangeKind::Direct => b.routing_key == routing_key,
        ExchangeKind::Fanout => true,
        ExchangeKind::Topic => topic_matches(&b.routing_key, routing_key),
        ExchangeKind::Headers => headers_match(&b.arguments, headers),
    }
}

/// AMQP topic matching: words split on `.`, `*` matches one word, `#` zero or more.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    topic_words(&words(pattern), &words(key))
}

/// The words of a key or pattern; the empty string has none (so `*` does not match it).
fn words(s: &str) -> Vec<&str> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('.').collect()
    }
}

fn topic_words(p: &[&str], k: &[&str]) -> bool {
    match p.first() {
        None => k.is_empty(),
        Some(&"#") => {
            // `#` absorbs zero or more words; collapse repeated `#`s first.
            let rest = &p[1..];
            (0..=k.len()).any(|i| topic_words(rest, &k[i..]))
        }
        Some(&"*") => !k.is_empty() && topic_words(&p[1..], &k[1..]),
        Some(w) => k.first() == Some(w) && topic_words(&p[1..], &k[1..]),
    }
}

/// Headers-exchange matching with RabbitMQ's `x-match` values: `all` (default), `any`,
/// `all-with-x`, `any-with-x`. Binding arguments whose value is void match on presence.
pub fn headers_match(binding_args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let args = binding_args.inner();
    let mode = match args.get("x-match") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.to_string(),
        _ => "all".to_string(),
    };
    let (any, with_x) = match mode.as_str() {
        "any" => (true, false),
        "any-with-x" => (true, true),
        "all-with-x" => (false, true),
        _ => (false, false),
    };
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty).inner();
    let mut considered = 0;
    let mut matched = 0;
    for (k, v) in args {
        if k.as_str() == "x-match" || (!with_x && k.as_str().starts_with("x-")) {
            continue;
        }
        considered += 1;
        let ok = match (v, headers.get(k.as_str())) {
            (AMQPValue::Void, Some(_)) => true,
            (v, Some(h)) => values_equal(v, h),
            (_, None) => false,
        };
        if ok {
            matched += 1;
            if any {
                return true;
            }
        } else if !any {
            return false;
        }
    }
    if any {
        matched > 0
    } else {
        considered == matched
    }
}

fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    // Clients encode the same string as short or long string, and integers at any width.
    match (crate::meta::args::string(a), crate::meta::args::string(b)) {
        (Some(x), Some(y)) => return x == y,
        (Some(_), None) | (None, Some(_)) => return false,
        _ => {}
    }
    match (as_int(a), as_int(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn as_int(v: &AMQPValue) -> Option<i128> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn topic_patterns() {
        assert!(topic_matches("a.*.c", "a.b.c"));
        assert!(!topic_matches("a.*.c", "a.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#", "a.b.c"));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#.c", "a.b.c"));
        assert!(!topic_matches("a.b", "a.b.c"));
        assert!(topic_matches("*.#.*", "a.b"));
        assert!(!topic_matches("*.#.*", "a"));
        assert!(!topic_matches("*", ""));
        assert!(topic_matches("#", ""));
    }

    /// An independent oracle: a bottom-up dynamic programme over (pattern word, key word).
    fn oracle(pattern: &str, key: &str) -> bool {
        let p: Vec<&str> = pattern.split('.').collect();
        let k: Vec<&str> = key.split('.').collect();
        // m[i][j]: p[i..] matches k[j..]
        let mut m = vec![vec![false; k.len() + 1]; p.len() + 1];
        m[p.len()][k.len()] = true;
        for i in (0..p.len()).rev() {
            for j in (0..=k.len()).rev() {
                m[i][j] = match p[i] {
                    "#" => m[i + 1][j] || (j < k.len() && m[i][j + 1]),
                    "*" => j < k.len() && m[i + 1][j + 1],
                    w => j < k.len() && k[j] == w && m[i + 1][j + 1],
                };
            }
        }
        m[0][0]
    }

    proptest! {
        #[test]
        fn topic_matching_agrees_with_a_dp_oracle(
            pattern in prop::collection::vec(prop_oneof!["a", "b", "\\*", "#"], 1..5),
            key in prop::collection::vec(prop_oneof!["a", "b", "c"], 1..5),
        ) {
            let pattern = pattern.join(".");
            let key = key.join(".");
            prop_assert_eq!(topic_matches(&pattern, &key), oracle(&pattern, &key), "{} vs {}", pattern, key);
        }
    }

    #[test]
    fn headers_all_and_any() {
        let mut args = FieldTable::default();
        args.insert("a".into(), AMQPValue::LongString("1".into()));
        args.insert("b".into(), AMQPValue::LongInt(2));
        let mut h = FieldTable::default();
        h.insert("a".into(), AMQPValue::ShortString("1".into()));
        assert!(!headers_match(&args, Some(&h)));
        h.insert("b".into(), AMQPValue::LongLongInt(2));
        assert!(headers_match(&args, Some(&h)));
        args.insert("x-match".into(), AMQPValue::LongString("any".into()));
        let mut h2 = FieldTable::default();
        h2.insert("b".into(), AMQPValue::ShortShortInt(2));
        assert!(headers_match(&args, Some(&h2)));
        assert!(!headers_match(&args, None));
    }
}

#[cfg(test)]
mod sender_selected_tests {
    use super::*;
    use amq_protocol::types::{FieldArray, LongString};

    fn array(keys: &[&str]) -> AMQPValue {
        let mut a = FieldArray::default();
        for k in keys {
            a.push(AMQPValue::LongString(LongString::from(
                k.as_bytes().to_vec(),
            )));
        }
        AMQPValue::FieldArray(a)
    }

    #[test]
    fn cc_and_bcc_arrays_give_their_keys_and_other_types_are_named() {
        let mut h = FieldTable::default();
        h.insert("CC".into(), array(&["b", "c"]));
        h.insert("BCC".into(), array(&["d"]));
        assert_eq!(sender_selected_keys(Some(&h)).unwrap(), ["b", "c", "d"]);
        assert_eq!(header_keys(Some(&h), "BCC").unwrap(), ["d"]);
        assert!(sender_selected_keys(None).unwrap().is_empty());
        let mut bad = FieldTable::default();
        bad.insert("CC".into(), AMQPValue::LongString("b".into()));
        assert_eq!(sender_selected_keys(Some(&bad)), Err(("CC", "longstr")));
    }
}

#[cfg(test)]
mod alternate_exchange_tests {
    use super::*;
    use crate::meta::policy::{ApplyTo, Policy, PolicyValue};
    use crate::meta::{Command, ExchangeDef, MetaState, QueueDef};

    fn exchange(name: &str, kind: ExchangeKind, ae: Option<&str>) -> Command {
        let mut arguments = FieldTable::default();
        if let Some(ae) = ae {
            arguments.insert(
                "alternate-exchange".into(),
                AMQPValue::LongString(ae.into()),
            );
        }
        Command::DeclareExchange(ExchangeDef {
            vhost: "/".into(),
            name: name.into(),
            kind,
            durable: false,
            auto_delete: false,
            internal: false,
            arguments,
        })
    }

    /// `x` (direct, no bindings), fanouts `ae1` -> `q1` and `ae2` -> `q2`, and a policy
    /// naming `ae1` for exchanges matching `^x`.
    fn state(argument: Option<&str>) -> MetaState {
        let mut s = MetaState::default();
        let mut cmds = vec![
            Command::AddVhost { name: "/".into() },
            exchange("x", ExchangeKind::Direct, argument),
            exchange("ae1", ExchangeKind::Fanout, None),
            exchange("ae2", ExchangeKind::Fanout, None),
        ];
        for (q, x) in [("q1", "ae1"), ("q2", "ae2")] {
            cmds.push(Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: q.into(),
                durable: false,
                exclusive_owner: None,
                auto_delete: false,
                arguments: FieldTable::default(),
                home: 0,
            }));
            cmds.push(Command::Bind(crate::meta::Binding {
                vhost: "/".into(),
                source: x.into(),
                destination: Destination::Queue(q.into()),
                routing_key: String::new(),
                arguments: FieldTable::default(),
            }));
        }
        cmds.push(Command::SetPolicy {
            policy: Policy {
                vhost: "/".into(),
                name: "ae".into(),
                pattern: "^x".into(),
                compiled: Default::default(),
                apply_to: ApplyTo::Exchanges,
                priority: 0,
                definition: [(
                    "alternate-exchange".to_string(),
                    PolicyValue::Str("ae1".into()),
                )]
                .into(),
            },
            operator: false,
        });
        for c in cmds {
            s.apply(&c).unwrap();
        }
        s
    }

    /// The default exchange's short cut routes as the walk does: queues `q1` and `q2`
    /// exist, keys may name them or not, and CC and extra (BCC) keys may add others.
    #[test]
    fn the_default_exchange_routes_as_the_walk_does() {
        let s = state(None);
        let v = s.vhost("/").unwrap();
        let keys = ["q1", "q2", "q3", ""];
        for key in keys {
            for cc in [None, Some("q2"), Some("q3")] {
                for extra in [&[][..], &["q2".to_string()][..]] {
                    let headers = cc.map(|k| {
                        let mut h = FieldTable::default();
                        h.insert(
                            "CC".into(),
                            AMQPValue::FieldArray(vec![AMQPValue::LongString(k.into())].into()),
                        );
                        h
                    });
                    assert_eq!(
                        route(v, "", key, headers.as_ref(), extra),
                        route_walk(v, "", key, headers.as_ref(), extra),
                        "key {key:?} cc {cc:?} extra {extra:?}"
                    );
                }
            }
        }
        assert_eq!(route(v, "", "q1", None, &[]), ["q1"]);
        assert!(route(v, "", "q3", None, &[]).is_empty());
    }

    #[test]
    fn a_policy_names_the_alternate_exchange_and_the_argument_wins_over_it() {
        let s = state(None);
        let v = s.vhost("/").unwrap();
        assert_eq!(route(v, "x", "nowhere", None, &[]), ["q1"]);
        // The policy does not match ae1, which routes as the fanout it is.
        assert_eq!(route(v, "ae1", "k", None, &[]), ["q1"]);
        let s = state(Some("ae2"));
        assert_eq!(
            route(s.vhost("/").unwrap(), "x", "nowhere", None, &[]),
            ["q2"]
        );
    }
}

//! The `ha-*` keys of a queue's effective policy.
//!
//! Validation (types, allowed values, `ha-params` matching `ha-mode`) happens when a policy
//! is set (`meta::policy`); this reads an effective definition into an [`HaPolicy`].
//!
//! Defaults differ from RabbitMQ's in one place: `ha-promote-on-failure` defaults to
//! `when-synced` (RabbitMQ: `always`). Promoting an unsynchronised mirror after a crash
//! silently loses every message it had not received yet, confirmed ones included; Warren
//! leaves the queue unavailable instead until the old master's node comes back or an operator
//! force-promotes (documented in `docs/clustering.md`).

use super::policy::{Effective, PolicyValue};

/// Where a queue is mirrored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HaMode {
    /// On every running node.
    All,
    /// On this many nodes in all, the master included (at least 1).
    Exactly(usize),
    /// On the nodes with these names.
    Nodes(Vec<String>),
}

/// When a new mirror copies the queue's backlog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Only on `warrenctl sync_queue`.
    Manual,
    /// At once, in the background.
    Automatic,
}

/// Whether an unsynchronised mirror may take over from a master that stopped or failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromoteRule {
    /// Yes (what it lacks is lost).
    Always,
    /// Only a synchronised one; otherwise the queue waits.
    WhenSynced,
}

/// A queue's mirroring policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaPolicy {
    /// `ha-mode` and `ha-params`.
    pub mode: HaMode,
    /// `ha-sync-mode` (default manual, as RabbitMQ).
    pub sync_mode: SyncMode,
    /// `ha-sync-batch-size` (default 4096, as RabbitMQ).
    pub sync_batch_size: u64,
    /// `ha-promote-on-shutdown` (default when-synced, as RabbitMQ).
    pub promote_on_shutdown: PromoteRule,
    /// `ha-promote-on-failure` (default when-synced; RabbitMQ's is always).
    pub promote_on_failure: PromoteRule,
}

/// RabbitMQ's default `ha-sync-batch-size`.
pub const DEFAULT_SYNC_BATCH_SIZE: u64 = 4096;

fn rule(e: &Effective, key: &str) -> PromoteRule {
    match e.str(key) {
        Some("always") => PromoteRule::Always,
        _ => PromoteRule::WhenSynced,
    }
}

impl HaPolicy {
    /// The mirroring policy in `effective`, or `None` when it has no (usable) `ha-mode`.
    /// Exclusive queues are never mirrored: callers pass `exclusive`.
    pub fn of(effective: &Effective, exclusive: bool) -> Option<HaPolicy> {
        if exclusive {
            return None;
        }
        let mode = match (
            effective.str("ha-mode")?,
            effective.definition.get("ha-params"),
        ) {
            ("all", _) => HaMode::All,
            ("exactly", Some(PolicyValue::Int(n))) if *n >= 1 => HaMode::Exactly(*n as usize),
            ("nodes", Some(PolicyValue::List(names))) => HaMode::Nodes(
                names
                    .iter()
                    .filter_map(|v| match v {
                        PolicyValue::Str(s) => Some(s.clone()),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => return None,
        };
        Some(HaPolicy {
            mode,
            sync_mode: match effective.str("ha-sync-mode") {
                Some("automatic") => SyncMode::Automatic,
                _ => SyncMode::Manual,
            },
            sync_batch_size: effective
                .int("ha-sync-batch-size")
                .and_then(|n| u64::try_from(n).ok())
                .filter(|n| *n > 0)
                .unwrap_or(DEFAULT_SYNC_BATCH_SIZE),
            promote_on_shutdown: rule(effective, "ha-promote-on-shutdown"),
            promote_on_failure: rule(effective, "ha-promote-on-failure"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effective(defs: &[(&str, PolicyValue)]) -> Effective {
        Effective {
            policy: Some("p".into()),
            operator_policy: None,
            definition: defs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }

    fn s(v: &str) -> PolicyValue {
        PolicyValue::Str(v.into())
    }

    #[test]
    fn modes_params_and_defaults() {
        let all = HaPolicy::of(&effective(&[("ha-mode", s("all"))]), false).unwrap();
        assert_eq!(all.mode, HaMode::All);
        assert_eq!(all.sync_mode, SyncMode::Manual);
        assert_eq!(all.sync_batch_size, 4096);
        assert_eq!(all.promote_on_shutdown, PromoteRule::WhenSynced);
        assert_eq!(
            all.promote_on_failure,
            PromoteRule::WhenSynced,
            "Warren's default, unlike RabbitMQ's"
        );
        let exactly = HaPolicy::of(
            &effective(&[
                ("ha-mode", s("exactly")),
                ("ha-params", PolicyValue::Int(2)),
                ("ha-sync-mode", s("automatic")),
                ("ha-sync-batch-size", PolicyValue::Int(100)),
                ("ha-promote-on-failure", s("always")),
            ]),
            false,
        )
        .unwrap();
        assert_eq!(exactly.mode, HaMode::Exactly(2));
        assert_eq!(exactly.sync_mode, SyncMode::Automatic);
        assert_eq!(exactly.sync_batch_size, 100);
        assert_eq!(exactly.promote_on_failure, PromoteRule::Always);
        let nodes = HaPolicy::of(
            &effective(&[
                ("ha-mode", s("nodes")),
                ("ha-params", PolicyValue::List(vec![s("n1"), s("n3")])),
            ]),
            false,
        )
        .unwrap();
        assert_eq!(nodes.mode, HaMode::Nodes(vec!["n1".into(), "n3".into()]));
    }

    #[test]
    fn no_mirroring_without_a_usable_mode_or_for_exclusive_queues() {
        assert_eq!(HaPolicy::of(&effective(&[]), false), None);
        assert_eq!(
            HaPolicy::of(&effective(&[("ha-mode", s("exactly"))]), false),
            None
        );
        assert_eq!(
            HaPolicy::of(&effective(&[("ha-mode", s("all"))]), true),
            None,
            "exclusive queues are never mirrored"
        );
    }
}

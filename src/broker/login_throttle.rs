//! Failed logins counted per source address: after `max_failures` failures within one
//! window, logins from that address are refused without looking at their credentials until
//! the window ends. RabbitMQ has no such guard; without it a client can try passwords as
//! fast as the handshake allows.

use std::collections::HashMap;

use crate::time::Instant;

/// Addresses tracked at most; beyond, the oldest windows are dropped (a flood from many
/// addresses must not grow memory without bound).
const MAX_SOURCES: usize = 100_000;

/// The failures of one source address in its current window.
#[derive(Clone, Copy, Debug)]
struct Source {
    window_start: Instant,
    failures: u32,
}

/// The per-address failed-login counts (`[limits] max_failed_logins`,
/// `failed_login_window_ms`).
#[derive(Debug)]
pub struct LoginThrottle {
    max_failures: u32,
    window_ms: u64,
    sources: HashMap<String, Source>,
}

impl LoginThrottle {
    /// At most `max_failures` failed logins per address per `window_ms`; 0 turns it off.
    pub fn new(max_failures: u32, window_ms: u64) -> LoginThrottle {
        LoginThrottle {
            max_failures,
            window_ms,
            sources: HashMap::new(),
        }
    }

    fn expired(&self, s: &Source, now: Instant) -> bool {
        now.millis_since(s.window_start) >= self.window_ms
    }

    /// Whether a login from `source` is refused now, unchecked.
    pub fn is_blocked(&self, source: &str, now: Instant) -> bool {
        self.max_failures > 0
            && self
                .sources
                .get(source)
                .is_some_and(|s| !self.expired(s, now) && s.failures >= self.max_failures)
    }

    /// A login from `source` failed: counted in its window (a new one if the last ended).
    pub fn handle_failure(&mut self, source: &str, now: Instant) {
        if self.max_failures == 0 {
            return;
        }
        if self.sources.len() >= MAX_SOURCES && !self.sources.contains_key(source) {
            let window = self.window_ms;
            self.sources
                .retain(|_, s| now.millis_since(s.window_start) < window);
            if self.sources.len() >= MAX_SOURCES {
                let oldest = self
                    .sources
                    .iter()
                    .min_by_key(|(_, s)| s.window_start)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.sources.remove(&k);
                }
            }
        }
        let window = self.window_ms;
        let s = self.sources.entry(source.to_string()).or_insert(Source {
            window_start: now,
            failures: 0,
        });
        if now.millis_since(s.window_start) >= window {
            *s = Source {
                window_start: now,
                failures: 0,
            };
        }
        s.failures = s.failures.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    #[test]
    fn an_address_is_blocked_after_its_failures_until_the_window_ends() {
        let mut t = LoginThrottle::new(3, 1000);
        for ms in [0, 10, 20] {
            assert!(!t.is_blocked("10.0.0.1", at(ms)));
            t.handle_failure("10.0.0.1", at(ms));
        }
        assert!(t.is_blocked("10.0.0.1", at(30)));
        assert!(!t.is_blocked("10.0.0.2", at(30)), "per address");
        assert!(t.is_blocked("10.0.0.1", at(999)));
        assert!(!t.is_blocked("10.0.0.1", at(1000)), "the window ended");
        // A new window counts from its first failure.
        t.handle_failure("10.0.0.1", at(1000));
        assert!(!t.is_blocked("10.0.0.1", at(1001)));
    }

    #[test]
    fn zero_turns_it_off() {
        let mut t = LoginThrottle::new(0, 1000);
        for ms in 0..100 {
            t.handle_failure("10.0.0.1", at(ms));
        }
        assert!(!t.is_blocked("10.0.0.1", at(100)));
    }

    #[test]
    fn memory_stays_bounded_under_a_flood_of_addresses() {
        let mut t = LoginThrottle::new(2, 60_000);
        for i in 0..(MAX_SOURCES + 10) {
            t.handle_failure(&format!("a{i}"), at(i as u64));
        }
        assert!(t.sources.len() <= MAX_SOURCES);
    }

    proptest::proptest! {
        /// Against a model: blocked exactly when the current window holds `max` failures.
        #[test]
        fn blocked_exactly_at_max_failures_in_a_window(
            max in 1u32..6,
            gaps in proptest::collection::vec(0u64..400, 1..20),
        ) {
            let mut t = LoginThrottle::new(max, 1000);
            let (mut now, mut start, mut count) = (0u64, None::<u64>, 0u32);
            for g in gaps {
                now += g;
                let expired = start.is_none_or(|s| now - s >= 1000);
                proptest::prop_assert_eq!(t.is_blocked("x", at(now)), !expired && count >= max);
                t.handle_failure("x", at(now));
                if expired {
                    start = Some(now);
                    count = 1;
                } else {
                    count += 1;
                }
            }
        }
    }
}

//! The node clock: milliseconds since the node started, on tokio's (virtualisable) clock.
//!
//! A clock may run at a rate of its own against tokio's: the simulation skews each node's
//! clock (`sim/`, the mirror scenario) to test what the master's lease assumes about drift
//! (`docs/mirroring.md`, *Two masters never deliver at once*). A node in production runs at
//! tokio's rate.

use crate::time::Instant;

/// Parts per million of a clock that runs at tokio's rate.
const SAME_RATE_PPM: u64 = 1_000_000;

/// Converts between tokio instants and the cores' [`Instant`].
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: tokio::time::Instant,
    /// Clock time per tokio time, in parts per million.
    rate_ppm: u64,
}

impl Clock {
    /// A clock whose origin is now.
    pub fn start() -> Clock {
        Clock::start_at_rate(SAME_RATE_PPM)
    }

    /// A clock whose origin is now and that advances `rate_ppm` millionths of a millisecond
    /// per millisecond of tokio's clock (at least 1).
    pub fn start_at_rate(rate_ppm: u64) -> Clock {
        Clock {
            origin: tokio::time::Instant::now(),
            rate_ppm: rate_ppm.max(1),
        }
    }

    /// Now.
    pub fn now(&self) -> Instant {
        let elapsed = self.origin.elapsed();
        if self.rate_ppm == SAME_RATE_PPM {
            return Instant::from_millis(elapsed.as_millis() as u64);
        }
        let scaled = elapsed.as_micros() * u128::from(self.rate_ppm) / 1_000_000_000;
        Instant::from_millis(scaled as u64)
    }

    /// The tokio instant for a core instant: the first microsecond at which [`Clock::now`]
    /// reads `t` (rounded up, not down: a timer that woke a microsecond early would find
    /// its deadline not yet reached and sleep until it again at once, without end where
    /// tokio's time stands still, as in the simulation).
    pub fn to_tokio(&self, t: Instant) -> tokio::time::Instant {
        let micros = (u128::from(t.as_millis()) * 1_000 * u128::from(SAME_RATE_PPM))
            .div_ceil(u128::from(self.rate_ppm));
        self.origin + std::time::Duration::from_micros(micros as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_clock_at_tokios_rate_counts_tokios_milliseconds() {
        let clock = Clock::start();
        tokio::time::advance(Duration::from_millis(1_234)).await;
        assert_eq!(clock.now(), Instant::from_millis(1_234));
        assert_eq!(
            clock.to_tokio(Instant::from_millis(500)) + Duration::from_millis(734),
            tokio::time::Instant::now()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_clock_counts_less_and_its_instants_lie_further_out() {
        // 0.6: 1,000 ms of tokio time are 600 ms on this clock, and a lease to 300 ms on
        // it ends 500 ms after the origin in tokio time.
        let clock = Clock::start_at_rate(600_000);
        let origin = tokio::time::Instant::now();
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert_eq!(clock.now(), Instant::from_millis(600));
        assert_eq!(
            clock.to_tokio(Instant::from_millis(300)),
            origin + Duration::from_millis(500)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_tokio_instant_of_a_deadline_the_clock_has_reached_it() {
        // Rates whose conversion is not exact: at `to_tokio(t)` the clock must read `t`,
        // or a driver sleeping until a session's deadline wakes, finds it not due, and
        // sleeps until the same instant again (a spin while tokio's time stands still).
        for rate in [600_000, 612_611, 953_281, 1_000_000, 1_377_001] {
            let clock = Clock::start_at_rate(rate);
            let origin = tokio::time::Instant::now();
            for ms in [1u64, 7, 333, 1_001, 99_999] {
                let t = Instant::from_millis(ms);
                let at = clock.to_tokio(t);
                tokio::time::advance(at - tokio::time::Instant::now()).await;
                assert_eq!(clock.now(), t, "rate {rate}, {ms} ms");
                // One microsecond earlier it had not.
                let before = at - origin - Duration::from_micros(1);
                let scaled = before.as_micros() * u128::from(rate) / 1_000_000_000;
                assert!(
                    (scaled as u64) < ms,
                    "rate {rate}, {ms} ms: not the first instant"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_clock_counts_more() {
        let clock = Clock::start_at_rate(1_400_000);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert_eq!(clock.now(), Instant::from_millis(1_400));
        let back = clock.to_tokio(clock.now());
        assert_eq!(back, tokio::time::Instant::now());
    }
}

//! The time type the sans-IO cores take as input. Only the runtime reads a clock; cores get
//! `now` passed in, so the simulation can drive them with virtual time.

/// Milliseconds on a monotonic clock whose origin the runtime chooses.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// An instant `ms` milliseconds after the origin.
    pub const fn from_millis(ms: u64) -> Instant {
        Instant(ms)
    }

    /// Milliseconds since the origin.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// This instant plus `ms` milliseconds (saturating).
    pub const fn plus_millis(self, ms: u64) -> Instant {
        Instant(self.0.saturating_add(ms))
    }

    /// Milliseconds from `earlier` to `self`, 0 if `earlier` is later.
    pub const fn millis_since(self, earlier: Instant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

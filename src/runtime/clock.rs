//! The node clock: milliseconds since the node started, on tokio's (virtualisable) clock.

use crate::time::Instant;

/// Converts between tokio instants and the cores' [`Instant`].
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: tokio::time::Instant,
}

impl Clock {
    /// A clock whose origin is now.
    pub fn start() -> Clock {
        Clock {
            origin: tokio::time::Instant::now(),
        }
    }

    /// Now.
    pub fn now(&self) -> Instant {
        Instant::from_millis(self.origin.elapsed().as_millis() as u64)
    }

    /// The tokio instant for a core instant.
    pub fn to_tokio(&self, t: Instant) -> tokio::time::Instant {
        self.origin + std::time::Duration::from_millis(t.as_millis())
    }
}

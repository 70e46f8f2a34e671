//! The sale clock: what time it is for the decisions that follow a sale's
//! calendar — whether an activity is open or ended, whether a coupon
//! batch has expired, how old a reservation is for reconciliation, and
//! the time a reservation is stamped with. Production runs on the system
//! clock; tests move a [`ShiftedClock`] forward instead of sleeping
//! through a sale window.
//!
//! What follows real time stays on it: token expiry, Redis key TTLs, the
//! database's `now()` (payment deadlines are closed by it), the broker
//! breaker, lease heartbeats and order numbers.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A duration in whole milliseconds, for arithmetic on unix-ms instants
/// (saturating: no setting is anywhere near 292 million years).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> DateTime<Utc>;

    /// Now, in unix milliseconds.
    fn now_ms(&self) -> i64 {
        self.now().timestamp_millis()
    }
}

/// The clock every component of one process shares.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// The system clock moved forward by however much [`ShiftedClock::advance`]
/// was told: time still passes, and never goes back.
#[derive(Debug, Default)]
pub struct ShiftedClock {
    ahead_ms: AtomicI64,
}

impl ShiftedClock {
    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX / 2);
        self.ahead_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ShiftedClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + chrono::Duration::milliseconds(self.ahead_ms.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shifted_clock_runs_ahead_by_what_it_was_told() {
        let clock = ShiftedClock::default();
        let before = Utc::now();
        assert!((clock.now() - before).num_milliseconds() < 1_000);
        clock.advance(Duration::from_secs(90));
        let ahead = (clock.now() - Utc::now()).num_milliseconds();
        assert!((89_000..=91_000).contains(&ahead), "{ahead} ms ahead");
        assert!(SystemClock.now_ms() <= Utc::now().timestamp_millis());
    }
}

//! The moment before which reservations may be voided, and whether the
//! order consumers have provably applied every event sent before it.

/// Reservations neither made nor sent since `before_ms` are voided,
/// `because` of what.
pub(super) struct Cutoff {
    /// When it was read (before the consumers' offsets).
    pub(super) at_ms: i64,
    pub(super) before_ms: i64,
    pub(super) because: &'static str,
    /// The order consumers have applied every event published before
    /// `at_ms`.
    pub(super) proven: bool,
}

impl Cutoff {
    /// No proof: nothing is old enough to void.
    pub(super) fn unproven(now: i64) -> Self {
        Self {
            at_ms: now,
            before_ms: i64::MIN,
            because: "the order consumers have not provably applied anything yet",
            proven: false,
        }
    }
}

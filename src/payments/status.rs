//! The payment state machine (SPEC step 5, docs/PAYMENTS.md).

/// A payment's state (its row's `status`); a provider's callback reports
/// `Success` or `Failed`.
///
/// ```text
/// PENDING → SUCCESS → REFUNDING → REFUNDED | REFUND_FAILED   (after-sale)
///         → FAILED (the charge failed, or the provider's side was closed)
///         → REFUND_REQUIRED → REFUNDING → …                  (a charge for
///           an order no longer payable: never revives it)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaymentStatus {
    /// Created, awaiting the provider's callback.
    Pending,
    /// Charged: its order is PAID.
    Success,
    /// The charge failed or can no longer happen; the order may still
    /// await payment.
    Failed,
    /// Charged for an order that was no longer payable; its refund is due.
    RefundRequired,
    /// Its refund is with the provider.
    Refunding,
    /// Given back.
    Refunded,
    /// The provider refused the refund for good: an operator must act.
    RefundFailed,
}

const ALL: [PaymentStatus; 7] = [
    PaymentStatus::Pending,
    PaymentStatus::Success,
    PaymentStatus::Failed,
    PaymentStatus::RefundRequired,
    PaymentStatus::Refunding,
    PaymentStatus::Refunded,
    PaymentStatus::RefundFailed,
];

impl PaymentStatus {
    /// Its name in the API and in the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Success => "SUCCESS",
            Self::Failed => "FAILED",
            Self::RefundRequired => "REFUND_REQUIRED",
            Self::Refunding => "REFUNDING",
            Self::Refunded => "REFUNDED",
            Self::RefundFailed => "REFUND_FAILED",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether a callback may report `s` (SUCCESS or FAILED).
    pub fn is_callback_status(s: &str) -> bool {
        matches!(Self::parse(s), Some(Self::Success | Self::Failed))
    }

    /// Whether the money was taken (a repeated callback changes nothing):
    /// every state but PENDING and FAILED.
    pub const fn is_settled(self) -> bool {
        !matches!(self, Self::Pending | Self::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::PaymentStatus::{self, *};

    #[test]
    fn names_round_trip_and_callbacks_report_success_or_failure_only() {
        for s in super::ALL {
            assert_eq!(PaymentStatus::parse(s.as_str()), Some(s));
        }
        assert!(PaymentStatus::is_callback_status(Success.as_str()));
        assert!(PaymentStatus::is_callback_status(Failed.as_str()));
        assert!(!PaymentStatus::is_callback_status(Pending.as_str()));
        assert!(!PaymentStatus::is_callback_status(Refunded.as_str()));
        assert!(!PaymentStatus::is_callback_status("success"));
        let settled: Vec<_> = super::ALL.into_iter().filter(|s| s.is_settled()).collect();
        assert_eq!(
            settled,
            [Success, RefundRequired, Refunding, Refunded, RefundFailed]
        );
    }
}

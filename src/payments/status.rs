//! The payment state machine (SPEC step 5).

/// A payment's state (its row's `status`); a provider's callback reports
/// `Success` or `Failed`. PENDING → SUCCESS | FAILED | REFUND_REQUIRED (a
/// charge for an order no longer payable: never revives it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaymentStatus {
    /// Created, awaiting the provider's callback.
    Pending,
    /// Charged: its order is PAID.
    Success,
    /// The charge failed; the order still awaits payment.
    Failed,
    /// Charged for an order that was no longer payable.
    RefundRequired,
}

impl PaymentStatus {
    /// Its name in the API and in the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Success => "SUCCESS",
            Self::Failed => "FAILED",
            Self::RefundRequired => "REFUND_REQUIRED",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Pending,
            Self::Success,
            Self::Failed,
            Self::RefundRequired,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }

    /// Whether a callback may report `s` (SUCCESS or FAILED).
    pub fn is_callback_status(s: &str) -> bool {
        matches!(Self::parse(s), Some(Self::Success | Self::Failed))
    }

    /// Whether the payment is settled for good (a repeated callback
    /// changes nothing).
    pub const fn is_settled(self) -> bool {
        matches!(self, Self::Success | Self::RefundRequired)
    }
}

#[cfg(test)]
mod tests {
    use super::PaymentStatus::{self, *};

    #[test]
    fn names_round_trip_and_callbacks_report_success_or_failure_only() {
        for s in [Pending, Success, Failed, RefundRequired] {
            assert_eq!(PaymentStatus::parse(s.as_str()), Some(s));
        }
        assert!(PaymentStatus::is_callback_status(Success.as_str()));
        assert!(PaymentStatus::is_callback_status(Failed.as_str()));
        assert!(!PaymentStatus::is_callback_status(Pending.as_str()));
        assert!(!PaymentStatus::is_callback_status("success"));
        let settled: Vec<_> = [Pending, Success, Failed, RefundRequired]
            .into_iter()
            .filter(|s| s.is_settled())
            .collect();
        assert_eq!(settled, [Success, RefundRequired]);
    }
}

//! WeChat Pay's own state names (`trade_state`, a refund's `status`), read
//! into ours. They share words with the order states (CLOSED, PROCESSING)
//! but are the provider's, and are named here only.

use crate::payments::provider::{ChargeOutcome, RefundState};

/// A trade's `trade_state`: SUCCESS, REFUND (paid, then refunded: the
/// payment was made), NOTPAY, USERPAYING, CLOSED, REVOKED, PAYERROR.
pub fn trade_outcome(trade_state: &str) -> ChargeOutcome {
    match trade_state {
        "SUCCESS" | "REFUND" => ChargeOutcome::Paid,
        "CLOSED" | "REVOKED" => ChargeOutcome::Closed,
        "PAYERROR" => ChargeOutcome::Failed,
        _ => ChargeOutcome::NotPaid,
    }
}

/// A refund's `status` (`refund_status` in callbacks): SUCCESS,
/// PROCESSING, CLOSED, ABNORMAL (the last two for good).
pub fn refund_state(status: &str) -> RefundState {
    match status {
        "SUCCESS" => RefundState::Succeeded,
        "PROCESSING" => RefundState::Processing,
        other => RefundState::Failed(other.to_owned()),
    }
}

/// Whether a trade bill's row is a charge (its 交易状态).
pub fn is_charge_row(state: &str) -> bool {
    state == "SUCCESS"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wechat_states_read_as_ours() {
        assert_eq!(trade_outcome("SUCCESS"), ChargeOutcome::Paid);
        assert_eq!(trade_outcome("REFUND"), ChargeOutcome::Paid);
        assert_eq!(trade_outcome("CLOSED"), ChargeOutcome::Closed);
        assert_eq!(trade_outcome("REVOKED"), ChargeOutcome::Closed);
        assert_eq!(trade_outcome("PAYERROR"), ChargeOutcome::Failed);
        assert_eq!(trade_outcome("NOTPAY"), ChargeOutcome::NotPaid);
        assert_eq!(trade_outcome("USERPAYING"), ChargeOutcome::NotPaid);
        assert_eq!(refund_state("SUCCESS"), RefundState::Succeeded);
        assert_eq!(refund_state("PROCESSING"), RefundState::Processing);
        assert_eq!(
            refund_state("ABNORMAL"),
            RefundState::Failed("ABNORMAL".into())
        );
        assert!(is_charge_row("SUCCESS") && !is_charge_row("REFUND"));
    }
}

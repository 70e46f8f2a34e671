//! WeChat Pay's own state names (`trade_state`, a refund's `status`), read
//! into ours. They share words with the order states (CLOSED, PROCESSING)
//! but are the provider's, and are named here only.

use crate::payments::provider::{ChargeOutcome, ProviderError, RefundState};

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

/// What a signed error answer `{"code", "message"}` of WeChat Pay API v3
/// means, by its documented code (the 错误码 tables of prepay, query,
/// close, refund and refund query):
///
/// - final ([`ProviderError::Refused`]): the request will never succeed as
///   it is (`PARAM_ERROR`, `INVALID_REQUEST`, `USER_ACCOUNT_ABNORMAL`, a
///   trade or refund that does not exist, a trade closed or paid). Each
///   call reads the codes it expects first (a query's `ORDER_NOT_EXIST` is
///   "not paid", a close's `ORDERPAID` is "paid first");
/// - unknown ([`ProviderError::Unknown`]): `SYSTEM_ERROR`, `BANKERROR`, as
///   for a 5xx: it may have been done;
/// - retry ([`ProviderError::Retry`]) for the rest: `FREQUENCY_LIMITED`
///   (429: "该笔退款未受理，请降低频率后重试"), `NOT_ENOUGH` (403: the
///   merchant's balance is short; resubmit under the same `out_refund_no`
///   once topped up), `NO_AUTH`, `SIGN_ERROR`, `MCH_NOT_EXISTS`,
///   `APPID_MCHID_NOT_MATCH` (a setting here to mend), and any code not
///   documented. A refund is never given up on a word we do not know.
pub fn error_of(http_status: u16, code: &str, message: &str) -> ProviderError {
    let (code, message) = (code.to_owned(), message.to_owned());
    match code.as_str() {
        "PARAM_ERROR"
        | "INVALID_REQUEST"
        | "USER_ACCOUNT_ABNORMAL"
        | "RESOURCE_NOT_EXISTS"
        | "ORDER_NOT_EXIST"
        | "ORDERNOTEXIST"
        | "ORDER_CLOSED"
        | "ORDERPAID"
        | "OUT_TRADE_NO_USED"
        | "RULE_LIMIT"
        | "TRADE_ERROR"
        | "OPENID_MISMATCH"
        | "INVALID_TRANSACTIONID"
        | "ACCOUNTERROR" => ProviderError::Refused { code, message },
        "SYSTEM_ERROR" | "BANKERROR" => {
            ProviderError::Unknown(format!("{http_status} {code}: {message}"))
        }
        _ => ProviderError::Retry { code, message },
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

    #[test]
    fn error_codes_read_as_final_retry_or_unknown() {
        let class = |status, code| error_of(status, code, "m").label();
        for code in [
            "FREQUENCY_LIMITED",
            "NOT_ENOUGH",
            "NO_AUTH",
            "SIGN_ERROR",
            "SOMETHING_NEW",
        ] {
            assert_eq!(class(403, code), "retry", "{code}");
        }
        assert_eq!(class(429, "FREQUENCY_LIMITED"), "retry");
        for code in ["SYSTEM_ERROR", "BANKERROR"] {
            assert_eq!(class(500, code), "unknown", "{code}");
        }
        for code in [
            "PARAM_ERROR",
            "INVALID_REQUEST",
            "USER_ACCOUNT_ABNORMAL",
            "RESOURCE_NOT_EXISTS",
            "ORDER_NOT_EXIST",
            "ORDERPAID",
        ] {
            assert_eq!(class(400, code), "refused", "{code}");
        }
    }
}

//! WeChat Pay's trade bill: the CSV of a day's trades, read into the lines
//! the statement reconciliation compares with our payments.

use super::status;
use crate::payments::provider::{ProviderError, StatementLine};

/// Yuan with two decimals ("99.00") in fen.
pub(super) fn fen(yuan: &str) -> Option<i64> {
    let (whole, frac) = yuan.trim().split_once('.').unwrap_or((yuan.trim(), "0"));
    if frac.len() > 2 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let frac: i64 = format!("{frac:0<2}").parse().ok()?;
    Some(whole.parse::<i64>().ok()? * 100 + frac)
}

/// The charges of a trade bill: every field starts with a backtick (so a
/// comma inside one is no separator), the header names the columns, and a
/// summary follows the rows. A row of state SUCCESS is a charge; REFUND
/// rows are refunds of charges billed on their own day.
pub fn parse_trade_bill(text: &str) -> Result<Vec<StatementLine>, ProviderError> {
    let bad = |why: &str| ProviderError::Unknown(format!("a trade bill not understood: {why}"));
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let split = |line: &str| -> Vec<String> {
        line.trim_start_matches('\u{feff}')
            .trim_start_matches('`')
            .split(",`")
            .map(|f| f.trim().to_owned())
            .collect()
    };
    let header: Vec<String> = lines
        .next()
        .ok_or_else(|| bad("empty"))?
        .trim_start_matches('\u{feff}')
        .split(',')
        .map(|f| f.trim().trim_start_matches('`').to_owned())
        .collect();
    let column = |name: &str| header.iter().position(|h| h == name);
    let (Some(trade_no), Some(state), Some(amount)) = (
        column("商户订单号"),
        column("交易状态"),
        column("订单金额").or_else(|| column("应结订单金额")),
    ) else {
        return Err(bad("no 商户订单号, 交易状态 or 订单金额 column"));
    };
    let txn = column("微信订单号");
    let mut out = Vec::new();
    for line in lines {
        if !line.starts_with('`') {
            break; // the summary
        }
        let fields = split(line);
        let get = |i: usize| fields.get(i).map(String::as_str);
        if !get(state).is_some_and(status::is_charge_row) {
            continue;
        }
        let reference = get(trade_no).ok_or_else(|| bad("a short row"))?.to_owned();
        let amount_cents = get(amount).and_then(fen).ok_or_else(|| bad("an amount"))?;
        out.push(StatementLine {
            reference,
            txn_id: txn.and_then(get).map(str::to_owned),
            amount_cents,
        });
    }
    Ok(out)
}

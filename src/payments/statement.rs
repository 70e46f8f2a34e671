//! Statement reconciliation: the provider's statement of a day (WeChat
//! Pay's trade bill) against the payments we recorded as charged that day.
//! It reports the charges the provider has and we don't (a payment we never
//! learnt of, or learnt of as failed), the ones we have and it doesn't, and
//! amounts that differ. Reports are kept, one per provider and day, and
//! shown on the operator page.

use chrono::{DateTime, Duration, FixedOffset, NaiveDate, TimeZone, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamptz};
use serde::Serialize;

use super::PaymentStatus;
use super::provider::{PaymentProvider, StatementLine};
use crate::store::schema::payment_statements;
use crate::store::{self, PgConn, PgPool};

/// WeChat Pay's days are China's (UTC+8).
fn china() -> FixedOffset {
    FixedOffset::east_opt(8 * 3600).unwrap_or_else(|| unreachable!("a valid offset"))
}

/// The day before today, in China.
pub fn yesterday(now: DateTime<Utc>) -> NaiveDate {
    (now.with_timezone(&china()) - Duration::days(1)).date_naive()
}

/// Whether a day's statement can be asked for at `now`: WeChat Pay makes
/// the trade bill of a day after 10:00 the next day.
pub fn due(now: DateTime<Utc>) -> bool {
    use chrono::Timelike;
    now.with_timezone(&china()).hour() >= 10
}

/// What one reconciliation found.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Report {
    pub provider: String,
    pub bill_date: NaiveDate,
    /// Charges on the provider's statement.
    pub provider_rows: usize,
    /// Payments we recorded as charged that day.
    pub our_rows: usize,
    /// Charged at the provider, not (or not as charged) here.
    pub missing_here: Vec<StatementLine>,
    /// Charged here, not on the provider's statement.
    pub missing_there: Vec<Ours>,
    /// On both, with other amounts.
    pub mismatched: Vec<Mismatch>,
}

impl Report {
    pub fn differences(&self) -> usize {
        self.missing_here.len() + self.missing_there.len() + self.mismatched.len()
    }
}

/// One of our charged payments.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, QueryableByName)]
pub struct Ours {
    #[diesel(sql_type = Text)]
    pub payment_no: String,
    #[diesel(sql_type = BigInt)]
    pub amount_cents: i64,
    #[diesel(sql_type = Text)]
    pub status: String,
}

/// A charge whose amounts differ.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Mismatch {
    pub payment_no: String,
    pub ours_cents: i64,
    pub theirs_cents: i64,
}

/// The states of a payment whose money was taken.
const CHARGED: [PaymentStatus; 5] = [
    PaymentStatus::Success,
    PaymentStatus::RefundRequired,
    PaymentStatus::Refunding,
    PaymentStatus::Refunded,
    PaymentStatus::RefundFailed,
];

/// Our payments of `provider` charged on `date` (China's day).
fn ours(conn: &mut PgConn, provider: &str, date: NaiveDate) -> QueryResult<Vec<Ours>> {
    let start = china()
        .from_local_datetime(&date.and_hms_opt(0, 0, 0).unwrap_or_default())
        .single()
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default();
    let statuses: Vec<String> = CHARGED
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    diesel::sql_query(format!(
        "SELECT payment_no::text AS payment_no, amount_cents, status FROM payments \
         WHERE provider = $1 AND status IN ({}) AND paid_at >= $2 AND paid_at < $3 \
         ORDER BY payment_no",
        statuses.join(", ")
    ))
    .bind::<Text, _>(provider)
    .bind::<Timestamptz, _>(start)
    .bind::<Timestamptz, _>(start + Duration::days(1))
    .load(conn)
}

/// Compares a statement with our charged payments.
pub fn compare(
    provider: &str,
    date: NaiveDate,
    lines: Vec<StatementLine>,
    ours: Vec<Ours>,
) -> Report {
    use std::collections::HashMap;
    let by_no: HashMap<&str, &Ours> = ours.iter().map(|o| (o.payment_no.as_str(), o)).collect();
    let theirs: HashMap<&str, &StatementLine> =
        lines.iter().map(|l| (l.reference.as_str(), l)).collect();
    let mut report = Report {
        provider: provider.to_owned(),
        bill_date: date,
        provider_rows: lines.len(),
        our_rows: ours.len(),
        missing_here: Vec::new(),
        missing_there: Vec::new(),
        mismatched: Vec::new(),
    };
    for line in &lines {
        match by_no.get(line.reference.as_str()) {
            None => report.missing_here.push(line.clone()),
            Some(o) if o.amount_cents != line.amount_cents => report.mismatched.push(Mismatch {
                payment_no: o.payment_no.clone(),
                ours_cents: o.amount_cents,
                theirs_cents: line.amount_cents,
            }),
            Some(_) => {}
        }
    }
    for o in &ours {
        if !theirs.contains_key(o.payment_no.as_str()) {
            report.missing_there.push(o.clone());
        }
    }
    report
}

/// Reconciles `date` and keeps the report (a later run of the same day
/// replaces it).
pub async fn run(
    db: &PgPool,
    provider: &dyn PaymentProvider,
    date: NaiveDate,
) -> anyhow::Result<Report> {
    let lines = provider.statement(date).await?;
    let name = provider.name();
    let report = store::run(db, move |conn| {
        let report = compare(name, date, lines, ours(conn, name, date)?);
        let json = serde_json::to_value(&report)?;
        let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
        diesel::insert_into(payment_statements::table)
            .values((
                payment_statements::provider.eq(name),
                payment_statements::bill_date.eq(date),
                payment_statements::provider_rows.eq(count(report.provider_rows)),
                payment_statements::our_rows.eq(count(report.our_rows)),
                payment_statements::differences.eq(count(report.differences())),
                payment_statements::report.eq(&json),
            ))
            .on_conflict((payment_statements::provider, payment_statements::bill_date))
            .do_update()
            .set((
                payment_statements::provider_rows.eq(count(report.provider_rows)),
                payment_statements::our_rows.eq(count(report.our_rows)),
                payment_statements::differences.eq(count(report.differences())),
                payment_statements::report.eq(&json),
                payment_statements::created_at.eq(diesel::dsl::now),
            ))
            .execute(conn)?;
        Ok(report)
    })
    .await?;
    if report.differences() > 0 {
        tracing::warn!(
            provider = name,
            bill_date = %date,
            missing_here = report.missing_here.len(),
            missing_there = report.missing_there.len(),
            mismatched = report.mismatched.len(),
            "the provider's statement and our payments differ"
        );
    }
    Ok(report)
}

/// Whether `date`'s report of `provider` is kept already.
pub fn kept(conn: &mut PgConn, provider: &str, date: NaiveDate) -> QueryResult<bool> {
    use diesel::dsl::exists;
    diesel::select(exists(
        payment_statements::table
            .filter(payment_statements::provider.eq(provider))
            .filter(payment_statements::bill_date.eq(date)),
    ))
    .get_result(conn)
}

/// The latest `limit` reports kept, newest day first.
pub fn latest(conn: &mut PgConn, limit: i64) -> QueryResult<Vec<serde_json::Value>> {
    let rows: Vec<(serde_json::Value, DateTime<Utc>)> = payment_statements::table
        .order((
            payment_statements::bill_date.desc(),
            payment_statements::provider,
        ))
        .limit(limit)
        .select((payment_statements::report, payment_statements::created_at))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(mut report, at)| {
            report["checked_at"] = serde_json::json!(at);
            report
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(reference: &str, amount_cents: i64) -> StatementLine {
        StatementLine {
            reference: reference.into(),
            txn_id: None,
            amount_cents,
        }
    }

    fn our(no: &str, amount_cents: i64) -> Ours {
        Ours {
            payment_no: no.into(),
            amount_cents,
            status: "SUCCESS".into(),
        }
    }

    #[test]
    fn each_kind_of_difference_is_found_and_nothing_else() {
        let date = NaiveDate::from_ymd_opt(2026, 12, 3).unwrap();
        let report = compare(
            "wechatpay",
            date,
            vec![line("1", 100), line("2", 200), line("4", 400)],
            vec![our("1", 100), our("2", 250), our("3", 300)],
        );
        assert_eq!(report.missing_here, [line("4", 400)]);
        assert_eq!(report.missing_there, [our("3", 300)]);
        assert_eq!(
            report.mismatched,
            [Mismatch {
                payment_no: "2".into(),
                ours_cents: 250,
                theirs_cents: 200
            }]
        );
        assert_eq!(
            (report.provider_rows, report.our_rows, report.differences()),
            (3, 3, 3)
        );
        let same = compare("wechatpay", date, vec![line("1", 100)], vec![our("1", 100)]);
        assert_eq!(same.differences(), 0);
    }

    #[test]
    fn days_are_china_days_and_a_bill_is_due_after_ten_there() {
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        // 2026-12-04 01:00 UTC is 09:00 in China: not due yet.
        assert!(!due(at("2026-12-04T01:00:00Z")));
        assert!(due(at("2026-12-04T02:00:00Z")));
        assert_eq!(
            yesterday(at("2026-12-03T17:00:00Z")),
            NaiveDate::from_ymd_opt(2026, 12, 3).unwrap(),
            "01:00 on the 4th in China"
        );
    }
}

//! Refund rows: one per payment at most, its number the provider's
//! idempotency key, so a refund is never sent as two. The row is the
//! outbox of the refund: written in the transaction that decides it, sent
//! by the sweeper ([`super::sweeper`]) until the provider has settled it.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Int4, Nullable, Text};
use serde::Serialize;

use super::PaymentStatus;
use super::provider::{RefundReport, RefundState};
use crate::store::PgConn;
use crate::store::schema::{payments, refunds};

/// Why a refund is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundKind {
    /// A charge for an order that was no longer payable.
    LatePayment,
    /// An admin refunded a PAID order.
    AfterSale,
}

impl RefundKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LatePayment => "LATE_PAYMENT",
            Self::AfterSale => "AFTER_SALE",
        }
    }
}

/// A refund's state (its row's `status`).
pub const REFUNDING: &str = "REFUNDING";
pub const REFUNDED: &str = "REFUNDED";
pub const REFUND_FAILED: &str = "REFUND_FAILED";

/// A refund row, as the API shows it.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = refunds)]
pub struct RefundRow {
    #[serde(serialize_with = "as_string")]
    pub refund_no: i64,
    #[serde(serialize_with = "as_string")]
    pub payment_no: i64,
    pub amount_cents: i64,
    pub kind: String,
    pub reason: String,
    pub status: String,
    #[serde(skip)]
    pub accepted: bool,
    #[serde(skip)]
    pub attempts: i32,
    pub last_error: Option<String>,
    pub refunded_at: Option<DateTime<Utc>>,
}

fn as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Writes the payment's refund (inside the caller's transaction), unless
/// it has one: that one is returned.
pub fn create(
    conn: &mut PgConn,
    payment_no: i64,
    amount_cents: i64,
    kind: RefundKind,
    reason: &str,
) -> QueryResult<RefundRow> {
    if let Some(existing) = find_for_payment(conn, payment_no)? {
        return Ok(existing);
    }
    let refund_no = crate::ids::database_number(conn, None)?;
    diesel::insert_into(refunds::table)
        .values((
            refunds::refund_no.eq(refund_no),
            refunds::payment_no.eq(payment_no),
            refunds::amount_cents.eq(amount_cents),
            refunds::kind.eq(kind.as_str()),
            refunds::reason.eq(reason),
        ))
        .on_conflict(refunds::payment_no)
        .do_nothing()
        .execute(conn)?;
    find_for_payment(conn, payment_no)?.ok_or(diesel::result::Error::NotFound)
}

/// The payment's refund, if it has one.
pub fn find_for_payment(conn: &mut PgConn, payment_no: i64) -> QueryResult<Option<RefundRow>> {
    refunds::table
        .filter(refunds::payment_no.eq(payment_no))
        .select(RefundRow::as_select())
        .first(conn)
        .optional()
}

/// A refund due to be sent or asked about, leased to the caller.
#[derive(Debug, Clone, QueryableByName)]
pub struct DueRefund {
    #[diesel(sql_type = BigInt)]
    pub refund_no: i64,
    #[diesel(sql_type = BigInt)]
    pub payment_no: i64,
    #[diesel(sql_type = BigInt)]
    pub amount_cents: i64,
    #[diesel(sql_type = BigInt)]
    pub total_cents: i64,
    #[diesel(sql_type = Text)]
    pub reason: String,
    #[diesel(sql_type = Bool)]
    pub accepted: bool,
    #[diesel(sql_type = Int4)]
    pub attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub payment_ref: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub provider_refund_id: Option<String>,
    /// The payment's provider: the refund goes there.
    #[diesel(sql_type = Text)]
    pub provider: String,
}

/// Up to `limit` refunds of payments of the `providers` configured here
/// whose next attempt is due, each leased until its backoff (`2^attempts`
/// s, at most `max_secs`) has passed, so that no other sweeper sends it
/// meanwhile; their payments go REFUNDING.
pub fn lease_due(
    conn: &mut PgConn,
    limit: i64,
    max_secs: i64,
    providers: &[String],
) -> QueryResult<Vec<DueRefund>> {
    conn.transaction(|conn| {
        let due: Vec<DueRefund> = diesel::sql_query(
            "WITH due AS ( \
               SELECT r.refund_no FROM refunds r JOIN payments p ON p.payment_no = r.payment_no \
               WHERE r.status = 'REFUNDING' AND r.next_attempt_at <= now() \
                 AND p.provider = ANY($3) \
               ORDER BY r.next_attempt_at LIMIT $1 FOR UPDATE OF r SKIP LOCKED) \
             UPDATE refunds r SET attempts = r.attempts + 1, updated_at = now(), \
               next_attempt_at = now() + make_interval(secs => least($2, power(2, least(r.attempts, 20)))) \
             FROM due, payments p \
             WHERE r.refund_no = due.refund_no AND p.payment_no = r.payment_no \
             RETURNING r.refund_no, r.payment_no, r.amount_cents, p.amount_cents AS total_cents, \
               r.reason, r.accepted, r.attempts, p.provider_ref AS payment_ref, \
               r.provider_refund_id, p.provider",
        )
        .bind::<BigInt, _>(limit)
        .bind::<BigInt, _>(max_secs)
        .bind::<diesel::sql_types::Array<Text>, _>(providers)
        .load(conn)?;
        let numbers: Vec<i64> = due.iter().map(|d| d.payment_no).collect();
        diesel::update(
            payments::table
                .filter(payments::payment_no.eq_any(&numbers))
                .filter(payments::status.eq_any([
                    PaymentStatus::Success.as_str(),
                    PaymentStatus::RefundRequired.as_str(),
                ])),
        )
        .set((
            payments::status.eq(PaymentStatus::Refunding.as_str()),
            payments::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)?;
        Ok(due)
    })
}

/// What applying a refund report did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundOutcome {
    /// REFUNDING → REFUNDED or REFUND_FAILED.
    Settled,
    /// The provider has it; still REFUNDING.
    Accepted,
    /// Settled before: nothing changed.
    Duplicate,
    /// No such refund.
    Unknown,
}

impl RefundOutcome {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Settled => "refund_settled",
            Self::Accepted => "refund_accepted",
            Self::Duplicate => "refund_duplicate",
            Self::Unknown => "refund_unknown",
        }
    }
}

/// Applies what `provider` said of a refund (its answer, a query or a
/// callback) in one transaction. A refund of another provider's payment
/// is unknown here. One the provider has accepted is asked about again
/// `query_after_secs` later, unless its callback comes first.
pub fn apply(
    conn: &mut PgConn,
    report: &RefundReport,
    provider: &str,
    query_after_secs: i64,
) -> QueryResult<RefundOutcome> {
    let (status, error) = match &report.state {
        RefundState::Processing => (REFUNDING, None),
        RefundState::Succeeded => (REFUNDED, None),
        RefundState::Failed(reason) => (REFUND_FAILED, Some(reason.as_str())),
    };
    settle(
        conn,
        report.refund_no,
        provider,
        status,
        report.provider_refund_id.as_deref(),
        error,
        query_after_secs,
    )
}

/// Marks the refund `status` (REFUNDING: accepted, still under way), and
/// its payment alike. The provider's later word wins over an earlier
/// failure: a REFUND_FAILED refund the provider then reports refunded is
/// REFUNDED, and one it reports under way is followed again. A REFUNDED
/// refund stays so: the money is back.
pub fn settle(
    conn: &mut PgConn,
    refund_no: i64,
    provider: &str,
    status: &str,
    provider_refund_id: Option<&str>,
    error: Option<&str>,
    query_after_secs: i64,
) -> QueryResult<RefundOutcome> {
    conn.transaction(|conn| {
        let current: Option<String> = refunds::table
            .find(refund_no)
            .select(refunds::status)
            .for_update()
            .first(conn)
            .optional()?;
        let of_provider: Option<String> = match &current {
            None => None,
            Some(_) => refunds::table
                .inner_join(payments::table)
                .filter(refunds::refund_no.eq(refund_no))
                .select(payments::provider)
                .first(conn)
                .optional()?,
        };
        let (Some(current), Some(of_provider)) = (current, of_provider) else {
            return Ok(RefundOutcome::Unknown);
        };
        if of_provider != provider {
            return Ok(RefundOutcome::Unknown);
        }
        let overrules = current == REFUND_FAILED && status != REFUND_FAILED;
        if current != REFUNDING && !overrules {
            return Ok(RefundOutcome::Duplicate);
        }
        if overrules {
            tracing::warn!(
                refund_no,
                status,
                "the provider's later word overrules a refund's failure"
            );
        }
        let payment_no: i64 = diesel::sql_query(
            "UPDATE refunds SET status = $2, accepted = true, \
               provider_refund_id = COALESCE($3, provider_refund_id), \
               last_error = COALESCE($4, last_error), updated_at = now(), \
               refunded_at = CASE WHEN $2 = 'REFUNDED' THEN now() END, \
               next_attempt_at = CASE WHEN $2 = 'REFUNDING' \
                 THEN greatest(next_attempt_at, now() + make_interval(secs => $5)) \
                 ELSE next_attempt_at END \
             WHERE refund_no = $1 RETURNING payment_no",
        )
        .bind::<BigInt, _>(refund_no)
        .bind::<Text, _>(status)
        .bind::<Nullable<Text>, _>(provider_refund_id)
        .bind::<Nullable<Text>, _>(error)
        .bind::<BigInt, _>(query_after_secs)
        .get_result::<PaymentOfRefund>(conn)?
        .payment_no;
        diesel::update(payments::table.find(payment_no))
            .set((
                payments::status.eq(status),
                payments::updated_at.eq(diesel::dsl::now),
            ))
            .execute(conn)?;
        Ok(if status == REFUNDING {
            RefundOutcome::Accepted
        } else {
            RefundOutcome::Settled
        })
    })
}

#[derive(QueryableByName)]
struct PaymentOfRefund {
    #[diesel(sql_type = BigInt)]
    payment_no: i64,
}

/// The provider does not know a refund we took as accepted (a query
/// answered that it has none): it is sent again, under the same number.
pub fn resend(conn: &mut PgConn, refund_no: i64, error: &str) -> QueryResult<()> {
    diesel::update(
        refunds::table
            .find(refund_no)
            .filter(refunds::status.eq(REFUNDING)),
    )
    .set((
        refunds::accepted.eq(false),
        refunds::last_error.eq(error),
        refunds::next_attempt_at.eq(diesel::dsl::now),
        refunds::updated_at.eq(diesel::dsl::now),
    ))
    .execute(conn)?;
    Ok(())
}

/// Notes why an attempt gave no answer to act on (it is tried again).
pub fn note_error(conn: &mut PgConn, refund_no: i64, error: &str) -> QueryResult<()> {
    diesel::update(refunds::table.find(refund_no))
        .set((
            refunds::last_error.eq(error),
            refunds::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)?;
    Ok(())
}

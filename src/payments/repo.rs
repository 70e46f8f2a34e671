//! Payment rows: intents and the one transaction that applies a callback.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use serde::Serialize;

use super::provider::{Charge, ChargeOutcome, Checkout};
use super::refunds::{self, RefundKind};
use crate::bus::events::OrderPaid;
use crate::coupons::repo as coupons;
use crate::domain::UserId;
use crate::ids::{OrderNo, PaymentNo};
use crate::orders::OrderStatus;
use crate::orders::partition::{seckill_order_slot, user_slot_column};
use crate::outbox;
use crate::payments::PaymentStatus;
use crate::stock::{self, Units};
use crate::store::PgConn;
use crate::store::schema::{orders, payments};

/// A payment row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = payments)]
pub struct Payment {
    #[serde(serialize_with = "as_string")]
    pub payment_no: i64,
    #[serde(serialize_with = "as_string")]
    pub order_no: i64,
    pub amount_cents: i64,
    pub status: String,
    #[serde(skip)]
    pub provider: String,
    #[serde(skip)]
    pub provider_txn_id: Option<String>,
    /// What the provider answered to the create (NULL until it did).
    #[serde(skip)]
    pub checkout: Option<serde_json::Value>,
    /// The provider's own id of the payment (a Stripe PaymentIntent).
    #[serde(skip)]
    pub provider_ref: Option<String>,
    /// Its capture paid the order (at most one payment per order).
    #[serde(skip)]
    pub pays_order: bool,
}

fn as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Result of asking to pay.
#[derive(Debug)]
pub enum PayIntent {
    /// No such order for this user.
    NotFound,
    /// The order is not WAITING_PAY.
    InvalidState,
    /// Earlier payments of the order that failed but that the provider has
    /// not closed: the buyer could still pay them there. Each is closed at
    /// its provider before a new payment is made.
    CloseFirst(Vec<Unclosed>),
    /// The pending payment (new or existing).
    Pending(Payment),
}

/// A FAILED payment its provider has not closed yet.
#[derive(Debug, Clone, Queryable)]
pub struct Unclosed {
    pub payment_no: i64,
    pub provider: String,
    pub provider_ref: Option<String>,
}

/// Creates the order's pending payment, or returns the one already
/// pending; or, while an earlier failed payment is still open at its
/// provider, asks for it to be closed first (defect: an old QR code or
/// client secret paid after the new one).
pub fn create_or_get(
    conn: &mut PgConn,
    order_no: OrderNo,
    user_id: UserId,
    payment_no: PaymentNo,
    provider: &str,
) -> QueryResult<PayIntent> {
    let (order_no, user_id, payment_no) = (order_no.get(), user_id.get(), payment_no.get());
    conn.transaction(|conn| {
        let order: Option<(OrderStatus, i64)> = orders::table
            .find(order_no)
            .filter(orders::user_slot.eq(user_slot_column(user_id)))
            .filter(orders::user_id.eq(user_id))
            .select((orders::status, orders::amount_cents))
            .for_update()
            .first(conn)
            .optional()?;
        let Some((status, amount)) = order else {
            return Ok(PayIntent::NotFound);
        };
        if !status.can_become(OrderStatus::Paid) {
            return Ok(PayIntent::InvalidState);
        }
        let pending: Option<Payment> = payments::table
            .filter(payments::order_no.eq(order_no))
            .filter(payments::status.eq(PaymentStatus::Pending.as_str()))
            .select(Payment::as_select())
            .first(conn)
            .optional()?;
        if let Some(p) = pending {
            return Ok(PayIntent::Pending(p));
        }
        let unclosed: Vec<Unclosed> = payments::table
            .filter(payments::order_no.eq(order_no))
            .filter(payments::status.eq(PaymentStatus::Failed.as_str()))
            .filter(payments::closed_at.is_null())
            .select((
                payments::payment_no,
                payments::provider,
                payments::provider_ref,
            ))
            .load(conn)?;
        if !unclosed.is_empty() {
            return Ok(PayIntent::CloseFirst(unclosed));
        }
        let created = diesel::insert_into(payments::table)
            .values((
                payments::payment_no.eq(payment_no),
                payments::order_no.eq(order_no),
                payments::amount_cents.eq(amount),
                payments::provider.eq(provider),
            ))
            .returning(Payment::as_returning())
            .get_result(conn)?;
        Ok(PayIntent::Pending(created))
    })
}

/// The payment, if it belongs to an order of `user_id`.
pub fn find_for_user(
    conn: &mut PgConn,
    payment_no: PaymentNo,
    user_id: UserId,
) -> QueryResult<Option<Payment>> {
    payments::table
        .inner_join(orders::table)
        .filter(payments::payment_no.eq(payment_no.get()))
        .filter(orders::user_slot.eq(user_slot_column(user_id.get())))
        .filter(orders::user_id.eq(user_id.get()))
        .select(Payment::as_select())
        .first(conn)
        .optional()
}

/// What a callback did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallbackOutcome {
    /// WAITING_PAY → PAID with all its effects.
    Applied,
    /// Seen before: acknowledged, nothing changed.
    Duplicate,
    /// A successful charge for an order that is no longer payable: recorded
    /// REFUND_REQUIRED, the order untouched.
    RefundRequired,
    /// A FAILED callback: the payment is failed, the order still WAITING_PAY.
    MarkedFailed,
    /// No such payment.
    UnknownPayment,
    /// The body's order_no is not the payment's.
    OrderMismatch,
    /// The amount differs from the payment's.
    AmountMismatch,
    /// The provider_txn_id was already recorded for another payment.
    TxnReused,
    /// A payment made through another provider: a callback is applied
    /// only by its own provider's route.
    WrongProvider,
    /// The provider's own id of the payment is not the one we recorded.
    RefMismatch,
    /// Not paid yet (a query's answer): nothing to do.
    Unchanged,
}

impl CallbackOutcome {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Duplicate => "duplicate",
            Self::RefundRequired => "refund_required",
            Self::MarkedFailed => "failed",
            Self::UnknownPayment => "unknown_payment",
            Self::OrderMismatch => "order_mismatch",
            Self::AmountMismatch => "amount_mismatch",
            Self::TxnReused => "txn_reused",
            Self::WrongProvider => "wrong_provider",
            Self::RefMismatch => "ref_mismatch",
            Self::Unchanged => "unchanged",
        }
    }
}

#[derive(QueryableByName)]
struct PaidOrder {
    #[diesel(embed)]
    units: Units,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = BigInt)]
    amount_cents: i64,
}

/// A FAILED charge: the pending payment becomes FAILED (the order may
/// still await payment, with a new one; the provider may still take this
/// one, so it stays open until closed there). The provider's side closed:
/// a pending or failed payment becomes FAILED with `closed_at`, and can
/// never be paid. Anything else is a duplicate.
fn mark_failed(conn: &mut PgConn, payment_no: i64, closed: bool) -> QueryResult<CallbackOutcome> {
    let n = if closed {
        let open = payments::status
            .eq(PaymentStatus::Pending.as_str())
            .or(payments::status
                .eq(PaymentStatus::Failed.as_str())
                .and(payments::closed_at.is_null()));
        diesel::update(payments::table.find(payment_no).filter(open))
            .set((
                payments::status.eq(PaymentStatus::Failed.as_str()),
                payments::updated_at.eq(diesel::dsl::now),
                payments::closed_at.eq(Some(Utc::now())),
            ))
            .execute(conn)?
    } else {
        let pending = payments::status.eq(PaymentStatus::Pending.as_str());
        diesel::update(payments::table.find(payment_no).filter(pending))
            .set((
                payments::status.eq(PaymentStatus::Failed.as_str()),
                payments::updated_at.eq(diesel::dsl::now),
            ))
            .execute(conn)?
    };
    Ok(if n == 1 {
        CallbackOutcome::MarkedFailed
    } else {
        CallbackOutcome::Duplicate
    })
}

/// Applies a verified charge report of `provider` (a callback to its
/// route, or its answer to a query) in ONE transaction (SPEC step 5):
/// whichever comes first applies, the rest are duplicates. The payment row
/// is locked first, so concurrent duplicates serialize and all but the
/// first see a settled payment. A payment of another provider is not
/// touched.
pub fn apply_charge(
    conn: &mut PgConn,
    charge: &Charge,
    provider: &str,
) -> QueryResult<CallbackOutcome> {
    let payment_no = charge.payment_no;
    let result = conn.transaction(|conn| {
        let payment: Option<Payment> = payments::table
            .find(payment_no)
            .select(Payment::as_select())
            .for_update()
            .first(conn)
            .optional()?;
        let Some(payment) = payment else {
            return Ok(CallbackOutcome::UnknownPayment);
        };
        if payment.provider != provider {
            return Ok(CallbackOutcome::WrongProvider);
        }
        if charge.order_no.is_some_and(|o| o != payment.order_no) {
            return Ok(CallbackOutcome::OrderMismatch);
        }
        match (&charge.provider_ref, &payment.provider_ref) {
            (Some(theirs), Some(ours)) if theirs != ours => {
                return Ok(CallbackOutcome::RefMismatch);
            }
            // The create's answer was lost: the provider names it now.
            (Some(theirs), None) => {
                diesel::update(payments::table.find(payment_no))
                    .set(payments::provider_ref.eq(theirs))
                    .execute(conn)?;
            }
            _ => {}
        }
        let order_no = payment.order_no;
        match charge.outcome {
            ChargeOutcome::NotPaid => return Ok(CallbackOutcome::Unchanged),
            ChargeOutcome::Failed | ChargeOutcome::Closed => {
                return mark_failed(conn, payment_no, charge.outcome == ChargeOutcome::Closed);
            }
            ChargeOutcome::Paid => {}
        }
        if payment.amount_cents != charge.amount_cents {
            return Ok(CallbackOutcome::AmountMismatch);
        }
        if PaymentStatus::parse(&payment.status).is_some_and(PaymentStatus::is_settled) {
            return Ok(CallbackOutcome::Duplicate);
        }
        let paid_at = charge.paid_at.unwrap_or_else(Utc::now);
        let paid: Option<PaidOrder> = diesel::sql_query(format!(
            "UPDATE orders SET status = {}, paid_at = $2, updated_at = now() \
             WHERE order_no = $1 AND user_slot = seckill_order_slot($1) AND status = {} \
             RETURNING order_no, activity_id, user_id, quantity, amount_cents",
            OrderStatus::Paid.sql(),
            OrderStatus::WaitingPay.sql()
        ))
        .bind::<BigInt, _>(order_no)
        .bind::<Timestamptz, _>(paid_at)
        .get_result(conn)
        .optional()?;
        let txn = charge.txn_id.as_deref();
        let Some(order) = paid else {
            // Closed, cancelled, or paid by another payment: never revived,
            // never charged twice. The money goes back (one refund per
            // payment), sent by the sweeper.
            settle(
                conn,
                payment_no,
                PaymentStatus::RefundRequired,
                txn,
                Some(paid_at),
            )?;
            refunds::create(
                conn,
                payment_no,
                payment.amount_cents,
                RefundKind::LatePayment,
                "paid after the order was no longer payable",
            )?;
            return Ok(CallbackOutcome::RefundRequired);
        };
        settle(conn, payment_no, PaymentStatus::Success, txn, Some(paid_at))?;
        diesel::update(payments::table.find(payment_no))
            .set(payments::pays_order.eq(true))
            .execute(conn)?;
        stock::confirm(conn, order.units)?;
        coupons::use_for_order(conn, order_no)?;
        let event = OrderPaid {
            event_id: format!("paid-{order_no}"),
            order_no: OrderNo::new(order_no),
            activity_id: order.units.activity_id,
            user_id: order.user_id,
            amount_cents: order.amount_cents,
            payment_no: payment_no.to_string(),
        };
        outbox::enqueue(conn, outbox::ORDER_PAID, &order_no.to_string(), &event)?;
        Ok(CallbackOutcome::Applied)
    });
    match result {
        Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info))
            if info.constraint_name() == Some("payments_provider_txn_id_key") =>
        {
            Ok(CallbackOutcome::TxnReused)
        }
        other => other,
    }
}

/// Keeps what the provider answered to the create, for the next pay call.
pub fn set_checkout(conn: &mut PgConn, payment_no: i64, checkout: &Checkout) -> QueryResult<()> {
    let value = serde_json::to_value(checkout).unwrap_or_default();
    diesel::update(payments::table.find(payment_no))
        .set((
            payments::checkout.eq(Some(value)),
            payments::provider_ref.eq(checkout.provider_ref.as_deref()),
        ))
        .execute(conn)?;
    Ok(())
}

/// A payment as `GET /orders/{no}` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PaymentView {
    /// Decimal string.
    pub payment_no: String,
    pub provider: String,
    /// PENDING | SUCCESS | FAILED | REFUND_REQUIRED | REFUNDING | REFUNDED | REFUND_FAILED
    pub status: String,
    /// Its refund's number (decimal string), once there is one.
    pub refund_no: Option<String>,
}

/// The payment that paid the order, else its latest one, and its refund,
/// if it has a payment.
pub fn view_for_order(conn: &mut PgConn, order_no: i64) -> QueryResult<Option<PaymentView>> {
    use crate::store::schema::refunds;
    let row: Option<(i64, String, String, Option<i64>)> = payments::table
        .left_join(refunds::table)
        .filter(payments::order_no.eq(order_no))
        .order((payments::pays_order.desc(), payments::created_at.desc()))
        .select((
            payments::payment_no,
            payments::provider,
            payments::status,
            refunds::refund_no.nullable(),
        ))
        .first(conn)
        .optional()?;
    Ok(
        row.map(|(payment_no, provider, status, refund_no)| PaymentView {
            payment_no: payment_no.to_string(),
            provider,
            status,
            refund_no: refund_no.map(|n| n.to_string()),
        }),
    )
}

/// A payment the sweeper looks at now, leased to it: PENDING, or FAILED
/// and not yet closed at its provider.
#[derive(Debug, Clone, QueryableByName)]
pub struct DuePayment {
    #[diesel(sql_type = BigInt)]
    pub payment_no: i64,
    /// Its provider (the one every call about it goes to).
    #[diesel(sql_type = Text)]
    pub provider: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub provider_ref: Option<String>,
    /// Its order is no longer payable: close it at the provider. Else its
    /// callback is late, or it failed and the buyer may still pay it:
    /// query it.
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub to_close: bool,
}

/// Up to `limit` payments of the `providers` configured here to close at
/// their provider (their order is no longer WAITING_PAY) or to query (a
/// PENDING one with no callback `query_after_secs` after its creation; a
/// FAILED one the provider has not closed), each leased until its backoff
/// (`2^checks` s, at most `max_secs`) has passed. A payment of a provider
/// not configured here is left alone: nothing here can ask about it.
pub fn lease_pending(
    conn: &mut PgConn,
    limit: i64,
    query_after_secs: i64,
    max_secs: i64,
    providers: &[String],
) -> QueryResult<Vec<DuePayment>> {
    diesel::sql_query(format!(
        "WITH due AS ( \
           SELECT p.payment_no, o.status <> {waiting} AS to_close FROM payments p \
           JOIN orders o ON o.order_no = p.order_no AND o.user_slot = p.order_slot \
           WHERE (p.status = '{pending}' OR (p.status = '{failed}' AND p.closed_at IS NULL)) \
             AND p.next_check_at <= now() AND p.provider = ANY($4) \
             AND (o.status <> {waiting} OR p.status = '{failed}' \
                  OR p.created_at <= now() - make_interval(secs => $2)) \
           ORDER BY p.next_check_at LIMIT $1 FOR UPDATE OF p SKIP LOCKED) \
         UPDATE payments p SET checks = p.checks + 1, \
           next_check_at = now() + make_interval(secs => least($3, power(2, least(p.checks, 20)))) \
         FROM due WHERE p.payment_no = due.payment_no \
         RETURNING p.payment_no, p.provider, p.provider_ref, due.to_close",
        waiting = OrderStatus::WaitingPay.sql(),
        pending = PaymentStatus::Pending.as_str(),
        failed = PaymentStatus::Failed.as_str(),
    ))
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(query_after_secs)
    .bind::<BigInt, _>(max_secs)
    .bind::<diesel::sql_types::Array<Text>, _>(providers)
    .load(conn)
}

/// The open payments of providers other than `providers`, counted by
/// provider: payments nothing here can close, query or refund.
pub fn unrouted(conn: &mut PgConn, providers: &[String]) -> QueryResult<Vec<(String, i64)>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        provider: String,
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let rows: Vec<Row> = diesel::sql_query(format!(
        "SELECT provider, count(*) AS n FROM payments \
         WHERE provider <> ALL($1) \
           AND (status IN ('{}', '{}', '{}') OR (status = '{}' AND closed_at IS NULL)) \
         GROUP BY provider",
        PaymentStatus::Pending.as_str(),
        PaymentStatus::RefundRequired.as_str(),
        PaymentStatus::Refunding.as_str(),
        PaymentStatus::Failed.as_str(),
    ))
    .bind::<diesel::sql_types::Array<Text>, _>(providers)
    .load(conn)?;
    Ok(rows.into_iter().map(|r| (r.provider, r.n)).collect())
}

/// The refund of a PAID order an admin asked for (an after-sale refund):
/// its payment goes REFUNDING, and the refund is sent by the sweeper. The
/// order stays PAID and its stock sold (docs/SPEC.md).
#[derive(Debug)]
pub enum AfterSale {
    NotFound,
    InvalidState,
    Refund(refunds::RefundRow),
}

/// Writes the after-sale refund of `order_no`, or returns the one written.
pub fn refund_paid_order(conn: &mut PgConn, order_no: i64, reason: &str) -> QueryResult<AfterSale> {
    conn.transaction(|conn| {
        let status: Option<OrderStatus> = orders::table
            .find(order_no)
            .filter(orders::user_slot.eq(seckill_order_slot(order_no)))
            .select(orders::status)
            .for_update()
            .first(conn)
            .optional()?;
        let Some(status) = status else {
            return Ok(AfterSale::NotFound);
        };
        // The payment whose capture paid the order: never another capture
        // of it (a late payment, refunded on its own).
        let paid: Option<Payment> = payments::table
            .filter(payments::order_no.eq(order_no))
            .filter(payments::pays_order)
            .select(Payment::as_select())
            .for_update()
            .first(conn)
            .optional()?;
        let Some(paid) = paid.filter(|_| status == OrderStatus::Paid) else {
            return Ok(AfterSale::InvalidState);
        };
        if let Some(existing) = refunds::find_for_payment(conn, paid.payment_no)? {
            return Ok(AfterSale::Refund(existing));
        }
        let refund = refunds::create(
            conn,
            paid.payment_no,
            paid.amount_cents,
            RefundKind::AfterSale,
            reason,
        )?;
        diesel::update(payments::table.find(paid.payment_no))
            .set((
                payments::status.eq(PaymentStatus::Refunding.as_str()),
                payments::updated_at.eq(diesel::dsl::now),
            ))
            .execute(conn)?;
        Ok(AfterSale::Refund(refund))
    })
}

fn settle(
    conn: &mut PgConn,
    payment_no: i64,
    status: PaymentStatus,
    txn: Option<&str>,
    paid_at: Option<DateTime<Utc>>,
) -> QueryResult<()> {
    diesel::sql_query(
        "UPDATE payments SET status = $2, provider_txn_id = COALESCE($3, provider_txn_id), \
         paid_at = $4, updated_at = now() WHERE payment_no = $1",
    )
    .bind::<BigInt, _>(payment_no)
    .bind::<Text, _>(status.as_str())
    .bind::<Nullable<Text>, _>(txn)
    .bind::<Nullable<Timestamptz>, _>(paid_at)
    .execute(conn)?;
    Ok(())
}

/// The `code_url` of the pending payment of the caller's order, if the
/// provider gave one.
pub fn pending_code_url(
    conn: &mut PgConn,
    order_no: OrderNo,
    user_id: UserId,
) -> QueryResult<Option<String>> {
    let checkout: Option<Option<serde_json::Value>> = payments::table
        .inner_join(orders::table)
        .filter(payments::order_no.eq(order_no.get()))
        .filter(orders::user_slot.eq(user_slot_column(user_id.get())))
        .filter(orders::user_id.eq(user_id.get()))
        .filter(payments::status.eq(PaymentStatus::Pending.as_str()))
        .select(payments::checkout)
        .first(conn)
        .optional()?;
    Ok(checkout
        .flatten()
        .and_then(|c| c["code_url"].as_str().map(str::to_owned)))
}

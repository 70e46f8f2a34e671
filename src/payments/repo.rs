//! Payment rows: intents and the one transaction that applies a callback.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use serde::Serialize;

use super::provider::Callback;
use crate::bus::events::OrderPaid;
use crate::coupons::repo as coupons;
use crate::domain::UserId;
use crate::ids::{OrderNo, PaymentNo};
use crate::orders::OrderStatus;
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
    /// The pending payment (new or existing).
    Pending(Payment),
}

/// Creates the order's pending payment, or returns the one already pending.
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

/// A FAILED callback: the pending payment becomes FAILED (the order still
/// awaits payment); a payment already settled is a duplicate.
fn mark_failed(conn: &mut PgConn, payment_no: i64) -> QueryResult<CallbackOutcome> {
    let pending = payments::status.eq(PaymentStatus::Pending.as_str());
    let n = diesel::update(payments::table.find(payment_no).filter(pending))
        .set((
            payments::status.eq(PaymentStatus::Failed.as_str()),
            payments::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)?;
    Ok(if n == 1 {
        CallbackOutcome::MarkedFailed
    } else {
        CallbackOutcome::Duplicate
    })
}

/// Applies a verified callback in ONE transaction (SPEC step 5). The
/// payment row is locked first, so concurrent duplicates serialize and all
/// but the first see a settled payment.
pub fn apply_callback(
    conn: &mut PgConn,
    payment_no: PaymentNo,
    order_no: OrderNo,
    cb: &Callback,
) -> QueryResult<CallbackOutcome> {
    let (payment_no, order_no) = (payment_no.get(), order_no.get());
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
        if payment.order_no != order_no {
            return Ok(CallbackOutcome::OrderMismatch);
        }
        if payment.amount_cents != cb.amount_cents {
            return Ok(CallbackOutcome::AmountMismatch);
        }
        if PaymentStatus::parse(&cb.status) == Some(PaymentStatus::Failed) {
            return mark_failed(conn, payment_no);
        }
        if PaymentStatus::parse(&payment.status).is_some_and(PaymentStatus::is_settled) {
            return Ok(CallbackOutcome::Duplicate);
        }
        let paid_at = cb.paid_at.unwrap_or_else(Utc::now);
        let paid: Option<PaidOrder> = diesel::sql_query(format!(
            "UPDATE orders SET status = {}, paid_at = $2, updated_at = now() \
             WHERE order_no = $1 AND status = {} \
             RETURNING order_no, activity_id, user_id, quantity, amount_cents",
            OrderStatus::Paid.sql(),
            OrderStatus::WaitingPay.sql()
        ))
        .bind::<BigInt, _>(order_no)
        .bind::<Timestamptz, _>(paid_at)
        .get_result(conn)
        .optional()?;
        let txn = cb.provider_txn_id.as_deref();
        let Some(order) = paid else {
            // Closed, cancelled, or paid by another payment: never revived,
            // never charged twice.
            settle(conn, payment_no, PaymentStatus::RefundRequired, txn, None)?;
            return Ok(CallbackOutcome::RefundRequired);
        };
        settle(conn, payment_no, PaymentStatus::Success, txn, Some(paid_at))?;
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

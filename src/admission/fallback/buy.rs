//! One fallback purchase: every check under the activity's stock row
//! lock, then the order and its LOCK flow row written in the same
//! transaction (`docs/FALLBACK.md`).

use std::sync::Arc;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, SmallInt, Text, Timestamptz};

use super::{Decided, Declined, Health, Mode, secs_of, unix_ms};
use crate::domain::{ActivityId, CouponId};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::partition::user_slot_column;
use crate::stock::{self, Units};
use crate::store::PgConn;

/// One fallback purchase, as the blocking task runs it.
pub(super) struct Buy {
    pub(super) activity_id: ActivityId,
    pub(super) user_id: i64,
    pub(super) request_id: String,
    pub(super) quantity: i32,
    pub(super) coupon_id: Option<CouponId>,
    /// The sale clock (windows).
    pub(super) now_ms: i64,
    /// Whether this instance may move the activity from REDIS to
    /// DATABASE, asked after the stock row is locked.
    pub(super) entry: Arc<Health>,
    /// How old the activity's move to the database must be before it
    /// sells through it (`admission.modes_trusted_for_ms`).
    pub(super) hold_ms: i64,
}

#[derive(QueryableByName)]
struct Available {
    #[diesel(sql_type = Integer)]
    available: i32,
}

/// A warmed activity's sale window and the buyer's order under this
/// request id, as both reads of a fallback purchase see them.
#[derive(QueryableByName)]
struct Window {
    #[diesel(sql_type = Timestamptz)]
    start_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = Timestamptz)]
    end_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = Bool)]
    warmed: bool,
    /// The order of this request id, if it has one.
    #[diesel(sql_type = Nullable<BigInt>)]
    existing: Option<i64>,
}

impl Window {
    /// Warmed, and open at `now_ms` (the sale clock).
    fn open(&self, now_ms: i64) -> bool {
        self.warmed
            && self.start_at.timestamp_millis() <= now_ms
            && now_ms < self.end_at.timestamp_millis()
    }
}

/// The activity, read after its stock row is locked.
#[derive(QueryableByName)]
struct Locked {
    #[diesel(sql_type = Text)]
    admission: String,
    #[diesel(embed)]
    window: Window,
    #[diesel(sql_type = Integer)]
    per_user_limit: i32,
    #[diesel(sql_type = BigInt)]
    price_cents: i64,
    #[diesel(sql_type = Integer)]
    pay_timeout_secs: i32,
    /// Units of the buyer's live orders.
    #[diesel(sql_type = BigInt)]
    held: i64,
    /// How long ago the admission last moved (the database's clock, ms).
    #[diesel(sql_type = BigInt)]
    moved_ms: i64,
}

/// The read before the lock.
#[derive(QueryableByName)]
struct Peek {
    #[diesel(sql_type = Integer)]
    available: i32,
    #[diesel(embed)]
    window: Window,
}

impl Buy {
    /// The transaction: every check under the stock row's lock, then the
    /// writes; a refusal writes nothing.
    pub(super) fn run(&self, conn: &mut PgConn) -> QueryResult<Result<Decided, Declined>> {
        // One read without the lock first: a replay, a closed window or a
        // sale with too little left is answered as the naive design
        // answers its sold-out buyers, without queueing behind every
        // purchase on the stock row. Everything is checked again under
        // the lock before anything is written.
        let Some(peek) = diesel::sql_query(
            "SELECT s.available, a.start_at, a.end_at, a.warmed_at IS NOT NULL AS warmed, \
               (SELECT order_no FROM orders \
                WHERE user_slot = $4 AND activity_id = $1 AND user_id = $2 AND request_id = $3) \
               AS existing \
             FROM stock s JOIN activities a ON a.id = s.activity_id WHERE s.activity_id = $1",
        )
        .bind::<BigInt, _>(self.activity_id)
        .bind::<BigInt, _>(self.user_id)
        .bind::<Text, _>(&self.request_id)
        .bind::<SmallInt, _>(user_slot_column(self.user_id))
        .get_result::<Peek>(conn)
        .optional()?
        else {
            return Ok(Err(Declined::NotActive));
        };
        if let Some(order_no) = peek.window.existing {
            return Ok(Ok(Decided::Replayed(OrderNo::new(order_no))));
        }
        if !peek.window.open(self.now_ms) {
            return Ok(Err(Declined::NotActive));
        }
        if peek.available < self.quantity {
            return Ok(Err(Declined::SoldOut));
        }
        self.under_the_lock(conn)
    }

    fn under_the_lock(&self, conn: &mut PgConn) -> QueryResult<Result<Decided, Declined>> {
        conn.transaction(|conn| {
            let (a, mode) = match self.lock_and_check(conn)? {
                Ok(checked) => checked,
                Err(answer) => return Ok(answer),
            };
            if mode == Mode::Redis {
                // The stock row is ours already: the repo's lock of it is
                // granted at once (a savepoint, on this one purchase).
                crate::activities::repo::switch_admission(
                    conn,
                    self.activity_id,
                    &[Mode::Redis],
                    Mode::Database,
                )?;
                tracing::warn!(
                    activity_id = %self.activity_id,
                    "activity moved to the database fallback"
                );
                if self.hold_ms > 0 {
                    // Committed, and nothing sold: an instance that read
                    // the modes before this and cannot read them now sells
                    // from Redis for up to the hold.
                    return Ok(Err(Declined::Moving(secs_of(self.hold_ms))));
                }
            } else if a.moved_ms < self.hold_ms {
                return Ok(Err(Declined::Moving(secs_of(self.hold_ms - a.moved_ms))));
            }
            let order_no = self.number(conn)?;
            let Some(amount) = self.amount(conn, &a, order_no)? else {
                return Ok(Err(Declined::CouponInvalid));
            };
            self.write(conn, &a, order_no, amount)?;
            Ok(Ok(Decided::Created(OrderNo::new(order_no))))
        })
    }

    /// Locks the stock row, then checks everything under the lock: the
    /// activity and its mode, or the answer that ends the purchase.
    fn lock_and_check(
        &self,
        conn: &mut PgConn,
    ) -> QueryResult<Result<(Locked, Mode), Result<Decided, Declined>>> {
        // The lock first, alone: a statement that waited for it sees the
        // locked row's newest version but the other rows of its join as
        // they were when it started, so the mode is read after it, by a
        // statement of its own (READ COMMITTED: a fresh snapshot).
        let Some(available) =
            diesel::sql_query("SELECT available FROM stock WHERE activity_id = $1 FOR UPDATE")
                .bind::<BigInt, _>(self.activity_id)
                .get_result::<Available>(conn)
                .optional()?
        else {
            return Ok(Err(Err(Declined::NotActive)));
        };
        let a: Locked = diesel::sql_query(format!(
            "SELECT admission, start_at, end_at, per_user_limit, price_cents, \
               pay_timeout_secs, warmed_at IS NOT NULL AS warmed, \
               (SELECT order_no FROM orders \
                WHERE user_slot = $4 AND activity_id = $1 AND user_id = $2 AND request_id = $3) \
               AS existing, \
               (SELECT COALESCE(sum(quantity), 0)::bigint FROM orders \
                WHERE user_slot = $4 AND activity_id = $1 AND user_id = $2 AND status IN ({})) \
               AS held, \
               COALESCE(EXTRACT(EPOCH FROM now() - admission_since) * 1000, 0)::bigint \
               AS moved_ms \
             FROM activities WHERE id = $1",
            OrderStatus::sql_list(&OrderStatus::HOLDING)
        ))
        .bind::<BigInt, _>(self.activity_id)
        .bind::<BigInt, _>(self.user_id)
        .bind::<Text, _>(&self.request_id)
        .bind::<SmallInt, _>(user_slot_column(self.user_id))
        .get_result(conn)?;
        if !a.window.open(self.now_ms) {
            return Ok(Err(Err(Declined::NotActive)));
        }
        let mode = Mode::parse(&a.admission);
        if mode == Mode::Restoring || (mode == Mode::Redis && !self.entry.may_enter(unix_ms())) {
            return Ok(Err(Err(Declined::NotInFallback)));
        }
        if let Some(order_no) = a.window.existing {
            return Ok(Err(Ok(Decided::Replayed(OrderNo::new(order_no)))));
        }
        let refused = if self.quantity > a.per_user_limit {
            Some(Declined::TooMany)
        } else if a.held + i64::from(self.quantity) > i64::from(a.per_user_limit) {
            Some(Declined::LimitExceeded)
        } else if available.available < self.quantity {
            Some(Declined::SoldOut)
        } else {
            None
        };
        Ok(match refused {
            Some(declined) => Err(Err(declined)),
            None => Ok((a, mode)),
        })
    }

    /// What the buyer pays: the gross, less the coupon's discount once the
    /// coupon is locked for this order; `None` if the coupon cannot be used.
    fn amount(&self, conn: &mut PgConn, a: &Locked, order_no: i64) -> QueryResult<Option<i64>> {
        let gross = a.price_cents.saturating_mul(i64::from(self.quantity));
        let Some(coupon_id) = self.coupon_id else {
            return Ok(Some(gross));
        };
        // Decided now, in the purchase's own transaction.
        let now_ms = chrono::Utc::now().timestamp_millis();
        let discount = crate::coupons::repo::lock_for_order(
            conn,
            coupon_id,
            self.user_id,
            order_no,
            gross,
            now_ms,
        )?;
        Ok(discount.map(|discount| gross.saturating_sub(discount).max(0)))
    }

    /// The order, as WAITING_PAY, and its units' LOCK through the ledger.
    fn write(&self, conn: &mut PgConn, a: &Locked, order_no: i64, amount: i64) -> QueryResult<()> {
        diesel::sql_query(format!(
            "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, \
               amount_cents, coupon_id, status, pay_deadline, user_slot) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, {}, now() + make_interval(secs => $8), $9)",
            OrderStatus::WaitingPay.sql()
        ))
        .bind::<BigInt, _>(order_no)
        .bind::<Text, _>(&self.request_id)
        .bind::<BigInt, _>(self.activity_id)
        .bind::<BigInt, _>(self.user_id)
        .bind::<Integer, _>(self.quantity)
        .bind::<BigInt, _>(amount)
        .bind::<Nullable<BigInt>, _>(self.coupon_id)
        .bind::<diesel::sql_types::Double, _>(f64::from(a.pay_timeout_secs))
        .bind::<SmallInt, _>(user_slot_column(self.user_id))
        .execute(conn)?;
        let units = Units {
            activity_id: self.activity_id,
            order_no,
            quantity: self.quantity,
        };
        if !stock::lock(conn, &[units])?.is_empty() {
            // Checked under the row lock above; never expected.
            return Err(diesel::result::Error::RollbackTransaction);
        }
        Ok(())
    }

    /// A number of the database's instance id, carrying its buyer's slot
    /// (the order table's partition, a sharded activity's shard).
    fn number(&self, conn: &mut PgConn) -> QueryResult<i64> {
        crate::ids::database_number(conn, Some(crate::ids::user_gene(self.user_id)))
    }
}

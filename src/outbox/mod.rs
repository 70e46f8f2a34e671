//! Transactional outbox (SPEC step 7): events born inside a database
//! transaction are written there as rows, and the relay publishes them
//! afterwards, at least once. Every consumer of them is idempotent.

pub mod relay;

use diesel::prelude::*;
use serde::Serialize;

use crate::store::PgConn;
use crate::store::schema::outbox;

/// Logical topic of cancelled / closed orders.
pub const STOCK_RELEASED: &str = "stock.released";
/// Logical topic of paid orders.
pub const ORDER_PAID: &str = "order.paid";

/// Writes one event in the caller's transaction.
pub fn enqueue<T: Serialize>(
    conn: &mut PgConn,
    topic: &str,
    key: &str,
    event: &T,
) -> QueryResult<()> {
    let payload = serde_json::to_value(event)
        .map_err(|e| diesel::result::Error::SerializationError(Box::new(e)))?;
    diesel::insert_into(outbox::table)
        .values((
            outbox::topic.eq(topic),
            outbox::event_key.eq(key),
            outbox::payload.eq(payload),
        ))
        .execute(conn)?;
    Ok(())
}

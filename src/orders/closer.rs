//! The payment-timeout closer (SPEC step 6): overdue WAITING_PAY orders are
//! closed in batches, every `workers.closer_interval_ms`.

use std::sync::Arc;
use std::time::Duration;

use super::OrderStatus;
use super::events::{OrderEvents, StatusChange};
use super::transitions;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};
use crate::worker::WorkerHandle;

/// Starts the closer loop on the current runtime; the orders it closes are
/// announced on `events`.
pub fn spawn(
    db: PgPool,
    interval: Duration,
    batch: i64,
    metrics: Metrics,
    events: Arc<OrderEvents>,
) -> WorkerHandle {
    WorkerHandle::spawn(|stop| async move {
        while !stop.is_cancelled() {
            // Drain every overdue order before sleeping again.
            loop {
                match store::run(&db, move |conn| {
                    Ok(transitions::close_overdue(conn, batch)?)
                })
                .await
                {
                    Ok(closed) => {
                        let n = closed.len();
                        metrics.orders_closed.inc_by(n as u64);
                        let changes: Vec<StatusChange> = closed
                            .into_iter()
                            .map(|order_no| StatusChange {
                                order_no,
                                status: OrderStatus::Closed,
                            })
                            .collect();
                        events.publish(&changes).await;
                        if (n as i64) < batch {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = format!("{e:#}"), "timeout closer pass failed");
                        break;
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    })
}

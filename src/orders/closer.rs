//! The payment-timeout closer (SPEC step 6): overdue WAITING_PAY orders are
//! closed in batches, every `workers.closer_interval_ms`.

use std::time::Duration;

use super::transitions;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};
use crate::worker::WorkerHandle;

/// Starts the closer loop on the current runtime.
pub fn spawn(db: PgPool, interval: Duration, batch: i64, metrics: Metrics) -> WorkerHandle {
    WorkerHandle::spawn(|stop| async move {
        while !stop.is_cancelled() {
            // Drain every overdue order before sleeping again.
            loop {
                match store::run(&db, move |conn| {
                    Ok(transitions::close_overdue(conn, batch)?)
                })
                .await
                {
                    Ok(n) => {
                        metrics.orders_closed.inc_by(n as u64);
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

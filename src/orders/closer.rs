//! The payment-timeout closer (SPEC step 6): overdue WAITING_PAY orders are
//! closed in batches, every `workers.closer_interval_ms`.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::transitions;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

/// A running closer.
pub struct CloserHandle {
    shutdown: CancellationToken,
    join: JoinHandle<()>,
}

impl CloserHandle {
    /// Finishes the batch in hand and stops.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
    }
}

/// Starts the closer loop on the current runtime.
pub fn spawn(db: PgPool, interval: Duration, batch: i64, metrics: Metrics) -> CloserHandle {
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let join = tokio::spawn(async move {
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
    });
    CloserHandle { shutdown, join }
}

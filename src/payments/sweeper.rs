//! The payment sweeper: what happens at the provider after the pay call,
//! every `payment.sweep_interval_ms`, from any instance (rows are leased,
//! and every call is idempotent at the provider):
//!
//! - a PENDING payment whose order is no longer payable (closed on
//!   timeout, cancelled) is closed at the provider; one the buyer paid
//!   first is queried and takes the late-payment way (a refund);
//! - a PENDING payment with no callback `payment.query_after_secs` after
//!   its creation is queried, and the answer is applied through the same
//!   transition as a callback (whichever comes first applies);
//! - a refund is sent, or once the provider has it, asked about, until it
//!   is REFUNDED or REFUND_FAILED.
//!
//! A call without an answer to act on is made again after a backoff
//! (1 s, doubling, at most `payment.retry_max_secs`); it is never undone.

use std::sync::Arc;
use std::time::Duration;

use super::provider::{
    Charge, ChargeOutcome, CloseOutcome, PaymentProvider, PaymentRef, ProviderError, RefundRef,
    RefundReport, RefundRequest, RefundState,
};
use super::refunds::{self, DueRefund, RefundOutcome};
use super::repo::{self, CallbackOutcome, DuePayment};
use super::statement;
use crate::config::PaymentSettings;
use crate::metrics::Metrics;
use crate::orders::OrderStatus;
use crate::orders::events::{OrderEvents, StatusChange};
use crate::store::{self, PgPool};
use crate::worker::WorkerHandle;

/// Rows leased per round, of each kind.
const BATCH: i64 = 50;

/// What the sweeper works with.
#[derive(Clone)]
pub struct Sweeper {
    pub db: PgPool,
    pub provider: Arc<dyn PaymentProvider>,
    pub settings: PaymentSettings,
    pub metrics: Metrics,
    pub events: Arc<OrderEvents>,
    /// When yesterday's statement was last asked for (at most every 10
    /// minutes until it is kept).
    pub statement_tried: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// Starts the sweeper loop.
pub fn spawn(sweeper: Sweeper) -> WorkerHandle {
    WorkerHandle::spawn(|stop| async move {
        while !stop.is_cancelled() {
            if let Err(e) = sweeper.round().await {
                tracing::warn!(error = format!("{e:#}"), "payment sweeper round failed");
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(sweeper.settings.sweep_interval_ms) => {}
            }
        }
    })
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX).max(1)
}

impl Sweeper {
    /// One round: the pending payments due, then the refunds due.
    pub async fn round(&self) -> anyhow::Result<()> {
        let (after, max) = (
            i64::try_from(self.settings.query_after_secs.as_secs()).unwrap_or(i64::MAX),
            secs(self.settings.retry_max_secs),
        );
        let due = store::run(&self.db, move |conn| {
            Ok(repo::lease_pending(conn, BATCH, after, max)?)
        })
        .await?;
        for payment in due {
            self.follow_payment(payment).await;
        }
        let due = store::run(&self.db, move |conn| {
            Ok(refunds::lease_due(conn, BATCH, max)?)
        })
        .await?;
        for refund in due {
            self.follow_refund(refund).await;
        }
        self.daily_statement().await;
        Ok(())
    }

    /// Yesterday's statement, once it is made (WeChat Pay: after 10:00
    /// China time) and until its report is kept.
    async fn daily_statement(&self) {
        let name = self.provider.name();
        let now = chrono::Utc::now();
        if name != "wechatpay" || !statement::due(now) {
            return;
        }
        {
            let mut last = self
                .statement_tried
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(600)) {
                return;
            }
            *last = Some(std::time::Instant::now());
        }
        let date = statement::yesterday(now);
        match store::run(&self.db, move |conn| Ok(statement::kept(conn, name, date)?)).await {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::info!(
                    error = format!("{e:#}"),
                    "statement: the database did not answer"
                );
                return;
            }
        }
        if let Err(e) = statement::run(&self.db, self.provider.as_ref(), date).await {
            tracing::warn!(error = format!("{e:#}"), bill_date = %date, "statement reconciliation failed; tried again in 10 minutes");
        }
    }

    fn count(&self, call: &str, result: Result<(), &ProviderError>) {
        let outcome = match result {
            Ok(()) => "ok",
            Err(ProviderError::Unknown(_)) => "unknown",
            Err(ProviderError::Refused { .. }) => "refused",
        };
        self.metrics
            .provider_calls
            .with_label_values(&[call, outcome])
            .inc();
    }

    async fn follow_payment(&self, due: DuePayment) {
        let no = due.payment_no;
        let payment = PaymentRef {
            payment_no: no,
            provider_ref: due.provider_ref.clone(),
        };
        let charge = if due.to_close {
            let closed = self.provider.close(&payment).await;
            self.count("close", closed.as_ref().map(|_| ()));
            match closed {
                Ok(CloseOutcome::Closed) => Ok(Charge {
                    payment_no: no,
                    order_no: None,
                    amount_cents: 0,
                    outcome: ChargeOutcome::Closed,
                    txn_id: None,
                    paid_at: None,
                }),
                Ok(CloseOutcome::AlreadyPaid) => self.query(&payment).await,
                Err(e) => Err(e),
            }
        } else {
            self.query(&payment).await
        };
        match charge {
            Ok(charge) => {
                if let Err(e) = self.apply_charge(charge).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        payment_no = no,
                        "a provider's answer not applied; asked again later"
                    );
                }
            }
            Err(e) => {
                tracing::info!(error = %e, payment_no = no, close = due.to_close, "payment provider gave no answer to act on; asked again later")
            }
        }
    }

    async fn query(&self, payment: &PaymentRef) -> Result<Charge, ProviderError> {
        let answer = self.provider.query(payment).await;
        self.count("query", answer.as_ref().map(|_| ()));
        answer
    }

    /// Applies a charge as a callback would be, and announces a paid order.
    pub async fn apply_charge(&self, charge: Charge) -> anyhow::Result<CallbackOutcome> {
        let outcome = store::run(&self.db, move |conn| {
            Ok((repo::apply_charge(conn, &charge)?, charge.payment_no))
        })
        .await?;
        let (outcome, payment_no) = outcome;
        self.metrics
            .callbacks
            .with_label_values(&[outcome.label()])
            .inc();
        if outcome == CallbackOutcome::Applied {
            announce_paid(&self.db, &self.events, payment_no).await;
        }
        Ok(outcome)
    }

    async fn follow_refund(&self, due: DueRefund) {
        let payment = PaymentRef {
            payment_no: due.payment_no,
            provider_ref: due.payment_ref.clone(),
        };
        let answer = if due.accepted {
            let refund = RefundRef {
                refund_no: due.refund_no,
                payment,
                provider_refund_id: due.provider_refund_id.clone(),
            };
            let a = self.provider.query_refund(&refund).await;
            self.count("query_refund", a.as_ref().map(|_| ()));
            a
        } else {
            let request = RefundRequest {
                refund_no: due.refund_no,
                payment,
                amount_cents: due.amount_cents,
                total_cents: due.total_cents,
                reason: due.reason.clone(),
            };
            let a = self.provider.refund(&request).await;
            self.count("refund", a.as_ref().map(|_| ()));
            a
        };
        let report = match answer {
            Ok(report) => report,
            Err(ProviderError::Refused { code, message }) => RefundReport {
                refund_no: due.refund_no,
                provider_refund_id: None,
                state: RefundState::Failed(format!("{code}: {message}")),
            },
            Err(ProviderError::Unknown(e)) => {
                tracing::info!(error = %e, refund_no = due.refund_no, attempts = due.attempts, "refund: no answer to act on; sent again later");
                let no = due.refund_no;
                let _ =
                    store::run(&self.db, move |conn| Ok(refunds::note_error(conn, no, &e)?)).await;
                return;
            }
        };
        if let Err(e) = apply_refund(
            &self.db,
            &self.metrics,
            report,
            self.settings.query_after_secs,
        )
        .await
        {
            tracing::warn!(
                error = format!("{e:#}"),
                refund_no = due.refund_no,
                "a refund's answer not applied; asked again later"
            );
        }
    }
}

/// Applies a refund report (an answer, a query, a callback) once, and
/// counts (and logs, for the alert) a settled one.
pub async fn apply_refund(
    db: &PgPool,
    metrics: &Metrics,
    report: RefundReport,
    query_after: Duration,
) -> anyhow::Result<RefundOutcome> {
    let state = report.state.clone();
    let refund_no = report.refund_no;
    let after = i64::try_from(query_after.as_secs()).unwrap_or(i64::MAX);
    let outcome = store::run(db, move |conn| Ok(refunds::apply(conn, &report, after)?)).await?;
    if outcome == RefundOutcome::Settled {
        match &state {
            RefundState::Succeeded => {
                metrics
                    .refunds
                    .with_label_values(&[refunds::REFUNDED])
                    .inc();
            }
            RefundState::Failed(reason) => {
                metrics
                    .refunds
                    .with_label_values(&[refunds::REFUND_FAILED])
                    .inc();
                tracing::error!(
                    refund_no,
                    reason,
                    "a refund was refused for good: the buyer has not got the money back"
                );
            }
            RefundState::Processing => {}
        }
    }
    Ok(outcome)
}

/// Tells the order's streams it is PAID.
pub async fn announce_paid(db: &PgPool, events: &OrderEvents, payment_no: i64) {
    use crate::store::schema::payments;
    use diesel::prelude::*;
    let order = store::run(db, move |conn| {
        Ok(payments::table
            .find(payment_no)
            .select(payments::order_no)
            .first::<i64>(conn)?)
    })
    .await;
    if let Ok(order_no) = order {
        events
            .publish(&[StatusChange {
                order_no,
                status: OrderStatus::Paid,
            }])
            .await;
    }
}

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
//! - a FAILED payment the provider has not closed is queried while its
//!   order awaits payment (the buyer may still pay it there), and closed
//!   once the order is no longer payable;
//! - a refund is sent, or once the provider has it, asked about, until it
//!   is REFUNDED or REFUND_FAILED.
//!
//! Every call goes to the payment's own provider. A call without an
//! answer to act on (unknown, or the provider's "try again") is made again
//! after a backoff (1 s, doubling, at most `payment.retry_max_secs`); it is
//! never undone. Only a provider's final word ends a refund.

use std::sync::Arc;
use std::time::Duration;

use super::Providers;
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
    /// Every configured provider: a row's calls go to its own.
    pub providers: Arc<Providers>,
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
        sweeper.warn_of_unrouted().await;
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
    /// Logs, once at start, the open payments of providers not configured
    /// here: nothing can close, query or refund them until they are.
    async fn warn_of_unrouted(&self) {
        let names = self.providers.names();
        match store::run(&self.db, move |conn| Ok(repo::unrouted(conn, &names)?)).await {
            Ok(rows) => {
                for (provider, open) in rows {
                    tracing::error!(
                        provider,
                        open,
                        "open payments of a provider not configured here: configure it again \
                         until they are settled (docs/OPERATIONS.md, \"Switching payment providers\")"
                    );
                }
            }
            Err(e) => tracing::info!(
                error = format!("{e:#}"),
                "the payments of unconfigured providers were not counted"
            ),
        }
    }

    /// One round: the pending payments due, then the refunds due.
    pub async fn round(&self) -> anyhow::Result<()> {
        let (after, max) = (
            i64::try_from(self.settings.query_after_secs.as_secs()).unwrap_or(i64::MAX),
            secs(self.settings.retry_max_secs),
        );
        let names = self.providers.names();
        let due = store::run(&self.db, {
            let names = names.clone();
            move |conn| Ok(repo::lease_pending(conn, BATCH, after, max, &names)?)
        })
        .await?;
        for payment in due {
            let Some(provider) = self.providers.get(&payment.provider).cloned() else {
                continue;
            };
            self.follow_payment(provider.as_ref(), payment).await;
        }
        let due = store::run(&self.db, move |conn| {
            Ok(refunds::lease_due(conn, BATCH, max, &names)?)
        })
        .await?;
        for refund in due {
            let Some(provider) = self.providers.get(&refund.provider).cloned() else {
                continue;
            };
            self.follow_refund(provider.as_ref(), refund).await;
        }
        self.daily_statement().await;
        Ok(())
    }

    /// Yesterday's statement, once it is made (WeChat Pay: after 10:00
    /// China time) and until its report is kept.
    async fn daily_statement(&self) {
        let Some(provider) = self.providers.get("wechatpay").cloned() else {
            return;
        };
        let name = provider.name();
        let now = chrono::Utc::now();
        if !statement::due(now) {
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
        if let Err(e) = statement::run(&self.db, provider.as_ref(), date).await {
            tracing::warn!(error = format!("{e:#}"), bill_date = %date, "statement reconciliation failed; tried again in 10 minutes");
        }
    }

    fn count(&self, call: &str, result: Result<(), &ProviderError>) {
        count_call(&self.metrics, call, result);
    }

    async fn follow_payment(&self, provider: &dyn PaymentProvider, due: DuePayment) {
        let no = due.payment_no;
        let payment = PaymentRef {
            payment_no: no,
            provider_ref: due.provider_ref.clone(),
        };
        let charge = if due.to_close {
            close(provider, &self.metrics, &payment).await
        } else {
            self.query(provider, &payment).await
        };
        match charge {
            Ok(charge) => {
                if let Err(e) = self.apply_charge(provider.name(), charge).await {
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

    async fn query(
        &self,
        provider: &dyn PaymentProvider,
        payment: &PaymentRef,
    ) -> Result<Charge, ProviderError> {
        let answer = provider.query(payment).await;
        self.count("query", answer.as_ref().map(|_| ()));
        answer
    }

    /// Applies `provider`'s charge as a callback would be, and announces a
    /// paid order.
    pub async fn apply_charge(
        &self,
        provider: &'static str,
        charge: Charge,
    ) -> anyhow::Result<CallbackOutcome> {
        apply_charge(&self.db, &self.metrics, &self.events, provider, charge).await
    }

    async fn follow_refund(&self, provider: &dyn PaymentProvider, due: DueRefund) {
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
            let a = provider.query_refund(&refund).await;
            self.count("query_refund", a.as_ref().map(|_| ()));
            match a {
                // Only the refund's own state ends it, never a query's error.
                Err(ProviderError::Refused { code, message }) => {
                    // The provider has no such refund: it never took it,
                    // so it is sent again under the same number.
                    tracing::warn!(
                        refund_no = due.refund_no,
                        code,
                        message,
                        "refund: the provider does not know it; sent again"
                    );
                    let (no, why) = (due.refund_no, format!("{code}: {message}"));
                    let _ = store::run(&self.db, move |conn| Ok(refunds::resend(conn, no, &why)?))
                        .await;
                    return;
                }
                other => other,
            }
        } else {
            let request = RefundRequest {
                refund_no: due.refund_no,
                payment,
                amount_cents: due.amount_cents,
                total_cents: due.total_cents,
                reason: due.reason.clone(),
            };
            let a = provider.refund(&request).await;
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
            Err(e) => {
                tracing::info!(error = %e, refund_no = due.refund_no, attempts = due.attempts, "refund: no answer to act on; asked again later");
                let (no, why) = (due.refund_no, e.to_string());
                let _ = store::run(&self.db, move |conn| {
                    Ok(refunds::note_error(conn, no, &why)?)
                })
                .await;
                return;
            }
        };
        if let Err(e) = apply_refund(
            &self.db,
            &self.metrics,
            provider.name(),
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

/// Counts a call to a provider by how it ended.
pub fn count_call(metrics: &Metrics, call: &str, result: Result<(), &ProviderError>) {
    let outcome = match result {
        Ok(()) => "ok",
        Err(e) => e.label(),
    };
    metrics
        .provider_calls
        .with_label_values(&[call, outcome])
        .inc();
}

/// Closes `payment` at `provider`: where it stands then. One the buyer
/// paid first is queried, so that it takes the late-payment way.
pub async fn close(
    provider: &dyn PaymentProvider,
    metrics: &Metrics,
    payment: &PaymentRef,
) -> Result<Charge, ProviderError> {
    let closed = provider.close(payment).await;
    count_call(metrics, "close", closed.as_ref().map(|_| ()));
    match closed? {
        CloseOutcome::Closed => Ok(Charge::bare(payment.payment_no, ChargeOutcome::Closed)),
        CloseOutcome::AlreadyPaid => {
            let answer = provider.query(payment).await;
            count_call(metrics, "query", answer.as_ref().map(|_| ()));
            answer
        }
    }
}

/// Applies `provider`'s report of a charge (a callback, a query's answer)
/// once, counts it, and announces a paid order.
pub async fn apply_charge(
    db: &PgPool,
    metrics: &Metrics,
    events: &OrderEvents,
    provider: &'static str,
    charge: Charge,
) -> anyhow::Result<CallbackOutcome> {
    let payment_no = charge.payment_no;
    let outcome = store::run(db, move |conn| {
        Ok(repo::apply_charge(conn, &charge, provider)?)
    })
    .await?;
    metrics
        .callbacks
        .with_label_values(&[outcome.label()])
        .inc();
    if outcome == CallbackOutcome::Applied {
        announce_paid(db, events, payment_no).await;
    }
    Ok(outcome)
}

/// Applies a refund report (an answer, a query, a callback) once, and
/// counts (and logs, for the alert) a settled one.
pub async fn apply_refund(
    db: &PgPool,
    metrics: &Metrics,
    provider: &'static str,
    report: RefundReport,
    query_after: Duration,
) -> anyhow::Result<RefundOutcome> {
    let state = report.state.clone();
    let refund_no = report.refund_no;
    let after = i64::try_from(query_after.as_secs()).unwrap_or(i64::MAX);
    let outcome = store::run(db, move |conn| {
        Ok(refunds::apply(conn, &report, provider, after)?)
    })
    .await?;
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

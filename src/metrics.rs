//! Prometheus metrics, served at `GET /metrics` in the text format.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Every metric the process exports, registered in one registry. Cheap to
/// clone (each metric is an `Arc` inside).
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// HTTP requests by route pattern, method and status.
    pub http_requests: IntCounterVec,
    /// HTTP latency by route pattern and method, in seconds.
    pub http_duration: HistogramVec,
    /// Purchase attempts by outcome (accepted, sold_out, duplicate, limited, …).
    pub admission: IntCounterVec,
    /// Latency of the admission script round trip, in seconds.
    pub lua_duration: Histogram,
    /// Latency from produce to delivery report of `order.requested`, in seconds.
    pub produce_duration: Histogram,
    /// Publishes that were not acknowledged, by outcome (queue_full,
    /// not_delivered, unknown).
    pub produce_errors: IntCounterVec,
    /// Purchases whose delivery outcome is unknown and whose event is being
    /// sent again in the background.
    pub deliveries_pending: IntGauge,
    /// Consumer clients rebuilt by the watchdog, by group.
    pub consumer_restarts: IntCounterVec,
    /// Kafka clients rebuilt because they were wedged while the broker
    /// answered a fresh client, by client (producer, progress, or the
    /// consumer's name).
    pub kafka_client_rebuilds: IntCounterVec,
    /// How long the order consumers have had messages waiting without
    /// committing any, in seconds (admission's BUSY and readiness read it).
    pub order_consumer_stalled_seconds: IntGauge,
    /// Messages per consumer batch.
    pub consumer_batch_size: Histogram,
    /// Consumed order events by result (created, failed, duplicate, …).
    pub consumer_events: IntCounterVec,
    /// Messages sent to a dead-letter topic.
    pub dead_letters: IntCounter,
    /// Outbox rows by status (NEW, RETRY, DEAD), refreshed by the relay.
    pub outbox_rows: IntGaugeVec,
    /// Payment callbacks by outcome (applied, duplicate, refund_required, …).
    pub callbacks: IntCounterVec,
    /// Orders closed by the payment timeout.
    pub orders_closed: IntCounter,
    /// Reservations given back to Redis from `stock.released`.
    pub stock_released: IntCounterVec,
    /// Reconciliation findings by what (difference | repair) and kind.
    pub reconcile: IntCounterVec,
    /// The snowflake instance id this process holds a lease on (-1: none).
    pub instance_id: IntGauge,
    /// Activities this instance answers SOLD_OUT for from memory.
    pub sold_out_activities: IntGauge,
    /// 1 while Redis answers this instance's probes, 0 while it does not.
    pub redis_up: IntGauge,
    /// Activities whose purchases go to the database (Redis fallback), by
    /// mode (database | restoring), as this instance last read them.
    pub admission_modes: IntGaugeVec,
    /// Order events whose event_id was applied before with a different
    /// payload (two instances minted one number): dead-lettered, alerting.
    pub event_conflicts: IntCounter,
    /// Order events not yet applied by the order consumers (−1: unknown);
    /// admission's consumer-lag backpressure reads it.
    pub order_consumer_lag: IntGauge,
    /// Stock units of each warm activity as reconciliation last read them,
    /// by activity, source (redis | db) and state (available | locked | sold).
    pub stock_units: IntGaugeVec,
    /// Open reservations in Redis of each warm activity, as reconciliation
    /// last read them (units in flight between admission and the database).
    pub open_reservations: IntGaugeVec,
    /// Activities the last reconciliation run found a difference in.
    pub reconcile_inconsistent: IntGauge,
    /// When reconciliation last ran to the end (unix seconds; 0: never).
    pub reconcile_last_run: IntGauge,
}

/// Label values every dashboard and alert reads, created at 0 on start so
/// each series exists before its first event (a `rate()` or an
/// `increase()` over a missing series is no data, not zero).
const ADMISSION_OUTCOMES: [&str; 12] = [
    "accepted",
    "accepted_fallback",
    "duplicate",
    "sold_out",
    "sold_out_memory",
    "limit_exceeded",
    "rate_limited",
    "busy",
    "not_active",
    "invalid_token",
    "retry_later",
    "pending",
];
const OUTBOX_STATUSES: [&str; 3] = ["NEW", "RETRY", "DEAD"];
const PRODUCE_ERRORS: [&str; 4] = ["queue_full", "not_delivered", "unknown", "unconfirmed"];
const CALLBACK_OUTCOMES: [&str; 3] = ["applied", "duplicate", "refund_required"];
/// The differences reconciliation counts (`what="difference"`).
const RECONCILE_DIFFERENCES: [&str; 4] = ["db_total", "db_locked", "db_sold", "redis_available"];

const LATENCY_BUCKETS: [f64; 14] = [
    0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> anyhow::Result<Self> {
        let registry = Registry::new_custom(Some("seckill".into()), None)?;
        let latency = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        };
        let metrics = Self {
            http_requests: IntCounterVec::new(
                Opts::new(
                    "http_requests_total",
                    "HTTP requests by route, method and status",
                ),
                &["route", "method", "status"],
            )?,
            http_duration: HistogramVec::new(
                HistogramOpts::new("http_request_duration_seconds", "HTTP request latency")
                    .buckets(LATENCY_BUCKETS.to_vec()),
                &["route", "method"],
            )?,
            admission: IntCounterVec::new(
                Opts::new("admission_total", "Purchase attempts by outcome"),
                &["outcome"],
            )?,
            lua_duration: latency("admission_script_seconds", "Admission script round trip")?,
            produce_duration: latency("kafka_produce_seconds", "Produce to delivery report")?,
            produce_errors: IntCounterVec::new(
                Opts::new(
                    "kafka_produce_errors_total",
                    "Unacknowledged publishes by outcome",
                ),
                &["kind"],
            )?,
            deliveries_pending: IntGauge::new(
                "order_deliveries_pending",
                "Purchases whose event is being sent again after an unknown delivery",
            )?,
            consumer_restarts: IntCounterVec::new(
                Opts::new(
                    "consumer_restarts_total",
                    "Consumer clients rebuilt by the watchdog",
                ),
                &["group"],
            )?,
            kafka_client_rebuilds: IntCounterVec::new(
                Opts::new(
                    "kafka_client_rebuilds_total",
                    "Kafka clients rebuilt because they were wedged while the broker answered a fresh client",
                ),
                &["client"],
            )?,
            order_consumer_stalled_seconds: IntGauge::new(
                "order_consumer_stalled_seconds",
                "Seconds the order consumers have had messages waiting and committed nothing",
            )?,
            consumer_batch_size: Histogram::with_opts(
                HistogramOpts::new("consumer_batch_size", "Messages per order consumer batch")
                    .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0]),
            )?,
            consumer_events: IntCounterVec::new(
                Opts::new("consumer_events_total", "Consumed order events by result"),
                &["result"],
            )?,
            dead_letters: IntCounter::new("dead_letters_total", "Messages dead-lettered")?,
            outbox_rows: IntGaugeVec::new(
                Opts::new("outbox_rows", "Outbox rows by status"),
                &["status"],
            )?,
            callbacks: IntCounterVec::new(
                Opts::new("payment_callbacks_total", "Payment callbacks by outcome"),
                &["outcome"],
            )?,
            orders_closed: IntCounter::new("orders_closed_total", "Orders closed by timeout")?,
            stock_released: IntCounterVec::new(
                Opts::new(
                    "stock_released_total",
                    "stock.released events applied to Redis",
                ),
                &["result"],
            )?,
            reconcile: IntCounterVec::new(
                Opts::new("reconcile_total", "Reconciliation differences and repairs"),
                &["what", "kind"],
            )?,
            instance_id: {
                let gauge = IntGauge::new(
                    "instance_id",
                    "Snowflake instance id leased by this process (-1: none)",
                )?;
                gauge.set(-1);
                gauge
            },
            sold_out_activities: IntGauge::new(
                "sold_out_activities",
                "Activities answered SOLD_OUT from memory (the sold-out fast path)",
            )?,
            redis_up: {
                let gauge = IntGauge::new(
                    "redis_up",
                    "1 while Redis answers this instance's probes (0: the database fallback may take purchases)",
                )?;
                gauge.set(1);
                gauge
            },
            admission_modes: IntGaugeVec::new(
                Opts::new(
                    "admission_fallback_activities",
                    "Activities admitted through the database fallback (database) or being loaded back into Redis (restoring)",
                ),
                &["mode"],
            )?,
            event_conflicts: IntCounter::new(
                "event_conflicts_total",
                "Order events applied before under the same event_id with a different payload",
            )?,
            order_consumer_lag: {
                let gauge = IntGauge::new(
                    "order_consumer_lag",
                    "order.requested messages the order consumers have not committed (-1: unknown)",
                )?;
                gauge.set(crate::bus::progress::UNKNOWN_LAG);
                gauge
            },
            stock_units: IntGaugeVec::new(
                Opts::new(
                    "stock_units",
                    "Stock units of warm activities as reconciliation last read them",
                ),
                &["activity_id", "source", "state"],
            )?,
            open_reservations: IntGaugeVec::new(
                Opts::new(
                    "open_reservations",
                    "Open Redis reservations of warm activities as reconciliation last read them",
                ),
                &["activity_id"],
            )?,
            reconcile_inconsistent: IntGauge::new(
                "reconcile_inconsistent_activities",
                "Activities the last reconciliation run found a difference in",
            )?,
            reconcile_last_run: IntGauge::new(
                "reconcile_last_run_timestamp_seconds",
                "When reconciliation last ran to the end (unix seconds)",
            )?,
            registry,
        };
        for outcome in ADMISSION_OUTCOMES {
            metrics.admission.with_label_values(&[outcome]);
        }
        for mode in ["database", "restoring"] {
            metrics.admission_modes.with_label_values(&[mode]);
        }
        for status in OUTBOX_STATUSES {
            metrics.outbox_rows.with_label_values(&[status]);
        }
        for kind in PRODUCE_ERRORS {
            metrics.produce_errors.with_label_values(&[kind]);
        }
        for outcome in CALLBACK_OUTCOMES {
            metrics.callbacks.with_label_values(&[outcome]);
        }
        for kind in RECONCILE_DIFFERENCES {
            metrics.reconcile.with_label_values(&["difference", kind]);
        }
        let r = &metrics.registry;
        r.register(Box::new(metrics.http_requests.clone()))?;
        r.register(Box::new(metrics.http_duration.clone()))?;
        r.register(Box::new(metrics.admission.clone()))?;
        r.register(Box::new(metrics.lua_duration.clone()))?;
        r.register(Box::new(metrics.produce_duration.clone()))?;
        r.register(Box::new(metrics.produce_errors.clone()))?;
        r.register(Box::new(metrics.deliveries_pending.clone()))?;
        r.register(Box::new(metrics.consumer_restarts.clone()))?;
        r.register(Box::new(metrics.kafka_client_rebuilds.clone()))?;
        r.register(Box::new(metrics.order_consumer_stalled_seconds.clone()))?;
        r.register(Box::new(metrics.consumer_batch_size.clone()))?;
        r.register(Box::new(metrics.consumer_events.clone()))?;
        r.register(Box::new(metrics.dead_letters.clone()))?;
        r.register(Box::new(metrics.outbox_rows.clone()))?;
        r.register(Box::new(metrics.callbacks.clone()))?;
        r.register(Box::new(metrics.orders_closed.clone()))?;
        r.register(Box::new(metrics.stock_released.clone()))?;
        r.register(Box::new(metrics.reconcile.clone()))?;
        r.register(Box::new(metrics.order_consumer_lag.clone()))?;
        r.register(Box::new(metrics.instance_id.clone()))?;
        r.register(Box::new(metrics.sold_out_activities.clone()))?;
        r.register(Box::new(metrics.event_conflicts.clone()))?;
        r.register(Box::new(metrics.redis_up.clone()))?;
        r.register(Box::new(metrics.admission_modes.clone()))?;
        r.register(Box::new(metrics.stock_units.clone()))?;
        r.register(Box::new(metrics.open_reservations.clone()))?;
        r.register(Box::new(metrics.reconcile_inconsistent.clone()))?;
        r.register(Box::new(metrics.reconcile_last_run.clone()))?;
        Ok(metrics)
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> anyhow::Result<String> {
        Ok(prometheus::TextEncoder::new().encode_to_string(&self.registry.gather())?)
    }
}

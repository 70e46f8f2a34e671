//! Prometheus metrics, served at `GET /metrics` in the text format.
//!
//! Each metric is declared once, in the [`metrics!`] list below: its field,
//! its type, its name and help. The macro makes the struct, creates each
//! metric and registers it.

use prometheus::{
    Counter, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// `metrics! { /// doc  field: Type = constructor; ... }`: the struct
/// [`Metrics`] with one public field per line, and `Metrics::declared`,
/// which creates every metric and registers it in a new registry.
macro_rules! metrics {
    ($( $(#[doc = $doc:literal])* $field:ident: $ty:ty = $make:expr; )*) => {
        /// Every metric the process exports, registered in one registry.
        /// Cheap to clone (each metric is an `Arc` inside).
        #[derive(Clone)]
        pub struct Metrics {
            /// The registry `/metrics` encodes.
            pub registry: Registry,
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        impl Metrics {
            /// Every metric, created and registered.
            fn declared() -> anyhow::Result<Self> {
                let registry = Registry::new_custom(Some("seckill".into()), None)?;
                $(
                    let $field: $ty = $make?;
                    registry.register(Box::new($field.clone()))?;
                )*
                Ok(Self { registry, $($field,)* })
            }
        }
    };
}

metrics! {
    /// HTTP requests by route pattern, method and status.
    http_requests: IntCounterVec = counters(
        "http_requests_total",
        "HTTP requests by route, method and status",
        &["route", "method", "status"],
    );
    /// HTTP latency by route pattern and method, in seconds.
    http_duration: HistogramVec = HistogramVec::new(
        HistogramOpts::new("http_request_duration_seconds", "HTTP request latency")
            .buckets(LATENCY_BUCKETS.to_vec()),
        &["route", "method"],
    );
    /// Purchase attempts by outcome (accepted, sold_out, duplicate, limited, …).
    admission: IntCounterVec = counters("admission_total", "Purchase attempts by outcome", &["outcome"]);
    /// Latency of the admission script round trip, in seconds.
    lua_duration: Histogram = latency("admission_script_seconds", "Admission script round trip");
    /// Latency from produce to delivery report of `order.requested`, in seconds.
    produce_duration: Histogram = latency("kafka_produce_seconds", "Produce to delivery report");
    /// Publishes that were not acknowledged, by outcome (queue_full,
    /// not_delivered, unknown).
    produce_errors: IntCounterVec = counters(
        "kafka_produce_errors_total",
        "Unacknowledged publishes by outcome",
        &["kind"],
    );
    /// Purchases whose delivery outcome is unknown and whose event is being
    /// sent again in the background.
    deliveries_pending: IntGauge = IntGauge::new(
        "order_deliveries_pending",
        "Purchases whose event is being sent again after an unknown delivery",
    );
    /// Consumer clients rebuilt by the watchdog, by group.
    consumer_restarts: IntCounterVec = counters(
        "consumer_restarts_total",
        "Consumer clients rebuilt by the watchdog",
        &["group"],
    );
    /// Kafka clients rebuilt because they were wedged while the broker
    /// answered a fresh client, by client (producer, progress, or the
    /// consumer's name).
    kafka_client_rebuilds: IntCounterVec = counters(
        "kafka_client_rebuilds_total",
        "Kafka clients rebuilt because they were wedged while the broker answered a fresh client",
        &["client"],
    );
    /// How long the order consumers have had messages waiting without
    /// committing any, in seconds (admission's BUSY and readiness read it).
    order_consumer_stalled_seconds: IntGauge = IntGauge::new(
        "order_consumer_stalled_seconds",
        "Seconds the order consumers have had messages waiting and committed nothing",
    );
    /// Messages per consumer batch.
    consumer_batch_size: Histogram = Histogram::with_opts(
        HistogramOpts::new("consumer_batch_size", "Messages per order consumer batch")
            .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0]),
    );
    /// Seconds order batches waited for `orders.max_write_rate`.
    order_consumer_paced: Counter = Counter::new(
        "order_consumer_paced_seconds_total",
        "Seconds order consumer batches waited for orders.max_write_rate",
    );
    /// `orders.max_write_rate` of this instance (0: unlimited).
    order_consumer_max_rate: IntGauge = IntGauge::new(
        "order_consumer_max_write_rate",
        "Orders per second this instance's order consumer may write (0: unlimited)",
    );
    /// Buyers' order reads by where they were answered: replica, primary,
    /// or redis (PROCESSING, the replica not having the row yet).
    order_reads: IntCounterVec = counters(
        "order_reads_total",
        "Buyers' order reads by where they were answered (replica, primary, redis)",
        &["source"],
    );
    /// 1 while `postgres.replica_url` is read from.
    replica_usable: IntGauge = gauge_at(
        "postgres_replica_usable",
        "1 while the replica is read from (answers, is a standby, within replica_max_lag_ms)",
        0,
    );
    /// How far the replica is behind the primary, ms (-1: unknown).
    replica_lag_ms: IntGauge = gauge_at(
        "postgres_replica_lag_ms",
        "How far the replica's replay is behind the primary, ms (-1: unknown)",
        -1,
    );
    /// Consumed order events by result (created, failed, duplicate, …).
    consumer_events: IntCounterVec = counters(
        "consumer_events_total",
        "Consumed order events by result",
        &["result"],
    );
    /// Order batches held because the database's schema has migrations
    /// this binary does not know (a newer binary migrated): an older
    /// binary does not write on a schema it was not built for.
    schema_holds: IntCounter = IntCounter::new(
        "consumer_schema_holds_total",
        "Order batches held: the schema is newer than this binary",
    );
    /// Messages sent to a dead-letter topic.
    dead_letters: IntCounter = IntCounter::new("dead_letters_total", "Messages dead-lettered");
    /// Outbox rows by status (NEW, RETRY, DEAD), refreshed by the relay.
    outbox_rows: IntGaugeVec = gauges("outbox_rows", "Outbox rows by status", &["status"]);
    /// Payment callbacks by outcome (applied, duplicate, refund_required, …).
    callbacks: IntCounterVec = counters(
        "payment_callbacks_total",
        "Payment callbacks by outcome",
        &["outcome"],
    );
    /// Calls to the payment provider by the sweeper and the pay route, by
    /// call (create, close, query, refund, query_refund) and outcome (ok;
    /// unknown: it may have been done; retry: the provider's "not now";
    /// refused: its final no).
    provider_calls: IntCounterVec = counters(
        "payment_provider_calls_total",
        "Calls to the payment provider by call and outcome",
        &["call", "outcome"],
    );
    /// Refunds settled, by status (REFUNDED, REFUND_FAILED: an operator
    /// must give the money back; alerted).
    refunds: IntCounterVec = counters(
        "payment_refunds_total",
        "Refunds settled by status",
        &["status"],
    );
    /// Orders closed by the payment timeout.
    orders_closed: IntCounter = IntCounter::new("orders_closed_total", "Orders closed by timeout");
    /// Order streams that read their order again (changes may have been
    /// missed: the subscription was lost, or the stream fell behind its
    /// own order's changes). Each is one query on the public pool.
    order_stream_resyncs: IntCounter = IntCounter::new(
        "order_stream_resyncs_total",
        "Order event streams that read their order again from the database",
    );
    /// Reservations given back to Redis from `stock.released`.
    stock_released: IntCounterVec = counters(
        "stock_released_total",
        "stock.released events applied to Redis",
        &["result"],
    );
    /// Reconciliation findings by what (difference | repair) and kind.
    reconcile: IntCounterVec = counters(
        "reconcile_total",
        "Reconciliation differences and repairs",
        &["what", "kind"],
    );
    /// Order events not yet applied by the order consumers (−1: unknown);
    /// admission's consumer-lag backpressure reads it.
    order_consumer_lag: IntGauge = gauge_at(
        "order_consumer_lag",
        "order.requested messages the order consumers have not committed (-1: unknown)",
        crate::bus::progress::UNKNOWN_LAG,
    );
    /// The snowflake instance id this process holds a lease on (-1: none).
    instance_id: IntGauge = gauge_at(
        "instance_id",
        "Snowflake instance id leased by this process (-1: none)",
        -1,
    );
    /// Activities this instance answers SOLD_OUT for from memory.
    sold_out_activities: IntGauge = IntGauge::new(
        "sold_out_activities",
        "Activities answered SOLD_OUT from memory (the sold-out fast path)",
    );
    /// Reads of an activity's acceptance count that confirmed refusals
    /// answered from memory (one read for the refusals of a moment).
    sold_out_recounts: IntCounter = IntCounter::new(
        "sold_out_recounts_total",
        "Reads of an acceptance count that confirmed sold-out refusals from memory",
    );
    /// Order events whose event_id was applied before with a different
    /// payload (two instances minted one number): dead-lettered, alerting.
    event_conflicts: IntCounter = IntCounter::new(
        "event_conflicts_total",
        "Order events applied before under the same event_id with a different payload",
    );
    /// 1 while Redis answers this instance's probes, 0 while it does not.
    redis_up: IntGauge = gauge_at(
        "redis_up",
        "1 while Redis answers this instance's probes (0: the database fallback may take purchases)",
        1,
    );
    /// Activities whose purchases go to the database (Redis fallback), by
    /// mode (database | restoring), as this instance last read them.
    admission_modes: IntGaugeVec = gauges(
        "admission_fallback_activities",
        "Activities admitted through the database fallback (database) or being loaded back into Redis (restoring)",
        &["mode"],
    );
    /// Stock units of each warm activity as reconciliation last read them,
    /// by activity, source (redis | db) and state (available | locked | sold).
    stock_units: IntGaugeVec = gauges(
        "stock_units",
        "Stock units of warm activities as reconciliation last read them",
        &["activity_id", "source", "state"],
    );
    /// Open reservations in Redis of each warm activity, as reconciliation
    /// last read them (units in flight between admission and the database).
    open_reservations: IntGaugeVec = gauges(
        "open_reservations",
        "Open Redis reservations of warm activities as reconciliation last read them",
        &["activity_id"],
    );
    /// Tickets waiting in each waiting room (taken, not yet admitted), by
    /// activity, as this instance's admitter last read them.
    room_queue_length: IntGaugeVec = gauges(
        "waiting_room_queue_length",
        "Tickets waiting in each waiting room (taken, not yet admitted)",
        &["activity_id"],
    );
    /// Passes given out and not yet used or expired, by activity.
    room_passes_outstanding: IntGaugeVec = gauges(
        "waiting_room_passes_outstanding",
        "Waiting-room passes and offers given out, not yet used or expired",
        &["activity_id"],
    );
    /// Offers of released units open, by activity.
    room_offers_open: IntGaugeVec = gauges(
        "waiting_room_offers_open",
        "Offers of released units held for a ticket",
        &["activity_id"],
    );
    /// Tickets admitted by this instance's admitter, by kind (pass | offer).
    room_admitted: IntCounterVec = counters(
        "waiting_room_admitted_total",
        "Tickets admitted: a pass in turn, or an offer of a released unit",
        &["kind"],
    );
    /// Passes shown to the purchase-token route, by outcome (used,
    /// missing, forged, foreign, expired, reused, sold_out, lost).
    room_pass_checks: IntCounterVec = counters(
        "waiting_room_pass_checks_total",
        "Queue passes checked by the purchase-token route, by outcome",
        &["outcome"],
    );
    /// Proof-of-work answers, by outcome (accepted, wrong, expired,
    /// replayed, too_easy: its challenge was made for a much lower join
    /// rate than the one at the join).
    room_pow: IntCounterVec = counters(
        "waiting_room_pow_total",
        "Proof-of-work answers to join a waiting room, by outcome",
        &["outcome"],
    );
    /// Activities read from the database by the admission cache when Redis
    /// has no meta: `row` one activity's, `index` the list of live ones
    /// (an id not in it is NOT_ACTIVE without a query).
    activity_lookups: IntCounterVec = counters(
        "activity_lookups_total",
        "Activity reads from the database by the admission cache: one activity's row, or the index of live ones",
        &["source"],
    );
    /// Rooms read from the database by the routes' cache: `row` one
    /// room's row, `index` the list of activities with a room (an id not
    /// in it is answered without a query).
    room_lookups: IntCounterVec = counters(
        "waiting_room_lookups_total",
        "Waiting-room reads from the database by the routes' cache: one room's row, or the index of rooms",
        &["source"],
    );
    /// Offers of released units by event (made, taken, expired).
    room_offers: IntCounterVec = counters(
        "waiting_room_offers_total",
        "Offers of released units: made, taken (used to buy), expired unused",
        &["event"],
    );
    /// Activities the last reconciliation run found a difference in.
    reconcile_inconsistent: IntGauge = IntGauge::new(
        "reconcile_inconsistent_activities",
        "Activities the last reconciliation run found a difference in",
    );
    /// When reconciliation last ran to the end (unix seconds; 0: never).
    reconcile_last_run: IntGauge = IntGauge::new(
        "reconcile_last_run_timestamp_seconds",
        "When reconciliation last ran to the end (unix seconds)",
    );
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
    /// Creates and registers every metric, with the label values the
    /// dashboards read created at 0.
    pub fn new() -> anyhow::Result<Self> {
        let metrics = Self::declared()?;
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
        for status in ["REFUNDED", "REFUND_FAILED"] {
            metrics.refunds.with_label_values(&[status]);
        }
        for (counter, labels) in [
            (&metrics.room_admitted, &["pass", "offer"][..]),
            (
                &metrics.room_pass_checks,
                &[
                    "used", "missing", "forged", "foreign", "expired", "reused", "sold_out",
                    "lost", "not_held",
                ][..],
            ),
            (
                &metrics.room_pow,
                &["accepted", "wrong", "expired", "replayed", "too_easy"][..],
            ),
            (&metrics.room_offers, &["made", "taken", "expired"][..]),
            (&metrics.room_lookups, &["row", "index"][..]),
            (&metrics.activity_lookups, &["row", "index"][..]),
        ] {
            for label in labels {
                counter.with_label_values(&[label]);
            }
        }
        Ok(metrics)
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> anyhow::Result<String> {
        Ok(prometheus::TextEncoder::new().encode_to_string(&self.registry.gather())?)
    }
}

fn counters(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    IntCounterVec::new(Opts::new(name, help), labels)
}

fn gauges(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
    IntGaugeVec::new(Opts::new(name, help), labels)
}

/// A gauge that starts at `value`.
fn gauge_at(name: &str, help: &str, value: i64) -> prometheus::Result<IntGauge> {
    let gauge = IntGauge::new(name, help)?;
    gauge.set(value);
    Ok(gauge)
}

fn latency(name: &str, help: &str) -> prometheus::Result<Histogram> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
}

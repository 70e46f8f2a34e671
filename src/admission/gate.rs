//! The Redis gate: the admission, release, commit and warm-up scripts.
//!
//! The hot path uses one long-lived multiplexed connection
//! ([`ConnectionManager`]), not the pool: every request is a single script
//! call, pipelined on one socket, with no per-checkout PING (see
//! BENCHMARKS.md for the measurement). Scripts go out as `EVALSHA`; on
//! `NOSCRIPT` (Redis restarted or failed over) `redis::Script` loads the
//! script and retries once.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisResult, Script};

use crate::admission::keys::ActivityKeys;
use crate::config::{AdmissionSettings, RedisSettings};

/// What the admission script decided. Ordinary outcomes, not errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Stock reserved for this new order.
    Accepted(i64),
    /// This user's `request_id` was accepted before, as this order.
    Duplicate(i64),
    /// No bucket (nor all of them together) holds the quantity.
    SoldOut,
    /// The user's live quantity would pass the per-user limit.
    LimitExceeded,
    /// Purchase token missing, used, expired or another user's.
    InvalidToken,
    /// Outside the sale window, or not warmed up.
    NotActive,
}

/// One purchase attempt, as the admission script sees it.
#[derive(Debug, Clone, Copy)]
pub struct ReserveRequest<'a> {
    /// The activity.
    pub activity_id: i64,
    /// The buyer.
    pub user_id: i64,
    /// The client's idempotency key.
    pub request_id: &'a str,
    /// The one-time purchase token.
    pub token: &'a str,
    /// Units wanted.
    pub quantity: i32,
    /// The snowflake made for this attempt.
    pub order_no: i64,
    /// Number of stock buckets of the activity.
    pub buckets: usize,
    /// Now, in unix milliseconds.
    pub now_ms: i64,
}

/// Why a reservation is released; recorded on the reservation.
#[derive(Debug, Clone, Copy)]
pub enum ReleaseReason {
    /// The order event could not be published; nothing was kept.
    PublishFailed,
    /// The database could not back the order (it is FAILED).
    OrderFailed,
    /// The order was cancelled or closed after it was created; the units
    /// come back even if Redis lost the reservation record.
    OrderReleased { user_id: i64, quantity: i32 },
}

impl ReleaseReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::PublishFailed => "PUBLISH_FAILED",
            Self::OrderFailed => "ORDER_FAILED",
            Self::OrderReleased { .. } => "ORDER_RELEASED",
        }
    }
}

/// An activity's sale window and limits, as warmed into Redis.
#[derive(Debug, Clone, Copy)]
pub struct WarmSpec {
    /// The activity.
    pub activity_id: i64,
    /// Sale start, unix ms.
    pub start_ms: i64,
    /// Sale end, unix ms.
    pub end_ms: i64,
    /// Per-user limit.
    pub per_user_limit: i32,
    /// Units to load (the database's available count).
    pub units: i32,
    /// Unit price, cents.
    pub price_cents: i64,
    /// Number of buckets to split the units over.
    pub buckets: usize,
}

/// The Redis side of admission and reservations.
#[derive(Clone)]
pub struct RedisGate {
    /// Kept to open per-worker connections ([`RedisGate::on_own_connection`]).
    client: redis::Client,
    config: ConnectionManagerConfig,
    conn: ConnectionManager,
    /// When set (`redis.gate_connection = "pool"`), the admission script runs
    /// on a pooled connection instead: kept to measure the difference.
    pool: Option<deadpool_redis::Pool>,
    prefix: String,
    reservation_ttl_secs: u64,
    reserve: Script,
    release: Script,
    commit: Script,
    warmup: Script,
    repair: Script,
}

impl RedisGate {
    /// A gate over a lazily connected, self-reconnecting multiplexed
    /// connection. Must be called inside a Tokio runtime.
    pub fn new(
        redis: &RedisSettings,
        admission: &AdmissionSettings,
        pool: Option<deadpool_redis::Pool>,
    ) -> RedisResult<Self> {
        let timeout = Some(Duration::from_millis(redis.timeout_ms));
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout)
            .set_number_of_retries(1);
        let client = redis::Client::open(redis.url.as_str())?;
        Ok(Self {
            conn: client.get_connection_manager_lazy(config.clone())?,
            client,
            config,
            pool,
            prefix: redis.key_prefix.clone(),
            reservation_ttl_secs: admission.reservation_ttl_secs,
            reserve: Script::new(include_str!("lua/reserve.lua")),
            release: Script::new(include_str!("lua/release.lua")),
            commit: Script::new(include_str!("lua/commit.lua")),
            warmup: Script::new(include_str!("lua/warmup.lua")),
            repair: Script::new(include_str!("lua/repair.lua")),
        })
    }

    /// The same gate on a connection of its own, driven by the runtime this
    /// is called on. Each HTTP worker gets one, so a purchase's script call
    /// never hops to another thread's runtime and back (see BENCHMARKS.md).
    pub fn on_own_connection(&self) -> RedisResult<Self> {
        let mut gate = self.clone();
        gate.conn = self
            .client
            .get_connection_manager_lazy(self.config.clone())?;
        Ok(gate)
    }

    /// The keys of one activity.
    pub fn keys(&self, activity_id: i64) -> ActivityKeys {
        ActivityKeys::new(&self.prefix, activity_id)
    }

    /// A clone of the multiplexed connection, for plain commands.
    pub fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Runs the admission script (one `EVALSHA`).
    pub async fn reserve(&self, r: &ReserveRequest<'_>) -> RedisResult<Admission> {
        let k = self.keys(r.activity_id);
        let mut call = self.reserve.prepare_invoke();
        call.key(k.meta())
            .key(k.requests())
            .key(k.holdings())
            .key(k.token(r.token))
            .key(k.reservation(r.order_no))
            .key(k.open());
        for b in 0..r.buckets {
            call.key(k.bucket(b));
        }
        let first_bucket = if r.buckets > 1 {
            fastrand::usize(..r.buckets)
        } else {
            0
        };
        call.arg(r.user_id)
            .arg(r.request_id)
            .arg(r.quantity)
            .arg(r.order_no)
            .arg(r.now_ms)
            .arg(first_bucket)
            .arg(self.reservation_ttl_secs);
        let (code, order_no): (i64, String) = match &self.pool {
            None => call.invoke_async(&mut self.conn.clone()).await?,
            Some(pool) => {
                let mut conn = pool.get().await.map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no pooled connection",
                        e.to_string(),
                    ))
                })?;
                call.invoke_async(&mut conn).await?
            }
        };
        let order_no = || order_no.parse::<i64>().unwrap_or(0);
        Ok(match code {
            0 => Admission::Accepted(order_no()),
            1 => Admission::Duplicate(order_no()),
            2 => Admission::SoldOut,
            3 => Admission::LimitExceeded,
            4 => Admission::InvalidToken,
            _ => Admission::NotActive,
        })
    }

    /// Gives a reservation's stock back; idempotent per order. Returns
    /// whether this call released it.
    pub async fn release(
        &self,
        activity_id: i64,
        order_no: i64,
        buckets: usize,
        reason: ReleaseReason,
    ) -> RedisResult<bool> {
        let k = self.keys(activity_id);
        let mut call = self.release.prepare_invoke();
        call.key(k.reservation(order_no))
            .key(k.open())
            .key(k.holdings())
            .key(k.requests());
        for b in 0..buckets {
            call.key(k.bucket(b));
        }
        let forget = matches!(reason, ReleaseReason::PublishFailed);
        // Units to restore when Redis lost the record: only for an order the
        // database had backed (cancelled / closed); nothing otherwise.
        let (user, fallback) = match reason {
            ReleaseReason::OrderReleased { user_id, quantity } => (user_id, quantity),
            _ => (0, 0),
        };
        call.arg(order_no)
            .arg(reason.as_str())
            .arg(if forget { "1" } else { "0" })
            .arg(fallback)
            .arg(user);
        let released: i64 = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(released == 1)
    }

    /// Keeps acknowledged events on their reservations (`(activity_id,
    /// order_no, payload)`), in one pipeline, for reconciliation to publish
    /// again if the broker lost them. The field is harmless on a reservation
    /// already committed or released (only open ones are looked at); should
    /// the record be gone, the re-created hash gets the reservation TTL.
    pub async fn mark_published(&self, marks: &[(i64, i64, Vec<u8>)]) -> RedisResult<()> {
        if marks.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (activity_id, order_no, payload) in marks {
            let key = self.keys(*activity_id).reservation(*order_no);
            pipe.hset(&key, "event", payload.as_slice()).ignore();
            pipe.cmd("EXPIRE")
                .arg(&key)
                .arg(self.reservation_ttl_secs)
                .arg("NX")
                .ignore();
        }
        pipe.query_async(&mut self.conn.clone()).await
    }

    /// Marks reservations of orders now in the database as committed;
    /// idempotent. Returns the order_nos that had been released meanwhile.
    pub async fn commit(&self, activity_id: i64, order_nos: &[i64]) -> RedisResult<Vec<i64>> {
        if order_nos.is_empty() {
            return Ok(Vec::new());
        }
        let k = self.keys(activity_id);
        let mut call = self.commit.prepare_invoke();
        call.key(k.open());
        for &o in order_nos {
            call.key(k.reservation(o)).arg(o);
        }
        call.invoke_async(&mut self.conn.clone()).await
    }

    /// Loads stock and the sale window, unless already warm. Returns
    /// `(warmed_now, units_in_redis)`.
    pub async fn warmup(&self, spec: &WarmSpec) -> RedisResult<(bool, i64)> {
        let k = self.keys(spec.activity_id);
        let mut call = self.warmup.prepare_invoke();
        call.key(k.meta());
        for b in 0..spec.buckets {
            call.key(k.bucket(b));
        }
        call.arg(spec.start_ms)
            .arg(spec.end_ms)
            .arg(spec.per_user_limit)
            .arg(spec.units)
            .arg(spec.price_cents);
        let (code, units): (i64, i64) = call.invoke_async(&mut self.conn.clone()).await?;
        Ok((code == 0, units))
    }

    /// Units available in Redis (the sum of the buckets).
    pub async fn available(&self, activity_id: i64, buckets: usize) -> RedisResult<i64> {
        let k = self.keys(activity_id);
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(k.buckets(buckets))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(values.into_iter().flatten().sum())
    }

    /// Moves the activity's Redis stock by `delta` units (never below zero);
    /// returns the delta applied. Reconciliation only.
    pub async fn repair(&self, activity_id: i64, buckets: usize, delta: i64) -> RedisResult<i64> {
        let k = self.keys(activity_id);
        let mut call = self.repair.prepare_invoke();
        for b in 0..buckets {
            call.key(k.bucket(b));
        }
        call.arg(delta).invoke_async(&mut self.conn.clone()).await
    }

    /// Open reservations made before `cutoff_ms`.
    pub async fn open_before(&self, activity_id: i64, cutoff_ms: i64) -> RedisResult<Vec<i64>> {
        redis::cmd("ZRANGEBYSCORE")
            .arg(self.keys(activity_id).open())
            .arg("-inf")
            .arg(format!("({cutoff_ms}"))
            .arg("LIMIT")
            .arg(0)
            .arg(1000)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Removes an ended activity's keys (meta, buckets, request and holding
    /// hashes, open index). Reservation records expire on their own.
    pub async fn remove_activity(&self, activity_id: i64, buckets: usize) -> RedisResult<()> {
        let k = self.keys(activity_id);
        let mut keys = k.buckets(buckets);
        keys.extend([k.meta(), k.requests(), k.holdings(), k.open()]);
        redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Drops an order from the open index (its record is gone).
    pub async fn forget_open(&self, activity_id: i64, order_no: i64) -> RedisResult<()> {
        redis::cmd("ZREM")
            .arg(self.keys(activity_id).open())
            .arg(order_no)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Number of open (not yet committed) reservations.
    pub async fn open_reservations(&self, activity_id: i64) -> RedisResult<i64> {
        redis::cmd("ZCARD")
            .arg(self.keys(activity_id).open())
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Whether the activity has been warmed (its meta hash exists).
    pub async fn is_warm(&self, activity_id: i64) -> RedisResult<bool> {
        redis::cmd("EXISTS")
            .arg(self.keys(activity_id).meta())
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Stores a one-time purchase token bound to `user_id`.
    pub async fn issue_token(
        &self,
        activity_id: i64,
        user_id: i64,
        token: &str,
        ttl_secs: u64,
    ) -> RedisResult<()> {
        redis::cmd("SET")
            .arg(self.keys(activity_id).token(token))
            .arg(user_id)
            .arg("EX")
            .arg(ttl_secs)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The reservation record of an order, if Redis has it:
    /// `(user_id, quantity, status, request_id)`.
    pub async fn reservation(
        &self,
        activity_id: i64,
        order_no: i64,
    ) -> RedisResult<Option<Reservation>> {
        type Fields = (
            Option<i64>,
            Option<i32>,
            Option<String>,
            Option<String>,
            Option<Vec<u8>>,
        );
        let (user, qty, status, req, event): Fields = redis::cmd("HMGET")
            .arg(self.keys(activity_id).reservation(order_no))
            .arg(&["user", "qty", "status", "req", "event"])
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(match (user, qty, status, req) {
            (Some(user_id), Some(quantity), Some(status), Some(request_id)) => Some(Reservation {
                user_id,
                quantity,
                released: status == "released",
                request_id,
                event,
            }),
            _ => None,
        })
    }
}

/// The gate of one HTTP worker (its own multiplexed connection).
pub struct WorkerGate(pub RedisGate);

/// A reservation as stored in Redis.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// The buyer.
    pub user_id: i64,
    /// Units reserved.
    pub quantity: i32,
    /// Whether its stock went back (publish failed, order failed, voided).
    pub released: bool,
    /// The client's idempotency key.
    pub request_id: String,
    /// The `order.requested` payload the broker acknowledged, once marked.
    pub event: Option<Vec<u8>>,
}

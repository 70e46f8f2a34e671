//! The Redis gate: the admission, release, commit and warm-up scripts.
//!
//! The hot path uses one long-lived multiplexed connection
//! ([`RedisConn`], to one server or a cluster), not the pool: every request is a single script
//! call, pipelined on one socket, with no per-checkout PING (see
//! BENCHMARKS.md for the measurement). Scripts go out as `EVALSHA`; on
//! `NOSCRIPT` (Redis restarted or failed over) `redis::Script` loads the
//! script and retries once.

use redis::{RedisResult, Script};

use crate::admission::keys::ActivityKeys;
use crate::bus::events::OrderRequested;
use crate::config::{AdmissionSettings, RedisSettings};
use crate::ids::OrderNo;
use crate::store::redis_conn::{RedisClient, RedisConn};

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
    /// Outside the sale window.
    NotActive,
    /// Redis holds no stock for the activity: never warmed, or Redis lost
    /// it (restarted empty) and reconciliation has not restored it yet.
    NotWarm,
    /// The order_no already keys another reservation (two instances made
    /// the same number): nothing was reserved, the other is untouched.
    NumberTaken,
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
    /// The coupon the buyer wants to use, kept on the reservation so the
    /// order event can be rebuilt from it.
    pub coupon_id: Option<i64>,
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

/// An activity's sale window and limits, as warm in Redis.
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    /// Sale start, unix ms.
    pub start_ms: i64,
    /// Sale end, unix ms.
    pub end_ms: i64,
    /// Per-user limit.
    pub per_user_limit: i32,
    /// Stock buckets (≥ 1).
    pub buckets: usize,
}

impl Meta {
    /// Whether `now_ms` is inside the sale window.
    pub fn is_open(&self, now_ms: i64) -> bool {
        self.start_ms <= now_ms && now_ms < self.end_ms
    }
}

/// The Redis side of admission and reservations.
#[derive(Clone)]
pub struct RedisGate {
    /// Kept to open per-worker connections ([`RedisGate::on_own_connection`]).
    client: RedisClient,
    conn: RedisConn,
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
    ack: Script,
    sending: Script,
    void: Script,
}

impl RedisGate {
    /// A gate over a lazily connected, self-reconnecting multiplexed
    /// connection. Must be called inside a Tokio runtime.
    pub fn new(
        redis: &RedisSettings,
        admission: &AdmissionSettings,
        pool: Option<deadpool_redis::Pool>,
    ) -> RedisResult<Self> {
        let client = RedisClient::new(redis)?;
        Ok(Self {
            conn: client.connect_lazy()?,
            client,
            pool,
            prefix: redis.key_prefix.clone(),
            reservation_ttl_secs: admission.reservation_ttl_secs,
            reserve: Script::new(include_str!("lua/reserve.lua")),
            release: Script::new(include_str!("lua/release.lua")),
            commit: Script::new(include_str!("lua/commit.lua")),
            warmup: Script::new(include_str!("lua/warmup.lua")),
            repair: Script::new(include_str!("lua/repair.lua")),
            ack: Script::new(include_str!("lua/ack.lua")),
            sending: Script::new(include_str!("lua/sending.lua")),
            void: Script::new(include_str!("lua/void.lua")),
        })
    }

    /// The same gate on a connection of its own, driven by the runtime this
    /// is called on. Each HTTP worker gets one, so a purchase's script call
    /// never hops to another thread's runtime and back (see BENCHMARKS.md).
    pub fn on_own_connection(&self) -> RedisResult<Self> {
        let mut gate = self.clone();
        gate.conn = self.client.connect_lazy()?;
        Ok(gate)
    }

    /// The keys of one activity.
    pub fn keys(&self, activity_id: i64) -> ActivityKeys {
        ActivityKeys::new(&self.prefix, activity_id)
    }

    /// A clone of the multiplexed connection, for plain commands.
    pub fn conn(&self) -> RedisConn {
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
            .arg(self.reservation_ttl_secs)
            .arg(r.coupon_id.map(|c| c.to_string()).unwrap_or_default());
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
            5 => Admission::NotActive,
            7 => Admission::NumberTaken,
            _ => Admission::NotWarm,
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

    /// Records that the broker acknowledged the events of `order_nos` (one
    /// activity): an open reservation is never voided from then on. Returns
    /// the status each reservation had (`None` when its record is gone);
    /// [`Status::Occupied`] means it is acknowledged now.
    pub async fn ack(
        &self,
        activity_id: i64,
        order_nos: &[i64],
        now_ms: i64,
    ) -> RedisResult<Vec<Option<Status>>> {
        if order_nos.is_empty() {
            return Ok(Vec::new());
        }
        let k = self.keys(activity_id);
        let mut call = self.ack.prepare_invoke();
        for &o in order_nos {
            call.key(k.reservation(o));
        }
        let found: Vec<String> = call
            .arg(now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(found.iter().map(|s| Status::parse(s)).collect())
    }

    /// Reads a reservation before its event is sent again; an open,
    /// unacknowledged one has its `sent` time moved to `now_ms` in the same
    /// call (see `sending.lua`). `None` when the record is gone.
    pub async fn sending(
        &self,
        activity_id: i64,
        order_no: i64,
        now_ms: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<String> = self
            .sending
            .key(self.keys(activity_id).reservation(order_no))
            .arg(now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(Reservation::from_fields(&fields))
    }

    /// Claims an open, unacknowledged reservation not made or sent since
    /// `cutoff_ms` for voiding (`void.lua`).
    pub async fn claim_void(
        &self,
        activity_id: i64,
        order_no: i64,
        cutoff_ms: i64,
    ) -> RedisResult<VoidClaim> {
        let code: i64 = self
            .void
            .key(self.keys(activity_id).reservation(order_no))
            .arg(cutoff_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(match code {
            1 => VoidClaim::Claimed,
            0 => VoidClaim::Refused,
            _ => VoidClaim::Gone,
        })
    }

    /// The status of each of `order_nos`' reservations (one activity), in
    /// one round trip; `None` where the record is gone.
    pub async fn statuses(
        &self,
        activity_id: i64,
        order_nos: &[i64],
    ) -> RedisResult<Vec<Option<Status>>> {
        if order_nos.is_empty() {
            return Ok(Vec::new());
        }
        let k = self.keys(activity_id);
        let mut pipe = redis::pipe();
        for &o in order_nos {
            pipe.hget(k.reservation(o), "status");
        }
        let found: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(found
            .iter()
            .map(|s| s.as_deref().and_then(Status::parse))
            .collect())
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

    /// Sets the activity's Redis stock to `target` units, but only while
    /// no reservation is open and the buckets still sum to `expected`
    /// (`repair.lua`). Returns the delta applied, or `None` when something
    /// moved in between and nothing was done. Reconciliation only.
    pub async fn repair(
        &self,
        activity_id: i64,
        buckets: usize,
        expected: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        let k = self.keys(activity_id);
        let mut call = self.repair.prepare_invoke();
        call.key(k.open());
        for b in 0..buckets {
            call.key(k.bucket(b));
        }
        let (done, value): (i64, i64) = call
            .arg(expected)
            .arg(target)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok((done == 1).then_some(value))
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
        keys.extend([
            k.meta(),
            k.requests(),
            k.holdings(),
            k.open(),
            k.restoring(),
        ]);
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

    /// The activity's window and limits, when it is warm.
    pub async fn meta(&self, activity_id: i64) -> RedisResult<Option<Meta>> {
        type Fields = (Option<i64>, Option<i64>, Option<i32>, Option<usize>);
        let (start, end, limit, buckets): Fields = redis::cmd("HMGET")
            .arg(self.keys(activity_id).meta())
            .arg(&["start_ms", "end_ms", "limit", "buckets"])
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(match (start, end, limit, buckets) {
            (Some(start_ms), Some(end_ms), Some(per_user_limit), Some(buckets)) => Some(Meta {
                start_ms,
                end_ms,
                per_user_limit,
                buckets: buckets.max(1),
            }),
            _ => None,
        })
    }

    /// When Redis was first seen without this (warmed) activity: sets the
    /// marker to `now_ms` unless it is there, and returns its value.
    pub async fn restoring_since(&self, activity_id: i64, now_ms: i64) -> RedisResult<i64> {
        let key = self.keys(activity_id).restoring();
        let (since,): (i64,) = redis::pipe()
            .cmd("SET")
            .arg(&key)
            .arg(now_ms)
            .arg("NX")
            .arg("EX")
            .arg(86_400)
            .ignore()
            .cmd("GET")
            .arg(&key)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(since)
    }

    /// Rebuilds a lost activity from a database snapshot, in one
    /// MULTI/EXEC: the stock, the request ids and holdings of its orders,
    /// the records of its live and released orders (so a later cancel or
    /// release applies exactly once), and the meta last, which opens it.
    pub async fn restore(&self, r: &Restore) -> RedisResult<()> {
        let k = self.keys(r.spec.activity_id);
        let ttl = self.reservation_ttl_secs;
        let mut pipe = redis::pipe();
        pipe.atomic();
        let mut stale = k.buckets(r.spec.buckets);
        stale.extend([k.requests(), k.holdings(), k.open(), k.meta()]);
        pipe.cmd("DEL").arg(stale).ignore();
        let n = r.spec.buckets.max(1);
        let units = i64::from(r.spec.units.max(0));
        for b in 0..n {
            let share = units / n as i64 + i64::from((b as i64) < units % n as i64);
            pipe.cmd("SET").arg(k.bucket(b)).arg(share).ignore();
        }
        for chunk in r.orders.chunks(500) {
            let mut requests = redis::cmd("HSET");
            requests.arg(k.requests());
            for o in chunk {
                requests
                    .arg(format!("{}:{}", o.user_id, o.request_id))
                    .arg(o.order_no);
            }
            pipe.add_command(requests).ignore();
        }
        for o in &r.orders {
            let status = match o.state {
                RestoredState::Live => "committed",
                RestoredState::Released => "released",
                RestoredState::Settled => continue,
            };
            let key = k.reservation(o.order_no);
            pipe.cmd("HSET")
                .arg(&key)
                .arg(&[
                    ("user", o.user_id.to_string()),
                    ("qty", o.quantity.to_string()),
                    ("alloc", format!("0:{}", o.quantity)),
                    ("req", o.request_id.clone()),
                    ("status", status.to_owned()),
                    ("ts", o.reserved_at_ms.to_string()),
                ])
                .ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(ttl).ignore();
        }
        let mut held: std::collections::BTreeMap<i64, i64> = std::collections::BTreeMap::new();
        for o in r.orders.iter().filter(|o| o.holds) {
            *held.entry(o.user_id).or_default() += i64::from(o.quantity);
        }
        for chunk in held.into_iter().collect::<Vec<_>>().chunks(500) {
            pipe.cmd("HSET").arg(k.holdings()).arg(chunk).ignore();
        }
        pipe.cmd("HSET")
            .arg(k.meta())
            .arg("start_ms")
            .arg(r.spec.start_ms)
            .arg("end_ms")
            .arg(r.spec.end_ms)
            .arg("limit")
            .arg(r.spec.per_user_limit)
            .arg("price")
            .arg(r.spec.price_cents)
            .arg("buckets")
            .arg(n)
            .ignore();
        pipe.cmd("DEL").arg(k.restoring()).ignore();
        pipe.query_async(&mut self.conn.clone()).await
    }

    /// Takes the lease `name` for `owner` for `ttl_ms` unless another owner
    /// holds it; true when `owner` holds it now.
    pub async fn try_lease(&self, name: &str, owner: &str, ttl_ms: u64) -> RedisResult<bool> {
        let taken: Option<String> = redis::cmd("SET")
            .arg(format!("{}lease:{name}", self.prefix))
            .arg(owner)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(taken.is_some())
    }

    /// Gives the lease `name` back, if `owner` still holds it.
    pub async fn end_lease(&self, name: &str, owner: &str) -> RedisResult<()> {
        let script = Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 0",
        );
        let _: i64 = script
            .key(format!("{}lease:{name}", self.prefix))
            .arg(owner)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
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

    /// The reservation record of an order, if Redis has it.
    pub async fn reservation(
        &self,
        activity_id: i64,
        order_no: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.keys(activity_id).reservation(order_no))
            .arg(&Reservation::FIELDS)
            .query_async(&mut self.conn.clone())
            .await?;
        let fields: Vec<String> = fields.into_iter().map(Option::unwrap_or_default).collect();
        Ok(Reservation::from_fields(&fields))
    }
}

/// The gate of one HTTP worker (its own multiplexed connection).
pub struct WorkerGate(pub RedisGate);

/// A lost activity, as the database knows it (see [`RedisGate::restore`]).
#[derive(Debug, Clone)]
pub struct Restore {
    /// Window, limit, price, buckets, and the database's available units.
    pub spec: WarmSpec,
    /// Every order of the activity.
    pub orders: Vec<RestoredOrder>,
}

/// One order of a lost activity.
#[derive(Debug, Clone)]
pub struct RestoredOrder {
    /// Its number.
    pub order_no: i64,
    /// The buyer.
    pub user_id: i64,
    /// The buyer's idempotency key: a replay gets this order again.
    pub request_id: String,
    /// Units.
    pub quantity: i32,
    /// When it was made (unix ms).
    pub reserved_at_ms: i64,
    /// Whether it counts against the buyer's limit (WAITING_PAY, PAID).
    pub holds: bool,
    /// What its reservation record becomes.
    pub state: RestoredState,
}

/// The reservation record a restored order gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoredState {
    /// WAITING_PAY: committed, so a later cancel or close releases it.
    Live,
    /// CANCELLED / CLOSED: released, so a late release is a no-op (the
    /// database's available count already has its units).
    Released,
    /// PAID or FAILED: no record needed.
    Settled,
}

/// Where a reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Stock held; the order is not in the database yet.
    Occupied,
    /// Its order is in the database (WAITING_PAY or later).
    Committed,
    /// Its stock went back (publish failed, order failed, voided,
    /// cancelled or closed).
    Released,
    /// The reconciler is voiding it (arbitration by the order row).
    Voiding,
}

impl Status {
    fn parse(raw: &str) -> Option<Self> {
        Some(match raw {
            "occupied" => Self::Occupied,
            "committed" => Self::Committed,
            "released" => Self::Released,
            "voiding" => Self::Voiding,
            _ => return None,
        })
    }
}

/// What [`RedisGate::claim_void`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoidClaim {
    /// The reservation is the caller's to void.
    Claimed,
    /// Acknowledged, recently made or sent, or no longer open: left alone.
    Refused,
    /// The record is gone.
    Gone,
}

/// A reservation as stored in Redis.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Where it stands.
    pub status: Status,
    /// Whether the broker acknowledged its event (never voided then).
    pub acked: bool,
    /// The buyer.
    pub user_id: i64,
    /// Units reserved.
    pub quantity: i32,
    /// The client's idempotency key.
    pub request_id: String,
    /// When it was made (unix ms): the event's `reserved_at_ms`.
    pub reserved_at_ms: i64,
    /// The coupon the purchase named.
    pub coupon_id: Option<i64>,
}

impl Reservation {
    /// The hash fields read, in [`Reservation::from_fields`]' order (the
    /// order `sending.lua` returns them in).
    const FIELDS: [&'static str; 7] = ["status", "acked", "user", "qty", "req", "ts", "coupon"];

    /// From the values of [`Reservation::FIELDS`] (`""` for a missing one);
    /// `None` unless the record is whole.
    fn from_fields(f: &[String]) -> Option<Self> {
        let [status, acked, user, qty, req, ts, coupon] = f else {
            return None;
        };
        Some(Self {
            status: Status::parse(status)?,
            acked: !acked.is_empty(),
            user_id: user.parse().ok()?,
            quantity: qty.parse().ok()?,
            request_id: req.clone(),
            reserved_at_ms: ts.parse().unwrap_or(0),
            coupon_id: coupon.parse().ok(),
        })
    }

    /// Whether its stock went back.
    pub fn released(&self) -> bool {
        self.status == Status::Released
    }

    /// Open: between admission and the order row, and not being voided.
    pub fn is_open(&self) -> bool {
        self.status == Status::Occupied
    }

    /// The `order.requested` event admission published for it, rebuilt
    /// byte for byte (the consumers deduplicate by its event_id).
    pub fn event(&self, activity_id: i64, order_no: i64) -> OrderRequested {
        OrderRequested {
            event_id: order_no.to_string(),
            order_no: OrderNo::new(order_no),
            activity_id,
            user_id: self.user_id,
            request_id: self.request_id.clone(),
            quantity: self.quantity,
            coupon_id: self.coupon_id,
            reserved_at_ms: self.reserved_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: [&str; 7]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_reservation_rebuilds_the_event_admission_published() {
        let r = Reservation::from_fields(&fields([
            "occupied",
            "",
            "7",
            "2",
            "req-1",
            "1700000000000",
            "3",
        ]))
        .expect("whole record");
        assert!(r.is_open() && !r.acked);
        let published = OrderRequested {
            event_id: "42".into(),
            order_no: OrderNo::new(42),
            activity_id: 9,
            user_id: 7,
            request_id: "req-1".into(),
            quantity: 2,
            coupon_id: Some(3),
            reserved_at_ms: 1_700_000_000_000,
        };
        assert_eq!(r.event(9, 42).encode(), published.encode());
    }

    #[test]
    fn a_partial_or_unknown_record_is_no_reservation() {
        assert!(Reservation::from_fields(&fields(["", "", "", "", "", "", ""])).is_none());
        assert!(Reservation::from_fields(&fields(["odd", "", "7", "1", "r", "1", ""])).is_none());
        let acked = Reservation::from_fields(&fields(["occupied", "5", "7", "1", "r", "1", ""]))
            .expect("whole");
        assert!(acked.acked && acked.coupon_id.is_none());
    }
}

//! The Redis gate: the admission, release, commit and warm-up scripts.
//!
//! The hot path uses one long-lived multiplexed connection
//! ([`RedisConn`], to one server or a cluster), not the pool: every request is a single script
//! call, pipelined on one socket, with no per-checkout PING (see
//! BENCHMARKS.md for the measurement). Scripts go out as `EVALSHA`; on
//! `NOSCRIPT` (Redis restarted or failed over) `redis::Script` loads the
//! script and retries once.

use redis::{RedisResult, Script};

use crate::admission::keys::{ActivityKeys, Layout, split_evenly};
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
    /// Units were on their way between shards through every round of
    /// borrowing: nothing was reserved, retry shortly.
    InTransit,
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
    /// The activity's buckets and shards.
    pub layout: Layout,
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
    /// Buckets and shards to split the units over.
    pub layout: Layout,
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
    /// Buckets and shards.
    pub layout: Layout,
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
    /// The stock-returned channel ([`super::soldout::channel`]).
    returned: String,
    reservation_ttl_secs: u64,
    reserve: Script,
    release: Script,
    commit: Script,
    warmup: Script,
    repair: Script,
    ack: Script,
    sending: Script,
    void: Script,
    lend: Script,
    borrow: Script,
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
            returned: super::soldout::channel(&redis.key_prefix),
            reservation_ttl_secs: admission.reservation_ttl_secs,
            reserve: Script::new(include_str!("lua/reserve.lua")),
            release: Script::new(include_str!("lua/release.lua")),
            commit: Script::new(include_str!("lua/commit.lua")),
            warmup: Script::new(include_str!("lua/warmup.lua")),
            repair: Script::new(include_str!("lua/repair.lua")),
            ack: Script::new(include_str!("lua/ack.lua")),
            sending: Script::new(include_str!("lua/sending.lua")),
            void: Script::new(include_str!("lua/void.lua")),
            lend: Script::new(include_str!("lua/lend.lua")),
            borrow: Script::new(include_str!("lua/borrow.lua")),
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

    /// The base keys of an activity: its meta and `restoring` marker (and,
    /// unsharded, all of its keys).
    fn keys(&self, activity_id: i64) -> ActivityKeys {
        ActivityKeys::new(&self.prefix, activity_id)
    }

    /// The keys of one shard of an activity.
    fn shard_keys(&self, activity_id: i64, layout: Layout, shard: usize) -> ActivityKeys {
        ActivityKeys::shard(&self.prefix, activity_id, layout, shard)
    }

    /// The keys of the shard holding `order_no`'s reservation.
    fn order_keys(&self, activity_id: i64, layout: Layout, order_no: i64) -> ActivityKeys {
        self.shard_keys(activity_id, layout, layout.shard_of_order(order_no))
    }

    /// A clone of the multiplexed connection, for plain commands.
    fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// `PING` on the gate's connection (a cluster answers from every
    /// master): readiness.
    pub async fn ping(&self) -> RedisResult<String> {
        redis::cmd("PING").query_async(&mut self.conn()).await
    }

    /// Runs the admission script (one `EVALSHA`) in the buyer's shard. In
    /// a sharded activity whose buyer's shard lacks the units, borrows a
    /// batch from another shard and runs it again; SOLD_OUT only once
    /// every other shard had none to lend and none on its way, and the
    /// buyer's shard, looked at after them, had none either.
    pub async fn reserve(&self, r: &ReserveRequest<'_>) -> RedisResult<Admission> {
        let home = r.layout.shard_of_user(r.user_id);
        let mut rounds = 0;
        let mut settled = false;
        loop {
            if rounds == BORROW_ROUNDS {
                // Units kept moving between shards, or sat in a transfer
                // whose process died between lend and credit: the stale
                // ones are completed here, once, and the rounds run again.
                // Still nothing: retry shortly (units exist, so never
                // SOLD_OUT).
                if !settled {
                    let before_ms = r.now_ms.saturating_sub(STALE_TRANSFER_MS);
                    settled = true;
                    if self
                        .settle_transfers(r.activity_id, r.layout, before_ms)
                        .await?
                        > 0
                    {
                        rounds = 0;
                        continue;
                    }
                }
                return Ok(Admission::InTransit);
            }
            rounds += 1;
            if let Some(found) = self.reserve_in(r, home).await? {
                return Ok(found);
            }
            match self.borrow_round(r, home).await? {
                Lend::Lent => continue,
                Lend::InFlight => tokio::time::sleep(IN_FLIGHT_PAUSE).await,
                Lend::Nothing => {
                    // A transfer into this shard that finished before the
                    // donors were asked is in its buckets now.
                    if let Some(found) = self.reserve_in(r, home).await? {
                        return Ok(found);
                    }
                    // Sold out everywhere; said so from this shard for a
                    // moment without asking the others again.
                    let _: () = redis::cmd("SET")
                        .arg(self.shard_keys(r.activity_id, r.layout, home).dry())
                        .arg(1)
                        .arg("PX")
                        .arg(DRY_MS)
                        .query_async(&mut self.conn.clone())
                        .await?;
                    return Ok(Admission::SoldOut);
                }
            }
        }
    }

    /// Asks the other shards in turn to lend to `home`, until one does.
    async fn borrow_round(&self, r: &ReserveRequest<'_>, home: usize) -> RedisResult<Lend> {
        let mut verdict = Lend::Nothing;
        for step in 1..r.layout.shards {
            let donor = (home + step) % r.layout.shards;
            match self.transfer(r, home, donor).await? {
                Lend::Lent => return Ok(Lend::Lent),
                Lend::InFlight => verdict = Lend::InFlight,
                Lend::Nothing => {}
            }
        }
        Ok(verdict)
    }

    /// The admission script in one shard; `None` when the shard lacks the
    /// units and others may not (sharded activities only).
    async fn reserve_in(
        &self,
        r: &ReserveRequest<'_>,
        shard: usize,
    ) -> RedisResult<Option<Admission>> {
        let buckets = r.layout.buckets;
        let k = self.shard_keys(r.activity_id, r.layout, shard);
        let mut call = self.reserve.prepare_invoke();
        call.key(k.meta())
            .key(k.requests())
            .key(k.holdings())
            .key(k.token(r.token))
            .key(k.reservation(r.order_no))
            .key(k.open())
            .key(k.dry());
        for b in 0..buckets {
            call.key(k.bucket(b));
        }
        let first_bucket = if buckets > 1 {
            fastrand::usize(..buckets)
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
            .arg(r.coupon_id.map(|c| c.to_string()).unwrap_or_default())
            .arg(if r.layout.is_sharded() { "1" } else { "0" });
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
        Ok(Some(match code {
            0 => Admission::Accepted(order_no()),
            1 => Admission::Duplicate(order_no()),
            2 => Admission::SoldOut,
            3 => Admission::LimitExceeded,
            4 => Admission::InvalidToken,
            5 => Admission::NotActive,
            7 => Admission::NumberTaken,
            8 => return Ok(None),
            _ => Admission::NotWarm,
        }))
    }

    /// Moves a batch of units from shard `donor` to shard `home` (lend,
    /// borrow, settle: docs/HOT_ACTIVITY.md). A failure part way leaves a
    /// transfer record in the donor, which [`RedisGate::settle_transfers`]
    /// completes.
    async fn transfer(
        &self,
        r: &ReserveRequest<'_>,
        home: usize,
        donor: usize,
    ) -> RedisResult<Lend> {
        let layout = r.layout;
        // Unique per transfer: one purchase may borrow from the same donor
        // twice, and a repeated id would find its credit already given.
        let id = format!("{}.{donor}.{:x}", r.order_no, fastrand::u64(..));
        let from = self.shard_keys(r.activity_id, layout, donor);
        let mut call = self.lend.prepare_invoke();
        call.key(from.lent());
        for b in 0..layout.buckets {
            call.key(from.bucket(b));
        }
        let lent: i64 = call
            .arg(&id)
            .arg(r.quantity)
            .arg(home)
            .arg(r.now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if lent < 0 {
            return Ok(Lend::InFlight);
        }
        if lent == 0 {
            return Ok(Lend::Nothing);
        }
        self.credit(r.activity_id, layout, home, &id, lent).await?;
        let _: i64 = redis::cmd("HDEL")
            .arg(from.lent())
            .arg(&id)
            .query_async(&mut self.conn.clone())
            .await?;
        tracing::debug!(
            activity_id = r.activity_id,
            home,
            donor,
            lent,
            "units moved between shards"
        );
        Ok(Lend::Lent)
    }

    /// Credits shard `home` with transfer `id`'s units, once (`borrow.lua`).
    async fn credit(
        &self,
        activity_id: i64,
        layout: Layout,
        home: usize,
        id: &str,
        units: i64,
    ) -> RedisResult<bool> {
        let to = self.shard_keys(activity_id, layout, home);
        let mut call = self.borrow.prepare_invoke();
        call.key(to.credited(id)).key(to.dry());
        for b in 0..layout.buckets {
            call.key(to.bucket(b));
        }
        let credited: i64 = call
            .arg(units)
            .arg(fastrand::usize(..layout.buckets))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(credited == 1)
    }

    /// The transfers the shards have lent and not yet settled.
    async fn transfers(&self, activity_id: i64, layout: Layout) -> RedisResult<Vec<Transfer>> {
        let mut found = Vec::new();
        if !layout.is_sharded() {
            return Ok(found);
        }
        for donor in 0..layout.shards {
            let lent: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(self.shard_keys(activity_id, layout, donor).lent())
                .query_async(&mut self.conn.clone())
                .await?;
            for (id, record) in lent {
                let mut parts = record.split(':').map(str::parse::<i64>);
                if let (Some(Ok(home)), Some(Ok(units)), Some(Ok(at_ms))) =
                    (parts.next(), parts.next(), parts.next())
                {
                    found.push(Transfer {
                        donor,
                        id,
                        home: usize::try_from(home).unwrap_or(0) % layout.shards,
                        units,
                        at_ms,
                    });
                }
            }
        }
        Ok(found)
    }

    /// Completes transfers lent before `before_ms` and never settled (the
    /// lending process died part way): credits the home shard unless it
    /// was credited, then drops the record. Returns how many it completed.
    /// Reconciliation only.
    pub async fn settle_transfers(
        &self,
        activity_id: i64,
        layout: Layout,
        before_ms: i64,
    ) -> RedisResult<usize> {
        let mut settled = 0;
        for t in self.transfers(activity_id, layout).await? {
            if t.at_ms >= before_ms {
                continue;
            }
            self.credit(activity_id, layout, t.home, &t.id, t.units)
                .await?;
            let _: i64 = redis::cmd("HDEL")
                .arg(self.shard_keys(activity_id, layout, t.donor).lent())
                .arg(&t.id)
                .query_async(&mut self.conn.clone())
                .await?;
            settled += 1;
        }
        Ok(settled)
    }

    /// Gives a reservation's stock back; idempotent per order. Returns
    /// whether this call released it.
    pub async fn release(
        &self,
        activity_id: i64,
        order_no: i64,
        layout: Layout,
        reason: ReleaseReason,
    ) -> RedisResult<bool> {
        let k = self.order_keys(activity_id, layout, order_no);
        let mut call = self.release.prepare_invoke();
        call.key(k.reservation(order_no))
            .key(k.open())
            .key(k.holdings())
            .key(k.requests());
        for b in 0..layout.buckets {
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
            .arg(user)
            .arg(&self.returned)
            .arg(activity_id);
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
        layout: Layout,
        order_nos: &[i64],
        now_ms: i64,
    ) -> RedisResult<Vec<Option<Status>>> {
        let mut found = vec![None; order_nos.len()];
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut call = self.ack.prepare_invoke();
            for &(_, o) in &group {
                call.key(k.reservation(o));
            }
            let statuses: Vec<String> = call
                .arg(now_ms)
                .invoke_async(&mut self.conn.clone())
                .await?;
            for ((i, _), s) in group.iter().zip(statuses) {
                found[*i] = Status::parse(&s);
            }
        }
        Ok(found)
    }

    /// Reads a reservation before its event is sent again; an open,
    /// unacknowledged one has its `sent` time moved to `now_ms` in the same
    /// call (see `sending.lua`). `None` when the record is gone.
    pub async fn sending(
        &self,
        activity_id: i64,
        layout: Layout,
        order_no: i64,
        now_ms: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<String> = self
            .sending
            .key(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
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
        layout: Layout,
        order_no: i64,
        cutoff_ms: i64,
    ) -> RedisResult<VoidClaim> {
        let code: i64 = self
            .void
            .key(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
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
    /// one round trip per shard; `None` where the record is gone.
    pub async fn statuses(
        &self,
        activity_id: i64,
        layout: Layout,
        order_nos: &[i64],
    ) -> RedisResult<Vec<Option<Status>>> {
        let mut found = vec![None; order_nos.len()];
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut pipe = redis::pipe();
            for &(_, o) in &group {
                pipe.hget(k.reservation(o), "status");
            }
            let statuses: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
            for ((i, _), s) in group.iter().zip(statuses) {
                found[*i] = s.as_deref().and_then(Status::parse);
            }
        }
        Ok(found)
    }

    /// Marks reservations of orders now in the database as committed;
    /// idempotent. Returns the order_nos that had been released meanwhile.
    pub async fn commit(
        &self,
        activity_id: i64,
        layout: Layout,
        order_nos: &[i64],
    ) -> RedisResult<Vec<i64>> {
        let mut conflicts = Vec::new();
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut call = self.commit.prepare_invoke();
            call.key(k.open());
            for &(_, o) in &group {
                call.key(k.reservation(o)).arg(o);
            }
            let found: Vec<i64> = call.invoke_async(&mut self.conn.clone()).await?;
            conflicts.extend(found);
        }
        Ok(conflicts)
    }

    /// Loads stock and the sale window, unless already warm: each shard
    /// its share of the units and a copy of the window, then the base meta.
    /// Returns `(warmed_now, units_in_redis)`.
    pub async fn warmup(&self, spec: &WarmSpec) -> RedisResult<(bool, i64)> {
        let layout = spec.layout;
        let (mut warmed_now, mut units) = (false, 0);
        for (shard, share) in layout.split(i64::from(spec.units)).into_iter().enumerate() {
            let k = self.shard_keys(spec.activity_id, layout, shard);
            let mut call = self.warmup.prepare_invoke();
            call.key(k.meta());
            for b in 0..layout.buckets {
                call.key(k.bucket(b));
            }
            call.arg(spec.start_ms)
                .arg(spec.end_ms)
                .arg(spec.per_user_limit)
                .arg(share)
                .arg(spec.price_cents);
            let (code, found): (i64, i64) = call.invoke_async(&mut self.conn.clone()).await?;
            warmed_now |= code == 0;
            units += found;
        }
        if layout.is_sharded() {
            self.write_base_meta(spec).await?;
        }
        Ok((warmed_now, units))
    }

    /// The base meta of a sharded activity (what [`RedisGate::meta`]
    /// reads): the window, limit, price and layout.
    async fn write_base_meta(&self, spec: &WarmSpec) -> RedisResult<()> {
        redis::cmd("HSET")
            .arg(self.keys(spec.activity_id).meta())
            .arg("start_ms")
            .arg(spec.start_ms)
            .arg("end_ms")
            .arg(spec.end_ms)
            .arg("limit")
            .arg(spec.per_user_limit)
            .arg("price")
            .arg(spec.price_cents)
            .arg("buckets")
            .arg(spec.layout.buckets)
            .arg("shards")
            .arg(spec.layout.shards)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Units available in Redis: the sum of every shard's buckets, plus
    /// units lent by one shard and not yet credited to another.
    pub async fn available(&self, activity_id: i64, layout: Layout) -> RedisResult<i64> {
        let mut sum = 0;
        for shard in 0..layout.shards {
            sum += self.shard_sum(activity_id, layout, shard).await?;
        }
        for t in self.transfers(activity_id, layout).await? {
            let credited: bool = redis::cmd("EXISTS")
                .arg(self.shard_keys(activity_id, layout, t.home).credited(&t.id))
                .query_async(&mut self.conn.clone())
                .await?;
            if !credited {
                sum += t.units;
            }
        }
        Ok(sum)
    }

    async fn shard_sum(&self, activity_id: i64, layout: Layout, shard: usize) -> RedisResult<i64> {
        let k = self.shard_keys(activity_id, layout, shard);
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(k.buckets(layout.buckets))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(values.into_iter().flatten().sum())
    }

    /// Sets the activity's Redis stock to `target` units, but only while
    /// no reservation is open and the buckets still sum to `expected`
    /// (`repair.lua`). Returns the delta applied, or `None` when something
    /// moved in between and nothing was done. Reconciliation only.
    ///
    /// A sharded activity is repaired in its shard 0, by the same
    /// compare-and-set; the other shards are read before (nothing open,
    /// nothing lent) and after, and if any moved meanwhile the repair is
    /// undone and `None` returned.
    pub async fn repair(
        &self,
        activity_id: i64,
        layout: Layout,
        expected: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        if !layout.is_sharded() {
            return self
                .repair_shard(activity_id, layout, 0, expected, target)
                .await;
        }
        let before = self.shard_states(activity_id, layout).await?;
        if before.iter().any(|s| s.open > 0 || s.lent > 0)
            || before.iter().map(|s| s.sum).sum::<i64>() != expected
        {
            return Ok(None);
        }
        let sum0 = before[0].sum;
        let Some(applied) = self
            .repair_shard(activity_id, layout, 0, sum0, sum0 + target - expected)
            .await?
        else {
            return Ok(None);
        };
        let after = self.shard_states(activity_id, layout).await?;
        if after[1..] == before[1..] {
            return Ok(Some(applied));
        }
        // Another shard moved while shard 0 was repaired: the figures
        // described different moments. Undo (a compare-and-set again).
        if self
            .repair_shard(activity_id, layout, 0, sum0 + applied, sum0)
            .await?
            .is_none()
        {
            tracing::warn!(
                activity_id,
                applied,
                "a sharded repair could not be undone; the next run compares again"
            );
        }
        Ok(None)
    }

    async fn repair_shard(
        &self,
        activity_id: i64,
        layout: Layout,
        shard: usize,
        expected: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        let k = self.shard_keys(activity_id, layout, shard);
        let mut call = self.repair.prepare_invoke();
        call.key(k.open());
        for b in 0..layout.buckets {
            call.key(k.bucket(b));
        }
        let (done, value): (i64, i64) = call
            .arg(expected)
            .arg(target)
            .arg(&self.returned)
            .arg(activity_id)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok((done == 1).then_some(value))
    }

    /// Purchases the activity has accepted since it was warmed (or
    /// restored), over its shards.
    pub async fn acceptances(&self, activity_id: i64, layout: Layout) -> RedisResult<i64> {
        let mut sum = 0;
        for shard in 0..layout.shards {
            let n: Option<i64> = redis::cmd("HGET")
                .arg(self.shard_keys(activity_id, layout, shard).meta())
                .arg("accepted")
                .query_async(&mut self.conn.clone())
                .await?;
            sum += n.unwrap_or(0);
        }
        Ok(sum)
    }

    /// The users with a request accepted in the activity (its request-id
    /// hashes), over its shards.
    pub async fn buyers(
        &self,
        activity_id: i64,
        layout: Layout,
    ) -> RedisResult<std::collections::HashSet<i64>> {
        let mut buyers = std::collections::HashSet::new();
        for shard in 0..layout.shards {
            let fields: Vec<String> = redis::cmd("HKEYS")
                .arg(self.shard_keys(activity_id, layout, shard).requests())
                .query_async(&mut self.conn.clone())
                .await?;
            buyers.extend(
                fields
                    .iter()
                    .filter_map(|f| f.split_once(':')?.0.parse::<i64>().ok()),
            );
        }
        Ok(buyers)
    }

    async fn shard_states(&self, activity_id: i64, layout: Layout) -> RedisResult<Vec<ShardState>> {
        let mut states = Vec::with_capacity(layout.shards);
        for shard in 0..layout.shards {
            let k = self.shard_keys(activity_id, layout, shard);
            let (open, lent): (i64, i64) = redis::pipe()
                .cmd("ZCARD")
                .arg(k.open())
                .cmd("HLEN")
                .arg(k.lent())
                .query_async(&mut self.conn.clone())
                .await?;
            states.push(ShardState {
                sum: self.shard_sum(activity_id, layout, shard).await?,
                open,
                lent,
            });
        }
        Ok(states)
    }

    /// Open reservations made before `cutoff_ms` (up to 1,000 per shard).
    pub async fn open_before(
        &self,
        activity_id: i64,
        layout: Layout,
        cutoff_ms: i64,
    ) -> RedisResult<Vec<i64>> {
        let mut found = Vec::new();
        for shard in 0..layout.shards {
            let some: Vec<i64> = redis::cmd("ZRANGEBYSCORE")
                .arg(self.shard_keys(activity_id, layout, shard).open())
                .arg("-inf")
                .arg(format!("({cutoff_ms}"))
                .arg("LIMIT")
                .arg(0)
                .arg(1000)
                .query_async(&mut self.conn.clone())
                .await?;
            found.extend(some);
        }
        Ok(found)
    }

    /// Removes an ended activity's keys (meta, buckets, request and holding
    /// hashes, open index, transfer records). Reservation records expire on
    /// their own.
    pub async fn remove_activity(&self, activity_id: i64, layout: Layout) -> RedisResult<()> {
        for shard in 0..layout.shards {
            let k = self.shard_keys(activity_id, layout, shard);
            // The records of open reservations first: one left behind
            // would be sent again by its publisher after the restore's
            // snapshot, and its units counted twice. The open set names
            // them; a record in it outlives the set only by a moment (the
            // admission script writes both at once, and the meta, dropped
            // below, is gone for it afterwards).
            let open: Vec<i64> = redis::cmd("ZRANGE")
                .arg(k.open())
                .arg(0)
                .arg(-1)
                .query_async(&mut self.conn.clone())
                .await?;
            for chunk in open.chunks(500) {
                let records: Vec<String> = chunk.iter().map(|&no| k.reservation(no)).collect();
                let _: () = redis::cmd("DEL")
                    .arg(records)
                    .query_async(&mut self.conn.clone())
                    .await?;
            }
            let mut keys = k.buckets(layout.buckets);
            keys.extend([
                k.meta(),
                k.requests(),
                k.holdings(),
                k.open(),
                k.lent(),
                k.dry(),
            ]);
            let _: () = redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut self.conn.clone())
                .await?;
        }
        let base = self.keys(activity_id);
        redis::cmd("DEL")
            .arg(&[base.meta(), base.restoring()])
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Closes a warm activity's sale window at `now_ms` on every meta hash
    /// (the admission script reads the window there): `end_ms` moves to
    /// `now_ms` if it was later, and `start_ms` to just before it if it was
    /// later still. Idempotent; an activity never warmed is left alone.
    pub async fn end_sale(&self, activity_id: i64, layout: Layout, now_ms: i64) -> RedisResult<()> {
        let script = Script::new(
            "if redis.call('HEXISTS', KEYS[1], 'start_ms') == 0 then return 0 end \
             local now = tonumber(ARGV[1]) \
             if tonumber(redis.call('HGET', KEYS[1], 'end_ms')) > now then \
               redis.call('HSET', KEYS[1], 'end_ms', now) end \
             if tonumber(redis.call('HGET', KEYS[1], 'start_ms')) >= now then \
               redis.call('HSET', KEYS[1], 'start_ms', now - 1) end \
             return 1",
        );
        let mut metas = vec![self.keys(activity_id).meta()];
        if layout.is_sharded() {
            metas
                .extend((0..layout.shards).map(|s| self.shard_keys(activity_id, layout, s).meta()));
        }
        for meta in metas {
            let _: i64 = script
                .key(meta)
                .arg(now_ms)
                .invoke_async(&mut self.conn.clone())
                .await?;
        }
        Ok(())
    }

    /// Drops an order from the open index (its record is gone).
    pub async fn forget_open(
        &self,
        activity_id: i64,
        layout: Layout,
        order_no: i64,
    ) -> RedisResult<()> {
        redis::cmd("ZREM")
            .arg(self.order_keys(activity_id, layout, order_no).open())
            .arg(order_no)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Number of open (not yet committed) reservations, over all shards.
    pub async fn open_reservations(&self, activity_id: i64, layout: Layout) -> RedisResult<i64> {
        let mut open = 0;
        for shard in 0..layout.shards {
            let n: i64 = redis::cmd("ZCARD")
                .arg(self.shard_keys(activity_id, layout, shard).open())
                .query_async(&mut self.conn.clone())
                .await?;
            open += n;
        }
        Ok(open)
    }

    /// The activity's window, limits and layout, when it is warm.
    pub async fn meta(&self, activity_id: i64) -> RedisResult<Option<Meta>> {
        type Fields = (
            Option<i64>,
            Option<i64>,
            Option<i32>,
            Option<usize>,
            Option<usize>,
        );
        let (start, end, limit, buckets, shards): Fields = redis::cmd("HMGET")
            .arg(self.keys(activity_id).meta())
            .arg(&["start_ms", "end_ms", "limit", "buckets", "shards"])
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(match (start, end, limit, buckets) {
            (Some(start_ms), Some(end_ms), Some(per_user_limit), Some(buckets)) => Some(Meta {
                start_ms,
                end_ms,
                per_user_limit,
                layout: Layout::new(buckets, shards.unwrap_or(1)),
            }),
            _ => None,
        })
    }

    /// When Redis was first seen without this (warmed) activity: sets the
    /// marker to `now_ms` unless it is there, and returns its value.
    pub async fn restoring_since(&self, activity_id: i64, now_ms: i64) -> RedisResult<i64> {
        crate::store::redis_conn::first_seen(
            &self.conn,
            &self.keys(activity_id).restoring(),
            now_ms,
        )
        .await
    }

    /// Rebuilds a lost activity from a database snapshot, in one
    /// MULTI/EXEC per shard: the stock, the request ids and holdings of its
    /// orders, the records of its live and released orders (so a later
    /// cancel or release applies exactly once), and the meta last, which
    /// opens it (a sharded activity's base meta after every shard's).
    pub async fn restore(&self, r: &Restore) -> RedisResult<()> {
        let layout = r.spec.layout;
        let shares = layout.split(i64::from(r.spec.units));
        for (shard, share) in shares.into_iter().enumerate() {
            self.restore_shard(r, shard, share).await?;
        }
        if layout.is_sharded() {
            self.write_base_meta(&r.spec).await?;
        }
        let _: () = redis::cmd("DEL")
            .arg(self.keys(r.spec.activity_id).restoring())
            .query_async(&mut self.conn.clone())
            .await?;
        // Sold-out flags of the activity's past go.
        redis::cmd("PUBLISH")
            .arg(&self.returned)
            .arg(r.spec.activity_id)
            .query_async(&mut self.conn.clone())
            .await
    }

    async fn restore_shard(&self, r: &Restore, shard: usize, units: i64) -> RedisResult<()> {
        let layout = r.spec.layout;
        let k = self.shard_keys(r.spec.activity_id, layout, shard);
        let ttl = self.reservation_ttl_secs;
        let mut pipe = redis::pipe();
        pipe.atomic();
        let mut stale = k.buckets(layout.buckets);
        stale.extend([
            k.requests(),
            k.holdings(),
            k.open(),
            k.meta(),
            k.lent(),
            k.dry(),
        ]);
        pipe.cmd("DEL").arg(stale).ignore();
        for (b, share) in split_evenly(units, layout.buckets).into_iter().enumerate() {
            pipe.cmd("SET").arg(k.bucket(b)).arg(share).ignore();
        }
        let buyers: Vec<&RestoredOrder> = r
            .orders
            .iter()
            .filter(|o| layout.shard_of_user(o.user_id) == shard)
            .collect();
        for chunk in buyers.chunks(500) {
            let mut requests = redis::cmd("HSET");
            requests.arg(k.requests());
            for o in chunk {
                requests
                    .arg(format!("{}:{}", o.user_id, o.request_id))
                    .arg(o.order_no);
            }
            pipe.add_command(requests).ignore();
        }
        for o in r
            .orders
            .iter()
            .filter(|o| layout.shard_of_order(o.order_no) == shard)
        {
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
        for o in buyers.iter().filter(|o| o.holds) {
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
            .arg(layout.buckets)
            // The acceptance count restarts below zero (minus now): no
            // count an instance read before the loss matches one after, so
            // its sold-out fast path reads the restored buyers again.
            .arg("accepted")
            .arg(-chrono::Utc::now().timestamp_millis())
            .ignore();
        pipe.query_async(&mut self.conn.clone()).await
    }

    /// Takes the lease `name` for `owner` for `ttl_ms` unless another owner
    /// holds it; true when `owner` holds it now.
    ///
    /// An owner that holds it already takes it again: a run cut short by
    /// Redis failing (its `SET` applied, the answer or the give-back lost,
    /// as a paused Redis does on resuming) must not keep the owner's own
    /// next runs out for the lease's whole lifetime.
    pub async fn try_lease(&self, name: &str, owner: &str, ttl_ms: u64) -> RedisResult<bool> {
        let script = Script::new(
            "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end \
             if redis.call('GET', KEYS[1]) == ARGV[1] then \
               redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end \
             return 0",
        );
        let taken: i64 = script
            .key(format!("{}lease:{name}", self.prefix))
            .arg(owner)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(taken == 1)
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

    /// Keeps `note` under `name` for `ttl_secs` (the last reconciliation's
    /// report, for whichever instance an operator asks).
    pub async fn put_note(&self, name: &str, note: &str, ttl_secs: u64) -> RedisResult<()> {
        redis::cmd("SET")
            .arg(format!("{}note:{name}", self.prefix))
            .arg(note)
            .arg("EX")
            .arg(ttl_secs.max(1))
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The note kept under `name`, if it has not expired.
    pub async fn note(&self, name: &str) -> RedisResult<Option<String>> {
        redis::cmd("GET")
            .arg(format!("{}note:{name}", self.prefix))
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

    /// Whether every shard of a sharded activity still has its meta (a
    /// shard's master can restart empty while the base keys, elsewhere,
    /// stay). One EXISTS per shard: their keys sit in different slots.
    pub async fn shards_warm(&self, activity_id: i64, layout: Layout) -> RedisResult<bool> {
        if !layout.is_sharded() {
            return Ok(true);
        }
        for shard in 0..layout.shards {
            let exists: bool = redis::cmd("EXISTS")
                .arg(self.shard_keys(activity_id, layout, shard).meta())
                .query_async(&mut self.conn.clone())
                .await?;
            if !exists {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Stores a one-time purchase token bound to `user_id`, in the buyer's
    /// shard.
    pub async fn issue_token(
        &self,
        activity_id: i64,
        layout: Layout,
        user_id: i64,
        token: &str,
        ttl_secs: u64,
    ) -> RedisResult<()> {
        let k = self.shard_keys(activity_id, layout, layout.shard_of_user(user_id));
        redis::cmd("SET")
            .arg(k.token(token))
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
        layout: Layout,
        order_no: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
            .arg(&Reservation::FIELDS)
            .query_async(&mut self.conn.clone())
            .await?;
        let fields: Vec<String> = fields.into_iter().map(Option::unwrap_or_default).collect();
        Ok(Reservation::from_fields(&fields))
    }
}

/// How long a shard that found every other shard empty answers SOLD_OUT
/// without asking them again: a release elsewhere is seen within this.
const DRY_MS: u64 = 200;

/// Most rounds of borrowing one purchase goes through.
const BORROW_ROUNDS: usize = 8;

/// A transfer between shards older than this was left part way (a live one
/// takes three round trips): a purchase that keeps finding units on their
/// way completes it.
const STALE_TRANSFER_MS: i64 = 1000;

/// The pause before looking again at units on their way between shards
/// (a transfer takes three round trips).
const IN_FLIGHT_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

/// What asking another shard to lend found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lend {
    /// Units moved to the buyer's shard.
    Lent,
    /// None to lend, but units lent earlier may still be on their way.
    InFlight,
    /// None to lend.
    Nothing,
}

/// Units one shard lent another, not yet settled.
#[derive(Debug)]
struct Transfer {
    donor: usize,
    id: String,
    home: usize,
    units: i64,
    at_ms: i64,
}

/// What a sharded repair compares before and after.
#[derive(Debug, PartialEq, Eq)]
struct ShardState {
    sum: i64,
    open: i64,
    lent: i64,
}

/// `order_nos` grouped by the shard of each, with their positions.
fn by_shard(
    layout: Layout,
    order_nos: &[i64],
) -> std::collections::BTreeMap<usize, Vec<(usize, i64)>> {
    let mut groups: std::collections::BTreeMap<usize, Vec<(usize, i64)>> = Default::default();
    for (i, &o) in order_nos.iter().enumerate() {
        groups
            .entry(layout.shard_of_order(o))
            .or_default()
            .push((i, o));
    }
    groups
}

/// The gate of one HTTP server thread (actix calls it a worker): its own
/// multiplexed connection, so the threads do not queue on one socket.
pub struct ThreadGate(pub RedisGate);

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

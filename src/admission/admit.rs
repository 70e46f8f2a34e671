//! The purchase pipeline (SPEC steps 1–2): from a parsed purchase to an
//! accepted order or a refusal saying why, with no database access on the
//! way (unless the activity cache misses and Redis has no meta for it).
//!
//! The order of the checks is the design: the caller's own rate bucket
//! first (one address flooding must not drain the activity's bucket for
//! everyone), then the activity's; the sale window from the in-process
//! cache; the sold-out flag (answered from memory); the coupon's
//! membership; back-pressure before Redis is touched (consumers behind or
//! stalled, a broker that acknowledges nothing, acknowledgements waiting,
//! too many purchases in flight); a number; ONE reservation script; then
//! the publish and its three-valued outcome ([`super::publish`]).
//!
//! A retry is never refused by a check made before the script: a refusal
//! of those checks first looks the request id up (one `HGET`), and a
//! request id bound to an order is answered as the replay it is.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{Notify, Semaphore};

use super::fallback::{Decided, Declined, Fallback, Route};
use super::gate::Meta as ActivityMeta;
use super::gate::Unsent;
use super::limits::{Limits, retry_secs};
use super::publish::{Confirmation, Published, Publisher};
pub use super::purchase::Purchase;
use super::soldout::SoldOut;
use super::{Admission, Layout, RedisGate, ReserveRequest};
use crate::activities::cache::{ActivityCache, Lookup};
use crate::bus::PublishError;
use crate::bus::events::OrderRequested;
use crate::bus::progress;
use crate::clock::SharedClock;
use crate::config::Settings;
use crate::coupons::gate::CouponGate;
use crate::domain::{ActivityId, CouponId, UserId, is_client_key};
use crate::ids::{IdGenerator, OrderNo};
use crate::metrics::Metrics;
use crate::store::PgPool;

/// A purchase the broker has: 202, or (a replay) the order's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// Reserved and delivered now.
    Accepted(OrderNo),
    /// Written to the database now, WAITING_PAY: Redis is down and the
    /// activity is sold through the fallback ([`super::fallback`]).
    Fallback(OrderNo),
    /// The request id was already bound to this order, whose delivery this
    /// retry confirmed just now (`confirmed_now`), or which was confirmed
    /// or settled before (answer with its current status).
    Replayed {
        /// The order the request id is bound to.
        order_no: OrderNo,
        /// Its activity's layout (where its reservation is).
        layout: Layout,
        /// Whether this retry's send made it accepted.
        confirmed_now: bool,
    },
}

/// The `Retry-After` of a purchase refused while the cluster refuses
/// writes: a broker's return takes seconds, and the probe looks every one.
const WRITES_REFUSED_RETRY_SECS: u32 = 5;

/// `admission.max_consumer_lag` is sized as this many seconds of draining
/// (config/default.toml): the drain rate a `Retry-After` estimates with.
const LAG_BOUND_SECS: i64 = 5;

/// The lag purchases are held past, and the drain rate (orders a second)
/// a `Retry-After` estimates with: `admission.max_consumer_lag`, sized as
/// `LAG_BOUND_SECS` of draining; but when `orders.max_write_rate` paces
/// the consumers slower than that, its rate, and at most `LAG_BOUND_SECS`
/// of it behind (a lag the bound allows would otherwise take minutes to
/// write).
fn lag_bound(max_consumer_lag: i64, max_write_rate: u32) -> (i64, i64) {
    let sized = (max_consumer_lag / LAG_BOUND_SECS).max(1);
    match i64::from(max_write_rate) {
        0 => (max_consumer_lag, sized),
        paced => {
            let per_sec = paced.min(sized);
            (max_consumer_lag.min(per_sec * LAG_BOUND_SECS), per_sec)
        }
    }
}

/// Seconds until a lag of `lag` is back under `bound`, draining `per_sec`
/// orders a second; 1 to 30.
fn drain_secs(lag: i64, bound: i64, per_sec: i64) -> u32 {
    let per_sec = per_sec.max(1);
    let excess = (lag - bound).max(0);
    u32::try_from((excess + per_sec - 1) / per_sec)
        .unwrap_or(u32::MAX)
        .clamp(1, 30)
}

/// Why a purchase was not accepted (each one answers differently).
#[derive(Debug)]
pub enum Refusal {
    /// The body is wrong (400).
    Invalid(&'static str),
    /// A token bucket is empty (429); says whose, and in how many seconds
    /// it holds a token again.
    RateLimited(&'static str, u32),
    /// The database fallback's rate for the activity is used up (429), in
    /// how many seconds it has room again. Redis is down, so no lookup of
    /// a replay in it is tried: each would be one more failed connection
    /// per refusal, while the fallback refuses most purchases. A replay of
    /// an order the fallback wrote is answered once within the rate.
    FallbackRateLimited(u32),
    /// The sale is not open (409).
    NotActive,
    /// Redis lost the activity and reconciliation is restoring it (503).
    Restoring,
    /// Sold out (409); `from_memory` when the sold-out flag answered.
    SoldOut {
        /// Answered from the in-process flag, Redis not asked.
        from_memory: bool,
    },
    /// The coupon cannot back this order (400): why.
    CouponInvalid(&'static str),
    /// Back-pressure (503 BUSY); says which, and in how many seconds a
    /// retry may find room.
    Busy(&'static str, u32),
    /// No instance id is leased, so no number can be made (503).
    NoOrderNumber,
    /// Redis is down and the database fallback does not take this
    /// purchase yet (503 RETRY_LATER): why, and when to retry.
    Degraded(&'static str, u32),
    /// The buyer already holds the per-user limit (409).
    LimitExceeded,
    /// The purchase token is missing, used, expired or not the buyer's.
    InvalidToken,
    /// The number made was already reserved: two instances share an id.
    NumberTaken,
    /// The broker definitely does not have it; nothing was kept (503).
    NotQueued,
    /// The cluster answers but refuses writes (too few in-sync replicas):
    /// nothing was reserved (503 RETRY_LATER), in how many seconds to retry.
    WritesRefused(u32),
    /// The delivery is not confirmed yet: retry with the same request id
    /// (503, with the order_no).
    Pending(OrderNo),
    /// Redis failed during the reservation (503); counted.
    ReserveFailed(anyhow::Error),
    /// A dependency failed before anything was reserved (503).
    Unavailable(anyhow::Error),
}

impl Refusal {
    /// For a refusal a retry may get past: in how many seconds (the
    /// `Retry-After` of its 429 or 503).
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            Self::RateLimited(_, secs)
            | Self::FallbackRateLimited(secs)
            | Self::Busy(_, secs)
            | Self::Degraded(_, secs)
            | Self::WritesRefused(secs) => Some(*secs),
            Self::Restoring
            | Self::NoOrderNumber
            | Self::NotQueued
            | Self::NumberTaken
            | Self::Pending(_)
            | Self::ReserveFailed(_)
            | Self::Unavailable(_) => Some(1),
            Self::Invalid(_)
            | Self::NotActive
            | Self::SoldOut { .. }
            | Self::CouponInvalid(_)
            | Self::LimitExceeded
            | Self::InvalidToken => None,
        }
    }

    /// Whether this refusal comes from a check made before the admission
    /// script (which answers a replay first), so that a retry bound to an
    /// order must be looked up before hearing it. Not the sold-out flag's:
    /// those stand only once no buyer was accepted since the flag's
    /// buyers were read (`SoldOut::confirm`), one read for many refusals.
    fn spares_a_replay(&self) -> bool {
        matches!(
            self,
            Self::RateLimited(..)
                | Self::Busy(..)
                | Self::WritesRefused(_)
                | Self::CouponInvalid(_)
        )
    }

    /// The `seckill_admission_total` outcome label, for those counted.
    pub fn outcome(&self) -> Option<&'static str> {
        Some(match self {
            Self::RateLimited(..) | Self::FallbackRateLimited(_) => "rate_limited",
            Self::NotActive => "not_active",
            Self::Restoring
            | Self::NoOrderNumber
            | Self::NotQueued
            | Self::ReserveFailed(_)
            | Self::WritesRefused(_)
            | Self::Degraded(..) => "retry_later",
            Self::SoldOut { from_memory: true } => "sold_out_memory",
            Self::SoldOut { from_memory: false } => "sold_out",
            Self::Busy(..) => "busy",
            Self::LimitExceeded => "limit_exceeded",
            Self::InvalidToken => "invalid_token",
            Self::NumberTaken => "number_taken",
            Self::Pending(_) => "pending",
            Self::Invalid(_) | Self::CouponInvalid(_) | Self::Unavailable(_) => return None,
        })
    }
}

/// Where and when a purchase's units were asked of Redis.
struct Reserved {
    layout: Layout,
    /// The number the order was reserved under.
    order_no: i64,
    /// The sale clock when it was asked (unix ms).
    now_ms: i64,
    /// When the script was called (a sold-out flag is asked at this moment).
    started: Instant,
    /// The activity's unit price (a coupon's minimum is checked on it).
    price_cents: i64,
}

/// What the pipeline needs; built once per process, shared by every HTTP
/// worker (each passes its own Redis connection to [`Admitter::admit`]).
pub struct Admitter {
    /// Admission and Kafka settings (limits, back-pressure).
    pub settings: Arc<Settings>,
    /// In-process token buckets (per activity, per client IP).
    pub limits: Limits,
    /// Warmed activities' windows and limits.
    pub activities: Arc<ActivityCache>,
    /// Activities Redis said are sold out.
    pub sold_out: Arc<SoldOut>,
    /// Coupon membership.
    pub coupons: Arc<CouponGate>,
    /// Purchases awaiting their delivery report; empty → 503 BUSY.
    pub in_flight: Arc<Semaphore>,
    /// Snowflake order numbers.
    pub ids: Arc<dyn IdGenerator>,
    /// Publishes accepted purchases (SPEC step 2).
    pub publisher: Arc<Publisher>,
    /// The shared gate (sold-out marking in the background).
    pub gate: Arc<RedisGate>,
    /// The database, for a cache miss Redis cannot answer.
    pub db: PgPool,
    /// Wakes the local reconciler when Redis lost an activity.
    pub restore_wanted: Arc<Notify>,
    /// Outcomes and script latency.
    pub metrics: Metrics,
    /// The sale clock (windows, reservation stamps).
    pub clock: SharedClock,
    /// The database fallback while Redis is down.
    pub fallback: Arc<Fallback>,
}

impl Admitter {
    /// Runs `purchase` through the pipeline on `gate` (the HTTP worker's
    /// own connection) and counts its outcome.
    pub async fn admit(&self, gate: &RedisGate, purchase: &Purchase) -> Result<Admitted, Refusal> {
        let result = self.run(gate, purchase).await;
        let outcome = match &result {
            Ok(Admitted::Accepted(_)) => Some("accepted"),
            Ok(Admitted::Fallback(_)) => Some("accepted_fallback"),
            Ok(Admitted::Replayed { .. }) => None, // counted as "duplicate" on the way
            Err(refusal) => refusal.outcome(),
        };
        if let Some(outcome) = outcome {
            self.count(outcome);
        }
        result
    }

    fn count(&self, outcome: &str) {
        self.metrics.admission.with_label_values(&[outcome]).inc();
    }

    async fn run(&self, gate: &RedisGate, p: &Purchase) -> Result<Admitted, Refusal> {
        if p.quantity < 1 {
            return Err(Refusal::Invalid("quantity must be at least 1"));
        }
        match self.checked(gate, p).await {
            // A retry of a purchase already bound to an order is answered
            // with that order, whatever a check before the script says:
            // refused BUSY, it would lose its order_no; refused 400 (its
            // coupon batch lost meanwhile), it would be told a final no
            // about an order that exists. Only refusals pay for the
            // lookup; an accepted purchase's script checks replays itself.
            Err(refusal) if refusal.spares_a_replay() => match self.bound(gate, p).await {
                Some((layout, order_no)) => {
                    self.count("duplicate");
                    self.replay(p.activity_id, layout, order_no).await
                }
                None => Err(refusal),
            },
            decided => decided,
        }
    }

    /// The order `p`'s request id is already bound to in Redis, if any
    /// (nothing when that cannot be asked: the refusal stands).
    async fn bound(&self, gate: &RedisGate, p: &Purchase) -> Option<(Layout, i64)> {
        let Ok(Lookup::Warm(meta)) = self
            .activities
            .lookup(gate, &self.db, p.activity_id, &*self.clock)
            .await
        else {
            return None;
        };
        let order_no = gate
            .bound_order(
                p.activity_id,
                meta.layout,
                p.user_id.get(),
                p.request_id.as_str(),
            )
            .await
            .ok()??;
        Some((meta.layout, order_no))
    }

    /// Every check, the script and the publish.
    async fn checked(&self, gate: &RedisGate, p: &Purchase) -> Result<Admitted, Refusal> {
        self.within_rate(p)?;
        match self.fallback.route(p.activity_id) {
            Route::Redis => {}
            Route::Database => return self.through_database(p).await,
            Route::Wait(why, secs) => return Err(Refusal::Degraded(why, secs)),
        }
        let meta = self.open_activity(gate, p.activity_id).await?;
        if p.quantity > meta.per_user_limit {
            return Err(Refusal::Invalid("quantity exceeds the per-user limit"));
        }
        let now_ms = self.clock.now_ms();
        // Sold out a moment ago, and this buyer has no order to be told
        // about: answered from memory (soldout.rs), once a read of the
        // acceptance count shared with the other refusals of the moment
        // finds no buyer accepted since; else the script decides.
        if meta.is_open(now_ms)
            && let Some(refused) = self.sold_out.refuses(p.activity_id, p.user_id.get())
            && self
                .sold_out
                .confirm(&self.gate, p.activity_id, meta.layout, refused)
                .await
        {
            return Err(Refusal::SoldOut { from_memory: true });
        }
        if p.coupon_id.is_some_and(|c| c.get() < 1) {
            return Err(Refusal::CouponInvalid("no such coupon"));
        }
        self.not_overloaded(now_ms)?;
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            return Err(Refusal::Busy(
                "too many purchases in flight; retry shortly",
                1,
            ));
        };
        let layout = meta.layout;
        let order_no = match self.number(p.user_id) {
            Ok(n) => n,
            // No number to mint now (the lease is being taken or was
            // lost): a retry of a purchase already admitted needs none.
            Err(refusal) => {
                let replayed = self
                    .gate
                    .requested_order(
                        p.activity_id,
                        layout,
                        p.user_id.get(),
                        p.request_id.as_str(),
                    )
                    .await
                    .ok()
                    .flatten();
                return match replayed {
                    Some(order_no) => self.replay(p.activity_id, layout, order_no).await,
                    None => Err(refusal),
                };
            }
        };
        let token = p
            .token
            .as_deref()
            .filter(|t| is_client_key(t))
            .unwrap_or("");
        let reserve = ReserveRequest {
            activity_id: p.activity_id,
            user_id: p.user_id.get(),
            request_id: p.request_id.as_str(),
            token,
            quantity: p.quantity,
            order_no,
            layout,
            now_ms,
            coupon_id: p.coupon_id,
        };
        let started = Instant::now();
        let admission = gate
            .reserve(&reserve)
            .await
            .map_err(|e| Refusal::ReserveFailed(e.into()))?;
        self.metrics
            .lua_duration
            .observe(started.elapsed().as_secs_f64());
        self.answer(
            admission,
            p,
            Reserved {
                layout,
                order_no,
                now_ms,
                started,
                price_cents: meta.price_cents,
            },
            permit,
        )
        .await
    }

    /// What the admission script's answer means for the buyer: an
    /// accepted purchase is published (SPEC step 2), the rest refused.
    async fn answer(
        &self,
        admission: Admission,
        p: &Purchase,
        at: Reserved,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<Admitted, Refusal> {
        let Reserved {
            layout,
            order_no,
            now_ms,
            started,
            price_cents,
        } = at;
        match admission {
            Admission::Accepted(order_no) => {
                if let Some(coupon_id) = p.coupon_id {
                    let amount = price_cents.saturating_mul(i64::from(p.quantity));
                    self.hold_coupon(p, coupon_id, layout, order_no, amount, now_ms)
                        .await?;
                }
                let event = OrderRequested {
                    event_id: order_no.to_string(),
                    order_no: OrderNo::new(order_no),
                    activity_id: p.activity_id,
                    user_id: p.user_id.get(),
                    request_id: p.request_id.as_str().to_owned(),
                    quantity: p.quantity,
                    coupon_id: p.coupon_id,
                    reserved_at_ms: now_ms,
                };
                let published = self.publisher.publish(event, layout, permit).await;
                if let (Published::NotDelivered(_), Some(coupon_id)) = (&published, p.coupon_id) {
                    // Nothing was kept: the coupon is free again. A hold
                    // left behind (Redis failing now) is freed by
                    // reconciliation once the order is known never to be.
                    let _ = self
                        .coupons
                        .unhold(coupon_id, p.user_id.get(), order_no)
                        .await;
                }
                match published {
                    Published::Delivered => Ok(Admitted::Accepted(OrderNo::new(order_no))),
                    Published::NotDelivered(PublishError::QueueFull) => {
                        Err(Refusal::Busy("the order queue is full; retry shortly", 1))
                    }
                    Published::NotDelivered(_) => Err(Refusal::NotQueued),
                    Published::Pending => Err(Refusal::Pending(OrderNo::new(order_no))),
                }
            }
            Admission::Duplicate(order_no) => {
                drop(permit);
                self.count("duplicate");
                self.replay(p.activity_id, layout, order_no).await
            }
            Admission::SoldOut => {
                // Asked at `started`: a release heard after that may have
                // come after Redis's answer, and keeps the flag off.
                self.sold_out
                    .mark_soon(&self.gate, p.activity_id, layout, started);
                Err(Refusal::SoldOut { from_memory: false })
            }
            Admission::LimitExceeded => Err(Refusal::LimitExceeded),
            Admission::InvalidToken => Err(Refusal::InvalidToken),
            Admission::NotActive => Err(Refusal::NotActive),
            Admission::NumberTaken => {
                tracing::error!(
                    order_no,
                    activity_id = %p.activity_id,
                    "order number already reserved: two instances share an instance id"
                );
                Err(Refusal::NumberTaken)
            }
            Admission::InTransit => Err(Refusal::Busy(
                "units are moving between shards; retry shortly",
                1,
            )),
            Admission::NotWarm => {
                // Warm a moment ago (the cache said so): Redis lost it.
                self.activities.forget(p.activity_id);
                Err(self.restoring())
            }
        }
    }

    /// Redis is down: the purchase in one database transaction.
    async fn through_database(&self, p: &Purchase) -> Result<Admitted, Refusal> {
        let decided = self.fallback.admit(p).await.map_err(Refusal::Unavailable)?;
        match decided {
            Ok(Decided::Created(order_no)) => Ok(Admitted::Fallback(order_no)),
            Ok(Decided::Replayed(order_no)) => {
                self.count("duplicate");
                Ok(Admitted::Replayed {
                    order_no,
                    // Its row exists: the layout is never read.
                    layout: Layout::single(1),
                    confirmed_now: false,
                })
            }
            Err(declined) => Err(match declined {
                Declined::RateLimited(wait) => Refusal::FallbackRateLimited(retry_secs(wait)),
                Declined::InvalidToken => Refusal::InvalidToken,
                Declined::NotActive => Refusal::NotActive,
                Declined::TooMany => Refusal::Invalid("quantity exceeds the per-user limit"),
                Declined::LimitExceeded => Refusal::LimitExceeded,
                Declined::SoldOut => Refusal::SoldOut { from_memory: false },
                Declined::CouponInvalid => {
                    Refusal::CouponInvalid("the coupon cannot back this order")
                }
                Declined::NotInFallback => {
                    Refusal::Degraded("the sale is moving between Redis and the database", 1)
                }
            }),
        }
    }

    /// The client's own bucket, then the activity's.
    fn within_rate(&self, p: &Purchase) -> Result<(), Refusal> {
        if let Some(ip) = p.client_ip
            && let Err(wait) = self.limits.ip.try_acquire(ip)
        {
            return Err(Refusal::RateLimited(
                "too many requests from this address",
                retry_secs(wait),
            ));
        }
        if let Err(wait) = self.limits.activity.try_acquire(p.activity_id) {
            return Err(Refusal::RateLimited(
                "too many requests for this activity",
                retry_secs(wait),
            ));
        }
        Ok(())
    }

    /// The activity's window and limits, if it is warm.
    async fn open_activity(
        &self,
        gate: &RedisGate,
        id: ActivityId,
    ) -> Result<ActivityMeta, Refusal> {
        match self
            .activities
            .lookup(gate, &self.db, id, &*self.clock)
            .await
        {
            Ok(Lookup::Warm(meta)) => Ok(meta),
            Ok(Lookup::Restoring) => Err(self.restoring()),
            Ok(Lookup::NotActive) => Err(Refusal::NotActive),
            Err(e) => Err(Refusal::Unavailable(e)),
        }
    }

    /// Wakes the local reconciler: Redis lost the activity.
    fn restoring(&self) -> Refusal {
        self.restore_wanted.notify_one();
        Refusal::Restoring
    }

    /// Holds the buyer's coupon for the order just reserved, or refuses
    /// the purchase and gives the reservation back (never published:
    /// nothing was kept). Decided here, before the 202, so that an order
    /// whose coupon is used, backs another order, has expired or does not
    /// reach its minimum is refused, never FAILED after its 202 (I4). The
    /// database's conditional lock stays the last guard.
    async fn hold_coupon(
        &self,
        p: &Purchase,
        coupon_id: CouponId,
        layout: Layout,
        order_no: i64,
        amount_cents: i64,
        now_ms: i64,
    ) -> Result<(), Refusal> {
        let held = self
            .coupons
            .hold(coupon_id, p.user_id.get(), order_no, amount_cents, now_ms)
            .await;
        let why = match held {
            Ok(decided) => match decided.refusal() {
                None => return Ok(()),
                Some(why) => Refusal::CouponInvalid(why),
            },
            Err(e) => {
                // Its reply lost, the hold may have been made: undone
                // (only this order's hold goes), or left to
                // reconciliation if Redis does not answer now either.
                let _ = self
                    .coupons
                    .unhold(coupon_id, p.user_id.get(), order_no)
                    .await;
                Refusal::ReserveFailed(e.into())
            }
        };
        // Not published, so no one else can have sent it: it goes, and its
        // request id with it, and the buyer's purchase token comes back as
        // it was, its cap too (a refused purchase never uses one up; an
        // offer's token still buys one unit). If Redis fails here too, the
        // reservation stays open and reconciliation voids it once provably
        // unsent.
        let most = self
            .gate
            .reservation_most(p.activity_id, order_no, layout)
            .await
            .unwrap_or(Some(1));
        match self
            .gate
            .release_unsent(p.activity_id, order_no, layout)
            .await
        {
            Ok(Unsent::Released) => {
                if let Some(token) = p.token.as_deref().filter(|t| is_client_key(t)) {
                    let ttl = self.settings.admission.token_ttl_secs.as_secs();
                    let _ = self
                        .gate
                        .issue_token(p.activity_id, layout, p.user_id.get(), token, ttl, most)
                        .await;
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, order_no, "release after a refused coupon failed")
            }
        }
        Err(why)
    }

    /// Back-pressure before Redis is touched: a 202 now would stay
    /// PROCESSING for long, or would not be acknowledged.
    fn not_overloaded(&self, now_ms: i64) -> Result<(), Refusal> {
        if self.publisher.probe.refuses_writes().is_some() {
            // Two of three brokers down: every acks=all write is refused
            // until they are back. Reserving now would only hold units
            // for purchases no broker can take.
            return Err(Refusal::WritesRefused(WRITES_REFUSED_RETRY_SECS));
        }
        if let Some((why, secs)) = self.consumer_backpressure() {
            return Err(Refusal::Busy(why, secs));
        }
        if !self.publisher.breaker.admits(now_ms) {
            // The breaker lets one probe through a second.
            return Err(Refusal::Busy(
                "the broker is not acknowledging orders; retry shortly",
                1,
            ));
        }
        if !self.publisher.acks.has_room() {
            return Err(Refusal::Busy(
                "acknowledgements are waiting on Redis; retry shortly",
                1,
            ));
        }
        Ok(())
    }

    /// A number for the order, carrying its buyer's gene: the partition
    /// of the order table, and a sharded activity's shard.
    fn number(&self, user_id: UserId) -> Result<i64, Refusal> {
        let gene = crate::ids::user_gene(user_id.get());
        self.ids
            .next_id_with_gene(gene)
            .ok_or(Refusal::NoOrderNumber)
    }

    /// A request id already bound to `order_no`: accepted now if this
    /// retry confirmed its delivery, settled if it was before, pending
    /// while still unknown.
    async fn replay(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
    ) -> Result<Admitted, Refusal> {
        let confirmation = self
            .publisher
            .confirm(activity_id, layout, order_no)
            .await
            .map_err(|e| Refusal::Unavailable(e.into()))?;
        let order_no = OrderNo::new(order_no);
        match confirmation {
            Confirmation::Pending => Err(Refusal::Pending(order_no)),
            Confirmation::ConfirmedNow | Confirmation::Settled => Ok(Admitted::Replayed {
                order_no,
                layout,
                confirmed_now: confirmation == Confirmation::ConfirmedNow,
            }),
        }
    }

    /// Why purchases should get 503 BUSY because of the order consumers,
    /// if they should: too many messages behind, or stalled (messages
    /// waiting, nothing committed) for `kafka.consumer_stall_secs`. Both
    /// are sampled every second by the lag sampler.
    /// Why purchases must wait for the order consumers, and for about how
    /// many seconds: over the lag bound, the time to drain the excess (the
    /// bound is sized as `LAG_BOUND_SECS` of draining); stalled, the
    /// watchdog's window, after which it rebuilds the consumer.
    pub fn consumer_backpressure(&self) -> Option<(&'static str, u32)> {
        let lag = self.metrics.order_consumer_lag.get();
        let (bound, per_sec) = lag_bound(
            self.settings.admission.max_consumer_lag,
            self.settings.orders.max_write_rate,
        );
        if progress::lag_over(lag, bound) {
            return Some((
                "orders are being written; retry shortly",
                drain_secs(lag, bound, per_sec),
            ));
        }
        if self.order_consumers_stalled().is_some() {
            let window =
                u32::try_from(self.settings.kafka.consumer_stall_secs.as_secs()).unwrap_or(30);
            return Some((
                "the order consumers are stalled; retry shortly",
                window.clamp(1, 30),
            ));
        }
        None
    }

    /// How long the order consumers (wherever they run) have had messages
    /// waiting and committed nothing, once that reaches
    /// `kafka.consumer_stall_secs`.
    pub fn order_consumers_stalled(&self) -> Option<i64> {
        let stall =
            i64::try_from(self.settings.kafka.consumer_stall_secs.as_secs()).unwrap_or(i64::MAX);
        let stalled = self.metrics.order_consumer_stalled_seconds.get();
        (stall > 0 && stalled >= stall).then_some(stalled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_after_of_a_lag_is_the_time_to_drain_its_excess() {
        // A bound of 100 000 is 5 s of draining: 20 000 a second.
        let (bound, rate) = lag_bound(100_000, 0);
        assert_eq!((bound, rate), (100_000, 20_000));
        assert_eq!(drain_secs(100_001, bound, rate), 1);
        assert_eq!(drain_secs(160_000, bound, rate), 3);
        assert_eq!(drain_secs(10_000_000, bound, rate), 30, "at most 30 s");
        let (bound, rate) = lag_bound(3, 0);
        assert_eq!(
            drain_secs(4, bound, rate),
            1,
            "a tiny bound still says a second"
        );
    }

    #[test]
    fn consumers_paced_slower_hold_purchases_sooner_and_say_so() {
        // Paced at 2 000 orders a second: 5 s of it is 10 000 behind, and
        // 30 000 behind is 10 s more to write.
        let (bound, rate) = lag_bound(100_000, 2_000);
        assert_eq!((bound, rate), (10_000, 2_000));
        assert!(progress::lag_over(30_000, bound));
        assert_eq!(drain_secs(30_000, bound, rate), 10);
        // A pace faster than the bound is sized for changes nothing.
        assert_eq!(lag_bound(100_000, 50_000), (100_000, 20_000));
    }

    #[test]
    fn refusals_a_retry_can_get_past_say_when() {
        assert_eq!(Refusal::RateLimited("x", 3).retry_after(), Some(3));
        assert_eq!(Refusal::FallbackRateLimited(2).retry_after(), Some(2));
        assert!(Refusal::RateLimited("x", 3).spares_a_replay());
        assert!(
            !Refusal::FallbackRateLimited(2).spares_a_replay(),
            "Redis is down: a replay is not looked up in it"
        );
        assert_eq!(Refusal::Busy("x", 7).retry_after(), Some(7));
        assert_eq!(Refusal::Restoring.retry_after(), Some(1));
        assert_eq!(Refusal::SoldOut { from_memory: false }.retry_after(), None);
        assert_eq!(Refusal::LimitExceeded.retry_after(), None);
    }
}

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
pub use super::refusal::Refusal;
use super::soldout::SoldOut;
use super::{Admission, Layout, RedisGate, ReserveRequest};
use crate::activities::cache::{ActivityCache, Lookup};
use crate::bus::PublishError;
use crate::bus::events::OrderRequested;
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
                Declined::Moving(secs) => Refusal::Degraded(
                    "the sale is moving to the database; it sells there once no instance \
                     can still be selling from Redis",
                    secs,
                ),
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
}

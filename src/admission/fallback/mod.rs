//! The database fallback: purchases while Redis is down
//! (`docs/FALLBACK.md`).
//!
//! Each instance probes Redis four times a second. Once every probe has
//! failed for `admission.fallback_after_ms`, purchases of a warmed activity
//! go to PostgreSQL instead, one transaction each, throttled per activity
//! (`admission.fallback_rate_per_sec`) — but only after the order events
//! sent before the outage are provably written: Redis had already taken
//! their units, and the database learns of them only from the consumers.
//! That is the proof a restore waits for: `kafka.message_timeout_ms +
//! admission.publish_budget_ms` since the outage began (no send starts
//! without Redis, and one in flight is decided by then) and, read after
//! that, the order consumers at the end of every partition.
//!
//! The transaction locks the activity's stock row first. Under that lock it
//! reads the activity's `admission` mode, the buyer's request id and live
//! orders, and the available stock; then it writes the order as
//! WAITING_PAY with its LOCK flow row through the ledger, under a number
//! the database makes (instance id 1023, which no lease grants). The first
//! such purchase moves the activity from REDIS to DATABASE, which every
//! instance reads once a second and follows, whatever its own view of
//! Redis. Reconciliation moves it back (REDIS → RESTORING → REDIS) under
//! the same row lock once Redis answers, so no fallback order is written
//! after the snapshot that loads the activity back into Redis.
//!
//! Purchase tokens live in Redis, so while this instance sends purchases
//! to the database it hands out signed ones instead: bound to the buyer
//! and the activity, valid for `admission.token_ttl_secs`, and not one-time
//! (the per-user limit, checked in the database, still holds).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text, Timestamptz};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;

mod buy;

use self::buy::Buy;
use super::RedisGate;
use super::limits::KeyedLimiter;
pub use super::mode::Mode;
use crate::bus::progress::GroupProgress;
use crate::clock::SharedClock;
use crate::config::Settings;
use crate::domain::ActivityId;
use crate::ids::OrderNo;
use crate::metrics::Metrics;
use crate::orders::OrderStatus;
use crate::orders::events::{OrderEvents, StatusChange};
use crate::store::{self, PgConn, PgPool};
use crate::worker::WorkerHandle;

/// How often Redis is probed.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How often the activities' modes are read from the database.
const POLL_EVERY: Duration = Duration::from_secs(1);

/// Where a purchase goes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Through Redis, as usual.
    Redis,
    /// Through the database fallback.
    Database,
    /// Neither yet: 503 with why, and in how many seconds to retry.
    Wait(&'static str, u32),
}

/// A purchase the fallback decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// Written now, WAITING_PAY.
    Created(OrderNo),
    /// The request id already has this order.
    Replayed(OrderNo),
}

/// Why the fallback refused a purchase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declined {
    /// Too many fallback purchases for the activity; the bucket holds a
    /// token again after this long (429).
    RateLimited(Duration),
    /// Not a signed token of this buyer and activity (403).
    InvalidToken,
    /// No such warmed activity, or outside its window (409).
    NotActive,
    /// More than the per-user limit in one purchase (400).
    TooMany,
    /// The buyer's live orders would pass the limit (409).
    LimitExceeded,
    /// Not enough stock (409).
    SoldOut,
    /// The buyer holds no such unused coupon (400).
    CouponInvalid,
    /// The activity is not (or no longer) in the fallback: retry (503).
    NotInFallback,
    /// The activity moved to the database less than
    /// `admission.modes_trusted_for_ms` ago: an instance that cannot read
    /// the modes may still sell from Redis until then. Retry in this many
    /// seconds (503).
    Moving(u32),
}

/// Redis as this instance's probes see it; times in unix ms.
#[derive(Default)]
struct Health {
    /// Since when every probe failed; 0 while Redis answers.
    down_since: AtomicI64,
    /// When a probe last succeeded after failing ones for at least
    /// `after_ms` (an outage long enough for an instance to have moved an
    /// activity to the database); a shorter blip leaves it.
    back_at: AtomicI64,
    /// The order events sent before this outage are provably written.
    proven: AtomicBool,
    /// `admission.fallback_after_ms`; 0 with the fallback turned off.
    after_ms: i64,
    enabled: bool,
}

impl Health {
    /// Whether this instance may move an activity into the fallback now:
    /// Redis down long enough, and what was sent before provably written.
    /// Read again under the stock row's lock, so a purchase that waited for
    /// the lock while Redis came back does not take the sale over.
    fn may_enter(&self, now: i64) -> bool {
        self.enabled
            && match self.down_since.load(Ordering::Acquire) {
                0 => false,
                since => now - since >= self.after_ms,
            }
            && self.proven.load(Ordering::Acquire)
    }
}

/// What the mode poll last read.
#[derive(Default)]
struct Polled {
    /// Activities not in REDIS mode.
    modes: HashMap<ActivityId, Mode>,
    /// Warmed activities' windows (unix ms), for signed tokens.
    windows: HashMap<ActivityId, (i64, i64)>,
}

/// The fallback's state on one instance: shared by admission, the token
/// route, readiness and its worker.
pub struct Fallback {
    settings: Arc<Settings>,
    db: PgPool,
    limiter: KeyedLimiter<ActivityId>,
    health: Arc<Health>,
    polled: RwLock<Polled>,
    /// When the last completed mode poll started (unix ms).
    polled_at: AtomicI64,
    /// When the polls began to succeed again after failing for longer
    /// than three polls (unix ms; 0: since the first).
    answering_since: AtomicI64,
    /// Some activity is in a mode other than REDIS (as last read).
    any_moved: AtomicBool,
    token_key: Vec<u8>,
    metrics: Metrics,
    clock: SharedClock,
    events: Arc<OrderEvents>,
}

fn unix_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub(super) fn secs_of(ms: i64) -> u32 {
    u32::try_from((ms.max(0) + 999) / 1000)
        .unwrap_or(u32::MAX)
        .clamp(1, 60)
}

impl Fallback {
    /// The fallback of one instance.
    pub fn new(
        settings: Arc<Settings>,
        db: PgPool,
        metrics: Metrics,
        clock: SharedClock,
        events: Arc<OrderEvents>,
    ) -> Self {
        let rate = settings.admission.fallback_rate_per_sec;
        let token_key =
            crate::auth::derive_key(&settings.auth.server_secret, "seckill/fallback-token/v1");
        let health = Arc::new(Health {
            down_since: AtomicI64::new(0),
            back_at: AtomicI64::new(0),
            proven: AtomicBool::new(false),
            after_ms: crate::clock::millis(settings.admission.fallback_after_ms),
            enabled: settings.admission.fallback_enabled,
        });
        Self {
            limiter: KeyedLimiter::new(rate, rate.max(1)),
            settings,
            db,
            health,
            polled: RwLock::default(),
            polled_at: AtomicI64::new(0),
            answering_since: AtomicI64::new(0),
            any_moved: AtomicBool::new(false),
            token_key,
            metrics,
            clock,
            events,
        }
    }

    fn enabled(&self) -> bool {
        self.settings.admission.fallback_enabled
    }

    /// How long every probe has failed, if Redis is down.
    fn down_for(&self, now: i64) -> Option<i64> {
        match self.health.down_since.load(Ordering::Acquire) {
            0 => None,
            since => Some(now - since),
        }
    }

    /// How long the events sent before an outage may still be arriving:
    /// what the fallback waits out before it sells (a probe's worth more,
    /// as the last Redis call may come just after a failed probe).
    fn proof_wait_ms(&self) -> i64 {
        crate::clock::millis(self.settings.restore_wait() + PROBE_EVERY + PROBE_TIMEOUT)
    }

    /// This instance may move an activity into the fallback: Redis down
    /// long enough, and what was sent before provably written.
    fn may_enter(&self, now: i64) -> bool {
        self.health.may_enter(now)
    }

    /// An activity's mode as last read.
    fn mode(&self, activity_id: ActivityId) -> Mode {
        let polled = self.polled.read().unwrap_or_else(|e| e.into_inner());
        polled
            .modes
            .get(&activity_id)
            .copied()
            .unwrap_or(Mode::Redis)
    }

    /// Where a purchase of `activity_id` goes now.
    pub fn route(&self, activity_id: ActivityId) -> Route {
        if !self.enabled() {
            return Route::Redis;
        }
        // The hot path, with Redis up and every activity on it: four
        // atomic loads and a clock read, no lock.
        if self.any_moved.load(Ordering::Acquire) {
            match self.mode(activity_id) {
                Mode::Database => return Route::Database,
                Mode::Restoring => {
                    return Route::Wait("the sale is moving back to Redis; retry shortly", 1);
                }
                Mode::Redis => {}
            }
        }
        if self.polled_at.load(Ordering::Acquire) == 0 {
            // A new instance has not read the modes yet: an activity in
            // DATABASE mode must not be sold from the stale copy Redis may
            // hold (it lacks the fallback's units, request ids and holds).
            return Route::Wait(
                "the sale's admission modes are not read yet; retry shortly",
                1,
            );
        }
        if unix_ms() - self.polled_at.load(Ordering::Acquire)
            > crate::clock::millis(self.settings.admission.modes_trusted_for_ms)
        {
            // The database has not answered the polls for a while: another
            // instance, which Redis did not answer, may have moved this
            // activity to the database since (this instance saw no
            // outage, so the "Redis is back" guard below is not armed).
            // Until then none can have sold through it: the fallback sells
            // only once its switch is this old (`buy.rs`).
            return Route::Wait(
                "the sale's admission modes could not be read lately; retry shortly",
                1,
            );
        }
        let down_since = self.health.down_since.load(Ordering::Acquire);
        if down_since == 0 {
            // Back, but the modes were last read before it came back: an
            // activity another instance moved to the database meanwhile
            // must not be sold from what Redis still holds.
            if self.health.back_at.load(Ordering::Acquire) > self.polled_at.load(Ordering::Acquire)
            {
                return Route::Wait("Redis is back; retry shortly", 1);
            }
            return Route::Redis;
        }
        let down = unix_ms() - down_since;
        if down < crate::clock::millis(self.settings.admission.fallback_after_ms) {
            // A blip: Redis itself answers (or fails) this purchase.
            Route::Redis
        } else if self.health.proven.load(Ordering::Acquire) {
            Route::Database
        } else {
            Route::Wait(
                "Redis is unreachable; purchases move to the database once \
                 the orders accepted before are written",
                secs_of(self.proof_wait_ms() - down),
            )
        }
    }

    /// Whether this instance sends any purchase to the database now, and
    /// the activities it reads in each mode other than REDIS.
    pub fn status(&self) -> (bool, Vec<ActivityId>, Vec<ActivityId>) {
        let polled = self.polled.read().unwrap_or_else(|e| e.into_inner());
        let mut database: Vec<ActivityId> = Vec::new();
        let mut restoring: Vec<ActivityId> = Vec::new();
        for (&id, &mode) in &polled.modes {
            match mode {
                Mode::Database => database.push(id),
                Mode::Restoring => restoring.push(id),
                Mode::Redis => {}
            }
        }
        database.sort_unstable();
        restoring.sort_unstable();
        let active = self.enabled() && (!database.is_empty() || self.may_enter(unix_ms()));
        (active, database, restoring)
    }

    /// Whether purchases wait for the first read of the admission modes
    /// (readiness waits for it too).
    pub fn modes_unread(&self) -> bool {
        self.enabled() && self.polled_at.load(Ordering::Acquire) == 0
    }

    /// Whether PostgreSQL has answered this instance's polls of the modes
    /// (none missed for longer than three polls) for at least `for_ms`.
    pub fn database_answers_for(&self, for_ms: i64) -> bool {
        let now = unix_ms();
        let polled = self.polled_at.load(Ordering::Acquire);
        polled > 0
            && now - polled <= 3 * crate::clock::millis(POLL_EVERY)
            && now - self.answering_since.load(Ordering::Acquire) >= for_ms
    }

    /// Whether Redis answers this instance's probes.
    pub fn redis_up(&self) -> bool {
        self.health.down_since.load(Ordering::Acquire) == 0
    }

    /// A signed purchase token for the buyer, when purchases of the
    /// activity go to the database; `Err(NotActive)` outside its window,
    /// `Ok(None)` when they go through Redis.
    pub fn token(&self, activity_id: ActivityId, user_id: i64) -> Result<Option<String>, Declined> {
        if self.route(activity_id) != Route::Database {
            return Ok(None);
        }
        let window = {
            let polled = self.polled.read().unwrap_or_else(|e| e.into_inner());
            polled.windows.get(&activity_id).copied()
        };
        let now = self.clock.now_ms();
        match window {
            Some((start, end)) if start <= now && now < end => {}
            _ => return Err(Declined::NotActive),
        }
        let expires =
            unix_ms() / 1000 + crate::clock::millis(self.settings.admission.token_ttl_secs) / 1000;
        Ok(Some(format!(
            "fb.{expires}.{}",
            self.sign(activity_id, user_id, expires)
        )))
    }

    fn sign(&self, activity_id: ActivityId, user_id: i64, expires: i64) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.token_key).expect("HMAC takes any key length");
        mac.update(format!("{activity_id}:{user_id}:{expires}").as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    fn token_valid(&self, activity_id: ActivityId, user_id: i64, token: Option<&str>) -> bool {
        let Some(rest) = token.and_then(|t| t.strip_prefix("fb.")) else {
            return false;
        };
        let Some((expires, signature)) = rest.split_once('.') else {
            return false;
        };
        let Ok(expires) = expires.parse::<i64>() else {
            return false;
        };
        if expires < unix_ms() / 1000 || signature.len() != 64 {
            return false;
        }
        let Ok(signature) = hex::decode(signature) else {
            return false;
        };
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.token_key).expect("HMAC takes any key length");
        mac.update(format!("{activity_id}:{user_id}:{expires}").as_bytes());
        mac.verify_slice(&signature).is_ok()
    }

    /// A purchase through the database, in one transaction.
    pub async fn admit(
        &self,
        purchase: &super::purchase::Purchase,
    ) -> anyhow::Result<Result<Decided, Declined>> {
        if let Err(wait) = self.limiter.try_acquire(purchase.activity_id) {
            return Ok(Err(Declined::RateLimited(wait)));
        }
        let user_id = purchase.user_id.get();
        if !self.token_valid(purchase.activity_id, user_id, purchase.token.as_deref()) {
            return Ok(Err(Declined::InvalidToken));
        }
        let buy = Buy {
            activity_id: purchase.activity_id,
            user_id,
            request_id: purchase.request_id.as_str().to_owned(),
            quantity: purchase.quantity,
            coupon_id: purchase.coupon_id,
            now_ms: self.clock.now_ms(),
            entry: self.health.clone(),
            hold_ms: crate::clock::millis(self.settings.admission.modes_trusted_for_ms),
        };
        let decided = store::run(&self.db, move |conn| Ok(buy.run(conn)?)).await?;
        if let Ok(Decided::Created(order_no)) = decided {
            let status = OrderStatus::WaitingPay;
            let order_no = order_no.get();
            self.events
                .publish(&[StatusChange { order_no, status }])
                .await;
        }
        Ok(decided)
    }

    /// Probes Redis and reads the modes until `shutdown`.
    pub fn spawn(
        self: &Arc<Self>,
        gate: Arc<RedisGate>,
        progress: Arc<GroupProgress>,
    ) -> WorkerHandle {
        let this = self.clone();
        WorkerHandle::spawn(move |shutdown| async move {
            this.watch(gate, progress, shutdown).await;
        })
    }

    async fn watch(
        &self,
        gate: Arc<RedisGate>,
        progress: Arc<GroupProgress>,
        shutdown: CancellationToken,
    ) {
        let mut next_poll = tokio::time::Instant::now();
        loop {
            let was_up = self.redis_up();
            let up = matches!(
                tokio::time::timeout(PROBE_TIMEOUT, gate.ping()).await,
                Ok(Ok(_))
            );
            let now = unix_ms();
            if up && !was_up {
                // After an outage the fallback could have acted on, no
                // purchase goes to Redis before the modes are read again.
                // A shorter blip (one probe past its timeout on a starved
                // host) moved no activity: an instance enters the fallback
                // only after failing probes for `after_ms` itself, and one
                // that saw Redis down for longer while this one did not is
                // a partition (FALLBACK.md's limits: one poll at most).
                // Guarded, such a blip answered purchases 503 until the
                // next read of the modes.
                let down_since = self.health.down_since.load(Ordering::Acquire);
                if now - down_since >= self.health.after_ms {
                    self.health.back_at.store(now, Ordering::Release);
                    next_poll = tokio::time::Instant::now();
                }
                self.health.down_since.store(0, Ordering::Release);
                self.health.proven.store(false, Ordering::Release);
                tracing::warn!(down_ms = now - down_since, "Redis answers again");
            } else if !up && was_up {
                self.health.down_since.store(now, Ordering::Release);
                tracing::warn!("Redis does not answer");
            }
            self.metrics.redis_up.set(i64::from(self.redis_up()));
            if tokio::time::Instant::now() >= next_poll {
                next_poll = tokio::time::Instant::now() + POLL_EVERY;
                if let Err(e) = self.poll().await {
                    tracing::warn!(error = format!("{e:#}"), "reading admission modes failed");
                }
                self.prove(&progress).await;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(PROBE_EVERY) => {}
            }
        }
    }

    /// Reads every warmed, unfinished activity's mode and window.
    async fn poll(&self) -> anyhow::Result<()> {
        let started = unix_ms();
        let rows = store::run(&self.db, |conn| Ok(modes(conn)?)).await?;
        let mut polled = Polled::default();
        for r in rows {
            let mode = Mode::parse(&r.admission);
            if mode != Mode::Redis {
                polled.modes.insert(r.id, mode);
            }
            polled.windows.insert(
                r.id,
                (r.start_at.timestamp_millis(), r.end_at.timestamp_millis()),
            );
        }
        for (mode, label) in [(Mode::Database, "database"), (Mode::Restoring, "restoring")] {
            let n = polled.modes.values().filter(|m| **m == mode).count();
            self.metrics
                .admission_modes
                .with_label_values(&[label])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let any_moved = !polled.modes.is_empty();
        *self.polled.write().unwrap_or_else(|e| e.into_inner()) = polled;
        self.any_moved.store(any_moved, Ordering::Release);
        let before = self.polled_at.swap(started, Ordering::AcqRel);
        if before > 0 && started - before > 3 * crate::clock::millis(POLL_EVERY) {
            self.answering_since.store(started, Ordering::Release);
        }
        Ok(())
    }

    /// While Redis is down: once the events sent before the outage can no
    /// longer arrive, asks Kafka whether the order consumers have applied
    /// every one (read after that moment, so each is among them).
    async fn prove(&self, progress: &Arc<GroupProgress>) {
        if !self.enabled() || self.health.proven.load(Ordering::Acquire) {
            return;
        }
        let Some(down) = self.down_for(unix_ms()) else {
            return;
        };
        if down < self.proof_wait_ms() {
            return;
        }
        match progress.caught_up().await {
            Ok(true) if !self.redis_up() => {
                self.health.proven.store(true, Ordering::Release);
                tracing::warn!(
                    down_ms = down,
                    "Redis down and every order accepted before is written: \
                     purchases go to the database"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = format!("{e:#}"), "consumer progress unknown"),
        }
    }
}

#[derive(QueryableByName)]
struct ModeRow {
    #[diesel(sql_type = BigInt)]
    id: ActivityId,
    #[diesel(sql_type = Text)]
    admission: String,
    #[diesel(sql_type = Timestamptz)]
    start_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = Timestamptz)]
    end_at: chrono::DateTime<chrono::Utc>,
}

fn modes(conn: &mut PgConn) -> QueryResult<Vec<ModeRow>> {
    diesel::sql_query(
        "SELECT id, admission, start_at, end_at FROM activities \
         WHERE warmed_at IS NOT NULL AND (status <> 'ENDED' OR admission <> 'REDIS')",
    )
    .load(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::database_id;

    #[test]
    fn database_numbers_carry_the_database_instance_and_the_gene() {
        let id = database_id(1_000, 5, None);
        assert_eq!(crate::ids::instance_of(id), crate::ids::DATABASE_INSTANCE);
        assert_eq!(id & 0xfff, 5);
        let sharded = database_id(1_000, 5, Some(3));
        assert_eq!(crate::ids::gene_of(sharded), 3);
        assert_eq!(crate::ids::instance_of(sharded), 1023);
        assert_ne!(
            database_id(1_000, 6, None),
            id,
            "the sequence tells them apart"
        );
    }

    #[test]
    fn modes_read_back_what_they_write() {
        for mode in [Mode::Redis, Mode::Database, Mode::Restoring] {
            assert_eq!(Mode::parse(mode.as_str()), mode);
        }
    }
}

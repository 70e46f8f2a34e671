//! The instance id, leased in Redis so that two running instances never
//! mint the same numbers, whatever their configuration says.
//!
//! - A lease is a key per instance id, `SET NX PX` with the owner's name,
//!   renewed by a heartbeat (compare-and-set on the owner).
//! - `app.instance_id` unset: the first free id from a random point of
//!   0..=1022. Set: exactly that id; held by a live instance, `serve`
//!   waits one lease lifetime (a crashed predecessor's lease runs out) and
//!   then refuses to start.
//! - The process makes numbers only while its lease is certainly valid:
//!   until the lease lifetime after the last renewal it *sent*, which is no
//!   later than Redis lets the key expire. If renewals fail (Redis
//!   unreachable) it stops before anyone else can take the id; a lease
//!   found taken is given up at once and a new one sought.
//! - Each renewal records where the holder may get to (its last
//!   millisecond plus a lifetime) beside the lease. The next holder of the
//!   id starts there, so a wall clock that stepped back between two
//!   holders cannot repeat a number either.
//! - Redis can restart empty (or be flushed) while a holder still mints:
//!   its key is gone, and another process would find the id free with
//!   floor 0. So every lease is fenced by a row in PostgreSQL
//!   (`instance_leases`), taken with the Redis key and renewed with it, on
//!   the database's clock, for four lease lifetimes. A holder mints only
//!   until a lifetime after its last renewal in Redis, and four after its
//!   last in PostgreSQL; an id whose row another owner renewed less than
//!   four lifetimes ago is not taken, whatever Redis says, and its floor is
//!   the higher of the two. A failover shorter than that leaves the
//!   numbers going; a database that cannot be reached for longer stops
//!   this instance's order numbers (purchases answer 503) until it is back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use prometheus::IntGauge;
use redis::{RedisResult, Script};

use super::{IdGenerator, MAX_LEASED_INSTANCE, Snowflake, epoch_ms_now};
use crate::store::PgPool;
use crate::store::redis_conn::RedisConn;
use crate::worker::WorkerHandle;

/// Takes the lease if it is free (or already ours). Returns the floor (ms
/// since the epoch) the last holder recorded, or -1 if another holds it.
const ACQUIRE: &str = r"
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return tonumber(redis.call('GET', KEYS[2]) or '0')
";

/// Renews the lease if it is still ours and raises the recorded floor.
/// Returns 1, or 0 if the lease is gone or another's.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local floor = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[3]) > floor then redis.call('SET', KEYS[2], ARGV[3]) end
return 1
";

/// Gives the lease up if it is still ours (a clean shutdown).
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
";

/// How many lease lifetimes the fence in PostgreSQL lasts.
const FENCE_LIFETIMES: u32 = 4;

/// Snowflake numbers made only under a valid instance-id lease.
pub struct LeasedIds {
    ids: Snowflake,
    started: Instant,
    /// Until when (ms since `started`) the Redis lease is certainly ours;
    /// 0: not held.
    valid_until: AtomicU64,
    /// Until when (ms since `started`) the fence in PostgreSQL is.
    fenced_until: AtomicU64,
    /// Whether a lease was ever held (the generator's id is then worth
    /// asking for first again).
    ever_held: AtomicBool,
}

impl Default for LeasedIds {
    fn default() -> Self {
        Self {
            ids: Snowflake::new(0),
            started: Instant::now(),
            valid_until: AtomicU64::new(0),
            fenced_until: AtomicU64::new(0),
            ever_held: AtomicBool::new(false),
        }
    }
}

impl LeasedIds {
    fn elapsed_ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.started).as_millis()).unwrap_or(u64::MAX)
    }

    /// The instance id held now, if any.
    pub fn instance(&self) -> Option<u16> {
        self.is_held().then(|| self.ids.instance())
    }

    /// Whether numbers can be made now.
    pub fn is_held(&self) -> bool {
        let now = self.elapsed_ms(Instant::now());
        now < self.valid_until.load(Ordering::Acquire)
            && now < self.fenced_until.load(Ordering::Acquire)
    }

    /// The Redis lease, renewed at `sent`, runs `ttl` more.
    fn extend(&self, sent: Instant, ttl: Duration) {
        let until = self.elapsed_ms(sent + ttl);
        self.valid_until.fetch_max(until, Ordering::AcqRel);
        self.ever_held.store(true, Ordering::Release);
    }

    /// The fence, renewed at `sent`, runs `ttl` more.
    fn extend_fence(&self, sent: Instant, ttl: Duration) {
        let until = self.elapsed_ms(sent + ttl);
        self.fenced_until.fetch_max(until, Ordering::AcqRel);
    }

    fn revoke(&self) {
        self.valid_until.store(0, Ordering::Release);
        self.fenced_until.store(0, Ordering::Release);
    }
}

impl IdGenerator for LeasedIds {
    fn next_id(&self) -> Option<i64> {
        self.is_held().then(|| self.ids.next_at(epoch_ms_now()))
    }

    fn next_id_with_gene(&self, gene: u8) -> Option<i64> {
        self.is_held()
            .then(|| self.ids.next_with_gene_at(epoch_ms_now(), gene))
    }
}

/// Why the instance id could not be leased.
#[derive(Debug)]
pub enum LeaseError {
    /// Redis did not answer; try again later.
    Unavailable(redis::RedisError),
    /// Every id asked for is held by a live instance.
    Taken(String),
    /// PostgreSQL, which fences the lease, did not answer.
    Fence(anyhow::Error),
}

impl From<redis::RedisError> for LeaseError {
    fn from(e: redis::RedisError) -> Self {
        Self::Unavailable(e)
    }
}

/// This process's claim on an instance id.
#[derive(Clone)]
pub struct InstanceLease {
    conn: RedisConn,
    db: PgPool,
    prefix: String,
    owner: String,
    /// The configured id, or `None` for any free one.
    wanted: Option<u16>,
    ttl: Duration,
    ids: Arc<LeasedIds>,
    gauge: IntGauge,
}

impl InstanceLease {
    /// A lease (not yet taken) feeding `ids`; `gauge` shows the id held
    /// (-1: none).
    pub fn new(
        conn: RedisConn,
        db: PgPool,
        prefix: &str,
        wanted: Option<u16>,
        ttl: Duration,
        ids: Arc<LeasedIds>,
        gauge: IntGauge,
    ) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
        gauge.set(-1);
        Self {
            conn,
            db,
            prefix: prefix.to_owned(),
            owner: format!(
                "{host}:{}:{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            wanted,
            ttl: ttl.max(Duration::from_secs(1)),
            ids,
            gauge,
        }
    }

    fn keys(&self, instance: u16) -> (String, String) {
        let key = format!("{}{{instance:{instance}}}", self.prefix);
        (key.clone(), format!("{key}:floor"))
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// How long the fence in PostgreSQL lasts: [`FENCE_LIFETIMES`] lease
    /// lifetimes, so that a PostgreSQL away for less (a failover) leaves
    /// this instance's numbers going while Redis renews its lease.
    fn fence_ttl(&self) -> Duration {
        self.ttl * FENCE_LIFETIMES
    }

    /// Tries once to take the configured id, or any free one.
    pub async fn acquire(&self) -> Result<u16, LeaseError> {
        let candidates: Vec<u16> = match self.wanted {
            Some(id) => vec![id],
            None => {
                // The id held last (its lease may still be ours), else a
                // random one, so that instances starting together spread.
                let first = if self.ids.ever_held.load(Ordering::Acquire) {
                    self.ids.ids.instance()
                } else {
                    fastrand::u16(..=MAX_LEASED_INSTANCE)
                };
                (0..=MAX_LEASED_INSTANCE)
                    .map(|i| (first + i) % (MAX_LEASED_INSTANCE + 1))
                    .collect()
            }
        };
        let script = Script::new(ACQUIRE);
        for instance in candidates {
            let (key, floor_key) = self.keys(instance);
            let sent = Instant::now();
            let floor: i64 = script
                .key(&key)
                .key(&floor_key)
                .arg(&self.owner)
                .arg(self.ttl_ms())
                .invoke_async(&mut self.conn.clone())
                .await?;
            if floor < 0 {
                continue;
            }
            let fenced = match self.fence(instance, None).await {
                Ok(fenced) => fenced,
                Err(e) => {
                    self.give_up_key(instance).await;
                    return Err(LeaseError::Fence(e));
                }
            };
            let Some(fence_floor) = fenced else {
                // Redis forgot it, PostgreSQL did not: its holder may
                // still be minting under it.
                tracing::warn!(
                    instance,
                    "instance id free in Redis but leased in PostgreSQL by another owner within a lifetime; not taken"
                );
                self.give_up_key(instance).await;
                continue;
            };
            let floor = u64::try_from(floor.max(fence_floor)).unwrap_or(0);
            self.ids.ids.reset(instance, floor.max(epoch_ms_now()));
            self.ids.extend(sent, self.ttl);
            self.ids.extend_fence(sent, self.fence_ttl());
            self.gauge.set(i64::from(instance));
            return Ok(instance);
        }
        Err(LeaseError::Taken(match self.wanted {
            Some(id) => format!(
                "app.instance_id {id} is leased by another running instance; \
                 give each instance its own id, or leave app.instance_id unset \
                 to lease a free one"
            ),
            None => "every instance id (0..=1022) is leased by a running instance".into(),
        }))
    }

    /// Takes (`reach` = None) or renews this owner's row of `instance` in
    /// `instance_leases`, for one fence lifetime on the database's clock:
    /// the floor recorded there, or `None` if another owner renewed it
    /// less than a fence lifetime ago (taking), or holds it now
    /// (renewing).
    async fn fence(&self, instance: u16, reach: Option<u64>) -> anyhow::Result<Option<i64>> {
        use diesel::RunQueryDsl;
        use diesel::sql_types::{BigInt, Nullable, SmallInt, Text};
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            floor_ms: i64,
        }
        let (owner, ttl_ms) = (
            self.owner.clone(),
            i64::try_from(self.fence_ttl().as_millis()).unwrap_or(i64::MAX),
        );
        let reach = reach.and_then(|r| i64::try_from(r).ok());
        crate::store::run(&self.db, move |conn| {
            let sql = if reach.is_none() {
                "INSERT INTO instance_leases (instance_id, owner, leased_until, floor_ms) \
                 VALUES ($1, $2, now() + $3 * interval '1 millisecond', coalesce($4, 0)) \
                 ON CONFLICT (instance_id) DO UPDATE \
                 SET owner = EXCLUDED.owner, leased_until = EXCLUDED.leased_until \
                 WHERE instance_leases.owner = EXCLUDED.owner \
                    OR instance_leases.leased_until < now() \
                 RETURNING floor_ms"
            } else {
                "UPDATE instance_leases \
                 SET leased_until = now() + $3 * interval '1 millisecond', \
                     floor_ms = greatest(floor_ms, coalesce($4, 0)) \
                 WHERE instance_id = $1 AND owner = $2 \
                 RETURNING floor_ms"
            };
            let rows: Vec<Row> = diesel::sql_query(sql)
                .bind::<SmallInt, _>(i16::try_from(instance).unwrap_or(i16::MAX))
                .bind::<Text, _>(owner)
                .bind::<BigInt, _>(ttl_ms)
                .bind::<Nullable<BigInt>, _>(reach)
                .load(conn)?;
            Ok(rows.first().map(|r| r.floor_ms))
        })
        .await
    }

    /// Deletes this owner's Redis key of `instance` (an id not taken after
    /// all, or given up).
    async fn give_up_key(&self, instance: u16) {
        let (key, _) = self.keys(instance);
        let released: RedisResult<i64> = Script::new(RELEASE)
            .key(&key)
            .arg(&self.owner)
            .invoke_async(&mut self.conn.clone())
            .await;
        if let Err(e) = released {
            tracing::warn!(instance, error = %e, "instance id lease not given up");
        }
    }

    /// Takes the lease at start-up. A configured id that is held is waited
    /// for one lease lifetime (a crashed predecessor's lease runs out),
    /// then refused. Redis unreachable is not fatal: the heartbeat takes
    /// the lease once it answers, and purchases get 503 until then.
    pub async fn acquire_at_start(&self) -> anyhow::Result<Option<u16>> {
        let deadline = Instant::now() + self.fence_ttl() + Duration::from_secs(1);
        loop {
            match self.acquire().await {
                Ok(id) => return Ok(Some(id)),
                Err(LeaseError::Unavailable(e)) => {
                    tracing::warn!(
                        error = %e,
                        "Redis unreachable: no instance id leased yet; purchases get 503 until it is"
                    );
                    return Ok(None);
                }
                Err(LeaseError::Fence(e)) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "PostgreSQL unreachable: no instance id leased yet; purchases get 503 until it is"
                    );
                    return Ok(None);
                }
                Err(LeaseError::Taken(why)) if Instant::now() >= deadline => bail!(why),
                Err(LeaseError::Taken(_)) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Renews a held lease in Redis, then its fence. False if it is no
    /// longer ours in either. Each is extended by what it confirmed: a
    /// fence that did not answer (PostgreSQL away) leaves the numbers
    /// going until it runs out, [`FENCE_LIFETIMES`] lifetimes after its
    /// last renewal.
    async fn renew(&self, instance: u16) -> RedisResult<bool> {
        let (key, floor_key) = self.keys(instance);
        // Where this holder may get to before its lease (in Redis) and its
        // fence (in PostgreSQL) run out.
        let last = self.ids.ids.last_ms().max(epoch_ms_now());
        let reach = last + self.ttl_ms();
        let fence_reach = last + u64::try_from(self.fence_ttl().as_millis()).unwrap_or(u64::MAX);
        let sent = Instant::now();
        let renewed: i64 = Script::new(RENEW)
            .key(&key)
            .key(&floor_key)
            .arg(&self.owner)
            .arg(self.ttl_ms())
            .arg(reach)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if renewed != 1 {
            return Ok(false);
        }
        // At once: a fence that takes long to answer (PostgreSQL going
        // away) must not let the lease in Redis lapse meanwhile.
        self.ids.extend(sent, self.ttl);
        // Nor a fence that does not answer hold up the next renewal.
        let fenced = tokio::time::timeout(self.ttl / 5, self.fence(instance, Some(fence_reach)))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within a fifth of the lease")));
        match fenced {
            Ok(Some(_)) => {
                self.ids.extend_fence(sent, self.fence_ttl());
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => {
                tracing::warn!(
                    instance,
                    error = format!("{e:#}"),
                    "instance id lease not renewed in PostgreSQL; numbers go on until its fence runs out"
                );
                Ok(true)
            }
        }
    }

    /// One heartbeat: renew the lease held, or take one.
    async fn beat(&self) {
        match self.ids.instance() {
            Some(instance) => match self.renew(instance).await {
                Ok(true) => {}
                Ok(false) => {
                    self.ids.revoke();
                    self.gauge.set(-1);
                    tracing::error!(
                        instance,
                        "instance id lease lost to another instance; no numbers are made until a new one is leased"
                    );
                }
                Err(e) => tracing::warn!(instance, error = %e, "instance id lease not renewed"),
            },
            None => {
                self.gauge.set(-1);
                match self.acquire().await {
                    Ok(instance) => tracing::info!(instance, "instance id leased"),
                    Err(LeaseError::Unavailable(e)) => {
                        tracing::warn!(error = %e, "instance id not leased: Redis unreachable");
                    }
                    Err(LeaseError::Taken(why)) => tracing::error!("{why}"),
                    Err(LeaseError::Fence(e)) => tracing::warn!(
                        error = format!("{e:#}"),
                        "instance id not leased: PostgreSQL unreachable"
                    ),
                }
            }
        }
    }

    /// Renews (or takes) the lease five times per lifetime until stopped,
    /// then gives it up.
    pub fn spawn(self) -> WorkerHandle {
        WorkerHandle::spawn(move |shutdown| async move {
            let period = self.ttl / 5;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(period) => self.beat().await,
                }
            }
            if let Some(instance) = self.ids.instance() {
                self.ids.revoke();
                self.give_up_key(instance).await;
                // The fence stays until its lifetime ends: this process
                // minted under it until a moment ago.
            }
        })
    }
}

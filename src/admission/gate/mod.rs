//! The Redis gate: the admission scripts and what they keep, one module per
//! script or family of scripts, each with its keys, its arguments and its
//! replies decoded into a type:
//!
//! - [`reserve`]: the admission script (SPEC step 1), its [`Admission`];
//! - [`lending`]: units lent between the shards of a hot activity;
//! - [`reservations`]: a reservation's life (release, acknowledgement,
//!   sending, void, commit) and its record;
//! - [`warmup`]: loading an activity, ending its sale, its stock figure;
//! - [`counts`]: what the sold-out path and the stats read of the shards;
//! - [`tokens`]: purchase tokens;
//! - [`room`]: the waiting room's queue, admission and passes.
//!
//! What reconciliation changes in Redis (repair, restore, removal) is in
//! `reconcile::redis`, over this gate's connection and keys.
//!
//! The hot path uses one long-lived multiplexed connection
//! ([`RedisConn`], to one server or a cluster), not the pool: every request is a single script
//! call, pipelined on one socket, with no per-checkout PING (see
//! docs/BENCHMARKS-HISTORY.md, "The admission path"). Scripts go out as `EVALSHA`; on
//! `NOSCRIPT` (Redis restarted or failed over) `redis::Script` loads the
//! script and retries once.

use redis::{RedisResult, Script};

use crate::admission::keys::{ActivityKeys, Layout};
use crate::config::{AdmissionSettings, RedisSettings};
use crate::domain::ActivityId;
use crate::store::redis_conn::{RedisClient, RedisConn};

mod attempt;
mod counts;
mod lending;
pub mod reservations;
pub mod reserve;
pub mod room;
mod tokens;
pub mod warmup;

pub use attempt::{Admission, ReserveRequest};
pub use reservations::{ReleaseReason, Reservation, Status, Unsent, VoidClaim};
pub use warmup::WarmSpec;

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
    /// Unit price, cents (a coupon's minimum is checked against it).
    pub price_cents: i64,
}

impl Meta {
    /// Whether `now_ms` is inside the sale window.
    pub fn is_open(&self, now_ms: i64) -> bool {
        self.start_ms <= now_ms && now_ms < self.end_ms
    }
}

/// The pub/sub channel of stock coming back, under a key prefix: messages
/// are activity ids (the sold-out flags listen to it).
pub fn returned_channel(prefix: &str) -> String {
    format!("{prefix}stock-returned")
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
    /// The stock-returned channel ([`returned_channel`]).
    returned: String,
    reservation_ttl_secs: u64,
    reserve: Script,
    release: Script,
    commit: Script,
    warmup: Script,
    ack: Script,
    sending: Script,
    void: Script,
    lend: Script,
    borrow: Script,
    shard_stock: Script,
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
            returned: returned_channel(&redis.key_prefix),
            reservation_ttl_secs: admission.reservation_ttl_secs.as_secs(),
            reserve: Script::new(include_str!("../lua/reserve.lua")),
            release: Script::new(include_str!("../lua/release.lua")),
            commit: Script::new(include_str!("../lua/commit.lua")),
            warmup: Script::new(include_str!("../lua/warmup.lua")),
            ack: Script::new(include_str!("../lua/ack.lua")),
            sending: Script::new(include_str!("../lua/sending.lua")),
            void: Script::new(include_str!("../lua/void.lua")),
            lend: Script::new(include_str!("../lua/lend.lua")),
            borrow: Script::new(include_str!("../lua/borrow.lua")),
            shard_stock: Script::new(include_str!("../lua/shard_stock.lua")),
        })
    }

    /// The same gate on a connection of its own, driven by the runtime this
    /// is called on. Each HTTP worker gets one, so a purchase's script call
    /// never hops to another thread's runtime and back (see
    /// docs/BENCHMARKS-HISTORY.md).
    pub fn on_own_connection(&self) -> RedisResult<Self> {
        let mut gate = self.clone();
        gate.conn = self.client.connect_lazy()?;
        Ok(gate)
    }

    /// The base keys of an activity: its meta and `restoring` marker (and,
    /// unsharded, all of its keys).
    pub(crate) fn keys(&self, activity_id: ActivityId) -> ActivityKeys {
        ActivityKeys::new(&self.prefix, activity_id)
    }

    /// The keys of one shard of an activity.
    pub(crate) fn shard_keys(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        shard: usize,
    ) -> ActivityKeys {
        ActivityKeys::shard(&self.prefix, activity_id, layout, shard)
    }

    /// The keys of the shard holding `order_no`'s reservation.
    pub(crate) fn order_keys(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
    ) -> ActivityKeys {
        self.shard_keys(activity_id, layout, layout.shard_of_order(order_no))
    }

    /// A clone of the multiplexed connection, for plain commands.
    pub(crate) fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// The stock-returned channel, published to when units come back.
    pub(crate) fn returned(&self) -> &str {
        &self.returned
    }

    /// How long a reservation record lives (`admission.reservation_ttl_secs`).
    pub(crate) fn reservation_ttl_secs(&self) -> u64 {
        self.reservation_ttl_secs
    }

    /// `PING` on the gate's connection (a cluster answers from every
    /// master): readiness.
    pub async fn ping(&self) -> RedisResult<String> {
        redis::cmd("PING").query_async(&mut self.conn()).await
    }

    /// The activity's window, limits and layout, when it is warm.
    pub async fn meta(&self, activity_id: ActivityId) -> RedisResult<Option<Meta>> {
        type Fields = (
            Option<i64>,
            Option<i64>,
            Option<i32>,
            Option<usize>,
            Option<usize>,
            Option<i64>,
        );
        let (start, end, limit, buckets, shards, price): Fields = redis::cmd("HMGET")
            .arg(self.keys(activity_id).meta())
            .arg(&["start_ms", "end_ms", "limit", "buckets", "shards", "price"])
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(match (start, end, limit, buckets) {
            (Some(start_ms), Some(end_ms), Some(per_user_limit), Some(buckets)) => Some(Meta {
                start_ms,
                end_ms,
                per_user_limit,
                layout: Layout::new(buckets, shards.unwrap_or(1)),
                price_cents: price.unwrap_or(0),
            }),
            _ => None,
        })
    }

    /// Whether the activity has been warmed (its meta hash exists).
    pub async fn is_warm(&self, activity_id: ActivityId) -> RedisResult<bool> {
        redis::cmd("EXISTS")
            .arg(self.keys(activity_id).meta())
            .query_async(&mut self.conn.clone())
            .await
    }
}

/// The gate of one HTTP server thread (actix calls it a worker): its own
/// multiplexed connection, so the threads do not queue on one socket.
pub struct ThreadGate(pub RedisGate);

/// `order_nos` grouped by the shard of each, with their positions.
pub(super) fn by_shard(
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

//! The room's settings as an activity is created with them, its views,
//! and what its routes can answer besides a body.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::draw;
use super::method::Method;
use super::repo::RoomRow;
use crate::domain::ActivityId;

/// The `waiting_room` object of an activity's creation.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RoomOptions {
    /// How long before `start_at` the pre-queue opens.
    #[schema(minimum = 0)]
    pub prequeue_secs: i32,
    /// Tickets admitted per second, across all instances.
    #[schema(minimum = 1)]
    pub admit_per_sec: i32,
    /// At most this many passes outstanding at once (unset: no cap).
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_active: Option<i32>,
    /// How long a pass admits its ticket.
    #[serde(default = "default_pass_ttl")]
    #[schema(minimum = 1, default = 120)]
    pub pass_ttl_secs: i32,
    /// How long a released unit is held for the ticket it is offered to.
    #[serde(default = "default_offer")]
    #[schema(minimum = 1, default = 60)]
    pub offer_secs: i32,
    /// The proof of work's `maxnumber` at a quiet join rate (a solver tries
    /// half of it on average).
    #[serde(default = "default_difficulty")]
    #[schema(minimum = 1, default = 50000)]
    pub pow_difficulty: i64,
    /// How the room lets buyers through (`fifo` by default).
    #[serde(default)]
    pub method: Method,
}

fn default_pass_ttl() -> i32 {
    120
}

fn default_offer() -> i32 {
    60
}

fn default_difficulty() -> i64 {
    50_000
}

/// The most a room admits per second.
const MAX_RATE: i32 = 100_000;

/// The largest difficulty a room starts at (about ten seconds in a
/// browser).
const MAX_DIFFICULTY: i64 = 10_000_000;

impl RoomOptions {
    /// Checks the options; the message names what is wrong.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.prequeue_secs < 0 || self.prequeue_secs > 7 * 86_400 {
            return Err("waiting_room.prequeue_secs must be 0..=604800");
        }
        if !(1..=MAX_RATE).contains(&self.admit_per_sec) {
            return Err("waiting_room.admit_per_sec must be 1..=100000");
        }
        if self.max_active.is_some_and(|m| m < 1) {
            return Err("waiting_room.max_active must be at least 1");
        }
        if self.pass_ttl_secs < 1 || self.pass_ttl_secs > 86_400 {
            return Err("waiting_room.pass_ttl_secs must be 1..=86400");
        }
        if self.offer_secs < 1 || self.offer_secs > 86_400 {
            return Err("waiting_room.offer_secs must be 1..=86400");
        }
        if !(1..=MAX_DIFFICULTY).contains(&self.pow_difficulty) {
            return Err("waiting_room.pow_difficulty must be 1..=10000000");
        }
        Ok(())
    }

    /// The row for `activity`, with a new secret seed.
    pub fn into_row(self, activity: ActivityId) -> anyhow::Result<RoomRow> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        Ok(RoomRow {
            activity_id: activity,
            prequeue_secs: self.prequeue_secs,
            admit_per_sec: self.admit_per_sec,
            max_active: self.max_active,
            pass_ttl_secs: self.pass_ttl_secs,
            offer_secs: self.offer_secs,
            pow_difficulty: self.pow_difficulty,
            seed: hex::encode(seed),
            epoch: 1,
            method: self.method.as_str().to_owned(),
        })
    }
}

/// A room's settings as clients see them.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RoomSettingsView {
    pub prequeue_secs: i32,
    pub admit_per_sec: i32,
    pub max_active: Option<i32>,
    pub pass_ttl_secs: i32,
    pub offer_secs: i32,
    pub pow_difficulty: i64,
    /// When the pre-queue opens.
    pub prequeue_opens_at: DateTime<Utc>,
    /// SHA-256 of the draw's seed, hex: public from the room's creation,
    /// so the seed revealed after the start (`…/queue/draw`) cannot have
    /// been chosen then.
    pub seed_sha256: String,
    /// How the room lets buyers through now.
    pub method: Method,
}

impl RoomSettingsView {
    /// The view of `row` for a sale starting at `start_at`.
    pub fn of(row: &RoomRow, start_at: DateTime<Utc>) -> Self {
        Self {
            prequeue_secs: row.prequeue_secs,
            admit_per_sec: row.admit_per_sec,
            max_active: row.max_active,
            pass_ttl_secs: row.pass_ttl_secs,
            offer_secs: row.offer_secs,
            pow_difficulty: row.pow_difficulty,
            prequeue_opens_at: opens_at(row, start_at),
            seed_sha256: hex::decode(&row.seed)
                .map(|s| draw::seed_commitment(&s))
                .unwrap_or_default(),
            method: row.method(),
        }
    }
}

/// When the pre-queue of `row` opens for a sale starting at `start_at`.
pub fn opens_at(row: &RoomRow, start_at: DateTime<Utc>) -> DateTime<Utc> {
    start_at - chrono::Duration::seconds(i64::from(row.prequeue_secs))
}

/// What anyone needs to recompute the pre-queue order.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DrawView {
    /// How the order follows from the rest (docs/WAITING_ROOM.md).
    pub algorithm: &'static str,
    /// The seed, hex; its SHA-256 was published before the pre-queue.
    pub seed: String,
    /// How the commitment is made (docs/WAITING_ROOM.md).
    pub commitment_scheme: &'static str,
    /// The root, hex, of the Merkle tree over the pre-queue entrants (one
    /// leaf per ticket, in ticket order), fixed at the start.
    pub commitment: String,
    /// Tickets in the draw: numbers 1..=entrants.
    pub entrants: u64,
    /// SHA-256 of the seed, as published before.
    pub seed_sha256: String,
    /// The queue these figures are of (a new one starts if Redis loses it).
    pub epoch: i64,
}

/// What a room's route can answer besides its body.
#[derive(Debug)]
pub enum RoomError {
    /// The activity has no waiting room (or does not exist).
    NoRoom,
    /// Outside the pre-queue-to-end window (or the queue not open yet).
    NotOpen,
    /// The operator closed the queue (method `reject`).
    Closed,
    /// The proof of work was wrong, expired or used.
    PowInvalid(&'static str),
    /// The caller holds no ticket.
    NotInQueue { restarted: bool },
    /// The queue is being restored after Redis lost it.
    Restoring,
    /// The token route needs a pass.
    PassRequired,
    /// The pass is not good (why, for the message).
    PassInvalid(&'static str),
    /// Sold out: an admitted pass no longer buys.
    SoldOut,
    /// A backing service failed.
    Unavailable(anyhow::Error),
}

impl From<redis::RedisError> for RoomError {
    fn from(e: redis::RedisError) -> Self {
        RoomError::Unavailable(e.into())
    }
}

impl From<anyhow::Error> for RoomError {
    fn from(e: anyhow::Error) -> Self {
        RoomError::Unavailable(e)
    }
}

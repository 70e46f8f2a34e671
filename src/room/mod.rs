//! The waiting room: an option of an activity that puts a fair queue in
//! front of its sale (docs/WAITING_ROOM.md).
//!
//! - Buyers answer a proof-of-work challenge ([`pow`]) and take a ticket.
//!   Tickets taken during the pre-queue are drawn into a random order at
//!   the start ([`draw`]), keyed by a Merkle root over them ([`entrants`])
//!   that lets each buyer prove their own ticket was drawn; later ones
//!   follow in the order they came.
//! - An admitter on every instance ([`admitter`]) admits the next tickets
//!   at the room's rate through one Redis script, giving each a signed,
//!   one-time pass ([`pass`]) that the purchase-token route asks for.
//! - Once sold out, every waiting ticket is on the waitlist, and each unit
//!   that comes back is offered to the next ticket in queue order.
//!
//! [`Rooms`] is what the routes call; the queue itself lives in Redis
//! (`admission::gate::room`), the room's settings in `waiting_rooms`.

pub mod admitter;
pub mod draw;
pub mod entrants;
pub mod pass;
pub mod pow;
pub mod repo;
mod ticket;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use secrecy::SecretString;

use crate::admission::gate::room::{Joined, Redeemed, RoomGate, RoomSpec, RoomView};
use crate::auth::derive_key;
use crate::domain::{ActivityId, UserId};
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

use draw::Draw;
use repo::RoomRow;
pub use ticket::{Inclusion, TicketState, TicketView};

/// How a room lets buyers through, changeable during a sale
/// (docs/WAITING_ROOM.md, "Queueing methods").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// The drawn pre-queue, then in the order buyers came.
    #[default]
    Fifo,
    /// Open without queueing: a purchase token needs no pass. Tickets
    /// are still taken and admitted, so switching back finds the queue.
    Passthrough,
    /// Closed: no challenge, no join, no admission, no purchase token.
    Reject,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Fifo => "fifo",
            Method::Passthrough => "passthrough",
            Method::Reject => "reject",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "fifo" => Some(Method::Fifo),
            "passthrough" => Some(Method::Passthrough),
            "reject" => Some(Method::Reject),
            _ => None,
        }
    }
}

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

/// How long a room's row is trusted in process.
const ROW_TTL: Duration = Duration::from_secs(2);

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

/// What is known of an existing activity's room.
#[derive(Clone)]
enum Known {
    /// The activity exists and has no room: true for good (a room is
    /// chosen at creation only).
    NoRoom,
    /// Its room, as read then.
    Room(Instant, Arc<repo::LiveRoom>),
}

/// The activities that have a room, read as a whole: an id not among them
/// is answered "no room" without a query, however many random ids a
/// client makes up.
struct Index {
    read_at: Instant,
    /// [`Rooms::forget`]'s generation when it was read.
    generation: u64,
    ids: HashSet<ActivityId>,
}

/// The waiting rooms of every activity: what the routes and the admitter
/// share.
pub struct Rooms {
    gate: RoomGate,
    db: PgPool,
    puzzles: pow::Puzzles,
    passes: pass::Passes,
    challenge_ttl: Duration,
    metrics: Metrics,
    /// The small pool of public reads: the rooms' rows are read there, not
    /// on the pool that orders and payments use.
    public: PgPool,
    /// Whether each existing activity seen has a room (fixed at creation)
    /// and its settings as read then (rate and epoch may move since: Redis
    /// has those). Only activities that exist are kept.
    known: RwLock<HashMap<ActivityId, Known>>,
    /// Which activities have a room, read again after [`ROW_TTL`]; one
    /// caller reads it while the others wait for that read.
    index: tokio::sync::Mutex<Option<Arc<Index>>>,
    /// Bumped by [`Rooms::forget`]: an index read before is read again.
    generation: AtomicU64,
    /// The draw of each closed queue, by activity and epoch, the last
    /// [`SEALED_KEPT`] built.
    draws: Mutex<Vec<(QueueKey, Arc<Sealed>)>>,
    /// One draw is built at a time; the others wait and find it built.
    sealing: tokio::sync::Mutex<()>,
    salts: entrants::Salts,
}

/// A queue: its activity and epoch.
type QueueKey = (ActivityId, i64);

/// How many queues' draws an instance keeps built (a tree is about 64
/// bytes an entrant); an older one is built again if asked for.
const SEALED_KEPT: usize = 8;

/// A closed queue's draw and the tree of its entrants it was keyed by.
pub struct Sealed {
    pub draw: Draw,
    pub tree: entrants::Tree,
}

impl Rooms {
    /// The rooms over `gate`, with keys derived from `secret`
    /// (`auth.server_secret`).
    pub fn new(
        gate: RoomGate,
        db: PgPool,
        public: PgPool,
        secret: &SecretString,
        challenge_ttl: Duration,
        metrics: Metrics,
    ) -> Self {
        Self {
            gate,
            db,
            puzzles: pow::Puzzles::new(hex::encode(derive_key(secret, "seckill/queue-pow/v1"))),
            passes: pass::Passes::new(&derive_key(secret, "seckill/queue-pass/v1")),
            challenge_ttl,
            metrics,
            public,
            known: RwLock::default(),
            index: tokio::sync::Mutex::default(),
            generation: AtomicU64::new(0),
            draws: Mutex::default(),
            sealing: tokio::sync::Mutex::default(),
            salts: entrants::Salts::new(&derive_key(secret, "seckill/queue-entrant-salt/v1")),
        }
    }

    /// The room of `activity` with its window, `None` without one (or
    /// without such an activity). Whether an activity has a room never
    /// changes: "none" is read once per process for an existing activity,
    /// so one without a room costs a map lookup on its token route, and an
    /// id without a room is answered from the index of rooms, with no
    /// query of its own. A room's row is read again after [`ROW_TTL`] (its
    /// end and whether its queue was opened can move).
    pub async fn room(&self, activity: ActivityId) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        self.lookup(activity, false).await
    }

    /// The room of an activity known to exist (the token route, once Redis
    /// holds it warm): the index is not believed, or one read before its
    /// creation on another instance would let its tokens go without a
    /// pass.
    pub async fn room_of_existing(
        &self,
        activity: ActivityId,
    ) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        self.lookup(activity, true).await
    }

    async fn lookup(
        &self,
        activity: ActivityId,
        exists: bool,
    ) -> anyhow::Result<Option<Arc<repo::LiveRoom>>> {
        let cached = self
            .known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&activity)
            .cloned();
        match cached {
            Some(Known::NoRoom) => return Ok(None),
            Some(Known::Room(at, room)) if at.elapsed() < ROW_TTL => return Ok(Some(room)),
            _ => {}
        }
        if !exists && !self.indexed().await?.ids.contains(&activity) {
            return Ok(None);
        }
        self.metrics.room_lookups.with_label_values(&["row"]).inc();
        let (found, exists) = store::run(&self.public, move |conn| {
            let found = repo::find_live(conn, activity)?;
            let exists =
                found.is_some() || crate::activities::repo::find(conn, activity)?.is_some();
            Ok((found, exists))
        })
        .await?;
        let found = found.map(Arc::new);
        let known = match (&found, exists) {
            (Some(room), _) => Known::Room(Instant::now(), room.clone()),
            (None, true) => Known::NoRoom,
            // No such activity (deleted since): nothing kept.
            (None, false) => return Ok(None),
        };
        self.known
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(activity, known);
        Ok(found)
    }

    /// The index of rooms, read again when older than [`ROW_TTL`] or
    /// read before a room was created here.
    async fn indexed(&self) -> anyhow::Result<Arc<Index>> {
        let mut index = self.index.lock().await;
        let generation = self.generation.load(Ordering::Acquire);
        if let Some(i) = index
            .as_ref()
            .filter(|i| i.generation == generation && i.read_at.elapsed() < ROW_TTL)
        {
            return Ok(i.clone());
        }
        self.metrics
            .room_lookups
            .with_label_values(&["index"])
            .inc();
        let ids = store::run(&self.public, |conn| Ok(repo::ids(conn)?)).await?;
        let fresh = Arc::new(Index {
            read_at: Instant::now(),
            generation,
            ids: ids.into_iter().collect(),
        });
        *index = Some(fresh.clone());
        Ok(fresh)
    }

    async fn require(&self, activity: ActivityId) -> Result<Arc<repo::LiveRoom>, RoomError> {
        self.room(activity).await?.ok_or(RoomError::NoRoom)
    }

    /// Opens the room's queue in Redis unless it is there; true if opened
    /// now.
    pub async fn open(&self, live: &repo::LiveRoom, epoch: i32) -> redis::RedisResult<bool> {
        let row = &live.room;
        let spec = RoomSpec {
            epoch: i64::from(epoch),
            open_ms: opens_at(row, live.start_at).timestamp_millis(),
            start_ms: live.start_at.timestamp_millis(),
            end_ms: live.end_at.timestamp_millis(),
            admit_per_sec: i64::from(row.admit_per_sec),
            max_active: i64::from(row.max_active.unwrap_or(0)),
            pass_ms: i64::from(row.pass_ttl_secs) * 1000,
            offer_ms: i64::from(row.offer_secs) * 1000,
            seed: row.seed.clone(),
        };
        let (now, _) = self.gate.open(row.activity_id, &spec).await?;
        Ok(now)
    }

    /// Opens the first queue of a room (at its creation; the admitter
    /// does it otherwise). A room opened before is left alone.
    pub async fn open_first(&self, activity: ActivityId) -> anyhow::Result<()> {
        let found = store::run(&self.db, move |conn| Ok(repo::find_live(conn, activity)?)).await?;
        let Some(live) = found.filter(|l| !l.opened) else {
            return Ok(());
        };
        // Marked first: a queue missing after this was lost, never "not
        // yet opened" (which would reuse the epoch).
        store::run(&self.db, move |conn| Ok(repo::mark_opened(conn, activity)?)).await?;
        self.open(&live, live.room.epoch).await?;
        self.forget(activity);
        Ok(())
    }

    /// A proof-of-work challenge for `user`, harder while many join.
    pub async fn challenge(
        &self,
        activity: ActivityId,
        user: UserId,
        now: DateTime<Utc>,
    ) -> Result<pow::Challenge, RoomError> {
        let room = self.require(activity).await?;
        if now >= room.end_at {
            return Err(RoomError::NotOpen);
        }
        if room.room.method() == Method::Reject {
            return Err(RoomError::Closed);
        }
        let rate = self.gate.join_rate(activity, now.timestamp()).await?;
        let maxnumber = pow::difficulty(room.room.pow_difficulty.max(1) as u64, rate);
        let expires_at = now + chrono::Duration::from_std(self.challenge_ttl).unwrap_or_default();
        Ok(self
            .puzzles
            .challenge(activity, user, maxnumber, expires_at)?)
    }

    /// Takes `user`'s ticket with `answer`: `(new, ticket)`.
    pub async fn join(
        &self,
        activity: ActivityId,
        user: UserId,
        answer: &pow::Answer,
        now: DateTime<Utc>,
    ) -> Result<(bool, TicketView), RoomError> {
        let room = self.require(activity).await?;
        if room.room.method() == Method::Reject {
            return Err(RoomError::Closed);
        }
        let solved = self
            .puzzles
            .check(answer, activity, user, now)
            .map_err(|refusal| {
                self.metrics
                    .room_pow
                    .with_label_values(&[refusal.as_str()])
                    .inc();
                RoomError::PowInvalid(match refusal {
                    pow::Refusal::Wrong => {
                        "the proof of work is not a solution of a challenge for you"
                    }
                    pow::Refusal::Expired => {
                        "the proof of work's challenge has expired; ask for a new one"
                    }
                })
            })?;
        let rate = self.gate.join_rate(activity, now.timestamp()).await?;
        let base = room.room.pow_difficulty.max(1) as u64;
        if !pow::hard_enough(solved.maxnumber, base, rate) {
            self.metrics.room_pow.with_label_values(&["too_easy"]).inc();
            return Err(RoomError::PowInvalid(
                "the proof of work's challenge is easier than the room asks now; ask for a new one",
            ));
        }
        let ttl_ms = (solved.expires_at - now).num_milliseconds();
        let joined = self
            .gate
            .join(
                activity,
                user,
                &answer.challenge,
                ttl_ms,
                now.timestamp_millis(),
            )
            .await?;
        let new = match joined {
            Joined::New(_) => true,
            Joined::Again(_) => false,
            Joined::Replayed => {
                self.metrics.room_pow.with_label_values(&["replayed"]).inc();
                return Err(RoomError::PowInvalid(
                    "this proof of work was used already; ask for a new challenge",
                ));
            }
            Joined::NotOpen => return Err(RoomError::NotOpen),
            Joined::NoRoom => return Err(self.missing(&room)),
        };
        self.metrics.room_pow.with_label_values(&["accepted"]).inc();
        Ok((new, self.ticket(activity, user, now, false).await?))
    }

    /// Why a room is not in Redis: not opened yet, or lost and being
    /// restored.
    fn missing(&self, room: &repo::LiveRoom) -> RoomError {
        if room.opened {
            RoomError::Restoring
        } else {
            RoomError::NotOpen
        }
    }

    /// `user`'s ticket; with `proof`, a drawn ticket's proof that it was
    /// among the entrants.
    pub async fn ticket(
        &self,
        activity: ActivityId,
        user: UserId,
        now: DateTime<Utc>,
        proof: bool,
    ) -> Result<TicketView, RoomError> {
        let room = self.require(activity).await?;
        let Some(view) = self.gate.status(activity, user).await? else {
            return Err(self.missing(&room));
        };
        if view.ticket == 0 {
            return Err(RoomError::NotInQueue {
                restarted: view.epoch > 1,
            });
        }
        let sealed = self.sealed(activity, &view).await?;
        let inclusion = sealed.as_deref().filter(|_| proof).and_then(|s| {
            Some(Inclusion {
                user: user.get(),
                salt: hex::encode(self.salts.of(activity, view.epoch, view.ticket)),
                entrants: s.tree.len(),
                root: s.tree.root(),
                path: s.tree.proof(view.ticket)?,
            })
        });
        let mut ticket = TicketView::of(
            &view,
            sealed.as_deref().map(|s| &s.draw),
            now.timestamp_millis(),
            |kind, expires_ms| {
                self.passes.sign(&pass::Pass {
                    activity,
                    user,
                    ticket: view.ticket,
                    epoch: view.epoch,
                    kind,
                    expires_ms,
                })
            },
        );
        ticket.inclusion = inclusion;
        Ok(ticket)
    }

    /// `user` leaves the queue: their ticket, now LEFT.
    pub async fn leave(
        &self,
        activity: ActivityId,
        user: UserId,
        now: DateTime<Utc>,
    ) -> Result<TicketView, RoomError> {
        let room = self.require(activity).await?;
        match self.gate.leave(activity, user).await? {
            None => Err(self.missing(&room)),
            Some(0) => Err(RoomError::NotInQueue { restarted: false }),
            Some(_) => self.ticket(activity, user, now, false).await,
        }
    }

    /// The draw's published figures, once the sale has started.
    pub async fn published_draw(&self, activity: ActivityId) -> Result<DrawView, RoomError> {
        let room = self.require(activity).await?;
        let Some(view) = self.gate.head(activity).await? else {
            return Err(self.missing(&room));
        };
        let Some(sealed) = self.sealed(activity, &view).await? else {
            return Err(RoomError::NotOpen);
        };
        Ok(DrawView {
            algorithm: draw::ALGORITHM,
            commitment_scheme: entrants::SCHEME,
            seed_sha256: hex::decode(&view.seed)
                .map(|s| draw::seed_commitment(&s))
                .unwrap_or_default(),
            seed: view.seed,
            commitment: sealed.tree.root(),
            entrants: view.entrants,
            epoch: view.epoch,
        })
    }

    /// The draw of a closed queue, `None` before the start. Built once
    /// per queue on each instance: the entrants read from Redis, their
    /// tree built off the async workers, its root written to the room if
    /// no instance did before and checked against the one there (every
    /// instance builds the same from the same list; a difference means the
    /// list changed, and nothing is admitted on it).
    pub(crate) async fn sealed(
        &self,
        activity: ActivityId,
        view: &RoomView,
    ) -> Result<Option<Arc<Sealed>>, RoomError> {
        if !view.closed {
            return Ok(None);
        }
        let key = (activity, view.epoch);
        if let Some(s) = self.built(key) {
            return Ok(Some(s));
        }
        let _one = self.sealing.lock().await;
        if let Some(s) = self.built(key) {
            return Ok(Some(s));
        }
        let seed = hex::decode(&view.seed)
            .map_err(|_| anyhow::anyhow!("room {activity}: its seed is not hex"))?;
        let users = self.gate.entrants(activity, view.entrants).await?;
        if users.len() as u64 != view.entrants {
            return Err(anyhow::anyhow!(
                "room {activity}: Redis holds {} of its {} entrants",
                users.len(),
                view.entrants
            )
            .into());
        }
        let (salts, epoch) = (self.salts.clone(), view.epoch);
        let tree = tokio::task::spawn_blocking(move || {
            entrants::Tree::build(&salts, activity, epoch, &users)
        })
        .await
        .map_err(anyhow::Error::from)?;
        let root = tree.root();
        match self.gate.seal(activity, view.epoch, &root).await? {
            Some(stored) if stored == root => {}
            Some(stored) => return Err(anyhow::anyhow!(
                "room {activity}: built the root {root} of its entrants, the room holds {stored}"
            )
            .into()),
            None => return Err(RoomError::Restoring),
        }
        let sealed = Arc::new(Sealed {
            draw: Draw::new(&seed, &root, view.entrants),
            tree,
        });
        let mut draws = self.draws.lock().unwrap_or_else(|e| e.into_inner());
        draws.retain(|((a, e), _)| *a != activity || *e > view.epoch);
        if draws.len() >= SEALED_KEPT {
            draws.remove(0);
        }
        draws.push((key, sealed.clone()));
        Ok(Some(sealed))
    }

    fn built(&self, key: QueueKey) -> Option<Arc<Sealed>> {
        let draws = self.draws.lock().unwrap_or_else(|e| e.into_inner());
        draws
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, s)| s.clone())
    }

    /// Checks and uses `raw`, the `X-Queue-Pass` of a token request: what
    /// it was given for (an offer's token buys the one unit held for it).
    pub async fn redeem(
        &self,
        activity: ActivityId,
        user: UserId,
        raw: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<pass::Kind, RoomError> {
        let outcome = self.redeem_outcome(activity, user, raw, now).await;
        let label = match &outcome {
            Ok(_) => "used",
            Err(RoomError::PassRequired) => "missing",
            Err(RoomError::PassInvalid(why)) => why_label(why),
            Err(RoomError::SoldOut) => "sold_out",
            Err(RoomError::Restoring) => "lost",
            Err(_) => "error",
        };
        self.metrics
            .room_pass_checks
            .with_label_values(&[label])
            .inc();
        outcome
    }

    async fn redeem_outcome(
        &self,
        activity: ActivityId,
        user: UserId,
        raw: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<pass::Kind, RoomError> {
        let raw = raw
            .filter(|r| !r.is_empty())
            .ok_or(RoomError::PassRequired)?;
        let now_ms = now.timestamp_millis();
        let p = self
            .passes
            .check(raw, activity, user, now_ms)
            .map_err(|r| RoomError::PassInvalid(refusal_text(r)))?;
        let used = self
            .gate
            .redeem(
                activity,
                p.ticket,
                user,
                p.epoch,
                p.kind.letter(),
                p.expires_ms,
                now_ms,
            )
            .await?;
        match used {
            Redeemed::Used => {
                if p.kind == pass::Kind::Offer {
                    self.metrics.room_offers.with_label_values(&["taken"]).inc();
                }
                Ok(p.kind)
            }
            Redeemed::SoldOut => Err(RoomError::SoldOut),
            Redeemed::Expired => Err(RoomError::PassInvalid(EXPIRED)),
            Redeemed::Reused => Err(RoomError::PassInvalid(REUSED)),
            Redeemed::OldEpoch | Redeemed::NoRoom => Err(RoomError::PassInvalid(LOST)),
            Redeemed::NotHeld => Err(RoomError::PassInvalid(NOT_HELD)),
        }
    }

    /// `user` bought in `activity`'s sale (a purchase was accepted): if it
    /// has a room, their ticket leaves the waitlist for good and an offer
    /// it used stops holding a unit.
    ///
    /// On the purchase path: an activity without a room costs a map
    /// lookup, or a look in the index of rooms (one query every
    /// [`ROW_TTL`] however many buy), never a query of its own. (A
    /// purchase in a room's sale came with a pass, whose token route read
    /// the room already.)
    pub async fn bought(&self, activity: ActivityId, user: UserId) -> anyhow::Result<()> {
        let cached = self
            .known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&activity)
            .map(|k| matches!(k, Known::Room(..)));
        let has_room = match cached {
            Some(has) => has,
            None => self.indexed().await?.ids.contains(&activity),
        };
        if has_room {
            self.gate.bought(activity, user).await?;
        }
        Ok(())
    }

    /// Sets the admission rate and cap of a room (`rate`), or how it lets
    /// buyers through (`method`), or both: in the database, and the rate
    /// in Redis. Every admitter follows the rate from its next round;
    /// every instance follows the method once it reads the room's row
    /// again (at most [`ROW_TTL`]; this one at once).
    pub async fn set_rate(
        &self,
        activity: ActivityId,
        rate: Option<(i32, Option<i32>)>,
        method: Option<Method>,
    ) -> Result<RoomRow, RoomError> {
        let row = store::run(&self.db, move |conn| {
            Ok(repo::set_rate(conn, activity, rate, method)?)
        })
        .await?
        .ok_or(RoomError::NoRoom)?;
        self.forget(activity);
        if let Some((admit_per_sec, max_active)) = rate {
            self.gate
                .set_rate(
                    activity,
                    i64::from(admit_per_sec),
                    i64::from(max_active.unwrap_or(0)),
                )
                .await?;
        }
        Ok(row)
    }

    /// The sale of `activity` ended at `now`: no join after it.
    pub async fn end(&self, activity: ActivityId, now: DateTime<Utc>) -> Result<(), RoomError> {
        if self.room(activity).await?.is_some() {
            self.gate.end(activity, now.timestamp_millis()).await?;
        }
        Ok(())
    }

    /// Forgets what is cached of `activity` (its room was just created or
    /// its epoch moved).
    pub fn forget(&self, activity: ActivityId) {
        self.known
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&activity);
        // A room created here is in this instance's next index at once.
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn gate(&self) -> &RoomGate {
        &self.gate
    }

    pub(crate) fn db(&self) -> &PgPool {
        &self.db
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

const EXPIRED: &str = "the queue pass has expired";
const REUSED: &str = "the queue pass was used already";
const LOST: &str = "the queue this pass is from was restarted; join the queue again";
const NOT_HELD: &str = "the queue pass is no longer this ticket's";
const FORGED: &str = "the queue pass was not issued by this service";
const FOREIGN: &str = "the queue pass is for another user or activity";

fn refusal_text(r: pass::Refusal) -> &'static str {
    match r {
        pass::Refusal::Forged => FORGED,
        pass::Refusal::Foreign => FOREIGN,
        pass::Refusal::Expired => EXPIRED,
    }
}

fn why_label(why: &str) -> &'static str {
    match why {
        EXPIRED => "expired",
        REUSED => "reused",
        LOST => "lost",
        FORGED => "forged",
        FOREIGN => "foreign",
        _ => "not_held",
    }
}

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
mod index;
mod method;
pub mod pass;
pub mod pow;
pub mod repo;
mod ticket;
mod types;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};

use secrecy::SecretString;

use crate::admission::gate::room::{Joined, Redeemed, RoomGate, RoomSpec, RoomView};
use crate::auth::derive_key;
use crate::domain::{ActivityId, UserId};
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

use draw::Draw;
use index::{Index, Known};
pub use method::Method;
use repo::RoomRow;
pub use ticket::{Inclusion, TicketState, TicketView};
pub use types::{DrawView, RoomError, RoomOptions, RoomSettingsView, opens_at};

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

//! The waiting room's scripts (`lua/room_*.lua`): open, join, status,
//! admit, redeem, leave, each one atomic call on the activity's base hash
//! tag, so a Redis Cluster runs them unchanged. Replies are decoded into
//! the types below; the draw, the passes and the answers to buyers are
//! `crate::room`'s.

use redis::{RedisResult, Script, Value};

use super::RedisGate;
use crate::admission::keys::ActivityKeys;
use crate::domain::{ActivityId, UserId};

/// The scripts that change a room start with this (`close_prequeue`).
macro_rules! with_close {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("../lua/room_close.lua"),
            include_str!(concat!("../lua/", $file))
        ))
    };
}

/// A room as it is opened.
#[derive(Debug, Clone)]
pub struct RoomSpec {
    pub epoch: i64,
    pub open_ms: i64,
    pub start_ms: i64,
    pub end_ms: i64,
    pub admit_per_sec: i64,
    /// 0: no cap.
    pub max_active: i64,
    pub pass_ms: i64,
    pub offer_ms: i64,
    /// Hex.
    pub seed: String,
}

/// A join's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined {
    /// A new ticket.
    New(u64),
    /// The user's ticket, as before.
    Again(u64),
    /// No room in Redis: never opened, or lost.
    NoRoom,
    /// Before the pre-queue opens, or after the end.
    NotOpen,
    /// That proof-of-work answer was accepted before.
    Replayed,
}

/// The room and one user's ticket, as `room_status.lua` reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomView {
    pub epoch: i64,
    /// The pre-queue draw is fixed (the sale started).
    pub closed: bool,
    /// Tickets in the draw (0 until closed).
    pub entrants: u64,
    /// Tickets taken.
    pub seq: u64,
    /// Places admitted so far: the next place served.
    pub serving: u64,
    pub sold_out: bool,
    pub admit_per_sec: i64,
    /// The user's ticket (0: none).
    pub ticket: u64,
    /// Its state once past its turn (`''` while it waits).
    pub state: String,
    pub commitment: String,
    /// Hex; secret until `closed`.
    pub seed: String,
    /// Once sold out, the next place the waitlist's offers go to.
    pub offering: u64,
    /// Passes and offers used so far (`room_redeem`), this queue's.
    pub used: u64,
    /// Purchases with a pass or offer marked bought so far
    /// (`room_bought`), this queue's.
    pub taken: u64,
}

impl RoomView {
    /// The place admission goes on from: `serving`, or `offering` once
    /// sold out.
    pub fn next_place(&self) -> u64 {
        if self.sold_out {
            self.offering
        } else {
            self.serving
        }
    }
}

impl TryFrom<Vec<String>> for RoomView {
    type Error = redis::RedisError;

    fn try_from(f: Vec<String>) -> RedisResult<Self> {
        let bad = || {
            redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "room status reply"))
        };
        if f.len() != 14 {
            return Err(bad());
        }
        let int = |i: usize| f[i].parse::<i64>().map_err(|_| bad());
        let count = |i: usize| f[i].parse::<u64>().map_err(|_| bad());
        Ok(Self {
            epoch: int(0)?,
            closed: f[1] == "1",
            entrants: count(2)?,
            seq: count(3)?,
            serving: count(4)?,
            sold_out: f[5] == "1",
            admit_per_sec: int(6)?,
            ticket: count(7)?,
            state: f[8].clone(),
            commitment: f[9].clone(),
            seed: f[10].clone(),
            offering: count(11)?,
            used: count(12)?,
            taken: count(13)?,
        })
    }
}

/// What one admission round may take, as adaptive admission sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// The share of the room's rate, in thousandths (1000: all of it).
    pub share_permille: u32,
    /// How many more orders the pipeline may have in flight, before the
    /// passes given out in the last `fresh_ms` and not used yet are
    /// counted; `None`: no limit.
    pub window: Option<u64>,
    pub fresh_ms: i64,
}

impl Pacing {
    /// The room's own rate, no window.
    pub const FULL: Self = Self {
        share_permille: 1000,
        window: None,
        fresh_ms: 0,
    };
}

/// An admission round's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Round {
    /// No room in Redis.
    NoRoom,
    /// The sale is over.
    Over,
    /// Another admitter moved first: the next place now.
    Stale(u64),
    /// The sale has not started.
    NotStarted,
    /// Admitted (or offered, once sold out) these tickets.
    Admitted(Admitted),
}

/// What one admission round did and saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The next place (`serving`, or `offering` once sold out).
    pub place: u64,
    pub sold_out: bool,
    pub seq: u64,
    pub passes_outstanding: u64,
    pub offers_open: u64,
    /// Offers that ran out unused in this round.
    pub offers_lapsed: u64,
    /// Orders the pipeline may still take in flight after this round
    /// (adaptive admission's window); `None`: no limit.
    pub window_left: Option<u64>,
    pub tickets: Vec<u64>,
}

impl TryFrom<Vec<i64>> for Round {
    type Error = redis::RedisError;

    fn try_from(r: Vec<i64>) -> RedisResult<Self> {
        let bad = || {
            redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "room admit reply"))
        };
        let at = |i: usize| r.get(i).map(|&v| v.max(0) as u64).ok_or_else(bad);
        Ok(match r.first().copied() {
            Some(-1) => Round::NoRoom,
            Some(-2) => Round::Over,
            Some(-3) => Round::Stale(at(1)?),
            Some(0) => Round::NotStarted,
            Some(1) if r.len() >= 8 => Round::Admitted(Admitted {
                place: at(1)?,
                sold_out: r[2] == 1,
                seq: at(3)?,
                passes_outstanding: at(4)?,
                offers_open: at(5)?,
                offers_lapsed: at(6)?,
                window_left: (r[7] >= 0).then_some(r[7] as u64),
                tickets: r[8..].iter().map(|&t| t.max(0) as u64).collect(),
            }),
            _ => return Err(bad()),
        })
    }
}

/// A redemption's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redeemed {
    /// Used now.
    Used,
    /// No room in Redis.
    NoRoom,
    /// The pass is of a queue Redis lost since.
    OldEpoch,
    /// Expired (on the sale clock).
    Expired,
    /// Sold out: an admitted pass no longer buys.
    SoldOut,
    /// Used before.
    Reused,
    /// Not the ticket's pass (another user's ticket, left, expired).
    NotHeld,
}

impl From<i64> for Redeemed {
    fn from(code: i64) -> Self {
        match code {
            1 => Redeemed::Used,
            -1 => Redeemed::NoRoom,
            -2 => Redeemed::OldEpoch,
            -4 => Redeemed::Expired,
            -5 => Redeemed::SoldOut,
            -6 => Redeemed::Reused,
            _ => Redeemed::NotHeld,
        }
    }
}

/// A room's figures for the operator (`GET …/stats`).
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct RoomFigures {
    /// The queue (a new one starts when Redis loses it).
    pub epoch: i64,
    /// Tickets taken.
    pub tickets: u64,
    /// Tickets not yet reached (admitted, or offered once sold out).
    pub waiting: u64,
    /// Passes and offers given out so far, in this queue.
    pub admitted: u64,
    /// Passes and offers given out and not yet used or expired.
    pub passes_outstanding: u64,
    /// Offers of released units held now.
    pub offers_open: u64,
    /// Sold out: released units go to the waitlist.
    pub sold_out: bool,
    /// The admission rate and cap in force (0: no cap).
    pub admit_per_sec: i64,
    pub max_active: i64,
    /// The rate admitting now: below `admit_per_sec` while the order
    /// pipeline is behind (adaptive admission), as the last round set it.
    pub admit_per_sec_now: i64,
    /// Adaptive admission's window after the last round: how many more
    /// passes the order pipeline could take in flight (three quarters of
    /// `admission.max_consumer_lag`, less the lag, the passes used lately
    /// and those given out lately and not used). Absent without a limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admit_window_now: Option<i64>,
    /// The queueing method (`fifo`, `passthrough`, `reject`), from the
    /// room's row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<&'static str>,
}

impl RedisGate {
    /// The room's figures, `None` without a room in Redis.
    pub async fn room_figures(&self, activity: ActivityId) -> RedisResult<Option<RoomFigures>> {
        let k = self.keys(activity);
        type Fields = (Vec<Option<i64>>, u64, u64);
        let (f, active, offers): Fields = redis::pipe()
            .cmd("HMGET")
            .arg(k.room())
            .arg(&[
                "epoch",
                "seq",
                "serving",
                "offering",
                "admitted",
                "sold",
                "rate",
                "max_active",
                "rate_now",
                "window_now",
            ])
            .cmd("ZCARD")
            .arg(k.room_active())
            .cmd("ZCARD")
            .arg(k.room_offers())
            .query_async(&mut self.conn())
            .await?;
        let at = |i: usize| f.get(i).copied().flatten();
        let Some(epoch) = at(0) else {
            return Ok(None);
        };
        let count = |i: usize| at(i).unwrap_or(0).max(0) as u64;
        let sold_out = at(5) == Some(1);
        let next = if sold_out { count(3) } else { count(2) };
        Ok(Some(RoomFigures {
            epoch,
            tickets: count(1),
            waiting: count(1).saturating_sub(next),
            admitted: count(4),
            passes_outstanding: active,
            offers_open: offers,
            sold_out,
            admit_per_sec: at(6).unwrap_or(0),
            max_active: at(7).unwrap_or(0),
            admit_per_sec_now: at(8).or(at(6)).unwrap_or(0),
            admit_window_now: at(9).filter(|&w| w >= 0),
            method: None,
        }))
    }
}

/// The room's scripts over the gate's connection.
#[derive(Clone)]
pub struct RoomGate {
    gate: RedisGate,
    open: Script,
    join: Script,
    status: Script,
    admit: Script,
    redeem: Script,
    leave: Script,
    bought: Script,
    seal: Script,
}

impl RoomGate {
    /// The scripts over `gate`'s connection and keys.
    pub fn new(gate: &RedisGate) -> Self {
        Self {
            gate: gate.clone(),
            open: Script::new(include_str!("../lua/room_open.lua")),
            join: with_close!("room_join.lua"),
            status: Script::new(include_str!("../lua/room_status.lua")),
            admit: with_close!("room_admit.lua"),
            redeem: Script::new(include_str!("../lua/room_redeem.lua")),
            leave: Script::new(include_str!("../lua/room_leave.lua")),
            bought: Script::new(include_str!("../lua/room_bought.lua")),
            seal: Script::new(include_str!("../lua/room_seal.lua")),
        }
    }

    fn keys(&self, activity: ActivityId) -> ActivityKeys {
        self.gate.keys(activity)
    }

    /// Opens the room unless it exists; the epoch Redis holds.
    pub async fn open(&self, activity: ActivityId, spec: &RoomSpec) -> RedisResult<(bool, i64)> {
        let k = self.keys(activity);
        let (code, epoch): (i64, i64) = self
            .open
            .key(k.room())
            .key(k.room_users())
            .key(k.room_entrants())
            .key(k.room_states())
            .key(k.room_active())
            .key(k.room_offers())
            .arg(spec.epoch)
            .arg(spec.open_ms)
            .arg(spec.start_ms)
            .arg(spec.end_ms)
            .arg(spec.admit_per_sec)
            .arg(spec.max_active)
            .arg(spec.pass_ms)
            .arg(spec.offer_ms)
            .arg(&spec.seed)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok((code == 0, epoch))
    }

    /// Takes `user`'s ticket with the answer to `challenge`, accepted until
    /// `answer_ttl_ms` from now.
    pub async fn join(
        &self,
        activity: ActivityId,
        user: UserId,
        challenge: &str,
        answer_ttl_ms: i64,
        now_ms: i64,
    ) -> RedisResult<Joined> {
        let k = self.keys(activity);
        let (code, ticket): (i64, i64) = self
            .join
            .key(k.room())
            .key(k.room_users())
            .key(k.room_states())
            .key(k.room_pow(challenge))
            .key(k.room_joins(now_ms.div_euclid(1000)))
            .key(k.room_entrants())
            .arg(user.get())
            .arg(now_ms)
            .arg(answer_ttl_ms.max(1))
            .invoke_async(&mut self.gate.conn())
            .await?;
        let ticket = ticket.max(0) as u64;
        Ok(match code {
            0 => Joined::New(ticket),
            1 => Joined::Again(ticket),
            -2 => Joined::NotOpen,
            -3 => Joined::Replayed,
            _ => Joined::NoRoom,
        })
    }

    /// The room and `user`'s ticket; `None` when there is no room.
    pub async fn status(
        &self,
        activity: ActivityId,
        user: UserId,
    ) -> RedisResult<Option<RoomView>> {
        self.read(activity, user.get()).await
    }

    /// The room alone, for the admitter and the draw (user 0 holds no
    /// ticket: the same read, ticket 0).
    pub async fn head(&self, activity: ActivityId) -> RedisResult<Option<RoomView>> {
        self.read(activity, 0).await
    }

    async fn read(&self, activity: ActivityId, user: i64) -> RedisResult<Option<RoomView>> {
        let k = self.keys(activity);
        let fields: Vec<String> = self
            .status
            .key(k.room())
            .key(k.room_users())
            .key(k.room_states())
            .arg(user)
            .invoke_async(&mut self.gate.conn())
            .await?;
        if fields.is_empty() {
            return Ok(None);
        }
        RoomView::try_from(fields).map(Some)
    }

    /// One admission round from `view`, the room as read ([`Self::head`])
    /// before `available`, the units for sale, was: `candidates` are the
    /// tickets at places `view.next_place()`, the next one, …; `pace` what
    /// the order pipeline takes now.
    pub async fn admit(
        &self,
        activity: ActivityId,
        now_ms: i64,
        view: &RoomView,
        available: i64,
        pace: Pacing,
        candidates: &[u64],
    ) -> RedisResult<Round> {
        let k = self.keys(activity);
        let mut call = self.admit.prepare_invoke();
        call.key(k.room())
            .key(k.room_states())
            .key(k.room_active())
            .key(k.room_offers())
            .arg(now_ms)
            .arg(view.next_place())
            .arg(available)
            .arg(pace.share_permille)
            .arg(
                pace.window
                    .map_or(-1, |w| i64::try_from(w).unwrap_or(i64::MAX)),
            )
            .arg(pace.fresh_ms)
            .arg(view.taken);
        for &t in candidates {
            call.arg(t);
        }
        let reply: Vec<i64> = call.invoke_async(&mut self.gate.conn()).await?;
        Round::try_from(reply)
    }

    /// Uses the pass of `ticket` (`kind` `A` or `O`, expiring at
    /// `expires_ms`) for `user`.
    #[allow(clippy::too_many_arguments)]
    pub async fn redeem(
        &self,
        activity: ActivityId,
        ticket: u64,
        user: UserId,
        epoch: i64,
        kind: &str,
        expires_ms: i64,
        now_ms: i64,
    ) -> RedisResult<Redeemed> {
        let k = self.keys(activity);
        let code: i64 = self
            .redeem
            .key(k.room())
            .key(k.room_users())
            .key(k.room_states())
            .key(k.room_active())
            .arg(ticket)
            .arg(user.get())
            .arg(epoch)
            .arg(kind)
            .arg(expires_ms)
            .arg(now_ms)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok(Redeemed::from(code))
    }

    /// `user` leaves; the ticket left (`Some(0)`: none held), `None` with
    /// no room.
    pub async fn leave(&self, activity: ActivityId, user: UserId) -> RedisResult<Option<u64>> {
        let code = self.on_ticket(&self.leave, activity, user).await?;
        Ok((code >= 0).then_some(code as u64))
    }

    /// `user`'s purchase with their ticket's pass or offer was accepted:
    /// the ticket bought (`room_bought.lua`). True when marked now.
    pub async fn bought(&self, activity: ActivityId, user: UserId) -> RedisResult<bool> {
        Ok(self.on_ticket(&self.bought, activity, user).await? == 1)
    }

    /// A script on `user`'s ticket over the room, its users, states,
    /// active passes and offers (`room_leave.lua`, `room_bought.lua`).
    async fn on_ticket(
        &self,
        script: &Script,
        activity: ActivityId,
        user: UserId,
    ) -> RedisResult<i64> {
        let k = self.keys(activity);
        script
            .key(k.room())
            .key(k.room_users())
            .key(k.room_states())
            .key(k.room_active())
            .key(k.room_offers())
            .arg(user.get())
            .invoke_async(&mut self.gate.conn())
            .await
    }

    /// The users who took the pre-queue tickets, in ticket order (the
    /// first `entrants` of the list), read in slices so that no one call
    /// holds Redis for long. Fewer than asked for when the list was lost.
    pub async fn entrants(&self, activity: ActivityId, entrants: u64) -> RedisResult<Vec<i64>> {
        const SLICE: u64 = 20_000;
        let key = self.keys(activity).room_entrants();
        let mut users = Vec::with_capacity(entrants.min(10_000_000) as usize);
        let mut conn = self.gate.conn();
        while (users.len() as u64) < entrants {
            let from = users.len() as u64;
            let to = (from + SLICE).min(entrants) - 1;
            let slice: Vec<i64> = redis::cmd("LRANGE")
                .arg(&key)
                .arg(from)
                .arg(to)
                .query_async(&mut conn)
                .await?;
            if slice.is_empty() {
                break;
            }
            users.extend(slice);
        }
        Ok(users)
    }

    /// Writes `root` as the commitment of queue `epoch` unless one is
    /// there: the room's commitment (`None`: the room is gone, of another
    /// epoch, or not closed).
    pub async fn seal(
        &self,
        activity: ActivityId,
        epoch: i64,
        root: &str,
    ) -> RedisResult<Option<String>> {
        let stored: String = self
            .seal
            .key(self.keys(activity).room())
            .arg(epoch)
            .arg(root)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok((!stored.is_empty()).then_some(stored))
    }

    /// Joins counted in `second` and the one before it (unix seconds): the
    /// larger, as the join rate.
    pub async fn join_rate(&self, activity: ActivityId, second: i64) -> RedisResult<u64> {
        let k = self.keys(activity);
        let counts: Vec<Option<u64>> = redis::cmd("MGET")
            .arg(k.room_joins(second))
            .arg(k.room_joins(second - 1))
            .query_async(&mut self.gate.conn())
            .await?;
        Ok(counts.into_iter().flatten().max().unwrap_or(0))
    }

    /// Sets the admission rate and cap, if the room is in Redis.
    pub async fn set_rate(
        &self,
        activity: ActivityId,
        admit_per_sec: i64,
        max_active: i64,
    ) -> RedisResult<bool> {
        let script = Script::new(
            "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end \
             redis.call('HSET', KEYS[1], 'rate', ARGV[1], 'max_active', ARGV[2]) return 1",
        );
        let n: i64 = script
            .key(self.keys(activity).room())
            .arg(admit_per_sec)
            .arg(max_active)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok(n == 1)
    }

    /// Moves the room's end to `now_ms` if it was later (the sale ended).
    pub async fn end(&self, activity: ActivityId, now_ms: i64) -> RedisResult<()> {
        let script = Script::new(
            "local e = redis.call('HGET', KEYS[1], 'end_ms') \
             if e and tonumber(e) > tonumber(ARGV[1]) then \
               redis.call('HSET', KEYS[1], 'end_ms', ARGV[1]) end return 1",
        );
        let _: Value = script
            .key(self.keys(activity).room())
            .arg(now_ms)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok(())
    }
}

//! The admitter: on every instance, every `waiting_room.admit_interval_ms`,
//! one admission round per live room (`room_admit.lua`). The round's
//! bucket and the place being served are in Redis, so any number of
//! instances admit together at the room's rate and never admit a ticket
//! twice; an instance that read a stale place is told so and tries again
//! next round.
//!
//! It also opens each room's queue in Redis, and starts a new one (the
//! next epoch) when Redis has lost it: an instance that finds the queue
//! gone for longer than [`LOSS_GRACE`] after it was first opened.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

use super::draw;
use super::repo::{self, LiveRoom};
use super::{RoomError, Rooms};
use crate::activities::layout;
use crate::admission::RedisGate;
use crate::admission::gate::room::{Admitted, RoomView, Round};
use crate::clock::SharedClock;
use crate::domain::ActivityId;
use crate::store;
use crate::worker::WorkerHandle;

/// How often the list of live rooms is read from the database.
const LIST_EVERY: Duration = Duration::from_secs(1);

/// How long a room's queue must be missing from Redis before it is taken
/// for lost (rather than not yet opened by another instance).
pub const LOSS_GRACE: Duration = Duration::from_secs(1);

/// The most tickets one round looks at.
const MAX_CANDIDATES: u64 = 2_000;

/// The share of a room's rate admitted while the order consumers are
/// `lag` messages behind, with purchases refused at `bound` (0: no bound),
/// in thousandths: all of it up to half the bound, then less in
/// proportion, none from the bound on (purchases would get 503 BUSY
/// there), and none while the broker refuses deliveries.
pub fn share_permille(lag: i64, bound: i64, broker_refuses: bool) -> u32 {
    if broker_refuses {
        return 0;
    }
    if bound <= 0 || lag <= bound / 2 {
        return 1000;
    }
    if lag >= bound {
        return 0;
    }
    let half = bound - bound / 2;
    u32::try_from((bound - lag) * 1000 / half.max(1)).unwrap_or(1000)
}

/// What adaptive admission reads: the order consumers' lag as this
/// instance samples it, the bound purchases are refused at, and the
/// broker's breaker.
pub struct Pace {
    pub lag: IntGauge,
    /// `admission.max_consumer_lag`; 0 leaves the rate alone.
    pub bound: i64,
    pub breaker: Option<Arc<crate::admission::publish::Publisher>>,
}

impl Pace {
    /// Rooms admit at their own rate, whatever the pipeline does.
    pub fn fixed() -> Self {
        Self {
            lag: IntGauge::new("unused", "unused").expect("a valid gauge"),
            bound: 0,
            breaker: None,
        }
    }

    fn share(&self) -> u32 {
        let refuses = self.breaker.as_ref().is_some_and(|p| p.breaker.is_open());
        share_permille(self.lag.get(), self.bound, refuses)
    }
}

/// Starts the admitter.
pub fn spawn(
    rooms: Arc<Rooms>,
    gate: Arc<RedisGate>,
    clock: SharedClock,
    interval: Duration,
    pace: Pace,
) -> WorkerHandle {
    WorkerHandle::spawn(move |shutdown| run(rooms, gate, clock, interval, pace, shutdown))
}

struct Admitter {
    rooms: Arc<Rooms>,
    gate: Arc<RedisGate>,
    clock: SharedClock,
    interval: Duration,
    pace: Pace,
    /// When each room was first found missing from Redis.
    missing_since: HashMap<ActivityId, Instant>,
}

async fn run(
    rooms: Arc<Rooms>,
    gate: Arc<RedisGate>,
    clock: SharedClock,
    interval: Duration,
    pace: Pace,
    shutdown: CancellationToken,
) {
    let mut admitter = Admitter {
        rooms,
        gate,
        clock,
        interval,
        pace,
        missing_since: HashMap::new(),
    };
    let mut live: Vec<LiveRoom> = Vec::new();
    let mut listed: Option<Instant> = None;
    let mut last_warning: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        if listed.is_none_or(|at| at.elapsed() >= LIST_EVERY) {
            let now = admitter.clock.now();
            match store::run(admitter.rooms.db(), move |conn| Ok(repo::live(conn, now)?)).await {
                Ok(rooms) => {
                    live = rooms;
                    listed = Some(Instant::now());
                }
                Err(e) => warn_now_and_then(&mut last_warning, &e),
            }
        }
        for room in &live {
            if let Err(e) = admitter.round(room).await {
                warn_now_and_then(&mut last_warning, &e);
            }
        }
    }
}

/// Logs `e` at most every ten seconds (Redis down fails every round).
fn warn_now_and_then(last: &mut Option<Instant>, e: &anyhow::Error) {
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
        tracing::warn!(error = %e, "waiting room admission round failed");
        *last = Some(Instant::now());
    }
}

impl Admitter {
    /// One round for one room.
    async fn round(&mut self, live: &LiveRoom) -> anyhow::Result<()> {
        let id = live.room.activity_id;
        let Some(view) = self.rooms.gate().head(id).await? else {
            return self.reopen(id).await;
        };
        self.missing_since.remove(&id);
        let now_ms = self.clock.now_ms();
        let queue_len = view.seq.saturating_sub(view.serving);
        let label = id.to_string();
        let metrics = self.rooms.metrics();
        metrics
            .room_queue_length
            .with_label_values(&[&label])
            .set(i64::try_from(queue_len).unwrap_or(i64::MAX));
        if !live.warmed || now_ms < live.start_at.timestamp_millis() {
            return Ok(());
        }
        // Closed by the operator: no one is admitted until it reopens.
        if live.room.method() == super::Method::Reject {
            return Ok(());
        }
        // Redis lost the activity's stock with the queue: no units to count
        // (zero would read as sold out) until reconciliation restores them.
        if !self.gate.is_warm(id).await? {
            return Ok(());
        }
        let layout = layout(live.buckets, live.shards);
        let available = self.gate.available(id, layout).await?;
        // Until the draw is fixed its order is unknown: the first round
        // after the start only closes the pre-queue.
        let candidates = if view.closed {
            self.candidates(id, &view).await?
        } else {
            Vec::new()
        };
        let round = self
            .rooms
            .gate()
            .admit(
                id,
                now_ms,
                view.next_place(),
                available,
                self.pace.share(),
                &candidates,
            )
            .await?;
        if let Round::Admitted(a) = round {
            self.record(&label, &a);
        }
        Ok(())
    }

    /// The tickets at the places from the next one on, as many as about
    /// two rounds admit.
    async fn candidates(&self, id: ActivityId, view: &RoomView) -> anyhow::Result<Vec<u64>> {
        let sealed = self.rooms.sealed(id, view).await.map_err(|e| match e {
            RoomError::Unavailable(e) => e,
            other => anyhow::anyhow!("room {id}: the draw is not built: {other:?}"),
        })?;
        let draw = sealed.as_deref().map(|s| &s.draw);
        let per_round = (view.admit_per_sec.max(1) as u64)
            .saturating_mul(self.interval.as_millis() as u64)
            / 1000;
        let want = (per_round * 2 + 8).min(MAX_CANDIDATES);
        let from = view.next_place();
        let end = view.seq.min(from + want);
        Ok((from..end)
            .map(|place| draw::ticket_at(draw, place))
            .collect())
    }

    fn record(&self, label: &str, a: &Admitted) {
        let m = self.rooms.metrics();
        let n = a.tickets.len() as u64;
        let kind = if a.sold_out { "offer" } else { "pass" };
        m.room_admitted.with_label_values(&[kind]).inc_by(n);
        if a.sold_out {
            m.room_offers.with_label_values(&["made"]).inc_by(n);
        }
        m.room_offers
            .with_label_values(&["expired"])
            .inc_by(a.offers_lapsed);
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        m.room_queue_length
            .with_label_values(&[label])
            .set(gauge(a.seq.saturating_sub(a.place)));
        m.room_passes_outstanding
            .with_label_values(&[label])
            .set(gauge(a.passes_outstanding));
        m.room_offers_open
            .with_label_values(&[label])
            .set(gauge(a.offers_open));
    }

    /// The room's queue is not in Redis: open its first one, or, once it
    /// has been missing for [`LOSS_GRACE`] after that, start the next
    /// epoch (every ticket and pass of the lost one is void).
    async fn reopen(&mut self, id: ActivityId) -> anyhow::Result<()> {
        let db = self.rooms.db();
        let Some(fresh) = store::run(db, move |conn| Ok(repo::find_live(conn, id)?)).await? else {
            return Ok(());
        };
        if !fresh.opened {
            return self.rooms.open_first(id).await;
        }
        let since = *self.missing_since.entry(id).or_insert_with(Instant::now);
        if since.elapsed() < LOSS_GRACE {
            return Ok(());
        }
        let seen = fresh.room.epoch;
        let epoch = match store::run(db, move |conn| Ok(repo::next_epoch(conn, id, seen)?)).await? {
            Some(next) => {
                tracing::warn!(
                    activity_id = %id,
                    epoch = next,
                    "Redis lost the waiting room's queue: a new one starts; its tickets and passes are void"
                );
                next
            }
            // Another instance started it; open it in case it did not.
            None => store::run(db, move |conn| Ok(repo::find(conn, id)?))
                .await?
                .map_or(seen, |row| row.epoch),
        };
        self.rooms.open(&fresh, epoch).await?;
        self.rooms.forget(id);
        self.missing_since.remove(&id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_falls_from_half_the_lag_bound_to_none_at_it() {
        assert_eq!(
            share_permille(0, 0, false),
            1000,
            "no bound: the room's rate"
        );
        assert_eq!(share_permille(1_000_000, 0, false), 1000);
        assert_eq!(share_permille(0, 10_000, false), 1000);
        assert_eq!(share_permille(5_000, 10_000, false), 1000);
        assert_eq!(share_permille(7_500, 10_000, false), 500);
        assert_eq!(share_permille(9_000, 10_000, false), 200);
        assert_eq!(share_permille(10_000, 10_000, false), 0);
        assert_eq!(share_permille(50_000, 10_000, false), 0);
        assert_eq!(share_permille(0, 10_000, true), 0, "the broker refuses");
        assert_eq!(
            share_permille(3, 5, false),
            666,
            "odd bounds: 2 of the 3 steps left"
        );
    }
}

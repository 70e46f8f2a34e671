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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

use super::draw;
use super::repo::{self, LiveRoom};
use super::{RoomError, Rooms};
use crate::activities::layout;
use crate::admission::RedisGate;
use crate::admission::gate::room::{Admitted, Pacing, RoomView, Round};
use crate::bus::progress::GroupProgress;
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

/// How long after a pass is used its order may still be missing from a lag
/// sample started since: the purchase, its reservation and its publish.
pub const PUBLISH_ALLOWANCE: Duration = Duration::from_millis(500);

/// How many orders the pipeline may have in flight beyond `lag` and the
/// `unseen` ones (passes used lately, whose orders the lag may not show
/// yet): three quarters of `bound` (0: no window), so that the holders of
/// the passes a round gives out cannot buy the lag past the bound where
/// purchases get 503 BUSY.
pub fn window(lag: i64, bound: i64, unseen: u64) -> Option<u64> {
    if bound <= 0 {
        return None;
    }
    let room = bound - bound / 4 - lag.max(0) - i64::try_from(unseen).unwrap_or(i64::MAX);
    Some(u64::try_from(room).unwrap_or(0))
}

/// What adaptive admission reads: the order consumers' lag as this
/// instance samples it and when that sample started, the bound purchases
/// are refused at, and the broker's breaker.
pub struct Pace {
    pub lag: IntGauge,
    /// `admission.max_consumer_lag`; 0 leaves the rate alone.
    pub bound: i64,
    pub breaker: Option<Arc<crate::admission::publish::Publisher>>,
    /// Where the lag's sample time is read; `None`: no window.
    pub progress: Option<Arc<GroupProgress>>,
    /// How long after it is given out an unused pass counts as an order
    /// to come (`waiting_room.fresh_pass_ms`): its holder may not have
    /// seen it yet. Older ones mostly never buy.
    pub fresh: Duration,
}

impl Pace {
    /// Rooms admit at their own rate, whatever the pipeline does.
    pub fn fixed() -> Self {
        Self {
            lag: IntGauge::new("unused", "unused").expect("a valid gauge"),
            bound: 0,
            breaker: None,
            progress: None,
            fresh: Duration::ZERO,
        }
    }

    fn share(&self) -> u32 {
        let refuses = self.breaker.as_ref().is_some_and(|p| p.breaker.is_open());
        share_permille(self.lag.get(), self.bound, refuses)
    }

    /// This round's pacing, with `used` the passes the room has seen used
    /// (what `uses` recorded of it, oldest first).
    fn pacing(&self, uses: &Uses) -> Pacing {
        // Blind (no sample answered yet, or the last ones failed: a topic
        // just made has partitions without a leader for seconds on a
        // loaded host), the window still holds: the last lag read stands
        // (none before the first), and every pass used since that sample
        // counts as in flight, as far back as the counts are kept. A
        // room at its full rate meanwhile gave out 355 passes where the
        // pipeline could take 30.
        let window = self.progress.as_ref().and_then(|p| {
            let (lag, unseen) = match p.last_sample() {
                Some((at, lag)) => (
                    lag,
                    at.checked_sub(PUBLISH_ALLOWANCE)
                        .map_or_else(|| uses.all(), |since| uses.since(since)),
                ),
                None => (0, uses.all()),
            };
            window(lag, self.bound, unseen)
        });
        Pacing {
            share_permille: self.share(),
            window,
            fresh_ms: i64::try_from(self.fresh.as_millis()).unwrap_or(i64::MAX),
        }
    }
}

/// A room's count of used passes as the admitter read it round by round:
/// how many were used after a moment.
#[derive(Default)]
struct Uses {
    seen: VecDeque<(Instant, u64)>,
}

/// How long the counts are kept: far longer than any lag sample is old.
const USES_KEPT: Duration = Duration::from_secs(30);

impl Uses {
    fn record(&mut self, at: Instant, used: u64) {
        // A new queue counts from 0 again.
        if self.seen.back().is_some_and(|&(_, last)| used < last) {
            self.seen.clear();
        }
        self.seen.push_back((at, used));
        while self.seen.len() > 1 && at.duration_since(self.seen[0].0) > USES_KEPT {
            self.seen.pop_front();
        }
    }

    /// Passes used since the oldest count kept.
    fn all(&self) -> u64 {
        match (self.seen.front(), self.seen.back()) {
            (Some(&(_, oldest)), Some(&(_, newest))) => newest.saturating_sub(oldest),
            _ => 0,
        }
    }

    /// Passes used since `since` as far as the counts tell: from the last
    /// count read at or before it (or the oldest kept) to the newest.
    fn since(&self, since: Instant) -> u64 {
        let Some(&(_, newest)) = self.seen.back() else {
            return 0;
        };
        let base = self
            .seen
            .iter()
            .rev()
            .find(|&&(at, _)| at <= since)
            .or(self.seen.front())
            .map_or(newest, |&(_, used)| used);
        newest.saturating_sub(base)
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
    /// Each room's used passes, as read round by round.
    uses: HashMap<ActivityId, Uses>,
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
        uses: HashMap::new(),
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
                    admitter
                        .uses
                        .retain(|id, _| live.iter().any(|r| r.room.activity_id == *id));
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
        let uses = self.uses.entry(id).or_default();
        uses.record(Instant::now(), view.used);
        let pacing = self.pace.pacing(uses);
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
        // Redis lost the activity's stock (with the queue, or one shard of
        // it, whose other shards reconciliation then drops): no units to
        // count (zero would read as sold out, for good) until
        // reconciliation restores them. Each shard's meta is read with
        // its buckets: a shard dropped between two reads is not 0 units.
        if !self.gate.is_warm(id).await? {
            return Ok(());
        }
        let layout = layout(live.buckets, live.shards);
        let Some(available) = self.gate.available_if_warm(id, layout).await? else {
            return Ok(());
        };
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
            .admit(id, now_ms, &view, available, pacing, &candidates)
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

    #[test]
    fn the_window_is_three_quarters_of_the_bound_less_what_is_in_flight() {
        assert_eq!(window(0, 0, 0), None, "no bound: no window");
        assert_eq!(window(-1, 300, 0), Some(225), "no lag below none");
        assert_eq!(window(0, 300, 0), Some(225));
        assert_eq!(window(100, 300, 25), Some(100));
        assert_eq!(window(200, 300, 25), Some(0));
        assert_eq!(window(400, 300, 0), Some(0), "never below none");
        assert_eq!(window(0, 300, u64::MAX), Some(0));
    }

    #[test]
    fn passes_used_since_a_moment_count_from_the_last_reading_before_it() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut uses = Uses::default();
        assert_eq!(uses.since(at(0)), 0, "nothing read yet");
        uses.record(at(0), 10);
        uses.record(at(100), 30);
        uses.record(at(200), 70);
        assert_eq!(uses.since(at(150)), 40, "from the reading at 100");
        assert_eq!(uses.since(at(100)), 40);
        assert_eq!(uses.since(at(250)), 0);
        assert_eq!(
            uses.since(t0 - Duration::from_secs(1)),
            60,
            "the oldest kept"
        );
        // A new queue counts from 0 again.
        uses.record(at(300), 5);
        assert_eq!(uses.since(at(0)), 0);
        uses.record(at(400), 9);
        assert_eq!(uses.since(at(350)), 4);
        assert_eq!(uses.all(), 4, "since the oldest kept");
        // Readings older than USES_KEPT go, but one is always kept.
        uses.record(at(400) + USES_KEPT + Duration::from_secs(1), 12);
        assert_eq!(uses.seen.len(), 1);
    }

    /// No lag sample has answered yet: the window holds as if the pipeline
    /// were empty, with every pass used meanwhile in flight.
    #[test]
    fn a_blind_admitter_still_holds_the_window() {
        let settings = crate::config::Settings::load_env("test").expect("test settings");
        let progress = GroupProgress::new(&settings.kafka, "blind", "nowhere").expect("a client");
        let pace = Pace {
            lag: IntGauge::new("lag", "lag").expect("a gauge"),
            bound: 300,
            breaker: None,
            progress: Some(Arc::new(progress)),
            fresh: Duration::from_secs(5),
        };
        pace.lag.set(crate::bus::progress::UNKNOWN_LAG);
        let mut uses = Uses::default();
        let t0 = Instant::now();
        uses.record(t0, 0);
        uses.record(t0 + Duration::from_millis(100), 25);
        let pacing = pace.pacing(&uses);
        assert_eq!(pacing.window, Some(200), "225 less the 25 used");
        assert_eq!(pacing.share_permille, 1000);
    }
}

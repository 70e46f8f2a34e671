//! The sold-out fast path. In a flash sale most purchases arrive after the
//! stock is gone; once Redis has answered SOLD_OUT for an activity, this
//! instance answers the next ones from memory, without a Redis call, until
//! a release of that activity's stock clears the flag (every instance hears
//! it: `release.lua`, `repair.lua` and the restore publish on
//! [`channel`] in the same call that adds the units) or the flag's lifetime
//! (`admission.sold_out_ttl_ms`, 200 ms) ends, the safety net for a missed
//! message. The flag only ever refuses, so it cannot oversell.
//!
//! A flag in use does not lapse: while it refuses purchases, a task reads
//! the activity's units every half lifetime and, while they are 0, sets it
//! again ([`SoldOut::keep_fresh`]). Without it, every lapse sent every
//! purchase to Redis until one was answered SOLD_OUT and the flag was set
//! again; under load that answer took longest, and thousands of purchases
//! piled up behind it (docs/BENCHMARKS-HISTORY.md,
//! "The first second of a sale").
//!
//! It must not change what a buyer who already has an order hears: a
//! replayed request_id gets its order (200), and a buyer at the limit
//! LIMIT_EXCEEDED, from Redis. So the flag carries the users that have any
//! request accepted in the activity (the Redis request-id hash, read when
//! the flag is set, and read again only when the activity's count of
//! acceptances moved); their purchases still go to Redis.
//!
//! That list can be late by one release: stock comes back, another
//! instance accepts a buyer for it, and the buyer's retry reaches this
//! instance before the release's message does. So a refusal stands only
//! once a read of the acceptance count *sent after the purchase arrived*
//! finds the count the list was read at ([`SoldOut::confirm`]): equal, no
//! buyer was accepted since, because the count only grows (`reserve.lua`);
//! moved, the purchase goes to Redis, whose script answers a replay first.
//! The refusals waiting at one moment share one read ([`Recount`]), so a
//! sale's thousands of refusals a second cost Redis a read per round trip,
//! not one each (it was an HGET of the buyer's request id per refusal).
//! Reads start at most once per [`RECOUNT_SPACING`]: back to back, a read
//! every loopback round trip confirmed two or three refusals each, and
//! the reads and their wake-ups were a quarter of the server's CPU per
//! refusal (BENCHMARKS.md, row 5 against row 2).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntGauge};

use super::{Layout, RedisGate};
use crate::domain::ActivityId;

/// The least time between the starts of two reads of one activity's
/// acceptance count ([`Recount`]). A refusal waits for a read started
/// after it arrived, so at most this much longer than a round trip; in
/// exchange, at a sale's tens of thousands of refusals a second, one read
/// confirms tens of them, not two or three.
pub const RECOUNT_SPACING: Duration = Duration::from_millis(1);

/// One activity's flag.
struct Flag {
    /// When Redis last said SOLD_OUT (`None`: cleared, users kept).
    since: Option<Instant>,
    /// Users with a request accepted in the activity.
    buyers: Arc<HashSet<i64>>,
    /// The activity's acceptance count `buyers` was read at.
    generation: i64,
    /// When stock last came back (a release heard).
    cleared_at: Option<Instant>,
    /// A purchase was refused by the flag since its last refresh.
    used: AtomicBool,
    /// The reads of the acceptance count its refusals wait on (kept when
    /// the flag is set again).
    recount: Arc<Recount>,
}

/// A refusal from the flag, until a read of the acceptance count confirms
/// it ([`SoldOut::confirm`]).
#[must_use = "a refusal stands only once confirmed"]
pub struct Refused {
    /// The acceptance count the flag's buyers were read at.
    generation: i64,
    /// Reads started when the purchase was checked: only a later one
    /// confirms it.
    arrival: u64,
    recount: Arc<Recount>,
}

/// One activity's reads of its acceptance count, shared by the refusals
/// waiting at the moment: at most one read at a time, the next one started
/// by the first refusal that needs it.
#[derive(Default)]
pub struct Recount {
    /// Reads started (each is numbered by this count, from 1).
    started: AtomicU64,
    /// A read is under way.
    reading: AtomicBool,
    /// The number of the last read done, and the count it found (`None`:
    /// Redis failed).
    done: tokio::sync::watch::Sender<(u64, Option<i64>)>,
    /// When the last read started.
    last_start: std::sync::Mutex<Option<Instant>>,
}

impl Recount {
    /// Whether a read started after read number `arrival` finds
    /// `generation` (or fails). When none is under way, the next one starts
    /// as a task of its own, `spawn(task)`, reading with `read`: a purchase
    /// dropped by its client must not take with it the read the others
    /// wait for.
    async fn finds<R, F>(
        self: &Arc<Self>,
        generation: i64,
        arrival: u64,
        spawn: impl Fn(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>),
        read: R,
    ) -> bool
    where
        R: Fn() -> F,
        F: Future<Output = Option<i64>> + Send + 'static,
    {
        let mut done = self.done.subscribe();
        loop {
            let (last, count) = *done.borrow_and_update();
            if last > arrival {
                return count.is_none_or(|c| c == generation);
            }
            if !self.reading.swap(true, Ordering::SeqCst) {
                let (recount, read) = (self.clone(), read());
                spawn(Box::pin(async move {
                    let n = recount.start().await;
                    let count = read.await;
                    recount.reading.store(false, Ordering::SeqCst);
                    recount.done.send_replace((n, count));
                }));
            }
            if done.changed().await.is_err() {
                return true;
            }
        }
    }

    /// Waits until [`RECOUNT_SPACING`] has passed since the last read
    /// started, then numbers the read that starts now. Only the task that
    /// set `reading` calls this, so reads never overlap.
    async fn start(&self) -> u64 {
        let last = *self.last_start.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(due) = last.map(|t| t + RECOUNT_SPACING)
            && due > Instant::now()
        {
            tokio::time::sleep_until(due.into()).await;
        }
        *self.last_start.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.started.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The flags of this instance.
pub struct SoldOut {
    ttl: Duration,
    flags: RwLock<HashMap<ActivityId, Flag>>,
    /// One flag is being set at a time.
    loading: AtomicBool,
    /// Flagged activities: while 0, a purchase takes no lock here.
    count: AtomicI64,
    /// Activities whose flag a task keeps fresh.
    refreshing: std::sync::Mutex<HashSet<ActivityId>>,
    gauge: IntGauge,
    /// Reads of an acceptance count made to confirm refusals.
    recounts: IntCounter,
    /// The runtime this was made on (the process's background runtime),
    /// where its reads of Redis run: spawned on the HTTP worker that
    /// needed them, they waited behind that worker's purchases for each
    /// hop, and a sale's first SOLD_OUT took 45–224 ms to become a flag
    /// while every purchase meanwhile went to Redis (14–50 ms here;
    /// docs/BENCHMARKS-HISTORY.md).
    home: Option<tokio::runtime::Handle>,
}

impl SoldOut {
    /// Flags living `ttl` (zero turns the fast path off); `gauge` shows
    /// how many activities are flagged, `recounts` counts the reads that
    /// confirm refusals.
    pub fn new(ttl: Duration, gauge: IntGauge, recounts: IntCounter) -> Self {
        Self {
            ttl,
            flags: RwLock::new(HashMap::new()),
            loading: AtomicBool::new(false),
            count: AtomicI64::new(0),
            refreshing: std::sync::Mutex::new(HashSet::new()),
            gauge,
            recounts,
            home: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// Runs `task` on this flag set's own runtime (the current one if it
    /// was made outside any).
    fn spawn<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        match &self.home {
            Some(home) => drop(home.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }

    /// [`Self::mark`] on this flag set's own runtime: what a purchase that
    /// Redis answered SOLD_OUT calls, without waiting for it.
    pub fn mark_soon(
        self: &Arc<Self>,
        gate: &Arc<RedisGate>,
        activity_id: ActivityId,
        layout: Layout,
        asked_at: Instant,
    ) {
        let (flags, gate) = (self.clone(), gate.clone());
        self.spawn(async move { flags.mark(&gate, activity_id, layout, asked_at).await });
    }

    /// Whether `user_id`'s purchase in `activity_id` is answered SOLD_OUT
    /// from memory: the activity is flagged and the user has no request
    /// accepted in it, as of the flag; [`Self::confirm`] then checks that
    /// no buyer was accepted since.
    pub fn refuses(&self, activity_id: ActivityId, user_id: i64) -> Option<Refused> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let flags = self.flags.read().unwrap_or_else(|e| e.into_inner());
        let f = flags.get(&activity_id)?;
        let refuses =
            f.since.is_some_and(|t| t.elapsed() < self.ttl) && !f.buyers.contains(&user_id);
        if !refuses {
            return None;
        }
        if !f.used.load(Ordering::Relaxed) {
            f.used.store(true, Ordering::Relaxed);
        }
        Some(Refused {
            generation: f.generation,
            arrival: f.recount.started.load(Ordering::SeqCst),
            recount: f.recount.clone(),
        })
    }

    /// Whether `refused` stands: a read of the activity's acceptance count
    /// started after the purchase was checked finds the count its buyers
    /// were read at (one read shared by every refusal waiting for it).
    /// Moved: a buyer was accepted since, maybe this one on another
    /// instance, and the purchase goes to Redis. Redis failing: the
    /// refusal stands, as before this check existed (the script would fail
    /// the same way).
    pub async fn confirm(
        &self,
        gate: &Arc<RedisGate>,
        activity_id: ActivityId,
        layout: Layout,
        refused: Refused,
    ) -> bool {
        let Refused {
            generation,
            arrival,
            recount,
        } = refused;
        let read = || {
            let (gate, recounts) = (gate.clone(), self.recounts.clone());
            async move {
                recounts.inc();
                gate.acceptances(activity_id, layout).await.ok()
            }
        };
        recount
            .finds(generation, arrival, |task| self.spawn(task), read)
            .await
    }

    /// Redis answered SOLD_OUT for `activity_id` to a call sent at
    /// `asked_at`: flags it, reading its buyers first unless they are known
    /// at the current acceptance count — unless stock came back after
    /// `asked_at` (the release's message can arrive between Redis's answer
    /// and this flag; set after it, the flag would refuse buyers while
    /// units wait). Runs off the request path; a second call while one is
    /// loading returns at once. A flag set here is then kept fresh while
    /// it is in use ([`Self::keep_fresh`]).
    pub async fn mark(
        self: &Arc<Self>,
        gate: &Arc<RedisGate>,
        activity_id: ActivityId,
        layout: Layout,
        asked_at: Instant,
    ) {
        if self.ttl.is_zero() || self.is_fresh(activity_id) {
            return;
        }
        if self.loading.swap(true, Ordering::AcqRel) {
            return;
        }
        let result = self.load(gate, activity_id, layout, asked_at).await;
        self.loading.store(false, Ordering::Release);
        match result {
            Ok(()) => {
                let first = self
                    .refreshing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(activity_id);
                if first {
                    self.spawn(self.clone().keep_fresh(gate.clone(), activity_id, layout));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, activity_id = %activity_id, "sold-out flag not set")
            }
        }
    }

    /// Every half lifetime, while the flag of `activity_id` is set and
    /// refused a purchase since the last round: reads its units, and sets
    /// the flag again if they are 0 (as [`Self::mark`] does after a
    /// SOLD_OUT, its buyers read again if the acceptances moved; not if a
    /// release was heard after the read was sent). Units back, an activity
    /// Redis does not hold whole, or Redis failing: the task ends and the
    /// flag lapses at the end of its lifetime, as before.
    async fn keep_fresh(
        self: Arc<Self>,
        gate: Arc<RedisGate>,
        activity_id: ActivityId,
        layout: Layout,
    ) {
        loop {
            tokio::time::sleep(self.ttl / 2).await;
            let used = {
                let flags = self.flags.read().unwrap_or_else(|e| e.into_inner());
                flags
                    .get(&activity_id)
                    .filter(|f| f.since.is_some())
                    .is_some_and(|f| f.used.swap(false, Ordering::Relaxed))
            };
            if !used {
                break;
            }
            let asked_at = Instant::now();
            match gate.available_if_warm(activity_id, layout).await {
                Ok(Some(0)) => {
                    if let Err(e) = self.load(&gate, activity_id, layout, asked_at).await {
                        tracing::debug!(error = %e, %activity_id, "sold-out flag not refreshed");
                        break;
                    }
                }
                _ => break,
            }
        }
        self.refreshing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&activity_id);
    }

    async fn load(
        &self,
        gate: &RedisGate,
        activity_id: ActivityId,
        layout: Layout,
        asked_at: Instant,
    ) -> redis::RedisResult<()> {
        // The count first: an acceptance after it makes the next load read
        // the buyers again.
        let generation = gate.acceptances(activity_id, layout).await?;
        let known = {
            let flags = self.flags.read().unwrap_or_else(|e| e.into_inner());
            flags
                .get(&activity_id)
                .filter(|f| f.generation == generation)
                .map(|f| f.buyers.clone())
        };
        let buyers = match known {
            Some(buyers) => buyers,
            None => Arc::new(gate.buyers(activity_id, layout).await?),
        };
        let mut flags = self.flags.write().unwrap_or_else(|e| e.into_inner());
        self.set(&mut flags, activity_id, buyers, generation, asked_at);
        self.recount(&flags);
        Ok(())
    }

    /// Sets the flag of an answer to a call sent at `asked_at`, unless a
    /// release was heard since.
    fn set(
        &self,
        flags: &mut HashMap<ActivityId, Flag>,
        activity_id: ActivityId,
        buyers: Arc<HashSet<i64>>,
        generation: i64,
        asked_at: Instant,
    ) {
        let cleared_at = flags.get(&activity_id).and_then(|f| f.cleared_at);
        if cleared_at.is_some_and(|c| c >= asked_at) {
            return;
        }
        let recount = flags
            .get(&activity_id)
            .map(|f| f.recount.clone())
            .unwrap_or_default();
        flags.insert(
            activity_id,
            Flag {
                since: Some(Instant::now()),
                buyers,
                generation,
                cleared_at,
                used: AtomicBool::new(false),
                recount,
            },
        );
    }

    fn is_fresh(&self, activity_id: ActivityId) -> bool {
        let flags = self.flags.read().unwrap_or_else(|e| e.into_inner());
        flags
            .get(&activity_id)
            .and_then(|f| f.since)
            .is_some_and(|t| t.elapsed() < self.ttl)
    }

    /// Stock of `activity_id` came back: its next purchase goes to Redis.
    pub fn clear(&self, activity_id: ActivityId) {
        let mut flags = self.flags.write().unwrap_or_else(|e| e.into_inner());
        let f = flags.entry(activity_id).or_insert_with(|| Flag {
            since: None,
            buyers: Arc::default(),
            // Matches no acceptance count: the buyers are read on a flag.
            generation: -1,
            cleared_at: None,
            used: AtomicBool::new(false),
            recount: Arc::default(),
        });
        f.since = None;
        f.cleared_at = Some(Instant::now());
        self.recount(&flags);
    }

    /// Every flag, and what is known of buyers, goes (the subscription to
    /// stock returns was down: messages may have been missed).
    pub fn clear_all(&self) {
        let mut flags = self.flags.write().unwrap_or_else(|e| e.into_inner());
        flags.clear();
        self.recount(&flags);
    }

    fn recount(&self, flags: &HashMap<ActivityId, Flag>) {
        let n = flagged(flags);
        self.count.store(n, Ordering::Release);
        self.gauge.set(n);
    }
}

fn flagged(flags: &HashMap<ActivityId, Flag>) -> i64 {
    flags.values().filter(|f| f.since.is_some()).count() as i64
}

/// Listens on [`channel`] and clears the flags of activities whose stock
/// came back, until `shutdown`. Every flag goes whenever the subscription
/// is not live: a return may be missed then.
pub async fn listen(
    seeds: Vec<String>,
    channel: String,
    flags: Arc<SoldOut>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let on_message = {
        let flags = flags.clone();
        move |m: &redis::Msg| {
            if let Ok(id) = m.get_payload::<i64>() {
                flags.clear(ActivityId::new(id));
            }
        }
    };
    crate::store::redis_conn::listen(
        seeds,
        channel,
        "stock returns",
        move |_| flags.clear_all(),
        on_message,
        shutdown,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(ttl_ms: u64) -> SoldOut {
        SoldOut::new(
            Duration::from_millis(ttl_ms),
            IntGauge::new("g", "g").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        )
    }

    fn set(s: &SoldOut, activity: i64, buyers: &[i64]) {
        let mut flags = s.flags.write().unwrap();
        flags.insert(
            ActivityId::new(activity),
            Flag {
                since: Some(Instant::now()),
                buyers: Arc::new(buyers.iter().copied().collect()),
                generation: 0,
                cleared_at: None,
                used: AtomicBool::new(false),
                recount: Arc::default(),
            },
        );
        s.recount(&flags);
    }

    /// The reads behind a flag run on the runtime the flags were made on,
    /// not on the busy HTTP worker that asked for them: here the asking
    /// thread never yields again, and the read still runs.
    #[test]
    fn its_reads_run_on_the_runtime_it_was_made_on_while_the_asking_thread_is_busy() {
        let home = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let s = {
            let _inside = home.enter();
            flags(200)
        };
        let worker = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let done = ran.clone();
        let ran_within = worker.block_on(async move {
            s.spawn(async move { done.store(true, Ordering::SeqCst) });
            // Busy, as a worker under a sale's first purchases: no await.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !ran.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            ran.load(Ordering::SeqCst)
        });
        assert!(ran_within, "the read waited for the asking thread to yield");
    }

    #[test]
    fn a_flag_refuses_only_buyers_without_an_accepted_request_and_only_until_cleared() {
        let s = flags(60_000);
        assert!(
            s.refuses(ActivityId::new(1), 5).is_none(),
            "nothing flagged"
        );
        set(&s, 1, &[7]);
        assert!(s.refuses(ActivityId::new(1), 5).is_some());
        assert!(
            s.refuses(ActivityId::new(1), 7).is_none(),
            "a buyer with an order goes to Redis"
        );
        assert!(
            s.refuses(ActivityId::new(2), 5).is_none(),
            "another activity"
        );
        s.clear(ActivityId::new(1));
        assert!(s.refuses(ActivityId::new(1), 5).is_none());
    }

    #[test]
    fn a_release_heard_after_the_call_keeps_the_flag_off() {
        // Defect 10 of issue #25: the call is sent, Redis answers SOLD_OUT,
        // a release adds units and its message is heard, and only then is
        // the flag set. It must not be: units are waiting.
        let s = flags(60_000);
        let asked_at = Instant::now();
        s.clear(ActivityId::new(1));
        let mut f = s.flags.write().unwrap();
        s.set(&mut f, ActivityId::new(1), Arc::default(), 0, asked_at);
        s.recount(&f);
        drop(f);
        assert!(
            s.refuses(ActivityId::new(1), 5).is_none(),
            "set after the release it came before"
        );
        // A call sent after the release is flagged as usual.
        let mut f = s.flags.write().unwrap();
        s.set(
            &mut f,
            ActivityId::new(1),
            Arc::default(),
            0,
            Instant::now(),
        );
        s.recount(&f);
        drop(f);
        assert!(s.refuses(ActivityId::new(1), 5).is_some());
    }

    /// The refusals of a moment share one read, and reads start at most
    /// once per [`RECOUNT_SPACING`]: here a read takes a moment, so back to
    /// back there would be thousands.
    #[test]
    fn reads_shared_by_waiting_refusals_start_at_most_once_per_spacing() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let recount = Arc::new(Recount::default());
        let reads = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let (waiters, each) = (64, 20);
        let confirmed = rt.block_on(async {
            let tasks = (0..waiters).map(|_| {
                let (recount, reads) = (recount.clone(), reads.clone());
                tokio::spawn(async move {
                    let mut confirmed = 0;
                    for _ in 0..each {
                        let arrival = recount.started.load(Ordering::SeqCst);
                        let read = || {
                            let reads = reads.clone();
                            async move {
                                reads.fetch_add(1, Ordering::SeqCst);
                                tokio::task::yield_now().await;
                                Some(7)
                            }
                        };
                        let spawn = |task| drop(tokio::spawn(task));
                        confirmed += usize::from(recount.finds(7, arrival, spawn, read).await);
                    }
                    confirmed
                })
            });
            let mut confirmed = 0;
            for task in tasks.collect::<Vec<_>>() {
                confirmed += task.await.unwrap();
            }
            confirmed
        });
        let elapsed = started.elapsed();
        let reads = reads.load(Ordering::SeqCst);
        assert_eq!(confirmed, waiters * each, "every refusal confirmed");
        let most = (elapsed.as_micros() / RECOUNT_SPACING.as_micros()) as u64 + 1;
        assert!(
            (1..=most).contains(&reads),
            "{reads} reads for {} refusals in {elapsed:?}: at most {most} may start",
            waiters * each
        );
    }

    #[test]
    fn a_flag_expires_on_its_own() {
        let s = flags(0);
        set(&s, 1, &[]);
        assert!(s.refuses(ActivityId::new(1), 5).is_none());
    }
}

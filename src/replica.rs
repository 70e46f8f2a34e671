//! Reads from a streaming replica (`postgres.replica_url`), with
//! read-your-writes and reads that never go back in time.
//!
//! A replica replays the primary's WAL some time behind it (seconds at a
//! sale's peak). Read from it blindly, a buyer who was just shown
//! WAITING_PAY could be shown "no such order" or PROCESSING, or PAID and
//! then WAITING_PAY. The rule that prevents it, per buyer:
//!
//! - Every time a buyer is answered from the primary (a read, or their own
//!   pay or cancel), the primary's WAL insert position *after* it is noted
//!   for that buyer in Redis (`seen:{u:<id>}`, kept as the largest value,
//!   for [`SEEN_TTL_SECS`]). Whatever they were shown was committed below
//!   that position.
//! - A buyer is read from the replica only when the replica has replayed
//!   past that position (and past the floor, below). What they see there
//!   is then at least as new as anything shown before.
//! - Reads from the replica need no note: there is one replica, and its
//!   replay position only moves forward. A replica seen to go back (rebuilt,
//!   or another node behind the same address) raises the floor, below, to
//!   where the old one had replayed.
//! - A status an order stream pushes, and one a purchase retry answers,
//!   were read on the primary too, and are noted like any other.
//! - A note that cannot be written raises the floor instead: every buyer
//!   reads the primary a moment, rather than one buyer going back.
//! - An order the replica does not have yet is not "not found": when Redis
//!   holds its live reservation the answer is PROCESSING (what the buyer
//!   was told at 202), else the primary is asked (the caller does this).
//!
//! The floor (`seen:floor`) covers a Redis that lost its notes (restarted
//! empty, flushed): the watcher sets it, when it is missing, to the
//! primary's position at that moment, so no buyer is read from the
//! replica until it has replayed everything up to the loss. A floor above
//! the primary's own position belongs to another history (a database
//! restored or made anew), and is set to the primary's position again.
//!
//! A watcher samples the replica every [`WATCH_EVERY`] on a connection of
//! its own: whether it is a standby, how far it has replayed, how far
//! behind it is. A replica that does not answer, is not a standby, or is
//! more than `postgres.replica_max_lag_ms` behind is not read from;
//! readiness shows it. A node found promoted is left: the watcher connects
//! again, so a `replica_url` naming several hosts with
//! `target_session_attrs=standby` finds the standby that replaced it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool};
use redis::Script;
use tokio_util::sync::CancellationToken;

use crate::config::PostgresSettings;
use crate::domain::UserId;
use crate::metrics::Metrics;
use crate::store::redis_conn::RedisConn;
use crate::store::{self, PgConn, PgPool};
use crate::worker::WorkerHandle;

/// How often the watcher samples the replica and the primary.
pub const WATCH_EVERY: Duration = Duration::from_millis(200);
/// How long a buyer's note lives. A replica further behind than
/// `postgres.replica_max_lag_ms` (at most a minute) is not read from, so
/// a note older than this has been replayed long since.
pub const SEEN_TTL_SECS: u64 = 600;

/// The replica, its watcher's latest view, and the buyers' notes.
pub struct Replica {
    pool: PgPool,
    url: String,
    primary: PgPool,
    notes: RedisConn,
    prefix: String,
    max_lag_ms: i64,
    metrics: Metrics,
    /// Replayed up to here (a WAL position, bytes); 0 until known.
    replay: AtomicI64,
    /// Not read from for a buyer below this (see the module doc).
    floor: AtomicI64,
    /// Behind the primary, ms; -1 when unknown.
    lag_ms: AtomicI64,
    /// Answering, a standby, and within the lag allowed.
    usable: AtomicBool,
    /// Answering at the last sample.
    answers: AtomicBool,
    note: Script,
    /// Raises the floor to at least ARGV[1].
    raise: Script,
}

/// Where a read goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The replica: it has replayed all the buyer was shown.
    Replica,
    /// The primary.
    Primary,
}

/// The replica as readiness shows it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReplicaStatus {
    /// up, lagging (answers, beyond `replica_max_lag_ms`), or down (does
    /// not answer, or is not a standby).
    pub state: &'static str,
    /// Behind the primary, ms (none when unknown).
    pub lag_ms: Option<i64>,
    /// Where the buyers' order reads go now: replica or primary.
    pub reads: &'static str,
}

#[derive(QueryableByName)]
struct Position {
    #[diesel(sql_type = BigInt)]
    lsn: i64,
}

#[derive(QueryableByName)]
struct Standby {
    #[diesel(sql_type = Bool)]
    standby: bool,
    #[diesel(sql_type = BigInt)]
    replay: i64,
    #[diesel(sql_type = BigInt)]
    age_ms: i64,
}

/// The primary's WAL insert position now, in bytes. Read after a
/// statement completed (on any connection), it is past every commit that
/// statement saw.
pub fn insert_position(conn: &mut PgConn) -> QueryResult<i64> {
    diesel::sql_query("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint AS lsn")
        .get_result::<Position>(conn)
        .map(|p| p.lsn)
}

impl Replica {
    /// The replica of `settings`, when one is configured; nothing connects
    /// yet. `notes` keeps the buyers' notes; `primary` is sampled for the
    /// lag. Inside a Tokio runtime.
    pub fn new(
        settings: &PostgresSettings,
        primary: PgPool,
        notes: RedisConn,
        prefix: &str,
        metrics: Metrics,
    ) -> Option<Arc<Self>> {
        let url = settings.replica()?.to_owned();
        // A replica that stopped answering must not hold a buyer's read
        // for the main pool's whole checkout timeout before the primary
        // takes it.
        let pool = store::read_pool(
            &url,
            settings,
            settings.pool_size,
            settings.timeout_ms.min(Duration::from_secs(1)),
        );
        Some(Arc::new(Self {
            pool,
            url,
            primary,
            notes,
            prefix: prefix.to_owned(),
            max_lag_ms: i64::try_from(settings.replica_max_lag_ms.as_millis()).unwrap_or(i64::MAX),
            metrics,
            replay: AtomicI64::new(0),
            floor: AtomicI64::new(i64::MAX),
            lag_ms: AtomicI64::new(-1),
            usable: AtomicBool::new(false),
            answers: AtomicBool::new(false),
            note: Script::new(
                "local cur = tonumber(redis.call('GET', KEYS[1]) or '0') \
                 if tonumber(ARGV[1]) > cur then \
                   redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) \
                 else redis.call('EXPIRE', KEYS[1], ARGV[2]) end \
                 return 1",
            ),
            raise: Script::new(
                "local cur = tonumber(redis.call('GET', KEYS[1]) or '0') \
                 if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end \
                 return 1",
            ),
        }))
    }

    fn seen_key(&self, user: UserId) -> String {
        format!("{}seen:{{u:{}}}", self.prefix, user.get())
    }

    fn floor_key(&self) -> String {
        format!("{}seen:floor", self.prefix)
    }

    /// The pool to read `user`'s orders from: the replica's when it is
    /// usable and has replayed all `user` was shown or wrote; `None` (the
    /// primary) otherwise, and when the note cannot be read.
    pub async fn pool_for(&self, user: UserId) -> Option<&PgPool> {
        if !self.usable.load(Ordering::Acquire) {
            return None;
        }
        let seen: Option<i64> = match redis::cmd("GET")
            .arg(self.seen_key(user))
            .query_async(&mut self.notes.clone())
            .await
        {
            Ok(seen) => seen,
            Err(e) => {
                tracing::debug!(error = %e, "replica reads: the buyer's note is unreadable; reading the primary");
                return None;
            }
        };
        let needed = seen.unwrap_or(0).max(self.floor.load(Ordering::Acquire));
        (self.replay.load(Ordering::Acquire) >= needed).then_some(&self.pool)
    }

    /// Notes that `user` was just answered from the primary (a read, or
    /// their own write): the primary's position now, which is past all
    /// they were shown. Best effort: a note that cannot be written is
    /// logged (the floor covers a Redis that lost them).
    pub async fn shown_from_primary(&self, user: UserId) {
        let position = store::run(&self.primary, |conn| Ok(insert_position(conn)?)).await;
        match position {
            Ok(p) => self.note(user, p).await,
            Err(e) => {
                tracing::warn!(error = %e, "replica reads: the primary's position is unreadable");
            }
        }
    }

    /// Notes `position` (read with [`insert_position`] after what `user`
    /// was answered from the primary) for `user`, keeping the largest. A
    /// note that cannot be written raises the floor to `position` instead,
    /// here at once and in Redis when it takes it: no buyer is read from
    /// the replica before it has replayed what this one was shown.
    pub async fn note(&self, user: UserId, position: i64) {
        let written: redis::RedisResult<i64> = self
            .note
            .key(self.seen_key(user))
            .arg(position)
            .arg(SEEN_TTL_SECS)
            .invoke_async(&mut self.notes.clone())
            .await;
        if let Err(e) = written {
            tracing::warn!(error = %e, "replica reads: a buyer's note was not written; the floor is raised");
            self.raise_floor(position).await;
        }
    }

    /// Raises the floor to at least `position`: here at once, and in Redis
    /// for every instance (best effort: an instance that cannot read the
    /// floor reads nobody from the replica anyway).
    async fn raise_floor(&self, position: i64) {
        self.floor.fetch_max(position, Ordering::AcqRel);
        let raised: redis::RedisResult<i64> = self
            .raise
            .key(self.floor_key())
            .arg(position)
            .invoke_async(&mut self.notes.clone())
            .await;
        if let Err(e) = raised {
            tracing::warn!(error = %e, "replica reads: the floor was not raised in Redis");
        }
    }

    /// Counts one order read by where it was answered from: replica,
    /// primary, or redis (PROCESSING, the replica not having the row yet).
    pub fn count(&self, source: &str) {
        self.metrics.order_reads.with_label_values(&[source]).inc();
    }

    /// Whether the replica may be read from at all now (the public
    /// activity view, which no buyer's note concerns).
    pub fn public_pool(&self) -> Option<&PgPool> {
        self.usable.load(Ordering::Acquire).then_some(&self.pool)
    }

    /// The replica as readiness shows it.
    pub fn status(&self) -> ReplicaStatus {
        let lag = self.lag_ms.load(Ordering::Acquire);
        let usable = self.usable.load(Ordering::Acquire);
        ReplicaStatus {
            state: match (self.answers.load(Ordering::Acquire), usable) {
                (_, true) => "up",
                (true, false) if lag >= 0 => "lagging",
                _ => "down",
            },
            lag_ms: (lag >= 0).then_some(lag),
            reads: if usable { "replica" } else { "primary" },
        }
    }

    /// Starts the watcher.
    pub fn watch(self: Arc<Self>) -> WorkerHandle {
        WorkerHandle::spawn(move |shutdown| self.watch_until(shutdown))
    }

    async fn watch_until(self: Arc<Self>, shutdown: CancellationToken) {
        // Its own connection: a wedged pool also fails its own probe.
        let conn: Arc<std::sync::Mutex<Option<PgConnection>>> = Arc::default();
        loop {
            self.sample(&conn).await;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(WATCH_EVERY) => {}
            }
        }
    }

    /// One sample: the primary's position, the floor, then the replica.
    async fn sample(&self, conn: &Arc<std::sync::Mutex<Option<PgConnection>>>) {
        let primary = store::run(&self.primary, |c| {
            Ok(
                diesel::sql_query("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS lsn")
                    .get_result::<Position>(c)?
                    .lsn,
            )
        })
        .await
        .ok();
        if let Some(position) = primary {
            self.keep_floor(position).await;
        }
        let (url, conn) = (self.url.clone(), conn.clone());
        let standby = tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|e| e.into_inner());
            if guard.is_none() {
                let mut c = PgConnection::establish(&with_connect_timeout(&url))?;
                diesel::sql_query("SET statement_timeout = 1000").execute(&mut c)?;
                *guard = Some(c);
            }
            let c = guard.as_mut().expect("connected above");
            let read = diesel::sql_query(
                "SELECT pg_is_in_recovery() AS standby, \
                   COALESCE((pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint, 0) AS replay, \
                   COALESCE((extract(epoch FROM now() - pg_last_xact_replay_timestamp()) * 1000)::bigint, -1) AS age_ms",
            )
            .get_result::<Standby>(c);
            // A node that failed, or that is no standby any more (promoted),
            // is left: the next sample connects again.
            if !matches!(read, Ok(Standby { standby: true, .. })) {
                *guard = None;
            }
            Ok::<_, anyhow::Error>(read?)
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| r);
        let (answers, usable, lag) = match standby {
            Ok(s) if s.standby => {
                let before = self.replay.swap(s.replay, Ordering::AcqRel);
                if let Some(floor) = went_back(before, s.replay) {
                    tracing::warn!(
                        before,
                        now = s.replay,
                        "replica reads: the replica went back (rebuilt or replaced); \
                         nobody reads it until it passes where it was"
                    );
                    self.raise_floor(floor).await;
                }
                // Replayed as far as the primary had written just before:
                // nothing to wait for, however old its last transaction.
                let lag = match primary {
                    Some(p) if s.replay >= p => 0,
                    _ => s.age_ms,
                };
                (true, lag >= 0 && lag <= self.max_lag_ms, lag)
            }
            Ok(_) => {
                tracing::warn!("postgres.replica_url is not a standby (promoted?): not read from");
                (true, false, -1)
            }
            Err(e) => {
                tracing::debug!(error = %e, "the replica does not answer");
                (false, false, -1)
            }
        };
        let was = self.usable.swap(usable, Ordering::AcqRel);
        self.answers.store(answers, Ordering::Release);
        self.lag_ms.store(lag, Ordering::Release);
        if was != usable {
            tracing::warn!(
                usable,
                lag_ms = lag,
                "replica reads {}",
                if usable {
                    "resume"
                } else {
                    "go to the primary"
                }
            );
        }
        self.metrics.replica_usable.set(i64::from(usable));
        self.metrics.replica_lag_ms.set(lag);
    }

    /// Reads the floor, setting it to `position` (the primary's now) when
    /// Redis has none, or when it is above `position`: a floor from
    /// another history of the database, which would keep every buyer off
    /// the replica for good.
    async fn keep_floor(&self, position: i64) {
        let script = Script::new(
            "local f = tonumber(redis.call('GET', KEYS[1]) or '-1') \
             if f < 0 or f > tonumber(ARGV[1]) then \
               redis.call('SET', KEYS[1], ARGV[1]) return tonumber(ARGV[1]) end \
             return f",
        );
        let floor: redis::RedisResult<i64> = script
            .key(self.floor_key())
            .arg(position)
            .invoke_async(&mut self.notes.clone())
            .await;
        match floor {
            Ok(f) => self.floor.store(f, Ordering::Release),
            // Unknown: no buyer is read from the replica until it is known.
            Err(_) => self.floor.store(i64::MAX, Ordering::Release),
        }
    }
}

/// The floor a replica's replay position moving from `before` to `now`
/// calls for: `before` when it went back (the node was rebuilt, or another
/// one answers at the address), so that nobody is read from it until it
/// has replayed as far as the one they may have been read from.
fn went_back(before: i64, now: i64) -> Option<i64> {
    (now < before).then_some(before)
}

/// `url` with a connect timeout of 2 s unless it names one: a replica
/// that stopped (SIGSTOP) must not hold the watcher.
fn with_connect_timeout(url: &str) -> String {
    if url.contains("connect_timeout=") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}connect_timeout=2")
}

#[cfg(test)]
mod tests {
    use super::{went_back, with_connect_timeout};

    #[test]
    fn a_replica_that_went_back_raises_the_floor_to_where_it_was() {
        assert_eq!(went_back(0, 5_000), None, "the first sample");
        assert_eq!(went_back(5_000, 5_000), None);
        assert_eq!(went_back(5_000, 9_000), None);
        assert_eq!(
            went_back(9_000, 1_000),
            Some(9_000),
            "rebuilt from an older copy"
        );
    }

    #[test]
    fn a_connect_timeout_is_added_once() {
        assert_eq!(
            with_connect_timeout("postgres://a@h:1/d"),
            "postgres://a@h:1/d?connect_timeout=2"
        );
        assert_eq!(
            with_connect_timeout("postgres://a@h:1/d?sslmode=disable"),
            "postgres://a@h:1/d?sslmode=disable&connect_timeout=2"
        );
        assert_eq!(
            with_connect_timeout("postgres://a@h:1/d?connect_timeout=5"),
            "postgres://a@h:1/d?connect_timeout=5"
        );
    }
}

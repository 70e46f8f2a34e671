//! PostgreSQL through Diesel: the connection pool, embedded migrations and
//! the helper that keeps synchronous Diesel calls off the async workers.

pub mod fenced;
pub mod notes;
pub mod redis_conn;
pub mod schema;

use anyhow::Context;
use diesel::PgConnection;
use diesel::r2d2::{ConnectionManager, Pool, PooledConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use secrecy::ExposeSecret;

use crate::config::PostgresSettings;

/// The embedded `migrations/` folder; run by `seckill migrate`, never at boot.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// Pooled PostgreSQL connections.
pub type PgPool = Pool<Connections>;
/// One connection checked out of [`PgPool`].
pub type PooledConn = PooledConnection<Connections>;

/// Diesel's connection manager, whose check of a connection before it is
/// handed out also asks whether the server is still the primary: after a
/// failover (postgres.url naming the pair, `target_session_attrs=read-
/// write`), a connection to a node that was demoted is dropped and a new
/// one goes to whichever node takes writes now. The public-reads pool
/// takes a standby's answers too.
#[derive(Debug)]
pub struct Connections {
    inner: ConnectionManager<PgConnection>,
    writes: bool,
}

/// Bumped when a call got no answer within `postgres.call_timeout_ms`
/// ([`CallTimeout`]): the network may have silently dropped every
/// connection open then (a primary that vanished, a partition), and an
/// idle one checked out would hold its caller the same way. So each
/// connection made before is discarded at its next checkout, and new
/// ones are made.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A pooled connection, and the [`GENERATION`] it was made in.
pub struct Tracked {
    conn: PgConnection,
    generation: u64,
}

impl std::ops::Deref for Tracked {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for Tracked {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Tracked {
    fn stale(&self) -> bool {
        self.generation != GENERATION.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl diesel::r2d2::ManageConnection for Connections {
    type Connection = Tracked;
    type Error = diesel::r2d2::Error;

    fn connect(&self) -> Result<Tracked, Self::Error> {
        let generation = GENERATION.load(std::sync::atomic::Ordering::Relaxed);
        Ok(Tracked {
            conn: self.inner.connect()?,
            generation,
        })
    }

    fn is_valid(&self, tracked: &mut Tracked) -> Result<(), Self::Error> {
        if tracked.stale() {
            return Err(diesel::r2d2::Error::ConnectionError(
                diesel::ConnectionError::BadConnection(
                    "made before a call went unanswered: perhaps silently dropped".into(),
                ),
            ));
        }
        let conn = &mut tracked.conn;
        if !self.writes {
            return self.inner.is_valid(conn);
        }
        #[derive(diesel::QueryableByName)]
        struct Recovery {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            standby: bool,
        }
        use diesel::RunQueryDsl;
        let r: Recovery = diesel::sql_query("SELECT pg_is_in_recovery() AS standby")
            .get_result(conn)
            .map_err(diesel::r2d2::Error::QueryError)?;
        if r.standby {
            return Err(diesel::r2d2::Error::QueryError(
                diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::ReadOnlyTransaction,
                    Box::new("the server is a standby now (a failover demoted it)".to_owned()),
                ),
            ));
        }
        Ok(())
    }

    fn has_broken(&self, tracked: &mut Tracked) -> bool {
        tracked.stale() || self.inner.has_broken(&mut tracked.conn)
    }
}
/// What repositories take: any PostgreSQL connection (a pooled one derefs to it).
pub type PgConn = PgConnection;

/// `url` with the timeouts of `settings` as libpq parameters, each unless
/// the URL sets it already: `connect_timeout` (per host), TCP keepalives
/// and `tcp_user_timeout` (a host that vanished is given up after
/// `dead_host_ms`, not TCP's ~15 minutes), and the server's
/// `statement_timeout` and `idle_in_transaction_session_timeout`.
pub fn with_timeouts(url: &str, settings: &PostgresSettings) -> String {
    let secs = |d: std::time::Duration| d.as_secs().max(1);
    let dead = settings.dead_host_ms;
    let params = [
        (
            "connect_timeout",
            secs(settings.connect_timeout_ms).to_string(),
        ),
        ("keepalives", "1".to_owned()),
        ("keepalives_idle", secs(dead / 2).to_string()),
        ("keepalives_interval", secs(dead / 6).to_string()),
        ("keepalives_count", "3".to_owned()),
        ("tcp_user_timeout", dead.as_millis().max(1).to_string()),
        (
            "options",
            format!(
                "-c%20statement_timeout%3D{}%20-c%20idle_in_transaction_session_timeout%3D{}",
                settings.statement_timeout_ms.as_millis(),
                settings.idle_in_transaction_timeout_ms.as_millis()
            ),
        ),
    ];
    let mut out = url.to_owned();
    for (key, value) in params {
        let set = out
            .split(['?', '&'])
            .skip(1)
            .any(|p| p.split('=').next() == Some(key));
        if !set {
            out.push(if out.contains('?') { '&' } else { '?' });
            out.push_str(&format!("{key}={value}"));
        }
    }
    out
}

/// Builds the pool without connecting: the server starts (and reports "not
/// ready") while PostgreSQL is down, and connects when it comes back.
pub fn pool(settings: &PostgresSettings) -> PgPool {
    set_call_timeout(settings.call_timeout_ms);
    let manager = Connections {
        inner: ConnectionManager::new(with_timeouts(settings.url.expose_secret(), settings)),
        writes: true,
    };
    Pool::builder()
        .max_size(settings.pool_size)
        .min_idle(Some(0))
        .connection_timeout(settings.timeout_ms)
        .build_unchecked(manager)
}

/// The small pool of public reads (the activity view, readiness), apart
/// from the one the consumers and the order routes use, so a flood of
/// anonymous reads cannot take the connections that create orders. Its
/// connections say `application_name=seckill-public-reads`.
pub fn public_pool(settings: &PostgresSettings) -> PgPool {
    let url = with_timeouts(settings.url.expose_secret(), settings);
    let sep = if url.contains('?') { '&' } else { '?' };
    let manager = Connections {
        inner: ConnectionManager::new(format!("{url}{sep}application_name={PUBLIC_READS}")),
        writes: false,
    };
    Pool::builder()
        .max_size(settings.public_pool_size.max(1))
        .min_idle(Some(0))
        .connection_timeout(settings.timeout_ms)
        .build_unchecked(manager)
}

/// A pool of reads only (a standby's answers taken), of at most `size`
/// connections to `url` with the timeouts of `settings`; nothing connects
/// yet.
pub fn read_pool(
    url: &str,
    settings: &PostgresSettings,
    size: u32,
    timeout: std::time::Duration,
) -> PgPool {
    let manager = Connections {
        inner: ConnectionManager::new(with_timeouts(url, settings)),
        writes: false,
    };
    Pool::builder()
        .max_size(size.max(1))
        .min_idle(Some(0))
        .connection_timeout(timeout)
        .build_unchecked(manager)
}

/// `application_name` of the public-reads pool's connections.
pub const PUBLIC_READS: &str = "seckill-public-reads";

/// The longest one call of [`run`] may take ([`PostgresSettings::call_timeout_ms`]),
/// in milliseconds; 0 before a pool is built (no deadline).
static CALL_TIMEOUT_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn set_call_timeout(d: std::time::Duration) {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    CALL_TIMEOUT_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// A database call gave no answer within `postgres.call_timeout_ms`: the
/// connection is left to the network (it may still complete), and the
/// caller retries on another.
#[derive(Debug, thiserror::Error)]
#[error("PostgreSQL did not answer within {0:?}")]
pub struct CallTimeout(std::time::Duration);

/// No connection could be had from the pool: PostgreSQL is down or saturated.
#[derive(Debug, thiserror::Error)]
#[error("no PostgreSQL connection: {0}")]
pub struct Unavailable(#[from] diesel::r2d2::PoolError);

/// Whether `error` is PostgreSQL saying "not now" rather than "no": a
/// deadlock or a serialization failure (the transaction was rolled back
/// and may simply be tried again), a statement cancelled by its timeout,
/// the server shutting down, starting up or ending the session, or a
/// connection lost. Answered 503 RETRY_LATER, never 500.
///
/// Diesel names a serialization failure and a closed connection; the rest
/// come as "unknown" and are told apart by PostgreSQL's message (its
/// default English messages: `lc_messages` set to another language hides
/// them, and they answer 500 as before).
pub fn is_transient(error: &anyhow::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error as DieselError};
    const TRANSIENT: [&str; 8] = [
        "deadlock detected",
        "could not serialize access",
        "canceling statement due to statement timeout",
        "terminating connection due to administrator command",
        "the database system is shutting down",
        "the database system is starting up",
        // A write that reached a node demoted by a failover.
        "in a read-only transaction",
        "the database system is in recovery mode",
    ];
    error.chain().any(|cause| {
        if cause.downcast_ref::<Unavailable>().is_some()
            || cause.downcast_ref::<CallTimeout>().is_some()
        {
            return true;
        }
        match cause.downcast_ref::<DieselError>() {
            Some(DieselError::DatabaseError(kind, info)) => {
                matches!(
                    kind,
                    DatabaseErrorKind::SerializationFailure
                        | DatabaseErrorKind::ClosedConnection
                        | DatabaseErrorKind::UnableToSendCommand
                        | DatabaseErrorKind::ReadOnlyTransaction
                ) || TRANSIENT.iter().any(|m| info.message().contains(m))
            }
            Some(DieselError::BrokenTransactionManager) => true,
            _ => false,
        }
    })
}

/// Runs `f` with a pooled connection on Tokio's blocking pool. Diesel is
/// synchronous; calling it on an async worker would stall every request that
/// worker serves.
pub async fn run<T, F>(pool: &PgPool, f: F) -> anyhow::Result<T>
where
    T: Send + 'static,
    F: FnOnce(&mut PgConn) -> anyhow::Result<T> + Send + 'static,
{
    let pool = pool.clone();
    let task = tokio::task::spawn_blocking(move || {
        let mut conn: PooledConn = pool.get().map_err(Unavailable)?;
        f(&mut conn)
    });
    // Diesel has no deadline of its own: a statement on a connection the
    // network silently dropped waits for TCP. The caller goes on without
    // it (the blocking task is left to finish or fail).
    let limit = CALL_TIMEOUT_MS.load(std::sync::atomic::Ordering::Relaxed);
    if limit == 0 {
        return task
            .await
            .context("database task panicked or was cancelled")?;
    }
    let limit = std::time::Duration::from_millis(limit);
    match tokio::time::timeout(limit, task).await {
        Ok(done) => done.context("database task panicked or was cancelled")?,
        Err(_) => {
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(anyhow::Error::new(CallTimeout(limit)))
        }
    }
}

/// Runs `f` as [`run`] does, inside one read-only REPEATABLE READ
/// transaction: every query of `f` sees the same snapshot, so figures read
/// together describe one moment.
pub async fn snapshot<T, F>(pool: &PgPool, f: F) -> anyhow::Result<T>
where
    T: Send + 'static,
    F: FnOnce(&mut PgConn) -> diesel::QueryResult<T> + Send + 'static,
{
    run(pool, move |conn| {
        Ok(conn
            .build_transaction()
            .read_only()
            .repeatable_read()
            .run(f)?)
    })
    .await
}

/// `SELECT 1` on a connection of `pool` (readiness).
pub async fn ping(pool: &PgPool) -> anyhow::Result<()> {
    run(pool, |conn| {
        diesel::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), conn)?;
        Ok(())
    })
    .await
}

/// Applies every pending migration; returns the versions applied.
pub fn migrate_up(conn: &mut PgConnection) -> anyhow::Result<Vec<String>> {
    let applied = conn
        .run_pending_migrations(MIGRATIONS)
        .map_err(|e| anyhow::anyhow!("running migrations: {e}"))?;
    Ok(applied.iter().map(|v| v.to_string()).collect())
}

/// Where the database's schema stands against the migrations this binary
/// carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schema {
    /// Every migration it knows is applied, and no other.
    Current,
    /// Some it knows are not applied yet: `seckill migrate` has not run.
    Behind,
    /// Applied migrations it does not know: a newer binary migrated, and
    /// this one must not write on a schema it was not built for.
    Ahead(Vec<String>),
}

/// The schema of the database `conn` is on, against this binary's
/// migrations.
pub fn schema(conn: &mut PgConnection) -> anyhow::Result<Schema> {
    use diesel::migration::MigrationSource;
    let known: std::collections::HashSet<String> =
        MigrationSource::<diesel::pg::Pg>::migrations(&MIGRATIONS)
            .map_err(|e| anyhow::anyhow!("listing this binary's migrations: {e}"))?
            .iter()
            .map(|m| m.name().version().to_string())
            .collect();
    let applied: Vec<String> = conn
        .applied_migrations()
        .map_err(|e| anyhow::anyhow!("reading the applied migrations: {e}"))?
        .iter()
        .map(|v| v.to_string())
        .collect();
    let unknown: Vec<String> = applied
        .iter()
        .filter(|v| !known.contains(*v))
        .cloned()
        .collect();
    Ok(if !unknown.is_empty() {
        Schema::Ahead(unknown)
    } else if applied.len() < known.len() {
        Schema::Behind
    } else {
        Schema::Current
    })
}

/// Reverts the newest applied migration; returns its version.
pub fn migrate_down_last(conn: &mut PgConnection) -> anyhow::Result<String> {
    let reverted = conn
        .revert_last_migration(MIGRATIONS)
        .map_err(|e| anyhow::anyhow!("reverting a migration: {e}"))?;
    Ok(reverted.to_string())
}

/// Reverts every applied migration, newest first; returns the versions reverted.
pub fn migrate_down_all(conn: &mut PgConnection) -> anyhow::Result<Vec<String>> {
    let reverted = conn
        .revert_all_migrations(MIGRATIONS)
        .map_err(|e| anyhow::anyhow!("reverting migrations: {e}"))?;
    Ok(reverted.iter().map(|v| v.to_string()).collect())
}

/// One row of a `SELECT status, count(*) AS n … GROUP BY status`.
#[derive(diesel::QueryableByName)]
pub struct StatusCount {
    /// The status.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub status: String,
    /// Rows in it.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub n: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pool_connection_carries_the_timeouts_unless_the_url_sets_them() {
        let settings = crate::config::Settings::load_env("test").unwrap().postgres;
        let url = with_timeouts("postgres://u:p@a:5436,b:5437/db", &settings);
        for part in [
            "?connect_timeout=5",
            "&keepalives=1",
            "&keepalives_idle=7",
            "&keepalives_interval=2",
            "&keepalives_count=3",
            "&tcp_user_timeout=15000",
            "&options=-c%20statement_timeout%3D15000%20-c%20idle_in_transaction_session_timeout%3D10000",
        ] {
            assert!(url.contains(part), "{part} in {url}");
        }
        let own = with_timeouts(
            "postgres://u:p@a/db?target_session_attrs=read-write&connect_timeout=3",
            &settings,
        );
        assert!(own.contains("connect_timeout=3"), "{own}");
        assert!(!own.contains("connect_timeout=5"), "{own}");
        assert!(own.starts_with("postgres://u:p@a/db?target_session_attrs=read-write&"));
    }
}

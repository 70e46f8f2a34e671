//! Databases of the integration and fault tests: each test gets its own,
//! created and migrated here, and reads its rows back with plain SQL.
//! Shared by `tests/api` and `tests/chaos` (`#[path]`-included by both).

use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use secrecy::{ExposeSecret, SecretString};

/// Creates and migrates `name` next to the configured database; returns its URL.
pub async fn create_database(base: &SecretString, name: &str) -> SecretString {
    let base = base.expose_secret().to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut admin = PgConnection::establish(&base).expect("connect to the main database");
        diesel::sql_query(format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .expect("create the test database");
        let url = database_url(&base, &name);
        // On a primary with a standby (a multi-host URL), libpq may try
        // the standby first, and one that has not replayed the CREATE yet
        // refuses the connection for good ("does not exist") instead of
        // passing to the next host: ask again until it has.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut conn = loop {
            match PgConnection::establish(&url) {
                Ok(conn) => break conn,
                Err(e)
                    if e.to_string().contains("does not exist")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(e) => panic!("connect to the test database: {e}"),
            }
        };
        seckill::store::migrate_up(&mut conn).expect("migrations apply");
        SecretString::from(url)
    })
    .await
    .expect("database setup task")
}

/// Drops database `name` of the server `url` points at (best effort,
/// blocking: from `Drop`).
pub fn drop_database(url: &str, name: &str) {
    if let Ok(mut conn) = PgConnection::establish(&database_url(url, "postgres")) {
        let _ = diesel::sql_query(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
            .execute(&mut conn);
    }
}

/// `base` with its database name replaced by `name`, its parameters
/// (`?target_session_attrs=read-write` of a multi-host URL) kept.
pub fn database_url(base: &str, name: &str) -> String {
    let (path, query) = match base.split_once('?') {
        Some((path, query)) => (path, format!("?{query}")),
        None => (base, String::new()),
    };
    let (server, _) = path.rsplit_once('/').expect("postgres url has a database");
    format!("{server}/{name}{query}")
}

/// The URL of the streaming replica (`scripts/services.sh up --pg-replica`)
/// of the server `primary` points at, for the same database: `configured`
/// (`postgres.replica_url`) with `primary`'s database, else the primary's
/// port + 100, where the script starts it.
#[allow(dead_code)] // the api tests' only; this file is in both test binaries
pub fn replica_url(primary: &str, configured: Option<&str>) -> String {
    let name = primary
        .split('?')
        .next()
        .and_then(|p| p.rsplit_once('/'))
        .map(|(_, name)| name)
        .expect("postgres url has a database");
    if let Some(replica) = configured {
        return database_url(replica, name);
    }
    let (head, rest) = primary.split_once('@').expect("postgres url has a host");
    let (address, tail) = rest.split_once('/').expect("postgres url has a database");
    let (host, port) = address.rsplit_once(':').unwrap_or((address, "5432"));
    let port: u16 = port.parse().expect("postgres url's port");
    format!("{head}@{host}:{}/{tail}", port + 100)
}

/// Runs `query` with a connection of its own to the database at `url`, on
/// the blocking pool.
async fn on_database<T: Send + 'static>(
    url: &SecretString,
    query: impl FnOnce(&mut PgConnection) -> T + Send + 'static,
) -> T {
    let url = url.expose_secret().to_owned();
    tokio::task::spawn_blocking(move || query(&mut PgConnection::establish(&url).expect("connect")))
        .await
        .expect("database task")
}

/// One `SELECT … AS n` (a BIGINT) on the database at `url`.
pub async fn count(url: &SecretString, sql: &str) -> i64 {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let sql = sql.to_owned();
    on_database(url, move |conn| {
        diesel::sql_query(sql)
            .get_result::<N>(conn)
            .expect("count query")
            .n
    })
    .await
}

/// [`strings`], or nothing while the database does not answer (a client
/// that carries on through a fault).
#[allow(dead_code)] // the fault tests' only; this file is in both test binaries
pub async fn try_strings(url: &SecretString, sql: &str) -> std::collections::HashSet<String> {
    #[derive(QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    let (url, sql) = (url.expose_secret().to_owned(), sql.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).ok()?;
        diesel::sql_query(sql).load::<S>(&mut conn).ok()
    })
    .await
    .ok()
    .flatten()
    .map(|rows| rows.into_iter().map(|r| r.s).collect())
    .unwrap_or_default()
}

/// The first column (TEXT, named `s`) of every row of `sql` on the
/// database at `url`.
#[allow(dead_code)] // the fault tests' only; this file is in both test binaries
pub async fn strings(url: &SecretString, sql: &str) -> std::collections::HashSet<String> {
    #[derive(QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    let sql = sql.to_owned();
    on_database(url, move |conn| {
        diesel::sql_query(sql)
            .load::<S>(conn)
            .expect("query")
            .into_iter()
            .map(|r| r.s)
            .collect()
    })
    .await
}

use diesel::sql_types::BigInt;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use seckill::config::Settings;
use secrecy::ExposeSecret;

use crate::helpers::{create_database, database_url};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

const TABLES: [&str; 9] = [
    "activities",
    "stock",
    "coupons",
    "orders",
    "stock_flow",
    "consume_log",
    "outbox",
    "payments",
    "user_coupons",
];

fn domain_tables(conn: &mut PgConnection) -> i64 {
    let list = TABLES
        .iter()
        .map(|t| format!("'{t}'"))
        .collect::<Vec<_>>()
        .join(",");
    diesel::sql_query(format!(
        "SELECT count(*) AS n FROM information_schema.tables \
         WHERE table_schema = 'public' AND table_name IN ({list})"
    ))
    .get_result::<Count>(conn)
    .unwrap()
    .n
}

/// Best effort: an autovacuum worker (owned by `postgres`) may sit in a new
/// database, and our role cannot end it; `scripts/test.sh` clears leftovers.
fn drop_database(base: &str, name: &str) {
    if let Ok(mut admin) = PgConnection::establish(&database_url(base, "postgres")) {
        for _ in 0..5 {
            let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
            if diesel::sql_query(sql).execute(&mut admin).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

#[tokio::test]
async fn migrations_apply_revert_cleanly_and_apply_again() {
    let settings = Settings::load_env("test").unwrap();
    let name = format!(
        "seckill_test_mig_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let url = create_database(&settings.postgres.url, &name).await;
    let base = settings.postgres.url.expose_secret().to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(url.expose_secret()).unwrap();
        assert_eq!(domain_tables(&mut conn), TABLES.len() as i64);

        let reverted = seckill::store::migrate_down_all(&mut conn).unwrap();
        assert!(!reverted.is_empty());
        assert_eq!(domain_tables(&mut conn), 0, "down leaves no domain table");

        let applied = seckill::store::migrate_up(&mut conn).unwrap();
        assert_eq!(applied, reverted.into_iter().rev().collect::<Vec<_>>());
        assert_eq!(domain_tables(&mut conn), TABLES.len() as i64);
        assert!(
            seckill::store::migrate_up(&mut conn).unwrap().is_empty(),
            "up is idempotent"
        );
        drop(conn);

        drop_database(&base, &name);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_stock_row_refuses_negative_or_unbalanced_figures() {
    let settings = Settings::load_env("test").unwrap();
    let name = format!(
        "seckill_test_mig_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let url = create_database(&settings.postgres.url, &name).await;
    let base = settings.postgres.url.expose_secret().to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(url.expose_secret()).unwrap();
        diesel::sql_query(
            "INSERT INTO activities (sku_id, name, price_cents, start_at, end_at, per_user_limit, \
             pay_timeout_secs, buckets) VALUES (1, 'x', 100, now(), now() + interval '1 hour', 1, 60, 1)",
        )
        .execute(&mut conn)
        .unwrap();
        let insert = |conn: &mut PgConnection, t: i32, a: i32, l: i32, s: i32| {
            diesel::sql_query(format!(
                "INSERT INTO stock (activity_id, total, available, locked, sold) \
                 SELECT id, {t}, {a}, {l}, {s} FROM activities"
            ))
            .execute(conn)
        };
        assert!(insert(&mut conn, 10, -1, 11, 0).is_err(), "negative available refused");
        assert!(insert(&mut conn, 10, 5, 1, 1).is_err(), "total must equal the sum");
        assert!(insert(&mut conn, 10, 8, 1, 1).is_ok());
        let oversell = diesel::sql_query("UPDATE stock SET available = available - 9, locked = locked + 9")
            .execute(&mut conn);
        assert!(oversell.is_err(), "the database refuses to oversell");
        drop(conn);
        drop_database(&base, &name);
    })
    .await
    .unwrap();
}

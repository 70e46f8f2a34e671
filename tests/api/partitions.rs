//! The order table split by buyer (16 partitions by `user_slot`): the
//! server's own queries for "my orders" and for an order by number read
//! one partition, shown by PostgreSQL's plans; and a database with orders
//! made before the split is converted in place, its old numbers still
//! found.

use diesel::pg::Pg;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use seckill::domain::UserId;
use seckill::ids::OrderNo;
use seckill::orders::partition::user_slot;
use seckill::orders::repo;
use secrecy::ExposeSecret;

use crate::helpers::{json, spawn_app};

#[derive(QueryableByName)]
struct Line {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    line: String,
}

/// A Diesel query's SQL with its binds written in (they are all numbers
/// here), as `diesel::debug_query` shows it: `… $1 … -- binds: [a, b]`.
fn inlined(query: &repo::OrderQuery) -> String {
    let shown = diesel::debug_query::<Pg, _>(query).to_string();
    let (sql, binds) = shown.split_once(" -- binds: [").expect("binds shown");
    let binds: Vec<&str> = binds.trim_end_matches(']').split(", ").collect();
    let mut sql = sql.to_owned();
    for (i, b) in binds.iter().enumerate().rev() {
        assert!(b.parse::<i64>().is_ok(), "a number: {b}");
        sql = sql.replace(&format!("${}", i + 1), b);
    }
    sql
}

/// The partitions of `orders` the plan of `sql` reads, as run.
fn partitions_read(conn: &mut PgConnection, sql: &str) -> (Vec<String>, String) {
    let plan: Vec<Line> = diesel::sql_query(format!(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {sql}"
    ))
    .load(conn)
    .expect("EXPLAIN runs");
    let text: Vec<String> = plan.into_iter().map(|l| l.line).collect();
    let mut read: Vec<String> = text
        .iter()
        .filter_map(|l| l.split(" on ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|t| {
            t.strip_prefix("orders_p")
                .is_some_and(|n| n.parse::<u8>().is_ok())
        })
        .map(str::to_owned)
        .collect();
    read.sort();
    read.dedup();
    (read, text.join("\n"))
}

#[tokio::test]
async fn my_orders_and_an_order_by_number_each_read_one_partition() {
    let app = spawn_app().await;
    let activity = app.live_activity(100, 1, 1).await;
    let mut numbers = Vec::new();
    for user in 1..=24 {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        numbers.push((user, body["order_no"].as_str().unwrap().to_owned()));
    }
    app.drained(activity, 24).await;
    // Users 1..=24 fill most of the 16 partitions.
    let filled = app
        .count("SELECT count(DISTINCT tableoid) AS n FROM orders")
        .await;
    assert!(filled >= 10, "{filled} partitions hold orders");

    let url = app.settings.postgres.url.expose_secret().to_owned();
    let checked = numbers.clone();
    let first = numbers[0].clone();
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        for (user, number) in checked {
            let own = format!("orders_p{}", user_slot(user));
            let no = OrderNo::parse(&number).unwrap();
            let uid = UserId::parse(&user.to_string()).unwrap();

            // The row is in its buyer's partition, and its number says so.
            #[derive(QueryableByName)]
            struct Where {
                #[diesel(sql_type = Text)]
                partition: String,
                #[diesel(sql_type = BigInt)]
                gene_slot: i64,
            }
            let at: Where = diesel::sql_query(format!(
                "SELECT tableoid::regclass::text AS partition, \
                 (seckill_order_slot(order_no))::bigint AS gene_slot \
                 FROM orders WHERE order_no = {}",
                no.get()
            ))
            .get_result(&mut conn)
            .unwrap();
            assert_eq!(at.partition, own);
            assert_eq!(at.gene_slot, i64::from(user_slot(user)));

            for (what, query) in [
                ("my orders", repo::list_for_user_query(uid, None, None, 20)),
                (
                    "my orders, next page",
                    repo::list_for_user_query(uid, None, Some(no), 20),
                ),
                ("my order", repo::find_for_user_query(no, uid)),
                ("an order by number", repo::by_number_query(no)),
            ] {
                let (read, plan) = partitions_read(&mut conn, &inlined(&query));
                assert_eq!(read, vec![own.clone()], "{what} of user {user}:\n{plan}");
            }
        }
        // Printed once, for the record.
        let (user, number) = &first;
        let no = OrderNo::parse(number).unwrap();
        for query in [
            repo::list_for_user_query(UserId::parse(&user.to_string()).unwrap(), None, None, 20),
            repo::by_number_query(no),
        ] {
            println!("{}", partitions_read(&mut conn, &inlined(&query)).1);
        }
    })
    .await
    .unwrap();

    // And over HTTP, each buyer sees exactly their order.
    for (user, number) in numbers.iter().take(4) {
        let list = json(
            app.get("/api/v1/orders", Some(&app.user_token(*user)))
                .await,
        )
        .await;
        let orders = list["orders"].as_array().unwrap();
        assert_eq!(orders.len(), 1, "{list}");
        assert_eq!(&orders[0]["order_no"], number);
    }
}

/// Reverts the migrations down to the one that split the order table,
/// that one included.
fn before_the_split(conn: &mut PgConnection) {
    loop {
        let reverted = seckill::store::migrate_down_last(conn).unwrap();
        if reverted == "20261205000008" {
            return;
        }
        assert!(
            reverted.as_str() > "20261205000008",
            "past the split: {reverted}"
        );
    }
}

#[tokio::test]
async fn orders_made_before_the_split_are_converted_in_place_and_found_by_their_old_numbers() {
    let app = spawn_app().await;
    let activity = app.live_activity(100, 5, 1).await;
    let url = app.settings.postgres.url.expose_secret().to_owned();
    // Legacy numbers: no gene (their low bits are not their buyers' slots).
    let legacy: Vec<(i64, i64)> = (1..=40).map(|u| (u, 1_000_000 + u * 16 + 3)).collect();
    let rows = legacy.clone();
    let pay_no = legacy[4].1;
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        before_the_split(&mut conn);
        for (user, no) in &rows {
            diesel::sql_query(format!(
                "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, \
                 amount_cents, status, pay_deadline) \
                 VALUES ({no}, 'legacy-{user}', {activity}, {user}, 1, 100, 'WAITING_PAY', \
                 now() + interval '1 hour')"
            ))
            .execute(&mut conn)
            .unwrap();
        }
        diesel::sql_query(format!(
            "INSERT INTO payments (payment_no, order_no, amount_cents, provider) \
             VALUES (77, {pay_no}, 100, 'mock')"
        ))
        .execute(&mut conn)
        .unwrap();
        let applied = seckill::store::migrate_up(&mut conn).unwrap();
        assert_eq!(applied[0], "20261205000008", "{applied:?}");
    })
    .await
    .unwrap();

    // Every old order is in its buyer's partition, found by its buyer and
    // by its number; the payment still names its order.
    for (user, no) in &legacy {
        let partition = app
            .count(&format!(
                "SELECT (regexp_replace(tableoid::regclass::text, '\\D', '', 'g'))::bigint AS n \
                 FROM orders WHERE order_no = {no}"
            ))
            .await;
        assert_eq!(partition, i64::from(user_slot(*user)), "order {no}");
        let body = json(
            app.get(
                &format!("/api/v1/orders/{no}"),
                Some(&app.user_token(*user)),
            )
            .await,
        )
        .await;
        assert_eq!(body["status"], "WAITING_PAY", "{body}");
        let list = json(
            app.get("/api/v1/orders", Some(&app.user_token(*user)))
                .await,
        )
        .await;
        assert_eq!(list["orders"][0]["order_no"], no.to_string(), "{list}");
    }
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM payments p JOIN orders o \
             ON o.order_no = p.order_no AND o.user_slot = p.order_slot \
             WHERE p.payment_no = 77 AND o.order_no = {pay_no}"
        ))
        .await,
        1
    );

    // New purchases by the same buyers get numbers with genes, beside the
    // old ones; a cancel by an old number works.
    let (status, body) = app.buy(3, activity).await;
    assert_eq!(status, 202, "{body}");
    let fresh: i64 = body["order_no"].as_str().unwrap().parse().unwrap();
    assert_eq!(i64::from(user_slot(3)), fresh & 15);
    app.drained(activity, 41).await;
    let (user, old) = legacy[7];
    assert_eq!(app.cancel(user, &old.to_string()).await.status(), 200);
    let list = json(app.get("/api/v1/orders", Some(&app.user_token(3))).await).await;
    assert_eq!(list["orders"].as_array().unwrap().len(), 2, "{list}");
}

/// A rolling upgrade across the split: an older binary's order events
/// (numbers without genes, above every number written) are still on the
/// broker when the new binary migrates (`seckill migrate`) and its
/// worker starts (`seckill consume`), both real processes. Every one ends
/// WAITING_PAY in its buyer's partition, found by its number, and can be
/// paid.
#[tokio::test]
async fn orders_an_older_binary_left_on_the_broker_are_written_after_the_split() {
    let app = crate::helpers::spawn_app_with(|s| s.orders.consumer_enabled = false).await;
    let activity = app.live_activity(100, 1, 1).await;
    let url = app.settings.postgres.url.expose_secret().to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        before_the_split(&mut conn);
        // Orders the older binary wrote: the largest number written.
        for user in 101..=103_i64 {
            diesel::sql_query(format!(
                "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, \
                 amount_cents, status, pay_deadline) \
                 VALUES ({}, 'written-{user}', {activity}, {user}, 1, 9900, 'WAITING_PAY', \
                 now() + interval '1 hour')",
                1_000_000 + user
            ))
            .execute(&mut conn)
            .unwrap();
        }
    })
    .await
    .unwrap();
    // The ones it left on the broker: larger, and no gene.
    let users: Vec<i64> = (1..=32).collect();
    let number = |user: i64| 5_000_000_000 + user * 16 + (i64::from(user_slot(user)) + 1) % 16;
    for &user in &users {
        let mut event = crate::delivery::event(activity, user, number(user));
        event.request_id = format!("old-{user}");
        crate::delivery::produce(&app, None, &event.event_id, &event.encode()).await;
    }
    let migrated = app.seckill(&["migrate"]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let _worker = crate::helpers::KillOnDrop(
        app.seckill_command(&["consume"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("seckill consume starts"),
    );
    crate::helpers::eventually(
        "every order written",
        std::time::Duration::from_secs(120),
        || async {
            let written = app
                .count(&format!(
                    "SELECT count(*) AS n FROM orders WHERE activity_id = {activity} \
                 AND request_id LIKE 'old-%'"
                ))
                .await;
            (written == users.len() as i64).then_some(())
        },
    )
    .await;
    let stats = app.stats(activity).await;
    assert_eq!(stats["orders"]["FAILED"], 0, "{stats}");
    assert_eq!(stats["orders"]["WAITING_PAY"], 35, "{stats}");
    for &user in &users {
        let no = number(user);
        let partition = app
            .count(&format!(
                "SELECT (regexp_replace(tableoid::regclass::text, '\\D', '', 'g'))::bigint AS n \
                 FROM orders WHERE order_no = {no}"
            ))
            .await;
        assert_eq!(partition, i64::from(user_slot(user)), "order {no}");
        assert_eq!(app.order_status(user, &no.to_string()).await, "WAITING_PAY");
    }
    // Paid by its number: the payment keeps the row's slot.
    let payment = app.payment(1, &number(1).to_string()).await;
    let (body, signature) = app.signed_callback(&payment, "SUCCESS", 9900, None, 0);
    assert_eq!(app.notify(body, Some(&signature)).await.status(), 200);
    assert_eq!(app.order_status(1, &number(1).to_string()).await, "PAID");
}

/// A newer binary migrated (a version this binary does not know is
/// applied): this one's order consumer holds its batches, writing
/// nothing, until the schema is one it knows.
#[tokio::test]
async fn an_older_binary_writes_no_order_on_a_schema_it_does_not_know() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    app.execute("INSERT INTO __diesel_schema_migrations (version) VALUES ('29991231000000')")
        .await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    let order_no = body["order_no"].as_str().unwrap().to_owned();
    crate::helpers::eventually(
        "the batch held",
        std::time::Duration::from_secs(60),
        || async {
            (app.metric("seckill_consumer_schema_holds_total")
                .await
                .unwrap_or(0)
                > 0)
            .then_some(())
        },
    )
    .await;
    assert_eq!(app.order_status(1, &order_no).await, "PROCESSING");
    app.execute("DELETE FROM __diesel_schema_migrations WHERE version = '29991231000000'")
        .await;
    crate::helpers::eventually(
        "written once the schema is known",
        std::time::Duration::from_secs(60),
        || async { (app.order_status(1, &order_no).await == "WAITING_PAY").then_some(()) },
    )
    .await;
}

//! Reads from a streaming replica replaying 3 s behind its primary
//! (`scripts/services.sh up --pg-replica`, `recovery_min_apply_delay`):
//! a buyer is never told "no such order" and never shown an order older
//! than already shown, and with the replica stopped every read goes to
//! the primary and readiness says so.

use std::process::Command;
use std::time::{Duration, Instant};

use diesel::sql_types::BigInt;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use futures_util::stream::{self, StreamExt};
use secrecy::ExposeSecret;
use serde_json::{Value, json};

use crate::helpers::{TestApp, eventually, json, reads_from_the_replica, spawn_app_with};
use crate::streams::Stream;

/// How far along an order is, as its buyer sees it: PROCESSING, then
/// WAITING_PAY, then WAITING_PAY with its payment, then PAID.
fn stage(order: &Value) -> u8 {
    match order["status"].as_str() {
        Some("PROCESSING") => 0,
        Some("WAITING_PAY") if order["payment"].is_null() => 1,
        Some("WAITING_PAY") => 2,
        Some("PAID") => 3,
        _ => panic!("an order in no stage of this test: {order}"),
    }
}

#[derive(QueryableByName)]
struct Lsn {
    #[diesel(sql_type = BigInt)]
    lsn: i64,
}

/// One WAL position read with `sql` on the database at `url`, or why not.
/// A hot standby may cancel even a new session's first reads when the WAL
/// it replays conflicts with them ("conflict with recovery"): a replica's
/// caller asks again.
async fn lsn(url: String, sql: &'static str) -> Result<i64, String> {
    tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).map_err(|e| e.to_string())?;
        diesel::sql_query(sql)
            .get_result::<Lsn>(&mut conn)
            .map(|r| r.lsn)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap()
}

impl TestApp {
    /// Waits until the replica has replayed all the primary had written
    /// when this was called, and the server's watcher (every 200 ms) has
    /// had time to see it. Asked of the databases, not through reads: a
    /// buyer's read from the primary notes a newer position each time.
    async fn replica_caught_up(&self) {
        let primary = self.settings.postgres.url.expose_secret().to_owned();
        let replica = self
            .settings
            .postgres
            .replica_url
            .expose_secret()
            .to_owned();
        let target = lsn(
            primary,
            "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint AS lsn",
        )
        .await
        .expect("the primary's WAL position");
        eventually(
            "the replica caught up",
            Duration::from_secs(120),
            || async {
                let replayed = lsn(
                    replica.clone(),
                    "SELECT COALESCE((pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint, 0) AS lsn",
                )
                .await;
                match replayed {
                    Ok(replayed) => (replayed >= target).then_some(()),
                    Err(e) => {
                        eprintln!("the replica's position unread, asked again: {e}");
                        None
                    }
                }
            },
        )
        .await;
        // Two of the watcher's samples: it only makes a read the replica's
        // sooner, never an answer wrong.
        tokio::time::sleep(2 * seckill::replica::WATCH_EVERY).await;
    }

    /// `/health/ready`'s replica, once `check` holds of it.
    async fn replica_once(&self, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        eventually(what, Duration::from_secs(120), || async {
            let res = self.get("/health/ready", None).await;
            let status = res.status();
            let body = json(res).await;
            // Never unready because of the replica. Another dependency
            // may be (a fresh Kafka client unanswered for 7 s on a host
            // busy with other suites): the replica's figures stand anyway.
            if status != 200 {
                assert_eq!(status, 503, "{body}");
                let detail = body["detail"].as_str().unwrap_or_default();
                assert!(
                    !detail.contains("replica") && body["checks"].get("replica").is_none(),
                    "a replica never makes the instance unready: {body}"
                );
                println!("unready for another dependency: {detail}");
            }
            let replica = body["replica"].clone();
            check(&replica).then_some(replica)
        })
        .await
    }

    /// The order as its buyer reads it now: 200 (after any 503s, read
    /// again as a client does: the database busy, never lag), at a stage
    /// no earlier than `shown`.
    async fn read_no_earlier(&self, user: i64, order_no: &str, shown: u8) -> u8 {
        let deadline = Instant::now() + Duration::from_secs(60);
        let (status, body) = loop {
            let res = self
                .get(
                    &format!("/api/v1/orders/{order_no}"),
                    Some(&self.user_token(user)),
                )
                .await;
            let status = res.status();
            let body = json(res).await;
            if status == 503 && body["code"] == "RETRY_LATER" && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            break (status, body);
        };
        assert_eq!(status, 200, "user {user}, order {order_no}: {body}");
        let now = stage(&body);
        assert!(
            now >= shown,
            "user {user}, order {order_no}: shown stage {shown}, then {body}"
        );
        now
    }

    /// Reads until the order is at `stage` at least, every 200 ms.
    async fn read_until(&self, user: i64, order_no: &str, mut shown: u8, stage: u8) -> (u8, u32) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut reads = 0;
        loop {
            shown = self.read_no_earlier(user, order_no, shown).await;
            reads += 1;
            if shown >= stage {
                return (shown, reads);
            }
            assert!(
                Instant::now() < deadline,
                "user {user}, order {order_no}: still at stage {shown}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// One buyer: buys, reads until WAITING_PAY, pays, reads, has the
    /// payment succeed, reads until PAID, and lists their orders. Returns
    /// the reads made.
    async fn buy_pay_and_watch(&self, activity: i64, user: i64) -> u32 {
        let (status, body) = self.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        let no = body["order_no"].as_str().unwrap().to_owned();
        let (shown, mut reads) = self.read_until(user, &no, 0, 1).await;
        let payment = self.payment(user, &no).await;
        assert_eq!(payment["status"], "PENDING", "{payment}");
        // Paying showed the payment: from now on it is always there.
        let shown = self.read_no_earlier(user, &no, shown.max(2)).await;
        reads += 1;
        self.payment_succeeds(user, &payment).await;
        let (shown, more) = self.read_until(user, &no, shown, 3).await;
        reads += more;
        let listed = eventually("the buyer's list", Duration::from_secs(60), || async {
            let res = self
                .get("/api/v1/orders", Some(&self.user_token(user)))
                .await;
            let status = res.status();
            let body = json(res).await;
            assert!(status == 200 || status == 503, "{status} {body}");
            (status == 200).then_some(body)
        })
        .await;
        let mine = listed["orders"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["order_no"] == no.as_str())
            .unwrap_or_else(|| panic!("user {user}'s list lost {no}: {listed}"));
        assert_eq!(mine["status"], "PAID", "the list went back: {listed}");
        assert_eq!(shown, 3);
        reads + 1
    }

    /// The provider's callback of `payment` succeeding, sent again until
    /// it is answered 200, as a provider does.
    async fn payment_succeeds(&self, user: i64, payment: &Value) {
        let path = format!(
            "/api/v1/dev/payments/{}/simulate",
            payment["payment_no"].as_str().unwrap()
        );
        eventually(
            "the payment callback answered",
            Duration::from_secs(60),
            || async {
                let res = self
                    .post_json(
                        &path,
                        &json!({"status": "SUCCESS", "times": 1}),
                        Some(&self.user_token(user)),
                    )
                    .await;
                assert_eq!(res.status(), 200);
                (json(res).await["responses"] == json!([200])).then_some(())
            },
        )
        .await;
    }

    fn reads_from(&self, source: &str) -> String {
        format!("seckill_order_reads_total{{source=\"{source}\"}}")
    }
}

/// `scripts/services.sh stop|start postgres-replica`.
fn replica(action: &str) {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(format!("{root}/scripts/services.sh"))
        .args([action, "postgres-replica"])
        .current_dir(root)
        .output()
        .expect("run scripts/services.sh");
    assert!(
        out.status.success(),
        "services.sh {action} postgres-replica: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 1,000 buyers, 50 at a time, each buys, reads, pays and reads again
/// against a replica 3 s behind: every read answers 200 and no order goes
/// back a stage (PROCESSING, WAITING_PAY, with its payment, PAID), in the
/// order view or in the buyer's list. The reads were answered by all
/// three: the replica, Redis (PROCESSING, the row not replayed yet) and
/// the primary (the buyer shown more than the replica has). Then the
/// replica stops: readiness says so, stays 200, and reads go to the
/// primary; it starts again and is read from again.
#[tokio::test]
async fn a_buyer_read_from_a_replica_3_s_behind_never_loses_an_order_nor_sees_it_go_back() {
    let app = spawn_app_with(reads_from_the_replica).await;
    // The test's database reaches the replica 3 s after its creation.
    let seen = app
        .replica_once("the replica read from", |r| r["reads"] == "replica")
        .await;
    println!("replica before the buyers: {seen}");
    let buyers = 1000;
    let activity = app.live_activity(buyers as i32, 1, 4).await;
    let began = Instant::now();
    let reads: u32 = stream::iter(1..=buyers)
        .map(|user| {
            let app = &app;
            async move { app.buy_pay_and_watch(activity, user).await }
        })
        .buffer_unordered(50)
        .fold(0, |sum, n| async move { sum + n })
        .await;
    let mut by_source = Vec::new();
    for source in ["replica", "redis", "primary"] {
        let n = app.metric(&app.reads_from(source)).await.unwrap_or(0);
        by_source.push((source, n));
    }
    println!(
        "{buyers} buyers, {reads} reads in {:.1}s; answered from {by_source:?}",
        began.elapsed().as_secs_f64()
    );
    for (source, n) in &by_source {
        assert!(*n > 0, "no read answered from the {source}: {by_source:?}");
    }
    assert_eq!(app.stats(activity).await["db_sold"], buyers);

    replica("stop");
    let down = app
        .replica_once("the replica seen down", |r| {
            r["state"] == "down" && r["reads"] == "primary"
        })
        .await;
    println!("replica stopped: {down}");
    let before = app.metric(&app.reads_from("primary")).await.unwrap_or(0);
    let (status, body) = app.buy(buyers + 1, activity).await;
    assert_eq!(status, 409, "sold out: {body}");
    let listed = eventually("user 1's list", Duration::from_secs(60), || async {
        let res = app.get("/api/v1/orders", Some(&app.user_token(1))).await;
        let status = res.status();
        let body = json(res).await;
        assert!(status == 200 || status == 503, "{status} {body}");
        (status == 200).then_some(body)
    })
    .await;
    assert_eq!(listed["orders"][0]["status"], "PAID", "{listed}");
    let after = app.metric(&app.reads_from("primary")).await.unwrap_or(0);
    assert_eq!(after, before + 1, "the list was read from the primary");

    replica("start");
    let back = app
        .replica_once("the replica read from again", |r| r["reads"] == "replica")
        .await;
    println!("replica started again: {back}");
}

/// #59 (5): a status a purchase retry answered, and one an order stream
/// pushed, were read on the primary like any other, and are noted: the
/// buyer's next read, at once, is no older, although the replica (3 s
/// behind) has replayed all they had read before. Without the notes, the
/// read after the retry finds no row on the replica (PROCESSING), and the
/// read after the pushed PAID finds WAITING_PAY there.
#[tokio::test]
async fn a_status_a_retry_answered_or_a_stream_pushed_is_never_read_back_older() {
    let app = spawn_app_with(reads_from_the_replica).await;
    app.replica_once("the replica read from", |r| r["reads"] == "replica")
        .await;
    let activity = app.live_activity(10, 1, 4).await;
    // The replica has the activity, and is past the floor set when the
    // server started: a buyer who read nothing is read from it.
    app.replica_caught_up().await;
    let user = 1;
    let request_id = uuid::Uuid::new_v4().to_string();
    let (status, body) = app.buy_as(user, activity, &request_id).await;
    assert_eq!(status, 202, "{body}");
    let no = body["order_no"].as_str().unwrap().to_owned();
    // Written, as the operator sees it; the buyer has read nothing yet.
    eventually("the order written", Duration::from_secs(60), || async {
        (app.stats(activity).await["orders"]["WAITING_PAY"] == 1).then_some(())
    })
    .await;
    let (status, body) = app.buy_as(user, activity, &request_id).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("WAITING_PAY")),
        "{body}"
    );
    app.read_no_earlier(user, &no, 1).await;

    let mut stream = Stream::of(&app, user, &no).await;
    assert_eq!(stream.status().await, "WAITING_PAY");
    let payment = app.payment(user, &no).await;
    assert_eq!(payment["status"], "PENDING", "{payment}");
    // The replica has replayed the payment, and all the buyer was shown.
    app.replica_caught_up().await;
    app.payment_succeeds(user, &payment).await;
    assert_eq!(stream.status().await, "PAID");
    app.read_no_earlier(user, &no, 3).await;
}

//! One hot activity spread over Redis shards (docs/HOT_ACTIVITY.md): each
//! buyer is routed to one shard, an empty shard borrows units from the
//! others, SOLD_OUT means none left anywhere, and reconciliation sums the
//! shards, completes transfers cut short and restores a lost activity into
//! the shards its orders live in. `scripts/test.sh` runs these on a single
//! Redis and again on the 3-master cluster, where the shards sit on
//! different masters.

use std::time::Duration;

use futures_util::future::join_all;
use seckill::admission::Layout;
use seckill::admission::keys::ActivityKeys;
use seckill::domain::ActivityId;
use serde_json::json;

use crate::helpers::{TestApp, json, spawn_app, spawn_app_with};

/// An open activity of `stock` units over `shards` shards, warmed.
async fn sharded_activity(app: &TestApp, stock: i32, buckets: i32, shards: i32) -> i64 {
    let now = chrono::Utc::now();
    let body = json!({
        "sku_id": 7, "name": "Hot phone", "price_cents": 9900, "stock": stock,
        "start_at": now - chrono::Duration::seconds(5),
        "end_at": now + chrono::Duration::hours(1),
        "per_user_limit": 1, "buckets": buckets, "shards": shards,
    });
    let res = app
        .post_json("/api/v1/admin/activities", &body, Some(&app.admin_token()))
        .await;
    assert_eq!(res.status(), 201);
    let created = json(res).await;
    assert_eq!(created["shards"], shards);
    let id = created["activity_id"].as_i64().unwrap();
    app.warmup(id).await;
    id
}

/// `n` user ids from `from` on whose shard is `shard`.
fn buyers_of(layout: Layout, shard: usize, n: usize, from: i64) -> Vec<i64> {
    (from..)
        .filter(|u| layout.shard_of_user(*u) == shard)
        .take(n)
        .collect()
}

/// The units in each shard's buckets, read straight from Redis.
async fn shard_units(app: &TestApp, activity: i64, layout: Layout) -> Vec<i64> {
    let mut conn = app.redis();
    let mut units = Vec::new();
    for shard in 0..layout.shards {
        let k = ActivityKeys::shard(
            &app.settings.redis.key_prefix,
            ActivityId::new(activity),
            layout,
            shard,
        );
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(k.buckets(layout.buckets))
            .query_async(&mut conn)
            .await
            .unwrap();
        units.push(values.into_iter().flatten().sum());
    }
    units
}

/// One reconciliation run's report of `activity`.
async fn reconcile(app: &TestApp, activity: i64) -> serde_json::Value {
    crate::reconcile::report(&crate::reconcile::reconcile(app).await, activity)
}

#[tokio::test]
async fn buyers_of_one_shard_buy_the_units_of_every_shard_and_not_one_more() {
    let app = spawn_app().await;
    let layout = Layout::new(2, 3);
    let activity = sharded_activity(&app, 30, 2, 3).await;
    assert_eq!(shard_units(&app, activity, layout).await, vec![10, 10, 10]);

    // 40 buyers, all routed to shard 0: its 10 units go first, then it
    // must borrow the other shards' 20.
    let buyers = buyers_of(layout, 0, 40, 1);
    let answers = join_all(buyers.iter().map(|&u| app.buy(u, activity))).await;
    let accepted: Vec<(i64, String)> = buyers
        .iter()
        .zip(&answers)
        .filter(|(_, (status, _))| *status == 202)
        .map(|(&u, (_, body))| (u, body["order_no"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(accepted.len(), 30, "exactly the stock: {answers:?}");
    for (status, body) in answers.iter().filter(|(s, _)| *s != 202) {
        assert_eq!((*status, body["code"].as_str()), (409, Some("SOLD_OUT")));
    }
    let stats = app.drained(activity, 30).await;
    app.assert_each_order_once(&stats, 30).await;
    assert_eq!(stats["db_available"], 0);
    assert_eq!(shard_units(&app, activity, layout).await, vec![0, 0, 0]);
    // Every order lives in its buyer's shard: its number says so.
    for (_, order_no) in &accepted {
        assert_eq!(layout.shard_of_order(order_no.parse().unwrap()), 0);
    }

    // The per-user limit holds in the shard.
    let (u, _) = accepted[0];
    let (status, body) = app.buy(u, activity).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("LIMIT_EXCEEDED"))
    );

    // A cancelled order's unit goes back to its own shard (0); a buyer of
    // shard 2, whose shard is empty, borrows it from there.
    let (u, order_no) = &accepted[1];
    assert_eq!(app.cancel(*u, order_no).await.status(), 200);
    app.wait_for_stats(activity, |s| s["redis_available"] == 1)
        .await;
    assert_eq!(shard_units(&app, activity, layout).await, vec![1, 0, 0]);
    let late = buyers_of(layout, 2, 1, 1_000)[0];
    let (status, body) = app.buy(late, activity).await;
    assert_eq!(status, 202, "{body}");
    let stats = app.drained(activity, 30).await;
    assert_eq!(stats["redis_available"], 0);
    assert_eq!(stats["db_available"], 0);
    assert_eq!(stats["orders"]["CANCELLED"], 1);

    let report = reconcile(&app, activity).await;
    assert_eq!(report["consistent"], true, "{report}");
    assert_eq!(report["repaired"], json!([]), "{report}");
}

#[tokio::test]
async fn units_lent_by_a_shard_whose_borrower_never_took_them_are_credited_by_reconciliation() {
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let layout = Layout::new(1, 3);
    let activity = sharded_activity(&app, 12, 1, 3).await;

    // What a process dying between lend.lua and borrow.lua leaves: shard 1
    // took 3 units off its bucket and recorded them lent to shard 0.
    let mut conn = app.redis();
    let donor = ActivityKeys::shard(
        &app.settings.redis.key_prefix,
        ActivityId::new(activity),
        layout,
        1,
    );
    let long_ago = chrono::Utc::now().timestamp_millis() - 120_000;
    let _: () = redis::pipe()
        .cmd("DECRBY")
        .arg(donor.bucket(0))
        .arg(3)
        .ignore()
        .cmd("HSET")
        .arg(donor.lent())
        .arg("died.1")
        .arg(format!("0:3:{long_ago}"))
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(shard_units(&app, activity, layout).await, vec![4, 1, 4]);
    // Redis's figure counts units in flight between shards.
    assert_eq!(app.stats(activity).await["redis_available"], 12);

    let report = reconcile(&app, activity).await;
    assert_eq!(report["consistent"], true, "{report}");
    assert!(
        report["repaired"]
            .to_string()
            .contains("completed 1 unsettled transfer"),
        "{report}"
    );
    assert_eq!(shard_units(&app, activity, layout).await, vec![7, 1, 4]);
    let lent: i64 = redis::cmd("HLEN")
        .arg(donor.lent())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(lent, 0);
    assert_eq!(app.stats(activity).await["redis_available"], 12);

    // Completed once: a second run finds nothing to do.
    let again = reconcile(&app, activity).await;
    assert_eq!(again["repaired"], json!([]), "{again}");
    assert_eq!(shard_units(&app, activity, layout).await, vec![7, 1, 4]);
}

/// Defect 10 of issue #25, second half: every unit sat in a transfer whose
/// process died between lend and credit. A purchase found them "on their
/// way" for all its rounds of borrowing and answered SOLD_OUT, though the
/// units were there. Now it completes the stale transfer itself and buys.
#[tokio::test]
async fn a_purchase_that_finds_every_unit_in_a_stale_transfer_completes_it_and_buys() {
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let layout = Layout::new(1, 3);
    let activity = sharded_activity(&app, 3, 1, 3).await;
    assert_eq!(shard_units(&app, activity, layout).await, vec![1, 1, 1]);
    // Shard 1 lent every unit there is to shard 0 and its process died
    // before shard 0 was credited.
    let mut conn = app.redis();
    let prefix = &app.settings.redis.key_prefix;
    let donor = ActivityKeys::shard(prefix, ActivityId::new(activity), layout, 1);
    let long_ago = chrono::Utc::now().timestamp_millis() - 60_000;
    // One command at a time: on a cluster the shards sit in other slots.
    for shard in 0..3 {
        let k = ActivityKeys::shard(prefix, ActivityId::new(activity), layout, shard);
        let _: () = redis::cmd("SET")
            .arg(k.bucket(0))
            .arg(0)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let _: () = redis::cmd("HSET")
        .arg(donor.lent())
        .arg("died.1")
        .arg(format!("0:3:{long_ago}"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(shard_units(&app, activity, layout).await, vec![0, 0, 0]);

    // A buyer of shard 2: its shard is empty, shard 0 has nothing yet,
    // shard 1 has units on their way. (Bought as a client does: a 503
    // whose delivery is unconfirmed, on a starved host, is retried.)
    let user = buyers_of(layout, 2, 1, 1)[0];
    let (status, body) = app.buy(user, activity).await;
    assert_eq!(status, 202, "{body}");
    // The other two units are in shard 0 or 2 now, none lost.
    let units: i64 = shard_units(&app, activity, layout).await.iter().sum();
    assert_eq!(units, 2);
    let lent: i64 = redis::cmd("HLEN")
        .arg(donor.lent())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(lent, 0, "the stale transfer is settled");
}

#[tokio::test]
async fn a_sharded_activity_redis_lost_is_restored_into_the_shards_its_buyers_and_orders_live_in() {
    let app = spawn_app_with(crate::helpers::restores_quickly).await;
    let activity = sharded_activity(&app, 12, 1, 3).await;
    let order_nos = app.buy_as_r_user(activity, 1..=6).await;
    app.drained(activity, 6).await;

    // Redis loses everything of the activity: its base keys and every
    // shard's. The reconciler is held off until the loss has been seen (it
    // could restore two seconds after it saw it, before the read on a
    // busy host).
    let lease = app.hold_the_reconcile_lease().await;
    app.forget_in_redis(activity).await;
    assert_eq!(app.stats(activity).await["redis_available"], 0);
    lease.end_lease("reconcile", "another").await.unwrap();

    // Restored by itself, into the right shards: replays and limits hold
    // for buyers of every shard.
    app.wait_for_stats(activity, |s| s["redis_available"] == 6)
        .await;
    // The restore moves the sale through RESTORING and back; an instance
    // that read the modes in between answers 503 "retry shortly" until its
    // next read (a second), as a client would retry.
    crate::helpers::eventually(
        "the sale back on Redis",
        Duration::from_secs(30),
        || async {
            let (status, _) = app.replay_as_r_user(activity, 1).await;
            (status != 503).then_some(())
        },
    )
    .await;
    for user in 1..=3 {
        let (status, replay) = app.replay_as_r_user(activity, user).await;
        assert_eq!(status, 200, "{replay}");
        assert_eq!(replay["order_no"], order_nos[user as usize - 1].as_str());
        assert_eq!(replay["status"], "WAITING_PAY");
    }
    for user in 4..=6 {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("LIMIT_EXCEEDED"))
        );
    }
    // A live order's record is back in its shard: a cancel gives its unit
    // back once.
    assert_eq!(app.cancel(1, &order_nos[0]).await.status(), 200);
    let stats = app
        .wait_for_stats(activity, |s| s["redis_available"] == 7)
        .await;
    assert_eq!(stats["db_available"], 7);
    let report = reconcile(&app, activity).await;
    assert_eq!(report["consistent"], true, "{report}");
    assert_eq!(app.stats(activity).await["redis_available"], 7);
}

/// Defect 6 of issue #25: one shard of a sharded activity lost (the Redis
/// master holding its slots restarted empty) while the base keys and the
/// other shards stay. It used to go unnoticed, since only the base meta
/// was checked, and the lost shard's buyers got 503 for good. The
/// activity is now restored whole: every shard's buyers are served, and
/// replays in the lost shard still find their orders.
#[tokio::test]
async fn a_sharded_activity_that_lost_one_shard_is_restored_and_that_shards_buyers_are_served() {
    let app = spawn_app_with(crate::helpers::restores_quickly).await;
    let activity = sharded_activity(&app, 12, 1, 3).await;
    let layout = Layout::new(1, 3);
    let order_nos = app.buy_as_r_user(activity, 1..=6).await;
    app.drained(activity, 6).await;

    // Every key of shard 1, and nothing else.
    let lost = 1;
    let pattern = format!("{}{{a:{activity}:{lost}.*", app.settings.redis.key_prefix);
    assert!(
        app.forget_keys(&pattern).await > 0,
        "shard {lost} has keys to lose"
    );

    // A buyer of the lost shard gets a unit again, and a replay of an order
    // that lived there finds it.
    let newcomer = (100..).find(|u| layout.shard_of_user(*u) == lost).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let (status, body) = app.buy(newcomer, activity).await;
        if status == 202 || status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lost shard's buyers are still refused: {status} {body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    for user in (1..=6).filter(|u| layout.shard_of_user(*u) == lost) {
        let (status, replay) = app.replay_as_r_user(activity, user).await;
        assert_eq!(status, 200, "{replay}");
        assert_eq!(replay["order_no"], order_nos[user as usize - 1].as_str());
    }
    let stats = app
        .wait_for_stats(activity, |s| {
            s["reservations_open"] == 0 && s["redis_available"] == s["db_available"]
        })
        .await;
    assert_eq!(stats["db_available"], 12 - 7, "{stats}");
}

/// A sharded activity's repair, decided before a cancel and a purchase in
/// another shard than the one it writes (shard 0) that cancel out in the
/// sum: not applied, as in one shard (`reconcile::a_repair_decided_before_
/// a_purchase_and_a_cancel_that_cancel_out_is_not_applied`). The other
/// shards' sums and open sets are as the mark read them; only their
/// acceptance counts tell.
#[tokio::test]
async fn a_sharded_repair_decided_before_a_purchase_and_a_cancel_that_cancel_out_is_not_applied() {
    use seckill::admission::RedisGate;
    use seckill::reconcile::repairs::Repairs;

    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let activity = sharded_activity(&app, 6, 1, 3).await;
    let (id, layout) = (ActivityId::new(activity), Layout::new(1, 3));
    let buyers = buyers_of(layout, 1, 3, 1);
    let mut orders = Vec::new();
    for &user in &buyers[..2] {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        orders.push(body["order_no"].as_str().unwrap().to_owned());
    }
    app.drained(activity, 2).await;
    let gate = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    let repairs = Repairs::new(&gate, i64::MAX);
    let repaired = crate::reconcile::repair_across_a_cancel_and_a_purchase(
        &app,
        &repairs,
        id,
        layout,
        (buyers[0], &orders[0]),
        buyers[2],
    )
    .await;
    assert_eq!(
        repaired, None,
        "a repair gave Redis a unit the database does not have"
    );
    assert_eq!(
        shard_units(&app, activity, layout)
            .await
            .iter()
            .sum::<i64>(),
        4
    );
}

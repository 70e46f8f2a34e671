//! Fault tests on the engines of a real deployment (`scripts/chaos.sh
//! --replicated`): Kafka with three brokers, replication factor 3 and
//! `min.insync.replicas` 2, and a PostgreSQL primary with a synchronous
//! standby under pg_auto_failover, reached through a multi-host URL. Each
//! hits one broker or one node of them mid-sale, then checks the same
//! invariants as every other fault test, and that the server never had to
//! be restarted.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{self, Chaos, Fault, Sale, signal, signal_group};

/// How long after a fault healed the instance must sell again (a 202 to a
/// new buyer) in these tests: what the issue promises is 30 s; this is
/// sized for a loaded 2-core host three times slower, and each test prints
/// what it took.
const SELLS_AGAIN_WITHIN: Duration = Duration::from_secs(120);

/// The replicated services, or a clear refusal to run on the others.
async fn start(name: &str) -> Chaos {
    let chaos = Chaos::start(name).await;
    assert!(
        chaos.services.replicated(),
        "{name} needs the replicated services: run it with scripts/chaos.sh --replicated"
    );
    chaos
}

/// The order topic of this test's server.
fn order_topic(chaos: &Chaos) -> String {
    format!("{}order.requested", chaos.topic_prefix())
}

/// The broker leading partition 0 of the order topic, waiting for one.
async fn leader(chaos: &Chaos) -> usize {
    let topic = order_topic(chaos);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(n) = chaos.services.leader_of(&topic, 0).await {
            return n;
        }
        assert!(Instant::now() < deadline, "{topic}[0] has no leader");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// None of these faults may cost a restart of the server.
fn assert_never_restarted(chaos: &Chaos) {
    assert!(
        chaos.server_exited().is_none(),
        "the server exited by itself: {}",
        chaos.logs()
    );
}

/// An activity of its own with more units than any test sells, for
/// [`sells_again`]: the sale under test sells out, and a buyer who hears
/// SOLD_OUT says nothing of whether the broker takes writes again.
async fn spare_activity(chaos: &Chaos) -> i64 {
    Sale::new(chaos, 0, 100_000).await.activity
}

/// Seconds until a new buyer (from `user` on) of `activity` (a
/// [`spare_activity`]) is accepted; panics past [`SELLS_AGAIN_WITHIN`]. A
/// server that exits by itself fails the test: none of these faults may
/// cost a restart.
async fn sells_again(chaos: &Chaos, activity: i64, mut user: i64) -> f64 {
    let from = Instant::now();
    loop {
        assert_never_restarted(chaos);
        let asked = Instant::now();
        let status = chaos.purchase_once(activity, user).await;
        if status == 202 {
            return from.elapsed().as_secs_f64();
        }
        eprintln!(
            "{:.1}s after the fault: a new buyer's purchase answered {status} in {:.1}s",
            from.elapsed().as_secs_f64(),
            asked.elapsed().as_secs_f64()
        );
        user += 1;
        assert!(
            from.elapsed() < SELLS_AGAIN_WITHIN,
            "not selling {}s after the fault healed; see {}",
            SELLS_AGAIN_WITHIN.as_secs(),
            chaos.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The leader of the order topic's partition SIGKILLed in the middle of the
/// burst, started again 20 s later: no 202 lost or duplicated, and buying
/// goes on (its partitions get a new leader from the in-sync replicas)
/// without a restart of the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_partition_leader_killed_mid_sale_loses_and_duplicates_nothing() {
    leader_hit("leader_killed", "KILL", Duration::from_secs(20)).await;
}

/// The leader stopped (SIGSTOP) for 30 s: fenced by the controllers while
/// it is away, its partitions led by another broker; the same outcome as
/// the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_partition_leader_paused_thirty_seconds_loses_and_duplicates_nothing() {
    leader_hit("leader_paused", "STOP", Duration::from_secs(30)).await;
}

/// A sale of 2,000 buyers for 1,500 units whose order-topic leader gets
/// `sig` (KILL or STOP) a third of the way in; `hold` after it, the broker
/// is started again (KILL) or continued (STOP). Then the invariants, and
/// no restart of the server.
async fn leader_hit(name: &str, sig: &'static str, hold: Duration) {
    let chaos = start(name).await;
    let spare = spare_activity(&chaos).await;
    let sale = Sale::new(&chaos, 2000, 1500).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            let n = leader(&chaos).await;
            let pid = chaos.services.broker_pid(n).await;
            eprintln!("{name}: broker {n} leads; SIG{sig}");
            signal(pid, sig);
            let hit = Instant::now();
            let _resume = harness::OnDrop(move || {
                if sig == "STOP" {
                    signal(pid, "CONT");
                }
            });
            let after = sells_again(&chaos, spare, 900_000).await;
            eprintln!("{name}: a new buyer accepted {after:.1}s after SIG{sig}");
            tokio::time::sleep(hold.saturating_sub(hit.elapsed())).await;
            if sig == "KILL" {
                chaos.services.start_broker(n).await;
            }
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    assert_never_restarted(&chaos);
}

/// Two of three brokers down: the one left leads every partition alone,
/// below `min.insync.replicas`, and refuses every write. Purchases answer
/// 503 RETRY_LATER with a Retry-After, nothing is accepted, readiness says
/// why, and the instance does not restart itself (for three times the
/// stall window and more). Once the brokers are back it sells again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn two_brokers_down_refuse_purchases_without_a_restart_loop_and_it_sells_again_after() {
    let chaos = start("two_brokers_down").await;
    let spare = spare_activity(&chaos).await;
    let sale = Sale::new(&chaos, 600, 400).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            let keep = leader(&chaos).await;
            let down: Vec<usize> = (1..=3).filter(|n| *n != keep).collect();
            for &n in &down {
                signal(chaos.services.broker_pid(n).await, "KILL");
            }
            eprintln!("two_brokers_down: brokers {down:?} killed; broker {keep} left");
            let killed = Instant::now();
            // The controllers fence the dead brokers (their sessions end)
            // and the survivor's in-sync replicas shrink to itself.
            let refused = loop {
                let res = chaos
                    .client()
                    .get(chaos.url("/health/ready"))
                    .send()
                    .await
                    .ok();
                if let Some(res) = res {
                    let body = res.text().await.unwrap_or_default();
                    if body.contains("refuse writes") {
                        break body;
                    }
                }
                assert!(
                    killed.elapsed() < Duration::from_secs(120),
                    "readiness never said the brokers refuse writes"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            };
            eprintln!(
                "two_brokers_down: readiness at {:.1}s: {refused}",
                killed.elapsed().as_secs_f64()
            );
            // 90 s more: well past three rebuild windows (10 s each) and
            // the liveness grace, with purchases refused all along.
            let mut refusals = 0;
            while killed.elapsed() < Duration::from_secs(90) {
                assert!(
                    chaos.server_exited().is_none(),
                    "the server exited while the brokers refused writes; see {}",
                    chaos.logs()
                );
                let (status, retry_after, body) = purchase(&chaos, spare, 800_000 + refusals).await;
                assert_eq!(status, 503, "accepted with two brokers down: {body}");
                assert_eq!(body["code"], "RETRY_LATER", "{body}");
                assert!(retry_after.is_some_and(|s| s >= 1), "{body}");
                refusals += 1;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            assert_eq!(
                chaos.log_lines_with("cannot heal"),
                0,
                "the instance gave up: {}",
                chaos.logs()
            );
            eprintln!("two_brokers_down: {refusals} purchases refused 503 RETRY_LATER, no restart");
            for &n in &down {
                chaos.services.start_broker(n).await;
            }
            let after = sells_again(&chaos, spare, 900_000).await;
            eprintln!("two_brokers_down: sells again {after:.1}s after the brokers were back");
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
}

/// One purchase, not retried: status, Retry-After, body.
async fn purchase(chaos: &Chaos, activity: i64, user: i64) -> (u16, Option<u64>, Value) {
    let jwt = chaos.user(user);
    let token = chaos
        .client()
        .get(chaos.url(&format!("/api/v1/activities/{activity}/token")))
        .bearer_auth(&jwt)
        .send()
        .await
        .expect("token answered")
        .json::<Value>()
        .await
        .unwrap_or(Value::Null)["token"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    purchase_with(chaos, activity, user, &token).await
}

/// A purchase with a token in hand.
async fn purchase_with(
    chaos: &Chaos,
    activity: i64,
    user: i64,
    token: &str,
) -> (u16, Option<u64>, Value) {
    let res = chaos
        .client()
        .post(chaos.url(&format!("/api/v1/activities/{activity}/orders")))
        .bearer_auth(chaos.user(user))
        .json(&json!({"request_id": format!("refused-{user}"), "token": token}))
        .send()
        .await
        .expect("purchase answered");
    let status = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    (status, retry_after, res.json().await.unwrap_or(Value::Null))
}

/// The PostgreSQL primary SIGKILLed (its keeper and PostgreSQL: the node
/// dying) while the consumers write a burst's orders: the standby takes
/// over, and the consumers, the closer, the relay and the reconciler go on
/// there through the multi-host URL. A payment callback sent during the
/// switch answers 503 (the provider retries) or, once the standby took
/// over, 200, never anything else, and the order is paid exactly once.
/// Readiness stays 200 throughout (a failover must not empty the load
/// balancer), and each new purchase is 202 or 503 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_postgres_primary_killed_mid_drain_fails_over_and_loses_and_duplicates_nothing() {
    let chaos = Chaos::start_with("primary_killed", |env| {
        // Small batches: the drain takes long enough to be interrupted.
        env.push(("SECKILL__ORDERS__BATCH_SIZE", "5".into()));
        env.push(("SECKILL__POSTGRES__TIMEOUT_MS", "1000".into()));
        // The default (test.toml shortens it for the fallback's tests): an
        // instance PostgreSQL does not answer sells on the modes it read
        // last for this long.
        env.push(("SECKILL__ADMISSION__MODES_TRUSTED_FOR_MS", "30000".into()));
    })
    .await;
    assert!(
        chaos.services.replicated(),
        "run with scripts/chaos.sh --replicated"
    );
    // An order paid during the switch: made, and its payment created,
    // before the fault.
    let paying = Sale::new(&chaos, 0, 10).await;
    let payment = chaos.paid_order_intent(paying.activity, 700_000).await;
    let spare = spare_activity(&chaos).await;
    // Bought from before the fault, as a live sale is: the instance knows
    // the activity (and that it has no waiting room) without asking the
    // database.
    sells_again(&chaos, spare, 800_000).await;
    let sale = Sale::new(&chaos, 2000, 1500).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            let primary = chaos.services.pg_primary().await.expect("a primary");
            let standby = 3 - primary;
            // Killed while a consumer is provably mid-batch: its writes
            // wait on a lock of the test's on the primary.
            let (held, waited) = chaos.hold_order_writes().await;
            eprintln!(
                "primary_killed: node {primary} is the primary, a consumer mid-batch: {waited}; \
                 SIGKILL to its group"
            );
            signal_group(chaos.services.pg_node_group(primary).await, "KILL");
            drop(held);
            let killed = Instant::now();
            // A load balancer's prober and new buyers, through the switch.
            let done = std::sync::atomic::AtomicBool::new(false);
            let prober = probe_through(&chaos, spare, &done);
            let failover = async {
            // A callback during the switch: 503 until the standby took
            // over (the provider retries), then 200.
            let mut answers = Vec::new();
            loop {
                let status = chaos.notify_success(&payment).await;
                answers.push(status);
                if status == 200 {
                    break;
                }
                // 503 while no primary takes writes; no answer or a 408 on
                // a starved host, retried as a provider does.
                assert!(
                    matches!(status, 503 | 408 | 0),
                    "a callback during the switch: {answers:?}"
                );
                assert!(
                    killed.elapsed() < Duration::from_secs(180),
                    "no failover in 180 s: {answers:?}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let promoted = chaos.services.pg_primary().await;
            eprintln!(
                "primary_killed: node {promoted:?} takes writes {:.1}s after the kill; callbacks {answers:?}",
                killed.elapsed().as_secs_f64()
            );
            assert_eq!(promoted, Some(standby), "the standby took over");
            let after = sells_again(&chaos, spare, 900_000).await;
            eprintln!("primary_killed: a new buyer accepted {after:.1}s later");
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            };
            let ((ready, bought), ()) = tokio::join!(prober, failover);
            eprintln!(
                "primary_killed: through the switch, readiness {ready:?}; purchases {bought:?}"
            );
            assert_eq!(
                ready.keys().copied().collect::<Vec<_>>(),
                vec![200],
                "readiness left 200 during the failover: {ready:?}"
            );
            // Issue #59, defect 4: purchases need Redis and Kafka, not
            // PostgreSQL. Through the switch every new buyer is accepted:
            // none is refused for the modes, the order numbers, or the
            // consumers' stall the outage caused.
            assert!(
                !bought.is_empty() && bought.keys().all(|k| k == "202 "),
                "purchases through the failover: {bought:?}"
            );
            chaos.services.start_pg_node(primary).await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    assert!(
        chaos.log_lines_with("order batch failed; retrying") > 0,
        "the failover interrupted the consumers' batches"
    );
    // The payment applied once: PAID, one SUCCESS payment, the unit sold.
    assert_eq!(
        chaos
            .count(&format!(
                "SELECT count(*) AS n FROM orders WHERE order_no = {} AND status = 'PAID'",
                payment["order_no"].as_str().unwrap()
            ))
            .await,
        1
    );
    assert_eq!(
        chaos
            .count(&format!(
                "SELECT count(*) AS n FROM payments WHERE order_no = {} AND status = 'SUCCESS'",
                payment["order_no"].as_str().unwrap()
            ))
            .await,
        1
    );
    assert_never_restarted(&chaos);
}

/// Polls readiness and buys one unit of `activity` twice a second until
/// `done`: the readiness statuses and the purchases' answers seen. A
/// purchase must be 202, or 503 with `Retry-After` (the instance answers
/// for itself; a load balancer never finds it unready).
async fn probe_through(
    chaos: &Chaos,
    activity: i64,
    done: &std::sync::atomic::AtomicBool,
) -> (
    std::collections::BTreeMap<u16, u32>,
    std::collections::BTreeMap<String, u32>,
) {
    let mut ready = std::collections::BTreeMap::new();
    let mut bought = std::collections::BTreeMap::new();
    let mut user = 950_000;
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        let status = match chaos.client().get(chaos.url("/health/ready")).send().await {
            Ok(res) => res.status().as_u16(),
            Err(_) => 0,
        };
        *ready.entry(status).or_insert(0) += 1;
        // The token first: it too is 200, or 503 with `Retry-After`.
        let token = chaos
            .client()
            .get(chaos.url(&format!("/api/v1/activities/{activity}/token")))
            .bearer_auth(chaos.user(user))
            .send()
            .await
            .expect("token answered");
        let (status, retry_after) = (
            token.status().as_u16(),
            token.headers().get("retry-after").is_some(),
        );
        let body: Value = token.json().await.unwrap_or(Value::Null);
        let code = body["code"].as_str().unwrap_or_default().to_owned();
        assert!(
            status == 200 || (status == 503 && retry_after),
            "a purchase token during the failover: {status} {body}"
        );
        if status != 200 {
            eprintln!("probe: a token answered {status} {}", body["detail"]);
            *bought.entry(format!("token {status} {code}")).or_insert(0) += 1;
        } else {
            let token = body["token"].as_str().unwrap_or_default();
            let (status, retry_after, body) = purchase_with(chaos, activity, user, token).await;
            let code = body["code"].as_str().unwrap_or_default().to_owned();
            assert!(
                status == 202 || (status == 503 && retry_after.is_some()),
                "a purchase during the failover: {status} {body}"
            );
            if status != 202 {
                eprintln!("probe: a purchase answered {status} {}", body["detail"]);
            }
            *bought.entry(format!("{status} {code}")).or_insert(0) += 1;
        }
        user += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (ready, bought)
}

/// The standby killed mid-sale: the primary goes on. With synchronous
/// replication, commits would wait for the lost standby for ever; the
/// monitor turns synchronous replication off (wait_primary) after its
/// health checks fail, and writes go on, held on one node until the
/// standby is back. What that trade costs is measured here: how long
/// commits waited before the primary went on alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_postgres_standby_killed_the_primary_goes_on() {
    let chaos = start("standby_killed").await;
    let spare = spare_activity(&chaos).await;
    let sale = Sale::new(&chaos, 2000, 1500).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            let primary = chaos.services.pg_primary().await.expect("a primary");
            let standby = 3 - primary;
            eprintln!("standby_killed: node {standby} is the standby; SIGKILL to its group");
            signal_group(chaos.services.pg_node_group(standby).await, "KILL");
            // A write that must commit on both nodes: it waits for the lost
            // standby until the monitor turns synchronous replication off.
            let written = Instant::now();
            chaos
                .count(
                    "WITH w AS (INSERT INTO consume_log (consumer, event_id) \
                     VALUES ('standby-killed', gen_random_uuid()::text) RETURNING 1) \
                     SELECT count(*) AS n FROM w",
                )
                .await;
            let waited = written.elapsed().as_secs_f64();
            let after = sells_again(&chaos, spare, 900_000).await;
            eprintln!(
                "standby_killed: a commit right after the kill waited {waited:.1}s; \
                 a new buyer accepted {after:.1}s after it"
            );
            assert_eq!(
                chaos.services.pg_primary().await,
                Some(primary),
                "the primary stays the primary"
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
            chaos.services.start_pg_node(standby).await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    assert_never_restarted(&chaos);
}

/// Runs `sql` as the superuser on PostgreSQL node `n` (no answer: false).
async fn on_node(chaos: &Chaos, n: usize, sql: &'static str) -> bool {
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=3",
        chaos.services.pg_port(n)
    );
    tokio::task::spawn_blocking(move || {
        use diesel::{Connection, RunQueryDsl};
        let mut conn = diesel::PgConnection::establish(&url).ok()?;
        diesel::sql_query(sql).execute(&mut conn).ok()
    })
    .await
    .ok()
    .flatten()
    .is_some()
}

/// The primary killed with WAL its standby never had (commits made with
/// `synchronous_commit = local` just before): once the standby took over,
/// the old primary must be rewound to rejoin. It rejoins by pg_rewind, in
/// seconds, not by a full base backup.
///
/// Left to itself, pg_autoctl 2.0 first recovers a crashed primary by
/// running it as a standby that listens on no TCP address. It then sends
/// that server SIGTERM and starts pg_rewind without waiting for it to stop.
/// On a loaded host the stop is slow, so pg_rewind finds the node not shut
/// down. It then runs crash recovery in single-user mode, which refuses the
/// standby signal, and the node is rebuilt by a base backup. Here that
/// server's checkpointer is paused while it would stop, as a loaded host
/// does. `pg_ha_recover` (scripts/services.d/pg-ha.sh) recovers the node
/// before its keeper starts, so no such server runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn a_killed_primary_rejoins_as_the_standby_by_rewind() {
    let chaos = start("primary_rewound").await;
    let primary = chaos.services.pg_primary().await.expect("a primary");
    let standby = 3 - primary;
    let log = chaos.services.pg_keeper_log(primary);
    let before = std::fs::read_to_string(&log).map_or(0, |l| l.len());
    // WAL only the primary has: committed locally, not waited for.
    assert!(
        on_node(
            &chaos,
            primary,
            "DO $$ BEGIN PERFORM set_config('synchronous_commit', 'local', true); \
             CREATE TABLE IF NOT EXISTS diverged (x int); \
             INSERT INTO diverged SELECT generate_series(1, 200000); END $$"
        )
        .await,
        "the write on the primary"
    );
    signal_group(chaos.services.pg_node_group(primary).await, "KILL");
    let killed = Instant::now();
    while chaos.services.pg_primary().await != Some(standby) {
        assert!(killed.elapsed() < Duration::from_secs(180), "no failover");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let restarted = Instant::now();
    let rejoined_flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slowed = slow_stop_of_a_recovery_server(
        chaos.services.pg_data(primary),
        rejoined_flag.clone(),
        Duration::from_secs(5),
    );
    chaos.services.start_pg_node(primary).await;
    // Back as a standby that follows the new primary.
    let rejoined = loop {
        let following = on_node(
            &chaos,
            standby,
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_stat_replication \
             WHERE state = 'streaming') THEN RAISE EXCEPTION 'no standby'; END IF; END $$",
        )
        .await;
        if following {
            break restarted.elapsed();
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(300),
            "the old primary never rejoined"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let since = std::fs::read_to_string(&log).unwrap_or_default();
    let since = &since[before.min(since.len())..];
    rejoined_flag.store(true, std::sync::atomic::Ordering::Release);
    let slowed = tokio::task::spawn_blocking(move || slowed.join().unwrap())
        .await
        .unwrap();
    eprintln!(
        "primary_rewound: node {primary} streams from node {standby} {:.1}s after its restart; \
         {}",
        rejoined.as_secs_f64(),
        slowed.map_or(
            "no recovery server ran before pg_rewind".to_owned(),
            |pid| format!("the checkpointer {pid} of a recovery server was paused 5 s")
        )
    );
    assert!(
        since.contains("bin/pg_rewind") && !since.contains("bin/pg_basebackup"),
        "rejoined by rewind, not a base backup: {}",
        since
            .lines()
            .filter(|l| l.contains("rewind") || l.contains("basebackup") || l.contains("FATAL"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Until `done`: finds a PostgreSQL of `data` that listens on no TCP
/// address (`-h ''`: pg_autoctl's crash recovery) and pauses its
/// checkpointer for `hold`, which makes the server's stop (its shutdown
/// restartpoint) slow. Returns the paused pid, if one ran.
fn slow_stop_of_a_recovery_server(
    data: std::path::PathBuf,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hold: Duration,
) -> std::thread::JoinHandle<Option<u32>> {
    let data = data.to_string_lossy().into_owned();
    std::thread::spawn(move || {
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(pid) = recovery_checkpointer(&data) {
                signal(pid, "STOP");
                std::thread::sleep(hold);
                signal(pid, "CONT");
                return Some(pid);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    })
}

/// The checkpointer of a postmaster of `data` started with `-h ''`.
fn recovery_checkpointer(data: &str) -> Option<u32> {
    let processes: Vec<(u32, Vec<String>)> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let args = raw
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, args))
        })
        .collect();
    let postmaster = processes.iter().find_map(|(pid, args)| {
        let recovering = args.first()?.ends_with("bin/postgres")
            && args.windows(2).any(|w| w[0] == "-D" && w[1] == data)
            && args.windows(2).any(|w| w[0] == "-h" && w[1].is_empty());
        recovering.then_some(*pid)
    })?;
    processes.iter().find_map(|(pid, args)| {
        let parent = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("PPid:")?.trim().parse::<u32>().ok())?;
        (parent == postmaster && args.first()?.contains("checkpointer")).then_some(*pid)
    })
}

/// One broker leads every partition of the order topic (the two others
/// were killed and started again: leadership stays with the survivor),
/// and that broker is paused (SIGSTOP), at the default message timeout
/// and stall window.
/// The producer gives its requests to the paused broker up once the
/// controllers have fenced it, and finds the new leaders by itself: the
/// sale goes on before any message times out and without a Kafka client
/// rebuilt, as after a killed leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn a_paused_broker_leading_every_partition_is_left_as_a_killed_one_is() {
    let chaos = Chaos::start_with("every_leader_paused", |env| {
        // The defaults (the harness shortens them): a message is retried
        // 15 s, a client is rebuilt after 20 s without progress.
        env.push(("SECKILL__KAFKA__MESSAGE_TIMEOUT_MS", "15000".into()));
        env.push(("SECKILL__KAFKA__CONSUMER_STALL_SECS", "20".into()));
        env.push(("SECKILL__RECONCILE__PUBLISH_WINDOW_SECS", "35".into()));
    })
    .await;
    assert!(
        chaos.services.replicated(),
        "run with scripts/chaos.sh --replicated"
    );
    let spare = spare_activity(&chaos).await;
    let topic = order_topic(&chaos);
    let keep = leader(&chaos).await;
    let others: Vec<usize> = (1..=3).filter(|n| *n != keep).collect();
    for &n in &others {
        signal(chaos.services.broker_pid(n).await, "KILL");
    }
    let moved = Instant::now();
    loop {
        let mut all = true;
        for p in 0..4 {
            all &= chaos.services.leader_of(&topic, p).await == Some(keep);
        }
        if all {
            break;
        }
        assert!(
            moved.elapsed() < Duration::from_secs(120),
            "the survivor never led every partition"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for &n in &others {
        chaos.services.start_broker(n).await;
    }
    // Back in the in-sync replicas: writes are taken again.
    sells_again(&chaos, spare, 700_000).await;
    let rebuilt = chaos.log_lines_with("wedged; rebuilding");
    let timed_out = chaos.log_lines_with("delivery unknown");
    let pid = chaos.services.broker_pid(keep).await;
    eprintln!("every_leader_paused: broker {keep} leads every partition; SIGSTOP");
    signal(pid, "STOP");
    let _resume = harness::OnDrop(move || signal(pid, "CONT"));
    let after = sells_again(&chaos, spare, 800_000).await;
    eprintln!("every_leader_paused: a new buyer accepted {after:.1}s after the pause");
    assert_eq!(
        chaos.log_lines_with("wedged; rebuilding"),
        rebuilt,
        "a Kafka client was rebuilt: the producer did not move to the new leaders by itself; {}",
        chaos.logs()
    );
    // The request to the paused broker was given up (10 s) and the new
    // leaders found before any message's own 15 s ran out.
    assert_eq!(
        chaos.log_lines_with("delivery unknown"),
        timed_out,
        "a message timed out on the paused broker: the producer stayed on it; {}",
        chaos.logs()
    );
    assert_never_restarted(&chaos);
}

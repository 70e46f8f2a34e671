//! When orders fail to drain, say why: for every reservation still open in
//! Redis, whether its event is on the topic (partition, offset), whether the
//! consumer group's committed offset is already past it, whether the order
//! consumer logged it, and what the dead-letter topic holds. A failure in
//! the crash-and-restart tests then tells a lost message from a skipped one.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Message, Offset, TopicPartitionList};
use seckill::admission::keys::ActivityKeys;
use seckill::bus::Topics;
use seckill::config::Settings;
use seckill::domain::ActivityId;
use secrecy::ExposeSecret;

/// A report on why `activity_id`'s reservations are still open (blocking).
pub fn explain_open_reservations(settings: &Settings, activity_id: i64) -> String {
    let open = match open_reservations(settings, activity_id) {
        Ok(open) => open,
        Err(e) => return format!("could not read the open reservations: {e}"),
    };
    let mut report = format!("open reservations: {open:?}\n");
    let failed = failed_orders(settings).unwrap_or_default();
    let mut suspects = open.clone();
    suspects.extend(failed.iter().map(|(o, _)| *o));
    let logged = consume_logged(settings, &suspects);
    let topics = Topics::new(&settings.kafka.topic_prefix);
    let on_topic = retried(|| scan(settings, &topics.order_requested));
    let group = seckill::bus::group_id(&settings.kafka, seckill::orders::consumer::CONSUMER);
    let committed = retried(|| committed(settings, &group, &topics.order_requested));
    let lines = open.iter().map(|o| (*o, format!("order {o}"))).chain(
        failed
            .iter()
            .map(|(o, reason)| (*o, format!("FAILED order {o} ({reason})"))),
    );
    for (order_no, label) in lines {
        let key = order_no.to_string();
        let place = on_topic
            .as_ref()
            .ok()
            .and_then(|s| s.by_key.get(&key).cloned());
        report.push_str(&format!(
            "  {label}: on topic at {place:?}, consume_log: {:?}, reservation {}\n",
            logged.as_ref().map(|l| l.contains(&key)),
            reservation_fields(settings, activity_id, order_no)
        ));
    }
    match &on_topic {
        Ok(s) => report.push_str(&format!(
            "{}: messages per partition {:?}\n",
            topics.order_requested, s.per_partition
        )),
        Err(e) => report.push_str(&format!("scanning {}: {e}\n", topics.order_requested)),
    }
    report.push_str(&format!("group {group} committed offsets: {committed:?}\n"));
    match retried(|| scan(settings, &topics.order_requested_dlq)) {
        Ok(s) => report.push_str(&format!(
            "dead letters: {:?} (errors: {:?})\n",
            s.per_partition, s.errors
        )),
        Err(e) => report.push_str(&format!("scanning the dead-letter topic: {e}\n")),
    }
    report
}

/// The broker answers "not leader" for a moment while topics come and go
/// (on a loaded 2-core host, for several seconds after a topic's first
/// message): ask again, with a new client each time, for up to a minute
/// before reporting an error.
fn retried<T>(mut f: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut errors = Vec::new();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline => {
                if errors.last() != Some(&e) {
                    errors.push(e);
                }
            }
            Err(e) => {
                errors.push(e);
                return Err(errors.join("; "));
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn open_reservations(settings: &Settings, activity_id: i64) -> redis::RedisResult<Vec<i64>> {
    let mut conn = crate::cleanup::redis_sync(settings)?;
    let keys = ActivityKeys::new(&settings.redis.key_prefix, ActivityId::new(activity_id));
    redis::cmd("ZRANGE")
        .arg(keys.open())
        .arg(0)
        .arg(-1)
        .query(&mut *conn)
}

/// The reservation record as Redis holds it (status, acked, sent, ts…).
fn reservation_fields(settings: &Settings, activity_id: i64, order_no: i64) -> String {
    let read = || -> redis::RedisResult<Vec<(String, String)>> {
        let mut conn = crate::cleanup::redis_sync(settings)?;
        let keys = ActivityKeys::new(&settings.redis.key_prefix, ActivityId::new(activity_id));
        redis::cmd("HGETALL")
            .arg(keys.reservation(order_no))
            .query(&mut *conn)
    };
    match read() {
        Ok(fields) => format!("{fields:?}"),
        Err(e) => format!("unreadable: {e}"),
    }
}

fn failed_orders(settings: &Settings) -> Result<Vec<(i64, String)>, String> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        order_no: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        reason: String,
    }
    let mut conn = PgConnection::establish(settings.postgres.url.expose_secret())
        .map_err(|e| e.to_string())?;
    diesel::sql_query(
        "SELECT order_no, COALESCE(failure_reason, '') AS reason FROM orders \
         WHERE status = 'FAILED' ORDER BY order_no LIMIT 20",
    )
    .load::<Row>(&mut conn)
    .map(|rows| rows.into_iter().map(|r| (r.order_no, r.reason)).collect())
    .map_err(|e| e.to_string())
}

fn consume_logged(settings: &Settings, order_nos: &[i64]) -> Result<Vec<String>, String> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        event_id: String,
    }
    let ids: Vec<String> = order_nos.iter().map(i64::to_string).collect();
    let mut conn = PgConnection::establish(settings.postgres.url.expose_secret())
        .map_err(|e| e.to_string())?;
    diesel::sql_query("SELECT event_id FROM consume_log WHERE event_id = ANY($1)")
        .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(&ids)
        .load::<Row>(&mut conn)
        .map(|rows| rows.into_iter().map(|r| r.event_id).collect())
        .map_err(|e| e.to_string())
}

#[derive(Debug, Default)]
struct Scan {
    /// Key → (partition, offset) of every message.
    by_key: HashMap<String, (i32, i64)>,
    /// Partition → messages read.
    per_partition: BTreeMap<i32, usize>,
    /// `error` headers seen.
    errors: Vec<String>,
}

/// A client in consumer group `group` that never joins it, and the
/// partitions of `topic`.
fn client_for(
    settings: &Settings,
    group: &str,
    topic: &str,
) -> Result<(BaseConsumer, Vec<i32>), String> {
    let consumer: BaseConsumer = seckill::bus::client_config(&settings.kafka)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| e.to_string())?;
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let partitions = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions())
        .map(|p| p.id())
        .collect();
    Ok((consumer, partitions))
}

/// The `error` headers of every message on `topic` now (blocking); one
/// try, for callers that poll.
pub fn errors_on(settings: &Settings, topic: &str) -> Result<Vec<String>, String> {
    scan(settings, topic).map(|s| s.errors)
}

/// The key of every message on `topic` now (blocking), asked again while
/// the broker answers with an error ([`retried`]).
pub fn keys_on(settings: &Settings, topic: &str) -> Result<Vec<String>, String> {
    retried(|| scan(settings, topic)).map(|s| s.by_key.into_keys().collect())
}

/// The partition of every message on `topic` now, by key, and the
/// topic's partition count (blocking).
pub fn partitions_on(
    settings: &Settings,
    topic: &str,
) -> Result<(HashMap<String, i32>, i32), String> {
    let (_, partitions) = client_for(settings, "forensics", topic)?;
    let placed = retried(|| scan(settings, topic))?
        .by_key
        .into_iter()
        .map(|(key, (partition, _))| (key, partition))
        .collect();
    Ok((placed, i32::try_from(partitions.len()).unwrap_or(0)))
}

/// Reads `topic` from the beginning to its high watermarks, outside any group.
fn scan(settings: &Settings, topic: &str) -> Result<Scan, String> {
    let (consumer, partitions) = client_for(settings, "forensics", topic)?;
    let timeout = Duration::from_secs(5);
    let mut ends = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| e.to_string())?;
        if high > 0 {
            ends.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
    }
    let mut scan = Scan::default();
    if ends.is_empty() {
        return Ok(scan);
    }
    consumer.assign(&tpl).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ends.is_empty() && Instant::now() < deadline {
        let Some(m) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = m.map_err(|e| e.to_string())?;
        let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
        scan.by_key
            .insert(key.unwrap_or_default(), (m.partition(), m.offset()));
        *scan.per_partition.entry(m.partition()).or_default() += 1;
        if let Some(headers) = m.headers() {
            for h in headers.iter().filter(|h| h.key == "error") {
                scan.errors
                    .push(String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned());
            }
        }
        if ends.get(&m.partition()) == Some(&(m.offset() + 1)) {
            ends.remove(&m.partition());
        }
    }
    Ok(scan)
}

/// The group's committed offset per partition of `topic` (without joining it).
fn committed(settings: &Settings, group: &str, topic: &str) -> Result<Vec<(i32, Offset)>, String> {
    let (consumer, partitions) = client_for(settings, group, topic)?;
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        tpl.add_partition(topic, p);
    }
    let timeout = Duration::from_secs(5);
    let offsets = consumer
        .committed_offsets(tpl, timeout)
        .map_err(|e| e.to_string())?;
    Ok(offsets
        .elements()
        .iter()
        .map(|e| (e.partition(), e.offset()))
        .collect())
}

#[tokio::test]
async fn the_report_finds_an_unconsumed_order_on_its_topic() {
    let app = crate::helpers::spawn_app_with(crate::helpers::without_order_consumer).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202);
    let order_no = body["order_no"].as_str().expect("order_no").to_owned();
    let settings = app.settings.clone();
    let report =
        tokio::task::spawn_blocking(move || explain_open_reservations(&settings, activity))
            .await
            .unwrap();
    assert!(
        report.contains(&format!("open reservations: [{order_no}]")),
        "{report}"
    );
    assert!(
        report.contains(&format!("order {order_no}: on topic at Some(")),
        "{report}"
    );
    assert!(report.contains("consume_log: Ok(false)"), "{report}");
    eprintln!("{report}");
}

#[tokio::test]
async fn each_order_event_lies_on_the_partition_of_its_numbers_time_slice() {
    use seckill::bus::partitioner::{SLICE_MS, of_order};
    use seckill::ids::OrderNo;
    let app = crate::helpers::spawn_app_with(crate::helpers::without_order_consumer).await;
    let activity = app.live_activity(40, 1, 1).await;
    let mut order_nos = Vec::new();
    for user in 1..=24 {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        order_nos.push(body["order_no"].as_str().expect("order_no").to_owned());
        if user % 6 == 0 {
            // Into the next slices.
            tokio::time::sleep(std::time::Duration::from_millis(SLICE_MS as u64)).await;
        }
    }
    let settings = app.settings.clone();
    let topic = Topics::new(&settings.kafka.topic_prefix).order_requested;
    let (placed, count) = tokio::task::spawn_blocking(move || partitions_on(&settings, &topic))
        .await
        .expect("scan")
        .expect("scan the order topic");
    assert_eq!(
        count, app.settings.kafka.partitions,
        "the topic as configured"
    );
    let mut used = std::collections::BTreeSet::new();
    for no in &order_nos {
        let on = *placed
            .get(no)
            .unwrap_or_else(|| panic!("{no} not on the topic"));
        let n = OrderNo::parse(no).expect("a number");
        assert_eq!(on, of_order(n, count), "order {no}");
        used.insert(on);
    }
    assert!(used.len() > 1, "four slices apart, one partition: {used:?}");
}

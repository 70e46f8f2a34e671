//! What a test leaves behind goes: its Redis keys when its `TestApp` drops,
//! and, once per test run before any test starts, the test topics of earlier
//! runs. Without this, every run adds topics until the local broker runs out
//! of heap.

use std::sync::OnceLock;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use seckill::config::Settings;

/// This test process's run id: every namespace of the run starts with
/// `t<run>`, so stale ones (other runs) can be told apart.
pub fn run_id() -> &'static str {
    static RUN: OnceLock<String> = OnceLock::new();
    RUN.get_or_init(|| format!("{:04x}", fastrand::u16(..)))
}

fn admin(settings: &Settings) -> Option<AdminClient<DefaultClientContext>> {
    seckill::bus::client_config(&settings.kafka).create().ok()
}

fn delete_topics(admin: &AdminClient<DefaultClientContext>, names: &[String]) {
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for chunk in names.chunks(200) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let _ = block_on(admin.delete_topics(&refs, &options));
    }
}

/// Runs a future to completion from a blocking context: a runtime's blocking
/// thread (through its handle) or a plain thread (on a small runtime).
fn block_on<F: Future>(f: F) -> F::Output {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.block_on(f),
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a small runtime for cleanup")
            .block_on(f),
    }
}

/// Once per run (blocking; call from a blocking thread): deletes the test
/// topics of other runs.
pub fn remove_stale_topics(settings: &Settings) {
    let Some(admin) = admin(settings) else { return };
    let Ok(metadata) = admin.inner().fetch_metadata(None, Duration::from_secs(10)) else {
        return;
    };
    let ours = format!("t{}", run_id());
    let stale: Vec<String> = metadata
        .topics()
        .iter()
        .map(|t| t.name().to_owned())
        .filter(|n| is_test_topic(n) && !n.starts_with(&ours))
        .collect();
    delete_topics(&admin, &stale);
}

/// `t` + 12 to 16 hex digits + `.`: the topic prefix `spawn_app` gives a
/// test (16 now; 12 before run ids were added).
fn is_test_topic(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('t') else {
        return false;
    };
    let Some(dot) = rest.find('.') else {
        return false;
    };
    (12..=16).contains(&dot) && rest[..dot].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Deletes one test's Redis keys (blocking; from Drop). Its Kafka topics go
/// at the start of the next run: deleting topics while other tests of the
/// run still rebalance consumer groups on the same broker is churn the
/// crash-and-restart tests do not need.
pub fn remove_namespace(settings: &Settings) {
    let Ok(mut conn) = redis_sync(settings) else {
        return;
    };
    let conn = &mut *conn;
    let pattern = format!("{}*", settings.redis.key_prefix);
    let keys: Vec<String> = match redis::cmd("KEYS").arg(&pattern).query(conn) {
        Ok(keys) => keys,
        Err(_) => return,
    };
    for chunk in keys.chunks(500) {
        let _: redis::RedisResult<()> = redis::cmd("UNLINK").arg(chunk).query(conn);
    }
}

/// A blocking connection to the test Redis: the server, or the cluster
/// (whose client sends KEYS to every master and splits UNLINK by slot).
pub fn redis_sync(settings: &Settings) -> redis::RedisResult<Box<dyn redis::ConnectionLike>> {
    let timeout = Duration::from_secs(2);
    if settings.redis.mode == seckill::config::RedisMode::Cluster {
        let nodes = seckill::store::redis_conn::seed_nodes(&settings.redis.url);
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .build()?;
        return Ok(Box::new(client.get_connection()?));
    }
    let client = redis::Client::open(settings.redis.url.as_str())?;
    Ok(Box::new(client.get_connection_with_timeout(timeout)?))
}

#[test]
fn test_topics_are_recognised_and_nothing_else_is() {
    assert!(is_test_topic("t0a1b2c3d4e5f6a7b.order.requested"));
    assert!(!is_test_topic("order.requested"));
    assert!(!is_test_topic("bench1764470000.order.requested"));
    assert!(is_test_topic("t0a1b2c3d4e5f.order.requested"));
    assert!(!is_test_topic("tzzzzzzzzzzzzzzzz.order.requested"));
    assert!(!is_test_topic("tabc.order.requested"));
}

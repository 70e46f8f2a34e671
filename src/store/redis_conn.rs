//! Redis connections, to one server or to a Redis Cluster (`redis.mode`).
//!
//! Both kinds are multiplexed, connect lazily (the service starts while
//! Redis is down and reports it in readiness) and reconnect by themselves.
//! Every script's keys share one hash tag (`{a:<activity>}`, `{c:<coupon>}`,
//! `{instance:<id>}`), so each script runs on the one node that owns its
//! slot; pipelines stay within one activity's slot too. Commands without
//! keys (PING, SCRIPT LOAD, KEYS) are routed to every master by the cluster
//! client.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::config::{RedisMode, RedisSettings};

/// Opens [`RedisConn`]s as `redis.mode` says.
#[derive(Clone)]
pub enum RedisClient {
    /// One server.
    Standalone {
        /// The server.
        client: redis::Client,
        /// Timeouts and retries of each connection.
        config: ConnectionManagerConfig,
    },
    /// A Redis Cluster, found through its seed nodes.
    Cluster {
        /// The seed nodes and timeouts.
        client: ClusterClient,
        /// Timeouts of each connection.
        config: ClusterConfig,
    },
}

impl RedisClient {
    /// The client for `settings` (nothing connects yet).
    pub fn new(settings: &RedisSettings) -> RedisResult<Self> {
        let timeout = settings.timeout_ms;
        if settings.mode == RedisMode::Cluster {
            let client = ClusterClient::builder(seed_nodes(&settings.url))
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2)
                .build()?;
            let config = ClusterConfig::new()
                .set_connection_timeout(timeout)
                .set_response_timeout(timeout);
            return Ok(Self::Cluster { client, config });
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        Ok(Self::Standalone {
            client: redis::Client::open(settings.url.as_str())?,
            config,
        })
    }

    /// A new multiplexed connection; it connects on first use. Must be
    /// called inside a Tokio runtime (the one that will drive it).
    pub fn connect_lazy(&self) -> RedisResult<RedisConn> {
        Ok(match self {
            Self::Standalone { client, config } => {
                RedisConn::Standalone(client.get_connection_manager_lazy(config.clone())?)
            }
            Self::Cluster { client, config } => {
                RedisConn::Cluster(client.get_pending_async_connection_with_config(config.clone()))
            }
        })
    }
}

/// Whether `e` says Redis could not be reached (or did not answer in
/// time), as opposed to Redis refusing the command. A server loading its
/// data set (`LOADING`, for the whole load after a restart), a cluster
/// without a quorum or a slot's master (`CLUSTERDOWN`, `MASTERDOWN`) and a
/// slot in migration (`TRYAGAIN`) answer, but serve nothing: unreachable
/// too, until they clear.
pub fn unreachable(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_unrecoverable_error()
        || matches!(
            e.code(),
            Some("LOADING" | "CLUSTERDOWN" | "MASTERDOWN" | "TRYAGAIN")
        )
}

/// When something was first seen at `key` (unix ms): sets it to `now_ms`
/// unless it is set (kept a day), and reads it back.
pub async fn first_seen(conn: &RedisConn, key: &str, now_ms: i64) -> redis::RedisResult<i64> {
    let (since,): (i64,) = redis::pipe()
        .cmd("SET")
        .arg(key)
        .arg(now_ms)
        .arg("NX")
        .arg("EX")
        .arg(86_400)
        .ignore()
        .cmd("GET")
        .arg(key)
        .query_async(&mut conn.clone())
        .await?;
    Ok(since)
}

/// The seed nodes of a cluster's `redis.url` (comma-separated URLs).
pub fn seed_nodes(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect()
}

/// A multiplexed connection to one server or to a cluster. Cheap to clone;
/// clones share the connection.
#[derive(Clone)]
pub enum RedisConn {
    /// One server.
    Standalone(ConnectionManager),
    /// A Redis Cluster (commands routed by their keys' slot).
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Standalone(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// What a [`listen`] subscription is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subscription {
    /// Not subscribed (starting, or lost): messages are being missed.
    Gap,
    /// Subscribed from now on.
    Live,
}

/// Subscribes to `channel` on one of `seeds` (a Redis Cluster broadcasts
/// every message to every node) and hands each message's payload to
/// `on_message`, until `shutdown`; after an error, the next seed a second
/// later. `on_state` hears each gap (before every attempt) and each new
/// subscription, so a listener can drop what it may have missed.
pub async fn listen(
    seeds: Vec<String>,
    channel: String,
    what: &'static str,
    mut on_state: impl FnMut(Subscription) + Send,
    mut on_message: impl FnMut(&redis::Msg) + Send,
    shutdown: tokio_util::sync::CancellationToken,
) {
    use futures_util::StreamExt;
    for seed in seeds.iter().cycle() {
        on_state(Subscription::Gap);
        let subscribed = async {
            let mut pubsub = redis::Client::open(seed.as_str())?
                .get_async_pubsub()
                .await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        match subscribed {
            Ok(mut pubsub) => {
                on_state(Subscription::Live);
                let mut messages = pubsub.on_message();
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        message = messages.next() => match message {
                            Some(m) => on_message(&m),
                            None => break,
                        },
                    }
                }
                tracing::warn!(what, "subscription lost; resubscribing");
            }
            Err(e) => tracing::warn!(what, error = %e, "cannot subscribe"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
        }
    }
}

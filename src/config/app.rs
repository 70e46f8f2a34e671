//! `[app]` and `[log]`: the process, its environment and its output.

use std::time::Duration;

use serde::Deserialize;

use super::duration;

/// Process-level settings.
#[derive(Debug, Clone, Deserialize)]
pub struct AppSettings {
    /// The environment's name, from `SECKILL_ENV` (default `development`).
    /// Only `development` and `test` allow the development secrets and the
    /// mock payment provider; every other name must set real ones.
    pub env: Environment,
    /// Address the HTTP server binds.
    pub host: String,
    /// Port the HTTP server binds; 0 picks a free one (tests).
    pub port: u16,
    /// This instance's id in the snowflake generator (0..=1022; 1023 is the database fallback's). Unset (the
    /// default): a free one is leased in Redis at start-up. Set: exactly
    /// this one is leased, and `serve` refuses to start while another
    /// running instance holds it. Either way two running instances never
    /// share an id.
    pub instance_id: Option<u16>,
    /// Lifetime of the instance-id lease in Redis, in seconds; renewed five
    /// times per lifetime. A process that cannot renew stops making order
    /// numbers when it runs out; a crashed one's id is free again after it.
    #[serde(deserialize_with = "duration::secs")]
    pub instance_lease_secs: Duration,
    /// How long a graceful shutdown waits for in-flight requests, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub shutdown_timeout_secs: Duration,
    /// Whether the environment was named (`SECKILL_ENV` set, or a test's
    /// own); false when `development` was assumed for want of a name.
    /// An assumed development never serves beyond loopback.
    #[serde(default)]
    pub env_named: bool,
}

/// The environment a process runs in (`app.env`, named by `SECKILL_ENV`).
/// Two names are known; every other is a deployment's own (`production`,
/// `staging`, a typo) and held to production's rules.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "String")]
pub enum Environment {
    /// A developer's machine: the development secrets, the mock provider
    /// and `POST /api/v1/dev/token`.
    Development,
    /// The test suites: the development secrets and the mock provider.
    Test,
    /// Any other name.
    Named(String),
}

impl Environment {
    /// The name, as `SECKILL_ENV` gave it.
    pub fn as_str(&self) -> &str {
        match self {
            Environment::Development => "development",
            Environment::Test => "test",
            Environment::Named(name) => name,
        }
    }
}

impl From<String> for Environment {
    fn from(name: String) -> Self {
        match name.as_str() {
            "development" => Environment::Development,
            "test" => Environment::Test,
            _ => Environment::Named(name),
        }
    }
}

impl From<&str> for Environment {
    fn from(name: &str) -> Self {
        Environment::from(name.to_owned())
    }
}

impl std::fmt::Display for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Environment {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// The log's format (`log.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

/// Log output settings.
#[derive(Debug, Clone, Deserialize)]
pub struct LogSettings {
    /// `pretty` (human-readable) or `json` (one object per line).
    pub format: LogFormat,
    /// Default filter (`RUST_LOG` wins when set), e.g. `info` or `seckill=debug`.
    pub level: String,
}

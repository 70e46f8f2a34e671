//! The checks a configuration must pass before anything starts: every
//! bound, and what production must set.

use std::time::Duration;

use anyhow::bail;
use secrecy::ExposeSecret;

use super::*;

impl Settings {
    /// What a production deployment must set and has not, each named by
    /// its variable, so one start-up message lists them all.
    pub fn production_problems(&self) -> Vec<&'static str> {
        let weak = |secret: &SecretString, dev: &str| {
            let secret = secret.expose_secret();
            secret == dev || secret.len() < 32
        };
        let mut problems = Vec::new();
        if weak(&self.auth.jwt_secret, DEV_JWT_SECRET) {
            problems.push(
                "SECKILL__AUTH__JWT_SECRET (auth.jwt_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        if weak(&self.auth.server_secret, DEV_SERVER_SECRET) {
            problems.push(
                "SECKILL__AUTH__SERVER_SECRET (auth.server_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        // Only `external` and the mock (refused below) verify callbacks
        // with it: under another provider its route is not there.
        if matches!(
            self.payment.kind(),
            ProviderKind::External | ProviderKind::Mock
        ) && weak(&self.payment.notify_secret, DEV_NOTIFY_SECRET)
        {
            problems.push(
                "SECKILL__PAYMENT__NOTIFY_SECRET (payment.notify_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        if self.payment.kind() == ProviderKind::Mock {
            problems.push(
                "SECKILL__PAYMENT__MOCK=false (payment.mock: the mock provider's \
                 /api/v1/dev routes let any buyer mark an order paid)",
            );
        }
        problems
    }

    /// Refuses settings that would run but be unsafe or wrong.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.app.env_named && !is_loopback(&self.app.host) {
            bail!(
                "app.host is {:?}, beyond loopback, and SECKILL_ENV is not set: an unnamed \
                 environment is development (its published JWT secret, the mock payment \
                 provider and the admin-minting /api/v1/dev/token), which must never face a \
                 network. Set SECKILL_ENV=production with its secrets, or \
                 SECKILL_ENV=development to say that this is what you want",
                self.app.host
            );
        }
        if !self.allows_development_conveniences() {
            let problems = self.production_problems();
            if !problems.is_empty() {
                let env = &self.app.env;
                bail!(
                    "{env} (SECKILL_ENV={env}) needs: {} (only development and test run without them)",
                    problems.join("; ")
                );
            }
        }
        let identity_provider = self.auth.provider()?.is_some();
        if identity_provider && !self.allows_development_conveniences() {
            // Keys fetched in clear text can be swapped on the way: anyone
            // on the path could then mint every buyer's and admin's token.
            for (name, url) in [
                ("auth.jwks_url", &self.auth.jwks_url),
                ("auth.issuer", &self.auth.issuer),
            ] {
                if let Some(url) = url.as_deref().filter(|u| u.starts_with("http://")) {
                    bail!(
                        "{name} is {url:?}: outside development the identity provider is \
                         reached over https only"
                    );
                }
            }
        }
        match self.payment.kind() {
            ProviderKind::Wechatpay if self.payment.wechatpay.is_none() => bail!(
                "payment.provider = \"wechatpay\" needs [payment.wechatpay]: mchid, appid, \
                 merchant_serial, merchant_key_file, apiv3_key, platform_key_dir, notify_url \
                 (docs/PAYMENTS.md)"
            ),
            ProviderKind::Stripe if self.payment.stripe.is_none() => bail!(
                "payment.provider = \"stripe\" needs [payment.stripe]: secret_key, \
                 webhook_secret (docs/PAYMENTS.md)"
            ),
            _ => {}
        }
        if self.auth.server_secret.expose_secret() == self.auth.jwt_secret.expose_secret() {
            bail!(
                "auth.server_secret is auth.jwt_secret: whoever can mint user tokens could \
                 mint queue passes and purchase tokens; give the server a secret of its own \
                 (SECKILL__AUTH__SERVER_SECRET)"
            );
        }
        self.check_durations()?;
        let rush = self.orders.rush_batch_wait_ms;
        if self.orders.rush_in_flight > 0
            && (rush < self.orders.batch_wait_ms || rush > Duration::from_secs(5))
        {
            bail!(
                "orders.rush_batch_wait_ms must be within orders.batch_wait_ms ({} ms) and \
                 5000 ms: a batch held longer would look to the watchdog like a stalled \
                 consumer (or set orders.rush_in_flight = 0 to turn rushes off)",
                self.orders.batch_wait_ms.as_millis()
            );
        }
        if self.redis.mode == RedisMode::Cluster
            && self.redis.gate_connection == GateConnection::Pool
        {
            bail!(
                "redis.gate_connection = \"pool\" is for one server only, not redis.mode = \"cluster\""
            );
        }
        if self.reconcile.publish_window_secs < self.in_flight_bound() {
            bail!(
                "reconcile.publish_window_secs must be at least \
                 2 × kafka.message_timeout_ms + admission.publish_budget_ms \
                 (how long an event can still reach the broker after it was sent)"
            );
        }
        if self
            .app
            .instance_id
            .is_some_and(|id| id > MAX_CONFIGURED_INSTANCE)
        {
            bail!(
                "app.instance_id must be within 0..=1022 (10 bits of the snowflake id; \
                 1023 is the database's, for orders admitted while Redis is down)"
            );
        }
        Ok(())
    }
}

impl Settings {
    /// Every duration's lower bound, each named by its key: the ones the
    /// code divides by, waits on in a loop, or needs at least one tick of.
    fn check_durations(&self) -> anyhow::Result<()> {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let bounds = [
            (
                "app.instance_lease_secs",
                self.app.instance_lease_secs,
                s(2),
            ),
            (
                "app.shutdown_timeout_secs",
                self.app.shutdown_timeout_secs,
                s(1),
            ),
            (
                "admission.publish_budget_ms",
                self.admission.publish_budget_ms,
                ms(1),
            ),
            // Two polls of the modes (one a second).
            (
                "admission.modes_trusted_for_ms",
                self.admission.modes_trusted_for_ms,
                ms(2000),
            ),
            (
                "admission.lag_sample_ms",
                self.admission.lag_sample_ms,
                ms(50),
            ),
            (
                "admission.token_ttl_secs",
                self.admission.token_ttl_secs,
                s(1),
            ),
            (
                "admission.reservation_ttl_secs",
                self.admission.reservation_ttl_secs,
                s(1),
            ),
            ("orders.batch_wait_ms", self.orders.batch_wait_ms, ms(1)),
            (
                "orders.events_timeout_secs",
                self.orders.events_timeout_secs,
                s(1),
            ),
            (
                "workers.closer_interval_ms",
                self.workers.closer_interval_ms,
                ms(1),
            ),
            ("workers.relay_poll_ms", self.workers.relay_poll_ms, ms(10)),
            (
                "reconcile.interval_secs",
                self.reconcile.interval_secs,
                s(1),
            ),
            ("redis.timeout_ms", self.redis.timeout_ms, ms(1)),
            ("postgres.timeout_ms", self.postgres.timeout_ms, ms(1)),
            (
                "postgres.replica_max_lag_ms",
                self.postgres.replica_max_lag_ms,
                ms(1),
            ),
            (
                "postgres.connect_timeout_ms",
                self.postgres.connect_timeout_ms,
                s(1),
            ),
            (
                "postgres.statement_timeout_ms",
                self.postgres.statement_timeout_ms,
                s(1),
            ),
            (
                "postgres.idle_in_transaction_timeout_ms",
                self.postgres.idle_in_transaction_timeout_ms,
                s(1),
            ),
            ("postgres.dead_host_ms", self.postgres.dead_host_ms, s(3)),
            ("kafka.timeout_ms", self.kafka.timeout_ms, ms(1)),
            (
                "kafka.message_timeout_ms",
                self.kafka.message_timeout_ms,
                ms(1),
            ),
        ];
        for (key, value, least) in bounds {
            if value < least {
                bail!("{key} must be at least {least:?} (it is {value:?})");
            }
        }
        if self.kafka.min_insync_replicas < 1
            || self.kafka.min_insync_replicas > self.kafka.replication_factor
        {
            bail!(
                "kafka.min_insync_replicas must be within 1..=kafka.replication_factor (it is {})",
                self.kafka.min_insync_replicas
            );
        }
        if self.postgres.call_timeout_ms <= self.postgres.statement_timeout_ms {
            bail!(
                "postgres.call_timeout_ms must be longer than postgres.statement_timeout_ms: a \
                 slow statement is cancelled by the server first, and the call's own deadline \
                 is for a connection that no longer answers"
            );
        }
        if self.reconcile.lease_secs.is_some_and(|l| l < s(1)) {
            bail!("reconcile.lease_secs must be at least 1 s when set");
        }
        self.waiting_room.check()
    }
}

/// Whether `host` names this machine only: a loopback address, or
/// `localhost`.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

//! The settings' checks: environments, secrets, durations, the publish
//! window.

use super::*;

fn settings(env: &str, secret: &str) -> Settings {
    let mut s = Settings::load_env("test").expect("test settings load");
    s.app.env = env.into();
    s.auth.jwt_secret = SecretString::from(secret.to_owned());
    // As config/production.toml has it.
    s.payment.mock = env != "production";
    s
}

#[test]
fn only_two_environment_names_are_known_and_every_name_reads_back() {
    assert_eq!(Environment::from("development"), Environment::Development);
    assert_eq!(Environment::from("test"), Environment::Test);
    for name in ["production", "prod", "staging", "Development", ""] {
        let env = Environment::from(name);
        assert_eq!(env, Environment::Named(name.to_owned()));
        assert_eq!(env.to_string(), name);
    }
}

#[test]
fn a_duration_below_its_bound_is_refused_by_its_key() {
    let mut s = settings("test", DEV_JWT_SECRET);
    assert!(s.validate().is_ok());
    s.workers.relay_poll_ms = Duration::from_millis(5);
    let err = s.validate().expect_err("below 10 ms").to_string();
    assert!(err.contains("workers.relay_poll_ms"), "{err}");
    s.workers.relay_poll_ms = Duration::from_millis(10);
    s.admission.publish_budget_ms = Duration::ZERO;
    let err = s.validate().expect_err("zero budget").to_string();
    assert!(err.contains("admission.publish_budget_ms"), "{err}");
    s.admission.publish_budget_ms = Duration::from_millis(1);
    // The modes' trust: two polls at least, both ends.
    s.admission.modes_trusted_for_ms = Duration::from_millis(1999);
    let err = s.validate().expect_err("under two polls").to_string();
    assert!(err.contains("admission.modes_trusted_for_ms"), "{err}");
    s.admission.modes_trusted_for_ms = Duration::from_millis(2000);
    assert!(s.validate().is_ok());
}

#[test]
fn production_refuses_the_development_secret() {
    assert!(settings("production", DEV_JWT_SECRET).validate().is_err());
    assert!(settings("production", "short").validate().is_err());
    let strong = "x".repeat(40);
    let mut s = settings("production", &strong);
    assert!(
        s.validate().is_err(),
        "the development notify secret is refused too"
    );
    s.payment.notify_secret = SecretString::from("y".repeat(40));
    assert!(
        s.validate().is_err(),
        "the development server secret is refused too"
    );
    s.auth.server_secret = SecretString::from("z".repeat(40));
    assert!(s.validate().is_ok());
    assert!(settings("development", DEV_JWT_SECRET).validate().is_ok());
}

#[test]
fn production_refuses_the_mock_provider_and_names_every_missing_variable_at_once() {
    let mut s = settings("production", DEV_JWT_SECRET);
    s.payment.mock = true; // SECKILL__PAYMENT__MOCK=true
    let err = s.validate().expect_err("refused").to_string();
    for name in [
        "SECKILL__AUTH__JWT_SECRET",
        "SECKILL__AUTH__SERVER_SECRET",
        "SECKILL__PAYMENT__NOTIFY_SECRET",
        "SECKILL__PAYMENT__MOCK=false",
    ] {
        assert!(err.contains(name), "{err}");
    }
    s.auth.jwt_secret = SecretString::from("x".repeat(40));
    s.auth.server_secret = SecretString::from("z".repeat(40));
    s.payment.notify_secret = SecretString::from("y".repeat(40));
    let err = s.validate().expect_err("the mock alone is refused");
    assert!(err.to_string().contains("payment.mock"), "{err}");
    s.payment.mock = false;
    assert!(s.validate().is_ok());
}

#[test]
fn the_server_secret_must_not_be_the_jwt_secret_in_any_environment() {
    for env in ["development", "test", "production"] {
        let mut s = settings(env, &"x".repeat(40));
        s.auth.server_secret = s.auth.jwt_secret.clone();
        s.payment.notify_secret = SecretString::from("y".repeat(40));
        s.payment.mock = env != "production";
        let err = s.validate().expect_err(env).to_string();
        assert!(
            err.contains("auth.server_secret is auth.jwt_secret"),
            "{env}: {err}"
        );
        s.auth.server_secret = SecretString::from("z".repeat(40));
        assert!(s.validate().is_ok(), "{env}");
    }
}

#[test]
fn every_environment_but_development_and_test_is_held_to_production_rules() {
    for env in ["staging", "prod", "Production", "developmnet", ""] {
        let mut s = settings(env, DEV_JWT_SECRET);
        s.payment.mock = true;
        let err = s.validate().expect_err(env).to_string();
        for name in [
            "SECKILL__AUTH__JWT_SECRET",
            "SECKILL__AUTH__SERVER_SECRET",
            "SECKILL__PAYMENT__NOTIFY_SECRET",
            "SECKILL__PAYMENT__MOCK=false",
        ] {
            assert!(err.contains(name), "{env}: {err}");
        }
    }
    for env in ["development", "test"] {
        assert!(settings(env, DEV_JWT_SECRET).validate().is_ok(), "{env}");
    }
}

#[test]
fn the_environment_is_the_one_named_even_without_a_file_of_its_own() {
    // No config/staging.toml: default.toml says development, but the
    // environment is staging, and staging refuses the development secret.
    let err = Settings::load_env("staging")
        .expect_err("refused")
        .to_string();
    assert!(err.contains("staging (SECKILL_ENV=staging)"), "{err}");
    assert_eq!(Settings::load_env("test").unwrap().app.env, "test");
}

#[test]
fn a_publish_window_shorter_than_a_publish_can_take_is_refused() {
    let mut s = Settings::load_env("test").expect("test settings load");
    assert!(s.validate().is_ok());
    s.kafka.message_timeout_ms = std::time::Duration::from_millis(15_000);
    s.admission.publish_budget_ms = std::time::Duration::from_millis(5_000);
    s.reconcile.publish_window_secs = std::time::Duration::from_secs(30);
    let err = s.validate().expect_err("30 s < 2 × 15 s + 5 s");
    assert!(err.to_string().contains("publish_window_secs"), "{err}");
    s.reconcile.publish_window_secs = std::time::Duration::from_secs(35);
    assert!(s.validate().is_ok());
}

/// #59 (6f): on a replicated topic an event whose delivery timed out can
/// still commit once the in-sync set shrinks, so the restore of a lost
/// Redis waits the brokers' replica lag on top of the message timeout.
#[test]
fn the_restore_waits_for_a_late_commit_on_a_replicated_topic() {
    use std::time::Duration;
    let mut s = Settings::load_env("test").expect("test settings load");
    s.kafka.message_timeout_ms = Duration::from_millis(15_000);
    s.admission.publish_budget_ms = Duration::from_millis(5_000);
    s.kafka.replica_lag_max_ms = Duration::from_millis(10_000);
    s.kafka.replication_factor = 1;
    assert_eq!(
        s.restore_wait(),
        Duration::from_secs(20),
        "one replica commits at once"
    );
    s.kafka.replication_factor = 3;
    assert_eq!(s.restore_wait(), Duration::from_secs(30));
}

#[test]
fn a_rush_wait_is_held_between_the_batch_wait_and_five_seconds() {
    use std::time::Duration;
    let mut s = Settings::load_env("test").expect("test settings load");
    s.orders.batch_wait_ms = Duration::from_millis(20);
    for ok in [20, 300, 5_000] {
        s.orders.rush_batch_wait_ms = Duration::from_millis(ok);
        assert!(s.validate().is_ok(), "{ok} ms");
    }
    for refused in [19, 5_001] {
        s.orders.rush_batch_wait_ms = Duration::from_millis(refused);
        let err = s.validate().expect_err("outside the range").to_string();
        assert!(err.contains("orders.rush_batch_wait_ms"), "{err}");
    }
    s.orders.rush_in_flight = 0;
    assert!(s.validate().is_ok(), "rushes off: the wait is not used");
}

#[test]
fn an_unknown_redis_mode_and_a_pooled_gate_on_a_cluster_are_refused() {
    let mode = |name: &str| {
        serde_json::from_value::<RedisMode>(serde_json::json!(name)).map_err(|e| e.to_string())
    };
    let e = mode("sentinel").unwrap_err();
    assert!(e.contains("standalone") && e.contains("cluster"), "{e}");
    let mut s = Settings::load_env("test").expect("test settings load");
    s.redis.mode = mode("cluster").unwrap();
    assert!(s.validate().is_ok());
    s.redis.gate_connection = GateConnection::Pool;
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("one server only"), "{e}");
}

#[test]
fn debug_output_never_shows_secrets() {
    let s = Settings::load_env("test").expect("test settings load");
    let printed = format!("{s:?}");
    assert!(!printed.contains(DEV_JWT_SECRET));
    assert!(!printed.contains(DEV_SERVER_SECRET));
    assert!(!printed.contains("seckill:seckill@"));
}

#[test]
fn an_unnamed_environment_serves_on_loopback_only() {
    let mut s = settings("development", DEV_JWT_SECRET);
    s.app.env_named = false;
    for host in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
        s.app.host = host.into();
        assert!(s.validate().is_ok(), "{host}");
    }
    for host in ["0.0.0.0", "::", "10.0.0.5", "seckill.internal"] {
        s.app.host = host.into();
        let err = s.validate().expect_err(host).to_string();
        assert!(
            err.contains("SECKILL_ENV") && err.contains("loopback"),
            "{host}: {err}"
        );
    }
    // Named, development may bind anywhere: the operator said so.
    s.app.env_named = true;
    assert!(s.validate().is_ok());
}

#[test]
fn an_environment_loaded_by_name_is_named() {
    assert!(Settings::load_env("test").unwrap().app.env_named);
}

#[test]
fn an_identity_provider_needs_an_issuer_an_audience_and_one_way_to_its_keys() {
    let mut s = settings("test", DEV_JWT_SECRET);
    assert!(s.auth.provider().unwrap().is_none(), "HS256 by default");
    s.auth.jwks_url = Some("https://id.example.test/jwks".into());
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("auth.issuer and auth.audience"), "{e}");
    s.auth.issuer = Some("https://id.example.test".into());
    s.auth.audience = Some("seckill".into());
    assert!(s.validate().is_ok());
    assert!(s.auth.provider().unwrap().is_some());
    s.auth.discovery = true;
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("set one"), "{e}");
    s.auth.jwks_url = None;
    assert!(s.validate().is_ok(), "discovery from the issuer");
    s.auth.issuer = Some("id.example.test".into());
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("http(s) URL"), "{e}");
    s.auth.issuer = Some("https://id.example.test".into());
    s.auth.jwks_cooldown_secs = Duration::ZERO;
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("jwks_cooldown_secs"), "{e}");
    s.auth.jwks_cooldown_secs = Duration::from_secs(30);
    s.auth.jwks_ttl_secs = Duration::from_secs(10);
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("jwks_ttl_secs"), "{e}");
}

#[test]
fn outside_development_the_identity_provider_is_reached_over_https_only() {
    let strong = |s: &mut Settings| {
        s.auth.jwt_secret = SecretString::from("x".repeat(40));
        s.auth.server_secret = SecretString::from("z".repeat(40));
        s.payment.notify_secret = SecretString::from("y".repeat(40));
    };
    for (jwks_url, issuer, refused) in [
        (
            Some("http://id.example.test/jwks"),
            "https://id.example.test",
            "auth.jwks_url",
        ),
        (None, "http://id.example.test", "auth.issuer"),
    ] {
        let mut s = settings("production", DEV_JWT_SECRET);
        strong(&mut s);
        s.auth.jwks_url = jwks_url.map(str::to_owned);
        s.auth.discovery = jwks_url.is_none();
        s.auth.issuer = Some(issuer.into());
        s.auth.audience = Some("seckill".into());
        let e = s.validate().expect_err("clear text refused").to_string();
        assert!(e.contains(refused) && e.contains("https"), "{e}");
        // Development and tests run a local provider over http.
        s.app.env = "test".into();
        assert!(s.validate().is_ok());
    }
    let mut s = settings("production", DEV_JWT_SECRET);
    strong(&mut s);
    s.auth.jwks_url = Some("https://id.example.test/jwks".into());
    s.auth.issuer = Some("https://id.example.test".into());
    s.auth.audience = Some("seckill".into());
    assert!(s.validate().is_ok());
    // Without an identity provider, the issuer is only a name to compare.
    s.auth.jwks_url = None;
    s.auth.issuer = Some("http://shop.example".into());
    assert!(s.validate().is_ok());
}

#[test]
fn production_asks_for_the_notify_secret_only_where_a_provider_uses_it() {
    let mut s = settings("production", &"x".repeat(40));
    s.auth.server_secret = SecretString::from("z".repeat(40));
    let e = s
        .validate()
        .expect_err("external verifies with it")
        .to_string();
    assert!(e.contains("SECKILL__PAYMENT__NOTIFY_SECRET"), "{e}");
    s.payment.provider = Some(ProviderKind::Stripe);
    s.payment.stripe = Some(StripeSettings {
        api_base: "https://api.stripe.com".into(),
        secret_key: SecretString::from("sk_live_x"),
        webhook_secret: SecretString::from("whsec_x"),
        previous_webhook_secret: None,
        currency: "cny".into(),
    });
    assert!(
        s.validate().is_ok(),
        "under stripe nothing verifies X-Pay-Signature: {:?}",
        s.validate()
    );
}

//! Tokens from an identity provider: a real OIDC issuer as a process
//! (`oauth2-mock-server`, driven by `tests/oidc/issuer.mjs`; its
//! `node_modules` installed by `scripts/test.sh`), discovery, the JWKS, a
//! key rotation, and what is refused.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::helpers::{TestApp, eventually, spawn_app_with};

const AUDIENCE: &str = "seckill";

/// The issuer process, killed when dropped.
struct Issuer {
    child: Child,
    /// Its `iss`, and where discovery starts.
    url: String,
    control: String,
    /// The key it signs with at start.
    kid: String,
    http: reqwest::Client,
}

impl Drop for Issuer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Issuer {
    fn start() -> Self {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/oidc");
        assert!(
            std::path::Path::new(dir)
                .join("node_modules/oauth2-mock-server")
                .exists(),
            "{dir}/node_modules is missing: scripts/test.sh installs it (npm ci in {dir})"
        );
        let mut child = Command::new("node")
            .arg("issuer.mjs")
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node runs the issuer");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the issuer's first line");
        let ready: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the issuer did not start: {e}: {line:?}"));
        Self {
            child,
            url: ready["issuer"].as_str().unwrap().to_owned(),
            control: ready["control"].as_str().unwrap().to_owned(),
            kid: ready["kid"].as_str().unwrap().to_owned(),
            http: reqwest::Client::new(),
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let res = self
            .http
            .request(method, format!("{}{path}", self.control))
            .json(&body)
            .send()
            .await
            .expect("the issuer's control port answers");
        assert!(res.status().is_success(), "{path}: {}", res.status());
        res.json().await.expect("JSON")
    }

    /// A token signed with `kid`, its claims `claims` over the issuer's
    /// own (`iss`, `iat`, `exp`, `nbf`).
    async fn token(&self, kid: &str, claims: Value) -> String {
        let answer = self
            .call(
                reqwest::Method::POST,
                "/token",
                json!({"kid": kid, "claims": claims}),
            )
            .await;
        answer["token"].as_str().unwrap().to_owned()
    }

    async fn add_key(&self, alg: &str) -> String {
        let answer = self
            .call(reqwest::Method::POST, "/keys", json!({"alg": alg}))
            .await;
        answer["kid"].as_str().unwrap().to_owned()
    }

    async fn remove_key(&self, kid: &str) {
        self.call(reqwest::Method::DELETE, &format!("/keys/{kid}"), json!({}))
            .await;
    }
}

/// A server taking tokens from `issuer`, found by discovery.
async fn app_for(issuer: &Issuer, ttl: Duration, cooldown: Duration) -> TestApp {
    let url = issuer.url.clone();
    spawn_app_with(move |s| {
        s.auth.issuer = Some(url);
        s.auth.audience = Some(AUDIENCE.into());
        s.auth.discovery = true;
        s.auth.jwks_ttl_secs = ttl;
        s.auth.jwks_cooldown_secs = cooldown;
    })
    .await
}

/// `GET /api/v1/me` with `token`: its status and body.
async fn me(app: &TestApp, token: &str) -> (u16, Value) {
    let res = app.get("/api/v1/me", Some(token)).await;
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// The JWKS fetches the server tried, from `/metrics`.
async fn fetches(app: &TestApp) -> u64 {
    let text = app.get("/metrics", None).await.text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("seckill_auth_jwks_fetches_total "))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

#[tokio::test]
async fn a_providers_token_is_accepted_its_rotated_key_after_one_fetch_and_a_removed_key_refused() {
    let issuer = Issuer::start();
    let app = app_for(&issuer, Duration::from_secs(2), Duration::from_secs(1)).await;
    let first = issuer
        .token(&issuer.kid, json!({"sub": "7", "aud": AUDIENCE}))
        .await;
    let (status, body) = me(&app, &first).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["user_id"], 7, "{body}");
    assert_eq!(body["role"], "user", "no role claim: a buyer: {body}");
    let admin = issuer
        .token(
            &issuer.kid,
            json!({"sub": "8", "aud": AUDIENCE, "role": "admin"}),
        )
        .await;
    let res = app.get("/api/v1/admin/me", Some(&admin)).await;
    assert_eq!(res.status(), 200);

    // The provider adds an ES256 key and signs with it. Once the cooldown
    // since the last fetch has passed (a lower bound: a slower host only
    // waits longer), the new kid is accepted at its first try, after one
    // fetch.
    let rotated = issuer.add_key("ES256").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = fetches(&app).await;
    let second = issuer
        .token(&rotated, json!({"sub": "9", "aud": AUDIENCE}))
        .await;
    let (status, body) = me(&app, &second).await;
    assert_eq!(status, 200, "the new kid: {body}");
    assert_eq!(fetches(&app).await - before, 1, "one fetch for the new kid");

    // The provider removes the first key: refused once the set is
    // fetched again (within its TTL).
    issuer.remove_key(&issuer.kid).await;
    eventually(
        "the removed key refused",
        Duration::from_secs(60),
        || async { (me(&app, &first).await.0 == 401).then_some(()) },
    )
    .await;
    assert_eq!(
        me(&app, &second).await.0,
        200,
        "the remaining key still works"
    );
    // The development token route mints nothing with a provider.
    let res = app
        .client
        .post(format!("{}/api/v1/dev/token", app.address))
        .json(&json!({"user_id": 7}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

#[tokio::test]
async fn forged_and_foreign_tokens_are_refused_and_made_up_kids_cost_one_fetch_per_cooldown() {
    const COOLDOWN: Duration = Duration::from_secs(2);
    let issuer = Issuer::start();
    let app = app_for(&issuer, Duration::from_secs(3600), COOLDOWN).await;
    let good = issuer
        .token(&issuer.kid, json!({"sub": "7", "aud": AUDIENCE}))
        .await;
    assert_eq!(me(&app, &good).await.0, 200);
    let b64 = |v: Value| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let (_, payload, signature) = {
        let mut parts = good.split('.');
        (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        )
    };
    let refused = |token: String, why: &'static str| {
        let app = &app;
        async move {
            let (status, body) = me(app, &token).await;
            assert_eq!(status, 401, "{why}: {body}");
            assert_eq!(body["code"], "UNAUTHORIZED", "{why}: {body}");
        }
    };
    // alg none, unsigned, over the good token's claims.
    let none = b64(json!({"alg": "none", "typ": "JWT", "kid": issuer.kid}));
    refused(format!("{none}.{payload}."), "alg none").await;
    // HS256 keyed with the provider's published key (its JWKS text).
    let jwks = reqwest::get(format!("{}/jwks", issuer.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let confused = {
        use hmac::{KeyInit, Mac};
        let head = b64(json!({"alg": "HS256", "typ": "JWT", "kid": issuer.kid}));
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(jwks.as_bytes()).unwrap();
        mac.update(format!("{head}.{payload}").as_bytes());
        let sig = {
            use base64::Engine;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
        };
        format!("{head}.{payload}.{sig}")
    };
    refused(confused, "HS256 over the public key").await;
    refused(
        issuer
            .token(&issuer.kid, json!({"sub": "7", "aud": "another-service"}))
            .await,
        "wrong aud",
    )
    .await;
    refused(
        issuer
            .token(
                &issuer.kid,
                json!({"sub": "7", "aud": AUDIENCE, "iss": "http://evil.example"}),
            )
            .await,
        "wrong iss",
    )
    .await;
    refused(app.user_token(7), "an HS256 token of the JWT secret").await;

    // 1,000 requests with made-up kids, 50 at a time, once a cooldown has
    // passed since the last fetch (a lower bound), so that the first may
    // fetch.
    tokio::time::sleep(COOLDOWN).await;
    let before = fetches(&app).await;
    let started = Instant::now();
    let mut made_up = Vec::new();
    for i in 0..1000 {
        let head = b64(json!({"alg": "RS256", "typ": "JWT", "kid": format!("made-up-{i}")}));
        made_up.push(format!("{head}.{payload}.{signature}"));
    }
    for chunk in made_up.chunks(50) {
        let answers = futures_util::future::join_all(chunk.iter().map(|t| me(&app, t))).await;
        assert!(answers.iter().all(|(s, _)| *s == 401), "all refused");
    }
    let cooldowns = started.elapsed().as_secs() / COOLDOWN.as_secs() + 1;
    let spent = fetches(&app).await - before;
    println!(
        "1,000 made-up kids in {:?}: {spent} JWKS fetches",
        started.elapsed()
    );
    assert!(
        (1..=cooldowns).contains(&spent),
        "{spent} fetches for 1,000 made-up kids within {cooldowns} cooldown(s)"
    );
    assert_eq!(me(&app, &good).await.0, 200, "the real key still works");
}

//! User tokens from an identity provider: RS256 or ES256, verified with
//! the public keys it publishes as a JWKS (RFC 7517), found at
//! `auth.jwks_url` or through OIDC discovery from `auth.issuer`.
//!
//! The key set is kept for `auth.jwks_ttl_secs`. A token whose key is in
//! the set is verified at once, however old the set: a set past its TTL is
//! fetched again in the background, and stays in use until a fetch
//! answers, so an identity provider's outage never holds a request. A
//! token whose `kid` is not in it waits for the set to be fetched again (a
//! provider rotated its keys), but at most once per
//! `auth.jwks_cooldown_secs`, and one fetch at a time: a storm of made-up
//! `kid`s costs one fetch, then each of them is refused from memory. A
//! fetch that fails is tried again after the cooldown, then twice as long
//! each time, up to the TTL. A key removed from the JWKS is refused from
//! the first fetch that no longer has it.
//!
//! Only RS256 and ES256 are accepted, whatever a token's header or a
//! key's `alg` says; a key is used only for the one algorithm its type
//! allows (an RSA key for RS256, a P-256 key for ES256), so a token
//! signed with HS256 over the public key, or with `alg: none`, is refused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use super::Role;
pub use crate::config::{JwksConfig, JwksSource};
use crate::domain::UserId;

/// The algorithms a provider's token may use. Never HS*: the verifying
/// key is public.
const ALLOWED: [Algorithm; 2] = [Algorithm::RS256, Algorithm::ES256];

/// Leeway on `exp` and `nbf`, for clocks a little apart.
const LEEWAY_SECS: u64 = 30;

/// How long one fetch of the JWKS or the discovery document may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// One usable key: its decoding key and the one algorithm it verifies.
#[derive(Clone)]
struct Key {
    decoding: DecodingKey,
    alg: Algorithm,
}

/// The key set as last fetched.
#[derive(Default)]
struct Fetched {
    keys: HashMap<String, Key>,
    /// When it was fetched; `None` before the first fetch answered.
    at: Option<Instant>,
}

/// When the set was last asked for, and how that went.
#[derive(Default)]
struct Tries {
    /// When the last fetch started.
    last: Option<Instant>,
    /// Fetches that failed since the last one that answered.
    failures: u32,
    /// A background fetch is under way.
    refreshing: bool,
}

/// The claims read from a provider's token (`iss`, `aud`, `exp` and `nbf`
/// are checked by the validation, in whatever shape they come).
#[derive(Debug, Deserialize)]
struct ProviderClaims {
    sub: String,
    /// `user` when absent: a provider that knows nothing of our roles
    /// issues buyers' tokens.
    #[serde(default)]
    role: Option<Role>,
}

/// A provider's public keys, fetched and kept.
pub struct Jwks {
    config: JwksConfig,
    http: reqwest::Client,
    validation_base: Validation,
    fetched: RwLock<Fetched>,
    /// Held while a fetch runs: one at a time.
    fetching: tokio::sync::Mutex<()>,
    tries: std::sync::Mutex<Tries>,
    /// Fetches tried since start.
    fetches: AtomicU64,
    /// The same, exported as `seckill_auth_jwks_fetches_total` once
    /// registered ([`Jwks::fetch_counter`]).
    counter: prometheus::IntCounter,
    /// The JWKS URL once discovery found it.
    jwks_url: RwLock<Option<String>>,
}

impl Jwks {
    pub fn new(config: JwksConfig) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .build()
            .context("building the JWKS client")?;
        let mut validation = Validation::new(Algorithm::RS256);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_issuer(&[&config.issuer]);
        validation.set_audience(&[&config.audience]);
        validation.set_required_spec_claims(&["exp", "sub", "iss", "aud"]);
        let jwks_url = match &config.source {
            JwksSource::Jwks(url) => Some(url.clone()),
            JwksSource::Discovery(_) => None,
        };
        Ok(Self {
            config,
            http,
            validation_base: validation,
            fetched: RwLock::default(),
            fetching: tokio::sync::Mutex::new(()),
            tries: std::sync::Mutex::default(),
            fetches: AtomicU64::new(0),
            counter: prometheus::IntCounter::new(
                "auth_jwks_fetches_total",
                "Fetches of the identity provider's JWKS tried (a stale set, or a kid it did not have)",
            )
            .context("the JWKS fetch counter")?,
            jwks_url: RwLock::new(jwks_url),
        })
    }

    /// Fetches tried since start.
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }

    /// The counter of fetches, to register with the process's metrics.
    pub fn fetch_counter(&self) -> prometheus::IntCounter {
        self.counter.clone()
    }

    /// The caller `token` names, or why it is refused.
    pub async fn verify(self: &Arc<Self>, token: &str) -> Result<(UserId, Role), String> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| format!("invalid token: {e}"))?;
        if !ALLOWED.contains(&header.alg) {
            return Err(format!(
                "invalid token: algorithm {:?} is not accepted (RS256, ES256)",
                header.alg
            ));
        }
        let kid = header
            .kid
            .ok_or_else(|| "invalid token: no key id (kid)".to_owned())?;
        let key = self
            .key(&kid)
            .await
            .ok_or_else(|| format!("invalid token: no key {kid:?} in the provider's JWKS"))?;
        if key.alg != header.alg {
            return Err(format!(
                "invalid token: key {kid:?} verifies {:?}, not {:?}",
                key.alg, header.alg
            ));
        }
        let mut validation = self.validation_base.clone();
        validation.algorithms = vec![key.alg];
        let data = jsonwebtoken::decode::<ProviderClaims>(token, &key.decoding, &validation)
            .map_err(|e| format!("invalid token: {e}"))?;
        let user = UserId::parse(&data.claims.sub)
            .ok_or_else(|| "token subject is not a user id".to_owned())?;
        Ok((user, data.claims.role.unwrap_or(Role::User)))
    }

    /// The key `kid`. A known key answers at once, however old the set:
    /// a stale set is fetched again in the background. An unknown `kid`
    /// waits for a fetch, one at a time, only when one is due.
    async fn key(self: &Arc<Self>, kid: &str) -> Option<Key> {
        let (known, fresh) = self.lookup(kid);
        if let Some(key) = known {
            if !fresh {
                self.refresh_in_background();
            }
            return Some(key);
        }
        if !self.due(false) {
            return None;
        }
        let _one = self.fetching.lock().await;
        // Another caller may have fetched while this one waited.
        if let (Some(key), _) = self.lookup(kid) {
            return Some(key);
        }
        if self.due(false) {
            self.try_fetch().await;
        }
        self.lookup(kid).0
    }

    /// Whether a fetch may start now: never tried; after a failure, once
    /// the backoff (the cooldown, doubled per failure, at most the TTL)
    /// has passed; else for a stale set at once, and for an unknown `kid`
    /// once the cooldown has passed.
    fn due(&self, stale: bool) -> bool {
        let tries = self.tries.lock().unwrap_or_else(|e| e.into_inner());
        let Some(last) = tries.last else {
            return true;
        };
        let wait = match tries.failures {
            0 if stale => return true,
            0 => self.config.cooldown,
            n => self
                .config
                .cooldown
                .saturating_mul(1 << (n - 1).min(16))
                .min(self.config.ttl.max(self.config.cooldown)),
        };
        last.elapsed() >= wait
    }

    /// Starts a fetch of a stale set, unless one is under way or not due:
    /// the callers go on with the set they have.
    fn refresh_in_background(self: &Arc<Self>) {
        {
            let mut tries = self.tries.lock().unwrap_or_else(|e| e.into_inner());
            if tries.refreshing {
                return;
            }
            tries.refreshing = true;
        }
        let me = Arc::clone(self);
        tokio::spawn(async move {
            {
                let _one = me.fetching.lock().await;
                let stale = !me.lookup("").1;
                if stale && me.due(true) {
                    me.try_fetch().await;
                }
            }
            me.tries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .refreshing = false;
        });
    }

    /// One fetch, noted for the backoff; a failure leaves the set in use.
    async fn try_fetch(&self) {
        self.tries.lock().unwrap_or_else(|e| e.into_inner()).last = Some(Instant::now());
        let fetched = self.fetch().await;
        let mut tries = self.tries.lock().unwrap_or_else(|e| e.into_inner());
        match fetched {
            Ok(()) => tries.failures = 0,
            Err(e) => {
                tries.failures = tries.failures.saturating_add(1);
                tracing::warn!(
                    error = format!("{e:#}"),
                    failures = tries.failures,
                    "fetching the identity provider's JWKS failed; the last set stays in use"
                );
            }
        }
    }

    /// The key `kid` as held now, and whether the set is within its TTL.
    fn lookup(&self, kid: &str) -> (Option<Key>, bool) {
        let fetched = self.fetched.read().unwrap_or_else(|e| e.into_inner());
        let fresh = fetched.at.is_some_and(|at| at.elapsed() < self.config.ttl);
        (fetched.keys.get(kid).cloned(), fresh)
    }

    async fn fetch(&self) -> anyhow::Result<()> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.counter.inc();
        let url = self.jwks_url().await?;
        #[derive(Deserialize)]
        struct Raw {
            keys: Vec<serde_json::Value>,
        }
        let raw: Raw = self.get_json(&url, "a JWKS").await?;
        // One key this library cannot read leaves the others usable.
        let set = JwkSet {
            keys: raw
                .keys
                .into_iter()
                .filter_map(|k| serde_json::from_value(k).ok())
                .collect(),
        };
        let keys = usable(&set);
        tracing::info!(
            url,
            keys = keys.len(),
            "fetched the identity provider's JWKS"
        );
        let mut fetched = self.fetched.write().unwrap_or_else(|e| e.into_inner());
        fetched.keys = keys;
        fetched.at = Some(Instant::now());
        Ok(())
    }

    /// `GET url` answered 2xx with `what` in JSON.
    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        what: &str,
    ) -> anyhow::Result<T> {
        self.http
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("GET {url}"))?
            .json()
            .await
            .with_context(|| format!("{url} is not {what}"))
    }

    /// The JWKS URL: configured, or found once by discovery.
    async fn jwks_url(&self) -> anyhow::Result<String> {
        if let Some(url) = self
            .jwks_url
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Ok(url);
        }
        let JwksSource::Discovery(issuer) = &self.config.source else {
            unreachable!("a configured JWKS URL is set at start")
        };
        let at = discovery_url(issuer);
        #[derive(Deserialize)]
        struct Discovery {
            issuer: String,
            jwks_uri: String,
        }
        let doc: Discovery = self.get_json(&at, "an OpenID configuration").await?;
        // OIDC Discovery 1.0, 4.3: the document's issuer is the one asked.
        anyhow::ensure!(
            doc.issuer == *issuer,
            "{at} names issuer {:?}, not {issuer:?}",
            doc.issuer
        );
        *self.jwks_url.write().unwrap_or_else(|e| e.into_inner()) = Some(doc.jwks_uri.clone());
        Ok(doc.jwks_uri)
    }
}

/// `{issuer}/.well-known/openid-configuration`.
pub fn discovery_url(issuer: &str) -> String {
    format!(
        "{}/.well-known/openid-configuration",
        issuer.trim_end_matches('/')
    )
}

/// The keys of `set` this service can use, by `kid`: RSA keys for RS256,
/// P-256 keys for ES256. A key without a `kid`, of another type or curve,
/// meant for encryption, or whose own `alg` says otherwise, is left out.
fn usable(set: &JwkSet) -> HashMap<String, Key> {
    let mut keys = HashMap::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else {
            continue;
        };
        if jwk
            .common
            .public_key_use
            .as_ref()
            .is_some_and(|u| *u != jsonwebtoken::jwk::PublicKeyUse::Signature)
        {
            continue;
        }
        let alg = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Algorithm::RS256,
            AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            _ => continue,
        };
        let declared = jwk.common.key_algorithm;
        let agrees = match declared {
            None => true,
            Some(KeyAlgorithm::RS256) => alg == Algorithm::RS256,
            Some(KeyAlgorithm::ES256) => alg == Algorithm::ES256,
            Some(_) => false,
        };
        if !agrees {
            continue;
        }
        if let Ok(decoding) = DecodingKey::from_jwk(jwk) {
            keys.insert(kid, Key { decoding, alg });
        }
    }
    keys
}

/// Shared, for the extractor and the metrics.
pub type SharedJwks = Arc<Jwks>;

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    use jsonwebtoken::jwk::Jwk;
    use jsonwebtoken::{EncodingKey, Header};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const ISSUER: &str = "https://id.example.test";
    const AUDIENCE: &str = "seckill";

    /// A key made now, as an identity provider holds it.
    struct Signer {
        kid: String,
        alg: Algorithm,
        encoding: EncodingKey,
        public: Jwk,
        /// The public key as PEM-less DER bytes, for the HS256 confusion.
        public_bytes: Vec<u8>,
    }

    fn rsa_signer(kid: &str) -> Signer {
        use rsa::pkcs1::{EncodeRsaPrivateKey, EncodeRsaPublicKey};
        use rsa::{Generate, PrivateKey};
        let key = PrivateKey::generate();
        let der = key.to_pkcs1_der().expect("pkcs1");
        let encoding = EncodingKey::from_rsa_der(der.as_bytes());
        let public_bytes = key
            .to_public_key()
            .to_pkcs1_der()
            .expect("public pkcs1")
            .as_bytes()
            .to_vec();
        signer(kid, Algorithm::RS256, encoding, public_bytes)
    }

    fn ec_signer(kid: &str) -> Signer {
        use p256::pkcs8::EncodePrivateKey;
        let key = loop {
            let mut bytes = [0u8; 32];
            getrandom::fill(&mut bytes).expect("random bytes");
            if let Ok(key) = p256::SecretKey::from_slice(&bytes) {
                break key;
            }
        };
        let der = key.to_pkcs8_der().expect("pkcs8");
        let encoding = EncodingKey::from_ec_der(der.as_bytes());
        let public_bytes = key.public_key().to_sec1_bytes().to_vec();
        signer(kid, Algorithm::ES256, encoding, public_bytes)
    }

    fn signer(kid: &str, alg: Algorithm, encoding: EncodingKey, public_bytes: Vec<u8>) -> Signer {
        let mut public = Jwk::from_encoding_key(&encoding, alg).expect("public jwk");
        public.common.key_id = Some(kid.to_owned());
        Signer {
            kid: kid.to_owned(),
            alg,
            encoding,
            public,
            public_bytes,
        }
    }

    fn claims(sub: &str) -> serde_json::Value {
        let now = chrono::Utc::now().timestamp();
        serde_json::json!({"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "exp": now + 300, "iat": now})
    }

    impl Signer {
        fn token(&self, claims: &serde_json::Value) -> String {
            let mut header = Header::new(self.alg);
            header.kid = Some(self.kid.clone());
            jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
        }
    }

    /// An identity provider's JWKS and discovery document over HTTP on
    /// loopback, counting the JWKS fetches.
    struct Provider {
        base: String,
        published: Arc<Mutex<Vec<Jwk>>>,
        fetches: Arc<AtomicUsize>,
        mode: Arc<AtomicUsize>,
    }

    /// How the provider answers a JWKS fetch.
    #[derive(Clone, Copy)]
    enum Answer {
        Keys = 0,
        /// 500 at once.
        Fails = 1,
        /// Nothing for a minute: a provider that hangs.
        Hangs = 2,
    }

    impl Provider {
        async fn start() -> Self {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let published: Arc<Mutex<Vec<Jwk>>> = Arc::default();
            let fetches = Arc::new(AtomicUsize::new(0));
            let mode = Arc::new(AtomicUsize::new(Answer::Keys as usize));
            let (keys, count, issuer) = (published.clone(), fetches.clone(), base.clone());
            let how = mode.clone();
            tokio::spawn(async move {
                while let Ok((mut conn, _)) = listener.accept().await {
                    let (keys, count, issuer, how) =
                        (keys.clone(), count.clone(), issuer.clone(), how.clone());
                    tokio::spawn(async move {
                        let mut request = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                            match conn.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => request.extend_from_slice(&buf[..n]),
                            }
                        }
                        let line = String::from_utf8_lossy(&request)
                            .lines()
                            .next()
                            .unwrap_or("")
                            .to_owned();
                        let mut status = "200 OK";
                        let body = if line.contains("/.well-known/openid-configuration") {
                        serde_json::json!({"issuer": issuer, "jwks_uri": format!("{issuer}/jwks")})
                    } else {
                        count.fetch_add(1, Ordering::SeqCst);
                        match how.load(Ordering::SeqCst) {
                            1 => status = "500 Internal Server Error",
                            2 => tokio::time::sleep(Duration::from_secs(60)).await,
                            _ => {}
                        }
                        let keys = keys.lock().unwrap().clone();
                        serde_json::json!({"keys": keys})
                    }
                    .to_string();
                        let reply = format!(
                            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = conn.write_all(reply.as_bytes()).await;
                    });
                }
            });
            Self {
                base,
                published,
                fetches,
                mode,
            }
        }

        fn publish(&self, signers: &[&Signer]) {
            *self.published.lock().unwrap() = signers.iter().map(|s| s.public.clone()).collect();
        }

        fn fetches(&self) -> usize {
            self.fetches.load(Ordering::SeqCst)
        }

        fn jwks(&self, ttl: Duration, cooldown: Duration) -> Arc<Jwks> {
            Arc::new(
                Jwks::new(JwksConfig {
                    source: JwksSource::Jwks(format!("{}/jwks", self.base)),
                    issuer: ISSUER.into(),
                    audience: AUDIENCE.into(),
                    ttl,
                    cooldown,
                })
                .unwrap(),
            )
        }

        /// From now on, each JWKS fetch is answered as `answer` says.
        fn answer(&self, answer: Answer) {
            self.mode.store(answer as usize, Ordering::SeqCst);
        }
    }

    const LONG: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn rs256_and_es256_tokens_of_the_published_keys_are_accepted() {
        let provider = Provider::start().await;
        let (rsa, ec) = (rsa_signer("r1"), ec_signer("e1"));
        provider.publish(&[&rsa, &ec]);
        let jwks = provider.jwks(LONG, LONG);
        assert_eq!(
            jwks.verify(&rsa.token(&claims("7"))).await,
            Ok((UserId::parse("7").unwrap(), Role::User)),
            "no role claim: a buyer"
        );
        let mut admin = claims("8");
        admin["role"] = "admin".into();
        assert_eq!(
            jwks.verify(&ec.token(&admin)).await,
            Ok((UserId::parse("8").unwrap(), Role::Admin))
        );
        let mut listed = claims("9");
        listed["aud"] = serde_json::json!(["other", AUDIENCE]);
        assert!(
            jwks.verify(&rsa.token(&listed)).await.is_ok(),
            "aud as a list naming us"
        );
        assert_eq!(provider.fetches(), 1, "one fetch serves every known key");
    }

    #[tokio::test]
    async fn a_forged_or_foreign_token_is_refused() {
        let provider = Provider::start().await;
        let rsa = rsa_signer("r1");
        let ec = ec_signer("e1");
        provider.publish(&[&rsa, &ec]);
        let jwks = provider.jwks(LONG, LONG);
        let refused = |token: String, why: &'static str| {
            let jwks = &jwks;
            async move {
                let answer = jwks.verify(&token).await;
                assert!(answer.is_err(), "{why}: {answer:?}");
            }
        };
        // alg none, unsigned.
        let b64 = |v: serde_json::Value| {
            use base64::Engine;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let none = format!(
            "{}.{}.",
            b64(serde_json::json!({"alg": "none", "kid": "r1", "typ": "JWT"})),
            b64(claims("7"))
        );
        refused(none, "alg none").await;
        // HS256 keyed with the RSA public key's bytes.
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("r1".into());
        let confused = jsonwebtoken::encode(
            &header,
            &claims("7"),
            &EncodingKey::from_secret(&rsa.public_bytes).unwrap(),
        )
        .unwrap();
        refused(confused, "HS256 over the public key").await;
        // ES256 claimed over the RSA key's kid.
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("r1".into());
        refused(
            jsonwebtoken::encode(&header, &claims("7"), &ec.encoding).unwrap(),
            "another key's kid",
        )
        .await;
        for (field, value, why) in [
            ("aud", serde_json::json!("someone-else"), "wrong aud"),
            (
                "iss",
                serde_json::json!("https://evil.example"),
                "wrong iss",
            ),
            (
                "exp",
                serde_json::json!(chrono::Utc::now().timestamp() - 120),
                "expired",
            ),
            (
                "nbf",
                serde_json::json!(chrono::Utc::now().timestamp() + 120),
                "not yet valid",
            ),
            (
                "sub",
                serde_json::json!("alice"),
                "a subject that is not a user id",
            ),
        ] {
            let mut c = claims("7");
            c[field] = value;
            refused(rsa.token(&c), why).await;
        }
        let mut c = claims("7");
        c.as_object_mut().unwrap().remove("aud");
        refused(rsa.token(&c), "no aud").await;
        // Signed by a key the provider never published.
        refused(
            rsa_signer("r1").token(&claims("7")),
            "another key under a known kid",
        )
        .await;
        let mut no_kid = Header::new(Algorithm::RS256);
        no_kid.kid = None;
        refused(
            jsonwebtoken::encode(&no_kid, &claims("7"), &rsa.encoding).unwrap(),
            "no kid",
        )
        .await;
    }

    #[tokio::test]
    async fn made_up_kids_cost_one_fetch_per_cooldown() {
        let provider = Provider::start().await;
        let rsa = rsa_signer("r1");
        provider.publish(&[&rsa]);
        let jwks = Arc::new(provider.jwks(LONG, LONG));
        assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
        assert_eq!(provider.fetches(), 1);
        // 1,000 tokens with random kids, 100 at a time.
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..1000 {
            let jwks = jwks.clone();
            let mut header = Header::new(Algorithm::RS256);
            header.kid = Some(format!("made-up-{i}-{}", fastrand::u64(..)));
            let token = jsonwebtoken::encode(&header, &claims("7"), &rsa.encoding).unwrap();
            tasks.spawn(async move { jwks.verify(&token).await.is_err() });
            if tasks.len() >= 100 {
                assert!(tasks.join_next().await.unwrap().unwrap(), "refused");
            }
        }
        while let Some(refused) = tasks.join_next().await {
            assert!(refused.unwrap(), "refused");
        }
        assert!(
            provider.fetches() <= 2,
            "{} fetches for 1,000 made-up kids within one cooldown",
            provider.fetches()
        );
        assert!(
            jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
            "the real key still works"
        );
    }

    #[tokio::test]
    async fn a_rotated_key_is_accepted_after_one_fetch_and_a_removed_one_refused() {
        let provider = Provider::start().await;
        let (old, new) = (rsa_signer("old"), ec_signer("new"));
        provider.publish(&[&old]);
        // No cooldown: every unknown kid may fetch (the storm test holds it).
        let jwks = provider.jwks(LONG, Duration::ZERO);
        let old_token = old.token(&claims("7"));
        assert!(jwks.verify(&old_token).await.is_ok());
        assert_eq!(provider.fetches(), 1);
        // The provider adds a key and signs with it.
        provider.publish(&[&old, &new]);
        assert!(
            jwks.verify(&new.token(&claims("7"))).await.is_ok(),
            "the new kid"
        );
        assert_eq!(provider.fetches(), 2, "one fetch for the new kid");
        assert!(
            jwks.verify(&old_token).await.is_ok(),
            "the old key is still published"
        );
        assert_eq!(provider.fetches(), 2, "known keys cost no fetch");
        // The provider removes the old key; the next fetch drops it.
        let newer = rsa_signer("newer");
        provider.publish(&[&new, &newer]);
        assert!(jwks.verify(&newer.token(&claims("7"))).await.is_ok());
        assert_eq!(provider.fetches(), 3);
        assert!(
            jwks.verify(&old_token).await.is_err(),
            "the removed key is refused"
        );
    }

    #[tokio::test]
    async fn a_stale_set_is_fetched_again_and_discovery_finds_the_jwks() {
        let provider = Provider::start().await;
        let rsa = rsa_signer("r1");
        provider.publish(&[&rsa]);
        let jwks = Arc::new(
            Jwks::new(JwksConfig {
                source: JwksSource::Discovery(provider.base.clone()),
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                ttl: Duration::ZERO,
                cooldown: LONG,
            })
            .unwrap(),
        );
        assert!(
            jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
            "found by discovery"
        );
        assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
        fetched(&provider, 2, "a set past its TTL is fetched again").await;
        // An issuer whose document names another issuer is not trusted.
        let wrong = Arc::new(
            Jwks::new(JwksConfig {
                source: JwksSource::Discovery(format!("{}/other", provider.base)),
                issuer: ISSUER.into(),
                audience: AUDIENCE.into(),
                ttl: LONG,
                cooldown: LONG,
            })
            .unwrap(),
        );
        assert!(wrong.verify(&rsa.token(&claims("7"))).await.is_err());
    }

    /// Waits (a minute at most) until the provider has been asked `n`
    /// times: a background fetch lands when it lands.
    async fn fetched(provider: &Provider, n: usize, what: &str) {
        for _ in 0..600 {
            if provider.fetches() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(provider.fetches(), n, "{what}");
    }

    /// An identity provider that hangs past the set's TTL holds no
    /// request whose key is known: each is verified with the set in hand,
    /// and one fetch at a time goes on in the background.
    #[tokio::test]
    async fn a_hung_provider_never_holds_a_token_of_a_known_key() {
        let provider = Provider::start().await;
        let rsa = rsa_signer("r1");
        provider.publish(&[&rsa]);
        let jwks = provider.jwks(Duration::ZERO, LONG);
        assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
        provider.answer(Answer::Hangs);
        let token = rsa.token(&claims("7"));
        for round in 0..2 {
            let verified = tokio::time::timeout(
                Duration::from_secs(30),
                futures_util::future::join_all((0..20).map(|_| jwks.verify(&token))),
            )
            .await
            .expect("no request waits for the hung fetch");
            assert!(verified.iter().all(Result::is_ok), "round {round}");
            fetched(
                &provider,
                2,
                "one fetch in the background, not one per request",
            )
            .await;
        }
    }

    /// A provider that fails is asked again only after a backoff, not by
    /// every request that finds the set stale.
    #[tokio::test]
    async fn a_failing_provider_is_asked_again_only_after_a_backoff() {
        let provider = Provider::start().await;
        let rsa = rsa_signer("r1");
        provider.publish(&[&rsa]);
        let jwks = provider.jwks(Duration::ZERO, LONG);
        assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
        provider.answer(Answer::Fails);
        assert!(jwks.verify(&rsa.token(&claims("7"))).await.is_ok());
        fetched(&provider, 2, "the stale set is fetched again").await;
        // Whether that fetch is still under way or has failed, no request
        // starts another.
        for _ in 0..50 {
            assert!(
                jwks.verify(&rsa.token(&claims("7"))).await.is_ok(),
                "the last set stays in use"
            );
        }
        assert_eq!(provider.fetches(), 2, "no fetch before the backoff");
    }
}

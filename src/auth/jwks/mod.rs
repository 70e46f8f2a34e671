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
mod tests;

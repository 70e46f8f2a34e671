//! `[auth]`: how tokens are checked, and the identity provider's keys.

use std::time::Duration;

use anyhow::bail;
use secrecy::SecretString;
use serde::Deserialize;

use super::duration;

/// JWT verification settings.
#[derive(Debug, Clone, Deserialize)]
pub struct AuthSettings {
    /// HS256 secret shared with whoever issues tokens.
    pub jwt_secret: SecretString,
    /// The key root of what the server signs for itself and checks
    /// itself: queue passes, proof-of-work challenges, entrants' salts,
    /// the fallback's purchase tokens. Never the JWT secret: whoever can
    /// mint user tokens must not be able to mint passes.
    pub server_secret: SecretString,
    /// When set, a token's `iss` must be exactly this.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, a token's `aud` must name this.
    #[serde(default)]
    pub audience: Option<String>,
    /// User tokens come from an identity provider that publishes its keys
    /// here (a JWKS): RS256 or ES256, never HS256. Needs `issuer` and
    /// `audience`.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// Find the JWKS through OIDC discovery, at
    /// `{issuer}/.well-known/openid-configuration`, instead of `jwks_url`.
    #[serde(default)]
    pub discovery: bool,
    /// How long a fetched JWKS is used before it is fetched again, in
    /// seconds.
    #[serde(default = "jwks_ttl_by_default", deserialize_with = "duration::secs")]
    pub jwks_ttl_secs: Duration,
    /// The least time between two fetches of the JWKS for a token whose
    /// `kid` it does not have, in seconds: made-up `kid`s cost one fetch
    /// per cooldown.
    #[serde(
        default = "jwks_cooldown_by_default",
        deserialize_with = "duration::secs"
    )]
    pub jwks_cooldown_secs: Duration,
}

fn jwks_ttl_by_default() -> Duration {
    Duration::from_secs(300)
}

fn jwks_cooldown_by_default() -> Duration {
    Duration::from_secs(30)
}

/// Where the keys are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// A JWKS URL.
    Jwks(String),
    /// An issuer whose `/.well-known/openid-configuration` names it.
    Discovery(String),
}

/// What the identity provider's key set (`auth::jwks::Jwks`) is
/// configured with.
#[derive(Debug, Clone)]
pub struct JwksConfig {
    pub source: JwksSource,
    /// The exact `iss` a token must carry.
    pub issuer: String,
    /// The audience a token's `aud` must name.
    pub audience: String,
    pub ttl: Duration,
    pub cooldown: Duration,
}

impl AuthSettings {
    /// The identity provider's settings, `None` without one; an error
    /// names what is missing or contradicts.
    pub fn provider(&self) -> anyhow::Result<Option<JwksConfig>> {
        let source = match (&self.jwks_url, self.discovery) {
            (None, false) => return Ok(None),
            (Some(_), true) => {
                bail!("auth.jwks_url and auth.discovery: set one (discovery finds the JWKS itself)")
            }
            (Some(url), false) => JwksSource::Jwks(url.clone()),
            (None, true) => JwksSource::Discovery(self.issuer.clone().ok_or_else(|| {
                anyhow::anyhow!("auth.discovery needs auth.issuer (the provider to ask)")
            })?),
        };
        let url = match &source {
            JwksSource::Jwks(url) | JwksSource::Discovery(url) => url,
        };
        if !(url.starts_with("https://") || url.starts_with("http://")) {
            bail!("auth.jwks_url / auth.issuer must be an http(s) URL, not {url:?}");
        }
        let (Some(issuer), Some(audience)) = (self.issuer.clone(), self.audience.clone()) else {
            bail!(
                "tokens from an identity provider need auth.issuer and auth.audience (a token's \
                 exact iss, and the aud it must name)"
            );
        };
        if self.jwks_cooldown_secs < Duration::from_secs(1) {
            bail!("auth.jwks_cooldown_secs must be at least 1 s");
        }
        if self.jwks_ttl_secs < self.jwks_cooldown_secs {
            bail!("auth.jwks_ttl_secs must be at least auth.jwks_cooldown_secs");
        }
        Ok(Some(JwksConfig {
            source,
            issuer,
            audience,
            ttl: self.jwks_ttl_secs,
            cooldown: self.jwks_cooldown_secs,
        }))
    }
}

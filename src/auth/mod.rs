//! JWT tokens: claims `sub` (user id), `role` (`user` | `admin`) and
//! `exp`. By default HS256, minted and verified with `auth.jwt_secret`
//! (development, tests, a shop that issues its own). With `auth.jwks_url`
//! or `auth.discovery`, RS256 / ES256 tokens from an identity provider,
//! verified with the keys it publishes ([`jwks`]). A token with an `nbf` in
//! the future is refused; with `auth.issuer` / `auth.audience` set, a
//! token's `iss` / `aud` must match them. The HTTP extractors that read
//! them are in `http/auth.rs`.

mod hs256;
pub mod jwks;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::domain::UserId;

/// A key for one `purpose` (a fixed label, e.g. `seckill/queue-pass/v1`)
/// derived from `auth.server_secret`, the key root of everything the
/// server signs and checks itself: HMAC-SHA-256(secret, purpose).
pub fn derive_key(server_secret: &SecretString, purpose: &str) -> Vec<u8> {
    use hmac::{KeyInit, Mac};
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(server_secret.expose_secret().as_bytes())
            .expect("HMAC takes any key length");
    mac.update(purpose.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// Who the token says the caller is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A shopper.
    User,
    /// An operator: may create activities, warm them up, read stats.
    Admin,
}

/// The claims we issue and accept.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    /// The user id, as a decimal string.
    pub sub: String,
    /// The caller's role.
    pub role: Role,
    /// Expiry, unix seconds.
    pub exp: i64,
    /// Not valid before, unix seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<i64>,
    /// Issuer (checked when `auth.issuer` is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    /// Audience (checked when `auth.audience` is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<String>,
}

/// Signing and verification keys derived from `auth.jwt_secret`, or an
/// identity provider's published keys.
pub struct JwtKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
    /// Tokens in the shape minted here, checked without `jsonwebtoken`.
    fast: hs256::Hs256,
    issuer: Option<String>,
    audience: Option<String>,
    /// Set: user tokens come from an identity provider, and only its keys
    /// verify them (the HS256 secret verifies nothing).
    provider: Option<jwks::SharedJwks>,
}

impl JwtKeys {
    /// Keys for the shared HS256 secret, with no issuer or audience.
    pub fn new(secret: &SecretString) -> anyhow::Result<Self> {
        Self::with(secret, None, None)
    }

    /// Keys as `auth` configures them.
    pub fn from_settings(auth: &crate::config::AuthSettings) -> anyhow::Result<Self> {
        let mut keys = Self::with(&auth.jwt_secret, auth.issuer.clone(), auth.audience.clone())?;
        if let Some(config) = auth.provider()? {
            keys.provider = Some(std::sync::Arc::new(jwks::Jwks::new(config)?));
        }
        Ok(keys)
    }

    /// The identity provider's keys, when tokens come from one.
    pub fn provider(&self) -> Option<&jwks::SharedJwks> {
        self.provider.as_ref()
    }

    fn with(
        secret: &SecretString,
        issuer: Option<String>,
        audience: Option<String>,
    ) -> anyhow::Result<Self> {
        let bytes = secret.expose_secret().as_bytes();
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.validate_nbf = true;
        let mut required = vec!["exp", "sub"];
        if let Some(iss) = &issuer {
            validation.set_issuer(&[iss]);
            required.push("iss");
        }
        match &audience {
            Some(aud) => {
                validation.set_audience(&[aud]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        Ok(Self {
            encoding: EncodingKey::from_secret(bytes)?,
            decoding: DecodingKey::from_secret(bytes)?,
            validation,
            fast: hs256::Hs256::new(bytes)?,
            issuer,
            audience,
            provider: None,
        })
    }

    /// Mints a token (the `token` subcommand, tests, the load generator).
    pub fn mint(&self, user_id: i64, role: Role, ttl_secs: i64) -> anyhow::Result<String> {
        anyhow::ensure!(
            self.provider.is_none(),
            "user tokens come from the identity provider (auth.jwks_url or auth.discovery)"
        );
        let claims = Claims {
            sub: user_id.to_string(),
            role,
            exp: chrono::Utc::now().timestamp() + ttl_secs,
            nbf: None,
            iss: self.issuer.clone(),
            aud: self.audience.clone(),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies a token whichever way they are issued here: with the
    /// identity provider's keys (which may be fetched again for an unknown
    /// `kid`), or the HS256 secret.
    pub async fn verify_any(&self, token: &str) -> Result<(UserId, Role), String> {
        match &self.provider {
            Some(provider) => provider.verify(token).await,
            None => self.verify(token),
        }
    }

    /// Verifies signature, algorithm and expiry, then the subject's shape,
    /// with the HS256 secret; the error says why the token is refused. With
    /// an identity provider every token is refused here: use
    /// [`JwtKeys::verify_any`].
    pub fn verify(&self, token: &str) -> Result<(UserId, Role), String> {
        if self.provider.is_some() {
            return Err("tokens are verified with the identity provider's keys".into());
        }
        let now = jsonwebtoken::get_current_timestamp() as i64;
        let claims =
            match self
                .fast
                .claims(token, now, self.issuer.as_deref(), self.audience.as_deref())
            {
                Some(claims) => claims,
                None => {
                    jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
                        .map_err(|e| format!("invalid token: {e}"))?
                        .claims
                }
            };
        let user_id = UserId::parse(&claims.sub)
            .ok_or_else(|| "token subject is not a user id".to_owned())?;
        Ok((user_id, claims.role))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> SecretString {
        SecretString::from("s".repeat(40))
    }

    fn signed(claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret().expose_secret().as_bytes()).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_token_not_valid_yet_is_refused() {
        let keys = JwtKeys::new(&secret()).unwrap();
        let now = chrono::Utc::now().timestamp();
        let early = signed(serde_json::json!({
            "sub": "7", "role": "user", "exp": now + 600, "nbf": now + 300
        }));
        assert!(keys.verify(&early).is_err(), "nbf in the future");
        let valid = signed(serde_json::json!({
            "sub": "7", "role": "user", "exp": now + 600, "nbf": now - 1
        }));
        assert!(keys.verify(&valid).is_ok());
    }

    #[test]
    fn a_configured_issuer_and_audience_must_match() {
        let keys = JwtKeys::with(&secret(), Some("shop".into()), Some("seckill".into())).unwrap();
        let now = chrono::Utc::now().timestamp();
        let token = |iss: Option<&str>, aud: Option<&str>| {
            let mut c = serde_json::json!({"sub": "7", "role": "user", "exp": now + 600});
            if let Some(iss) = iss {
                c["iss"] = iss.into();
            }
            if let Some(aud) = aud {
                c["aud"] = aud.into();
            }
            signed(c)
        };
        assert!(keys.verify(&token(Some("shop"), Some("seckill"))).is_ok());
        assert!(
            keys.verify(&token(None, Some("seckill"))).is_err(),
            "no iss"
        );
        assert!(keys.verify(&token(Some("other"), Some("seckill"))).is_err());
        assert!(keys.verify(&token(Some("shop"), None)).is_err(), "no aud");
        assert!(keys.verify(&token(Some("shop"), Some("other"))).is_err());
        // What it mints it accepts.
        let minted = keys.mint(7, Role::User, 60).unwrap();
        assert!(keys.verify(&minted).is_ok());
        // Without them configured, neither is required.
        let plain = JwtKeys::new(&secret()).unwrap();
        assert!(plain.verify(&token(None, None)).is_ok());
    }
}

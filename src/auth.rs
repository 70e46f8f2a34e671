//! JWT (HS256) tokens: claims `sub` (user id), `role` (`user` | `admin`)
//! and `exp`, minted and verified with `auth.jwt_secret`. The HTTP
//! extractors that read them are in `http/auth.rs`.

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::domain::UserId;

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
}

/// Signing and verification keys derived from `auth.jwt_secret`.
pub struct JwtKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl JwtKeys {
    /// Keys for the shared HS256 secret.
    pub fn new(secret: &SecretString) -> anyhow::Result<Self> {
        let bytes = secret.expose_secret().as_bytes();
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "sub"]);
        Ok(Self {
            encoding: EncodingKey::from_secret(bytes)?,
            decoding: DecodingKey::from_secret(bytes)?,
            validation,
        })
    }

    /// Mints a token (the `token` subcommand, tests, the load generator).
    pub fn mint(&self, user_id: i64, role: Role, ttl_secs: i64) -> anyhow::Result<String> {
        let claims = Claims {
            sub: user_id.to_string(),
            role,
            exp: chrono::Utc::now().timestamp() + ttl_secs,
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies signature, algorithm and expiry, then the subject's shape;
    /// the error says why the token is refused.
    pub fn verify(&self, token: &str) -> Result<(UserId, Role), String> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|e| format!("invalid token: {e}"))?;
        let user_id = UserId::parse(&data.claims.sub)
            .ok_or_else(|| "token subject is not a user id".to_owned())?;
        Ok((user_id, data.claims.role))
    }
}

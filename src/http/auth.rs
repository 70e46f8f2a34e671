//! JWT authentication (HS256): `Authorization: Bearer <JWT>` with claims
//! `sub` (user id), `role` (`user` | `admin`) and `exp`. The extractors
//! [`AuthUser`] and [`AdminUser`] answer 401 / 403 in the API error shape.

use std::future::{Ready, ready};

use actix_web::http::header;
use actix_web::{FromRequest, HttpRequest, dev::Payload, web};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::domain::UserId;
use crate::http::error::{ApiError, ErrorCode};

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

    /// Verifies signature, algorithm and expiry, then the subject's shape.
    pub fn verify(&self, token: &str) -> Result<AuthUser, ApiError> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|e| unauthorized(format!("invalid token: {e}")))?;
        let user_id = UserId::parse(&data.claims.sub)
            .ok_or_else(|| unauthorized("token subject is not a user id"))?;
        Ok(AuthUser {
            user_id,
            role: data.claims.role,
        })
    }
}

fn unauthorized(message: impl Into<std::borrow::Cow<'static, str>>) -> ApiError {
    ApiError::new(ErrorCode::Unauthorized, message)
}

/// An authenticated caller of any role.
#[derive(Debug, Clone, Copy)]
pub struct AuthUser {
    /// The caller.
    pub user_id: UserId,
    /// The caller's role.
    pub role: Role,
}

/// An authenticated caller with `role = "admin"`.
#[derive(Debug, Clone, Copy)]
pub struct AdminUser(pub AuthUser);

fn authenticate(req: &HttpRequest) -> Result<AuthUser, ApiError> {
    let keys = req
        .app_data::<web::Data<JwtKeys>>()
        .ok_or_else(|| ApiError::unexpected(anyhow::anyhow!("JwtKeys missing from app data")))?;
    let value = req
        .headers()
        .get(header::AUTHORIZATION)
        .ok_or_else(|| unauthorized("missing Authorization header"))?;
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| unauthorized("expected `Authorization: Bearer <token>`"))?;
    keys.verify(token)
}

impl FromRequest for AuthUser {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(authenticate(req))
    }
}

impl FromRequest for AdminUser {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(authenticate(req).and_then(|user| match user.role {
            Role::Admin => Ok(AdminUser(user)),
            Role::User => Err(ApiError::new(ErrorCode::Forbidden, "admin role required")),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(secret: &str) -> JwtKeys {
        JwtKeys::new(&SecretString::from(secret.to_owned())).expect("keys")
    }

    #[test]
    fn a_minted_token_verifies_with_the_same_secret_only() {
        let token = keys("a").mint(7, Role::User, 60).expect("mint");
        let user = keys("a").verify(&token).expect("verifies");
        assert_eq!(user.user_id.get(), 7);
        assert_eq!(user.role, Role::User);
        assert_eq!(keys("b").verify(&token).unwrap_err().code(), "UNAUTHORIZED");
    }

    #[test]
    fn an_expired_token_is_refused() {
        let token = keys("a").mint(7, Role::Admin, -120).expect("mint");
        assert_eq!(keys("a").verify(&token).unwrap_err().code(), "UNAUTHORIZED");
    }
}

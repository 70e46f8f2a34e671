//! Authentication at the edge: `Authorization: Bearer <JWT>` (see
//! `crate::auth`). The extractors [`AuthUser`] and [`AdminUser`] answer
//! 401 / 403 in the API error shape.

use futures_util::future::{Either, LocalBoxFuture, Ready, ready};

use actix_web::http::header;
use actix_web::{FromRequest, HttpRequest, dev::Payload, web};

pub use crate::auth::{JwtKeys, Role};
use crate::domain::UserId;
use crate::http::error::{ApiError, ErrorCode};

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

/// The string claim `name` of the bearer token of `req`, read without a
/// second check of its signature: call it only in a handler that took an
/// [`AuthUser`], which has verified this very token.
pub fn verified_claim(req: &HttpRequest, name: &str) -> Option<String> {
    use base64::Engine;
    let token = req
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")?
        .trim();
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims.get(name)?.as_str().map(str::to_owned)
}

/// An authenticated caller with `role = "admin"`.
#[derive(Debug, Clone, Copy)]
pub struct AdminUser(pub AuthUser);

/// The caller of `req`: from memory with the HS256 secret or a key the
/// identity provider's JWKS already gave; an unknown `kid` may wait for
/// the JWKS to be fetched again. Only that case allocates a future: the
/// HS256 answer is ready at once (every purchase asks).
fn authenticate(req: &HttpRequest) -> Authenticating {
    let (keys, token) = match bearer(req) {
        Ok(found) => found,
        Err(e) => return Either::Left(ready(Err(e))),
    };
    if keys.provider().is_none() {
        return Either::Left(ready(verify(&keys, &token)));
    }
    Either::Right(Box::pin(async move {
        let (user_id, role) = keys.verify_any(&token).await.map_err(unauthorized)?;
        Ok(AuthUser { user_id, role })
    }))
}

/// [`authenticate`]'s answer: ready, or waiting on the identity provider.
type Authenticating =
    Either<Ready<Result<AuthUser, ApiError>>, LocalBoxFuture<'static, Result<AuthUser, ApiError>>>;

/// The keys and the bearer token of `req`.
fn bearer(req: &HttpRequest) -> Result<(web::Data<JwtKeys>, String), ApiError> {
    let keys = req
        .app_data::<web::Data<JwtKeys>>()
        .cloned()
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
    Ok((keys, token.to_owned()))
}

/// A bearer token's caller with the HS256 secret, or 401 UNAUTHORIZED
/// saying why not.
pub fn verify(keys: &JwtKeys, token: &str) -> Result<AuthUser, ApiError> {
    let (user_id, role) = keys.verify(token).map_err(unauthorized)?;
    Ok(AuthUser { user_id, role })
}

impl FromRequest for AuthUser {
    type Error = ApiError;
    type Future = Authenticating;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        authenticate(req)
    }
}

impl FromRequest for AdminUser {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let user = authenticate(req);
        Box::pin(async move {
            let user = user.await?;
            match user.role {
                Role::Admin => Ok(AdminUser(user)),
                Role::User => Err(ApiError::new(ErrorCode::Forbidden, "admin role required")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use secrecy::SecretString;

    use super::*;

    fn keys(secret: &str) -> JwtKeys {
        JwtKeys::new(&SecretString::from(secret.to_owned())).expect("keys")
    }

    #[test]
    fn a_minted_token_verifies_with_the_same_secret_only() {
        let token = keys("a").mint(7, Role::User, 60).expect("mint");
        let user = verify(&keys("a"), &token).expect("verifies");
        assert_eq!(user.user_id.get(), 7);
        assert_eq!(user.role, Role::User);
        assert_eq!(
            verify(&keys("b"), &token).unwrap_err().code(),
            "UNAUTHORIZED"
        );
    }

    #[test]
    fn an_expired_token_is_refused() {
        let token = keys("a").mint(7, Role::Admin, -120).expect("mint");
        assert_eq!(
            verify(&keys("a"), &token).unwrap_err().code(),
            "UNAUTHORIZED"
        );
    }
}

//! The HS256 fast path: a token in exactly the shape this server mints
//! (our header, byte for byte) is checked here with the HMAC keyed once,
//! and its claims parsed once. Every purchase carries a token, and
//! `jsonwebtoken::decode` keyed the HMAC again and parsed the claims twice
//! for each: a tenth of the server's CPU per refused purchase
//! (BENCHMARKS.md, row 5 against row 2).
//!
//! It only ever accepts: each check is as strict as the full verification's
//! or stricter (no leeway on `exp` and `nbf`), and a token it does not
//! accept goes through `jsonwebtoken` as before, which says why it is
//! refused or accepts it (a header of another shape, `exp` within the
//! leeway).

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};

use super::Claims;

/// The secret's HMAC, keyed once, and the header segment this server mints.
pub(super) struct Hs256 {
    mac: hmac::Hmac<sha2::Sha256>,
    header: String,
}

impl Hs256 {
    pub(super) fn new(secret: &[u8]) -> anyhow::Result<Self> {
        let header =
            serde_json::to_vec(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256))?;
        Ok(Self {
            mac: hmac::Hmac::new_from_slice(secret)?,
            header: URL_SAFE_NO_PAD.encode(header),
        })
    }

    /// The claims of `token` if it is in our shape, signed with the secret,
    /// valid now without leeway, and from `issuer` for `audience` when
    /// they are set; `None`: ask the full verification.
    pub(super) fn claims(
        &self,
        token: &str,
        now: i64,
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Option<Claims> {
        let (signed, signature) = token.rsplit_once('.')?;
        let (header, payload) = signed.split_once('.')?;
        if header != self.header || payload.contains('.') {
            return None;
        }
        let signature = URL_SAFE_NO_PAD.decode(signature).ok()?;
        let mut mac = self.mac.clone();
        mac.update(signed.as_bytes());
        mac.verify_slice(&signature).ok()?;
        let claims: Claims = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
        let fresh = claims.exp > now && claims.nbf.is_none_or(|nbf| nbf <= now);
        let issued = issuer.is_none_or(|iss| claims.iss.as_deref() == Some(iss));
        let meant = audience.is_none_or(|aud| claims.aud.as_deref() == Some(aud));
        (fresh && issued && meant).then_some(claims)
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    use secrecy::{ExposeSecret, SecretString};

    use super::*;
    use crate::auth::{JwtKeys, Role};

    fn secret() -> SecretString {
        SecretString::from("k".repeat(40))
    }

    fn now() -> i64 {
        jsonwebtoken::get_current_timestamp() as i64
    }

    fn signed(header: &Header, claims: serde_json::Value) -> String {
        let key = EncodingKey::from_secret(secret().expose_secret().as_bytes()).unwrap();
        jsonwebtoken::encode(header, &claims, &key).unwrap()
    }

    fn fast() -> Hs256 {
        Hs256::new(secret().expose_secret().as_bytes()).unwrap()
    }

    #[test]
    fn a_token_minted_here_is_read_without_jsonwebtoken() {
        let keys = JwtKeys::new(&secret()).unwrap();
        let token = keys.mint(42, Role::Admin, 600).unwrap();
        let claims = fast().claims(&token, now(), None, None).expect("our shape");
        assert_eq!((claims.sub.as_str(), claims.role), ("42", Role::Admin));
        assert_eq!(keys.verify(&token).unwrap().1, Role::Admin);
    }

    #[test]
    fn what_the_fast_path_does_not_accept_is_decided_by_the_full_verification() {
        let keys = JwtKeys::new(&secret()).unwrap();
        let fast = fast();
        let ours = Header::new(Algorithm::HS256);

        // A signature that does not match: refused by both.
        let mut forged = keys.mint(7, Role::User, 600).unwrap();
        let last = forged.pop().unwrap();
        forged.push(if last == 'A' { 'B' } else { 'A' });
        assert!(fast.claims(&forged, now(), None, None).is_none());
        assert!(keys.verify(&forged).is_err(), "a forged signature");

        // Expired a second ago: within the full check's leeway of 5 s.
        let late = signed(
            &ours,
            serde_json::json!({"sub": "7", "role": "user", "exp": now() - 1}),
        );
        assert!(
            fast.claims(&late, now(), None, None).is_none(),
            "no leeway here"
        );
        assert!(keys.verify(&late).is_ok(), "the leeway of the full check");

        // Not valid for another minute: refused by both.
        let early = signed(
            &ours,
            serde_json::json!({"sub": "7", "role": "user", "exp": now() + 600, "nbf": now() + 60}),
        );
        assert!(fast.claims(&early, now(), None, None).is_none());
        assert!(keys.verify(&early).is_err());

        // Another header (a `kid`), the same secret: the full check.
        let mut with_kid = Header::new(Algorithm::HS256);
        with_kid.kid = Some("k1".into());
        let other = signed(
            &with_kid,
            serde_json::json!({"sub": "9", "role": "user", "exp": now() + 600}),
        );
        assert!(fast.claims(&other, now(), None, None).is_none());
        assert_eq!(keys.verify(&other).unwrap().0.get(), 9);

        // Our header on an unsigned token ("alg": "none" cannot be ours).
        let (signed_part, _) = keys
            .mint(7, Role::User, 600)
            .unwrap()
            .rsplit_once('.')
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .unwrap();
        let unsigned = format!("{signed_part}.");
        assert!(fast.claims(&unsigned, now(), None, None).is_none());
        assert!(keys.verify(&unsigned).is_err());
    }

    #[test]
    fn an_issuer_and_audience_set_here_must_be_in_the_token() {
        let fast = fast();
        let (shop, seckill) = (Some("https://shop"), Some("seckill"));
        let ours = Header::new(Algorithm::HS256);
        let exp = now() + 600;
        let right = signed(
            &ours,
            serde_json::json!({"sub": "7", "role": "user", "exp": exp, "iss": "https://shop", "aud": "seckill"}),
        );
        assert!(fast.claims(&right, now(), shop, seckill).is_some());
        for claims in [
            serde_json::json!({"sub": "7", "role": "user", "exp": exp}),
            serde_json::json!({"sub": "7", "role": "user", "exp": exp, "iss": "https://other", "aud": "seckill"}),
            serde_json::json!({"sub": "7", "role": "user", "exp": exp, "iss": "https://shop", "aud": "other"}),
        ] {
            let token = signed(&ours, claims.clone());
            assert!(
                fast.claims(&token, now(), shop, seckill).is_none(),
                "{claims}"
            );
        }
    }
}

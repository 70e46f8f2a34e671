//! `X-Pay-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`
//! — the callback signature of docs/HTTP.md. Verification is constant-time and
//! refuses timestamps more than the tolerance away from now (replays of old
//! callbacks).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Why a signature was refused. All of them answer 401 BAD_SIGNATURE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// No header.
    #[error("missing X-Pay-Signature")]
    Missing,
    /// Not `t=…,v1=…`.
    #[error("malformed X-Pay-Signature")]
    Malformed,
    /// `|now - t|` is beyond the tolerance.
    #[error("signature timestamp outside the allowed window")]
    Stale,
    /// The HMAC does not match.
    #[error("signature does not match")]
    Mismatch,
}

fn mac(secret: &[u8], t: i64, body: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = HmacSha256::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The header value for `body` signed at `t`.
pub fn sign(secret: &[u8], t: i64, body: &[u8]) -> String {
    let tag = mac(secret, t, body).finalize().into_bytes();
    format!("t={t},v1={}", hex::encode(tag))
}

/// Checks `header` against `body` at time `now` (unix seconds).
pub fn verify(
    secret: &[u8],
    header: Option<&str>,
    body: &[u8],
    now: i64,
    tolerance_secs: i64,
) -> Result<(), SignatureError> {
    let header = header.ok_or(SignatureError::Missing)?;
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<i64>().ok(),
            Some(("v1", v)) => v1 = hex::decode(v).ok(),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else {
        return Err(SignatureError::Malformed);
    };
    // No subtraction: a hostile `t` (i64::MIN) must not overflow.
    if now.abs_diff(t) > tolerance_secs.unsigned_abs() {
        return Err(SignatureError::Stale);
    }
    mac(secret, t, body)
        .verify_slice(&v1)
        .map_err(|_| SignatureError::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_764_460_800;

    #[test]
    fn a_signed_body_verifies_and_any_change_breaks_it() {
        let header = sign(b"secret", NOW, b"{\"a\":1}");
        assert_eq!(
            verify(b"secret", Some(&header), b"{\"a\":1}", NOW, 300),
            Ok(())
        );
        assert_eq!(
            verify(b"secret", Some(&header), b"{\"a\":2}", NOW, 300),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(b"other", Some(&header), b"{\"a\":1}", NOW, 300),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn timestamps_outside_the_window_are_refused_both_ways() {
        let old = sign(b"s", NOW - 301, b"x");
        assert_eq!(
            verify(b"s", Some(&old), b"x", NOW, 300),
            Err(SignatureError::Stale)
        );
        let future = sign(b"s", NOW + 301, b"x");
        assert_eq!(
            verify(b"s", Some(&future), b"x", NOW, 300),
            Err(SignatureError::Stale)
        );
        let edge = sign(b"s", NOW - 300, b"x");
        assert_eq!(verify(b"s", Some(&edge), b"x", NOW, 300), Ok(()));
    }

    #[test]
    fn extreme_timestamps_are_stale_not_an_overflow() {
        for t in [i64::MIN, i64::MIN + 1, i64::MAX] {
            let header = format!("t={t},v1=00");
            assert_eq!(
                verify(b"s", Some(&header), b"x", NOW, 300),
                Err(SignatureError::Stale),
                "{t}"
            );
        }
    }

    #[test]
    fn missing_and_malformed_headers_are_refused() {
        assert_eq!(
            verify(b"s", None, b"x", NOW, 300),
            Err(SignatureError::Missing)
        );
        for bad in ["", "t=1", "v1=abcd", "t=x,v1=00", "t=1,v1=zz", "garbage"] {
            assert_eq!(
                verify(b"s", Some(bad), b"x", NOW, 300),
                Err(SignatureError::Malformed),
                "{bad}"
            );
        }
    }
}

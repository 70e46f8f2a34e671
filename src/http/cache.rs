//! HTTP caching of what is the same for every caller: the public activity
//! view and the console's files. They carry `Cache-Control` and an `ETag`,
//! and a conditional GET naming the current `ETag` is answered 304, so a
//! CDN in front can keep browsing traffic off the trading path. Every other
//! answer is `no-store` ([`DEFAULT`], which `http::observe` sets), so a CDN
//! never keeps a purchase, an order or a token.

use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder};
use sha2::{Digest, Sha256};

/// Every answer that sets no policy of its own: never stored anywhere.
pub const DEFAULT: &str = "no-store";

/// The live activity view: its remaining count moves with every purchase,
/// so a cache may serve it for 2 s at most.
pub const LIVE_VIEW: &str = "public, max-age=2";

/// A console page, or a script or style sheet asked for without its
/// version: kept, but asked again (304 when unchanged) before each use.
pub const REVALIDATED: &str = "public, no-cache";

/// A console script or style sheet asked for by its version (`?v=`, the
/// pages name it so): its content never changes under that name.
pub const IMMUTABLE: &str = "public, max-age=31536000, immutable";

/// A strong validator for `body`: the first 16 bytes of its SHA-256.
pub fn etag(body: &[u8]) -> String {
    format!("\"{}\"", hex::encode(&Sha256::digest(body)[..16]))
}

/// The answer to a GET of `body`: 304 Not Modified (no body) when the
/// request's `If-None-Match` names `etag`, else 200 with `body`. Either
/// way with `policy` and `etag`; `extra` goes on a 200 only.
pub fn respond(
    req: &HttpRequest,
    policy: &'static str,
    etag: &str,
    content_type: &'static str,
    body: impl actix_web::body::MessageBody + 'static,
    extra: impl FnOnce(&mut HttpResponseBuilder),
) -> HttpResponse {
    let holds = req
        .headers()
        .get_all(header::IF_NONE_MATCH)
        .any(|v| names(v, etag));
    let mut res = if holds {
        HttpResponse::NotModified()
    } else {
        HttpResponse::Ok()
    };
    res.insert_header((header::CACHE_CONTROL, policy))
        .insert_header((header::ETAG, etag));
    if holds {
        return res.finish();
    }
    extra(&mut res);
    res.content_type(content_type).body(body)
}

/// Whether an `If-None-Match` value names `etag`: `*`, or a list of tags
/// compared weakly (RFC 9110 §13.1.2: `W/"x"` names `"x"`).
fn names(value: &HeaderValue, etag: &str) -> bool {
    let Ok(value) = value.to_str() else {
        return false;
    };
    value
        .split(',')
        .map(str::trim)
        .any(|tag| tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == etag)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn an_etag_is_quoted_and_follows_the_content() {
        let a = etag(b"one");
        assert_eq!(a.len(), 34);
        assert!(a.starts_with('"') && a.ends_with('"'));
        assert_eq!(a, etag(b"one"));
        assert_ne!(a, etag(b"two"));
    }

    #[test]
    fn if_none_match_names_a_tag_in_a_list_weakly_or_by_star() {
        let tag = etag(b"x");
        assert!(names(&value(&tag), &tag));
        assert!(names(&value(&format!("W/{tag}")), &tag));
        assert!(names(&value(&format!("\"other\", {tag}")), &tag));
        assert!(names(&value("*"), &tag));
        assert!(!names(&value("\"other\""), &tag));
        assert!(!names(&value(""), &tag));
        // Unquoted, the tag is another one.
        assert!(!names(&value(tag.trim_matches('"')), &tag));
    }
}

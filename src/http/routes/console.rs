//! The web console (`/console/`): a buyer page and an operator page, plain
//! HTML and JavaScript compiled into the binary (no build step, nothing
//! fetched from elsewhere). The pages call the public API like any client.

use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};

use crate::http::cache;
use crate::http::error::ApiError;

/// `(name, media type, content)` of every console file, as written.
const SOURCES: &[(&str, &str, &str)] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("../console/index.html"),
    ),
    (
        "operator.html",
        "text/html; charset=utf-8",
        include_str!("../console/operator.html"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("../console/console.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("../console/console.css"),
    ),
];

/// The pages' script and style sheet, named by their version in the pages.
const ASSETS: &[&str] = &["console.js", "console.css"];

/// A console file as served.
struct File {
    name: &'static str,
    media_type: &'static str,
    content: String,
    etag: String,
    /// The `v` a page names it by (assets only).
    version: Option<String>,
}

/// The files as served, made once: each page names the script and style
/// sheet with their version (`console.js?v=…`), so a cache may keep those
/// for good, and a new binary's pages name new ones.
fn files() -> &'static [File] {
    static FILES: std::sync::OnceLock<Vec<File>> = std::sync::OnceLock::new();
    FILES.get_or_init(|| {
        let version = |content: &str| cache::etag(content.as_bytes()).trim_matches('"').to_owned();
        let versions: Vec<(&str, String)> = SOURCES
            .iter()
            .filter(|(name, _, _)| ASSETS.contains(name))
            .map(|(name, _, content)| (*name, version(content)))
            .collect();
        SOURCES
            .iter()
            .map(|&(name, media_type, source)| {
                let mut content = source.to_owned();
                for (asset, v) in &versions {
                    content =
                        content.replace(&format!("\"{asset}\""), &format!("\"{asset}?v={v}\""));
                }
                File {
                    name,
                    media_type,
                    etag: cache::etag(content.as_bytes()),
                    version: versions
                        .iter()
                        .find(|(a, _)| *a == name)
                        .map(|(_, v)| v.clone()),
                    content,
                }
            })
            .collect()
    })
}

/// `GET /console`: to the buyer page.
#[utoipa::path(get, path = "/console", tag = "console",
    responses((status = 308, description = "to /console/")))]
pub async fn root() -> HttpResponse {
    HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "/console/"))
        .finish()
}

/// `GET /console/{file}`: a console page or its script or style sheet
/// (`/console/` is the buyer page, `/console/operator.html` the operator's).
#[utoipa::path(get, path = "/console/{file}", tag = "console",
    params(("file" = String, Path, description = "index.html (also the empty name), operator.html, console.js or console.css")),
    responses(
        (status = 200, description = "the file, with an ETag; a script or style sheet asked for by its version (?v=) is immutable", content_type = "text/html"),
        (status = 304, description = "unchanged since the ETag given in If-None-Match"),
        (status = 404, description = "NOT_FOUND", body = crate::http::error::Problem, content_type = "application/problem+json"),
    ))]
pub async fn file(req: HttpRequest, path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let name = match path.as_str() {
        "" => "index.html",
        name => name,
    };
    let file = files()
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| ApiError::not_found("no such console file"))?;
    let asked = web::Query::<Version>::from_query(req.query_string())
        .ok()
        .and_then(|q| q.into_inner().v);
    let policy = match (&file.version, asked) {
        (Some(version), Some(asked)) if *version == asked => cache::IMMUTABLE,
        _ => cache::REVALIDATED,
    };
    Ok(cache::respond(
        &req,
        policy,
        &file.etag,
        file.media_type,
        file.content.clone(),
        |res| {
            // The pages run only their own script and talk only to this server.
            res.insert_header((
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            ));
        },
    ))
}

/// The version a page names a console file by.
#[derive(serde::Deserialize)]
struct Version {
    v: Option<String>,
}

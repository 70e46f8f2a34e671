//! The web console (`/console/`): a buyer page and an operator page, plain
//! HTML and JavaScript compiled into the binary (no build step, nothing
//! fetched from elsewhere). The pages call the public API like any client.

use actix_web::http::header;
use actix_web::web::Bytes;
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
    /// Shared with every answer, never copied.
    content: Bytes,
    etag: String,
    /// The `v` a page names it by (assets only): its ETag, unquoted.
    version: Option<String>,
}

impl File {
    fn new(name: &'static str, media_type: &'static str, content: String) -> Self {
        let etag = cache::etag(content.as_bytes());
        let version = ASSETS
            .contains(&name)
            .then(|| etag.trim_matches('"').to_owned());
        Self {
            name,
            media_type,
            content: Bytes::from(content),
            etag,
            version,
        }
    }
}

/// The files as served, made once: each page names the script and style
/// sheet with their version (`console.js?v=…`), so a cache may keep those
/// for good, and a new binary's pages name new ones.
fn files() -> &'static [File] {
    static FILES: std::sync::OnceLock<Vec<File>> = std::sync::OnceLock::new();
    FILES.get_or_init(|| {
        let (assets, pages): (Vec<_>, Vec<_>) = SOURCES
            .iter()
            .partition(|(name, _, _)| ASSETS.contains(name));
        let mut files: Vec<File> = assets
            .into_iter()
            .map(|&(name, media_type, source)| File::new(name, media_type, source.to_owned()))
            .collect();
        let named: Vec<(String, String)> = files
            .iter()
            .filter_map(|f| {
                let v = f.version.as_ref()?;
                Some((format!("\"{}\"", f.name), format!("\"{}?v={v}\"", f.name)))
            })
            .collect();
        for &(name, media_type, source) in pages {
            let content = named
                .iter()
                .fold(source.to_owned(), |page, (plain, versioned)| {
                    page.replace(plain, versioned)
                });
            files.push(File::new(name, media_type, content));
        }
        files
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
        file.content.clone(), // a reference count, not a copy
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

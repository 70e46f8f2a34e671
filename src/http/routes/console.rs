//! The web console (`/console/`): a buyer page and an operator page, plain
//! HTML and JavaScript compiled into the binary (no build step, nothing
//! fetched from elsewhere). The pages call the public API like any client.

use actix_web::http::header;
use actix_web::{HttpResponse, web};

use crate::http::error::ApiError;

/// `(name, media type, content)` of every console file.
const FILES: &[(&str, &str, &str)] = &[
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
        (status = 200, description = "the file", content_type = "text/html"),
        (status = 404, description = "NOT_FOUND", body = crate::http::error::Problem, content_type = "application/problem+json"),
    ))]
pub async fn file(path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let name = match path.as_str() {
        "" => "index.html",
        name => name,
    };
    let (_, media_type, content) = FILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .ok_or_else(|| ApiError::not_found("no such console file"))?;
    Ok(HttpResponse::Ok()
        .content_type(*media_type)
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        // The pages run only their own script and talk only to this server.
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
        ))
        .body(*content))
}

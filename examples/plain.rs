//! The HTTP ceiling for `scripts/bench.sh`: actix-web with one trivial
//! handler that answers the purchase route with a fixed 202 body, no auth,
//! no Redis, no Kafka. What the load generator reaches against this is the
//! most any handler on this machine could do under the same load.
//!
//!   cargo run --release --example plain -- 127.0.0.1:8082

// The same allocator as the server (src/main.rs), so that the rows
// compare handlers, not allocators.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use actix_web::{App, HttpResponse, HttpServer, web};

async fn accept(_body: web::Bytes) -> HttpResponse {
    HttpResponse::Accepted()
        .content_type("application/json")
        .body(r#"{"order_no":"1","request_id":"r","status":"PROCESSING"}"#)
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let address = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8082".into());
    HttpServer::new(|| App::new().default_service(web::to(accept)))
        .bind(address)?
        .run()
        .await
}

//! The naive baseline the seeds warn against: "synchronous order,
//! synchronous stock deduction" straight on the database. Same binary
//! stack, auth, routes and schema as `seckill serve` — only the purchase
//! route differs: per request, ONE transaction does
//! `UPDATE stock ... WHERE available >= n`, checks the per-user limit and
//! inserts the order. It is correct (the conditional update cannot
//! oversell) but every purchase of an activity serializes on one row lock.
//!
//! Kept out of the production binary; `scripts/bench.sh` runs it:
//!   SECKILL__APP__PORT=8081 cargo run --release --example naive

// The same allocator as the server (src/main.rs), so that the rows
// compare handlers, not allocators.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use actix_web::{App, HttpResponse, HttpServer, web};
use anyhow::Context;
use chrono::Utc;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use serde::Deserialize;
use serde_json::json;

use seckill::config::Settings;
use seckill::http::{self, auth::AuthUser, auth::JwtKeys, error::ApiError, error::ErrorCode};
use seckill::state::AppState;
use seckill::store::{self, PgConn};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceOrder {
    request_id: String,
    #[allow(dead_code)]
    token: Option<String>,
    quantity: Option<i32>,
    #[allow(dead_code)]
    coupon_id: Option<i64>,
}

enum Outcome {
    Accepted(i64),
    Duplicate(i64),
    SoldOut,
    LimitExceeded,
    NotActive,
}

#[derive(QueryableByName)]
struct Terms {
    #[diesel(sql_type = BigInt)]
    price_cents: i64,
    #[diesel(sql_type = Integer)]
    per_user_limit: i32,
    #[diesel(sql_type = Integer)]
    pay_timeout_secs: i32,
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn purchase(
    conn: &mut PgConn,
    activity_id: i64,
    user_id: i64,
    request_id: &str,
    quantity: i32,
    order_no: i64,
) -> QueryResult<Outcome> {
    conn.transaction(|conn| {
        let existing: Option<N> = diesel::sql_query(
            "SELECT order_no AS n FROM orders WHERE activity_id = $1 AND user_id = $2 AND request_id = $3",
        )
        .bind::<BigInt, _>(activity_id)
        .bind::<BigInt, _>(user_id)
        .bind::<Text, _>(request_id)
        .get_result(conn)
        .optional()?;
        if let Some(o) = existing {
            return Ok(Outcome::Duplicate(o.n));
        }
        let terms: Option<Terms> = diesel::sql_query(
            "SELECT price_cents, per_user_limit, pay_timeout_secs FROM activities \
             WHERE id = $1 AND now() BETWEEN start_at AND end_at",
        )
        .bind::<BigInt, _>(activity_id)
        .get_result(conn)
        .optional()?;
        let Some(terms) = terms else {
            return Ok(Outcome::NotActive);
        };
        // The row lock every purchase of the activity queues on.
        let moved = diesel::sql_query(
            "UPDATE stock SET available = available - $2, locked = locked + $2, updated_at = now() \
             WHERE activity_id = $1 AND available >= $2",
        )
        .bind::<BigInt, _>(activity_id)
        .bind::<Integer, _>(quantity)
        .execute(conn)?;
        if moved == 0 {
            return Ok(Outcome::SoldOut);
        }
        // Safe under concurrency: the stock row lock serializes this activity.
        let held: N = diesel::sql_query(
            "SELECT COALESCE(sum(quantity), 0)::bigint AS n FROM orders \
             WHERE activity_id = $1 AND user_id = $2 AND status IN ('WAITING_PAY', 'PAID')",
        )
        .bind::<BigInt, _>(activity_id)
        .bind::<BigInt, _>(user_id)
        .get_result(conn)?;
        if held.n + i64::from(quantity) > i64::from(terms.per_user_limit) {
            // Undo the stock move; the caller reports LIMIT_EXCEEDED.
            return Err(diesel::result::Error::RollbackTransaction);
        }
        diesel::sql_query(
            "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, \
             status, pay_deadline, user_slot) VALUES ($1, $2, $3, $4, $5, $6, 'WAITING_PAY', \
             now() + make_interval(secs => $7), $8)",
        )
        .bind::<BigInt, _>(order_no)
        .bind::<Text, _>(request_id)
        .bind::<BigInt, _>(activity_id)
        .bind::<BigInt, _>(user_id)
        .bind::<Integer, _>(quantity)
        .bind::<BigInt, _>(terms.price_cents * i64::from(quantity))
        .bind::<diesel::sql_types::Double, _>(f64::from(terms.pay_timeout_secs))
        .bind::<diesel::sql_types::SmallInt, _>(i16::from(seckill::ids::user_slot(user_id)))
        .execute(conn)?;
        diesel::sql_query(
            "INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) VALUES ($1, 'LOCK', $2, $3)",
        )
        .bind::<BigInt, _>(activity_id)
        .bind::<BigInt, _>(order_no)
        .bind::<Integer, _>(quantity)
        .execute(conn)?;
        Ok(Outcome::Accepted(order_no))
    })
}

async fn place(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<i64>,
    body: web::Json<PlaceOrder>,
) -> Result<HttpResponse, ApiError> {
    let activity_id = path.into_inner();
    let body = body.into_inner();
    let quantity = body.quantity.unwrap_or(1);
    if body.request_id.is_empty() || body.request_id.len() > 64 || quantity < 1 {
        return Err(ApiError::bad_request("bad request_id or quantity"));
    }
    let user_id = user.user_id.get();
    // The buyer's slot in the number: the partition of the order table.
    let Some(order_no) = state
        .sale
        .ids
        .next_id_with_gene(seckill::ids::user_gene(user_id))
    else {
        return Err(ApiError::new(
            ErrorCode::RetryLater,
            "no instance id leased",
        ));
    };
    let request_id = body.request_id.clone();
    let outcome = store::run(&state.pg.db, move |conn| {
        // A limit breach rolls back after the stock moved; report it as such.
        match purchase(conn, activity_id, user_id, &request_id, quantity, order_no) {
            Err(diesel::result::Error::RollbackTransaction) => Ok(Outcome::LimitExceeded),
            other => Ok(other?),
        }
    })
    .await
    .map_err(ApiError::unavailable)?;
    let answer = |status: actix_web::http::StatusCode, no: i64, s: &str| {
        HttpResponse::build(status)
            .json(json!({"order_no": no.to_string(), "request_id": body.request_id, "status": s}))
    };
    match outcome {
        Outcome::Accepted(no) => Ok(answer(
            actix_web::http::StatusCode::ACCEPTED,
            no,
            "WAITING_PAY",
        )),
        Outcome::Duplicate(no) => Ok(answer(actix_web::http::StatusCode::OK, no, "WAITING_PAY")),
        Outcome::SoldOut => Err(ApiError::new(ErrorCode::SoldOut, "sold out")),
        Outcome::LimitExceeded => Err(ApiError::new(ErrorCode::LimitExceeded, "limit reached")),
        Outcome::NotActive => Err(ApiError::new(ErrorCode::NotActive, "the sale is not open")),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = Settings::load()?;
    seckill::telemetry::init(&settings.log);
    let address = format!("{}:{}", settings.app.host, settings.app.port);
    let keys = web::Data::new(JwtKeys::new(&settings.auth.jwt_secret)?);
    let state = AppState::connect(settings)?;
    state.sale.lease.acquire_at_start().await?;
    let _lease = state.sale.lease.clone().spawn();
    let state = web::Data::new(state);
    tracing::info!(%address, started = %Utc::now(), "naive baseline serving");
    HttpServer::new(move || {
        let metrics = std::sync::Arc::new(state.metrics.clone());
        App::new()
            .app_data(state.clone())
            .app_data(keys.clone())
            .configure(http::extractor_configs)
            // Registered before the real routes, so it wins for this path.
            .service(web::resource("/api/v1/activities/{id}/orders").post(place))
            .configure(http::routes::configure)
            .default_service(web::to(http::routes::not_found))
            .wrap(http::error_handlers())
            .wrap_fn(move |req, srv| http::observe(req, srv, metrics.clone()))
    })
    .bind(&address)
    .with_context(|| format!("binding {address}"))?
    .run()
    .await?;
    Ok(())
}

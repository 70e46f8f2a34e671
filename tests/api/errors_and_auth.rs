use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;

use crate::helpers::{json, spawn_app};

async fn assert_error(res: reqwest::Response, status: u16, code: &str) {
    assert_eq!(res.status(), status);
    assert_eq!(
        res.headers()["content-type"].to_str().unwrap(),
        "application/problem+json",
        "error responses are RFC 9457 problems"
    );
    let body = json(res).await;
    assert_eq!(body["code"], code, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    // The RFC 9457 members: a type per code, its title, the status
    // repeated, and the detail (the message).
    assert_eq!(
        body["type"],
        format!("urn:seckill:problem:{code}"),
        "{body}"
    );
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert_eq!(body["status"], status, "{body}");
    assert_eq!(body["detail"], body["message"], "{body}");
}

#[tokio::test]
async fn unknown_routes_are_404_in_the_error_shape() {
    let app = spawn_app().await;
    assert_error(app.get("/no/such/route", None).await, 404, "NOT_FOUND").await;
    assert_error(app.get("/api/v1/nothing", None).await, 404, "NOT_FOUND").await;
}

#[tokio::test]
async fn a_wrong_method_is_405_in_the_error_shape() {
    let app = spawn_app().await;
    let res = app.post_json("/health/live", &json!({}), None).await;
    assert_error(res, 405, "METHOD_NOT_ALLOWED").await;
}

#[tokio::test]
async fn openapi_document_is_served() {
    let app = spawn_app().await;
    let body = json(app.get("/api/v1/openapi.json", None).await).await;
    // Generated from the code (http::openapi, whose unit tests hold it to
    // the router); here, that the server serves it.
    assert_eq!(body["openapi"], "3.1.0");
    assert!(body["paths"]["/health/ready"].is_object());
    assert!(body["paths"]["/api/v1/activities/{id}/orders"]["post"].is_object());
    assert!(body["components"]["schemas"]["Problem"].is_object());
}

#[tokio::test]
async fn a_missing_or_malformed_authorization_header_is_401() {
    let app = spawn_app().await;
    assert_error(app.get("/api/v1/me", None).await, 401, "UNAUTHORIZED").await;
    let res = app
        .client
        .get(format!("{}/api/v1/me", app.address))
        .header("Authorization", "Basic dXNlcjpwYXNz")
        .send()
        .await
        .unwrap();
    assert_error(res, 401, "UNAUTHORIZED").await;
    assert_error(
        app.get("/api/v1/me", Some("not.a.jwt")).await,
        401,
        "UNAUTHORIZED",
    )
    .await;
}

fn sign(secret: &str, claims: serde_json::Value) -> String {
    let key = EncodingKey::from_secret(secret.as_bytes()).unwrap();
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap()
}

#[tokio::test]
async fn a_forged_token_is_401() {
    let app = spawn_app().await;
    let exp = chrono::Utc::now().timestamp() + 600;
    let forged = sign(
        "somebody-elses-secret",
        json!({"sub": "5", "role": "admin", "exp": exp}),
    );
    assert_error(
        app.get("/api/v1/me", Some(&forged)).await,
        401,
        "UNAUTHORIZED",
    )
    .await;
    assert_error(
        app.get("/api/v1/admin/me", Some(&forged)).await,
        401,
        "UNAUTHORIZED",
    )
    .await;
}

#[tokio::test]
async fn an_expired_token_is_401() {
    let app = spawn_app().await;
    use secrecy::ExposeSecret;
    let secret = app.settings.auth.jwt_secret.expose_secret().to_owned();
    let exp = chrono::Utc::now().timestamp() - 3600;
    let expired = sign(&secret, json!({"sub": "5", "role": "user", "exp": exp}));
    assert_error(
        app.get("/api/v1/me", Some(&expired)).await,
        401,
        "UNAUTHORIZED",
    )
    .await;
    // The same claims, not expired, are accepted: the expiry is what failed.
    let fresh = sign(
        &secret,
        json!({"sub": "5", "role": "user", "exp": exp + 7200}),
    );
    assert_eq!(app.get("/api/v1/me", Some(&fresh)).await.status(), 200);
}

#[tokio::test]
async fn a_token_with_a_non_numeric_subject_is_401() {
    let app = spawn_app().await;
    use secrecy::ExposeSecret;
    let secret = app.settings.auth.jwt_secret.expose_secret().to_owned();
    let exp = chrono::Utc::now().timestamp() + 600;
    let token = sign(&secret, json!({"sub": "alice", "role": "user", "exp": exp}));
    assert_error(
        app.get("/api/v1/me", Some(&token)).await,
        401,
        "UNAUTHORIZED",
    )
    .await;
}

#[tokio::test]
async fn a_user_token_on_an_admin_route_is_403_and_an_admin_token_passes() {
    let app = spawn_app().await;
    let user = app.user_token(9);
    assert_error(
        app.get("/api/v1/admin/me", Some(&user)).await,
        403,
        "FORBIDDEN",
    )
    .await;
    let res = app.get("/api/v1/admin/me", Some(&app.admin_token())).await;
    assert_eq!(res.status(), 200);
    assert_eq!(json(res).await["role"], "admin");
    let me = json(app.get("/api/v1/me", Some(&user)).await).await;
    assert_eq!(me["user_id"], 9);
}

#[tokio::test]
async fn a_path_id_that_is_not_a_number_is_400_in_our_words() {
    let app = spawn_app().await;
    let admin = app.admin_token();
    for (path, token) in [
        ("/api/v1/activities/null,null", None),
        ("/api/v1/activities/abc/token", Some(app.user_token(1))),
        ("/api/v1/admin/activities/1e3/stats", Some(admin.clone())),
        ("/api/v1/admin/coupons/-/stats", Some(admin)),
    ] {
        let res = app.get(path, token.as_deref()).await;
        assert_eq!(res.status(), 400, "{path}");
        let body = json(res).await;
        assert_eq!(body["code"], "BAD_REQUEST", "{path}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("decimal integer"),
            "{path}: {body}"
        );
    }
}

/// What a handler answers for a database error: the status and the code.
fn answered(error: diesel::result::Error) -> (u16, &'static str) {
    use actix_web::ResponseError;
    let e = seckill::http::error::ApiError::unexpected(anyhow::Error::new(error));
    (e.status_code().as_u16(), e.code())
}

/// PostgreSQL's "not now" (a deadlock, a statement timeout, the session
/// ended by the administrator), each made for real on the test's
/// database: 503 RETRY_LATER, never a 500.
#[tokio::test]
async fn a_deadlock_a_statement_timeout_and_an_ended_session_answer_503_retry_later() {
    use diesel::{Connection, PgConnection, RunQueryDsl};
    use secrecy::ExposeSecret;
    use std::sync::{Arc, Barrier};

    let app = spawn_app().await;
    app.execute("CREATE TABLE lock_pair (id int PRIMARY KEY)")
        .await;
    app.execute("INSERT INTO lock_pair VALUES (1), (2)").await;
    let url = app.settings.postgres.url.expose_secret().to_owned();
    let errors = tokio::task::spawn_blocking(move || {
        // Two transactions lock the two rows in opposite orders.
        let both_hold_one = Arc::new(Barrier::new(2));
        let sides: Vec<_> = [(1, 2), (2, 1)]
            .into_iter()
            .map(|(first, second)| {
                let (url, barrier) = (url.clone(), both_hold_one.clone());
                std::thread::spawn(move || {
                    let mut conn = PgConnection::establish(&url).expect("connect");
                    conn.transaction::<(), diesel::result::Error, _>(|c| {
                        diesel::sql_query(format!(
                            "SELECT id FROM lock_pair WHERE id = {first} FOR UPDATE"
                        ))
                        .execute(c)?;
                        barrier.wait();
                        diesel::sql_query(format!(
                            "SELECT id FROM lock_pair WHERE id = {second} FOR UPDATE"
                        ))
                        .execute(c)?;
                        Ok(())
                    })
                    .err()
                })
            })
            .collect();
        let mut errors: Vec<diesel::result::Error> = sides
            .into_iter()
            .filter_map(|s| s.join().unwrap())
            .collect();

        let mut conn = PgConnection::establish(&url).expect("connect");
        diesel::sql_query("SET statement_timeout = 50")
            .execute(&mut conn)
            .unwrap();
        errors.push(
            diesel::sql_query("SELECT pg_sleep(2)")
                .execute(&mut conn)
                .expect_err("the statement times out"),
        );

        #[derive(diesel::QueryableByName)]
        struct Pid {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            pid: i32,
        }
        let mut ended = PgConnection::establish(&url).expect("connect");
        let pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
            .get_result::<Pid>(&mut ended)
            .unwrap()
            .pid;
        diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
            .execute(&mut conn)
            .ok();
        diesel::sql_query("SET statement_timeout = 0")
            .execute(&mut conn)
            .unwrap();
        errors.push(
            diesel::sql_query("SELECT 1")
                .execute(&mut ended)
                .expect_err("the session was ended"),
        );
        errors
    })
    .await
    .unwrap();
    assert_eq!(
        errors.len(),
        3,
        "one deadlock victim, one timeout, one ended session: {errors:?}"
    );
    assert!(errors[0].to_string().contains("deadlock"), "{}", errors[0]);
    for e in errors {
        let what = e.to_string();
        assert_eq!(answered(e), (503, "RETRY_LATER"), "{what}");
    }
    // A fault of ours stays a 500.
    assert_eq!(answered(diesel::result::Error::NotFound), (500, "INTERNAL"));
}

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

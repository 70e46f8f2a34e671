//! What the web console stands on: the activity list, ending a sale, the
//! development token, the last reconciliation report and the console's own
//! files. (The pages themselves are driven in a real browser by
//! `scripts/browser-test.sh`.)

use serde_json::json;

use crate::helpers::{Window, json, spawn_app, spawn_app_with};

#[tokio::test]
async fn the_list_shows_open_and_coming_activities_with_the_server_clock() {
    let app = spawn_app().await;
    let open = app.live_activity(5, 1, 1).await;
    let coming = app
        .create_activity(
            3,
            1,
            1,
            Window {
                start: 600,
                end: 1200,
            },
        )
        .await;
    let ended = app.live_activity(2, 1, 1).await;
    let res = app
        .post_json(
            &format!("/api/v1/admin/activities/{ended}/end"),
            &json!({}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 200);
    app.buy(1, open).await;

    let body = json(app.get("/api/v1/activities", None).await).await;
    let server_time = chrono::DateTime::parse_from_rfc3339(body["server_time"].as_str().unwrap())
        .expect("server_time is RFC 3339");
    let skew = (server_time.with_timezone(&chrono::Utc) - chrono::Utc::now()).num_seconds();
    assert!(skew.abs() < 60, "server_time {server_time}");
    let listed = body["activities"].as_array().unwrap();
    let find = |id: i64| {
        listed
            .iter()
            .find(|a| a["activity_id"] == id)
            .unwrap_or_else(|| panic!("activity {id} not listed: {body}"))
    };
    assert_eq!(find(open)["status"], "ACTIVE");
    assert_eq!(find(open)["remaining"], 4, "one unit bought");
    assert_eq!(find(coming)["status"], "PENDING");
    assert_eq!(find(coming)["remaining"], 0, "not warmed");
    assert_eq!(find(ended)["status"], "ENDED");
    // Soonest first.
    let starts: Vec<&str> = listed
        .iter()
        .map(|a| a["start_at"].as_str().unwrap())
        .collect();
    let mut sorted = starts.clone();
    sorted.sort();
    assert_eq!(starts, sorted);
}

#[tokio::test]
async fn ending_a_sale_refuses_the_next_purchase_and_keeps_what_was_sold() {
    let app = spawn_app().await;
    let id = app.live_activity(10, 1, 2).await;
    let (status, first) = app.buy(1, id).await;
    assert_eq!(status, 202, "{first}");
    // A token taken before the end, used after it.
    let token = app.purchase_token(2, id).await;

    let end_path = format!("/api/v1/admin/activities/{id}/end");
    let admin = app.admin_token();
    let res = app.post_json(&end_path, &json!({}), Some(&admin)).await;
    assert_eq!(res.status(), 200);
    let body = json(res).await;
    assert_eq!(body["status"], "ENDED", "{body}");

    let res = app
        .post_json(
            &format!("/api/v1/activities/{id}/orders"),
            &json!({"request_id": "after-the-end", "token": token}),
            Some(&app.user_token(2)),
        )
        .await;
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "NOT_ACTIVE");

    // Again: nothing changes.
    let again = json(app.post_json(&end_path, &json!({}), Some(&admin)).await).await;
    assert_eq!(again["end_at"], body["end_at"], "{again}");
    // Not an admin; no such activity.
    let res = app
        .post_json(
            &format!("/api/v1/admin/activities/{id}/end"),
            &json!({}),
            Some(&app.user_token(1)),
        )
        .await;
    assert_eq!(res.status(), 403);
    let res = app
        .post_json(
            "/api/v1/admin/activities/987654/end",
            &json!({}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 404);

    // The order taken before the end is made and holds its unit.
    let stats = app.drained(id, 1).await;
    assert_eq!(stats["db_locked"], 1, "{stats}");
    assert_eq!(stats["db_available"], 9, "{stats}");
    assert_eq!(stats["redis_available"], 9, "{stats}");
}

#[tokio::test]
async fn ending_a_sale_before_it_starts_means_it_never_opens() {
    let app = spawn_app().await;
    let id = app
        .warmed_activity(
            5,
            1,
            1,
            Window {
                start: 2,
                end: 3600,
            },
        )
        .await;
    let res = app
        .post_json(
            &format!("/api/v1/admin/activities/{id}/end"),
            &json!({}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 200);
    // Past the old start: still closed.
    app.clock.advance(std::time::Duration::from_secs(5));
    let res = app
        .get(
            &format!("/api/v1/activities/{id}/token"),
            Some(&app.user_token(1)),
        )
        .await;
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "NOT_ACTIVE");
}

#[tokio::test]
async fn the_development_token_exists_only_on_a_development_server() {
    let app = spawn_app().await;
    let res = app
        .post_json("/api/v1/dev/token", &json!({"user_id": 5}), None)
        .await;
    assert_eq!(res.status(), 404, "test env: no such route");

    let dev = spawn_app_with(|s| s.app.env = "development".into()).await;
    let res = dev
        .post_json(
            "/api/v1/dev/token",
            &json!({"user_id": 5, "admin": true}),
            None,
        )
        .await;
    assert_eq!(res.status(), 200);
    let body = json(res).await;
    let token = body["token"].as_str().unwrap();
    let me = json(dev.get("/api/v1/admin/me", Some(token)).await).await;
    assert_eq!(me["user_id"], 5, "{me}");
    assert_eq!(me["role"], "admin", "{me}");
    let res = dev
        .post_json("/api/v1/dev/token", &json!({"user_id": 0}), None)
        .await;
    assert_eq!(res.status(), 400);
    let res = dev
        .post_json(
            "/api/v1/dev/token",
            &json!({"user_id": 5, "role": "admin"}),
            None,
        )
        .await;
    assert_eq!(res.status(), 400, "unknown fields are refused");
}

#[tokio::test]
async fn the_last_reconciliation_report_is_kept_for_the_operator() {
    let app =
        spawn_app_with(|s| s.reconcile.interval_secs = std::time::Duration::from_secs(3600)).await;
    let admin = app.admin_token();
    let id = app.live_activity(3, 1, 1).await;
    let before = json(app.get("/api/v1/admin/reconcile/last", Some(&admin)).await).await;
    assert!(before["last"].is_null(), "{before}");
    let res = app
        .get("/api/v1/admin/reconcile/last", Some(&app.user_token(1)))
        .await;
    assert_eq!(res.status(), 403);

    crate::reconcile::reconcile(&app).await;
    let last = json(app.get("/api/v1/admin/reconcile/last", Some(&admin)).await).await;
    let report = last["last"]["activities"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["activity_id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("activity {id} not in {last}"));
    assert_eq!(report["consistent"], true, "{report}");
    assert!(last["last"]["at"].is_string(), "{last}");
    assert!(last["last"]["by"].is_string(), "{last}");
    // The run's stock figures are exported too.
    let redis = app
        .metric(&format!(
            "seckill_stock_units{{activity_id=\"{id}\",source=\"redis\",state=\"available\"}}"
        ))
        .await;
    assert_eq!(redis, Some(3));
}

#[tokio::test]
async fn the_console_is_served_from_the_binary() {
    let app = spawn_app().await;
    for (path, kind) in [
        ("/console/", "text/html"),
        ("/console/index.html", "text/html"),
        ("/console/operator.html", "text/html"),
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
    ] {
        let res = app.get(path, None).await;
        assert_eq!(res.status(), 200, "{path}");
        let content_type = res.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        assert!(!res.text().await.unwrap().is_empty(), "{path}");
    }
    let res = app
        .client
        .get(format!("{}/console", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.url().path(),
        "/console/",
        "redirected to the buyer page"
    );
    let res = app.get("/console/nothing.html", None).await;
    assert_eq!(res.status(), 404);
    assert_eq!(json(res).await["code"], "NOT_FOUND");
}

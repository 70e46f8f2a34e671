//! What a CDN may keep: the public activity view for 2 s, the console's
//! pages revalidated and its versioned script and style sheet for good,
//! each with an `ETag` a conditional GET is answered 304 by. Nothing that
//! names a buyer, an order or a token may be stored anywhere.

use serde_json::json;

use crate::helpers::{TestApp, json, spawn_app};

/// A GET of `path` naming `etag` in `If-None-Match`.
async fn get_if_none_match(app: &TestApp, path: &str, etag: &str) -> reqwest::Response {
    app.client
        .get(format!("{}{path}", app.address))
        .header("If-None-Match", etag)
        .send()
        .await
        .expect("an answer")
}

fn header(res: &reqwest::Response, name: &str) -> String {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("no {name} on {} {}", res.url(), res.status()))
}

#[tokio::test]
async fn the_activity_view_may_be_kept_two_seconds_and_is_answered_304_while_unchanged() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let path = format!("/api/v1/activities/{activity}");

    let res = app.get(&path, None).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "cache-control"), "public, max-age=2");
    let etag = header(&res, "etag");
    assert_eq!(json(res).await["remaining"], 10);

    let res = get_if_none_match(&app, &path, &etag).await;
    assert_eq!(res.status(), 304);
    assert_eq!(header(&res, "etag"), etag);
    assert_eq!(header(&res, "cache-control"), "public, max-age=2");
    assert!(res.bytes().await.unwrap().is_empty(), "a 304 has no body");
    // Weakly compared, and among others.
    let res = get_if_none_match(&app, &path, &format!("\"x\", W/{etag}")).await;
    assert_eq!(res.status(), 304);

    // A purchase moves the remaining count: the old tag no longer holds.
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    let res = get_if_none_match(&app, &path, &etag).await;
    assert_eq!(res.status(), 200);
    assert_ne!(header(&res, "etag"), etag);
    assert_eq!(json(res).await["remaining"], 9);

    // No such activity: an error, never kept.
    let res = app.get("/api/v1/activities/999999", None).await;
    assert_eq!(res.status(), 404);
    assert_eq!(header(&res, "cache-control"), "no-store");
}

#[tokio::test]
async fn console_pages_are_revalidated_and_their_versioned_assets_kept_for_good() {
    let app = spawn_app().await;
    let res = app.get("/console/", None).await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "cache-control"), "public, no-cache");
    let page_tag = header(&res, "etag");
    let page = res.text().await.unwrap();
    let res = get_if_none_match(&app, "/console/", &page_tag).await;
    assert_eq!(res.status(), 304);

    for asset in ["console.js", "console.css"] {
        // The page names the asset by its version.
        let start = page
            .find(&format!("\"{asset}?v="))
            .unwrap_or_else(|| panic!("{asset} named by version in {page}"));
        let named = &page[start + 1..];
        let named = &named[..named.find('"').unwrap()];
        let path = format!("/console/{named}");
        let res = app.get(&path, None).await;
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(
            header(&res, "cache-control"),
            "public, max-age=31536000, immutable",
            "{path}"
        );
        let etag = header(&res, "etag");
        assert!(!res.bytes().await.unwrap().is_empty());
        let res = get_if_none_match(&app, &path, &etag).await;
        assert_eq!(res.status(), 304, "{path}");
        // Without its version, or with another one, it is revalidated:
        // that name may hold other content after an upgrade.
        for other in [
            format!("/console/{asset}"),
            format!("/console/{asset}?v=old"),
        ] {
            let res = app.get(&other, None).await;
            assert_eq!(res.status(), 200, "{other}");
            assert_eq!(header(&res, "cache-control"), "public, no-cache", "{other}");
            assert_eq!(header(&res, "etag"), etag, "{other}");
        }
    }
}

/// Every route that answers for one buyer, an order, a payment, a token
/// or an operator says `no-store`, whatever its status; so does every
/// error.
#[tokio::test]
async fn no_private_route_carries_a_cacheable_header() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let user = app.user_token(1);
    let admin = app.admin_token();
    let stranger = app.user_token(2);
    let token = app.purchase_token(1, activity).await;
    // Sent again on a passing 503 (on a loaded host the modes' read can be
    // late), as a client does: the headers of the acceptance are under
    // test here, not admission. A retry is answered 202 or 200.
    let placed = app
        .order_past_503(1, activity, &json!({"request_id": "c1", "token": token}))
        .await;
    assert!(placed.status().is_success(), "{}", placed.status());
    assert_eq!(header(&placed, "cache-control"), "no-store", "purchase");
    let order_no = json(placed).await["order_no"]
        .as_str()
        .expect("order_no")
        .to_owned();
    let mut answers = Vec::new();
    let gets: Vec<(String, Option<&str>)> = vec![
        (format!("/api/v1/activities/{activity}/token"), Some(&user)),
        ("/api/v1/orders".into(), Some(&user)),
        (format!("/api/v1/orders/{order_no}"), Some(&user)),
        (format!("/api/v1/orders/{order_no}/events"), Some(&user)),
        ("/api/v1/me".into(), Some(&user)),
        ("/api/v1/coupons/mine".into(), Some(&user)),
        (
            format!("/api/v1/admin/activities/{activity}/stats"),
            Some(&admin),
        ),
        ("/api/v1/admin/me".into(), Some(&admin)),
        ("/api/v1/admin/reconcile/last".into(), Some(&admin)),
        ("/api/v1/orders".into(), None),
        (format!("/api/v1/orders/{order_no}"), Some(&stranger)),
        ("/api/v1/activities".into(), None),
        ("/health/ready".into(), None),
        ("/no/such/route".into(), None),
    ];
    for (path, token) in gets {
        let res = app.get(&path, token).await;
        answers.push((format!("GET {path} ({})", res.status()), res));
    }
    let res = app
        .post_json(
            &format!("/api/v1/orders/{order_no}/pay"),
            &json!({}),
            Some(&user),
        )
        .await;
    answers.push((format!("pay ({})", res.status()), res));
    for (what, res) in &answers {
        let policy = header(res, "cache-control");
        assert_eq!(policy, "no-store", "{what}");
        assert!(res.headers().get("etag").is_none(), "{what}");
    }
}

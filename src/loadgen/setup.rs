//! Setting a run up: the activity created and warmed, and each buyer's
//! purchase token fetched.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

use super::args::LoadgenArgs;
use super::client::Client;
use super::progress::Progress;
use crate::auth::Role;
use crate::domain::ActivityId;

/// A buyer ready to buy: their id, JWT and purchase token.
pub(super) type Ready = (i64, String, String);

/// One purchase token per user.
pub(super) async fn fetch_tokens(
    client: &Arc<Client>,
    activity_id: ActivityId,
    args: &LoadgenArgs,
) -> anyhow::Result<Vec<Ready>> {
    eprintln!(
        "activity {activity_id}: fetching {} purchase tokens…",
        args.users
    );
    let users: Vec<i64> = (args.first_user..args.first_user + args.users).collect();
    for_each_user("tokens", &users, args.concurrency, |user| {
        purchase_token(client, activity_id, user)
    })
    .await
}

/// `call` for every user, `concurrency` at once, with a progress line;
/// the first error ends it.
pub(super) async fn for_each_user<T, F, Fut>(
    label: &'static str,
    users: &[i64],
    concurrency: usize,
    call: F,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(i64) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let progress = Progress::start(label, users.len() as u64);
    let done = stream::iter(users.iter().copied())
        .map(|user| {
            let progress = progress.clone();
            let answer = call(user);
            async move {
                let answer = answer.await;
                progress.tick();
                answer
            }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<anyhow::Result<T>>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>();
    progress.finish();
    done
}

pub(super) async fn create_activity(
    client: &Client,
    admin: &str,
    args: &LoadgenArgs,
) -> anyhow::Result<ActivityId> {
    let now = chrono::Utc::now();
    let body = json!({
        "sku_id": 1, "name": "loadgen", "price_cents": 100, "stock": args.stock,
        "start_at": now - chrono::Duration::seconds(5),
        "end_at": now + chrono::Duration::hours(1),
        "per_user_limit": 1, "pay_timeout_secs": 3600, "buckets": args.buckets,
        "shards": args.shards,
    });
    create_and_warm(client, admin, &body).await
}

/// Creates the activity `body` describes, and warms it up.
pub(super) async fn create_and_warm(
    client: &Client,
    admin: &str,
    body: &Value,
) -> anyhow::Result<ActivityId> {
    let (status, created) = client
        .send(
            reqwest::Method::POST,
            "/api/v1/admin/activities",
            admin,
            Some(body),
        )
        .await?;
    if status != 201 {
        bail!("creating the activity: {status} {created}");
    }
    let id = created["activity_id"]
        .as_i64()
        .context("activity_id missing")?;
    let path = format!("/api/v1/admin/activities/{id}/warmup");
    let (status, warmed) = client
        .send(reqwest::Method::POST, &path, admin, Some(&json!({})))
        .await?;
    if status != 200 {
        bail!("warming up: {status} {warmed}");
    }
    Ok(ActivityId::new(id))
}

/// One user's purchase token. A token is harmless to ask for twice: a
/// connection lost on the way is retried, as a client would.
pub(super) async fn purchase_token(
    client: &Client,
    activity_id: ActivityId,
    user: i64,
) -> anyhow::Result<Ready> {
    let jwt = client.token(user, Role::User)?;
    let path = format!("/api/v1/activities/{activity_id}/token");
    let url = client.url_of(user);
    let mut attempt = 0;
    let (status, body) = loop {
        attempt += 1;
        match client
            .send_to(url, reqwest::Method::GET, &path, &jwt, None)
            .await
        {
            Err(_) if attempt < 5 => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            answer => break answer?,
        }
    };
    if status != 200 {
        bail!("token for user {user}: {status} {body}");
    }
    let token = body["token"].as_str().context("token missing")?.to_owned();
    Ok((user, jwt, token))
}

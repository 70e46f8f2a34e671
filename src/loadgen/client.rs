//! The load generator's HTTP client: one connection pool, the servers'
//! URLs, and the keys it mints JWTs with.

use serde_json::Value;

use crate::auth::{JwtKeys, Role};

pub(super) struct Client {
    pub(super) http: reqwest::Client,
    pub(super) urls: Vec<String>,
    pub(super) keys: JwtKeys,
}

impl Client {
    pub(super) fn token(&self, user: i64, role: Role) -> anyhow::Result<String> {
        self.keys.mint(user, role, 3600)
    }

    /// The instance buyer `user` talks to.
    pub(super) fn url_of(&self, user: i64) -> &str {
        &self.urls[self.server_of(user)]
    }

    /// Which of the servers (`--url`, in order) a user's requests go to.
    pub(super) fn server_of(&self, user: i64) -> usize {
        let n = self.urls.len().max(1) as i64;
        user.rem_euclid(n) as usize
    }

    /// An admin call, to the first instance.
    pub(super) async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        bearer: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        self.send_to(&self.urls[0], method, path, bearer, body)
            .await
    }

    pub(super) async fn send_to(
        &self,
        url: &str,
        method: reqwest::Method,
        path: &str,
        bearer: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut req = self
            .http
            .request(method, format!("{url}{path}"))
            .bearer_auth(bearer);
        if let Some(b) = body {
            req = req.json(b);
        }
        let res = req.send().await?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }
}

//! `spawn_app()`: the server on port 0 in an isolated namespace.

use diesel::{Connection, PgConnection, RunQueryDsl};
use seckill::app::Application;
use seckill::config::Settings;
use seckill::http::auth::{JwtKeys, Role};
use secrecy::{ExposeSecret, SecretString};

/// A running server and what a test needs to talk to it.
pub struct TestApp {
    /// `http://127.0.0.1:<port>`.
    pub address: String,
    /// The settings the server runs with (its own database, prefixes).
    pub settings: Settings,
    /// A keep-alive HTTP client.
    pub client: reqwest::Client,
    /// This test's database, dropped with the `TestApp`.
    pub db_name: String,
    keys: JwtKeys,
}

/// The server with the test settings and a fresh namespace.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Like [`spawn_app`], with `tweak` applied to the settings last (e.g. to point
/// a client at a closed port).
pub async fn spawn_app_with(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let mut settings = Settings::load_env("test").expect("test settings load");
    let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    settings.app.port = 0;
    settings.redis.key_prefix = format!("t{id}:");
    settings.kafka.topic_prefix = format!("t{id}.");
    let db_name = format!("seckill_test_{id}");
    settings.postgres.url = create_database(&settings.postgres.url, &db_name).await;
    tweak(&mut settings);

    let app = Application::build(settings.clone())
        .await
        .expect("application builds");
    let address = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until_stopped());
    TestApp {
        address,
        keys: JwtKeys::new(&settings.auth.jwt_secret).expect("jwt keys"),
        settings,
        client: reqwest::Client::new(),
        db_name,
    }
}

/// Creates and migrates `name` next to the configured database; returns its URL.
pub async fn create_database(base: &SecretString, name: &str) -> SecretString {
    let base = base.expose_secret().to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut admin = PgConnection::establish(&base).expect("connect to the main database");
        diesel::sql_query(format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .expect("create the test database");
        let url = database_url(&base, &name);
        let mut conn = PgConnection::establish(&url).expect("connect to the test database");
        seckill::store::migrate_up(&mut conn).expect("migrations apply");
        SecretString::from(url)
    })
    .await
    .expect("database setup task")
}

/// `base` with its database name replaced by `name`.
pub fn database_url(base: &str, name: &str) -> String {
    let (server, _) = base.rsplit_once('/').expect("postgres url has a database");
    format!("{server}/{name}")
}

impl TestApp {
    /// A user token for `user_id`.
    pub fn user_token(&self, user_id: i64) -> String {
        self.keys.mint(user_id, Role::User, 3600).expect("mint")
    }

    /// An admin token.
    pub fn admin_token(&self) -> String {
        self.keys.mint(1, Role::Admin, 3600).expect("mint")
    }

    /// `GET path` with an optional bearer token.
    pub async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let mut req = self.client.get(format!("{}{path}", self.address));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.expect("request sent")
    }

    /// `POST path` with a JSON body and an optional bearer token.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
        token: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self
            .client
            .post(format!("{}{path}", self.address))
            .json(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.expect("request sent")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        // Best effort, on a plain thread (Drop may run inside the runtime).
        let base = self.settings.postgres.url.expose_secret().to_owned();
        let name = self.db_name.clone();
        let _ = std::thread::spawn(move || {
            let main = database_url(&base, "postgres");
            if let Ok(mut conn) = PgConnection::establish(&main) {
                let _ =
                    diesel::sql_query(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                        .execute(&mut conn);
            }
        })
        .join();
    }
}

/// Reads a JSON body, failing the test with the raw text when it is not JSON.
pub async fn json(res: reqwest::Response) -> serde_json::Value {
    let text = res.text().await.expect("body");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

//! One purchase over HTTP: its request built before the burst, its answer
//! read into a small struct, and the purchase token before it.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::client::Client;
use crate::domain::ActivityId;
use crate::orders::OrderStatus;

/// How long a request waits for its answer before it counts as lost (and
/// is sent again, as a client does).
pub(super) const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// One purchase request, built before the burst: its URL, its
/// `Authorization` header and its body.
#[derive(Clone)]
pub(super) struct Prepared {
    pub(super) url: reqwest::Url,
    pub(super) auth: reqwest::header::HeaderValue,
    pub(super) body: bytes::Bytes,
}

impl Prepared {
    pub(super) fn new(
        base: &str,
        activity_id: ActivityId,
        jwt: &str,
        body: &Value,
    ) -> anyhow::Result<Self> {
        Self::to(
            &format!("{base}/api/v1/activities/{activity_id}/orders"),
            jwt,
            body,
        )
    }

    pub(super) fn to(url: &str, jwt: &str, body: &Value) -> anyhow::Result<Self> {
        Ok(Self {
            url: reqwest::Url::parse(url)?,
            auth: reqwest::header::HeaderValue::from_str(&format!("Bearer {jwt}"))?,
            body: serde_json::to_vec(body)?.into(),
        })
    }

    /// The whole HTTP/1.1 request, for [`wire::Wire::send`] to `host`.
    pub(super) fn raw(&self, host: &str) -> bytes::Bytes {
        let mut raw = format!(
            "POST {} HTTP/1.1\r\nhost: {host}\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            self.url.path(),
            self.auth.to_str().unwrap_or_default(),
            self.body.len()
        )
        .into_bytes();
        raw.extend_from_slice(&self.body);
        raw.into()
    }

    pub(super) async fn send<A: Answer>(&self, client: &Client) -> anyhow::Result<(u16, A)> {
        let res = client
            .http
            .post(self.url.clone())
            .header(reqwest::header::AUTHORIZATION, self.auth.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body.clone())
            .send()
            .await?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await?;
        Ok((status, A::parse(&bytes)))
    }
}

/// An answer as a caller reads it: whole ([`Value`]), or only what the
/// burst needs ([`Reply`]).
pub(super) trait Answer: Sized {
    fn parse(bytes: &[u8]) -> Self;
    /// It names an order (a 503 with one is retried).
    fn names_order(&self) -> bool;
    /// Its `status` is FAILED.
    fn failed(&self) -> bool;
}

impl Answer for Value {
    fn parse(bytes: &[u8]) -> Self {
        serde_json::from_slice(bytes).unwrap_or(Value::Null)
    }

    fn names_order(&self) -> bool {
        self["order_no"].is_string()
    }

    fn failed(&self) -> bool {
        self["status"] == OrderStatus::Failed.as_str()
    }
}

impl Answer for Reply {
    fn parse(bytes: &[u8]) -> Self {
        Reply::parse(bytes)
    }

    fn names_order(&self) -> bool {
        self.order_no.is_some()
    }

    fn failed(&self) -> bool {
        self.failed
    }
}

/// What the load generator reads of an answer (the rest is skipped, not
/// parsed into a tree).
#[derive(Debug, Default)]
pub(super) struct Reply {
    pub(super) code: String,
    pub(super) order_no: Option<String>,
    /// Its `status` is FAILED.
    pub(super) failed: bool,
}

impl Reply {
    pub(super) fn parse(bytes: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Fields<'a> {
            #[serde(borrow)]
            code: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            order_no: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            status: Option<Status<'a>>,
        }
        /// An order's `status` is text; a problem's is its HTTP status.
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Status<'a> {
            Text(#[serde(borrow)] std::borrow::Cow<'a, str>),
            Other(serde::de::IgnoredAny),
        }
        match serde_json::from_slice::<Fields>(bytes) {
            Ok(f) => Self {
                code: f.code.map(|c| c.into_owned()).unwrap_or_default(),
                order_no: f.order_no.map(|o| o.into_owned()),
                failed: matches!(f.status, Some(Status::Text(s)) if s == OrderStatus::Failed.as_str()),
            },
            Err(_) => Self::default(),
        }
    }
}

/// One purchase as a client must make it: an answer that names an order
/// whose delivery is not confirmed yet (503 RETRY_LATER with `order_no`) is
/// retried with the same request for up to a minute; a 2xx after that is
/// the purchase accepted (reported as 202), since that order exists.
pub(super) async fn purchase(
    client: &Client,
    url: &str,
    path: &str,
    jwt: &str,
    body: &Value,
) -> anyhow::Result<(u16, Value)> {
    purchase_as(client, &Prepared::to(&format!("{url}{path}"), jwt, body)?).await
}

/// [`purchase`] of a request built beforehand, its answer read as `A`.
pub(super) async fn purchase_as<A: Answer>(
    client: &Client,
    request: &Prepared,
) -> anyhow::Result<(u16, A)> {
    purchase_with(|| request.send::<A>(client)).await
}

/// [`purchase`], each attempt made by `send`.
pub(super) async fn purchase_with<A, F, Fut>(send: F) -> anyhow::Result<(u16, A)>
where
    A: Answer,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(u16, A)>>,
{
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut pending = false;
    loop {
        let (status, answer) = match send().await {
            Ok(answer) => answer,
            // Lost on the way, in either direction: the same request_id
            // again is safe (the server answers a replay with the order it
            // made, if it made one), as a well-behaved client does.
            Err(_) if Instant::now() < give_up => {
                pending = true;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if status == 503 && answer.names_order() && Instant::now() < give_up {
            pending = true;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let accepted_late = pending && status == 200 && !answer.failed();
        return Ok((if accepted_late { 202 } else { status }, answer));
    }
}

#[cfg(test)]
mod tests {
    use super::{OrderStatus, Reply};

    #[test]
    pub(super) fn a_problem_is_read_for_its_code_although_its_status_is_a_number() {
        let body = br#"{"type":"urn:seckill:problem:SOLD_OUT","title":"Sold out","status":409,"detail":"d","code":"SOLD_OUT","message":"m"}"#;
        let reply = Reply::parse(body);
        assert_eq!(reply.code, "SOLD_OUT");
        assert!(!reply.failed);
    }

    #[test]
    pub(super) fn an_order_is_read_for_its_number_and_a_failed_status() {
        let order = |status: OrderStatus| {
            serde_json::json!({"order_no": "1234", "status": status.as_str()}).to_string()
        };
        let accepted = Reply::parse(order(OrderStatus::Processing).as_bytes());
        assert_eq!(accepted.order_no.as_deref(), Some("1234"));
        assert!(!accepted.failed);
        assert!(Reply::parse(order(OrderStatus::Failed).as_bytes()).failed);
    }
}

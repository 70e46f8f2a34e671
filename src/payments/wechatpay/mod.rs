//! WeChat Pay API v3 (`payment.provider = "wechatpay"`), written against its
//! documented protocol: Native and JSAPI prepay, query and close by
//! `out_trade_no` (our payment number), refunds under `out_refund_no` (our
//! refund number), and payment and refund callbacks.
//!
//! Every request is signed `WECHATPAY2-SHA256-RSA2048` with the merchant
//! key. Every answer, 2xx or 4xx, and every callback must carry a valid
//! signature of one of WeChat Pay's public keys, chosen by
//! `Wechatpay-Serial`, and a `Wechatpay-Timestamp` within the tolerance.
//! An answer that does not is an unknown outcome, like no answer at all: a
//! forged or replayed "no" never closes a payment or ends a refund.

mod bill;
pub mod crypto;
pub mod status;

pub use bill::parse_trade_bill;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::{BoxFuture, FutureExt};
use reqwest::Method;
use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::json;

use self::crypto::{ApiV3Cipher, MerchantSigner, PlatformKeys, SCHEME, VerifyError};
use super::provider::exchange::{Answer, exchange, parse};
use super::provider::{
    CallbackError, Charge, ChargeOutcome, Checkout, CloseOutcome, Event, Headers, JsapiPayment,
    NewPayment, PaymentProvider, PaymentRef, ProviderError, RefundRef, RefundReport, RefundRequest,
    StatementLine,
};
use crate::config::{TradeType, WechatPaySettings};

/// The only currency of WeChat Pay's domestic payments.
const CNY: &str = "CNY";

/// The adapter: one merchant account.
pub struct WechatPay {
    base_url: String,
    mchid: String,
    appid: String,
    notify_url: String,
    trade_type: TradeType,
    signer: MerchantSigner,
    platform: PlatformKeys,
    cipher: ApiV3Cipher,
    http: reqwest::Client,
    /// Largest accepted |now − Wechatpay-Timestamp| of an answer or a
    /// callback, seconds.
    tolerance_secs: i64,
}

/// A callback's envelope.
#[derive(Deserialize)]
struct Notification {
    event_type: String,
    resource: Resource,
}

#[derive(Deserialize)]
struct Resource {
    algorithm: String,
    ciphertext: String,
    #[serde(default)]
    associated_data: String,
    nonce: String,
}

/// A transaction, as queried or as a payment callback's resource.
#[derive(Deserialize)]
struct Transaction {
    mchid: Option<String>,
    appid: Option<String>,
    out_trade_no: String,
    transaction_id: Option<String>,
    trade_state: String,
    success_time: Option<DateTime<chrono::FixedOffset>>,
    amount: Option<Amount>,
}

#[derive(Deserialize)]
struct Amount {
    #[serde(default)]
    total: i64,
    currency: Option<String>,
}

/// A refund, as answered or as a refund callback's resource.
#[derive(Deserialize)]
struct Refund {
    /// In callbacks.
    mchid: Option<String>,
    out_refund_no: String,
    refund_id: Option<String>,
    /// In answers.
    status: Option<String>,
    /// In callbacks.
    refund_status: Option<String>,
    amount: Option<Amount>,
}

/// An error answer: `{"code", "message"}`.
#[derive(Deserialize)]
struct ErrorAnswer {
    code: String,
    #[serde(default)]
    message: String,
}

fn header<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn nonce() -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).unwrap_or_else(|_| fastrand::fill(&mut bytes));
    hex::encode_upper(bytes)
}

/// Why an answer or a callback is not WeChat Pay's word.
#[derive(Debug)]
enum Unverified {
    Missing,
    Stale,
    Key(VerifyError),
}

impl WechatPay {
    /// From `[payment.wechatpay]`; reads the merchant key and the platform
    /// keys from their files.
    pub fn from_settings(
        s: &WechatPaySettings,
        timeout: Duration,
        tolerance_secs: i64,
    ) -> anyhow::Result<Self> {
        let pem = std::fs::read_to_string(&s.merchant_key_file).map_err(|e| {
            anyhow::anyhow!(
                "payment.wechatpay.merchant_key_file {}: {e}",
                s.merchant_key_file
            )
        })?;
        Ok(Self {
            base_url: s.base_url.trim_end_matches('/').to_owned(),
            mchid: s.mchid.clone(),
            appid: s.appid.clone(),
            notify_url: s.notify_url.clone(),
            trade_type: s.trade_type,
            signer: MerchantSigner::from_pem(&s.mchid, &s.merchant_serial, &pem)?,
            platform: PlatformKeys::load_dir(std::path::Path::new(&s.platform_key_dir))?,
            cipher: ApiV3Cipher::new(s.apiv3_key.expose_secret().as_bytes())?,
            http: reqwest::Client::builder().timeout(timeout).build()?,
            tolerance_secs,
        })
    }

    /// Checks the `Wechatpay-*` headers over `body`, at `now` (unix
    /// seconds): a platform key's signature, made within the tolerance.
    fn verify_signed(
        &self,
        get: impl Fn(&str) -> Option<String>,
        body: &[u8],
        now: i64,
    ) -> Result<(), Unverified> {
        let (Some(ts), Some(nonce), Some(serial), Some(signature)) = (
            get("wechatpay-timestamp"),
            get("wechatpay-nonce"),
            get("wechatpay-serial"),
            get("wechatpay-signature"),
        ) else {
            return Err(Unverified::Missing);
        };
        let t: i64 = ts.parse().map_err(|_| Unverified::Missing)?;
        if now.abs_diff(t) > self.tolerance_secs.unsigned_abs() {
            return Err(Unverified::Stale);
        }
        self.platform
            .verify(
                &serial,
                &crypto::response_message(&ts, &nonce, body),
                &signature,
            )
            .map_err(Unverified::Key)
    }

    /// One signed call: `Ok((status, body))` for a 2xx. A 4xx is read by
    /// its code ([`status::error_of`]); a 5xx, no answer, and any answer
    /// whose signature or timestamp does not hold are `Unknown`. `signed`
    /// is false only for a bill's download, whose 2xx carries no
    /// signature (its hash, given by a signed answer, is checked instead).
    async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<serde_json::Value>,
        signed: bool,
    ) -> Result<(u16, Vec<u8>), ProviderError> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let ts = Utc::now().timestamp();
        let nonce = nonce();
        let authorization =
            self.signer
                .authorization(method.as_str(), path_and_query, ts, &nonce, &body);
        let mut request = self
            .http
            .request(method, format!("{}{path_and_query}", self.base_url))
            .header("authorization", authorization)
            .header("accept", "application/json")
            .header("user-agent", concat!("seckill/", env!("CARGO_PKG_VERSION")));
        if !body.is_empty() {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        let Answer {
            status,
            headers,
            body: bytes,
        } = exchange(request).await?;
        let error = (400..500).contains(&status);
        if !error && !(200..300).contains(&status) {
            return Err(ProviderError::Unknown(format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes)
            )));
        }
        if signed || error {
            let get = |name: &str| header(&headers, name).map(str::to_owned);
            self.verify_signed(get, &bytes, Utc::now().timestamp())
                .map_err(|e| {
                    ProviderError::Unknown(format!("{status}, not WeChat Pay's word: {e:?}"))
                })?;
        }
        if error {
            let answer: ErrorAnswer = serde_json::from_slice(&bytes)
                .map_err(|_| ProviderError::Unknown(format!("{status} without an error code")))?;
            return Err(status::error_of(status, &answer.code, &answer.message));
        }
        Ok((status, bytes.to_vec()))
    }

    /// [`Self::send`] with the answer's signature checked.
    async fn call(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(u16, Vec<u8>), ProviderError> {
        self.send(method, path_and_query, body, true).await
    }

    /// Native (a `code_url` to show as a QR code) or JSAPI (the parameters
    /// of the mini-program's `wx.requestPayment`), as configured.
    async fn prepay(&self, p: &NewPayment) -> Result<Checkout, ProviderError> {
        let mut body = json!({
            "appid": self.appid,
            "mchid": self.mchid,
            "description": p.description,
            "out_trade_no": p.payment_no.to_string(),
            "attach": p.order_no.to_string(),
            "notify_url": self.notify_url,
            "amount": {"total": p.amount_cents, "currency": CNY},
        });
        if let Some(at) = p.expires_at {
            body["time_expire"] = json!(at.to_rfc3339_opts(chrono::SecondsFormat::Secs, false));
        }
        match self.trade_type {
            TradeType::Native => {
                #[derive(Deserialize)]
                struct Prepay {
                    code_url: String,
                }
                let (_, answer) = self
                    .call(Method::POST, "/v3/pay/transactions/native", Some(body))
                    .await?;
                let prepay: Prepay = parse(&answer)?;
                Ok(Checkout {
                    code_url: Some(prepay.code_url),
                    ..Checkout::default()
                })
            }
            TradeType::Jsapi => {
                #[derive(Deserialize)]
                struct Prepay {
                    prepay_id: String,
                }
                let Some(openid) = p.payer_openid.as_deref() else {
                    return Err(ProviderError::Refused {
                        code: "OPENID_REQUIRED".into(),
                        message: "a JSAPI payment needs the payer's openid".into(),
                    });
                };
                body["payer"] = json!({"openid": openid});
                let (_, answer) = self
                    .call(Method::POST, "/v3/pay/transactions/jsapi", Some(body))
                    .await?;
                let prepay: Prepay = parse(&answer)?;
                let params =
                    self.request_payment(&prepay.prepay_id, Utc::now().timestamp(), &nonce());
                Ok(Checkout {
                    jsapi: Some(params),
                    ..Checkout::default()
                })
            }
        }
    }

    /// What `wx.requestPayment` takes to pay `prepay_id`: `paySign` is the
    /// merchant key's RSA-SHA256 over `appId`, `timeStamp`, `nonceStr` and
    /// `package`, each followed by a newline (WeChat Pay's JSAPI
    /// documentation, and the official SDK's `JsapiServiceExtension`).
    pub fn request_payment(&self, prepay_id: &str, timestamp: i64, nonce: &str) -> JsapiPayment {
        let package = format!("prepay_id={prepay_id}");
        let message = format!("{}\n{timestamp}\n{nonce}\n{package}\n", self.appid);
        JsapiPayment {
            app_id: self.appid.clone(),
            time_stamp: timestamp.to_string(),
            nonce_str: nonce.to_owned(),
            package,
            sign_type: "RSA".into(),
            pay_sign: self.signer.sign(message.as_bytes()),
        }
    }

    /// Closes the trade. Only a signed answer counts: `ORDERPAID` means the
    /// buyer paid first; `ORDER_CLOSED` and `ORDER_NOT_EXIST` (never made
    /// there) mean it can no longer be paid.
    async fn close_trade(&self, payment_no: i64) -> Result<CloseOutcome, ProviderError> {
        let path = format!("/v3/pay/transactions/out-trade-no/{payment_no}/close");
        match self
            .call(Method::POST, &path, Some(json!({"mchid": self.mchid})))
            .await
        {
            Ok(_) => Ok(CloseOutcome::Closed),
            Err(ProviderError::Refused { code, .. }) if code == "ORDERPAID" => {
                Ok(CloseOutcome::AlreadyPaid)
            }
            Err(ProviderError::Refused { code, .. })
                if code == "ORDER_CLOSED" || code == "ORDER_NOT_EXIST" =>
            {
                Ok(CloseOutcome::Closed)
            }
            Err(e) => Err(e),
        }
    }

    async fn query_trade(&self, payment_no: i64) -> Result<Charge, ProviderError> {
        let path = format!(
            "/v3/pay/transactions/out-trade-no/{payment_no}?mchid={}",
            self.mchid
        );
        match self.call(Method::GET, &path, None).await {
            Ok((_, body)) => self
                .charge_of(parse(&body)?)
                .map_err(ProviderError::Unknown),
            Err(ProviderError::Refused { code, .. }) if code == "ORDER_NOT_EXIST" => {
                Ok(Charge::bare(payment_no, ChargeOutcome::NotPaid))
            }
            Err(e) => Err(e),
        }
    }

    async fn send_refund(&self, r: &RefundRequest) -> Result<RefundReport, ProviderError> {
        let body = json!({
            "out_trade_no": r.payment.payment_no.to_string(),
            "out_refund_no": r.refund_no.to_string(),
            "reason": r.reason,
            "notify_url": self.notify_url,
            "amount": {"refund": r.amount_cents, "total": r.total_cents, "currency": CNY},
        });
        let (_, answer) = self
            .call(Method::POST, "/v3/refund/domestic/refunds", Some(body))
            .await?;
        report_of(parse(&answer)?).map_err(ProviderError::Unknown)
    }

    /// The trade bill of `date` (China time): its download address, then
    /// the file, checked against the SHA-1 the first answer gave.
    async fn trade_bill(
        &self,
        date: chrono::NaiveDate,
    ) -> Result<Vec<StatementLine>, ProviderError> {
        #[derive(Deserialize)]
        struct Bill {
            download_url: String,
            hash_type: Option<String>,
            hash_value: Option<String>,
        }
        let path = format!(
            "/v3/bill/tradebill?bill_date={}&bill_type=ALL",
            date.format("%Y-%m-%d")
        );
        let (_, answer) = self.call(Method::GET, &path, None).await?;
        let bill: Bill = parse(&answer)?;
        // Signed like any request, at this server's base (the address names
        // WeChat Pay's host).
        let at = bill
            .download_url
            .find("/v3/")
            .ok_or_else(|| ProviderError::Unknown(format!("download_url {}", bill.download_url)))?;
        let (_, file) = self
            .send(Method::GET, &bill.download_url[at..], None, false)
            .await?;
        if bill
            .hash_type
            .as_deref()
            .is_some_and(|t| t.eq_ignore_ascii_case("SHA1"))
        {
            use sha1::Digest;
            let digest = hex::encode(sha1::Sha1::digest(&file));
            if !bill
                .hash_value
                .as_deref()
                .is_some_and(|h| h.eq_ignore_ascii_case(&digest))
            {
                return Err(ProviderError::Unknown(
                    "the bill does not match its hash".into(),
                ));
            }
        }
        parse_trade_bill(&String::from_utf8_lossy(&file))
    }

    async fn find_refund(&self, refund_no: i64) -> Result<RefundReport, ProviderError> {
        let path = format!("/v3/refund/domestic/refunds/{refund_no}");
        let (_, answer) = self.call(Method::GET, &path, None).await?;
        report_of(parse(&answer)?).map_err(ProviderError::Unknown)
    }

    /// A transaction read as ours, once it is shown to be of this merchant
    /// and app, in yuan.
    fn charge_of(&self, t: Transaction) -> Result<Charge, String> {
        if t.mchid.as_deref() != Some(self.mchid.as_str()) {
            return Err(format!("a transaction of mchid {:?}", t.mchid));
        }
        if t.appid.as_deref() != Some(self.appid.as_str()) {
            return Err(format!("a transaction of appid {:?}", t.appid));
        }
        let currency = t.amount.as_ref().and_then(|a| a.currency.as_deref());
        if currency.is_some_and(|c| c != CNY) {
            return Err(format!("a transaction in {currency:?}"));
        }
        let payment_no = t
            .out_trade_no
            .parse()
            .map_err(|_| format!("out_trade_no {:?}", t.out_trade_no))?;
        Ok(Charge {
            payment_no,
            order_no: None,
            amount_cents: t.amount.map_or(0, |a| a.total),
            outcome: status::trade_outcome(&t.trade_state),
            txn_id: t.transaction_id,
            paid_at: t.success_time.map(|t| t.with_timezone(&Utc)),
            provider_ref: None,
        })
    }
}

fn report_of(r: Refund) -> Result<RefundReport, String> {
    let currency = r.amount.as_ref().and_then(|a| a.currency.as_deref());
    if currency.is_some_and(|c| c != CNY) {
        return Err(format!("a refund in {currency:?}"));
    }
    let refund_no = r
        .out_refund_no
        .parse()
        .map_err(|_| format!("out_refund_no {:?}", r.out_refund_no))?;
    let status = r.status.or(r.refund_status).unwrap_or_default();
    let state = status::refund_state(&status);
    Ok(RefundReport {
        refund_no,
        provider_refund_id: r.refund_id,
        state,
    })
}

impl PaymentProvider for WechatPay {
    fn name(&self) -> &'static str {
        "wechatpay"
    }

    fn needs_payer(&self) -> bool {
        self.trade_type == TradeType::Jsapi
    }

    fn create<'a>(
        &'a self,
        payment: &'a NewPayment,
    ) -> BoxFuture<'a, Result<Checkout, ProviderError>> {
        self.prepay(payment).boxed()
    }

    fn parse_callback(
        &self,
        headers: &dyn Headers,
        body: &[u8],
        now: i64,
    ) -> Result<Event, CallbackError> {
        if headers
            .header("wechatpay-signature-type")
            .is_some_and(|t| t != SCHEME)
        {
            return Err(CallbackError::Malformed("an unknown signature type".into()));
        }
        self.verify_signed(|name| headers.header(name).map(str::to_owned), body, now)
            .map_err(|e| match e {
                Unverified::Missing => {
                    CallbackError::Malformed("Wechatpay-* headers missing or malformed".into())
                }
                Unverified::Stale => CallbackError::Stale,
                Unverified::Key(VerifyError::UnknownSerial(s)) => CallbackError::UnknownKey(s),
                Unverified::Key(VerifyError::Malformed) => {
                    CallbackError::Malformed("Wechatpay-Signature".into())
                }
                Unverified::Key(VerifyError::Mismatch) => CallbackError::BadSignature,
            })?;
        let n: Notification =
            serde_json::from_slice(body).map_err(|e| CallbackError::Malformed(e.to_string()))?;
        if n.resource.algorithm != "AEAD_AES_256_GCM" {
            return Err(CallbackError::Malformed(format!(
                "resource algorithm {}",
                n.resource.algorithm
            )));
        }
        let plain = self
            .cipher
            .decrypt(
                n.resource.associated_data.as_bytes(),
                n.resource.nonce.as_bytes(),
                &n.resource.ciphertext,
            )
            .ok_or(CallbackError::Undecryptable)?;
        let malformed = |e: serde_json::Error| CallbackError::Malformed(e.to_string());
        if n.event_type.starts_with("TRANSACTION.") {
            let t: Transaction = serde_json::from_slice(&plain).map_err(malformed)?;
            Ok(Event::Charge(
                self.charge_of(t).map_err(CallbackError::Foreign)?,
            ))
        } else if n.event_type.starts_with("REFUND.") {
            let r: Refund = serde_json::from_slice(&plain).map_err(malformed)?;
            if r.mchid.as_deref() != Some(self.mchid.as_str()) {
                return Err(CallbackError::Foreign(format!(
                    "a refund of mchid {:?}",
                    r.mchid
                )));
            }
            Ok(Event::Refund(report_of(r).map_err(CallbackError::Foreign)?))
        } else {
            Err(CallbackError::Malformed(format!(
                "event_type {}",
                n.event_type
            )))
        }
    }

    fn close<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<CloseOutcome, ProviderError>> {
        self.close_trade(payment.payment_no).boxed()
    }

    fn statement(
        &self,
        date: chrono::NaiveDate,
    ) -> BoxFuture<'_, Result<Vec<StatementLine>, ProviderError>> {
        self.trade_bill(date).boxed()
    }

    fn query<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<Charge, ProviderError>> {
        self.query_trade(payment.payment_no).boxed()
    }

    fn refund<'a>(
        &'a self,
        refund: &'a RefundRequest,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        self.send_refund(refund).boxed()
    }

    fn query_refund<'a>(
        &'a self,
        refund: &'a RefundRef,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        self.find_refund(refund.refund_no).boxed()
    }
}

#[cfg(test)]
mod tests;

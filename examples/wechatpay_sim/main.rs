//! A WeChat Pay API v3 platform simulator, for the tests (WeChat Pay has no
//! sandbox for API v3). It keeps trades and refunds in memory, checks the
//! merchant's request signatures, signs its answers and its callbacks with
//! platform keys it makes at start, and seals callback resources with
//! AEAD_AES_256_GCM under the APIv3 key. The official wechatpay-java SDK
//! checks it (`tests/wechatpay-sdk`, run by `scripts/test.sh`): the SDK's
//! client pays, queries, closes and refunds against it and verifies its
//! answers, and the SDK's `NotificationParser` parses its callbacks.
//!
//!   wechatpay_sim --mchid 1900000001 --merchant-serial S \
//!     --merchant-public-key merchant.pub.pem --apiv3-key <32 bytes> \
//!     --platform-key-dir DIR
//!
//! It writes two platform public keys, `<serial>.pem`, to DIR (it signs
//! with the first until told otherwise: a rotation), then prints one JSON
//! line, `{"url", "serials"}`, once it listens.
//!
//! What a test drives, under `/sim`:
//! - `POST /sim/pay/{out_trade_no}` `{"times", "deliver", "outcome"}`: the
//!   buyer pays (`outcome` `PAYERROR`: the charge fails, and the trade can
//!   still be paid later, as WeChat Pay's can); the payment callback is
//!   sent `times` times (none when `deliver` is false: a dropped callback),
//!   or as the delivery plan says when neither is given. A closed trade,
//!   or one past its `time_expire`, is refused (409);
//! - `POST /sim/deliver/{out_trade_no}` `{"tamper": "body" | "serial" |
//!   "timestamp" | "mchid" | "appid" | "currency" | null}`: one more
//!   callback, spoiled as asked (the last three: a genuine signature over
//!   a resource of another merchant, app or currency);
//! - `POST /sim/script` `{"path", "status", "code", "signed", "stale",
//!   "after_work", "times"}`: the next calls whose path contains `path`
//!   get that answer (`faults.rs`);
//! - `POST /sim/faults` `{"error_rate", "hang_rate", "hang_ms", "seed"}`:
//!   faults drawn at a rate from a seed, on every merchant call;
//! - `POST /sim/callbacks`: the delivery plan (`deliver.rs`): callbacks
//!   dropped, repeated, late, refunds settled before their answer;
//! - `POST /sim/refund-settle/{out_refund_no}` `{"status", "force"}`: a
//!   refund still PROCESSING (`force`: or one that failed) settles now,
//!   and its callback goes out;
//! - `POST /sim/sign-with` `{"serial"}`: sign with the other key from now;
//! - `POST /sim/refund-callbacks` `{"deliver"}`: send refund callbacks, or not;
//! - `POST /sim/notify-to` `{"url"}`: send callbacks there, whatever
//!   `notify_url` the requests named;
//! - `POST /sim/plant` `{"out_trade_no", "amount"}`, `POST
//!   /sim/forget/{out_trade_no}`: a trade paid behind the merchant's back,
//!   an amount changed, a trade gone (for the statement reconciliation);
//! - `GET /sim/state` (`?requests=false` without the requests): trades,
//!   refunds, faults given, and every request with whether its signature
//!   held.

mod deliver;
mod faults;

use std::collections::HashMap;
use std::sync::Mutex;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use chrono::{SecondsFormat, Utc};
use rsa::Generate;
use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
use seckill::payments::wechatpay::crypto::{self, ApiV3Cipher, MerchantSigner, PlatformKeys};
use serde_json::{Value, json};

use faults::{Faults, Op, Verdict};

struct Trade {
    out_trade_no: String,
    amount: i64,
    body: Value,
    notify_url: String,
    code_url: String,
    state: &'static str,
    transaction_id: Option<String>,
    success_time: Option<String>,
    /// Prepay calls made for it (one trade, however many calls).
    creates: u32,
    /// `NATIVE` or `JSAPI`.
    trade_type: &'static str,
    /// JSAPI: the payer's openid, and the prepay id given.
    openid: Option<String>,
    prepay_id: String,
    /// After this the trade cannot be paid.
    expires: Option<chrono::DateTime<chrono::FixedOffset>>,
}

struct Refund {
    out_refund_no: String,
    out_trade_no: String,
    refund_id: String,
    amount: i64,
    total: i64,
    status: &'static str,
    notify_url: String,
    creates: u32,
}

struct Sim {
    mchid: String,
    merchant: PlatformKeys,
    signers: Vec<(String, MerchantSigner)>,
    current: Mutex<usize>,
    cipher: ApiV3Cipher,
    trades: Mutex<HashMap<String, Trade>>,
    refunds: Mutex<HashMap<String, Refund>>,
    requests: Mutex<Vec<Value>>,
    refund_callbacks: Mutex<bool>,
    /// Where callbacks go instead of the `notify_url` of the request (a
    /// test's server listens on a port chosen when it starts).
    notify_to: Mutex<Option<String>>,
    http: reqwest::Client,
    faults: Faults,
    plan: Mutex<deliver::Plan>,
}

fn arg(args: &[String], name: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| panic!("{name} is required"))
}

/// Now in China time, as WeChat Pay writes its times.
fn china_now() -> String {
    let china = chrono::FixedOffset::east_opt(8 * 3600).unwrap();
    Utc::now()
        .with_timezone(&china)
        .to_rfc3339_opts(SecondsFormat::Secs, false)
}

fn random(n: usize) -> String {
    (0..n).map(|_| fastrand::alphanumeric()).collect()
}

impl Sim {
    fn signer(&self) -> &(String, MerchantSigner) {
        &self.signers[*self.current.lock().unwrap()]
    }

    /// Wechatpay-* headers over `body`, at `ts`.
    fn sign(&self, ts: i64, body: &[u8]) -> Vec<(&'static str, String)> {
        let (serial, signer) = self.signer();
        let nonce = random(32);
        let signature = signer.sign(&crypto::response_message(&ts.to_string(), &nonce, body));
        vec![
            ("Wechatpay-Timestamp", ts.to_string()),
            ("Wechatpay-Nonce", nonce),
            ("Wechatpay-Serial", serial.clone()),
            ("Wechatpay-Signature", signature),
            ("Wechatpay-Signature-Type", crypto::SCHEME.to_owned()),
        ]
    }

    fn answer(&self, status: u16, body: Option<Value>) -> HttpResponse {
        self.answer_signed(status, body, Some(Utc::now().timestamp()))
    }

    /// An answer signed at `signed_at` (unix seconds), or not at all.
    fn answer_signed(
        &self,
        status: u16,
        body: Option<Value>,
        signed_at: Option<i64>,
    ) -> HttpResponse {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let mut res = HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap());
        for (k, v) in signed_at
            .map(|ts| self.sign(ts, bytes.as_bytes()))
            .unwrap_or_default()
        {
            res.insert_header((k, v));
        }
        res.insert_header(("Request-ID", random(16)));
        let mut res = if bytes.is_empty() {
            res.finish()
        } else {
            res.content_type("application/json").body(bytes)
        };
        // Header names as WeChat Pay writes them (Wechatpay-Timestamp): the
        // official SDK looks them up in that case only, and actix writes
        // them in lower case otherwise.
        res.head_mut().set_camel_case_headers(true);
        res
    }

    fn error(&self, status: u16, code: &str, message: &str) -> HttpResponse {
        self.answer(status, Some(json!({"code": code, "message": message})))
    }

    /// A fault's error answer, signed or not, fresh or stale.
    fn fault(&self, a: &faults::Answer) -> HttpResponse {
        let now = Utc::now().timestamp();
        let signed_at = a.signed.then_some(if a.stale { now - 3600 } else { now });
        self.answer_signed(
            a.status,
            Some(json!({"code": a.code, "message": a.message})),
            signed_at,
        )
    }

    /// Checks the merchant's `Authorization` over the request.
    fn verify(&self, req: &HttpRequest, body: &[u8]) -> Result<(), String> {
        let auth = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .ok_or("no Authorization")?;
        let params = auth
            .strip_prefix(crypto::SCHEME)
            .ok_or("not WECHATPAY2-SHA256-RSA2048")?
            .trim();
        let mut fields = HashMap::new();
        for part in params.split(',') {
            let (k, v) = part.split_once('=').ok_or("a malformed field")?;
            fields.insert(k.trim(), v.trim().trim_matches('"'));
        }
        let get = |k: &str| fields.get(k).copied().ok_or(format!("no {k}"));
        if get("mchid")? != self.mchid {
            return Err("another mchid".into());
        }
        let ts: i64 = get("timestamp")?.parse().map_err(|_| "timestamp")?;
        if (Utc::now().timestamp() - ts).abs() > 300 {
            return Err("an old timestamp".into());
        }
        let path = req.uri().path_and_query().map_or("", |p| p.as_str());
        let message = crypto::request_message(
            req.method().as_str(),
            path,
            ts,
            get("nonce_str")?,
            std::str::from_utf8(body).map_err(|_| "a body not UTF-8")?,
        );
        self.merchant
            .verify(get("serial_no")?, message.as_bytes(), get("signature")?)
            .map_err(|e| format!("{e:?}"))
    }

    /// Logs the request and checks it; the error answer when it fails.
    fn check(&self, req: &HttpRequest, body: &[u8]) -> Option<HttpResponse> {
        let verified = self.verify(req, body);
        self.requests.lock().unwrap().push(json!({
            "method": req.method().as_str(),
            "path": req.uri().to_string(),
            "verified": verified.is_ok(),
            "error": verified.as_ref().err(),
            "authorization": req.headers().get("authorization").and_then(|v| v.to_str().ok()),
            "body": String::from_utf8_lossy(body),
        }));
        verified
            .err()
            .map(|e| self.error(401, "SIGN_ERROR", &format!("signature: {e}")))
    }

    fn transaction(&self, t: &Trade) -> Value {
        json!({
            "appid": t.body["appid"],
            "mchid": self.mchid,
            "out_trade_no": t.out_trade_no,
            "transaction_id": t.transaction_id,
            "trade_type": t.trade_type,
            "trade_state": t.state,
            "trade_state_desc": t.state,
            "bank_type": "OTHERS",
            "attach": t.body["attach"],
            "success_time": t.success_time,
            "payer": {"openid": t.openid.clone().unwrap_or_else(|| "o-simulated-payer".into())},
            "amount": {"total": t.amount, "payer_total": t.amount, "currency": "CNY", "payer_currency": "CNY"},
        })
    }

    fn refund_json(&self, r: &Refund) -> Value {
        json!({
            "refund_id": r.refund_id,
            "out_refund_no": r.out_refund_no,
            "transaction_id": self.trades.lock().unwrap().get(&r.out_trade_no).and_then(|t| t.transaction_id.clone()),
            "out_trade_no": r.out_trade_no,
            "channel": "ORIGINAL",
            "user_received_account": "simulated balance",
            "status": r.status,
            "create_time": Utc::now().to_rfc3339_opts(SecondsFormat::Secs, false),
            "amount": {"total": r.total, "refund": r.amount, "payer_total": r.total, "payer_refund": r.amount, "currency": "CNY"},
        })
    }

    /// A callback `(headers, body)` of `event_type` carrying `resource`.
    fn callback(
        &self,
        event_type: &str,
        original: &str,
        resource: &Value,
        ts: i64,
    ) -> (Vec<(&'static str, String)>, Vec<u8>) {
        let nonce = random(12);
        let ciphertext = self
            .cipher
            .encrypt(
                original.as_bytes(),
                nonce.as_bytes(),
                resource.to_string().as_bytes(),
            )
            .expect("a 12-byte nonce");
        let body = json!({
            "id": uuid::Uuid::new_v4().to_string(),
            "create_time": Utc::now().to_rfc3339_opts(SecondsFormat::Secs, false),
            "resource_type": "encrypt-resource",
            "event_type": event_type,
            "summary": "simulated",
            "resource": {
                "original_type": original,
                "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": ciphertext,
                "associated_data": original,
                "nonce": nonce,
            },
        })
        .to_string()
        .into_bytes();
        (self.sign(ts, &body), body)
    }

    /// The trade bill of `date` (China time): header, one row per trade
    /// paid that day (a REFUND row too for a refunded one), the summary.
    fn bill(&self, date: &str) -> String {
        let mut out = String::from(
            "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率,订单金额,申请退款金额,费率备注\n",
        );
        let yuan = |fen: i64| format!("{}.{:02}", fen / 100, fen % 100);
        let trades = self.trades.lock().unwrap();
        let (mut count, mut total) = (0, 0);
        let mut paid: Vec<&Trade> = trades
            .values()
            .filter(|t| {
                t.success_time
                    .as_deref()
                    .is_some_and(|s| s.starts_with(date))
            })
            .collect();
        paid.sort_by(|a, b| a.out_trade_no.cmp(&b.out_trade_no));
        for t in paid {
            let time = t
                .success_time
                .as_deref()
                .unwrap_or_default()
                .replace('T', " ");
            let time = &time[..19.min(time.len())];
            out.push_str(&format!(
                "`{time},`wxd678efh567hg6787,`{},`0,`,`{},`{},`o-simulated-payer,`NATIVE,`SUCCESS,`OTHERS,`CNY,`{},`0.00,`0,`0,`0.00,`0.00,`,`,`seckill, simulated,`,`0.00000,`0.60%,`{},`0.00,`\n",
                self.mchid,
                t.transaction_id.as_deref().unwrap_or_default(),
                t.out_trade_no,
                yuan(t.amount),
                yuan(t.amount),
            ));
            count += 1;
            total += t.amount;
        }
        out.push_str("总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\n");
        out.push_str(&format!(
            "`{count},`{},`0.00,`0.00,`0.00000,`{},`0.00\n",
            yuan(total),
            yuan(total)
        ));
        out
    }

    fn notify_url(&self, asked: String) -> String {
        self.notify_to.lock().unwrap().clone().unwrap_or(asked)
    }

    async fn post(
        &self,
        url: &str,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    ) -> (u16, String) {
        let mut req = self
            .http
            .post(url)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(k, v);
        }
        match req.body(body).send().await {
            Ok(res) => {
                let status = res.status().as_u16();
                (status, res.text().await.unwrap_or_default())
            }
            Err(e) => (0, e.to_string()),
        }
    }

    /// Sends the trade's payment callback, spoiled as `tamper` says.
    async fn deliver(&self, no: &str, tamper: Option<&str>) -> Option<(u16, String)> {
        let notice = self.payment_callback(no, tamper)?;
        Some(self.post(&notice.url, notice.headers, notice.body).await)
    }

    /// The trade's payment callback, spoiled as `tamper` says.
    fn payment_callback(&self, no: &str, tamper: Option<&str>) -> Option<deliver::Notice> {
        let (mut resource, url) = {
            let trades = self.trades.lock().unwrap();
            let t = trades.get(no)?;
            (self.transaction(t), self.notify_url(t.notify_url.clone()))
        };
        match tamper {
            Some("mchid") => resource["mchid"] = json!("1900009999"),
            Some("appid") => resource["appid"] = json!("wx-another-app"),
            Some("currency") => resource["amount"]["currency"] = json!("USD"),
            _ => {}
        }
        let ts = match tamper {
            Some("timestamp") => Utc::now().timestamp() - 3600,
            _ => Utc::now().timestamp(),
        };
        let (mut headers, mut body) =
            self.callback("TRANSACTION.SUCCESS", "transaction", &resource, ts);
        match tamper {
            Some("body") => {
                // One byte of the ciphertext changed after signing.
                let text = String::from_utf8(body).unwrap();
                let at = text.find("\"ciphertext\":\"").unwrap() + 14;
                let mut bytes = text.into_bytes();
                bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
                body = bytes;
            }
            Some("serial") => {
                for h in &mut headers {
                    if h.0 == "Wechatpay-Serial" {
                        h.1 = "UNKNOWN-SERIAL".into();
                    }
                }
            }
            _ => {}
        }
        Some(deliver::Notice { headers, body, url })
    }

    /// The refund's callback as it stands now.
    fn refund_notice(&self, no: &str) -> Option<deliver::Notice> {
        let (resource, url) = {
            let refunds = self.refunds.lock().unwrap();
            let r = refunds.get(no)?;
            let mut resource = self.refund_json(r);
            // A refund callback names it `refund_status`, an answer `status`.
            let status = resource
                .as_object_mut()
                .and_then(|o| o.remove("status"))
                .unwrap_or_default();
            resource["refund_status"] = status;
            resource["mchid"] = json!(self.mchid);
            (resource, self.notify_url(r.notify_url.clone()))
        };
        let event = format!(
            "REFUND.{}",
            resource["refund_status"].as_str().unwrap_or("SUCCESS")
        );
        let (headers, body) = self.callback(&event, "refund", &resource, Utc::now().timestamp());
        Some(deliver::Notice { headers, body, url })
    }

    /// The refund's callback, sent as the delivery plan says.
    async fn refund_callback(self: &std::sync::Arc<Self>, no: &str) {
        if !*self.refund_callbacks.lock().unwrap() {
            return;
        }
        if let Some(notice) = self.refund_notice(no) {
            deliver::send(self.clone(), notice).await;
        }
    }

    /// Settles a refund still PROCESSING as `status` (`force`: one that
    /// failed, too, as a merchant who mends an abnormal refund does), and
    /// sends its callback.
    async fn settle_refund(
        self: &std::sync::Arc<Self>,
        no: &str,
        status: &'static str,
        force: bool,
    ) -> bool {
        let settled = match self.refunds.lock().unwrap().get_mut(no) {
            Some(r) if r.status == "PROCESSING" || (force && r.status != "SUCCESS") => {
                r.status = status;
                true
            }
            _ => false,
        };
        if settled {
            self.refund_callback(no).await;
        }
        settled
    }

    /// The verdict of the faults in force on a call of `op` to `req`'s path.
    fn verdict(&self, op: Op, req: &HttpRequest) -> Verdict {
        let path = req.uri().path_and_query().map_or("", |p| p.as_str());
        self.faults.verdict(op, path)
    }

    /// The answer to a call whose work is done, as the verdict says: as
    /// is, replaced by an error, or held past the client's patience.
    async fn after_work(&self, verdict: Verdict, answer: HttpResponse) -> HttpResponse {
        match verdict {
            Verdict::After(a) => self.fault(&a),
            Verdict::Hang(ms) => {
                actix_web::rt::time::sleep(std::time::Duration::from_millis(ms)).await;
                answer
            }
            _ => answer,
        }
    }
}

/// Prepay, Native or JSAPI.
async fn prepay(
    sim: web::Data<Sim>,
    req: HttpRequest,
    body: web::Bytes,
    trade_type: &'static str,
) -> HttpResponse {
    if let Some(refused) = sim.check(&req, &body) {
        return refused;
    }
    let verdict = sim.verdict(Op::Prepay, &req);
    if let Verdict::Before(a) = &verdict {
        return sim.fault(a);
    }
    let Ok(b) = serde_json::from_slice::<Value>(&body) else {
        return sim.error(400, "PARAM_ERROR", "a body not JSON");
    };
    let (Some(no), Some(amount), Some(notify)) = (
        b["out_trade_no"].as_str(),
        b["amount"]["total"].as_i64(),
        b["notify_url"].as_str(),
    ) else {
        return sim.error(
            400,
            "PARAM_ERROR",
            "out_trade_no, amount.total and notify_url are required",
        );
    };
    let openid = b["payer"]["openid"].as_str().map(str::to_owned);
    if trade_type == "JSAPI" && openid.as_deref().is_none_or(str::is_empty) {
        return sim.error(400, "PARAM_ERROR", "payer.openid is required");
    }
    if b["mchid"] != json!(sim.mchid) {
        return sim.error(400, "MCH_NOT_EXISTS", "another mchid");
    }
    let expires = b["time_expire"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok());
    let answer = {
        let mut trades = sim.trades.lock().unwrap();
        let trade = trades.entry(no.to_owned()).or_insert_with(|| Trade {
            out_trade_no: no.to_owned(),
            amount,
            body: b.clone(),
            notify_url: notify.to_owned(),
            code_url: format!("weixin://wxpay/bizpayurl?pr={}", random(10)),
            state: "NOTPAY",
            transaction_id: None,
            success_time: None,
            creates: 0,
            trade_type,
            openid: openid.clone(),
            prepay_id: format!("wx{}", random(30)),
            expires,
        });
        trade.creates += 1;
        if trade.amount != amount || trade.body != b {
            Err((
                400,
                "INVALID_REQUEST",
                "out_trade_no used with other parameters",
            ))
        } else {
            match (trade.state, trade_type) {
                ("CLOSED", _) => Err((400, "ORDER_CLOSED", "the trade is closed")),
                ("SUCCESS" | "REFUND", _) => Err((400, "ORDERPAID", "the trade is paid")),
                (_, "JSAPI") => Ok(json!({"prepay_id": trade.prepay_id})),
                _ => Ok(json!({"code_url": trade.code_url})),
            }
        }
    };
    let answer = match answer {
        Ok(answer) => answer,
        Err((status, code, message)) => return sim.error(status, code, message),
    };
    let answer = sim.answer(200, Some(answer));
    sim.after_work(verdict, answer).await
}

async fn native(sim: web::Data<Sim>, req: HttpRequest, body: web::Bytes) -> HttpResponse {
    prepay(sim, req, body, "NATIVE").await
}

async fn jsapi(sim: web::Data<Sim>, req: HttpRequest, body: web::Bytes) -> HttpResponse {
    prepay(sim, req, body, "JSAPI").await
}

async fn query(sim: web::Data<Sim>, req: HttpRequest, path: web::Path<String>) -> HttpResponse {
    if let Some(refused) = sim.check(&req, b"") {
        return refused;
    }
    let verdict = sim.verdict(Op::Query, &req);
    if let Verdict::Before(a) = &verdict {
        return sim.fault(a);
    }
    let body = sim
        .trades
        .lock()
        .unwrap()
        .get(path.as_str())
        .map(|t| sim.transaction(t));
    let answer = match body {
        Some(body) => sim.answer(200, Some(body)),
        None => sim.error(404, "ORDER_NOT_EXIST", "no such trade"),
    };
    sim.after_work(verdict, answer).await
}

async fn close(
    sim: web::Data<Sim>,
    req: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    if let Some(refused) = sim.check(&req, &body) {
        return refused;
    }
    let verdict = sim.verdict(Op::Close, &req);
    if let Verdict::Before(a) = &verdict {
        return sim.fault(a);
    }
    let state = match sim.trades.lock().unwrap().get_mut(path.as_str()) {
        None => None,
        // A failed charge can still be paid until the trade is closed.
        Some(t) if t.state == "NOTPAY" || t.state == "PAYERROR" => {
            t.state = "CLOSED";
            Some("CLOSED")
        }
        Some(t) => Some(t.state),
    };
    let answer = match state {
        None => sim.error(404, "ORDER_NOT_EXIST", "no such trade"),
        Some("SUCCESS" | "REFUND") => sim.error(400, "ORDERPAID", "the trade is paid"),
        Some(_) => sim.answer(204, None),
    };
    sim.after_work(verdict, answer).await
}

async fn refund(sim: web::Data<Sim>, req: HttpRequest, body: web::Bytes) -> HttpResponse {
    if let Some(refused) = sim.check(&req, &body) {
        return refused;
    }
    let verdict = sim.verdict(Op::Refund, &req);
    if let Verdict::Before(a) = &verdict {
        return sim.fault(a);
    }
    let Ok(b) = serde_json::from_slice::<Value>(&body) else {
        return sim.error(400, "PARAM_ERROR", "a body not JSON");
    };
    let (Some(no), Some(trade_no), Some(amount), Some(total)) = (
        b["out_refund_no"].as_str(),
        b["out_trade_no"].as_str(),
        b["amount"]["refund"].as_i64(),
        b["amount"]["total"].as_i64(),
    ) else {
        return sim.error(
            400,
            "PARAM_ERROR",
            "out_refund_no, out_trade_no and amount are required",
        );
    };
    let known = sim.refunds.lock().unwrap().contains_key(no);
    if !known {
        let mut trades = sim.trades.lock().unwrap();
        let Some(t) = trades.get_mut(trade_no) else {
            drop(trades);
            return sim.error(404, "RESOURCE_NOT_EXISTS", "no such trade");
        };
        if t.state != "SUCCESS" && t.state != "REFUND" {
            drop(trades);
            return sim.error(400, "INVALID_REQUEST", "the trade is not paid");
        }
        if total != t.amount || amount > total || amount <= 0 {
            drop(trades);
            return sim.error(
                400,
                "PARAM_ERROR",
                "amount.total is not the trade's, or the refund exceeds it",
            );
        }
        t.state = "REFUND";
    }
    let (body, created) = {
        let mut refunds = sim.refunds.lock().unwrap();
        let mut created = false;
        let r = refunds.entry(no.to_owned()).or_insert_with(|| {
            created = true;
            Refund {
                out_refund_no: no.to_owned(),
                out_trade_no: trade_no.to_owned(),
                refund_id: format!("50{}", random(26)),
                amount,
                total,
                status: "PROCESSING",
                notify_url: b["notify_url"].as_str().unwrap_or_default().to_owned(),
                creates: 0,
            }
        });
        r.creates += 1;
        let r = &*r;
        (sim.refund_json(r), created)
    };
    if created {
        let sim = sim.clone().into_inner();
        let no = no.to_owned();
        let (early, wait) = sim.plan.lock().unwrap().refund_timing();
        if early {
            // Settled at once, and its callback sent before this answer:
            // the answer's PROCESSING arrives after the callback's SUCCESS.
            sim.settle_refund(&no, "SUCCESS", false).await;
        } else {
            // The money arrives later, and the refund callback says so.
            actix_web::rt::spawn(async move {
                if let Some(ms) = wait {
                    actix_web::rt::time::sleep(std::time::Duration::from_millis(ms)).await;
                    sim.settle_refund(&no, "SUCCESS", false).await;
                }
            });
        }
    }
    let answer = sim.answer(200, Some(body));
    sim.after_work(verdict, answer).await
}

async fn query_refund(
    sim: web::Data<Sim>,
    req: HttpRequest,
    path: web::Path<String>,
) -> HttpResponse {
    if let Some(refused) = sim.check(&req, b"") {
        return refused;
    }
    let verdict = sim.verdict(Op::QueryRefund, &req);
    if let Verdict::Before(a) = &verdict {
        return sim.fault(a);
    }
    let body = sim
        .refunds
        .lock()
        .unwrap()
        .get(path.as_str())
        .map(|r| sim.refund_json(r));
    let answer = match body {
        Some(body) => sim.answer(200, Some(body)),
        None => sim.error(404, "RESOURCE_NOT_EXISTS", "no such refund"),
    };
    sim.after_work(verdict, answer).await
}

async fn sim_pay(
    sim: web::Data<Sim>,
    path: web::Path<String>,
    body: web::Json<Value>,
) -> HttpResponse {
    let outcome = match body["outcome"].as_str() {
        Some("PAYERROR") => "PAYERROR",
        _ => "SUCCESS",
    };
    {
        let mut trades = sim.trades.lock().unwrap();
        let Some(t) = trades.get_mut(path.as_str()) else {
            return HttpResponse::NotFound().json(json!({"error": "no such trade"}));
        };
        if t.state != "NOTPAY" && t.state != "PAYERROR" {
            return HttpResponse::Conflict()
                .json(json!({"error": format!("the trade is {}", t.state)}));
        }
        if t.expires.is_some_and(|at| at < Utc::now()) {
            return HttpResponse::Conflict()
                .json(json!({"error": "the trade is past its time_expire"}));
        }
        t.state = outcome;
        if outcome == "SUCCESS" {
            t.transaction_id = Some(format!("42{}", random(26)));
            t.success_time = Some(china_now());
        }
    }
    if outcome != "SUCCESS" {
        // WeChat Pay notifies successful payments only.
        return HttpResponse::Ok().json(json!({"statuses": []}));
    }
    if body.get("times").is_none() && body.get("deliver").is_none() {
        // As the delivery plan says, in the background.
        if let Some(notice) = sim.payment_callback(path.as_str(), None) {
            actix_web::rt::spawn(deliver::send(sim.clone().into_inner(), notice));
        }
        return HttpResponse::Ok().json(json!({"statuses": []}));
    }
    let times = body["times"].as_u64().unwrap_or(1);
    let deliver = body["deliver"].as_bool().unwrap_or(true);
    let mut statuses = Vec::new();
    if deliver {
        for _ in 0..times {
            if let Some((status, _)) = sim.deliver(path.as_str(), None).await {
                statuses.push(status);
            }
        }
    }
    HttpResponse::Ok().json(json!({"statuses": statuses}))
}

async fn sim_refund_settle(
    sim: web::Data<Sim>,
    path: web::Path<String>,
    body: web::Json<Value>,
) -> HttpResponse {
    let status = match body["status"].as_str() {
        Some("ABNORMAL") => "ABNORMAL",
        Some("CLOSED") => "CLOSED",
        _ => "SUCCESS",
    };
    let force = body["force"].as_bool().unwrap_or(false);
    let sim = sim.into_inner();
    if sim.settle_refund(path.as_str(), status, force).await {
        HttpResponse::Ok().json(json!({"status": status}))
    } else {
        HttpResponse::Conflict().json(json!({"error": "no such refund PROCESSING"}))
    }
}

async fn sim_script(sim: web::Data<Sim>, body: web::Json<faults::Scripted>) -> HttpResponse {
    sim.faults.script(body.into_inner());
    HttpResponse::Ok().json(json!({}))
}

async fn sim_faults(sim: web::Data<Sim>, body: web::Json<faults::Rates>) -> HttpResponse {
    sim.faults.set_rates(body.into_inner());
    HttpResponse::Ok().json(json!({}))
}

async fn sim_callbacks(sim: web::Data<Sim>, body: web::Json<deliver::Plan>) -> HttpResponse {
    *sim.plan.lock().unwrap() = body.into_inner();
    HttpResponse::Ok().json(json!({}))
}

async fn sim_deliver(
    sim: web::Data<Sim>,
    path: web::Path<String>,
    body: web::Json<Value>,
) -> HttpResponse {
    match sim.deliver(path.as_str(), body["tamper"].as_str()).await {
        Some((status, body)) => HttpResponse::Ok().json(json!({"status": status, "body": body})),
        None => HttpResponse::NotFound().json(json!({"error": "no such trade"})),
    }
}

async fn sim_sign_with(sim: web::Data<Sim>, body: web::Json<Value>) -> HttpResponse {
    let serial = body["serial"].as_str().unwrap_or_default();
    match sim.signers.iter().position(|(s, _)| s == serial) {
        Some(i) => {
            *sim.current.lock().unwrap() = i;
            HttpResponse::Ok().json(json!({"serial": serial}))
        }
        None => HttpResponse::NotFound().json(json!({"error": "no such key"})),
    }
}

async fn sim_refund_callbacks(sim: web::Data<Sim>, body: web::Json<Value>) -> HttpResponse {
    *sim.refund_callbacks.lock().unwrap() = body["deliver"].as_bool().unwrap_or(true);
    HttpResponse::Ok().json(json!({}))
}

/// `GET /v3/bill/tradebill?bill_date=`: where the day's trade bill is,
/// and its SHA-1.
async fn trade_bill(sim: web::Data<Sim>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = sim.check(&req, b"") {
        return refused;
    }
    let query = req.query_string();
    let Some(date) = query
        .split('&')
        .find_map(|p| p.strip_prefix("bill_date="))
        .map(str::to_owned)
    else {
        return sim.error(400, "PARAM_ERROR", "bill_date is required");
    };
    let file = sim.bill(&date);
    use sha1::Digest;
    let hash = hex::encode(sha1::Sha1::digest(file.as_bytes()));
    sim.answer(
        200,
        Some(json!({
            "hash_type": "SHA1",
            "hash_value": hash,
            "download_url": format!("https://api.mch.weixin.qq.com/v3/billdownload/file?token={date}"),
        })),
    )
}

/// `GET /v3/billdownload/file?token=`: the bill itself (not signed).
async fn bill_file(sim: web::Data<Sim>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = sim.check(&req, b"") {
        return refused;
    }
    let date = req
        .query_string()
        .split('&')
        .find_map(|p| p.strip_prefix("token="))
        .unwrap_or_default()
        .to_owned();
    HttpResponse::Ok()
        .content_type("text/plain; charset=utf-8")
        .body(sim.bill(&date))
}

/// `POST /sim/plant` `{"out_trade_no", "amount", "appid"}`: a paid trade
/// the merchant never asked for, or a paid trade's amount changed.
async fn sim_plant(sim: web::Data<Sim>, body: web::Json<Value>) -> HttpResponse {
    let (Some(no), Some(amount)) = (body["out_trade_no"].as_str(), body["amount"].as_i64()) else {
        return HttpResponse::BadRequest().finish();
    };
    let mut trades = sim.trades.lock().unwrap();
    let t = trades.entry(no.to_owned()).or_insert_with(|| Trade {
        out_trade_no: no.to_owned(),
        amount,
        body: json!({"appid": body["appid"]}),
        notify_url: String::new(),
        code_url: String::new(),
        state: "SUCCESS",
        transaction_id: Some(format!("42{}", random(26))),
        success_time: Some(china_now()),
        creates: 0,
        trade_type: "NATIVE",
        openid: None,
        prepay_id: String::new(),
        expires: None,
    });
    t.amount = amount;
    HttpResponse::Ok().json(json!({}))
}

/// `POST /sim/forget/{out_trade_no}`: the trade is gone from the platform.
async fn sim_forget(sim: web::Data<Sim>, path: web::Path<String>) -> HttpResponse {
    sim.trades.lock().unwrap().remove(path.as_str());
    HttpResponse::Ok().json(json!({}))
}

async fn sim_notify_to(sim: web::Data<Sim>, body: web::Json<Value>) -> HttpResponse {
    *sim.notify_to.lock().unwrap() = body["url"].as_str().map(str::to_owned);
    HttpResponse::Ok().json(json!({}))
}

async fn sim_state(sim: web::Data<Sim>, req: HttpRequest) -> HttpResponse {
    let trades: Vec<Value> = sim
        .trades
        .lock()
        .unwrap()
        .values()
        .map(|t| json!({"out_trade_no": t.out_trade_no, "state": t.state, "amount": t.amount, "creates": t.creates, "code_url": t.code_url, "notify_url": t.notify_url, "success_time": t.success_time, "trade_type": t.trade_type, "openid": t.openid, "prepay_id": t.prepay_id}))
        .collect();
    let refunds: Vec<Value> = sim
        .refunds
        .lock()
        .unwrap()
        .values()
        .map(|r| json!({"out_refund_no": r.out_refund_no, "out_trade_no": r.out_trade_no, "status": r.status, "amount": r.amount, "creates": r.creates}))
        .collect();
    let requests = if req.query_string().contains("requests=false") {
        Vec::new()
    } else {
        sim.requests.lock().unwrap().clone()
    };
    let faults = sim.faults.given.lock().unwrap().clone();
    let deliveries = sim.plan.lock().unwrap().given();
    HttpResponse::Ok().json(json!({"trades": trades, "refunds": refunds, "requests": requests, "faults": faults, "deliveries": deliveries}))
}

fn platform_key(dir: &str, serial: &str) -> MerchantSigner {
    let key = rsa::PrivateKey::generate();
    let public = key
        .to_public_key()
        .to_public_key_pem(LineEnding::LF)
        .expect("an SPKI PEM");
    std::fs::write(format!("{dir}/{serial}.pem"), public).expect("the key directory is writable");
    let private = key.to_pkcs8_pem(LineEnding::LF).expect("a PKCS#8 PEM");
    MerchantSigner::from_pem("platform", serial, &private).expect("its own key")
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = arg(&args, "--platform-key-dir");
    std::fs::create_dir_all(&dir)?;
    let mut merchant = PlatformKeys::default();
    let pem = std::fs::read_to_string(arg(&args, "--merchant-public-key"))?;
    merchant
        .add_pem(&arg(&args, "--merchant-serial"), &pem)
        .expect("the merchant's public key");
    let serials = [
        format!("PUB_KEY_ID_{}", random(8)),
        format!("PUB_KEY_ID_{}", random(8)),
    ];
    let signers = serials
        .iter()
        .map(|s| (s.clone(), platform_key(&dir, s)))
        .collect();
    let sim = web::Data::new(Sim {
        mchid: arg(&args, "--mchid"),
        merchant,
        signers,
        current: Mutex::new(0),
        cipher: ApiV3Cipher::new(arg(&args, "--apiv3-key").as_bytes())
            .expect("a 32-byte APIv3 key"),
        trades: Mutex::default(),
        refunds: Mutex::default(),
        requests: Mutex::default(),
        refund_callbacks: Mutex::new(true),
        notify_to: Mutex::default(),
        faults: Faults::default(),
        plan: Mutex::default(),
        http: reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .expect("an HTTP client"),
    });
    let server = HttpServer::new({
        let sim = sim.clone();
        move || {
            App::new()
                .app_data(sim.clone())
                .route("/v3/pay/transactions/native", web::post().to(native))
                .route("/v3/pay/transactions/jsapi", web::post().to(jsapi))
                .route(
                    "/v3/pay/transactions/out-trade-no/{no}",
                    web::get().to(query),
                )
                .route(
                    "/v3/pay/transactions/out-trade-no/{no}/close",
                    web::post().to(close),
                )
                .route("/v3/refund/domestic/refunds", web::post().to(refund))
                .route(
                    "/v3/refund/domestic/refunds/{no}",
                    web::get().to(query_refund),
                )
                .route("/sim/pay/{no}", web::post().to(sim_pay))
                .route("/sim/deliver/{no}", web::post().to(sim_deliver))
                .route("/sim/sign-with", web::post().to(sim_sign_with))
                .route(
                    "/sim/refund-callbacks",
                    web::post().to(sim_refund_callbacks),
                )
                .route("/v3/bill/tradebill", web::get().to(trade_bill))
                .route("/v3/billdownload/file", web::get().to(bill_file))
                .route("/sim/plant", web::post().to(sim_plant))
                .route("/sim/forget/{no}", web::post().to(sim_forget))
                .route("/sim/notify-to", web::post().to(sim_notify_to))
                .route("/sim/state", web::get().to(sim_state))
                .route("/sim/script", web::post().to(sim_script))
                .route("/sim/faults", web::post().to(sim_faults))
                .route("/sim/callbacks", web::post().to(sim_callbacks))
                .route("/sim/refund-settle/{no}", web::post().to(sim_refund_settle))
        }
    })
    .workers(2)
    .bind("127.0.0.1:0")?;
    let addr = server.addrs()[0];
    println!(
        "{}",
        json!({"url": format!("http://{addr}"), "serials": serials})
    );
    server.run().await
}

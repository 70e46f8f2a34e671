use super::bill::fen;
use super::*;

#[test]
fn a_trade_bill_yields_its_successful_charges_in_fen() {
    let bill = "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率,订单金额,申请退款金额,费率备注\n\
`2026-12-04 10:00:00,`wx1,`1900000001,`0,`,`4200001,`101,`o1,`NATIVE,`SUCCESS,`OTHERS,`CNY,`99.00,`0.00,`0,`0,`0.00,`0.00,`,`,`Phone, black,`,`0.59000,`0.60%,`99.00,`0.00,`\n\
`2026-12-04 11:00:00,`wx1,`1900000001,`0,`,`4200002,`102,`o2,`NATIVE,`REFUND,`OTHERS,`CNY,`0.00,`0.00,`5000001,`9001,`99.00,`0.00,`ORIGINAL,`SUCCESS,`Phone,`,`-0.59000,`0.60%,`0.00,`99.00,`\n\
`2026-12-04 12:00:00,`wx1,`1900000001,`0,`,`4200003,`103,`o3,`NATIVE,`SUCCESS,`OTHERS,`CNY,`0.5,`0.00,`0,`0,`0.00,`0.00,`,`,`Case,`,`0.00000,`0.60%,`0.5,`0.00,`\n\
总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\n\
`2,`99.50,`99.00,`0.00,`0.59000,`99.50,`99.00\n";
    let lines = parse_trade_bill(bill).unwrap();
    assert_eq!(
        lines,
        [
            StatementLine {
                reference: "101".into(),
                txn_id: Some("4200001".into()),
                amount_cents: 9900
            },
            StatementLine {
                reference: "103".into(),
                txn_id: Some("4200003".into()),
                amount_cents: 50
            },
        ],
        "a comma inside a field is no separator; REFUND rows are not charges"
    );
    assert!(parse_trade_bill("").is_err());
    assert!(parse_trade_bill("a,b\n`1,`2\n").is_err());
    assert_eq!(fen("12.3"), Some(1230));
    assert_eq!(fen("7"), Some(700));
    assert_eq!(fen("1.234"), None);
    assert_eq!(fen("x.00"), None);
}

/// A platform that answers every request with the answer `reply`
/// makes of the time: `(status, body, signed at)`, signed with
/// `platform` unless the time is `None`.
fn canned(
    platform: MerchantSigner,
    reply: impl Fn(i64) -> (u16, String, Option<i64>) + Send + 'static,
) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut buf = [0u8; 16384];
            let _ = stream.read(&mut buf);
            let (status, body, signed_at) = reply(Utc::now().timestamp());
            let mut head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            if let Some(ts) = signed_at {
                let nonce = "n0nce";
                let signature = platform.sign(&crypto::response_message(
                    &ts.to_string(),
                    nonce,
                    body.as_bytes(),
                ));
                head.push_str(&format!(
                    "wechatpay-timestamp: {ts}\r\nwechatpay-nonce: {nonce}\r\nwechatpay-serial: PLATFORM-1\r\nwechatpay-signature: {signature}\r\n"
                ));
            }
            let _ = write!(stream, "{head}\r\n{body}");
        }
    });
    url
}

/// The adapter of merchant `1900000001`, app `wx1`, against `url`,
/// trusting the platform key `PLATFORM-1`: (adapter, that key's signer).
fn adapter_and_platform() -> (impl FnOnce(String) -> WechatPay, MerchantSigner) {
    use rsa::Generate;
    use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
    let dir = std::env::temp_dir().join(format!("seckill-wx-unit-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("platform")).unwrap();
    let merchant = rsa::PrivateKey::generate();
    std::fs::write(
        dir.join("merchant.pem"),
        merchant.to_pkcs8_pem(LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    let platform = rsa::PrivateKey::generate();
    std::fs::write(
        dir.join("platform/PLATFORM-1.pem"),
        platform
            .to_public_key()
            .to_public_key_pem(LineEnding::LF)
            .unwrap(),
    )
    .unwrap();
    let signer = MerchantSigner::from_pem(
        "platform",
        "PLATFORM-1",
        &platform.to_pkcs8_pem(LineEnding::LF).unwrap(),
    )
    .unwrap();
    let build = move |url: String| {
        let settings = WechatPaySettings {
            base_url: url,
            mchid: "1900000001".into(),
            appid: "wx1".into(),
            merchant_serial: "M1".into(),
            merchant_key_file: dir.join("merchant.pem").display().to_string(),
            apiv3_key: secrecy::SecretString::from("k".repeat(32)),
            platform_key_dir: dir.join("platform").display().to_string(),
            notify_url: "https://shop.example/n".into(),
            trade_type: TradeType::Native,
            openid_claim: None,
        };
        let adapter = WechatPay::from_settings(&settings, Duration::from_secs(5), 300).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        adapter
    };
    (build, signer)
}

fn paid_trade(mchid: &str) -> String {
    json!({
        "mchid": mchid, "appid": "wx1", "out_trade_no": "101",
        "transaction_id": "4200001", "trade_state": "SUCCESS",
        "amount": {"total": 9900, "currency": "CNY"},
    })
    .to_string()
}

/// Only WeChat Pay's signed, fresh word counts: an unsigned "no such
/// trade" (which would close a payment), an answer signed an hour ago
/// (a replay), or a trade of another merchant are no answer at all.
#[tokio::test]
async fn an_unsigned_stale_or_foreign_answer_is_no_answer() {
    let (build, platform) = adapter_and_platform();
    let not_exist = json!({"code": "ORDER_NOT_EXIST", "message": "no"}).to_string();
    let script: std::sync::Arc<std::sync::Mutex<Vec<(u16, String, i64)>>> =
        std::sync::Arc::default();
    let next = script.clone();
    let url = canned(platform, move |now| {
        let (status, body, age) = next.lock().unwrap().remove(0);
        let signed = (age >= 0).then_some(now - age);
        (status, body, signed)
    });
    let wechat = build(url);
    let payment = PaymentRef {
        payment_no: 101,
        provider_ref: None,
    };
    let mut answers = Vec::new();
    for (status, body, age) in [
        (404, not_exist.clone(), -1),
        (404, not_exist.clone(), 3600),
        (404, not_exist.clone(), 0),
    ] {
        script.lock().unwrap().push((status, body, age));
        answers.push(wechat.close(&payment).await.map_err(|e| e.label()));
    }
    assert_eq!(
        answers,
        [Err("unknown"), Err("unknown"), Ok(CloseOutcome::Closed)],
        "unsigned, stale, then genuine"
    );
    let mut queried = Vec::new();
    for (body, age) in [
        (paid_trade("1900000001"), 3600),
        (paid_trade("1900009999"), 0),
        (paid_trade("1900000001"), 0),
    ] {
        script.lock().unwrap().push((200, body, age));
        queried.push(
            wechat
                .query(&payment)
                .await
                .map(|c| c.outcome)
                .map_err(|e| e.label()),
        );
    }
    assert_eq!(
        queried,
        [Err("unknown"), Err("unknown"), Ok(ChargeOutcome::Paid)],
        "stale, another merchant's, then genuine"
    );
    for (status, code, class) in [
        (429, "FREQUENCY_LIMITED", "retry"),
        (403, "NOT_ENOUGH", "retry"),
        (500, "SYSTEM_ERROR", "unknown"),
        (403, "USER_ACCOUNT_ABNORMAL", "refused"),
    ] {
        let body = json!({"code": code, "message": "m"}).to_string();
        script.lock().unwrap().push((status, body, 0));
        let refund = RefundRequest {
            refund_no: 7,
            payment: payment.clone(),
            amount_cents: 9900,
            total_cents: 9900,
            reason: "r".into(),
        };
        assert_eq!(
            wechat.refund(&refund).await.map_err(|e| e.label()).err(),
            Some(class),
            "{status} {code}"
        );
    }
}

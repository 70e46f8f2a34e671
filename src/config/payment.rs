//! `[payment]`: which provider pay intents go to, and how pending payments
//! and refunds are followed up (docs/PAYMENTS.md).

use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::duration;

/// The payment provider.
#[derive(Debug, Clone, Deserialize)]
pub struct PaymentSettings {
    /// Where pay intents go. Unset: `mock` when `payment.mock` is true,
    /// else `external`.
    #[serde(default)]
    pub provider: Option<ProviderKind>,
    /// The built-in mock provider (and `/api/v1/dev/payments/...`), when
    /// `provider` is unset.
    pub mock: bool,
    /// Shared HMAC-SHA256 secret of `X-Pay-Signature` (the mock and
    /// `external` providers).
    pub notify_secret: SecretString,
    /// Largest accepted |now − t| of a signed callback, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub signature_tolerance_secs: Duration,
    /// A PENDING payment whose callback has not come this long after it
    /// was created is queried at the provider, in seconds.
    #[serde(default = "query_after", deserialize_with = "duration::secs")]
    pub query_after_secs: Duration,
    /// Pause between the payment sweeper's rounds (closes at the
    /// provider, late queries, refunds), in milliseconds.
    #[serde(default = "sweep_interval", deserialize_with = "duration::millis")]
    pub sweep_interval_ms: Duration,
    /// Longest wait for one answer of the provider, in milliseconds. An
    /// unanswered call is an unknown outcome: repeated, never undone.
    #[serde(default = "provider_timeout", deserialize_with = "duration::millis")]
    pub provider_timeout_ms: Duration,
    /// Longest pause between two attempts of the same close, query or
    /// refund (they back off from 1 s), in seconds.
    #[serde(default = "retry_max", deserialize_with = "duration::secs")]
    pub retry_max_secs: Duration,
    /// Run the payment sweeper inside `serve`.
    #[serde(default = "yes")]
    pub sweeper_enabled: bool,
    /// WeChat Pay API v3 (`provider = "wechatpay"`).
    #[serde(default)]
    pub wechatpay: Option<WechatPaySettings>,
    /// A Stripe account (`provider = "stripe"`).
    #[serde(default)]
    pub stripe: Option<StripeSettings>,
}

/// A Stripe account (or a Stripe-style server such as localstripe).
#[derive(Debug, Clone, Deserialize)]
pub struct StripeSettings {
    /// `https://api.stripe.com`, or a Stripe-style server's address.
    #[serde(default = "stripe_api_base")]
    pub api_base: String,
    /// The secret API key (`sk_…`).
    pub secret_key: SecretString,
    /// The webhook endpoint's signing secret (`whsec_…`).
    pub webhook_secret: SecretString,
    /// The secret before it, accepted too while a rotation lasts.
    #[serde(default)]
    pub previous_webhook_secret: Option<SecretString>,
    /// The currency of the intents (ISO 4217, lower case); amounts are in
    /// its smallest unit, as `amount_cents`.
    #[serde(default = "stripe_currency")]
    pub currency: String,
}

fn stripe_api_base() -> String {
    "https://api.stripe.com".into()
}

fn stripe_currency() -> String {
    "cny".into()
}

/// The providers pay intents can go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Built in, for development: callbacks signed with
    /// `payment.notify_secret`, sent by `/api/v1/dev/payments/…/simulate`.
    Mock,
    /// A provider that signs its callbacks with `X-Pay-Signature` and has
    /// no API this server calls.
    External,
    /// WeChat Pay API v3.
    Wechatpay,
    /// A Stripe-style provider.
    Stripe,
}

impl ProviderKind {
    /// Its name in `payments.provider` and in answers.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Mock => "mock",
            Self::External => "external",
            Self::Wechatpay => "wechatpay",
            Self::Stripe => "stripe",
        }
    }
}

/// A merchant account of WeChat Pay API v3.
#[derive(Debug, Clone, Deserialize)]
pub struct WechatPaySettings {
    /// `https://api.mch.weixin.qq.com`, or a simulator's address.
    #[serde(default = "wechatpay_base_url")]
    pub base_url: String,
    /// The merchant id (`mchid`).
    pub mchid: String,
    /// The app id the payments are made under (`appid`).
    pub appid: String,
    /// The serial number of the merchant API certificate.
    pub merchant_serial: String,
    /// The merchant API private key (`apiclient_key.pem`, PKCS#8 PEM).
    pub merchant_key_file: String,
    /// The APIv3 key (32 bytes): callbacks' resources are encrypted with it.
    pub apiv3_key: SecretString,
    /// A directory of WeChat Pay's public keys, one `<serial>.pem` each
    /// (SPKI PEM: a platform certificate's key, or the "WeChat Pay public
    /// key"). All of them verify answers and callbacks, chosen by
    /// `Wechatpay-Serial`, so a new key can be added before the old one
    /// goes (rotation).
    pub platform_key_dir: String,
    /// Where WeChat Pay sends callbacks: this server's
    /// `/api/v1/payments/notify/wechatpay` as the internet reaches it.
    pub notify_url: String,
    /// How buyers pay: `native` (a QR code the buyer scans) or `jsapi`
    /// (inside WeChat: a mini-program's `wx.requestPayment`, as the buyer's
    /// `openid`).
    #[serde(default)]
    pub trade_type: TradeType,
    /// JSAPI: the claim of the buyer's identity token that carries their
    /// WeChat `openid`. Unset, or absent from a token: the pay request's
    /// body gives it.
    #[serde(default)]
    pub openid_claim: Option<String>,
}

/// How a WeChat Pay buyer pays.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TradeType {
    /// `/v3/pay/transactions/native`: a `code_url` shown as a QR code.
    #[default]
    Native,
    /// `/v3/pay/transactions/jsapi`: the parameters of `wx.requestPayment`.
    Jsapi,
}

fn query_after() -> Duration {
    Duration::from_secs(60)
}

fn sweep_interval() -> Duration {
    Duration::from_secs(1)
}

fn provider_timeout() -> Duration {
    Duration::from_secs(10)
}

fn retry_max() -> Duration {
    Duration::from_secs(300)
}

fn yes() -> bool {
    true
}

fn wechatpay_base_url() -> String {
    "https://api.mch.weixin.qq.com".into()
}

impl PaymentSettings {
    /// The provider pay intents go to.
    pub fn kind(&self) -> ProviderKind {
        self.provider.unwrap_or(if self.mock {
            ProviderKind::Mock
        } else {
            ProviderKind::External
        })
    }
}

//! The payment provider boundary (docs/PAYMENTS.md): what this server asks
//! of a provider, and the one shape every provider's callback is turned
//! into before it touches an order.
//!
//! Every call is idempotent at the provider: a payment is created under our
//! payment number, a refund under our refund number. So a call whose answer
//! never came ([`ProviderError::Unknown`]) is simply made again, and never
//! undone on our side.

use chrono::{DateTime, Utc};
use futures_util::future::{BoxFuture, FutureExt};

pub mod exchange;
pub mod mock;

pub use mock::{Callback, SignedProvider};

/// A payment to create at the provider.
#[derive(Debug, Clone)]
pub struct NewPayment {
    /// Ours; the provider's idempotency key (WeChat Pay's `out_trade_no`).
    pub payment_no: i64,
    pub order_no: i64,
    pub amount_cents: i64,
    /// What the buyer sees on the provider's page.
    pub description: String,
    /// After this the provider refuses to take the money (the order's
    /// payment deadline).
    pub expires_at: Option<DateTime<Utc>>,
    /// The buyer's WeChat `openid` (WeChat Pay JSAPI pays as this payer).
    pub payer_openid: Option<String>,
}

/// A payment as the provider knows it: our number, and its own id when it
/// gives one (Stripe's PaymentIntent id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRef {
    pub payment_no: i64,
    pub provider_ref: Option<String>,
}

/// A refund as the provider knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundRef {
    pub refund_no: i64,
    pub payment: PaymentRef,
    /// Its own id of the refund, once it answered.
    pub provider_refund_id: Option<String>,
}

/// What the buyer's client needs to pay, as the provider answered it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Checkout {
    /// WeChat Pay Native: the URL the buyer's phone scans (as a QR code).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code_url: Option<String>,
    /// Stripe: the PaymentIntent's client secret.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
    /// WeChat Pay JSAPI: exactly what the mini-program's
    /// `wx.requestPayment` takes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jsapi: Option<JsapiPayment>,
    /// The provider's own id of the payment (kept in
    /// `payments.provider_ref`, not shown).
    #[serde(skip)]
    pub provider_ref: Option<String>,
}

/// The parameters of `wx.requestPayment` for one WeChat Pay JSAPI
/// payment (field names as the mini-program API spells them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct JsapiPayment {
    #[serde(rename = "appId")]
    pub app_id: String,
    /// Unix seconds, as a string.
    #[serde(rename = "timeStamp")]
    pub time_stamp: String,
    #[serde(rename = "nonceStr")]
    pub nonce_str: String,
    /// `prepay_id=<id>`.
    pub package: String,
    /// `RSA`.
    #[serde(rename = "signType")]
    pub sign_type: String,
    /// The merchant key's RSA-SHA256 (Base64) over
    /// `appId\ntimeStamp\nnonceStr\npackage\n`.
    #[serde(rename = "paySign")]
    pub pay_sign: String,
}

/// A charge as the provider reports it (callback or query), normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub payment_no: i64,
    /// Only the mock's and `external` callbacks carry it; checked when set.
    pub order_no: Option<i64>,
    /// What the provider says was charged, in cents.
    pub amount_cents: i64,
    pub outcome: ChargeOutcome,
    /// The provider's transaction id.
    pub txn_id: Option<String>,
    pub paid_at: Option<DateTime<Utc>>,
    /// The provider's own id of the payment, where it has one (a Stripe
    /// PaymentIntent): it must be the one recorded for our payment.
    pub provider_ref: Option<String>,
}

impl Charge {
    /// A report with nothing charged: where `payment_no` stands when the
    /// provider has no more to say (not paid, closed).
    pub fn bare(payment_no: i64, outcome: ChargeOutcome) -> Self {
        Self {
            payment_no,
            order_no: None,
            amount_cents: 0,
            outcome,
            txn_id: None,
            paid_at: None,
            provider_ref: None,
        }
    }
}

/// Where a charge stands at the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// The money was taken.
    Paid,
    /// The charge failed; the buyer may try again.
    Failed,
    /// Not paid yet.
    NotPaid,
    /// Closed at the provider: it will never be paid.
    Closed,
}

/// A refund as the provider reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundReport {
    pub refund_no: i64,
    pub provider_refund_id: Option<String>,
    pub state: RefundState,
}

/// Where a refund stands at the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefundState {
    /// Accepted, not done yet: a callback or a query will tell.
    Processing,
    /// The money is back with the buyer.
    Succeeded,
    /// Refused or closed for good, with the provider's reason.
    Failed(String),
}

/// A verified callback, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Charge(Charge),
    Refund(RefundReport),
    /// A kind of event this server does not act on (acknowledged, so that
    /// the provider stops sending it).
    Ignored(String),
}

/// A refund to send.
#[derive(Debug, Clone)]
pub struct RefundRequest {
    /// Ours; the provider's idempotency key (`out_refund_no`).
    pub refund_no: i64,
    pub payment: PaymentRef,
    /// How much goes back, and what the payment was.
    pub amount_cents: i64,
    pub total_cents: i64,
    pub reason: String,
}

/// What closing a payment at the provider found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseOutcome {
    /// Closed (or never existed there): it can no longer be paid.
    Closed,
    /// The buyer paid first: query it, and take the late-payment way.
    AlreadyPaid,
}

/// Why a call to the provider did not give an answer to act on. Each
/// provider maps its documented error codes onto these three
/// (docs/PAYMENTS.md, "What each answer means"): only a provider's
/// definite, documented "never" is final.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// No answer, or one that cannot be trusted (a timeout, a 5xx, an
    /// unsigned or stale answer): the effect may have happened. Repeat the
    /// same call later.
    #[error("provider outcome unknown: {0}")]
    Unknown(String),
    /// A definite "not now" that the provider documents as worth repeating
    /// (rate limited, the merchant's balance short, a permission not yet
    /// granted): nothing was done. The same call later, under the same key.
    #[error("provider asks to try again ({code}): {message}")]
    Retry { code: String, message: String },
    /// A definite no, for good, with the provider's code.
    #[error("provider refused ({code}): {message}")]
    Refused { code: String, message: String },
}

impl ProviderError {
    /// The metric label of a call that ended so.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Unknown(_) => "unknown",
            Self::Retry { .. } => "retry",
            Self::Refused { .. } => "refused",
        }
    }
}

/// Why a callback was not accepted. Each one is answered so that the
/// provider sends it again (it may be ours, garbled on the way), and
/// changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallbackError {
    #[error("callback signature missing or malformed: {0}")]
    Malformed(String),
    #[error("callback timestamp outside the allowed window")]
    Stale,
    #[error("callback signed with an unknown key serial {0}")]
    UnknownKey(String),
    #[error("callback signature does not match")]
    BadSignature,
    #[error("callback resource could not be decrypted")]
    Undecryptable,
    /// Signed by the provider, but for another merchant, app or currency.
    #[error("callback not for this merchant: {0}")]
    Foreign(String),
}

/// One charge on the provider's statement of a day.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StatementLine {
    /// Our payment number as the provider holds it (`out_trade_no`).
    pub reference: String,
    /// The provider's transaction id.
    pub txn_id: Option<String>,
    pub amount_cents: i64,
}

/// A callback's headers, as the HTTP edge hands them over (names in any
/// case).
pub trait Headers {
    /// The value of header `name`, if it is there and readable as text.
    fn header(&self, name: &str) -> Option<&str>;
}

/// A payment provider.
pub trait PaymentProvider: Send + Sync {
    /// Stored in `payments.provider`.
    fn name(&self) -> &'static str;

    /// Whether a payment is created as a known payer
    /// ([`NewPayment::payer_openid`]: WeChat Pay JSAPI).
    fn needs_payer(&self) -> bool {
        false
    }

    /// Creates the payment, or returns the one created before under the
    /// same payment number.
    fn create<'a>(
        &'a self,
        payment: &'a NewPayment,
    ) -> BoxFuture<'a, Result<Checkout, ProviderError>>;

    /// Verifies a callback from its raw headers and body (at `now`, unix
    /// seconds) and parses it.
    fn parse_callback(
        &self,
        headers: &dyn Headers,
        body: &[u8],
        now: i64,
    ) -> Result<Event, CallbackError>;

    /// Closes the payment: after this it cannot be paid.
    fn close<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<CloseOutcome, ProviderError>>;

    /// Where the payment stands.
    fn query<'a>(&'a self, payment: &'a PaymentRef)
    -> BoxFuture<'a, Result<Charge, ProviderError>>;

    /// Sends the refund, or reports the one sent before under the same
    /// refund number.
    fn refund<'a>(
        &'a self,
        refund: &'a RefundRequest,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>>;

    /// The charges on the provider's statement of `date` (its own time
    /// zone's day). `Refused` by a provider that publishes none.
    fn statement(
        &self,
        date: chrono::NaiveDate,
    ) -> BoxFuture<'_, Result<Vec<StatementLine>, ProviderError>> {
        let _ = date;
        futures_util::future::ready(Err(ProviderError::Refused {
            code: "NO_STATEMENT".into(),
            message: format!("{} publishes no statement here", self.name()),
        }))
        .boxed()
    }

    /// Where the refund stands.
    fn query_refund<'a>(
        &'a self,
        refund: &'a RefundRef,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>>;
}

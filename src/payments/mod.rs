//! Payments (SPEC step 5, docs/PAYMENTS.md): pay intents through a
//! [`provider::PaymentProvider`], provider callbacks applied once, pending
//! payments closed or queried at the provider, and refunds sent through it.

pub mod provider;
pub mod refunds;
pub mod repo;
pub mod signature;
pub mod statement;
pub mod status;
pub mod stripe;
pub mod sweeper;
pub mod wechatpay;

pub use status::PaymentStatus;

use std::sync::Arc;

use crate::config::{PaymentSettings, ProviderKind, Settings};

/// Every provider this server reaches, by name: the one new payments go
/// to (`payment.provider`), and each other one configured
/// (`[payment.wechatpay]`, `[payment.stripe]`), which still closes,
/// queries and refunds the payments made through it and takes their
/// callbacks. Every call about a payment goes to the provider named on
/// its row, never to whichever is current (docs/OPERATIONS.md, "Switching
/// payment providers").
pub struct Providers {
    current: Arc<dyn provider::PaymentProvider>,
    others: Vec<Arc<dyn provider::PaymentProvider>>,
}

impl Providers {
    /// The configured providers.
    pub fn from_settings(settings: &Settings) -> anyhow::Result<Self> {
        let payment = &settings.payment;
        let current: Arc<dyn provider::PaymentProvider> =
            Arc::from(build(payment, payment.kind())?);
        let mut others = Vec::new();
        for (kind, configured) in [
            (ProviderKind::Wechatpay, payment.wechatpay.is_some()),
            (ProviderKind::Stripe, payment.stripe.is_some()),
        ] {
            if configured && kind != payment.kind() {
                others.push(Arc::from(build(payment, kind)?));
            }
        }
        Ok(Self { current, others })
    }

    /// Where new payments go.
    pub fn current(&self) -> &Arc<dyn provider::PaymentProvider> {
        &self.current
    }

    /// The provider named `name` (a payment row's), if it is configured.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn provider::PaymentProvider>> {
        std::iter::once(&self.current)
            .chain(&self.others)
            .find(|p| p.name() == name)
    }

    /// The names of every configured provider.
    pub fn names(&self) -> Vec<String> {
        std::iter::once(&self.current)
            .chain(&self.others)
            .map(|p| p.name().to_owned())
            .collect()
    }
}

/// The provider `kind`, from its settings.
fn build(
    payment: &PaymentSettings,
    kind: ProviderKind,
) -> anyhow::Result<Box<dyn provider::PaymentProvider>> {
    let tolerance = crate::clock::millis(payment.signature_tolerance_secs) / 1000;
    let secret = payment.notify_secret.clone();
    Ok(match kind {
        ProviderKind::Mock => Box::new(provider::SignedProvider::mock(secret, tolerance)),
        ProviderKind::External => Box::new(provider::SignedProvider::external(secret, tolerance)),
        ProviderKind::Wechatpay => {
            let Some(wechat) = payment.wechatpay.as_ref() else {
                anyhow::bail!("payment.provider = \"wechatpay\" needs [payment.wechatpay]");
            };
            Box::new(wechatpay::WechatPay::from_settings(
                wechat,
                payment.provider_timeout_ms,
                tolerance,
            )?)
        }
        ProviderKind::Stripe => {
            let Some(stripe) = payment.stripe.as_ref() else {
                anyhow::bail!("payment.provider = \"stripe\" needs [payment.stripe]");
            };
            Box::new(stripe::Stripe::from_settings(
                stripe,
                payment.provider_timeout_ms,
                tolerance,
            )?)
        }
    })
}

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

use crate::config::{ProviderKind, Settings};

/// The configured provider.
pub fn provider(settings: &Settings) -> anyhow::Result<Box<dyn provider::PaymentProvider>> {
    let payment = &settings.payment;
    let tolerance = crate::clock::millis(payment.signature_tolerance_secs) / 1000;
    let secret = payment.notify_secret.clone();
    Ok(match payment.kind() {
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

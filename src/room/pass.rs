//! Queue passes: what an admitted ticket shows the purchase-token route.
//!
//! A pass is `v1.<activity>.<user>.<ticket>.<epoch>.<kind>.<expires_ms>.<mac>`,
//! `mac` the hex HMAC-SHA-256 of everything before it under a key derived
//! from the service's secret. `kind` is `A` (admitted in turn) or `O` (an
//! offer of a released unit). The signature says the server made it; the
//! room in Redis says whether it is still the ticket's pass and unused
//! (`redeem`), so a pass is honoured once, and never after the queue it
//! came from was lost (`epoch`).

use hmac::{KeyInit, Mac};
use sha2::Sha256;

use crate::domain::{ActivityId, UserId};

/// What a pass was given for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The ticket's turn came.
    Admitted,
    /// A released unit held for the ticket.
    Offer,
}

impl Kind {
    /// Its letter in the pass and in the room's ticket states.
    pub fn letter(self) -> &'static str {
        match self {
            Kind::Admitted => "A",
            Kind::Offer => "O",
        }
    }

    fn parse(letter: &str) -> Option<Self> {
        match letter {
            "A" => Some(Kind::Admitted),
            "O" => Some(Kind::Offer),
            _ => None,
        }
    }
}

/// What a pass says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub activity: ActivityId,
    pub user: UserId,
    pub ticket: u64,
    pub epoch: i64,
    pub kind: Kind,
    /// Unix ms, on the sale clock.
    pub expires_ms: i64,
}

/// Why a pass is refused before Redis is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not made by this service, or not a pass at all.
    Forged,
    /// Another user's, or for another activity.
    Foreign,
    /// Past its time.
    Expired,
}

impl Refusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Forged => "forged",
            Refusal::Foreign => "foreign",
            Refusal::Expired => "expired",
        }
    }
}

/// Signs and checks passes under one key.
#[derive(Clone)]
pub struct Passes {
    mac: hmac::Hmac<Sha256>,
}

impl Passes {
    /// Passes under `key`.
    pub fn new(key: &[u8]) -> Self {
        Self {
            mac: hmac::Hmac::new_from_slice(key).expect("HMAC takes any key length"),
        }
    }

    /// The signed pass.
    pub fn sign(&self, pass: &Pass) -> String {
        let body = body(pass);
        let mut mac = self.mac.clone();
        mac.update(body.as_bytes());
        format!("{body}.{}", hex::encode(mac.finalize().into_bytes()))
    }

    /// The pass `raw` says, when it is ours, for `user` and `activity`, and
    /// not expired at `now_ms`.
    pub fn check(
        &self,
        raw: &str,
        activity: ActivityId,
        user: UserId,
        now_ms: i64,
    ) -> Result<Pass, Refusal> {
        let (body, mac) = raw.rsplit_once('.').ok_or(Refusal::Forged)?;
        let mac = hex::decode(mac).map_err(|_| Refusal::Forged)?;
        let mut expected = self.mac.clone();
        expected.update(body.as_bytes());
        expected.verify_slice(&mac).map_err(|_| Refusal::Forged)?;
        let pass = parse(body).ok_or(Refusal::Forged)?;
        if pass.activity != activity || pass.user != user {
            return Err(Refusal::Foreign);
        }
        if now_ms >= pass.expires_ms {
            return Err(Refusal::Expired);
        }
        Ok(pass)
    }
}

fn body(p: &Pass) -> String {
    format!(
        "v1.{}.{}.{}.{}.{}.{}",
        p.activity,
        p.user,
        p.ticket,
        p.epoch,
        p.kind.letter(),
        p.expires_ms
    )
}

fn parse(body: &str) -> Option<Pass> {
    let mut parts = body.split('.');
    if parts.next()? != "v1" {
        return None;
    }
    let pass = Pass {
        activity: ActivityId::parse(parts.next()?)?,
        user: UserId::parse(parts.next()?)?,
        ticket: parts.next()?.parse().ok()?,
        epoch: parts.next()?.parse().ok()?,
        kind: Kind::parse(parts.next()?)?,
        expires_ms: parts.next()?.parse().ok()?,
    };
    parts.next().is_none().then_some(pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass() -> Pass {
        Pass {
            activity: ActivityId::new(3),
            user: UserId::parse("5").unwrap(),
            ticket: 17,
            epoch: 1,
            kind: Kind::Admitted,
            expires_ms: 10_000,
        }
    }

    #[test]
    fn a_pass_checks_for_its_user_and_activity_until_it_expires() {
        let passes = Passes::new(b"k");
        let raw = passes.sign(&pass());
        let (a, u) = (ActivityId::new(3), UserId::parse("5").unwrap());
        assert_eq!(passes.check(&raw, a, u, 9_999), Ok(pass()));
        assert_eq!(passes.check(&raw, a, u, 10_000), Err(Refusal::Expired));
        let other = UserId::parse("6").unwrap();
        assert_eq!(passes.check(&raw, a, other, 0), Err(Refusal::Foreign));
        assert_eq!(
            passes.check(&raw, ActivityId::new(4), u, 0),
            Err(Refusal::Foreign)
        );
    }

    #[test]
    fn a_changed_or_foreign_signed_pass_is_forged() {
        let passes = Passes::new(b"k");
        let raw = passes.sign(&pass());
        let (a, u) = (ActivityId::new(3), UserId::parse("5").unwrap());
        let later = raw.replace(".10000.", ".99999.");
        assert_eq!(passes.check(&later, a, u, 0), Err(Refusal::Forged));
        let theirs = Passes::new(b"other").sign(&pass());
        assert_eq!(passes.check(&theirs, a, u, 0), Err(Refusal::Forged));
        for junk in ["", "v1", "x.y", &format!("{raw}0")] {
            assert_eq!(passes.check(junk, a, u, 0), Err(Refusal::Forged), "{junk}");
        }
    }
}

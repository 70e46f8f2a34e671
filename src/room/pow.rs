//! Proof of work before a ticket: ALTCHA's v1 challenge (a salted SHA-256
//! puzzle, signed with HMAC-SHA-256), made and checked by the
//! `altcha-lib-rs` crate. The server keeps nothing per challenge until it
//! is answered: the salt carries the activity, the user and the expiry, and
//! the signature covers them. Each answer is then accepted once, which the
//! join script records in Redis until the challenge would have expired.
//!
//! Difficulty is ALTCHA's `maxnumber`: the secret number is drawn from
//! `0..=maxnumber`, so a solver tries `maxnumber / 2` hashes on average.
//! It starts at the room's `pow_difficulty` and rises with the join rate
//! ([`difficulty`]).

use altcha_lib_rs::algorithm::AltchaAlgorithm;
use altcha_lib_rs::{ChallengeOptions, Payload};
use chrono::{DateTime, Utc};
use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::domain::{ActivityId, UserId};

/// Joins per second that add one `pow_difficulty` to the difficulty.
pub const JOINS_PER_STEP: u64 = 50;

/// The most the difficulty rises: this many times the room's own.
pub const MAX_STEPS: u64 = 16;

/// The difficulty of a challenge made while `joins_per_sec` tickets a
/// second are being taken: the room's `base`, plus one `base` for every
/// [`JOINS_PER_STEP`] joins a second, at most [`MAX_STEPS`] times `base`.
pub fn difficulty(base: u64, joins_per_sec: u64) -> u64 {
    base.saturating_mul((1 + joins_per_sec / JOINS_PER_STEP).min(MAX_STEPS))
}

/// A challenge as the buyer gets it (ALTCHA's shape, plus its expiry).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Challenge {
    /// Always `SHA-256`.
    pub algorithm: &'static str,
    /// Hex SHA-256 of `salt` followed by the secret number in decimal.
    pub challenge: String,
    /// The secret number is in `0..=maxnumber`.
    pub maxnumber: u64,
    /// Opaque to the solver: random, then `.<activity>.<user>`, then
    /// `?expires=<unix seconds>&`.
    pub salt: String,
    /// HMAC-SHA-256 of `challenge`, hex.
    pub signature: String,
    /// After this the answer is refused.
    pub expires_at: DateTime<Utc>,
}

/// An answer (ALTCHA's payload, without its optional `took`).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    pub algorithm: String,
    pub challenge: String,
    pub salt: String,
    /// The number found.
    pub number: u64,
    pub signature: String,
    /// Milliseconds the solver took (ALTCHA's widget sends it; ignored).
    #[serde(default)]
    pub took: Option<u64>,
}

/// Why an answer is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not a solution, not signed by us, or not for this user and activity.
    Wrong,
    /// Its challenge has expired.
    Expired,
}

impl Refusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Wrong => "wrong",
            Refusal::Expired => "expired",
        }
    }
}

/// Makes and checks challenges under one key.
#[derive(Clone)]
pub struct Puzzles {
    key: String,
}

impl Puzzles {
    /// Puzzles signed with `key` (derived from the service's secret).
    pub fn new(key: String) -> Self {
        Self { key }
    }

    /// A challenge of `maxnumber` for `user` joining `activity`, valid
    /// until `expires_at`.
    pub fn challenge(
        &self,
        activity: ActivityId,
        user: UserId,
        maxnumber: u64,
        expires_at: DateTime<Utc>,
    ) -> anyhow::Result<Challenge> {
        // The salt names who it is for; its one parameter is the expiry.
        // (The crate rebuilds the parameters from a HashMap when it
        // verifies, so with two or more their order, and the hash, would
        // change at random.)
        let mut random = [0u8; 12];
        getrandom::fill(&mut random).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        let salt = format!("{}.{activity}.{user}", hex::encode(random));
        let params = [("expires".to_owned(), expires_at.timestamp().to_string())];
        let c = altcha_lib_rs::create_challenge(ChallengeOptions {
            algorithm: Some(AltchaAlgorithm::Sha256),
            max_number: Some(maxnumber),
            hmac_key: &self.key,
            salt: Some(salt),
            params: Some(params.into_iter().collect()),
            ..Default::default()
        })
        .map_err(|e| anyhow::anyhow!("creating a challenge: {e}"))?;
        Ok(Challenge {
            algorithm: "SHA-256",
            challenge: c.challenge,
            maxnumber: c.maxnumber,
            salt: c.salt,
            signature: c.signature,
            expires_at,
        })
    }

    /// Checks `answer` for `user` joining `activity` at `now` (the sale
    /// clock); `Ok` with its expiry when it solves a challenge of ours for
    /// them. Whether it was answered before is the join script's to say.
    pub fn check(
        &self,
        answer: &Answer,
        activity: ActivityId,
        user: UserId,
        now: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, Refusal> {
        if answer.algorithm != "SHA-256" || !self.signed_by_us(answer) {
            return Err(Refusal::Wrong);
        }
        let (base, query) = answer.salt.split_once('?').ok_or(Refusal::Wrong)?;
        let mut named = base.rsplitn(3, '.');
        let (for_user, for_activity) = (named.next(), named.next());
        if for_user != Some(&user.to_string()) || for_activity != Some(&activity.to_string()) {
            return Err(Refusal::Wrong);
        }
        let expires_at = query
            .split('&')
            .find_map(|pair| pair.strip_prefix("expires="))
            .and_then(|v| v.parse::<i64>().ok())
            .and_then(|s| DateTime::from_timestamp(s, 0))
            .ok_or(Refusal::Wrong)?;
        let payload = Payload {
            algorithm: AltchaAlgorithm::Sha256,
            challenge: answer.challenge.clone(),
            number: answer.number,
            salt: answer.salt.clone(),
            signature: answer.signature.clone(),
            took: None,
        };
        // The crate checks expiry on the system clock; ours is the sale's.
        altcha_lib_rs::verify_solution(&payload, &self.key, false).map_err(|_| Refusal::Wrong)?;
        if now >= expires_at {
            return Err(Refusal::Expired);
        }
        Ok(expires_at)
    }

    /// The signature, compared in constant time before anything else (the
    /// crate compares its hex strings with `!=`).
    fn signed_by_us(&self, answer: &Answer) -> bool {
        let Ok(signature) = hex::decode(&answer.signature) else {
            return false;
        };
        let mut mac = hmac::Hmac::<Sha256>::new_from_slice(self.key.as_bytes())
            .expect("HMAC takes any key length");
        mac.update(answer.challenge.as_bytes());
        mac.verify_slice(&signature).is_ok()
    }
}

/// Solves `challenge` by trying every number: what the buyer page does in
/// the browser, for tests and the load generator.
pub fn solve(challenge: &Challenge) -> Option<Answer> {
    let number = solve_parts(&challenge.salt, &challenge.challenge, challenge.maxnumber)?;
    Some(Answer {
        algorithm: challenge.algorithm.to_owned(),
        challenge: challenge.challenge.clone(),
        salt: challenge.salt.clone(),
        number,
        signature: challenge.signature.clone(),
        took: None,
    })
}

/// The number in `0..=maxnumber` whose SHA-256 after `salt` is the hex
/// `challenge`.
pub fn solve_parts(salt: &str, challenge: &str, maxnumber: u64) -> Option<u64> {
    use sha2::Digest;
    let target = hex::decode(challenge).ok()?;
    (0..=maxnumber).find(|n| {
        let mut h = Sha256::new();
        h.update(salt.as_bytes());
        h.update(n.to_string().as_bytes());
        h.finalize().as_slice() == target.as_slice()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn puzzles() -> Puzzles {
        Puzzles::new("k".into())
    }

    fn user(id: i64) -> UserId {
        UserId::parse(&id.to_string()).unwrap()
    }

    #[test]
    fn a_solved_challenge_is_accepted_for_its_user_and_activity_only() {
        let now = Utc::now();
        let (a, u) = (ActivityId::new(7), user(9));
        let c = puzzles()
            .challenge(a, u, 2_000, now + chrono::Duration::seconds(60))
            .unwrap();
        let answer = solve(&c).unwrap();
        assert!(puzzles().check(&answer, a, u, now).is_ok());
        assert_eq!(
            puzzles().check(&answer, a, user(10), now),
            Err(Refusal::Wrong)
        );
        assert_eq!(
            puzzles().check(&answer, ActivityId::new(8), u, now),
            Err(Refusal::Wrong)
        );
        assert_eq!(
            puzzles().check(&answer, a, u, now + chrono::Duration::seconds(61)),
            Err(Refusal::Expired)
        );
        let wrong = Answer {
            number: answer.number + 1,
            ..answer.clone()
        };
        assert_eq!(puzzles().check(&wrong, a, u, now), Err(Refusal::Wrong));
        let forged = Puzzles::new("other".into());
        assert_eq!(forged.check(&answer, a, u, now), Err(Refusal::Wrong));
    }

    #[test]
    fn difficulty_rises_with_the_join_rate_up_to_a_cap() {
        assert_eq!(difficulty(1_000, 0), 1_000);
        assert_eq!(difficulty(1_000, JOINS_PER_STEP - 1), 1_000);
        assert_eq!(difficulty(1_000, JOINS_PER_STEP), 2_000);
        assert_eq!(difficulty(1_000, 1_000_000), 16_000);
    }
}

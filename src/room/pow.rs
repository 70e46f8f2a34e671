//! Proof of work before a ticket: ALTCHA's v1 challenge (a salted SHA-256
//! puzzle, signed with HMAC-SHA-256), in ALTCHA's wire shape so its widget
//! and any ALTCHA solver work. The server keeps nothing per challenge until
//! it is answered: the salt carries the activity, the user, the expiry and
//! the difficulty, and the signature covers them. Each answer is then
//! accepted once, which the join script records in Redis until the
//! challenge would have expired.
//!
//! Difficulty is ALTCHA's `maxnumber`: the secret number is drawn from
//! `0..=maxnumber`, so a solver tries `maxnumber / 2` hashes on average.
//! It starts at the room's `pow_difficulty` and rises with the join rate
//! ([`difficulty`]); a join is refused when its challenge is much easier
//! than the rate asks then ([`hard_enough`]), so easy challenges fetched in
//! a quiet moment cannot be solved in advance and spent in the rush.
//!
//! Made and checked here, in a few lines, rather than by `altcha-lib-rs`:
//! its `verify_solution` (0.3.3) rebuilds the challenge with its default
//! `maxnumber` of 1,000,000 and refuses every honest answer above it,
//! while rooms may ask for up to 16 times 10,000,000.

use chrono::{DateTime, Utc};
use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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

/// Whether a challenge of `maxnumber` still buys a ticket while
/// `joins_per_sec` tickets a second are taken: at least the difficulty of
/// half that rate. A buyer who fetched theirs while the rush was building
/// is not sent back for a step or two; one fetched in a quiet second and
/// kept for the rush is.
pub fn hard_enough(maxnumber: u64, base: u64, joins_per_sec: u64) -> bool {
    maxnumber >= difficulty(base, joins_per_sec / 2)
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
    /// `?expires=<unix seconds>&max=<maxnumber>&`.
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

/// What an accepted answer's challenge said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Solved {
    pub expires_at: DateTime<Utc>,
    /// Its difficulty when it was made.
    pub maxnumber: u64,
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
        let mut random = [0u8; 20];
        getrandom::fill(&mut random).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        let (salt_bytes, number_bytes) = random.split_at(12);
        let draw = u64::from_le_bytes(number_bytes.try_into().expect("8 bytes"));
        let number = draw % maxnumber.saturating_add(1).max(1);
        Ok(self.numbered(
            hex::encode(salt_bytes),
            activity,
            user,
            maxnumber,
            expires_at,
            number,
        ))
    }

    /// The challenge whose secret is `number`.
    fn numbered(
        &self,
        random: String,
        activity: ActivityId,
        user: UserId,
        maxnumber: u64,
        expires_at: DateTime<Utc>,
        number: u64,
    ) -> Challenge {
        let salt = format!(
            "{random}.{activity}.{user}?expires={}&max={maxnumber}&",
            expires_at.timestamp()
        );
        let challenge = hash_hex(&salt, number);
        let signature = hex::encode(self.mac(&challenge).finalize().into_bytes());
        Challenge {
            algorithm: "SHA-256",
            challenge,
            maxnumber,
            salt,
            signature,
            expires_at,
        }
    }

    /// Checks `answer` for `user` joining `activity` at `now` (the sale
    /// clock); `Ok` when it solves a challenge of ours for them. Whether
    /// it was answered before is the join script's to say, and whether it
    /// is hard enough the room's ([`hard_enough`]).
    pub fn check(
        &self,
        answer: &Answer,
        activity: ActivityId,
        user: UserId,
        now: DateTime<Utc>,
    ) -> Result<Solved, Refusal> {
        // The signature first, compared in constant time.
        let signature = hex::decode(&answer.signature).map_err(|_| Refusal::Wrong)?;
        if answer.algorithm != "SHA-256"
            || self
                .mac(&answer.challenge)
                .verify_slice(&signature)
                .is_err()
        {
            return Err(Refusal::Wrong);
        }
        let (base, query) = answer.salt.split_once('?').ok_or(Refusal::Wrong)?;
        let mut named = base.rsplitn(3, '.');
        let (for_user, for_activity) = (named.next(), named.next());
        if for_user != Some(&user.to_string()) || for_activity != Some(&activity.to_string()) {
            return Err(Refusal::Wrong);
        }
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
        };
        let expires_at = param("expires")
            .and_then(|v| v.parse::<i64>().ok())
            .and_then(|s| DateTime::from_timestamp(s, 0))
            .ok_or(Refusal::Wrong)?;
        let maxnumber = param("max")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or(Refusal::Wrong)?;
        if answer.number > maxnumber || hash_hex(&answer.salt, answer.number) != answer.challenge {
            return Err(Refusal::Wrong);
        }
        if now >= expires_at {
            return Err(Refusal::Expired);
        }
        Ok(Solved {
            expires_at,
            maxnumber,
        })
    }

    fn mac(&self, challenge: &str) -> hmac::Hmac<Sha256> {
        let mut mac = hmac::Hmac::<Sha256>::new_from_slice(self.key.as_bytes())
            .expect("HMAC takes any key length");
        mac.update(challenge.as_bytes());
        mac
    }
}

/// Hex SHA-256 of `salt` followed by `number` in decimal.
fn hash_hex(salt: &str, number: u64) -> String {
    let mut h = Sha256::new();
    h.update(salt.as_bytes());
    h.update(number.to_string().as_bytes());
    hex::encode(h.finalize())
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
        assert_eq!(
            puzzles().check(&answer, a, u, now).map(|s| s.maxnumber),
            Ok(2_000)
        );
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
    fn answers_above_a_million_are_accepted_up_to_the_largest_difficulty() {
        // pow_difficulty goes up to 10,000,000 and rises 16 times.
        let now = Utc::now();
        let (a, u) = (ActivityId::new(7), user(9));
        let expires = now + chrono::Duration::seconds(60);
        let top = difficulty(10_000_000, u64::MAX);
        for (maxnumber, number) in [(2_000_000, 1_160_469), (top, top), (top, 0)] {
            let c = puzzles().numbered("ab".into(), a, u, maxnumber, expires, number);
            let answer = Answer {
                algorithm: c.algorithm.to_owned(),
                challenge: c.challenge.clone(),
                salt: c.salt.clone(),
                number,
                signature: c.signature.clone(),
                took: None,
            };
            assert_eq!(
                puzzles().check(&answer, a, u, now),
                Ok(Solved {
                    expires_at: DateTime::from_timestamp(expires.timestamp(), 0).unwrap(),
                    maxnumber
                }),
                "number {number} of {maxnumber}"
            );
        }
    }

    #[test]
    fn a_salt_that_claims_another_difficulty_breaks_the_signature() {
        let now = Utc::now();
        let (a, u) = (ActivityId::new(7), user(9));
        let c = puzzles()
            .challenge(a, u, 100, now + chrono::Duration::seconds(60))
            .unwrap();
        let mut answer = solve(&c).unwrap();
        answer.salt = answer.salt.replace("&max=100&", "&max=1600&");
        // The hash no longer matches the signed challenge.
        assert_eq!(puzzles().check(&answer, a, u, now), Err(Refusal::Wrong));
        answer.challenge = hash_hex(&answer.salt, answer.number);
        assert_eq!(puzzles().check(&answer, a, u, now), Err(Refusal::Wrong));
    }

    #[test]
    fn an_easy_challenge_kept_for_the_rush_is_not_hard_enough() {
        let base = 1_000;
        // Fetched in a quiet second: enough while the rate stays low.
        assert!(hard_enough(difficulty(base, 0), base, 0));
        assert!(hard_enough(
            difficulty(base, 0),
            base,
            2 * JOINS_PER_STEP - 1
        ));
        // Spent in the rush: refused.
        assert!(!hard_enough(difficulty(base, 0), base, 2 * JOINS_PER_STEP));
        assert!(!hard_enough(difficulty(base, 0), base, 10_000));
        // Fetched as the rush built, a step or two below today's: kept.
        assert!(hard_enough(difficulty(base, 400), base, 800));
        assert!(hard_enough(difficulty(base, 10_000), base, 10_000));
    }

    #[test]
    fn difficulty_rises_with_the_join_rate_up_to_a_cap() {
        assert_eq!(difficulty(1_000, 0), 1_000);
        assert_eq!(difficulty(1_000, JOINS_PER_STEP - 1), 1_000);
        assert_eq!(difficulty(1_000, JOINS_PER_STEP), 2_000);
        assert_eq!(difficulty(1_000, 1_000_000), 16_000);
    }
}

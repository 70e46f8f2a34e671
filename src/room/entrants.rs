//! The commitment to a room's pre-queue entrants: a Merkle tree whose
//! leaves are the tickets taken before the start, in ticket order. Its
//! root keys the draw ([`super::draw::Draw::key`]), so the order depends on
//! every entrant; and a buyer can check that their own ticket was among
//! them from `log2(entrants)` hashes (`GET …/queue/me?proof=true`,
//! `scripts/verify_draw.py --ticket`), without learning anyone else's user.
//!
//! - leaf(t) = SHA-256(0x00 ‖ t as 8 bytes big-endian ‖ user as 8 bytes
//!   big-endian ‖ salt(t)), where salt(t) is 16 bytes only the server can
//!   make ([`Salts`]): a sibling leaf in someone's proof cannot be matched
//!   against guessed user ids.
//! - node = SHA-256(0x01 ‖ left ‖ right); the last node of a level with an
//!   odd count goes up unchanged.
//! - The root of no entrants is SHA-256 of nothing; of one, its leaf.
//!
//! Redis keeps the entrants as a list of users in ticket order (pushed by
//! `room_join.lua` while the pre-queue is open); every instance builds the
//! same tree from it once per queue, and the first to finish writes the
//! root to the room (`room_seal.lua`), which the others check theirs
//! against.

use hmac::{KeyInit, Mac};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::domain::ActivityId;

type Hash = [u8; 32];

/// The name `GET …/queue/draw` publishes the commitment's scheme under.
pub const SCHEME: &str = "seckill-entrants-v1: SHA-256 Merkle tree, leaf = H(0x00|ticket|user|salt), node = H(0x01|left|right)";

/// Makes each leaf's salt: HMAC-SHA-256 under a key derived from the
/// service's secret, of the activity, the queue's epoch and the ticket.
#[derive(Clone)]
pub struct Salts {
    mac: hmac::Hmac<Sha256>,
}

impl Salts {
    pub fn new(key: &[u8]) -> Self {
        Self {
            mac: hmac::Hmac::new_from_slice(key).expect("HMAC takes any key length"),
        }
    }

    /// The salt of `ticket` in `activity`'s queue `epoch`.
    pub fn of(&self, activity: ActivityId, epoch: i64, ticket: u64) -> [u8; 16] {
        let mut mac = self.mac.clone();
        mac.update(&activity.get().to_be_bytes());
        mac.update(&epoch.to_be_bytes());
        mac.update(&ticket.to_be_bytes());
        let out = mac.finalize().into_bytes();
        let mut salt = [0u8; 16];
        salt.copy_from_slice(&out[..16]);
        salt
    }
}

/// The leaf of ticket `ticket` (from 1), taken by `user`.
pub fn leaf(ticket: u64, user: i64, salt: &[u8; 16]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(ticket.to_be_bytes());
    h.update(user.to_be_bytes());
    h.update(salt);
    h.finalize().into()
}

fn node(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// Which side a proof's hash goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub enum Side {
    /// Hashed before the running value: SHA-256(0x01 ‖ hash ‖ running).
    L,
    /// Hashed after it: SHA-256(0x01 ‖ running ‖ hash).
    R,
}

/// One step up a proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Step {
    pub side: Side,
    /// Hex.
    pub hash: String,
}

/// The entrants' tree, every level kept (about 64 bytes an entrant) so
/// that a proof is read, not computed.
pub struct Tree {
    levels: Vec<Vec<Hash>>,
}

impl Tree {
    /// The tree over `users` (ticket `i + 1` taken by `users[i]`) in
    /// `activity`'s queue `epoch`.
    pub fn build(salts: &Salts, activity: ActivityId, epoch: i64, users: &[i64]) -> Self {
        let leaves: Vec<Hash> = users
            .iter()
            .enumerate()
            .map(|(i, &user)| {
                let ticket = i as u64 + 1;
                leaf(ticket, user, &salts.of(activity, epoch, ticket))
            })
            .collect();
        let mut levels = vec![leaves];
        while levels.last().is_some_and(|l| l.len() > 1) {
            let below = levels.last().expect("a level");
            let up = below
                .chunks(2)
                .map(|pair| match pair {
                    [l, r] => node(l, r),
                    [only] => *only,
                    _ => unreachable!("chunks of two"),
                })
                .collect();
            levels.push(up);
        }
        Self { levels }
    }

    /// How many entrants it commits to.
    pub fn len(&self) -> u64 {
        self.levels[0].len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The root, hex: the commitment the draw is keyed by.
    pub fn root(&self) -> String {
        match self.levels.last().and_then(|l| l.first()) {
            Some(root) => hex::encode(root),
            None => hex::encode(Sha256::digest(b"")),
        }
    }

    /// The path from ticket `ticket`'s leaf to the root, bottom up; `None`
    /// for a ticket that is not an entrant.
    pub fn proof(&self, ticket: u64) -> Option<Vec<Step>> {
        if ticket == 0 || ticket > self.len() {
            return None;
        }
        let mut at = (ticket - 1) as usize;
        let mut steps = Vec::new();
        for level in &self.levels[..self.levels.len() - 1] {
            let sibling = at ^ 1;
            if let Some(h) = level.get(sibling) {
                steps.push(Step {
                    side: if sibling < at { Side::L } else { Side::R },
                    hash: hex::encode(h),
                });
            }
            at >>= 1;
        }
        Some(steps)
    }
}

/// Whether `steps` lead from ticket `ticket`'s leaf (user `user`, salt
/// `salt`) to `root` in a tree of `entrants`, with the shape that ticket's
/// place in it must have. What `scripts/verify_draw.py --ticket` checks.
pub fn verify(
    ticket: u64,
    user: i64,
    salt: &[u8; 16],
    steps: &[Step],
    entrants: u64,
    root: &str,
) -> bool {
    if ticket == 0 || ticket > entrants {
        return false;
    }
    let mut running = leaf(ticket, user, salt);
    let (mut at, mut width) = (ticket - 1, entrants);
    let mut steps = steps.iter();
    while width > 1 {
        let sibling = at ^ 1;
        if sibling < width {
            let Some(step) = steps.next() else {
                return false;
            };
            let want = if sibling < at { Side::L } else { Side::R };
            let Ok(Ok(h)) = hex::decode(&step.hash).map(<Hash>::try_from) else {
                return false;
            };
            if step.side != want {
                return false;
            }
            running = match want {
                Side::L => node(&h, &running),
                Side::R => node(&running, &h),
            };
        }
        at >>= 1;
        width = width.div_ceil(2);
    }
    steps.next().is_none() && hex::encode(running) == root
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(n: usize) -> (Salts, Tree, Vec<i64>) {
        let salts = Salts::new(b"k");
        let users: Vec<i64> = (0..n as i64).map(|i| 1000 + i * 7).collect();
        let t = Tree::build(&salts, ActivityId::new(5), 2, &users);
        (salts, t, users)
    }

    #[test]
    fn every_entrant_proves_its_ticket_and_nothing_else_verifies() {
        for n in [1usize, 2, 3, 5, 8, 13, 100, 257] {
            let (salts, t, users) = tree(n);
            let root = t.root();
            for (i, &user) in users.iter().enumerate() {
                let ticket = i as u64 + 1;
                let salt = salts.of(ActivityId::new(5), 2, ticket);
                let steps = t.proof(ticket).unwrap();
                assert!(
                    verify(ticket, user, &salt, &steps, n as u64, &root),
                    "{n}/{ticket}"
                );
                // Another user, another ticket number, another salt, or
                // a count that changes the shape: refused.
                assert!(!verify(ticket, user + 1, &salt, &steps, n as u64, &root));
                assert!(!verify(ticket, user, &[0; 16], &steps, n as u64, &root));
                if n > 1 {
                    let other = ticket % n as u64 + 1;
                    assert!(!verify(other, user, &salt, &steps, n as u64, &root));
                }
                assert!(!verify(
                    ticket,
                    user,
                    &salt,
                    &steps,
                    n as u64 * 2 + 1,
                    &root
                ));
            }
            assert!(t.proof(n as u64 + 1).is_none());
            assert!(t.proof(0).is_none());
        }
    }

    #[test]
    fn a_ticket_that_was_not_committed_has_no_proof_that_verifies() {
        let (salts, t, users) = tree(10);
        let root = t.root();
        // Ticket 11, taken after the start, borrows ticket 10's path.
        let salt = salts.of(ActivityId::new(5), 2, 11);
        let borrowed = t.proof(10).unwrap();
        assert!(!verify(11, users[9], &salt, &borrowed, 10, &root));
        assert!(!verify(11, users[9], &salt, &borrowed, 11, &root));
        // A flipped side or a changed hash breaks a genuine proof.
        let salt = salts.of(ActivityId::new(5), 2, 4);
        let mut steps = t.proof(4).unwrap();
        steps[0].side = match steps[0].side {
            Side::L => Side::R,
            Side::R => Side::L,
        };
        assert!(!verify(4, users[3], &salt, &steps, 10, &root));
        let mut steps = t.proof(4).unwrap();
        steps[1].hash = hex::encode([9u8; 32]);
        assert!(!verify(4, users[3], &salt, &steps, 10, &root));
    }

    #[test]
    fn the_root_changes_with_any_entrant_and_with_their_order() {
        let salts = Salts::new(b"k");
        let root = |users: &[i64]| Tree::build(&salts, ActivityId::new(1), 1, users).root();
        let base = root(&[1, 2, 3, 4, 5]);
        assert_eq!(base, root(&[1, 2, 3, 4, 5]));
        assert_ne!(base, root(&[1, 2, 3, 4, 6]));
        assert_ne!(base, root(&[2, 1, 3, 4, 5]));
        assert_ne!(base, root(&[1, 2, 3, 4]));
        assert_ne!(
            base,
            Tree::build(&salts, ActivityId::new(1), 2, &[1, 2, 3, 4, 5]).root()
        );
        assert_eq!(root(&[]), hex::encode(Sha256::digest(b"")));
    }
}

//! The pre-queue draw: the order of the tickets taken before the start, as
//! a keyed permutation of their numbers. Nothing is shuffled or stored: a
//! ticket's place is computed when it is read ([`Draw::position`]), and the
//! ticket at a place when the admitter reaches it ([`Draw::ticket_at`]).
//!
//! The permutation is a balanced Feistel network over the smallest even
//! number of bits that holds the entrants, `ROUNDS` rounds of HMAC-SHA-256
//! keyed by [`Draw::key`], walked in cycles until it lands inside
//! `0..entrants`. Its key is derived from the room's seed, whose SHA-256 is
//! public from the room's creation, and from the commitment to the entrants
//! that Redis chained as they joined: neither the seed alone nor the
//! entrants alone decide the order. `scripts/verify_draw.py` recomputes it
//! from what `GET …/queue/draw` publishes; docs/WAITING_ROOM.md states it.

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = hmac::Hmac<Sha256>;

/// The name `GET …/queue/draw` publishes the algorithm under.
pub const ALGORITHM: &str = "seckill-draw-v1: Feistel-8 over HMAC-SHA-256";

/// Rounds of the Feistel network.
const ROUNDS: u8 = 8;

/// The order of a room's pre-queue tickets.
#[derive(Clone)]
pub struct Draw {
    mac: HmacSha256,
    entrants: u64,
    half_bits: u32,
}

impl Draw {
    /// The permutation key: SHA-256 of the algorithm's label, the seed's
    /// bytes, the commitment (as its text) and the entrant count (decimal).
    pub fn key(seed: &[u8], commitment: &str, entrants: u64) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"seckill-draw-v1\n");
        h.update(seed);
        h.update(b"\n");
        h.update(commitment.as_bytes());
        h.update(b"\n");
        h.update(entrants.to_string().as_bytes());
        h.finalize().into()
    }

    /// The draw of `entrants` tickets under `seed` and `commitment`.
    pub fn new(seed: &[u8], commitment: &str, entrants: u64) -> Self {
        let key = Self::key(seed, commitment, entrants);
        let bits = 64 - entrants.saturating_sub(1).leading_zeros();
        Self {
            mac: HmacSha256::new_from_slice(&key).expect("HMAC takes any key length"),
            entrants,
            half_bits: bits.div_ceil(2).max(1),
        }
    }

    /// How many tickets were drawn.
    pub fn entrants(&self) -> u64 {
        self.entrants
    }

    /// The place (0-based) of the ticket at `index` (its number minus one)
    /// among the entrants.
    pub fn position(&self, index: u64) -> u64 {
        debug_assert!(index < self.entrants);
        let mut x = self.encrypt(index);
        while x >= self.entrants {
            x = self.encrypt(x);
        }
        x
    }

    /// The index (ticket number minus one) at place `position`: the
    /// inverse of [`Draw::position`].
    pub fn ticket_at(&self, position: u64) -> u64 {
        debug_assert!(position < self.entrants);
        let mut x = self.decrypt(position);
        while x >= self.entrants {
            x = self.decrypt(x);
        }
        x
    }

    fn mask(&self) -> u64 {
        (1u64 << self.half_bits) - 1
    }

    fn round(&self, round: u8, half: u64) -> u64 {
        let mut mac = self.mac.clone();
        mac.update(&[round]);
        mac.update(&half.to_be_bytes());
        let out = mac.finalize().into_bytes();
        let mut first = [0u8; 8];
        first.copy_from_slice(&out[..8]);
        u64::from_be_bytes(first) & self.mask()
    }

    fn encrypt(&self, x: u64) -> u64 {
        let (mut left, mut right) = (x >> self.half_bits, x & self.mask());
        for r in 0..ROUNDS {
            (left, right) = (right, left ^ self.round(r, right));
        }
        (left << self.half_bits) | right
    }

    fn decrypt(&self, y: u64) -> u64 {
        let (mut left, mut right) = (y >> self.half_bits, y & self.mask());
        for r in (0..ROUNDS).rev() {
            (left, right) = (right ^ self.round(r, left), left);
        }
        (left << self.half_bits) | right
    }
}

/// Where a ticket stands in the queue: its place (0-based) in the order of
/// admission. Pre-queue tickets (`ticket <= draw.entrants()`) are drawn;
/// later ones follow in the order they joined.
pub fn place(draw: Option<&Draw>, ticket: u64) -> u64 {
    match draw {
        Some(d) if ticket >= 1 && ticket <= d.entrants() => d.position(ticket - 1),
        _ => ticket.saturating_sub(1),
    }
}

/// The ticket at `place`: the inverse of [`place`].
pub fn ticket_at(draw: Option<&Draw>, place: u64) -> u64 {
    match draw {
        Some(d) if place < d.entrants() => d.ticket_at(place) + 1,
        _ => place + 1,
    }
}

/// SHA-256 of the seed, hex: published from the room's creation on.
pub fn seed_commitment(seed: &[u8]) -> String {
    hex::encode(Sha256::digest(seed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draw_is_a_permutation_and_its_inverse_undoes_it() {
        for n in [1u64, 2, 3, 5, 16, 17, 1000, 4097] {
            let d = Draw::new(b"seed", "c", n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let p = d.position(i);
                assert!(p < n);
                assert!(!seen[p as usize], "{n}: two tickets at {p}");
                seen[p as usize] = true;
                assert_eq!(d.ticket_at(p), i);
            }
        }
    }

    #[test]
    fn the_seed_and_the_commitment_both_change_the_order() {
        let order = |seed: &[u8], c: &str| {
            let d = Draw::new(seed, c, 200);
            (0..200).map(|i| d.position(i)).collect::<Vec<_>>()
        };
        assert_eq!(order(b"a", "x"), order(b"a", "x"));
        assert_ne!(order(b"a", "x"), order(b"b", "x"));
        assert_ne!(order(b"a", "x"), order(b"a", "y"));
    }

    #[test]
    fn tickets_after_the_draw_follow_in_join_order() {
        let d = Draw::new(b"s", "c", 10);
        assert!(place(Some(&d), 10) < 10);
        assert_eq!(place(Some(&d), 11), 10);
        assert_eq!(place(None, 3), 2);
        for t in 1..=15 {
            assert_eq!(ticket_at(Some(&d), place(Some(&d), t)), t);
        }
    }
}

//! Which partition each produced message goes to.
//!
//! An order event goes to the partition of the time slice its order number
//! was minted in: every number of one [`SLICE_MS`] window goes to one
//! partition, and the next window to the next partition. At any moment the
//! producer fills one partition's batch, not one per partition. librdkafka
//! sends a produce request, and waits out a linger, per partition. Spread by
//! key hash over four partitions, every buyer served, that cost about a
//! quarter of the server's CPU per order (BENCHMARKS.md). Over a whole sale
//! the slices still spread the events evenly, so the consumers keep their
//! parallelism.
//!
//! The choice depends on the order number alone, so every send of one event
//! (a retry, a re-send by reconciliation) goes to the same partition.
//!
//! Every other message goes where librdkafka's default partitioner
//! (`consistent_random`) puts it: the CRC-32 of its key modulo the
//! partitions, or any partition for an empty key.

use std::sync::atomic::{AtomicU32, Ordering};

use rdkafka::producer::Partitioner;

use crate::ids::{OrderNo, minted_at_unix_ms};

/// How long one partition receives every order event, in ms of the order
/// numbers' clock: several lingers long, so that a partition's batches
/// fill before the next partition's turn.
pub const SLICE_MS: i64 = 32;

/// The producer's partitioner.
pub struct Partitions {
    /// The full name of `order.requested`.
    orders: String,
    /// Spreads messages with no key.
    next: AtomicU32,
}

impl Partitions {
    /// Order numbers by time slice on `orders`; key hashes elsewhere.
    pub fn new(orders: String) -> Self {
        Self {
            orders,
            next: AtomicU32::new(0),
        }
    }
}

impl Partitioner for Partitions {
    fn partition(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        count: i32,
        _available: impl Fn(i32) -> bool,
    ) -> i32 {
        if count < 1 {
            return rdkafka::producer::PARTITION_UA;
        }
        let key = key.unwrap_or_default();
        if topic == self.orders
            && let Some(n) = std::str::from_utf8(key).ok().and_then(OrderNo::parse)
        {
            return of_order(n, count);
        }
        if key.is_empty() {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            return i32::try_from(n % count.unsigned_abs()).unwrap_or(0);
        }
        of_key(key, count)
    }
}

/// The partition of order `n`'s event among `count`.
pub fn of_order(n: OrderNo, count: i32) -> i32 {
    let slice = minted_at_unix_ms(n.get()) / SLICE_MS;
    i32::try_from(slice.rem_euclid(i64::from(count))).unwrap_or(0)
}

/// librdkafka's `consistent` partition of `key` among `count`.
pub fn of_key(key: &[u8], count: i32) -> i32 {
    i32::try_from(crc32fast::hash(key) % count.unsigned_abs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Snowflake;

    #[test]
    fn other_keys_go_where_librdkafkas_default_puts_them() {
        for count in [1, 3, 4, 16] {
            for i in 0..2_000u32 {
                let key = format!("release-{i}-{}", i.wrapping_mul(2_654_435_761));
                // SAFETY: the consistent partitioner only hashes the key;
                // it reads neither the topic nor the opaques.
                let theirs = unsafe {
                    rdkafka::bindings::rd_kafka_msg_partitioner_consistent(
                        std::ptr::null(),
                        key.as_ptr().cast(),
                        key.len(),
                        count,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                };
                assert_eq!(of_key(key.as_bytes(), count), theirs, "{key} of {count}");
            }
        }
    }

    #[test]
    fn one_slice_of_order_numbers_shares_a_partition_and_the_slices_take_turns() {
        let ids = Snowflake::new(7);
        let start = 1_000_000 * SLICE_MS as u64;
        let mut seen = [0u32; 4];
        for slice in 0..400u64 {
            let at = start + slice * SLICE_MS as u64;
            let first = of_order(OrderNo::new(ids.next_at(at)), 4);
            let last = of_order(OrderNo::new(ids.next_at(at + SLICE_MS as u64 - 1)), 4);
            assert_eq!(first, last, "slice {slice}");
            seen[first as usize] += 1;
        }
        assert_eq!(seen, [100; 4], "every partition takes its turn");
    }

    #[test]
    fn every_send_of_an_event_goes_to_one_partition_and_other_topics_hash() {
        let p = Partitions::new("x.order.requested".into());
        let n = Snowflake::new(3).next_at(5_000_000);
        let key = n.to_string();
        let once = p.partition("x.order.requested", Some(key.as_bytes()), 4, |_| true);
        for _ in 0..10 {
            assert_eq!(
                p.partition("x.order.requested", Some(key.as_bytes()), 4, |_| true),
                once
            );
        }
        assert_eq!(once, of_order(OrderNo::new(n), 4));
        assert_eq!(
            p.partition("x.stock.released", Some(key.as_bytes()), 4, |_| true),
            of_key(key.as_bytes(), 4)
        );
        // A key that is no order number, and no key at all.
        let odd = p.partition("x.order.requested", Some(b"not-a-number"), 4, |_| true);
        assert_eq!(odd, of_key(b"not-a-number", 4));
        let spread: std::collections::BTreeSet<i32> = (0..8)
            .map(|_| p.partition("x.order.paid", None, 4, |_| true))
            .collect();
        assert_eq!(spread.len(), 4);
    }
}

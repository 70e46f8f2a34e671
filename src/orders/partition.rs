//! The order table's partitions (migration `..._orders_partitioned`): 16,
//! one per buyer slot, `user_slot = splitmix64(user_id) mod 16`. One
//! user's orders are in one partition, and every order number carries
//! its buyer's gene in its low bits ([`crate::ids::GENE_BITS`]), whose low 4
//! bits are the slot, so a lookup by number reads one partition too
//! (`user_slot = seckill_order_slot(order_no)` in SQL: the gene, or for
//! a number minted before the table was split, the row's own slot).
//!
//! A sharded activity's Redis shard is the gene modulo its shards, so
//! the same gene names both.

pub use crate::ids::{PARTITIONS, user_slot};

/// [`user_slot`] as the column's type.
pub fn user_slot_column(user_id: i64) -> i16 {
    i16::from(user_slot(user_id))
}

diesel::define_sql_function! {
    /// The partition slot of the order numbered `n` (the migration's
    /// `seckill_order_slot`): filter `user_slot` on it and the executor
    /// reads one partition.
    fn seckill_order_slot(n: diesel::sql_types::BigInt) -> diesel::sql_types::SmallInt;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_databases_and_spread_evenly() {
        // seckill_user_slot(1), (2), (42), (i64::MAX) in PostgreSQL.
        assert_eq!(
            [1, 2, 42, i64::MAX].map(user_slot),
            [1, 14, 5, 7],
            "the same function as the migration's"
        );
        let mut counts = [0u32; PARTITIONS as usize];
        for user in 1..=160_000 {
            counts[user_slot(user) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&n| (9_500..=10_500).contains(&n)),
            "{counts:?}"
        );
    }
}

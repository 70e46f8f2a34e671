//! Units lent between the shards of a hot activity (`lua/lend.lua`, then
//! `lua/borrow.lua`; docs/HOT_ACTIVITY.md).

use redis::RedisResult;

use super::RedisGate;
use super::attempt::ReserveRequest;
use crate::admission::keys::Layout;
use crate::domain::ActivityId;

/// How long a shard that found every other shard empty answers SOLD_OUT
/// without asking them again: a release elsewhere is seen within this.
pub(super) const DRY_MS: u64 = 200;

/// Most rounds of borrowing one purchase goes through.
pub(super) const BORROW_ROUNDS: usize = 8;

/// A transfer between shards older than this was left part way (a live one
/// takes three round trips): a purchase that keeps finding units on their
/// way completes it.
pub(super) const STALE_TRANSFER_MS: i64 = 1000;

/// The pause before looking again at units on their way between shards
/// (a transfer takes three round trips).
pub(super) const IN_FLIGHT_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

/// What asking another shard to lend found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lend {
    /// Units moved to the buyer's shard.
    Lent,
    /// None to lend, but units lent earlier may still be on their way.
    InFlight,
    /// None to lend.
    Nothing,
}

/// Units one shard lent another, not yet settled.
#[derive(Debug)]
pub(super) struct Transfer {
    pub(super) donor: usize,
    pub(super) id: String,
    pub(super) home: usize,
    pub(super) units: i64,
    pub(super) at_ms: i64,
}

impl RedisGate {
    /// Asks the other shards in turn to lend to `home`, until one does.
    pub(super) async fn borrow_round(
        &self,
        r: &ReserveRequest<'_>,
        home: usize,
    ) -> RedisResult<Lend> {
        let mut verdict = Lend::Nothing;
        for step in 1..r.layout.shards {
            let donor = (home + step) % r.layout.shards;
            match self.transfer(r, home, donor).await? {
                Lend::Lent => return Ok(Lend::Lent),
                Lend::InFlight => verdict = Lend::InFlight,
                Lend::Nothing => {}
            }
        }
        Ok(verdict)
    }

    /// Moves a batch of units from shard `donor` to shard `home` (lend,
    /// borrow, settle: docs/HOT_ACTIVITY.md). A failure part way leaves a
    /// transfer record in the donor, which [`RedisGate::settle_transfers`]
    /// completes.
    async fn transfer(
        &self,
        r: &ReserveRequest<'_>,
        home: usize,
        donor: usize,
    ) -> RedisResult<Lend> {
        let layout = r.layout;
        // Unique per transfer: one purchase may borrow from the same donor
        // twice, and a repeated id would find its credit already given.
        let id = format!("{}.{donor}.{:x}", r.order_no, fastrand::u64(..));
        let from = self.shard_keys(r.activity_id, layout, donor);
        let mut call = self.lend.prepare_invoke();
        call.key(from.lent());
        for b in 0..layout.buckets {
            call.key(from.bucket(b));
        }
        let lent: i64 = call
            .arg(&id)
            .arg(r.quantity)
            .arg(home)
            .arg(r.now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        if lent < 0 {
            return Ok(Lend::InFlight);
        }
        if lent == 0 {
            return Ok(Lend::Nothing);
        }
        self.credit(r.activity_id, layout, home, &id, lent).await?;
        let _: i64 = redis::cmd("HDEL")
            .arg(from.lent())
            .arg(&id)
            .query_async(&mut self.conn.clone())
            .await?;
        tracing::debug!(
            activity_id = %r.activity_id,
            home,
            donor,
            lent,
            "units moved between shards"
        );
        Ok(Lend::Lent)
    }

    /// Credits shard `home` with transfer `id`'s units, once (`borrow.lua`).
    async fn credit(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        home: usize,
        id: &str,
        units: i64,
    ) -> RedisResult<bool> {
        let to = self.shard_keys(activity_id, layout, home);
        let mut call = self.borrow.prepare_invoke();
        call.key(to.credited(id)).key(to.dry());
        for b in 0..layout.buckets {
            call.key(to.bucket(b));
        }
        let credited: i64 = call
            .arg(units)
            .arg(fastrand::usize(..layout.buckets))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(credited == 1)
    }

    /// The transfers the shards have lent and not yet settled.
    pub(super) async fn transfers(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<Vec<Transfer>> {
        let mut found = Vec::new();
        if !layout.is_sharded() {
            return Ok(found);
        }
        for donor in 0..layout.shards {
            let lent: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(self.shard_keys(activity_id, layout, donor).lent())
                .query_async(&mut self.conn.clone())
                .await?;
            for (id, record) in lent {
                let mut parts = record.split(':').map(str::parse::<i64>);
                if let (Some(Ok(home)), Some(Ok(units)), Some(Ok(at_ms))) =
                    (parts.next(), parts.next(), parts.next())
                {
                    found.push(Transfer {
                        donor,
                        id,
                        home: usize::try_from(home).unwrap_or(0) % layout.shards,
                        units,
                        at_ms,
                    });
                }
            }
        }
        Ok(found)
    }

    /// Completes transfers lent before `before_ms` and never settled (the
    /// lending process died part way): credits the home shard unless it
    /// was credited, then drops the record. Returns how many it completed.
    /// Reconciliation only.
    pub async fn settle_transfers(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        before_ms: i64,
    ) -> RedisResult<usize> {
        let mut settled = 0;
        for t in self.transfers(activity_id, layout).await? {
            if t.at_ms >= before_ms {
                continue;
            }
            self.credit(activity_id, layout, t.home, &t.id, t.units)
                .await?;
            let _: i64 = redis::cmd("HDEL")
                .arg(self.shard_keys(activity_id, layout, t.donor).lent())
                .arg(&t.id)
                .query_async(&mut self.conn.clone())
                .await?;
            settled += 1;
        }
        Ok(settled)
    }
}

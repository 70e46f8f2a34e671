//! The reconcile lease, held for one run: taken with a fencing token,
//! renewed in the background every third of its lifetime, and given back
//! however the run ends — returned, failed, or its future dropped (an
//! operator's `POST /admin/reconcile` whose client hung up). A renewal
//! that outlived its run would keep every other instance's reconciler out
//! for as long as this process lives.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::store::notes::Notes;

/// A lease held by this run; given back when dropped.
pub struct Held {
    notes: Notes,
    name: &'static str,
    owner: String,
    token: i64,
    /// False once a renewal found the lease gone or taken by another.
    held: Arc<AtomicBool>,
    renewing: tokio::task::JoinHandle<()>,
}

impl Held {
    /// Takes `name` for `owner` for `ttl`, unless another owner holds it.
    /// Must be called inside a Tokio runtime.
    pub async fn take(
        notes: &Notes,
        name: &'static str,
        owner: &str,
        ttl: Duration,
    ) -> redis::RedisResult<Option<Self>> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let Some(token) = notes.take_lease(name, owner, ttl_ms).await? else {
            return Ok(None);
        };
        let held = Arc::new(AtomicBool::new(true));
        let renewing = tokio::spawn(renew(
            notes.clone(),
            name,
            owner.to_owned(),
            token,
            ttl,
            held.clone(),
        ));
        Ok(Some(Self {
            notes: notes.clone(),
            name,
            owner: owner.to_owned(),
            token,
            held,
            renewing,
        }))
    }

    /// Whether the lease is still this run's, as far as the last renewal
    /// knew. A write must still carry [`Held::token`]: a process paused
    /// past the lifetime learns it lost the lease only afterwards.
    pub fn holds(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The fencing token of this holding.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// Stops renewing and gives the lease back now.
    pub async fn end(self) {
        self.renewing.abort();
        if let Err(e) = self.notes.end_lease(self.name, &self.owner).await {
            tracing::debug!(error = %e, lease = self.name, "lease not given back; it expires");
        }
        // Given back: the drop has nothing left to do.
        self.held.store(false, Ordering::Release);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renewing.abort();
        if !self.held.swap(false, Ordering::AcqRel) {
            return;
        }
        // Dropped mid-run: give it back from a task of its own (a drop
        // cannot wait), or let it expire if no runtime is left.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (notes, name, owner) = (self.notes.clone(), self.name, self.owner.clone());
            runtime.spawn(async move {
                if let Err(e) = notes.end_lease(name, &owner).await {
                    tracing::debug!(error = %e, lease = name, "lease not given back; it expires");
                }
            });
        }
    }
}

/// Renews every third of `ttl` while the lease is this holding's; marks it
/// lost once a renewal is refused, or once none succeeded for a lifetime.
async fn renew(
    notes: Notes,
    name: &'static str,
    owner: String,
    token: i64,
    ttl: Duration,
    held: Arc<AtomicBool>,
) {
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    let mut renewed = Instant::now();
    loop {
        tokio::time::sleep(ttl / 3).await;
        match notes.renew_lease(name, &owner, token, ttl_ms).await {
            Ok(true) => renewed = Instant::now(),
            Ok(false) => break,
            Err(e) => {
                tracing::warn!(error = %e, lease = name, "lease not renewed");
                if renewed.elapsed() >= ttl {
                    break;
                }
            }
        }
    }
    held.store(false, Ordering::Release);
}

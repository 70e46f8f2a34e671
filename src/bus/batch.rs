//! How a consumer fills a batch: up to N messages or T ms after the first,
//! and longer while this instance is in a rush of purchases.
//!
//! A sale's first moment is the most expensive one: every purchase runs the
//! admission script until the units are gone, and each accepted one waits
//! for its event's acknowledgement. Order batches of 20 ms each, committed
//! to PostgreSQL at that moment, take the CPU from those purchases, and the
//! queue that forms then is what a buyer waits in (docs/BENCHMARKS-HISTORY.md,
//! "The first second of a sale"). While more purchases are in flight than
//! [`Rush::threshold`], a batch waits up to [`Rush::wait`] to fill, and the
//! consumer applies one batch at a time ([`super::runner`]): the orders of
//! the first moment are written a few hundred milliseconds later, in one
//! transaction instead of a dozen.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

/// The purchases in flight on this instance, as a consumer sees them.
#[derive(Debug, Clone)]
pub struct Rush {
    /// The admission path's in-flight permits (`admission.max_in_flight`).
    pub in_flight: Arc<Semaphore>,
    /// Their number.
    pub max: usize,
    /// More purchases in flight than this is a rush (`orders.rush_in_flight`).
    pub threshold: usize,
    /// How long a batch waits to fill during one (`orders.rush_batch_wait_ms`).
    pub wait: Duration,
}

impl Rush {
    /// Whether more purchases are in flight than the threshold.
    pub fn on(&self) -> bool {
        self.max.saturating_sub(self.in_flight.available_permits()) > self.threshold
    }
}

/// Fills a batch that starts with `first`: receives until it holds `max`,
/// until `wait` after it began, or until `recv` fails (None). While `rush`
/// is on when that wait ends, waits on in steps of `wait`, up to the rush's
/// own wait after the batch began.
pub async fn fill<T, F, Fut>(
    first: T,
    max: usize,
    wait: Duration,
    rush: Option<&Rush>,
    mut recv: F,
) -> Vec<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let began = Instant::now();
    let mut batch = vec![first];
    let mut deadline = began + wait;
    loop {
        while batch.len() < max {
            match tokio::time::timeout_at(deadline, recv()).await {
                Ok(Some(m)) => batch.push(m),
                Ok(None) => return batch,
                Err(_) => break,
            }
        }
        let longest = match rush {
            Some(r) if batch.len() < max && r.on() => began + r.wait,
            _ => return batch,
        };
        if deadline >= longest {
            return batch;
        }
        deadline = (deadline + wait.max(Duration::from_millis(1))).min(longest);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Messages due at `offset`, then one every `every`, from the call;
    /// a receive dropped before its message is due does not take it.
    fn ticking(
        offset: Duration,
        every: Duration,
    ) -> impl FnMut() -> std::pin::Pin<Box<dyn Future<Output = Option<u32>>>> {
        let start = Instant::now();
        let taken = std::rc::Rc::new(std::cell::Cell::new(0u32));
        move || {
            let taken = taken.clone();
            Box::pin(async move {
                let i = taken.get();
                tokio::time::sleep_until(start + offset + every * i).await;
                taken.set(i + 1);
                Some(i + 1)
            })
        }
    }

    /// A rush of threshold 64 and a wait of 300 ms, with `in_use` of its
    /// 100 permits held (as long as the second half lives).
    pub(crate) fn rush(in_use: u32) -> (Rush, Option<tokio::sync::OwnedSemaphorePermit>) {
        let in_flight = Arc::new(Semaphore::new(100));
        let held = (in_use > 0).then(|| in_flight.clone().try_acquire_many_owned(in_use).unwrap());
        let rush = Rush {
            in_flight,
            max: 100,
            threshold: 64,
            wait: Duration::from_millis(300),
        };
        (rush, held)
    }

    /// A batch of at most `max` with a 20 ms wait, from messages at 3 ms
    /// and every 5 ms after: the batch, and how long it took.
    async fn every_5_ms(max: usize, rush: &Rush) -> (Vec<u32>, Duration) {
        let began = Instant::now();
        let ticks = ticking(Duration::from_millis(3), Duration::from_millis(5));
        let batch = fill(0, max, Duration::from_millis(20), Some(rush), ticks).await;
        (batch, began.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_instance_closes_a_batch_at_its_wait() {
        let (quiet, _held) = rush(64);
        assert!(!quiet.on());
        let (batch, took) = every_5_ms(1000, &quiet).await;
        assert_eq!(took, Duration::from_millis(20));
        assert_eq!(batch, vec![0, 1, 2, 3, 4], "messages at 3, 8, 13 and 18 ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rush_holds_the_batch_up_to_its_own_wait() {
        let (busy, _held) = rush(65);
        assert!(busy.on());
        let (batch, took) = every_5_ms(1000, &busy).await;
        assert_eq!(took, Duration::from_millis(300));
        assert_eq!(batch.len(), 61, "messages at 3, 8, … 298 ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_closes_when_the_rush_ends() {
        let (busy, held) = rush(80);
        let ends = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(90)).await;
            drop(held);
        });
        let (batch, took) = every_5_ms(1000, &busy).await;
        ends.await.unwrap();
        assert_eq!(
            took,
            Duration::from_millis(100),
            "the first step after the rush ended"
        );
        assert_eq!(batch.len(), 21, "messages at 3, 8, … 98 ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_does_not_wait_for_the_rush() {
        let (busy, _held) = rush(90);
        let (batch, took) = every_5_ms(10, &busy).await;
        assert_eq!(
            took,
            Duration::from_millis(43),
            "at the ninth message, within the rush"
        );
        assert_eq!(batch.len(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_receive_closes_the_batch_at_once() {
        let (busy, _held) = rush(90);
        let mut n = 0;
        let batch = fill(0, 1000, Duration::from_millis(20), Some(&busy), move || {
            n += 1;
            let i = n;
            async move { (i < 3).then_some(i) }
        })
        .await;
        assert_eq!(batch, vec![0, 1, 2]);
    }
}

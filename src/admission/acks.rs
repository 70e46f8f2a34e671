//! Acknowledgements recorded on reservations, off the request path: the
//! purchase route queues one and answers; one task writes whatever is
//! queued, one `ack.lua` call per activity, so many purchases share a round
//! trip. An acknowledged reservation is never voided (SPEC step 4): if the
//! broker loses its event after all, reconciliation sends it again.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::{Layout, RedisGate};
use crate::clock::SharedClock;
use crate::domain::ActivityId;

/// `(activity_id, its layout, order_no)`.
type Ack = (ActivityId, Layout, i64);

/// Most acknowledgements taken off the queue at once.
const MAX_BATCH: usize = 512;

/// Writes one activity's acknowledgements, again and again until Redis
/// takes them. One not recorded would leave an accepted purchase looking
/// like an orphan; meanwhile the queue fills and new purchases wait (503
/// BUSY), which is what a Redis that takes no writes should cause.
async fn write_until_recorded(
    gate: &RedisGate,
    activity_id: ActivityId,
    layout: Layout,
    order_nos: &[i64],
    now: i64,
) {
    let mut attempt = 0u32;
    while let Err(e) = gate.ack(activity_id, layout, order_nos, now).await {
        attempt += 1;
        if attempt == 1 || attempt.is_power_of_two() {
            tracing::warn!(
                error = %e,
                activity_id = %activity_id,
                count = order_nos.len(),
                attempt,
                "acknowledgements not recorded on their reservations yet; retrying"
            );
        }
        tokio::time::sleep(crate::bus::runner::backoff(attempt)).await;
    }
}

/// The queue of acknowledgements; cheap to clone. Bounded: while Redis
/// falls behind and it is full, purchases get 503 BUSY before anything is
/// reserved ([`Acks::has_room`]), and an acknowledgement that still finds
/// it full waits for room in its delivery task; none is dropped.
#[derive(Clone)]
pub struct Acks {
    tx: mpsc::Sender<Ack>,
}

impl Acks {
    /// Starts the writer on the current runtime, with room for `capacity`
    /// queued acknowledgements; it ends once every `Acks` is dropped and
    /// the queue is written.
    pub fn start(gate: Arc<RedisGate>, capacity: usize, clock: SharedClock) -> Self {
        let (tx, mut rx) = mpsc::channel::<Ack>(capacity.max(1));
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(MAX_BATCH);
            let mut by_activity: HashMap<(ActivityId, Layout), Vec<i64>> = HashMap::new();
            while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
                for (activity_id, layout, order_no) in batch.drain(..) {
                    by_activity
                        .entry((activity_id, layout))
                        .or_default()
                        .push(order_no);
                }
                let now = clock.now_ms();
                for ((activity_id, layout), order_nos) in by_activity.drain() {
                    write_until_recorded(&gate, activity_id, layout, &order_nos, now).await;
                }
            }
        });
        Self { tx }
    }

    /// Queues the acknowledgement of one purchase, waiting for room.
    pub async fn ack(&self, activity_id: ActivityId, layout: Layout, order_no: i64) {
        // The writer only stops when the process does.
        let _ = self.tx.send((activity_id, layout, order_no)).await;
    }

    /// Whether the queue has room: a new purchase is refused (503 BUSY)
    /// while it has none.
    pub fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }

    /// Acknowledgements queued and not taken by the writer yet.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    #[tokio::test]
    async fn the_queue_is_bounded_while_redis_does_not_answer() {
        // A "Redis" that accepts connections and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = silent.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                open.push(socket);
            }
        });
        let mut settings = Settings::load_env("test").unwrap();
        settings.redis.url = format!("redis://{address}");
        let gate = Arc::new(RedisGate::new(&settings.redis, &settings.admission, None).unwrap());
        let acks = Acks::start(gate, 2, Arc::new(crate::clock::SystemClock));
        assert!(acks.has_room());
        // The writer takes what is queued and hangs on it; what comes after
        // fills the queue, whatever the scheduling.
        let mut queued = 0;
        while acks.has_room() && queued < 10 {
            acks.ack(ActivityId::new(1), Layout::single(1), queued)
                .await;
            queued += 1;
            tokio::task::yield_now().await;
        }
        assert!(
            !acks.has_room(),
            "full after {queued} behind a silent Redis"
        );
        held.abort();
    }
}

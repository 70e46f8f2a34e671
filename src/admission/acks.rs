//! Acknowledgements recorded on reservations, off the request path: the
//! purchase route queues one and answers; one task writes whatever is
//! queued, one `ack.lua` call per activity, so many purchases share a round
//! trip. An acknowledged reservation is never voided (SPEC step 4): if the
//! broker loses its event after all, reconciliation sends it again.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::RedisGate;

/// `(activity_id, order_no)`.
type Ack = (i64, i64);

/// Most acknowledgements taken off the queue at once.
const MAX_BATCH: usize = 512;

/// The queue of acknowledgements; cheap to clone.
#[derive(Clone)]
pub struct Acks {
    tx: mpsc::UnboundedSender<Ack>,
}

impl Acks {
    /// Starts the writer on the current runtime; it ends once every `Acks`
    /// is dropped and the queue is written.
    pub fn start(gate: Arc<RedisGate>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Ack>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(MAX_BATCH);
            let mut by_activity: HashMap<i64, Vec<i64>> = HashMap::new();
            while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
                for (activity_id, order_no) in batch.drain(..) {
                    by_activity.entry(activity_id).or_default().push(order_no);
                }
                let now = chrono::Utc::now().timestamp_millis();
                for (activity_id, order_nos) in by_activity.drain() {
                    // Best effort: an acknowledgement not recorded leaves the
                    // reservation voidable once provably unapplied, the case
                    // a broker that lost an acknowledged write creates.
                    if let Err(e) = gate.ack(activity_id, &order_nos, now).await {
                        tracing::warn!(
                            error = %e,
                            activity_id,
                            count = order_nos.len(),
                            "acknowledgements not recorded on their reservations"
                        );
                    }
                }
            }
        });
        Self { tx }
    }

    /// Queues the acknowledgement of one purchase.
    pub fn ack(&self, activity_id: i64, order_no: i64) {
        // The writer only stops when the process does.
        let _ = self.tx.send((activity_id, order_no));
    }
}

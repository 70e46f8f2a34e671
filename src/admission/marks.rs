//! Acknowledged events kept on their reservations, off the request path: the
//! purchase route queues a mark and answers; one task writes whatever marks
//! are queued in a single pipeline, so many purchases share a round trip.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::RedisGate;

/// `(activity_id, order_no, event payload)`.
type Mark = (i64, i64, Vec<u8>);

/// Most marks written in one pipeline.
const MAX_BATCH: usize = 512;

/// The queue of marks; cheap to clone.
#[derive(Clone)]
pub struct PublishedMarks {
    tx: mpsc::UnboundedSender<Mark>,
}

impl PublishedMarks {
    /// Starts the writer on the current runtime; it ends once every
    /// `PublishedMarks` is dropped and the queue is written.
    pub fn start(gate: Arc<RedisGate>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Mark>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(MAX_BATCH);
            while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
                // Best effort: without its mark, a purchase whose event the
                // broker loses ends FAILED instead of being published again.
                if let Err(e) = gate.mark_published(&batch).await {
                    tracing::warn!(
                        error = %e,
                        count = batch.len(),
                        "acknowledged events not kept on their reservations"
                    );
                }
                batch.clear();
            }
        });
        Self { tx }
    }

    /// Queues the mark of one acknowledged purchase.
    pub fn mark(&self, activity_id: i64, order_no: i64, payload: Vec<u8>) {
        // The writer only stops when the process does.
        let _ = self.tx.send((activity_id, order_no, payload));
    }
}

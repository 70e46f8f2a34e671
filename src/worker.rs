//! A background task that stops cleanly: every worker (consumers, timeout
//! closer, outbox relay) runs as one, so `serve` can stop them all the same
//! way after the HTTP server has drained.

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A running worker.
pub struct WorkerHandle {
    shutdown: CancellationToken,
    join: JoinHandle<()>,
}

impl WorkerHandle {
    /// Spawns `work` on the current runtime; it gets the token that asks it
    /// to stop and must return once it is cancelled.
    pub fn spawn<F, Fut>(work: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let shutdown = CancellationToken::new();
        let join = tokio::spawn(work(shutdown.clone()));
        Self { shutdown, join }
    }

    /// Asks the worker to finish what it has in hand, and waits for it.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
    }

    /// Stops it at once, wherever it is (tests simulate a crash with this),
    /// and waits until the task is gone. A Kafka consumer it owned is then
    /// closed on a thread of its own, and leaves its group shortly after.
    pub async fn abort(self) {
        self.join.abort();
        let _ = self.join.await;
    }
}

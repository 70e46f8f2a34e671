//! Destroying a librdkafka client off every thread that has other work.
//!
//! A consumer's destructor closes it: it commits the stored offsets,
//! leaves the group, and polls until librdkafka says it is closed, with no
//! bound. Against a group coordinator in a broken state (after a broker
//! stall, librdkafka #4027) that is for ever. Run where it happens to be
//! dropped, that wait takes the thread with it: a runtime worker, every
//! task of a current-thread runtime, or a runtime shutting down, which
//! drops its tasks (and the clients they hold) on its own thread and then
//! waits for its blocking pool. [`OffThread`] gives the destructor a thread
//! of its own; whoever needs the close to have finished waits for it with
//! a deadline ([`OffThread::destroy_within`]).

use std::ops::Deref;
use std::time::Duration;

/// A client whose destructor runs on a thread of its own. Dereferences to
/// the client.
pub struct OffThread<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> OffThread<T> {
    /// Wraps `client`.
    pub fn new(client: T) -> Self {
        Self(Some(client))
    }

    /// Destroys the client on a thread of its own and waits until it is
    /// destroyed, at most `within`. True if it was; if not, it goes on by
    /// itself and nobody waits for it.
    pub async fn destroy_within(mut self, within: Duration) -> bool {
        let Some(client) = self.0.take() else {
            return true;
        };
        let (done, destroyed) = tokio::sync::oneshot::channel();
        destroy(client, Some(done));
        tokio::time::timeout(within, destroyed).await.is_ok()
    }
}

impl<T: Send + 'static> Deref for OffThread<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0
            .as_ref()
            .expect("only destroy_within takes the client, and it consumes the wrapper")
    }
}

impl<T: Send + 'static> Drop for OffThread<T> {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            destroy(client, None);
        }
    }
}

/// Drops `client` on a new thread, then says so on `done`.
fn destroy<T: Send + 'static>(client: T, done: Option<tokio::sync::oneshot::Sender<()>>) {
    let spawned = std::thread::Builder::new()
        .name("kafka-close".into())
        .spawn(move || {
            drop(client);
            if let Some(done) = done {
                let _ = done.send(());
            }
        });
    if let Err(e) = spawned {
        // The closure, and the client in it, were dropped here already:
        // nothing else to do but say why this thread may have waited.
        tracing::warn!(error = %e, "no thread to close a Kafka client on; closed in place");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Stands for a client whose destructor waits until it is let go.
    struct Stuck {
        release: mpsc::Receiver<()>,
        destroyed: mpsc::Sender<()>,
    }

    impl Drop for Stuck {
        fn drop(&mut self) {
            let _ = self.release.recv();
            let _ = self.destroyed.send(());
        }
    }

    fn stuck() -> (Stuck, mpsc::Sender<()>, mpsc::Receiver<()>) {
        let (release, released) = mpsc::channel();
        let (destroyed, was_destroyed) = mpsc::channel();
        let client = Stuck {
            release: released,
            destroyed,
        };
        (client, release, was_destroyed)
    }

    #[test]
    fn dropping_returns_while_the_destructor_still_waits_and_it_finishes_later() {
        let (client, release, destroyed) = stuck();
        // Let go of it 2 s from now: a drop in place would return then,
        // with the destructor done.
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            let _ = release.send(());
        });
        drop(OffThread::new(client));
        assert!(
            destroyed.try_recv().is_err(),
            "the drop waited for the destructor"
        );
        destroyed
            .recv_timeout(Duration::from_secs(60))
            .expect("destroyed once let go");
        letting_go.join().expect("the letting-go thread ends");
    }

    #[tokio::test]
    async fn destroy_within_gives_up_at_its_deadline_and_waits_for_a_quick_one() {
        let (client, release, destroyed) = stuck();
        let wrapped = OffThread::new(client);
        assert!(!wrapped.destroy_within(Duration::from_millis(50)).await);
        release.send(()).expect("the stuck client listens");
        destroyed
            .recv_timeout(Duration::from_secs(60))
            .expect("destroyed once let go");

        let (client, release, destroyed) = stuck();
        release.send(()).expect("the stuck client listens");
        let wrapped = OffThread::new(client);
        assert!(wrapped.destroy_within(Duration::from_secs(60)).await);
        assert!(destroyed.try_recv().is_ok());
    }

    #[test]
    fn the_client_is_reachable_through_the_wrapper() {
        let wrapped = OffThread::new(vec![1, 2, 3]);
        assert_eq!(wrapped.len(), 3);
    }
}

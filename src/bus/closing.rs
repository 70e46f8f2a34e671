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
//!
//! A close that never ends keeps its thread for good, so they are counted:
//! [`stuck`] closes past [`STUCK_AFTER`] are what a supervisor weighs
//! before it rebuilds a client once more, and at [`MAX_STUCK`] the process
//! gives up and exits to be restarted instead of adding threads without
//! bound. A client for which no thread can be made is leaked, never closed
//! in place: its destructor would take the thread that dropped it.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A close that has not ended after this long is stuck: a healthy one
/// takes milliseconds, and a group's session timeout is 10 s.
pub const STUCK_AFTER: Duration = Duration::from_secs(30);

/// Stuck closes at which supervisors stop rebuilding and the process
/// gives up (each holds a thread, and librdkafka's own threads with it).
pub const MAX_STUCK: usize = 8;

/// When each close still under way began, by a number of its own.
static CLOSING: Mutex<Option<HashMap<u64, Instant>>> = Mutex::new(None);
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Closes under way for longer than [`STUCK_AFTER`].
pub fn stuck() -> usize {
    stuck_at(Instant::now())
}

fn stuck_at(now: Instant) -> usize {
    CLOSING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map_or(0, |m| {
            m.values()
                .filter(|&&began| now.duration_since(began) >= STUCK_AFTER)
                .count()
        })
}

/// Records a close beginning; its number.
fn began() -> u64 {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    CLOSING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(id, Instant::now());
    id
}

/// When close `id` began, while it is under way.
#[cfg(test)]
fn under_way(id: u64) -> Option<Instant> {
    CLOSING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&id).copied())
}

fn ended(id: u64) {
    if let Some(m) = CLOSING.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        m.remove(&id);
    }
}

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

/// Drops `client` on a new thread, then says so on `done`. With no
/// thread to be had, the client is leaked instead: never destroyed on the
/// thread that let go of it.
fn destroy<T: Send + 'static>(client: T, done: Option<tokio::sync::oneshot::Sender<()>>) {
    // Out of the closure's reach until its thread runs, so that a failed
    // spawn, which drops the closure here, does not drop the client here.
    let slot = std::sync::Arc::new(Mutex::new(Some(client)));
    let id = began();
    let theirs = slot.clone();
    let spawned = std::thread::Builder::new()
        .name("kafka-close".into())
        .spawn(move || {
            let client = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
            drop(client);
            ended(id);
            if let Some(done) = done {
                let _ = done.send(());
            }
        });
    if let Err(e) = spawned {
        ended(id);
        let client = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        std::mem::forget(client);
        tracing::warn!(error = %e, "no thread to close a Kafka client on; leaking it");
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
    fn a_close_under_way_counts_as_stuck_only_past_its_time_and_not_once_ended() {
        let id = began();
        let since = under_way(id).expect("recorded");
        // Other tests' closes come and go meanwhile: only this one's
        // record is looked at, and counts only grow with it.
        assert!(since + STUCK_AFTER > Instant::now(), "fresh, not stuck");
        assert!(
            stuck_at(since + STUCK_AFTER) >= 1,
            "stuck once past its time"
        );
        ended(id);
        assert!(under_way(id).is_none());
    }

    #[test]
    fn a_destroyed_client_leaves_no_close_under_way() {
        let before = NEXT.load(Ordering::Relaxed);
        drop(OffThread::new(vec![1, 2, 3]));
        let deadline = Instant::now() + Duration::from_secs(60);
        // Its close has a number at or after `before`; once the thread
        // ran, none of the numbers it could have is under way (unless
        // another test's stuck client took one of them).
        loop {
            let mine_left = CLOSING
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_some_and(|m| m.keys().any(|&k| k == before));
            if !mine_left {
                break;
            }
            assert!(Instant::now() < deadline, "the close never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn the_client_is_reachable_through_the_wrapper() {
        let wrapped = OffThread::new(vec![1, 2, 3]);
        assert_eq!(wrapped.len(), 3);
    }
}

//! Order status changes, pushed to whoever follows an order
//! (`GET /api/v1/orders/{order_no}/events`) instead of making it poll.
//!
//! Each place that commits a change — the order consumer's batch, the
//! payment callback, a cancel, the timeout closer, a voided reservation —
//! calls [`OrderEvents::publish`] after its transaction. One Redis PUBLISH
//! per call carries every change of it; every instance's [`listen`] task
//! hands each change to the streams that follow its order, and to no
//! other: a stream is woken by its own order's changes only, however many
//! others change (10,000 a second beside 1,000 open streams cost those
//! streams nothing). A stream costs no database query while it waits: it
//! reads its order once when it opens, and again only when changes may
//! have been missed (the subscription was lost, or it fell behind its own
//! order's changes): [`Note::Resync`].
//!
//! Delivery is best effort, by design: a change is in the database before
//! it is announced, so a stream that missed one reads it on its resync, and
//! a client that lost its stream asks `GET /api/v1/orders/{order_no}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::OrderStatus;
use crate::store::redis_conn::{self, RedisConn, Subscription};

/// One order's new status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusChange {
    /// The order.
    pub order_no: i64,
    /// Its status now.
    pub status: OrderStatus,
}

/// What a stream hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// An order changed.
    Change(StatusChange),
    /// Changes may have been missed: read the order again.
    Resync,
}

/// A stream this far behind its order's changes gets a resync instead of
/// the changes it missed (an order changes a handful of times in all).
const BUFFER: usize = 16;

/// The channel of `redis.key_prefix`.
pub fn channel(key_prefix: &str) -> String {
    format!("{key_prefix}order-status")
}

/// The publishing side and this instance's followers, by order.
pub struct OrderEvents {
    followers: Followers,
    conn: RedisConn,
    channel: String,
}

/// One channel per order that open streams follow.
type Followers = Arc<Mutex<HashMap<i64, broadcast::Sender<Note>>>>;

/// A stream's hold on its order's changes; dropping it unfollows (the
/// order's channel goes with its last follower).
pub struct Following {
    notes: Option<broadcast::Receiver<Note>>,
    followers: Followers,
    order_no: i64,
}

impl Following {
    /// The next note of the order; `Lagged` means changes were missed.
    pub async fn recv(&mut self) -> Result<Note, broadcast::error::RecvError> {
        match self.notes.as_mut() {
            Some(notes) => notes.recv().await,
            None => Err(broadcast::error::RecvError::Closed),
        }
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        drop(self.notes.take());
        let mut followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        if followers
            .get(&self.order_no)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            followers.remove(&self.order_no);
        }
    }
}

impl OrderEvents {
    /// Publishes on `redis.key_prefix`'s channel through `conn`.
    pub fn new(conn: RedisConn, key_prefix: &str) -> Self {
        Self {
            followers: Arc::default(),
            conn,
            channel: channel(key_prefix),
        }
    }

    /// What this instance hears of `order_no` from now on.
    pub fn follow(&self, order_no: i64) -> Following {
        let mut followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        let notes = followers
            .entry(order_no)
            .or_insert_with(|| broadcast::channel(BUFFER).0)
            .subscribe();
        Following {
            notes: Some(notes),
            followers: self.followers.clone(),
            order_no,
        }
    }

    /// Orders followed on this instance.
    pub fn followed(&self) -> usize {
        self.followers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Announces committed changes to every instance. If Redis does not
    /// take them, this instance's streams still hear them; the others
    /// resync when their subscription comes back.
    pub async fn publish(&self, changes: &[StatusChange]) {
        if changes.is_empty() {
            return;
        }
        let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(&self.channel)
            .arg(encode(changes))
            .query_async(&mut self.conn.clone())
            .await;
        if let Err(e) = sent {
            tracing::debug!(error = %e, "order status changes not published; local streams only");
            self.deliver(changes);
        }
    }

    /// Hands changes to the streams that follow their orders: one map
    /// lookup per change, under one lock per batch.
    fn deliver(&self, changes: &[StatusChange]) {
        let followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        if followers.is_empty() {
            return;
        }
        for &change in changes {
            if let Some(tx) = followers.get(&change.order_no) {
                let _ = tx.send(Note::Change(change));
            }
        }
    }

    /// Every stream reads its order again (the subscription was lost).
    fn resync(&self) {
        let followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        for tx in followers.values() {
            let _ = tx.send(Note::Resync);
        }
    }
}

/// `order_no:STATUS` pairs, comma-separated.
fn encode(changes: &[StatusChange]) -> String {
    let mut out = String::with_capacity(changes.len() * 32);
    for (i, c) in changes.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&c.order_no.to_string());
        out.push(':');
        out.push_str(c.status.as_str());
    }
    out
}

fn decode(payload: &str) -> Vec<StatusChange> {
    payload
        .split(',')
        .filter_map(|pair| {
            let (no, status) = pair.split_once(':')?;
            Some(StatusChange {
                order_no: no.parse().ok()?,
                status: OrderStatus::parse(status)?,
            })
        })
        .collect()
}

/// Listens on the channel and hands what it hears to `events`' streams,
/// until `shutdown`. Each new subscription resyncs every stream: changes
/// published while there was none were missed.
pub async fn listen(seeds: Vec<String>, events: Arc<OrderEvents>, shutdown: CancellationToken) {
    let channel = events.channel.clone();
    let on_message = {
        let events = events.clone();
        move |m: &redis::Msg| {
            if let Ok(payload) = m.get_payload::<String>() {
                events.deliver(&decode(&payload));
            }
        }
    };
    let on_state = move |state| {
        if state == Subscription::Live {
            events.resync();
        }
    };
    redis_conn::listen(
        seeds,
        channel,
        "order status changes",
        on_state,
        on_message,
        shutdown,
    )
    .await;
}

/// Open streams per user on this instance.
#[derive(Default)]
pub struct StreamCounts(std::sync::Mutex<std::collections::HashMap<i64, usize>>);

/// One open stream; dropping it gives its place back.
pub struct StreamSlot {
    counts: std::sync::Arc<StreamCounts>,
    user_id: i64,
}

impl StreamCounts {
    /// A place for one more stream of `user_id`, unless `max` are open.
    pub fn take(self: &std::sync::Arc<Self>, user_id: i64, max: usize) -> Option<StreamSlot> {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let open = counts.entry(user_id).or_default();
        if *open >= max {
            return None;
        }
        *open += 1;
        Some(StreamSlot {
            counts: self.clone(),
            user_id,
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = counts.get_mut(&self.user_id) {
            *open -= 1;
            if *open == 0 {
                counts.remove(&self.user_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_go_over_the_wire_and_back() {
        let changes = [
            StatusChange {
                order_no: 386_010_798_423_023_616,
                status: OrderStatus::WaitingPay,
            },
            StatusChange {
                order_no: 7,
                status: OrderStatus::Failed,
            },
        ];
        let wire = encode(&changes);
        assert_eq!(wire, "386010798423023616:WAITING_PAY,7:FAILED");
        assert_eq!(decode(&wire), changes);
        assert!(decode("x:PAID,9:NOPE,").is_empty(), "garbage is dropped");
    }
}

//! A fault-injecting proxy in front of the real broker's FAULT listener
//! (`scripts/services.sh` opens it on the Kafka port + 2 and advertises it
//! on the Kafka port + 3, where this proxy listens). A client that
//! bootstraps through the proxy is told the broker is at the proxy, so all
//! of its requests pass through it.
//!
//! The one fault it makes: the first Produce request whose bytes contain
//! `marker` is held back until the next Produce request on the same
//! connection arrives, then forwarded with one byte of the marker flipped
//! (its record batch fails its CRC: the broker refuses it, retriably, with
//! CORRUPT_MESSAGE, and writes nothing), followed at once by that next
//! request (accepted). A first write refused while the one behind it is
//! accepted: what a partition not yet ready on the broker does to the first
//! writes of a producer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, MutexGuard, Notify};

/// One fault to make, and what the proxy saw of it.
#[derive(Default)]
struct Seen {
    marker: Vec<u8>,
    /// The marked request was taken (one-shot).
    armed: AtomicBool,
    /// The marked request is being held.
    holding: AtomicBool,
    held: Notify,
    /// The marked request went out corrupted, right before the next one.
    refused_before_the_next: AtomicBool,
}

/// The proxy of this test process: one, on a thread of its own, for the
/// process's lifetime. A test's server keeps talking through it while the
/// test's runtime shuts down (librdkafka clients close cleanly only with
/// their broker reachable); tests take turns setting the fault.
struct Shared {
    brokers: String,
    fault: std::sync::Mutex<Option<Arc<Seen>>>,
}

impl Shared {
    fn fault(&self) -> Option<Arc<Seen>> {
        self.fault.lock().expect("fault lock").clone()
    }
}

static SHARED: OnceLock<Shared> = OnceLock::new();

/// A test's turn at the proxy, with its fault set. Dropping it clears the
/// fault; the proxy goes on forwarding.
pub struct FaultProxy {
    /// `host:port` to give a Kafka client as `bootstrap.servers`.
    pub brokers: String,
    seen: Arc<Seen>,
    shared: &'static Shared,
    _one_at_a_time: MutexGuard<'static, ()>,
}

impl FaultProxy {
    /// Takes the proxy (starting it on first use) for the broker whose
    /// PLAINTEXT listener is `brokers` (the first of the list), and sets
    /// its fault: the first Produce request carrying `marker`.
    pub async fn start(brokers: &str, marker: &[u8]) -> Self {
        static TURN: Mutex<()> = Mutex::const_new(());
        let guard = TURN.lock().await;
        let shared = SHARED.get_or_init(|| spawn(brokers));
        let seen = Arc::new(Seen {
            marker: marker.to_vec(),
            ..Seen::default()
        });
        *shared.fault.lock().expect("fault lock") = Some(seen.clone());
        Self {
            brokers: shared.brokers.clone(),
            seen,
            shared,
            _one_at_a_time: guard,
        }
    }

    /// Waits (at most `within`) until the marked Produce request is held.
    pub async fn holding(&self, within: Duration) -> bool {
        let held = self.seen.held.notified();
        if self.seen.holding.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::timeout(within, held).await.is_ok()
    }

    /// Whether the marked request was refused by the broker with the next
    /// request already behind it: the fault happened as meant.
    pub fn refused_before_the_next(&self) -> bool {
        self.seen.refused_before_the_next.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        *self.shared.fault.lock().expect("fault lock") = None;
    }
}

/// Starts the proxy's thread: it listens on the Kafka port + 3 and
/// forwards to the Kafka port + 2.
fn spawn(brokers: &str) -> Shared {
    let first = brokers.split(',').next().expect("a broker");
    let (host, port) = first.rsplit_once(':').expect("host:port");
    let port: u16 = port.parse().expect("a port");
    let upstream = format!("{host}:{}", port + 2);
    let listen = format!("{host}:{}", port + 3);
    let listener = std::net::TcpListener::bind(&listen)
        .unwrap_or_else(|e| panic!("the fault proxy binds {listen}: {e}"));
    listener.set_nonblocking(true).expect("non-blocking");
    let shared = Shared {
        brokers: listen,
        fault: std::sync::Mutex::new(None),
    };
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the fault proxy's runtime");
        runtime.block_on(async move {
            let listener = TcpListener::from_std(listener).expect("listener");
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        relay(client, server).await;
                    }
                });
            }
        });
    });
    shared
}

/// Copies the broker's answers back unchanged, and the client's requests
/// through, frame by frame, making the fault set at the time.
async fn relay(client: TcpStream, server: TcpStream) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let answers = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
    });
    // The marked request held back, its fault, and what came after it.
    let mut held: Option<(Vec<u8>, Arc<Seen>)> = None;
    let mut behind: Vec<Vec<u8>> = Vec::new();
    loop {
        let frame = if held.is_some() {
            // Not forever: a client that sends nothing more gets its
            // request through, corrupted, alone (the fault did not happen).
            let next = Duration::from_secs(20);
            match tokio::time::timeout(next, read_frame(&mut from_client)).await {
                Ok(frame) => frame,
                Err(_) => {
                    let (mut first, seen) = held.take().expect("held");
                    flip_marker(&mut first, &seen.marker);
                    behind.insert(0, first);
                    if write_all(&mut to_server, &behind).await.is_err() {
                        break;
                    }
                    behind.clear();
                    continue;
                }
            }
        } else {
            read_frame(&mut from_client).await
        };
        let Some(frame) = frame else { break };
        let produce = frame.len() >= 2 && i16::from_be_bytes([frame[0], frame[1]]) == 0;
        if let Some((mut first, seen)) = held.take() {
            if !produce {
                behind.push(frame);
                held = Some((first, seen));
                continue;
            }
            flip_marker(&mut first, &seen.marker);
            behind.insert(0, first);
            behind.push(frame);
            if write_all(&mut to_server, &behind).await.is_err() {
                break;
            }
            behind.clear();
            seen.refused_before_the_next.store(true, Ordering::SeqCst);
            continue;
        }
        let fault = SHARED.get().and_then(Shared::fault);
        if let Some(seen) = fault.filter(|seen| {
            produce
                && contains(&frame, &seen.marker)
                && seen
                    .armed
                    .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
        }) {
            seen.holding.store(true, Ordering::SeqCst);
            seen.held.notify_waiters();
            held = Some((frame, seen));
            continue;
        }
        if write_all(&mut to_server, &[frame]).await.is_err() {
            break;
        }
    }
    answers.abort();
}

/// One request: its 4-byte size, then that many bytes. `None` at the end.
async fn read_frame(from: &mut tokio::net::tcp::OwnedReadHalf) -> Option<Vec<u8>> {
    let mut size = [0u8; 4];
    from.read_exact(&mut size).await.ok()?;
    let mut frame = vec![0u8; u32::from_be_bytes(size) as usize];
    from.read_exact(&mut frame).await.ok()?;
    Some(frame)
}

async fn write_all(
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    frames: &[Vec<u8>],
) -> std::io::Result<()> {
    for frame in frames {
        let size = u32::try_from(frame.len()).expect("a frame under 4 GiB");
        to.write_all(&size.to_be_bytes()).await?;
        to.write_all(frame).await?;
    }
    Ok(())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    position(haystack, needle).is_some()
}

fn position(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Flips one bit of the marker's first byte, inside the record batch: its
/// CRC no longer matches.
fn flip_marker(frame: &mut [u8], marker: &[u8]) {
    let at = position(frame, marker).expect("the marker is in the held request");
    frame[at] ^= 0x01;
}

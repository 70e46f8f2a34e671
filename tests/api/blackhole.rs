//! A TCP proxy in front of PostgreSQL that can make every connection it
//! carries go silent for good, without a reset: what a host that vanished,
//! or a network that cut it off, does to them. Connections made after the
//! cut go through, as to the primary a failover promotes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct Blackhole {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// Bumped by each cut: a connection accepted before it goes silent.
    cuts: Arc<AtomicU64>,
    /// Set by [`Blackhole::close_silenced`].
    closing: Arc<std::sync::atomic::AtomicBool>,
    /// Set by [`Blackhole::away`]: new connections are closed at once.
    refusing: Arc<std::sync::atomic::AtomicBool>,
}

impl Blackhole {
    /// A proxy to `target` (`host:port`).
    pub async fn start(target: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cuts = Arc::new(AtomicU64::new(0));
        let closing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let refusing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (target, seen, close) = (target.to_owned(), cuts.clone(), closing.clone());
        let refuse = refusing.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let born = seen.load(Ordering::SeqCst);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, seen.clone(), close.clone(), born));
                tokio::spawn(pump(sr, cw, seen.clone(), close.clone(), born));
            }
        });
        Self {
            addr,
            cuts,
            closing,
            refusing,
        }
    }

    /// The database goes away, as during a failover: every connection
    /// open now goes silent, and new ones are closed at once, until
    /// [`Blackhole::back`].
    pub fn away(&self) {
        self.refusing.store(true, Ordering::SeqCst);
        self.cut();
    }

    /// New connections go through again.
    pub fn back(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    /// The silenced connections are closed at last (a test ends: the
    /// threads blocked on them must end with it).
    pub fn close_silenced(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Every connection open now goes silent, for good; sockets stay open.
    pub fn cut(&self) {
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    /// `url` (`postgres://user:password@host:port/db…`) through the proxy.
    pub fn url(&self, url: &str) -> String {
        let at = url.find('@').expect("user@host in the URL") + 1;
        let end = url[at..].find('/').map_or(url.len(), |i| at + i);
        format!("{}{}{}", &url[..at], self.addr, &url[end..])
    }

    /// The `host:port` of `url`.
    pub fn target_of(url: &str) -> String {
        let at = url.find('@').expect("user@host in the URL") + 1;
        let end = url[at..].find('/').map_or(url.len(), |i| at + i);
        url[at..end].to_owned()
    }
}

/// Forwards `from` to `to` until a cut after the connection was born, then
/// holds both open and silent.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cuts: Arc<AtomicU64>,
    closing: Arc<std::sync::atomic::AtomicBool>,
    born: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cuts.load(Ordering::SeqCst) != born {
            // Silent: nothing more goes either way, nothing is closed
            // (until the test ends).
            let _hold = (from, to);
            while !closing.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

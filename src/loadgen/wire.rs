//! The open loop's HTTP/1.1 client: each purchase written as the bytes
//! built before the clock started, its answer read as a status line,
//! headers and a `Content-Length` body, over keep-alive connections that
//! every purchase takes in turn.
//!
//! The open loop shares the server's two CPUs at the sale's first moment,
//! when they are fullest (docs/BENCHMARKS-HISTORY.md,
//! "The first second of a sale").
//! Through `reqwest`, about two thirds of its CPU per purchase was the
//! client's own work: the URL parsed again for each request, the pool's
//! checkout, the request and response types. Here a purchase costs a
//! write, a read and a header scan. The closed-loop rows keep `reqwest`:
//! row 2 and row 5 compare handlers through the same client.

use std::collections::VecDeque;
use std::io;
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most a header section may take before the answer is refused as
/// malformed.
const MAX_HEAD: usize = 16 * 1024;

/// Keep-alive connections to each server, taken oldest first, so that
/// every connection is used in turn and none idles into the server's
/// keep-alive timeout while others are busy.
pub(super) struct Wire {
    pools: Vec<Pool>,
}

struct Pool {
    /// `host:port`.
    addr: String,
    idle: Mutex<VecDeque<TcpStream>>,
}

impl Wire {
    /// Connections to each of `urls` (`http://host:port`), `per_server`
    /// of them opened now.
    pub(super) async fn open(urls: &[String], per_server: usize) -> anyhow::Result<Self> {
        let mut pools = Vec::with_capacity(urls.len());
        for url in urls {
            let addr = url
                .strip_prefix("http://")
                .ok_or_else(|| anyhow::anyhow!("the open loop speaks plain http: {url}"))?
                .trim_end_matches('/')
                .to_owned();
            let opened =
                futures_util::future::join_all((0..per_server).map(|_| connect(&addr))).await;
            let idle = opened.into_iter().collect::<io::Result<VecDeque<_>>>()?;
            pools.push(Pool {
                addr,
                idle: Mutex::new(idle),
            });
        }
        Ok(Self { pools })
    }

    /// `host:port` of server `i`, for the requests' `Host` header.
    pub(super) fn addr(&self, i: usize) -> &str {
        &self.pools[i].addr
    }

    /// Sends `request` (a whole HTTP/1.1 request) to server `i` and reads
    /// its answer: status and body. A kept connection the server closed
    /// while it was idle fails before any byte of an answer; the request
    /// then goes once more on a new connection (a purchase is idempotent
    /// by its request_id).
    pub(super) async fn send(&self, i: usize, request: &[u8]) -> io::Result<(u16, Bytes)> {
        let pool = &self.pools[i];
        let kept = pool.idle.lock().expect("pool lock").pop_front();
        if let Some(conn) = kept {
            match exchange(conn, request).await {
                Ok((status, body, conn)) => return Ok(pool.answered(status, body, conn)),
                Err(Failed {
                    before_answer: false,
                    error,
                }) => return Err(error),
                Err(Failed { .. }) => {}
            }
        }
        let conn = connect(&pool.addr).await?;
        match exchange(conn, request).await {
            Ok((status, body, conn)) => Ok(pool.answered(status, body, conn)),
            Err(Failed { error, .. }) => Err(error),
        }
    }
}

impl Pool {
    fn answered(&self, status: u16, body: Bytes, conn: Option<TcpStream>) -> (u16, Bytes) {
        if let Some(conn) = conn {
            self.idle.lock().expect("pool lock").push_back(conn);
        }
        (status, body)
    }
}

async fn connect(addr: &str) -> io::Result<TcpStream> {
    let conn = TcpStream::connect(addr).await?;
    conn.set_nodelay(true)?;
    Ok(conn)
}

struct Failed {
    /// Nothing of an answer had arrived.
    before_answer: bool,
    error: io::Error,
}

/// One request and its answer on `conn`; the connection comes back unless
/// the server said it closes it.
async fn exchange(
    mut conn: TcpStream,
    request: &[u8],
) -> Result<(u16, Bytes, Option<TcpStream>), Failed> {
    let early = |error| Failed {
        before_answer: true,
        error,
    };
    conn.write_all(request).await.map_err(early)?;
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        let n = conn.read_buf(&mut buf).await.map_err(|e| Failed {
            before_answer: buf.is_empty(),
            error: e,
        })?;
        if n == 0 {
            return Err(Failed {
                before_answer: buf.is_empty(),
                error: io::ErrorKind::UnexpectedEof.into(),
            });
        }
        let Some(head) = head(&buf).map_err(|e| Failed {
            before_answer: false,
            error: e,
        })?
        else {
            continue;
        };
        while buf.len() < head.len + head.body {
            let n = conn.read_buf(&mut buf).await.map_err(|e| Failed {
                before_answer: false,
                error: e,
            })?;
            if n == 0 {
                return Err(Failed {
                    before_answer: false,
                    error: io::ErrorKind::UnexpectedEof.into(),
                });
            }
        }
        let body = buf.split_off(head.len).split_to(head.body).freeze();
        return Ok((head.status, body, (!head.close).then_some(conn)));
    }
}

/// What the header section of an answer says.
#[derive(Debug, PartialEq)]
struct Head {
    status: u16,
    /// Bytes of the status line and headers, blank line included.
    len: usize,
    /// `Content-Length`.
    body: usize,
    /// `Connection: close`.
    close: bool,
}

/// The header section at the start of `buf`, once it is all there.
fn head(buf: &[u8]) -> io::Result<Option<Head>> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Ok(None),
        Ok(httparse::Status::Partial) => return Err(bad("header section too long")),
        Err(e) => return Err(bad(&e.to_string())),
    };
    let status = response.code.ok_or_else(|| bad("no status"))?;
    let mut body = None;
    let mut close = false;
    for h in response.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let text = std::str::from_utf8(h.value).map_err(|_| bad("content-length"))?;
            body = Some(text.trim().parse().map_err(|_| bad("content-length"))?);
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = h.value.eq_ignore_ascii_case(b"close");
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(bad("chunked answers are not read here"));
        }
    }
    Ok(Some(Head {
        status,
        len,
        body: body.unwrap_or(0),
        close,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_read_once_its_header_section_is_whole() {
        let answer = b"HTTP/1.1 409 Conflict\r\ncontent-length: 17\r\ncontent-type: application/problem+json\r\n\r\n{\"code\":\"SOLD_OUT\"}";
        assert_eq!(head(&answer[..30]).unwrap(), None);
        let h = head(answer).unwrap().unwrap();
        assert_eq!(h.status, 409);
        assert_eq!(h.body, 17);
        assert_eq!(&answer[h.len..h.len + 2], b"{\"");
        assert!(!h.close);
    }

    #[test]
    fn a_closing_answer_gives_its_connection_up_and_chunks_are_refused() {
        let closing = head(
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\ncontent-length: 0\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert!(closing.close);
        assert!(head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").is_err());
    }

    #[tokio::test]
    async fn a_request_is_answered_and_its_connection_kept_for_the_next() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // A server that answers two requests on one connection, then
        // refuses any other connection.
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            for body in ["{\"n\":1}", "{\"n\":22}"] {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"POST /x HTTP/1.1\r\n"));
                let answer = format!(
                    "HTTP/1.1 202 Accepted\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                conn.write_all(answer.as_bytes()).await.unwrap();
            }
        });
        let wire = Wire::open(&[format!("http://{addr}")], 1).await.unwrap();
        let request = format!(
            "POST /x HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\n\r\n",
            wire.addr(0)
        );
        let first = wire.send(0, request.as_bytes()).await.unwrap();
        let second = wire.send(0, request.as_bytes()).await.unwrap();
        assert_eq!(first, (202, Bytes::from_static(b"{\"n\":1}")));
        assert_eq!(second, (202, Bytes::from_static(b"{\"n\":22}")));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_kept_connection_the_server_closed_is_replaced_and_the_request_sent_again() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // The first connection answers once and is closed, as a server
        // closes one idle past its keep-alive.
        let server = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let (mut conn, _) = listener.accept().await.unwrap();
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0);
            conn.write_all(b"HTTP/1.1 409 Conflict\r\ncontent-length: 2\r\n\r\n[]")
                .await
                .unwrap();
        });
        let wire = Wire::open(&[format!("http://{addr}")], 1).await.unwrap();
        let request = format!(
            "POST /x HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\n\r\n",
            wire.addr(0)
        );
        assert_eq!(wire.send(0, request.as_bytes()).await.unwrap().0, 409);
        server.await.unwrap();
        // The kept connection is closed now; no listener is left either,
        // so the answer below can only come from a second server.
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let again = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = conn.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"POST /x "));
            conn.write_all(b"HTTP/1.1 409 Conflict\r\ncontent-length: 2\r\n\r\n{}")
                .await
                .unwrap();
        });
        let (status, body) = wire.send(0, request.as_bytes()).await.unwrap();
        assert_eq!((status, &body[..]), (409, &b"{}"[..]));
        again.await.unwrap();
    }
}

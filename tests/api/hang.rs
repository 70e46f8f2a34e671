//! A test that hangs fails, naming itself, instead of holding the whole run
//! until CI's limit. `spawn_app` starts a watch on a plain thread before
//! it builds anything; the watch ends when the test's thread does, which
//! is after the test's runtime is gone and everything it held has been
//! dropped (a librdkafka client's destructor can wait for ever). If the
//! thread is still there after [`limit`], the watch reports what it can
//! see from outside (whether the server still answers, and every thread's
//! stack in this process' own code, through gdb where there is one) and
//! ends the test process with a failure.
//!
//! Tests wait with [`crate::helpers::eventually`] and its deadlines; this
//! is the backstop for a wait that has none, or for a runtime thread that
//! something blocked (which stops the test's own timers too).

use std::cell::RefCell;
use std::io::{Read, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long one test's thread may live from its first `spawn_app`: many
/// times the slowest test on a slow host (`SECKILL_TEST_HANG_SECS`
/// changes it).
fn limit() -> Duration {
    let secs = std::env::var("SECKILL_TEST_HANG_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(900);
    Duration::from_secs(secs)
}

type Done = Arc<(Mutex<bool>, Condvar)>;

/// The watches started on this thread, ended when the thread ends.
#[derive(Default)]
struct EndedWithThread(RefCell<Vec<Done>>);

impl Drop for EndedWithThread {
    fn drop(&mut self) {
        for done in self.0.take() {
            let (lock, ended) = &*done;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            ended.notify_all();
        }
    }
}

thread_local! {
    static WATCHES: EndedWithThread = EndedWithThread::default();
}

/// The watch of the test running on this thread.
pub struct HangWatch {
    /// The server's address once there is one (`http://127.0.0.1:<port>`).
    address: Arc<Mutex<Option<String>>>,
}

impl HangWatch {
    /// Starts watching the test on this thread: the process ends if the
    /// thread outlives [`limit`].
    pub fn start() -> Self {
        let done: Done = Arc::new((Mutex::new(false), Condvar::new()));
        WATCHES.with(|w| w.0.borrow_mut().push(done.clone()));
        let test = std::thread::current()
            .name()
            .unwrap_or("an unnamed test")
            .to_owned();
        let address = Arc::new(Mutex::new(None));
        let watched_address = address.clone();
        let deadline = Instant::now() + limit();
        std::thread::spawn(move || {
            let (lock, ended) = &*done;
            let mut finished = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !*finished {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    drop(finished);
                    let address = watched_address
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone();
                    report(&test, address.as_deref());
                    end_process();
                }
                finished = ended
                    .wait_timeout(finished, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        });
        Self { address }
    }

    /// The watched test's server now listens at `address`.
    pub fn serving(&self, address: &str) {
        *self.address.lock().unwrap_or_else(|e| e.into_inner()) = Some(address.to_owned());
    }
}

/// Exits with a failure; if the exit itself hangs (an exit handler of a
/// C library waiting on a stuck thread), aborts.
fn end_process() -> ! {
    std::thread::spawn(|| std::process::exit(101));
    std::thread::sleep(Duration::from_secs(30));
    std::process::abort()
}

fn report(test: &str, address: Option<&str>) {
    // Straight to the stderr handle: libtest captures `eprintln!` of the
    // test's threads, and drops what it captured when the process exits.
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "\nHUNG: {test} has run for {}s (SECKILL_TEST_HANG_SECS); ending the test process",
        limit().as_secs()
    );
    let _ = writeln!(
        err,
        "HUNG: GET /health/ready from outside: {}",
        address.map_or_else(|| "(no server yet)".to_owned(), ready)
    );
    let _ = writeln!(
        err,
        "HUNG: this process' threads, in its own code:\n{}",
        stacks()
    );
}

/// One plain HTTP request with its own timeouts: whether the server's
/// workers answer while the test's runtime may be stuck.
fn ready(address: &str) -> String {
    let host = address.trim_start_matches("http://");
    let attempt = || -> std::io::Result<String> {
        let addr = host
            .parse()
            .map_err(|e| std::io::Error::other(format!("{host}: {e}")))?;
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /health/ready HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer.replace("\r\n", " | "))
    };
    attempt().unwrap_or_else(|e| format!("no answer: {e}"))
}

/// Every thread's frames in the project's code (`seckill`, the test
/// crate), from gdb attached to this process; empty without gdb.
fn stacks() -> String {
    // gdb takes seconds; one that takes minutes is stuck itself.
    let text = crate::gdb::all_threads(std::process::id(), Duration::from_secs(120));
    own_frames(&text)
}

/// Per thread of a gdb `thread apply all bt`: its name and its innermost
/// frames in the project's code or in librdkafka (whose calls block).
/// librdkafka's own threads (`rdk:`) always wait in a poll: left out.
fn own_frames(backtraces: &str) -> String {
    let mut out = Vec::new();
    for thread in backtraces.split("\nThread ").skip(1) {
        let mut lines = thread.lines();
        let name = lines.next().unwrap_or_default();
        if name.contains("\"rdk:") {
            continue;
        }
        let frames: Vec<String> = lines
            .filter(|l| {
                [" seckill::", " api::", " rdkafka::", " rd_kafka_"]
                    .iter()
                    .any(|k| l.contains(k))
            })
            .take(8)
            .map(|l| l.chars().take(200).collect())
            .collect();
        if !frames.is_empty() {
            out.push(format!("Thread {name}\n  {}", frames.join("\n  ")));
        }
    }
    out.join("\n")
}

//! A Redis still loading its data set (a restart with a large RDB or AOF)
//! answers every command with `LOADING` for the whole load. That is Redis
//! being away, like a refused connection, not Redis refusing the command:
//! the order consumer writes through it, and the fallback's and the
//! restore's proofs can hold.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use seckill::store::redis_conn::unreachable;

/// A `redis-server` of this test's own, in a folder of its own.
struct Server(Child, std::path::PathBuf);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn start(dir: &std::path::Path, port: u16) -> Child {
    Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args([
            "--appendonly",
            "no",
            "--enable-debug-command",
            "yes",
            "--dir",
        ])
        .arg(dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server runs")
}

async fn connect(port: u16) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // DEBUG POPULATE and SAVE take seconds.
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(120)));
        if let Ok(c) = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
        {
            return c;
        }
        assert!(Instant::now() < deadline, "redis-server never accepted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_redis_loading_its_data_set_counts_as_unreachable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("seckill-loading-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    // A data set large enough to take a while to load, saved to disk.
    let mut first = start(&dir, port);
    let mut conn = connect(port).await;
    let _: () = redis::cmd("DEBUG")
        .arg("POPULATE")
        .arg(3_000_000)
        .arg("k")
        .arg(64)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SAVE").query_async(&mut conn).await.unwrap();
    drop(conn);
    first.kill().unwrap();
    first.wait().unwrap();

    // Started again: it loads the file before it serves.
    let _second = Server(start(&dir, port), dir.clone());
    let mut conn = connect(port).await;
    // The first command after the connection is taken meets the load.
    let loading = match redis::cmd("GET")
        .arg("k:1")
        .query_async::<Option<String>>(&mut conn)
        .await
    {
        Err(e) if e.code() == Some("LOADING") => e,
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("loaded before a command reached it: make the data set larger"),
    };
    assert!(unreachable(&loading), "LOADING is Redis away: {loading}");
    // A refusal of the command itself is not.
    let wrong = loop {
        match redis::cmd("NO-SUCH-COMMAND")
            .query_async::<()>(&mut conn)
            .await
        {
            Err(e) if e.code() == Some("LOADING") => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => break e,
            Ok(()) => panic!("an unknown command succeeded"),
        }
    };
    assert!(!unreachable(&wrong), "{wrong}");
}

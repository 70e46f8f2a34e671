//! The server's side of a timeline (`seckill serve --timeline FILE`): every
//! 10 ms, on a thread of its own (it samples on time however busy the
//! runtimes are), one CSV line of what the order path holds and did since
//! the last line, on the wall clock the load generator's timeline uses
//! (`loadgen/timeline.rs`; `scripts/timeline.py` draws both).
//!
//! Per line: purchases in flight (holding an in-flight permit), delivery
//! reports awaited, messages librdkafka holds, acknowledgements queued,
//! PostgreSQL connections in use; since the last line, purchases accepted
//! and refused sold out (from memory and from Redis), admission scripts
//! and their mean round trip, deliveries and their mean time from produce
//! to report, the order consumer's batches and messages; the CPU time and
//! run-queue wait of this process's threads by kind (HTTP workers, the
//! background runtime with its blocking pool, librdkafka, the rest); and
//! the host's busy share and runnable threads.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::sync::Arc;

use anyhow::Context;
use prometheus::Histogram;
use tokio::sync::Semaphore;

use crate::admission::acks::Acks;
use crate::bus::producer::Producer;
use crate::metrics::Metrics;
use crate::store::PgPool;

/// What the sampler reads (the assembly hands it over: `app.rs`).
pub struct Sources {
    /// The counters and histograms of the order path.
    pub metrics: Metrics,
    /// Admission's in-flight permits, and how many there are.
    pub in_flight: Arc<Semaphore>,
    pub max_in_flight: usize,
    /// The queue of acknowledgements.
    pub acks: Acks,
    /// The Kafka producer.
    pub producer: Producer,
    /// The main database pool.
    pub db: PgPool,
}

/// The sampling period.
pub const PERIOD: Duration = Duration::from_millis(10);

const HEADER: &str = "unix_ms,purchases_in_flight,deliveries_pending,kafka_queued,acks_queued,\
pg_in_use,accepted,sold_out_memory,sold_out_redis,scripts,script_mean_ms,delivered,\
delivery_mean_ms,batches,batch_messages,cpu_http_ms,wait_http_ms,cpu_background_ms,\
wait_background_ms,cpu_librdkafka_ms,cpu_other_ms,host_busy,host_runnable";

/// Starts the sampler writing to `path`; it runs until the process ends.
pub fn start(sources: Sources, path: &Path) -> anyhow::Result<()> {
    let mut out = std::io::LineWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    writeln!(out, "{HEADER}")?;
    let path: PathBuf = path.to_owned();
    std::thread::Builder::new()
        .name("timeline".into())
        .spawn(move || {
            let mut sampler = Sampler::new(sources);
            let mut next = Instant::now() + PERIOD;
            loop {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                next += PERIOD;
                let line = sampler.line();
                if let Err(e) = writeln!(out, "{line}") {
                    tracing::warn!(error = %e, path = %path.display(), "timeline stopped");
                    return;
                }
            }
        })
        .context("starting the timeline thread")?;
    Ok(())
}

/// Counters read last time, to write what happened since.
struct Sampler {
    sources: Sources,
    last: Counters,
    threads: Threads,
    host: Option<(u64, u64)>,
}

#[derive(Default, Clone, Copy)]
struct Counters {
    accepted: u64,
    sold_out_memory: u64,
    sold_out_redis: u64,
    scripts: (u64, f64),
    delivered: (u64, f64),
    batches: (u64, f64),
}

impl Sampler {
    fn new(sources: Sources) -> Self {
        let mut s = Self {
            sources,
            last: Counters::default(),
            threads: Threads::default(),
            host: None,
        };
        s.last = s.counters();
        s.threads.sample();
        s.host = host_ticks();
        s
    }

    fn counters(&self) -> Counters {
        let m = &self.sources.metrics;
        let outcome = |o: &str| m.admission.with_label_values(&[o]).get();
        let hist = |h: &Histogram| (h.get_sample_count(), h.get_sample_sum());
        Counters {
            accepted: outcome("accepted"),
            sold_out_memory: outcome("sold_out_memory"),
            sold_out_redis: outcome("sold_out"),
            scripts: hist(&m.lua_duration),
            delivered: hist(&m.produce_duration),
            batches: hist(&m.consumer_batch_size),
        }
    }

    fn line(&mut self) -> String {
        let now = self.counters();
        let was = std::mem::replace(&mut self.last, now);
        let src = &self.sources;
        let in_flight = src
            .max_in_flight
            .saturating_sub(src.in_flight.available_permits());
        let pg = src.db.state();
        let delta = |a: (u64, f64), b: (u64, f64)| (a.0.saturating_sub(b.0), a.1 - b.1);
        let mean_ms = |(n, sum): (u64, f64)| if n == 0 { 0.0 } else { sum / n as f64 * 1000.0 };
        let scripts = delta(now.scripts, was.scripts);
        let delivered = delta(now.delivered, was.delivered);
        let batches = delta(now.batches, was.batches);
        let cpu = self.threads.sample();
        // One read of /proc/stat for both host figures.
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let host = stat.lines().next().and_then(cpu_line);
        let busy = match (self.host, host) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64,
            _ => 0.0,
        };
        self.host = host;
        format!(
            "{},{in_flight},{},{},{},{},{},{},{},{},{:.3},{},{:.3},{},{:.0},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{busy:.3},{}",
            chrono::Utc::now().timestamp_millis(),
            src.metrics.deliveries_pending.get(),
            src.producer.queued(),
            src.acks.queued(),
            pg.connections - pg.idle_connections,
            now.accepted.saturating_sub(was.accepted),
            now.sold_out_memory.saturating_sub(was.sold_out_memory),
            now.sold_out_redis.saturating_sub(was.sold_out_redis),
            scripts.0,
            mean_ms(scripts),
            delivered.0,
            mean_ms(delivered),
            batches.0,
            batches.1,
            cpu.run_ms[Kind::Http as usize],
            cpu.wait_ms[Kind::Http as usize],
            cpu.run_ms[Kind::Background as usize],
            cpu.wait_ms[Kind::Background as usize],
            cpu.run_ms[Kind::Kafka as usize],
            cpu.run_ms[Kind::Other as usize],
            runnable(&stat).unwrap_or(0),
        )
    }
}

/// What a thread of this process is, by its name.
#[derive(Clone, Copy)]
enum Kind {
    Http = 0,
    Background = 1,
    Kafka = 2,
    Other = 3,
}

fn kind(name: &str) -> Kind {
    if name.starts_with("actix") {
        Kind::Http
    } else if name.starts_with("tokio") {
        Kind::Background
    } else if name.starts_with("rdk:") {
        Kind::Kafka
    } else {
        Kind::Other
    }
}

/// Per kind of thread, ms on a CPU and ms runnable but waiting for one.
#[derive(Default)]
struct Spent {
    run_ms: [f64; 4],
    wait_ms: [f64; 4],
}

/// Each thread's kind and its schedstat at the last sample.
#[derive(Default)]
struct Threads {
    seen: HashMap<u32, (Kind, u64, u64)>,
    samples: u64,
}

/// Names are read again this often (in samples): a thread may be seen
/// before it has named itself.
const RENAME_EVERY: u64 = 50;

impl Threads {
    /// What every thread spent since the last call (/proc/self/task's
    /// schedstat: ns on a CPU, ns waiting on a run queue).
    fn sample(&mut self) -> Spent {
        let mut spent = Spent::default();
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return spent;
        };
        let mut alive = HashMap::with_capacity(self.seen.len());
        self.samples += 1;
        let rename = self.samples.is_multiple_of(RENAME_EVERY);
        for task in tasks.flatten() {
            let Some(tid) = task
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<u32>().ok())
            else {
                continue;
            };
            let Some((run, wait)) = schedstat(tid) else {
                continue;
            };
            let name_of = || {
                let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"));
                kind(name.unwrap_or_default().trim())
            };
            let (k, run0, wait0) = match self.seen.get(&tid) {
                Some(&(k, r, w)) if rename && matches!(k, Kind::Other) => (name_of(), r, w),
                Some(&(k, r, w)) => (k, r, w),
                // A thread first seen now: counted from now.
                None => (name_of(), run, wait),
            };
            spent.run_ms[k as usize] += run.saturating_sub(run0) as f64 / 1e6;
            spent.wait_ms[k as usize] += wait.saturating_sub(wait0) as f64 / 1e6;
            alive.insert(tid, (k, run, wait));
        }
        self.seen = alive;
        spent
    }
}

fn schedstat(tid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// (busy, total) clock ticks over every CPU of the host, from /proc/stat.
pub fn host_ticks() -> Option<(u64, u64)> {
    cpu_line(std::fs::read_to_string("/proc/stat").ok()?.lines().next()?)
}

/// (busy, total) of /proc/stat's `cpu` line: idle and iowait are not busy.
fn cpu_line(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = fields.filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest is in user)
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// Threads of the whole host runnable right now (/proc/stat's
/// `procs_running`): above the CPU count, some wait for one.
fn runnable(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("procs_running "))
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_told_apart_by_name() {
        assert!(matches!(kind("actix-rt|system"), Kind::Http));
        assert!(matches!(kind("tokio-runtime-w"), Kind::Background));
        assert!(matches!(kind("rdk:broker1"), Kind::Kafka));
        assert!(matches!(kind("timeline"), Kind::Other));
    }

    #[test]
    fn idle_and_iowait_are_not_busy() {
        assert_eq!(
            cpu_line("cpu  100 5 45 800 50 0 0 0 0 0"),
            Some((150, 1000))
        );
        assert_eq!(cpu_line("intr 1 2 3"), None);
    }

    #[test]
    fn this_process_threads_and_the_host_can_be_read() {
        let mut t = Threads::default();
        t.sample();
        // Spin a little: the main thread's CPU time must move.
        let until = Instant::now() + Duration::from_millis(30);
        while Instant::now() < until {
            std::hint::black_box(0u64);
        }
        let spent = t.sample();
        assert!(spent.run_ms.iter().sum::<f64>() > 0.0);
        assert!(host_ticks().is_some_and(|(b, t)| t >= b));
        let stat = std::fs::read_to_string("/proc/stat").expect("a Linux /proc");
        assert!(runnable(&stat).is_some_and(|n| n >= 1), "this thread runs");
    }
}

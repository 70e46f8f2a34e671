//! What one run measured: each purchase's outcome and the run's figures.

use std::time::Duration;

use super::cpu;
use crate::domain::ActivityId;

/// One purchase: HTTP status (0 when the transport failed), error code,
/// order number, latency.
pub(super) type Outcome = (u16, String, Option<String>, Duration);

/// The figures of one run, for scripts (`--json` prints them).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The activity bought from (0 for the ceiling, which buys nothing).
    pub activity_id: ActivityId,
    pub requests: u64,
    pub accepted: u64,
    pub sold_out: u64,
    pub limited: u64,
    pub errors: u64,
    pub seconds: f64,
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// p99 of the accepted purchases alone (202), and of all the others:
    /// where a tail comes from.
    pub p99_accepted_ms: f64,
    pub p99_refused_ms: f64,
    /// The arrival rate asked for (open loop), purchases per second.
    pub rate: Option<f64>,
    /// Purchase tokens fetched per second before the burst (the token
    /// route, at `--concurrency`).
    pub tokens_per_sec: Option<f64>,
    pub drain_seconds: Option<f64>,
    pub invariants_ok: Option<bool>,
    /// With --cpu-pid: the server's CPU time (user + system, all threads)
    /// over the burst per request, in µs, and the share of the host's CPUs
    /// busy meanwhile (0..1, every process).
    pub server_cpu_us_per_request: Option<f64>,
    pub host_busy: Option<f64>,
    /// This load generator's own CPU time per request over the burst, µs
    /// (it shares the host with the server).
    pub loadgen_cpu_us_per_request: Option<f64>,
    /// A whole sale (`--bots`, `--room`): who took the units, and the room's
    /// admission.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sale: Option<SaleFigures>,
}

impl Report {
    pub(super) fn with_cost(&mut self, cost: Option<(cpu::Cost, cpu::Cost)>) {
        self.server_cpu_us_per_request = cost.map(|c| c.0.us_per_request);
        self.host_busy = cost.map(|c| c.0.host_busy);
        self.loadgen_cpu_us_per_request = cost.map(|c| c.1.us_per_request);
    }
}

/// What the sale came to, beyond the purchase report.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SaleFigures {
    pub waiting_room: bool,
    pub bots: i64,
    pub people: i64,
    /// Units taken (accepted purchases) by bots and by people.
    pub bot_units: u64,
    pub people_units: u64,
    /// The bots' share of the units taken.
    pub bot_share: f64,
    /// With a room: tickets taken in the pre-queue, and seconds it took.
    pub prequeue_joined: u64,
    pub join_seconds: f64,
    /// With a room: the admission rate configured, the passes given out
    /// when the room sold out, and the seconds from the start until then.
    pub admit_per_sec: i32,
    pub max_active: Option<i32>,
    pub admitted_at_sell_out: u64,
    pub sell_out_secs: f64,
    /// Passes given out per second from the start to the sell-out.
    pub admitted_per_sec: f64,
    /// The fastest admission over any window of a second or more in that
    /// time, per second (from the stats route, read every 100 ms).
    pub admitted_max_per_sec: f64,
    /// p99 and max, in ms, of the purchases buyers made (the token and
    /// the order), from the click.
    pub purchase_p99_ms: f64,
    pub purchase_max_ms: f64,
}

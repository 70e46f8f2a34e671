//! The load generator's command line.

use crate::domain::ActivityId;

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadgenArgs {
    /// Base URL of the server; repeat it to spread the buyers over several
    /// instances (buyer N goes to URL N mod count; admin calls to the first).
    #[arg(long = "url", default_values_t = [String::from("http://127.0.0.1:8080")])]
    pub urls: Vec<String>,
    /// Distinct buyers (one purchase each).
    #[arg(long, default_value_t = 20_000)]
    pub users: i64,
    /// Units on sale (ignored with --activity).
    #[arg(long, default_value_t = 1_000)]
    pub stock: i32,
    /// Requests in flight at once (closed loop: a new purchase starts when
    /// one ends; also the token phase).
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Open loop: start purchases at this fixed rate per second, whatever
    /// the answers take, and measure each latency from its intended start
    /// (as wrk2 does: no coordinated omission).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stock buckets of the created activity.
    #[arg(long, default_value_t = 1)]
    pub buckets: i32,
    /// Redis shards of the created activity (a hot activity spread over
    /// a cluster's masters).
    #[arg(long, default_value_t = 1)]
    pub shards: i32,
    /// Use this existing, warmed activity instead of creating one.
    #[arg(long)]
    pub activity: Option<ActivityId>,
    /// First user id (ids are first..first+users).
    #[arg(long, default_value_t = 1)]
    pub first_user: i64,
    /// How long to wait for the consumer to drain, in seconds.
    #[arg(long, default_value_t = 120)]
    pub drain_timeout: u64,
    /// Skip the drain wait and invariant check (pure admission throughput).
    #[arg(long)]
    pub no_check: bool,
    /// The design under test keeps no stock in Redis (the naive baseline):
    /// leave Redis out of the I7 comparison.
    #[arg(long)]
    pub db_only: bool,
    /// Instead of a sale, POST `--users` purchase-shaped requests to this URL
    /// (an HTTP ceiling: `examples/plain.rs`).
    #[arg(long)]
    pub ceiling_url: Option<String>,
    /// A whole sale, bought by people and by this many bot accounts (the
    /// first user ids), reporting the units each side took (see
    /// `loadgen/sale.rs` for how each behaves).
    #[arg(long, default_value_t = 0)]
    pub bots: i64,
    /// Run the sale through a waiting room: everyone joins the pre-queue,
    /// then buys with the pass of their turn.
    #[arg(long)]
    pub room: bool,
    /// With --room: tickets admitted per second.
    #[arg(long, default_value_t = 2_000)]
    pub admit_per_sec: i32,
    /// With --room: at most this many passes outstanding at once.
    #[arg(long)]
    pub max_active: Option<i32>,
    /// With --room: seconds from the activity's creation to its start, in
    /// which every buyer joins the pre-queue.
    #[arg(long, default_value_t = 60)]
    pub prequeue_secs: u64,
    /// With --rate: write the open loop's timeline (per 10 ms of intended
    /// send time) to this CSV file (`loadgen/timeline.rs`).
    #[arg(long)]
    pub timeline: Option<std::path::PathBuf>,
    /// The server's process id: report its CPU time per request over the
    /// burst (read from /proc), and how busy the whole host was.
    #[arg(long)]
    pub cpu_pid: Option<u32>,
    /// Milliseconds between the last purchase token and the first
    /// purchase (buyers fetch their tokens before the start, not in the
    /// same instant).
    #[arg(long, default_value_t = 0)]
    pub settle_ms: u64,
    /// Open this many connections before the first purchase (at least
    /// --concurrency are, by the token phase). Buyers of a real sale hold
    /// their own connections when it starts; an open loop whose answers
    /// lag needs one per purchase in flight, and opening them in the first
    /// second of the sale measures connection set-up on a host that has
    /// none to spare.
    #[arg(long, default_value_t = 0)]
    pub connections: usize,
    /// Open loop: at most this many purchases in flight at once; one due
    /// while all are out waits for an answer (its wait counts in its
    /// latency, which runs from its intended start). The buyers' connections
    /// are then the ones `--connections` opened: an open loop whose answers
    /// lag otherwise opens a connection for each purchase past them, at the
    /// moment the host has least to spare for it.
    #[arg(long)]
    pub max_in_flight: Option<usize>,
    /// Worker threads of this process (default: one per core). An open
    /// loop on the server's own host wants 1: a fixed rate needs only the
    /// CPU of that rate, and with a worker per core the load generator
    /// took both cores from the server at the sale's first moment
    /// (docs/BENCHMARKS-HISTORY.md, "How to measure on this machine").
    #[arg(long)]
    pub threads: Option<usize>,
}

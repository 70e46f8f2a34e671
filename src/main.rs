//! The `seckill` binary: a thin CLI over the library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use diesel::{Connection, PgConnection};
use secrecy::ExposeSecret;

use seckill::app::Application;

// mimalloc rather than glibc's allocator: under the sale's many small,
// short-lived allocations across threads, glibc's malloc took about a
// tenth of the load generator's and the server's CPU (docs/BENCHMARKS-HISTORY.md,
// "The first second of a sale").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use seckill::auth::{JwtKeys, Role};
use seckill::config::Settings;

#[derive(Parser)]
#[command(name = "seckill", version, about = "Flash-sale order service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve HTTP and run the consumers in the same process.
    Serve {
        /// Run no consumer here (orders, stock releases, coupon claims): an
        /// API-only instance, beside `seckill consume` workers.
        #[arg(long)]
        no_consumer: bool,
        /// Write a timeline of the order path, a CSV line every 10 ms, to
        /// this file (`scripts/bench.sh --timeline`).
        #[arg(long)]
        timeline: Option<std::path::PathBuf>,
    },
    /// Run the consumers (a worker-only instance) until SIGINT/SIGTERM:
    /// every one, or those named.
    Consume {
        #[command(flatten)]
        which: Consumers,
    },
    /// Reconcile every recent activity once and print the report (JSON).
    Reconcile,
    /// Apply (default) or revert the database migrations.
    Migrate {
        #[arg(value_enum, default_value = "up")]
        direction: Direction,
    },
    /// Operate the transactional outbox.
    Outbox {
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Print the OpenAPI document (the one `GET /api/v1/openapi.json` serves).
    Openapi,
    /// Print a signed JWT for development and load tests.
    Token {
        /// The user id (`sub`).
        #[arg(long, default_value_t = 1)]
        user: i64,
        /// Issue an admin token.
        #[arg(long)]
        admin: bool,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: i64,
    },
    /// Fire a flash-sale burst at a running server and check the invariants.
    Loadgen {
        #[command(flatten)]
        args: Box<seckill::loadgen::LoadgenArgs>,
        /// Also print the report as one JSON line.
        #[arg(long)]
        json: bool,
    },
}

/// Which consumers `seckill consume` runs; none named: all of them.
#[derive(clap::Args, Clone, Copy)]
struct Consumers {
    /// The order creator (`order.requested` → order rows).
    #[arg(long)]
    orders: bool,
    /// The stock releaser (`stock.released` → units back in Redis).
    #[arg(long)]
    releases: bool,
    /// The coupon claimer (`coupon.claimed` → claim rows).
    #[arg(long)]
    claims: bool,
}

impl Consumers {
    fn all_if_none(self) -> Self {
        if self.orders || self.releases || self.claims {
            self
        } else {
            Self {
                orders: true,
                releases: true,
                claims: true,
            }
        }
    }
}

#[derive(Subcommand)]
enum OutboxAction {
    /// List the DEAD rows (the broker refused them `workers.relay_max_attempts` times), as JSON.
    Dead,
    /// Put DEAD rows back to be published again: those given with --id, or --all.
    Requeue {
        /// A DEAD row's id (repeatable).
        #[arg(long = "id", required_unless_present = "all")]
        ids: Vec<i64>,
        /// Every DEAD row.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Direction {
    /// Apply every pending migration.
    Up,
    /// Revert every applied migration (drops all seckill tables).
    Down,
    /// Wait until every migration this binary carries is applied (by the
    /// migration Job): the Deployments' init container, so that no new pod
    /// starts on the old schema. Fails at once on a schema newer than the
    /// binary.
    Wait,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Command::Loadgen { args, .. } = &cli.command
        && let Some(threads) = args.threads
    {
        anyhow::ensure!(threads > 0, "--threads must be at least 1");
        runtime.worker_threads(threads);
    }
    runtime.build()?.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Command::Openapi = cli.command {
        // Needs no settings: the document is the code's.
        println!("{}", seckill::http::openapi::json());
        return Ok(());
    }
    let settings = Settings::load()?;
    seckill::telemetry::init(&settings.log);
    match cli.command {
        Command::Serve {
            no_consumer,
            timeline,
        } => {
            let mut settings = settings;
            if no_consumer {
                settings.orders.consumer_enabled = false;
                settings.workers.releaser_enabled = false;
                settings.workers.claimer_enabled = false;
            }
            serve(settings, timeline).await?;
            // Everything is stopped: the runtime's blocking threads (a
            // Kafka client's destructor) must not hold the exit.
            std::process::exit(0)
        }
        Command::Consume { which } => {
            consume(settings, which.all_if_none()).await?;
            std::process::exit(0)
        }
        Command::Reconcile => {
            let state = seckill::state::AppState::connect(settings)?;
            let reports = state.reconciler().run().await?;
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({"activities": reports}))?
            );
            Ok(())
        }
        Command::Loadgen { args, json } => {
            let report = seckill::loadgen::run(&settings, *args).await?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            }
            if report.invariants_ok == Some(false) {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Migrate { direction } => migrate(&settings, direction),
        Command::Outbox { action } => outbox(&settings, action),
        Command::Openapi => unreachable!("answered before the settings load"),
        Command::Token { user, admin, ttl } => {
            let role = if admin { Role::Admin } else { Role::User };
            println!(
                "{}",
                JwtKeys::from_settings(&settings.auth)?.mint(user, role, ttl)?
            );
            Ok(())
        }
    }
}

async fn serve(settings: Settings, timeline: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    let (host, env) = (settings.app.host.clone(), settings.app.env.clone());
    let app = Application::build(settings).await?;
    if let Some(path) = timeline {
        app.sample_timeline(&path)?;
    }
    tracing::info!(host = %host, port = app.port(), env = %env, "seckill serving");
    app.run_until_stopped()
        .await
        .context("HTTP server failed")?;
    tracing::info!("seckill stopped");
    Ok(())
}

async fn consume(settings: Settings, which: Consumers) -> anyhow::Result<()> {
    use seckill::orders::consumer::{self, ConsumerDeps};
    let deps = ConsumerDeps::connect(settings)?;
    seckill::bus::ensure_topics_or_retry(&deps.settings.kafka, &deps.topics, Default::default())
        .await;
    let mut running = Vec::new();
    if which.orders {
        running.push(("order creator", consumer::spawn(deps.clone())?));
    }
    if which.releases {
        running.push((
            "stock releaser",
            seckill::orders::releaser::spawn(deps.clone())?,
        ));
    }
    if which.claims {
        running.push((
            "coupon claimer",
            seckill::coupons::consumer::spawn(deps.clone())?,
        ));
    }
    // Judged like the server's: by a fresh client, the producer too.
    let producer_watch = deps.producer.supervise(deps.supervision.clone());
    let names: Vec<&str> = running.iter().map(|(name, _)| *name).collect();
    tracing::info!(consumers = ?names, "consumers running");
    seckill::app::shutdown_signal().await;
    seckill::app::exit_at(deps.settings.app.shutdown_timeout_secs);
    for (_, handle) in running {
        handle.stop().await;
    }
    producer_watch.stop().await;
    tracing::info!("consumers stopped");
    Ok(())
}

fn outbox(settings: &Settings, action: OutboxAction) -> anyhow::Result<()> {
    use seckill::outbox::relay;
    let mut conn = PgConnection::establish(settings.postgres.url.expose_secret())
        .context("connecting to PostgreSQL")?;
    match action {
        OutboxAction::Dead => {
            let rows = relay::dead_rows(&mut conn)?;
            println!("{}", serde_json::to_string_pretty(&rows)?);
        }
        OutboxAction::Requeue { ids, all } => {
            let n = relay::requeue(&mut conn, (!all).then_some(ids.as_slice()))?;
            println!("outbox: {n} DEAD rows put back to be published");
        }
    }
    Ok(())
}

fn migrate(settings: &Settings, direction: Direction) -> anyhow::Result<()> {
    let url = settings.postgres.url.expose_secret();
    if direction == Direction::Wait {
        return wait_for_schema(url);
    }
    let mut conn = PgConnection::establish(url).context("connecting to PostgreSQL")?;
    let versions = match direction {
        Direction::Up => seckill::store::migrate_up(&mut conn)?,
        Direction::Down => seckill::store::migrate_down_all(&mut conn)?,
        Direction::Wait => unreachable!("answered above"),
    };
    let verb = match direction {
        Direction::Up => "applied",
        _ => "reverted",
    };
    if versions.is_empty() {
        println!("migrations: nothing to do");
    }
    for v in versions {
        println!("migration {verb}: {v}");
    }
    Ok(())
}

/// `seckill migrate wait`: until the schema is this binary's.
fn wait_for_schema(url: &str) -> anyhow::Result<()> {
    use seckill::store::Schema;
    loop {
        let state = PgConnection::establish(url)
            .context("connecting to PostgreSQL")
            .and_then(|mut conn| seckill::store::schema(&mut conn));
        match state {
            Ok(Schema::Current) => {
                println!("migrations: the schema is this binary's");
                return Ok(());
            }
            Ok(Schema::Ahead(unknown)) => anyhow::bail!(
                "the schema has migrations this binary does not know ({}): run a newer binary",
                unknown.join(", ")
            ),
            Ok(Schema::Behind) => println!("migrations: waiting for the migration to run"),
            Err(e) => println!("migrations: waiting for PostgreSQL: {e:#}"),
        }
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
}

//! The `seckill` binary: a thin CLI over the library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use diesel::{Connection, PgConnection};
use secrecy::ExposeSecret;

use seckill::app::Application;
use seckill::config::Settings;
use seckill::http::auth::{JwtKeys, Role};

#[derive(Parser)]
#[command(name = "seckill", version, about = "Flash-sale order service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve HTTP (and, as they are built, the background workers).
    Serve,
    /// Apply (default) or revert the database migrations.
    Migrate {
        #[arg(value_enum, default_value = "up")]
        direction: Direction,
    },
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
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Direction {
    /// Apply every pending migration.
    Up,
    /// Revert every applied migration (drops all seckill tables).
    Down,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = Settings::load()?;
    seckill::telemetry::init(&settings.log);
    match cli.command {
        Command::Serve => serve(settings).await,
        Command::Migrate { direction } => migrate(&settings, direction),
        Command::Token { user, admin, ttl } => {
            let role = if admin { Role::Admin } else { Role::User };
            println!(
                "{}",
                JwtKeys::new(&settings.auth.jwt_secret)?.mint(user, role, ttl)?
            );
            Ok(())
        }
    }
}

async fn serve(settings: Settings) -> anyhow::Result<()> {
    let (host, env) = (settings.app.host.clone(), settings.app.env.clone());
    let app = Application::build(settings).await?;
    tracing::info!(host = %host, port = app.port(), env = %env, "seckill serving");
    app.run_until_stopped()
        .await
        .context("HTTP server failed")?;
    tracing::info!("seckill stopped");
    Ok(())
}

fn migrate(settings: &Settings, direction: Direction) -> anyhow::Result<()> {
    let mut conn = PgConnection::establish(settings.postgres.url.expose_secret())
        .context("connecting to PostgreSQL")?;
    let versions = match direction {
        Direction::Up => seckill::store::migrate_up(&mut conn)?,
        Direction::Down => seckill::store::migrate_down_all(&mut conn)?,
    };
    let verb = match direction {
        Direction::Up => "applied",
        Direction::Down => "reverted",
    };
    if versions.is_empty() {
        println!("migrations: nothing to do");
    }
    for v in versions {
        println!("migration {verb}: {v}");
    }
    Ok(())
}

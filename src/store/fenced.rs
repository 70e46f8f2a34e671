//! Writes fenced with a lease's token (`lua/fenced.lua`): each Redis slot
//! written keeps the highest token that wrote there, and a write carrying a
//! lower one is refused, atomically with the check. A holder that lost its
//! lease without knowing (a process paused past the lease's lifetime, a
//! failover of the lease key's master) can so never write over what a
//! newer holder read and wrote. Reconciliation's destructive writes (an
//! activity's restore and removal, a coupon batch's restore) go through it.

use std::sync::LazyLock;

use redis::{RedisResult, Script};

use super::redis_conn::RedisConn;

static FENCED: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/fenced.lua")));

/// How long a slot remembers its fence: far longer than any pause a
/// stale holder could still wake from.
pub const FENCE_TTL_SECS: u64 = 86_400;

/// The error of a write refused because a newer lease holder wrote there.
pub fn fenced_off() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "fenced off",
        "a holder of a newer lease wrote here; this one lost its lease".to_owned(),
    ))
}

/// Commands for one slot, run under its fence by [`Writes::run`].
#[derive(Default)]
pub struct Writes {
    keys: Vec<String>,
    commands: Vec<Vec<String>>,
}

impl Writes {
    /// Adds one command (`args`, its name first) and the keys it touches.
    pub fn cmd(&mut self, keys: &[String], args: Vec<String>) {
        self.keys.extend_from_slice(keys);
        self.commands.push(args);
    }

    /// Adds one command that touches `key` only.
    pub fn on(&mut self, key: &str, args: Vec<String>) {
        self.keys.push(key.to_owned());
        self.commands.push(args);
    }

    /// Runs the commands, in order, in the slot of `fence_key`, only if no
    /// token above `token` wrote there (raising its fence to `token`); with
    /// no command, only claims the slot. [`fenced_off`] when refused.
    pub async fn run(self, conn: &RedisConn, fence_key: &str, token: i64) -> RedisResult<()> {
        let commands = serde_json::to_string(&self.commands).map_err(|e| {
            redis::RedisError::from((redis::ErrorKind::Client, "commands", e.to_string()))
        })?;
        let mut call = FENCED.prepare_invoke();
        call.key(fence_key);
        for k in &self.keys {
            call.key(k);
        }
        let ran: i64 = call
            .arg(token)
            .arg(commands)
            .arg(FENCE_TTL_SECS)
            .invoke_async(&mut conn.clone())
            .await?;
        if ran == 1 { Ok(()) } else { Err(fenced_off()) }
    }
}

/// A command of `name` over `args`, as [`Writes::cmd`] takes it.
pub fn command<I, S>(name: &str, args: I) -> Vec<String>
where
    I: IntoIterator<Item = S>,
    S: ToString,
{
    std::iter::once(name.to_owned())
        .chain(args.into_iter().map(|a| a.to_string()))
        .collect()
}

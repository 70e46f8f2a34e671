//! Whether this process can still heal itself. A part that cannot (a Kafka
//! client rebuilt again and again without any progress) gives up: from
//! then on `/health/live` answers 503, and a moment later the process exits
//! with [`EXIT_UNHEALED`], so that its supervisor (systemd, Kubernetes, a
//! test harness) starts it again. A restart loses nothing: everything
//! accepted is in Redis, Kafka or PostgreSQL, and the restarted process
//! picks it up where this one left it.

use std::sync::Mutex;
use std::time::Duration;

/// The exit status of a process that gave up healing itself
/// (`EX_SOFTWARE`).
pub const EXIT_UNHEALED: i32 = 70;

/// How long `/health/live` fails before the process exits.
const GRACE: Duration = Duration::from_secs(2);

/// This process's liveness.
#[derive(Debug, Default)]
pub struct Liveness {
    gave_up: Mutex<Option<String>>,
}

impl Liveness {
    /// Why the process gave up, once it has.
    pub fn gave_up(&self) -> Option<String> {
        self.gave_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Gives up: liveness fails now, and the process exits with
    /// [`EXIT_UNHEALED`] after a short grace, whatever else it is doing.
    pub fn give_up(&self, why: String) {
        tracing::error!(
            reason = why,
            exit = EXIT_UNHEALED,
            "cannot heal: /health/live fails and the process exits to be restarted"
        );
        // Also straight to the standard error, whatever the log settings
        // (or a test harness capturing output) do with the line above: a
        // process that exits on purpose says why where its supervisor
        // looks.
        {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr().lock(),
                "seckill: cannot heal, exiting with {EXIT_UNHEALED} in {}s: {why}",
                GRACE.as_secs()
            );
        }
        let mut gave_up = self.gave_up.lock().unwrap_or_else(|e| e.into_inner());
        if gave_up.is_none() {
            *gave_up = Some(why);
            exit_after(GRACE, EXIT_UNHEALED);
        }
    }
}

/// Ends the process with `code` after `after`, on a thread of its own, so
/// that nothing the runtime is stuck on can hold it.
pub fn exit_after(after: Duration, code: i32) {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        std::process::exit(code);
    });
}

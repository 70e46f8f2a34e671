//! Logging. Human-readable lines by default, one JSON object per line when
//! `log.format = "json"`. `RUST_LOG` overrides `log.level`.

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogSettings};

/// Installs the global subscriber. Safe to call more than once (tests): later
/// calls are no-ops.
pub fn init(settings: &LogSettings) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = if settings.format == LogFormat::Json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder.with_target(true).try_init()
    };
}

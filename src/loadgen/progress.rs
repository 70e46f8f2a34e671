//! A progress line on stderr while a phase runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A once-a-second progress line on stderr.
#[derive(Clone)]
pub(super) struct Progress {
    done: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
}

impl Progress {
    pub(super) fn start(label: &'static str, total: u64) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let (d, s) = (done.clone(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut last = 0;
            loop {
                tokio::select! {
                    _ = s.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                let now = d.load(Ordering::Relaxed);
                eprintln!(
                    "  {label}: {now}/{total} ({:.0}/s now, {:.1}s elapsed)",
                    (now - last) as f64,
                    started.elapsed().as_secs_f64()
                );
                last = now;
            }
        });
        Self { done, stop }
    }

    pub(super) fn tick(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn finish(&self) {
        self.stop.cancel();
    }
}

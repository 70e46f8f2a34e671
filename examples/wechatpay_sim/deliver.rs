//! How the simulated platform delivers its callbacks. By default each is
//! sent once, at once, and a refund settles 200 ms after it is asked. The
//! payments nemesis sets a plan drawn from a seed: callbacks dropped,
//! repeated up to `max_copies` times, delayed, some held past the order's
//! pay deadline, and refunds settled at once with their callback sent
//! before the refund request is answered (out of order). A copy the
//! merchant does not answer 2xx is sent again, as WeChat Pay does, a few
//! times.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::Sim;

/// One callback to send: its headers, its body, and where.
pub struct Notice {
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub url: String,
}

/// The delivery plan.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct Plan {
    /// Share of callbacks never sent.
    pub drop_rate: f64,
    /// Each callback sent is sent 1..=max_copies times (mostly once).
    pub max_copies: u32,
    /// Each copy waits 0..delay_ms before it goes.
    pub delay_ms: u64,
    /// Share of callbacks held `late_ms` first.
    pub late_rate: f64,
    pub late_ms: u64,
    /// Share of refunds settled at once, their callback sent before the
    /// refund request's answer.
    pub early_refund_rate: f64,
    /// A refund stays PROCESSING for `refund_ms[0]..=refund_ms[1]`; none
    /// settles by itself when `hold` is set (`/sim/refund-settle` does).
    pub refund_ms: [u64; 2],
    pub hold: bool,
    /// A copy not answered 2xx is sent again up to this many times, 1 s,
    /// 2 s, 4 s … apart.
    pub retries: u32,
    pub seed: u64,
    #[serde(skip)]
    rng: Option<fastrand::Rng>,
    #[serde(skip)]
    given: BTreeMap<&'static str, u64>,
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            drop_rate: 0.0,
            max_copies: 1,
            delay_ms: 0,
            late_rate: 0.0,
            late_ms: 0,
            early_refund_rate: 0.0,
            refund_ms: [200, 200],
            hold: false,
            retries: 0,
            seed: 0,
            rng: None,
            given: BTreeMap::new(),
        }
    }
}

/// What one callback's delivery was drawn to be.
struct Draw {
    /// Sent at these delays from now, one per copy; none: dropped.
    copies: Vec<u64>,
    retries: u32,
}

impl Plan {
    fn rng(&mut self) -> &mut fastrand::Rng {
        let seed = self.seed;
        self.rng
            .get_or_insert_with(|| fastrand::Rng::with_seed(seed))
    }

    fn count(&mut self, what: &'static str) {
        *self.given.entry(what).or_default() += 1;
    }

    /// What was drawn so far, by kind.
    pub fn given(&self) -> BTreeMap<&'static str, u64> {
        self.given.clone()
    }

    /// Whether a new refund settles at once (its callback before its
    /// answer), else how long it stays PROCESSING (none: held).
    pub fn refund_timing(&mut self) -> (bool, Option<u64>) {
        let (early, [lo, hi], hold) = (self.early_refund_rate, self.refund_ms, self.hold);
        if self.rng().f64() < early {
            self.count("refund settled before its answer");
            return (true, None);
        }
        if hold {
            return (false, None);
        }
        let ms = self.rng().u64(lo.min(hi)..=hi.max(lo));
        (false, Some(ms))
    }

    fn draw(&mut self) -> Draw {
        let (drop_rate, max, delay, late_rate, late_ms, retries) = (
            self.drop_rate,
            self.max_copies.max(1),
            self.delay_ms,
            self.late_rate,
            self.late_ms,
            self.retries,
        );
        let rng = self.rng();
        if rng.f64() < drop_rate {
            self.count("dropped");
            return Draw {
                copies: Vec::new(),
                retries,
            };
        }
        // Mostly once; one in five repeated, up to `max` times.
        let n = if max > 1 && rng.u32(..5) == 0 {
            rng.u32(2..=max)
        } else {
            1
        };
        let late = rng.f64() < late_rate;
        let base = if late { late_ms } else { 0 };
        let copies = (0..n).map(|_| base + rng.u64(..=delay)).collect();
        if late {
            self.count("late");
        }
        if n > 1 {
            self.count("repeated");
        }
        self.count("sent");
        Draw { copies, retries }
    }
}

/// Sends one callback as the plan draws it.
pub async fn send(sim: Arc<Sim>, notice: Notice) {
    let draw = sim.plan.lock().unwrap().draw();
    let notice = Arc::new(notice);
    let copies = draw.copies.into_iter().map(|delay| {
        let (sim, notice) = (sim.clone(), notice.clone());
        async move {
            actix_web::rt::time::sleep(Duration::from_millis(delay)).await;
            for attempt in 0..=draw.retries {
                let (status, _) = sim
                    .post(&notice.url, notice.headers.clone(), notice.body.clone())
                    .await;
                if (200..300).contains(&status) {
                    return;
                }
                actix_web::rt::time::sleep(Duration::from_secs(1 << attempt.min(4))).await;
            }
        }
    });
    futures_util::future::join_all(copies).await;
}

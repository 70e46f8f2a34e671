//! What goes wrong at the simulated platform, on purpose: answers scripted
//! by a test (the next call of a path answered 429, an unsigned 404, a
//! stale signature), and, for the payments nemesis, faults drawn at a rate
//! from a seed (429 `FREQUENCY_LIMITED`, 403 `NOT_ENOUGH` on a refund, 500
//! `SYSTEM_ERROR` before or after the work, and an answer that never comes
//! after the work was done).

use std::sync::Mutex;

use serde::Deserialize;

/// A merchant API call, as a fault sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Prepay,
    Query,
    Close,
    Refund,
    QueryRefund,
}

/// An answer a test put in place for the next calls whose path contains
/// `path`.
#[derive(Debug, Clone, Deserialize)]
pub struct Scripted {
    pub path: String,
    pub status: u16,
    pub code: String,
    #[serde(default = "yes")]
    pub signed: bool,
    /// Signed an hour ago: a replayed answer.
    #[serde(default)]
    pub stale: bool,
    /// The call's work is done first (the answer lies about it, or never
    /// comes: `status` 0 hangs for `hang_ms`).
    #[serde(default)]
    pub after_work: bool,
    #[serde(default = "one")]
    pub times: u32,
}

fn yes() -> bool {
    true
}

fn one() -> u32 {
    1
}

/// Faults at a rate: each call draws once.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Rates {
    /// Share of calls answered with an error (429, 403 on a refund, 500).
    #[serde(default)]
    pub error_rate: f64,
    /// Share of calls whose work is done and whose answer never comes.
    #[serde(default)]
    pub hang_rate: f64,
    /// How long a hung answer is held (past the client's timeout).
    #[serde(default)]
    pub hang_ms: u64,
    #[serde(default)]
    pub seed: u64,
}

/// What to do with one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Do the work and answer.
    Pass,
    /// Answer this without doing the work.
    Before(Answer),
    /// Do the work, then answer this instead.
    After(Answer),
    /// Do the work, then hold the answer this long.
    Hang(u64),
}

/// An error answer to give.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub signed: bool,
    pub stale: bool,
}

impl Answer {
    fn documented(status: u16, code: &str, message: &str) -> Self {
        Self {
            status,
            code: code.into(),
            message: message.into(),
            signed: true,
            stale: false,
        }
    }
}

/// The faults in force, and a count of those given, by kind.
#[derive(Default)]
pub struct Faults {
    scripted: Mutex<Vec<Scripted>>,
    rates: Mutex<(Rates, Option<fastrand::Rng>)>,
    pub given: Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Faults {
    pub fn script(&self, s: Scripted) {
        self.scripted.lock().unwrap().push(s);
    }

    pub fn set_rates(&self, rates: Rates) {
        let rng = fastrand::Rng::with_seed(rates.seed);
        *self.rates.lock().unwrap() = (rates, Some(rng));
    }

    fn count(&self, what: String) {
        *self.given.lock().unwrap().entry(what).or_default() += 1;
    }

    /// The verdict on a call of `op` to `path`: a scripted answer first,
    /// then one drawn at the rates in force.
    pub fn verdict(&self, op: Op, path: &str) -> Verdict {
        {
            let mut scripted = self.scripted.lock().unwrap();
            if let Some(i) = scripted.iter().position(|s| path.contains(&s.path)) {
                let s = scripted[i].clone();
                scripted[i].times -= 1;
                if scripted[i].times == 0 {
                    scripted.remove(i);
                }
                self.count(format!("scripted {} {}", s.status, s.code));
                if s.status == 0 {
                    return Verdict::Hang(60_000);
                }
                let answer = Answer {
                    status: s.status,
                    code: s.code.clone(),
                    message: format!("scripted {}", s.code),
                    signed: s.signed,
                    stale: s.stale,
                };
                return if s.after_work {
                    Verdict::After(answer)
                } else {
                    Verdict::Before(answer)
                };
            }
        }
        let mut rates = self.rates.lock().unwrap();
        let (rates, rng) = &mut *rates;
        let Some(rng) = rng.as_mut() else {
            return Verdict::Pass;
        };
        let draw = rng.f64();
        if draw < rates.hang_rate {
            self.count("hang".into());
            return Verdict::Hang(rates.hang_ms);
        }
        if draw < rates.hang_rate + rates.error_rate {
            let verdict = match rng.u32(..4) {
                0 if op == Op::Refund => {
                    Verdict::Before(Answer::documented(403, "NOT_ENOUGH", "余额不足"))
                }
                0 | 1 => Verdict::Before(Answer::documented(429, "FREQUENCY_LIMITED", "频率限制")),
                2 => Verdict::Before(Answer::documented(
                    500,
                    "SYSTEM_ERROR",
                    "系统异常，请稍后重试",
                )),
                _ => Verdict::After(Answer::documented(
                    500,
                    "SYSTEM_ERROR",
                    "系统异常，请稍后重试",
                )),
            };
            let label = match &verdict {
                Verdict::Before(a) => format!("{} {}", a.status, a.code),
                Verdict::After(a) => format!("{} {} after the work", a.status, a.code),
                _ => unreachable!(),
            };
            self.count(label);
            return verdict;
        }
        Verdict::Pass
    }
}

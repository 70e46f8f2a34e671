//! The open loop on a timeline (`seckill loadgen --rate R --timeline FILE`):
//! per 10 ms of intended send time, what was sent, answered and in flight,
//! how late this process sent it, and the latency of what was sent in that
//! slot, accepted purchases apart from refusals. `scripts/timeline.py`
//! draws it beside the server's own timeline (`seckill serve --timeline`)
//! on the same wall clock.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;

/// The width of one slot.
pub const SLOT: Duration = Duration::from_millis(10);

/// One purchase of the open loop.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    /// Its intended start, from the burst's start.
    pub intended: Duration,
    /// How long after that this process started it (its own lateness).
    pub lag: Duration,
    /// From the intended start to the answer.
    pub latency: Duration,
    /// Answered 202.
    pub accepted: bool,
}

/// One slot's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// The slot's start, ms from the burst's start.
    pub t_ms: u64,
    /// Purchases whose intended start is in the slot.
    pub sent: u64,
    /// Answers that arrived in the slot.
    pub answered: u64,
    /// Sent and not answered at the slot's end.
    pub in_flight: u64,
    /// Of the purchases sent in the slot, ms: median and p99 of all, p99 of
    /// the 202s and of the refusals (0 when there are none), and p99 of
    /// this process's lateness in starting them.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p99_accepted_ms: f64,
    pub p99_refused_ms: f64,
    pub lag_p99_ms: f64,
}

/// The slots of `sent`, from the burst's start to its last answer.
pub fn slots(sent: &[Sent]) -> Vec<Slot> {
    let slot_of = |d: Duration| (d.as_micros() / SLOT.as_micros()) as usize;
    let last = sent
        .iter()
        .map(|s| slot_of(s.intended + s.latency))
        .max()
        .unwrap_or(0);
    let mut by_slot: Vec<Vec<&Sent>> = vec![Vec::new(); last + 1];
    let mut answered = vec![0u64; last + 1];
    for s in sent {
        by_slot[slot_of(s.intended)].push(s);
        answered[slot_of(s.intended + s.latency)] += 1;
    }
    let (mut started, mut done) = (0u64, 0u64);
    by_slot
        .iter()
        .enumerate()
        .map(|(i, here)| {
            started += here.len() as u64;
            done += answered[i];
            let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
            let all: Vec<f64> = here.iter().map(|s| ms(&s.latency)).collect();
            let of = |accepted: bool| -> Vec<f64> {
                here.iter()
                    .filter(|s| s.accepted == accepted)
                    .map(|s| ms(&s.latency))
                    .collect()
            };
            let lags: Vec<f64> = here.iter().map(|s| ms(&s.lag)).collect();
            Slot {
                t_ms: (i as u64) * SLOT.as_millis() as u64,
                sent: here.len() as u64,
                answered: answered[i],
                in_flight: started - done,
                p50_ms: quantile(all.clone(), 0.5),
                p99_ms: quantile(all, 0.99),
                p99_accepted_ms: quantile(of(true), 0.99),
                p99_refused_ms: quantile(of(false), 0.99),
                lag_p99_ms: quantile(lags, 0.99),
            }
        })
        .collect()
}

/// The `q` quantile (nearest rank) of `values`; 0 for none.
fn quantile(mut values: Vec<f64>, q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Writes the slots as CSV; `started_unix_ms` is the burst's start on the
/// wall clock (the server's timeline is on it too).
pub fn write(path: &Path, started_unix_ms: i64, sent: &[Sent]) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    writeln!(
        out,
        "unix_ms,t_ms,sent,answered,in_flight,p50_ms,p99_ms,p99_accepted_ms,p99_refused_ms,lag_p99_ms"
    )?;
    for s in slots(sent) {
        writeln!(
            out,
            "{},{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3}",
            started_unix_ms + s.t_ms as i64,
            s.t_ms,
            s.sent,
            s.answered,
            s.in_flight,
            s.p50_ms,
            s.p99_ms,
            s.p99_accepted_ms,
            s.p99_refused_ms,
            s.lag_p99_ms
        )?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(intended_ms: u64, latency_ms: u64, accepted: bool) -> Sent {
        Sent {
            intended: Duration::from_millis(intended_ms),
            lag: Duration::ZERO,
            latency: Duration::from_millis(latency_ms),
            accepted,
        }
    }

    #[test]
    fn a_slow_answer_is_in_flight_across_the_slots_it_spans() {
        let s = slots(&[sent(0, 1, true), sent(1, 35, false), sent(12, 2, false)]);
        assert_eq!(s.len(), 4, "up to the slot of the last answer (36 ms)");
        assert_eq!((s[0].sent, s[0].answered, s[0].in_flight), (2, 1, 1));
        assert_eq!((s[1].sent, s[1].answered, s[1].in_flight), (1, 1, 1));
        assert_eq!((s[2].sent, s[2].answered, s[2].in_flight), (0, 0, 1));
        assert_eq!((s[3].sent, s[3].answered, s[3].in_flight), (0, 1, 0));
        assert_eq!(s[0].p99_accepted_ms, 1.0);
        assert_eq!(s[0].p99_refused_ms, 35.0);
        assert_eq!(s[0].p50_ms, 1.0);
        assert_eq!(s[0].p99_ms, 35.0);
        assert_eq!(s[1].t_ms, 10);
    }

    #[test]
    fn the_quantile_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(v.clone(), 0.5), 50.0);
        assert_eq!(quantile(v.clone(), 0.99), 99.0);
        assert_eq!(quantile(v, 1.0), 100.0);
        assert_eq!(quantile(Vec::new(), 0.99), 0.0);
    }
}

//! CPU time over a burst, from /proc (Linux): the server's (every thread,
//! user and system) and the whole host's. A figure of work per request
//! that does not depend on how fast the shared host happens to be.

/// A reading of the CPU counters, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// The process's user + system time.
    process: u64,
    /// The host's busy and total time, over every CPU.
    host_busy: u64,
    host_total: u64,
}

/// What a burst of `requests` cost, between two readings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// The process's CPU time per request, µs.
    pub us_per_request: f64,
    /// The share of the host's CPUs busy (0..1).
    pub host_busy: f64,
}

impl Reading {
    /// Reads `pid`'s and the host's counters; `None` off Linux or when
    /// the process is gone.
    pub fn now(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (host_busy, host_total) = crate::timeline::host_ticks()?;
        Some(Self {
            process: process_ticks(&stat)?,
            host_busy,
            host_total,
        })
    }

    /// The cost of `requests` from `self` to `later`.
    pub fn cost(&self, later: &Self, requests: u64) -> Cost {
        // USER_HZ: 100 on every Linux this runs on.
        let us = later.process.saturating_sub(self.process) as f64 * 10_000.0;
        let total = later.host_total.saturating_sub(self.host_total).max(1) as f64;
        Cost {
            us_per_request: us / requests.max(1) as f64,
            host_busy: later.host_busy.saturating_sub(self.host_busy) as f64 / total,
        }
    }
}

/// utime + stime of a `/proc/PID/stat` line (fields 14 and 15; the
/// command name in parentheses may hold spaces).
fn process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_user_plus_system_even_with_spaces_in_the_name() {
        let line = "4242 (tokio runtime) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    1500 250 0 0 20 0 12 0 9000 1000000 500 18446744073709551615";
        assert_eq!(process_ticks(line), Some(1750));
    }

    #[test]
    fn the_cost_is_per_request_and_the_busy_share_of_the_host() {
        let a = Reading {
            process: 100,
            host_busy: 1_000,
            host_total: 4_000,
        };
        let b = Reading {
            process: 300,
            host_busy: 1_150,
            host_total: 4_200,
        };
        let c = a.cost(&b, 1_000);
        assert_eq!(c.us_per_request, 2_000.0, "200 ticks of 10 ms over 1,000");
        assert_eq!(c.host_busy, 0.75);
    }

    #[test]
    fn this_process_can_be_read() {
        let r = Reading::now(std::process::id()).expect("a Linux /proc");
        assert!(r.host_total >= r.host_busy);
    }
}

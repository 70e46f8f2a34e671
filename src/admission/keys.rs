//! Redis key layout. Every key of an activity carries the hash tag
//! `{a:<activity_id>}`, so all keys one script touches live in one Redis
//! Cluster slot and the scripts run unchanged on a cluster.

/// The keys of one activity under this instance's prefix.
#[derive(Debug, Clone)]
pub struct ActivityKeys {
    base: String,
}

impl ActivityKeys {
    /// Keys for `activity_id` under `prefix` (`redis.key_prefix`).
    pub fn new(prefix: &str, activity_id: i64) -> Self {
        Self {
            base: format!("{prefix}{{a:{activity_id}}}:"),
        }
    }

    /// Hash of the activity's sale window and limits; present once warmed.
    pub fn meta(&self) -> String {
        format!("{}meta", self.base)
    }

    /// Stock bucket `b` (units available to reserve).
    pub fn bucket(&self, b: usize) -> String {
        format!("{}stock:{b}", self.base)
    }

    /// All `n` stock buckets.
    pub fn buckets(&self, n: usize) -> Vec<String> {
        (0..n).map(|b| self.bucket(b)).collect()
    }

    /// Hash `"<user>:<request_id>"` → order_no (I3).
    pub fn requests(&self) -> String {
        format!("{}reqs", self.base)
    }

    /// Hash user → live reserved quantity (I2).
    pub fn holdings(&self) -> String {
        format!("{}users", self.base)
    }

    /// One purchase token.
    pub fn token(&self, token: &str) -> String {
        format!("{}token:{token}", self.base)
    }

    /// The reservation record of one order.
    pub fn reservation(&self, order_no: i64) -> String {
        format!("{}res:{order_no}", self.base)
    }

    /// Zset of open (not yet committed) reservations by time.
    pub fn open(&self) -> String {
        format!("{}open", self.base)
    }

    /// When reconciliation first saw that Redis lost this activity (unix
    /// ms); present only until it is restored.
    pub fn restoring(&self) -> String {
        format!("{}restoring", self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_an_activity_shares_one_hash_tag() {
        let k = ActivityKeys::new("sk:", 42);
        for key in [
            k.meta(),
            k.bucket(3),
            k.requests(),
            k.holdings(),
            k.token("t"),
            k.reservation(9),
            k.open(),
            k.restoring(),
        ] {
            assert!(key.starts_with("sk:{a:42}:"), "{key}");
        }
        assert_ne!(
            ActivityKeys::new("sk:", 4).meta(),
            ActivityKeys::new("sk:", 42).meta()
        );
    }
}

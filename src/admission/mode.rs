//! Where an activity's purchases are admitted: the mode the activity row
//! stores, read by the admission path, its fallback and reconciliation.

/// Where an activity's purchases are admitted (`activities.admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The normal path.
    Redis,
    /// The database fallback.
    Database,
    /// Being loaded back into Redis by reconciliation.
    Restoring,
}

impl Mode {
    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Redis => "REDIS",
            Self::Database => "DATABASE",
            Self::Restoring => "RESTORING",
        }
    }

    /// The mode a column value names (REDIS for anything unknown).
    pub fn parse(s: &str) -> Self {
        match s {
            "DATABASE" => Self::Database,
            "RESTORING" => Self::Restoring,
            _ => Self::Redis,
        }
    }
}

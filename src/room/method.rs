//! How a room lets buyers through: `fifo`, `passthrough` or `reject`,
//! changeable during a sale.

use serde::{Deserialize, Serialize};

/// How a room lets buyers through, changeable during a sale
/// (docs/WAITING_ROOM.md, "Queueing methods").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// The drawn pre-queue, then in the order buyers came.
    #[default]
    Fifo,
    /// Open without queueing: a purchase token needs no pass. Tickets
    /// are still taken and admitted, so switching back finds the queue.
    Passthrough,
    /// Closed: no challenge, no join, no admission, no purchase token.
    Reject,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Fifo => "fifo",
            Method::Passthrough => "passthrough",
            Method::Reject => "reject",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "fifo" => Some(Method::Fifo),
            "passthrough" => Some(Method::Passthrough),
            "reject" => Some(Method::Reject),
            _ => None,
        }
    }
}

//! The order state machine (SPEC "Order states", I6): the states an order
//! goes through and the transitions allowed between them, in one place.
//!
//! ```text
//! PROCESSING ──► WAITING_PAY ──► PAID
//!     │              ├─────────► CANCELLED   (owner)
//!     │              ├─────────► CLOSED      (payment deadline)
//!     └──────────────┴─────────► FAILED      (no stock, over the limit, coupon, voided)
//! ```
//!
//! PROCESSING is the API's name for an order that has a reservation in
//! Redis but no row yet; it is never stored (the `orders.status` CHECK
//! refuses it). Every other state is a row's `status`, and every stored
//! transition is a conditional `UPDATE ... WHERE status = 'WAITING_PAY'`.
//! SQL text takes the states from here (`OrderStatus::X.sql()`), never as
//! literals.

use std::fmt;
use std::io::Write;

use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::pg::{Pg, PgValue};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::Text;
use serde::{Deserialize, Serialize};

/// The state of an order.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, AsExpression, FromSqlRow,
)]
#[diesel(sql_type = Text)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OrderStatus {
    /// Reserved in Redis, no row yet (never stored).
    Processing,
    /// Created with its stock locked, awaiting payment.
    WaitingPay,
    /// Paid: its stock sold.
    Paid,
    /// Cancelled by its owner: its stock released.
    Cancelled,
    /// Closed at its payment deadline: its stock released.
    Closed,
    /// Never backed (or voided): holds no stock.
    Failed,
}

impl OrderStatus {
    /// The states a row can have, in the order the API lists them.
    pub const STORED: [Self; 5] = [
        Self::WaitingPay,
        Self::Paid,
        Self::Cancelled,
        Self::Closed,
        Self::Failed,
    ];

    /// The states whose orders hold their units and count against the
    /// buyer's limit.
    pub const HOLDING: [Self; 2] = [Self::WaitingPay, Self::Paid];

    /// Its name in the API and in the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "PROCESSING",
            Self::WaitingPay => "WAITING_PAY",
            Self::Paid => "PAID",
            Self::Cancelled => "CANCELLED",
            Self::Closed => "CLOSED",
            Self::Failed => "FAILED",
        }
    }

    /// The state named `s` (any of the six), if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Processing]
            .into_iter()
            .chain(Self::STORED)
            .find(|st| st.as_str() == s)
    }

    /// Its name quoted as an SQL string literal, for SQL text (the unit
    /// test holds it to [`OrderStatus::as_str`]).
    pub const fn sql(self) -> &'static str {
        match self {
            Self::Processing => "'PROCESSING'",
            Self::WaitingPay => "'WAITING_PAY'",
            Self::Paid => "'PAID'",
            Self::Cancelled => "'CANCELLED'",
            Self::Closed => "'CLOSED'",
            Self::Failed => "'FAILED'",
        }
    }

    /// `states` as SQL string literals, for `status IN (...)`.
    pub fn sql_list(states: &[Self]) -> String {
        states
            .iter()
            .map(|s| s.sql())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether an order may move from this state to `next`. The only
    /// moves: a reservation becomes a row (WAITING_PAY, or FAILED when the
    /// database cannot back it), and a WAITING_PAY order is paid,
    /// cancelled, closed or failed. Every other state is final.
    pub const fn can_become(self, next: Self) -> bool {
        matches!(
            (self, next),
            (Self::Processing, Self::WaitingPay | Self::Failed)
                | (
                    Self::WaitingPay,
                    Self::Paid | Self::Cancelled | Self::Closed | Self::Failed
                )
        )
    }

    /// Whether an order in this state counts against its buyer's limit and
    /// holds its units (locked or sold).
    pub const fn holds_units(self) -> bool {
        matches!(self, Self::WaitingPay | Self::Paid)
    }

    /// Whether no transition leaves this state.
    pub const fn is_final(self) -> bool {
        !matches!(self, Self::Processing | Self::WaitingPay)
    }
}

impl fmt::Display for OrderStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ToSql<Text, Pg> for OrderStatus {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(self.as_str().as_bytes())?;
        Ok(IsNull::No)
    }
}

impl FromSql<Text, Pg> for OrderStatus {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let text = std::str::from_utf8(bytes.as_bytes())?;
        Self::parse(text).ok_or_else(|| format!("unknown order status {text:?}").into())
    }
}

#[cfg(test)]
mod tests {
    use super::OrderStatus::{self, *};

    const ALL: [OrderStatus; 6] = [Processing, WaitingPay, Paid, Cancelled, Closed, Failed];

    #[test]
    fn the_allowed_transitions_are_exactly_the_state_machine() {
        let allowed: Vec<(OrderStatus, OrderStatus)> = ALL
            .iter()
            .flat_map(|&from| ALL.iter().map(move |&to| (from, to)))
            .filter(|&(from, to)| from.can_become(to))
            .collect();
        assert_eq!(
            allowed,
            [
                (Processing, WaitingPay),
                (Processing, Failed),
                (WaitingPay, Paid),
                (WaitingPay, Cancelled),
                (WaitingPay, Closed),
                (WaitingPay, Failed),
            ]
        );
    }

    #[test]
    fn final_states_have_no_way_out_and_nothing_returns_to_a_live_one() {
        for from in ALL {
            let exits = ALL.iter().filter(|&&to| from.can_become(to)).count();
            assert_eq!(from.is_final(), exits == 0, "{from}");
            assert!(!from.can_become(Processing), "{from} → PROCESSING");
            assert!(!from.can_become(from), "{from} → itself");
        }
        // A paid order is never cancelled, closed or failed (I6).
        for to in [Cancelled, Closed, Failed] {
            assert!(!Paid.can_become(to));
        }
    }

    #[test]
    fn names_round_trip_and_only_live_orders_hold_units() {
        for s in ALL {
            assert_eq!(OrderStatus::parse(s.as_str()), Some(s));
            assert_eq!(
                serde_json::to_value(s).unwrap(),
                serde_json::json!(s.as_str())
            );
            assert_eq!(s.sql(), format!("'{s}'"));
        }
        assert_eq!(OrderStatus::parse("waiting_pay"), None);
        assert_eq!(OrderStatus::parse(""), None);
        let holding: Vec<_> = ALL.into_iter().filter(|s| s.holds_units()).collect();
        assert_eq!(holding, OrderStatus::HOLDING);
        assert_eq!(
            OrderStatus::sql_list(&OrderStatus::HOLDING),
            "'WAITING_PAY', 'PAID'"
        );
        assert!(!OrderStatus::STORED.contains(&Processing));
    }
}

//! A ticket as its holder sees it: state, place, wait, and the pass once
//! admitted, computed from one read of the room (`room_status.lua`).

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::draw::{self, Draw};
use super::entrants::Step;
use super::pass::Kind;
use crate::admission::gate::room::RoomView;

/// Where a ticket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TicketState {
    /// Taken before the start: its place is drawn when the sale starts.
    Prequeue,
    /// Waiting its turn.
    Queued,
    /// Its turn came: the pass buys a purchase token.
    Admitted,
    /// A released unit is held for it: the pass buys a purchase token.
    Offered,
    /// Sold out; on the waitlist for units that come back.
    SoldOut,
    /// Its pass or offer ran out unused.
    Expired,
    /// Its holder left the queue.
    Left,
}

/// `GET …/queue/me`'s body.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct TicketView {
    /// The ticket's number: the order it was taken in.
    pub ticket: u64,
    pub state: TicketState,
    /// Its place in the order of admission, from 1; null in the pre-queue
    /// (drawn at the start).
    pub position: Option<u64>,
    /// Tickets before it not yet admitted (some may have left); null in
    /// the pre-queue.
    pub ahead: Option<u64>,
    /// `ahead` at the admission rate; null when not waiting in turn.
    pub estimated_wait_secs: Option<u64>,
    /// When to ask again (or listen on `…/queue/events`).
    pub refresh_after_ms: u64,
    /// The signed pass for `GET …/token`'s `X-Queue-Pass`: ADMITTED and
    /// OFFERED only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_expires_at: Option<DateTime<Utc>>,
    /// The pass bought a purchase token already.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_used: Option<bool>,
    /// The queue this ticket is in: a new one starts if Redis loses the
    /// queue, and tickets of an earlier one are gone.
    pub epoch: i64,
    /// With `?proof=true`, once the sale started, for a ticket taken in
    /// the pre-queue: the proof that it was among the entrants the draw
    /// was keyed by (`scripts/verify_draw.py --ticket` checks it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inclusion: Option<Inclusion>,
}

/// A drawn ticket's proof of inclusion: its leaf is SHA-256(0x00 ‖ ticket
/// ‖ user ‖ salt), each step up hashes the running value with `path`'s
/// next hash on its side, and the last value is `root`, the draw's
/// published commitment.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Inclusion {
    /// The ticket's holder (the caller).
    pub user: i64,
    /// The leaf's salt, hex: secret to everyone else, so the hashes in
    /// another buyer's proof do not reveal this user.
    pub salt: String,
    /// Leaves in the tree: the draw's `entrants`.
    pub entrants: u64,
    /// Hex; equal to `GET …/queue/draw`'s `commitment`.
    pub root: String,
    /// Bottom up.
    pub path: Vec<Step>,
}

impl TicketView {
    /// The ticket of `view`, its place under `draw`, at `now_ms`; `sign`
    /// makes the pass of a kind and expiry.
    pub fn of(
        view: &RoomView,
        draw: Option<&Draw>,
        now_ms: i64,
        sign: impl Fn(Kind, i64) -> String,
    ) -> Self {
        let place = view.closed.then(|| draw::place(draw, view.ticket));
        let held = parse_held(&view.state);
        let state = match (&view.state[..], held) {
            ("L", _) => TicketState::Left,
            ("E", _) => TicketState::Expired,
            // It bought: its pass or offer did its work, and stays shown
            // as used, never as expired.
            (_, Some(h)) if h.use_ == Use::Bought => h.kind.state(),
            // Sold out: an unused pass no longer buys, and a used one
            // whose purchase lost the last race bought nothing; the
            // ticket waits for a unit to come back.
            (_, Some(h)) if view.sold_out && h.kind == Kind::Admitted => TicketState::SoldOut,
            // Ran out unused; an offer used without a purchase in its
            // time is over too.
            (_, Some(h))
                if now_ms >= h.expires_ms && (h.kind == Kind::Offer || h.use_ == Use::Unused) =>
            {
                TicketState::Expired
            }
            (_, Some(h)) => h.kind.state(),
            _ if !view.closed => TicketState::Prequeue,
            _ if view.sold_out => TicketState::SoldOut,
            _ => TicketState::Queued,
        };
        let waiting = matches!(state, TicketState::Queued | TicketState::SoldOut);
        let ahead = place.map(|p| {
            if waiting {
                p.saturating_sub(view.next_place())
            } else {
                0
            }
        });
        let rate = view.admit_per_sec.max(1) as u64;
        let estimated_wait_secs = (state == TicketState::Queued)
            .then(|| ahead.map(|a| a.div_ceil(rate)))
            .flatten();
        let refresh_after_ms = match state {
            TicketState::Queued => estimated_wait_secs
                .map_or(1_000, |s| s * 250)
                .clamp(1_000, 10_000),
            TicketState::Prequeue => 2_000,
            TicketState::Admitted | TicketState::Offered | TicketState::SoldOut => 5_000,
            TicketState::Expired | TicketState::Left => 30_000,
        };
        let pass = held.filter(|_| matches!(state, TicketState::Admitted | TicketState::Offered));
        let pass = pass.map(|h| (h.kind, h.use_ != Use::Unused, h.expires_ms));
        Self {
            ticket: view.ticket,
            state,
            position: place.map(|p| p + 1),
            ahead,
            estimated_wait_secs,
            refresh_after_ms,
            pass: pass.map(|(kind, _, exp)| sign(kind, exp)),
            pass_expires_at: pass.and_then(|(_, _, exp)| DateTime::from_timestamp_millis(exp)),
            pass_used: pass.map(|(_, used, _)| used),
            epoch: view.epoch,
            inclusion: None,
        }
    }
}

/// What became of a held pass or offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Unused,
    /// It bought a purchase token.
    Used,
    /// A purchase made with that token was accepted (`room_bought.lua`).
    Bought,
}

/// A held pass or offer.
#[derive(Debug, Clone, Copy)]
struct Held {
    kind: Kind,
    use_: Use,
    expires_ms: i64,
}

impl Kind {
    fn state(self) -> TicketState {
        match self {
            Kind::Admitted => TicketState::Admitted,
            Kind::Offer => TicketState::Offered,
        }
    }
}

/// A held state with its expiry: a pass `A:` (unused), `U:` (used), `B:`
/// (bought); an offer `O:`, `V:`, `D:` likewise.
fn parse_held(state: &str) -> Option<Held> {
    let (letter, exp) = state.split_once(':')?;
    let expires_ms = exp.parse().ok()?;
    let (kind, use_) = match letter {
        "A" => (Kind::Admitted, Use::Unused),
        "U" => (Kind::Admitted, Use::Used),
        "B" => (Kind::Admitted, Use::Bought),
        "O" => (Kind::Offer, Use::Unused),
        "V" => (Kind::Offer, Use::Used),
        "D" => (Kind::Offer, Use::Bought),
        _ => return None,
    };
    Some(Held {
        kind,
        use_,
        expires_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(state: &str, closed: bool, sold_out: bool) -> RoomView {
        RoomView {
            epoch: 1,
            closed,
            entrants: 0,
            seq: 10,
            serving: 3,
            sold_out,
            admit_per_sec: 2,
            ticket: 8,
            state: state.into(),
            commitment: String::new(),
            seed: String::new(),
            offering: 1,
            used: 0,
            taken: 0,
        }
    }

    fn of(v: &RoomView, now: i64) -> TicketView {
        TicketView::of(v, None, now, |k, e| format!("{}{e}", k.letter()))
    }

    #[test]
    fn a_waiting_ticket_counts_the_places_before_it() {
        let t = of(&view("", true, false), 0);
        assert_eq!(t.state, TicketState::Queued);
        assert_eq!(
            (t.position, t.ahead, t.estimated_wait_secs),
            (Some(8), Some(4), Some(2))
        );
        assert!(t.pass.is_none());
        let t = of(&view("", false, false), 0);
        assert_eq!(
            (t.state, t.position, t.ahead),
            (TicketState::Prequeue, None, None)
        );
    }

    #[test]
    fn a_pass_shows_until_it_expires_and_an_admitted_one_waitlists_at_sell_out() {
        let t = of(&view("A:500", true, false), 100);
        assert_eq!(
            (t.state, t.pass.as_deref()),
            (TicketState::Admitted, Some("A500"))
        );
        assert_eq!(t.pass_used, Some(false));
        assert_eq!(
            of(&view("A:500", true, false), 500).state,
            TicketState::Expired
        );
        assert_eq!(
            of(&view("A:500", true, true), 900).state,
            TicketState::SoldOut
        );
        assert_eq!(of(&view("A:500", true, true), 100).ahead, Some(6));
        // Used, and the purchase lost the last race: waitlisted.
        assert_eq!(
            of(&view("U:500", true, true), 100).state,
            TicketState::SoldOut
        );
        let t = of(&view("O:900", true, true), 100);
        assert_eq!(
            (t.state, t.pass.as_deref()),
            (TicketState::Offered, Some("O900"))
        );
        assert_eq!(of(&view("", true, true), 100).state, TicketState::SoldOut);
        // An offer used without a purchase in its time is over.
        assert_eq!(
            of(&view("V:900", true, true), 900).state,
            TicketState::Expired
        );
        assert_eq!(of(&view("L", true, false), 100).state, TicketState::Left);
        assert_eq!(of(&view("E", true, false), 100).state, TicketState::Expired);
    }

    #[test]
    fn a_used_pass_or_offer_never_reads_expired() {
        // Used before the sell-out, past its expiry: still admitted.
        let t = of(&view("U:500", true, false), 900);
        assert_eq!((t.state, t.pass_used), (TicketState::Admitted, Some(true)));
        // It bought: so it reads, sold out or not, long after.
        for sold_out in [false, true] {
            let t = of(&view("B:500", true, sold_out), 10_000);
            assert_eq!((t.state, t.pass_used), (TicketState::Admitted, Some(true)));
            let t = of(&view("D:900", true, sold_out), 10_000);
            assert_eq!((t.state, t.pass_used), (TicketState::Offered, Some(true)));
        }
    }
}

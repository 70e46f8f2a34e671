-- Real payment providers (docs/PAYMENTS.md): what the buyer's client needs
-- to pay, the provider's side closed on timeout, pending payments queried
-- when their callback is late, and refunds sent through the provider.

ALTER TABLE payments DROP CONSTRAINT payments_status_check;
ALTER TABLE payments ADD CONSTRAINT payments_status_check CHECK (status IN (
    'PENDING', 'SUCCESS', 'FAILED', 'REFUND_REQUIRED',
    'REFUNDING', 'REFUNDED', 'REFUND_FAILED'));
-- What the provider answered to the create (WeChat Pay Native's code_url,
-- Stripe's client_secret): NULL until it answered.
ALTER TABLE payments ADD COLUMN checkout JSONB;
-- The provider's own id of the payment, when it names it (Stripe's
-- PaymentIntent); WeChat Pay goes by our payment number.
ALTER TABLE payments ADD COLUMN provider_ref TEXT;
-- When the sweeper looks at a PENDING payment next (a query when its
-- callback is late, a close at the provider once its order is closed),
-- and how many times it has.
ALTER TABLE payments ADD COLUMN next_check_at TIMESTAMPTZ NOT NULL DEFAULT now();
ALTER TABLE payments ADD COLUMN checks INTEGER NOT NULL DEFAULT 0 CHECK (checks >= 0);
ALTER TABLE payments ADD COLUMN closed_at TIMESTAMPTZ;
CREATE INDEX payments_pending_check ON payments (next_check_at) WHERE status = 'PENDING';

-- One refund per payment: its number is the idempotency key at the
-- provider, so it is never sent as two refunds.
CREATE TABLE refunds (
    refund_no          BIGINT      PRIMARY KEY,
    payment_no         BIGINT      NOT NULL UNIQUE REFERENCES payments (payment_no),
    amount_cents       BIGINT      NOT NULL CHECK (amount_cents >= 0),
    -- LATE_PAYMENT: a charge for an order no longer payable;
    -- AFTER_SALE: an admin refunded a PAID order.
    kind               TEXT        NOT NULL CHECK (kind IN ('LATE_PAYMENT', 'AFTER_SALE')),
    reason             TEXT        NOT NULL,
    status             TEXT        NOT NULL DEFAULT 'REFUNDING'
                       CHECK (status IN ('REFUNDING', 'REFUNDED', 'REFUND_FAILED')),
    -- The provider has the refund (it answered the create): later
    -- attempts query it instead.
    accepted           BOOLEAN     NOT NULL DEFAULT false,
    provider_refund_id TEXT,
    attempts           INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error         TEXT,
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    refunded_at        TIMESTAMPTZ
);
CREATE INDEX refunds_due ON refunds (next_attempt_at) WHERE status = 'REFUNDING';

-- Statement reconciliation: one report per provider and bill date, what
-- the provider's statement has that we don't, the other way round, and
-- amounts that differ.
CREATE TABLE payment_statements (
    provider      TEXT        NOT NULL,
    bill_date     DATE        NOT NULL,
    provider_rows INTEGER     NOT NULL,
    our_rows      INTEGER     NOT NULL,
    differences   INTEGER     NOT NULL,
    report        JSONB       NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, bill_date)
);

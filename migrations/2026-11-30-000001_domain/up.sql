-- The whole seckill domain. PostgreSQL is the source of truth: every
-- invariant of SPEC.md that a row can carry is a constraint here, so a bug
-- upstream turns into a refused write, never into wrong data.

-- A flash sale of one SKU. `status` is the stored lifecycle (PENDING until
-- warmed, READY after); ACTIVE and ENDED follow from the clock.
CREATE TABLE activities (
    id               BIGSERIAL PRIMARY KEY,
    sku_id           BIGINT      NOT NULL,
    name             TEXT        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    price_cents      BIGINT      NOT NULL CHECK (price_cents >= 0),
    start_at         TIMESTAMPTZ NOT NULL,
    end_at           TIMESTAMPTZ NOT NULL,
    per_user_limit   INTEGER     NOT NULL CHECK (per_user_limit >= 1),
    pay_timeout_secs INTEGER     NOT NULL CHECK (pay_timeout_secs >= 1),
    buckets          INTEGER     NOT NULL CHECK (buckets >= 1),
    status           TEXT        NOT NULL DEFAULT 'PENDING'
                     CHECK (status IN ('PENDING', 'READY', 'ACTIVE', 'ENDED')),
    warmed_at        TIMESTAMPTZ,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (end_at > start_at)
);

-- One row per activity, in units. I7: total = available + locked + sold.
CREATE TABLE stock (
    activity_id BIGINT      PRIMARY KEY REFERENCES activities (id),
    total       INTEGER     NOT NULL CHECK (total >= 1),
    available   INTEGER     NOT NULL CHECK (available >= 0),
    locked      INTEGER     NOT NULL DEFAULT 0 CHECK (locked >= 0),
    sold        INTEGER     NOT NULL DEFAULT 0 CHECK (sold >= 0),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (total = available + locked + sold)
);

CREATE TABLE coupons (
    id               BIGSERIAL   PRIMARY KEY,
    name             TEXT        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    total            INTEGER     NOT NULL CHECK (total >= 1),
    claimed          INTEGER     NOT NULL DEFAULT 0 CHECK (claimed >= 0),
    discount_cents   BIGINT      NOT NULL CHECK (discount_cents >= 0),
    min_amount_cents BIGINT      NOT NULL DEFAULT 0 CHECK (min_amount_cents >= 0),
    per_user_limit   INTEGER     NOT NULL DEFAULT 1 CHECK (per_user_limit >= 1),
    valid_until      TIMESTAMPTZ NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- I8: never more claimed than exist.
    CHECK (claimed <= total)
);

-- Orders. `order_no` is the snowflake id made at admission; I3 is the
-- unique (activity, user, request_id).
CREATE TABLE orders (
    order_no       BIGINT      PRIMARY KEY,
    request_id     TEXT        NOT NULL CHECK (length(request_id) BETWEEN 1 AND 64),
    activity_id    BIGINT      NOT NULL REFERENCES activities (id),
    user_id        BIGINT      NOT NULL,
    quantity       INTEGER     NOT NULL CHECK (quantity >= 1),
    amount_cents   BIGINT      NOT NULL CHECK (amount_cents >= 0),
    coupon_id      BIGINT      REFERENCES coupons (id),
    status         TEXT        NOT NULL
                   CHECK (status IN ('WAITING_PAY', 'PAID', 'CANCELLED', 'CLOSED', 'FAILED')),
    failure_reason TEXT,
    pay_deadline   TIMESTAMPTZ,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    paid_at        TIMESTAMPTZ,
    closed_at      TIMESTAMPTZ,
    CONSTRAINT orders_request_unique UNIQUE (activity_id, user_id, request_id),
    CHECK (status <> 'FAILED' OR failure_reason IS NOT NULL),
    CHECK (status <> 'WAITING_PAY' OR pay_deadline IS NOT NULL)
);
-- The timeout closer scans overdue WAITING_PAY orders only.
CREATE INDEX orders_waiting_deadline ON orders (pay_deadline) WHERE status = 'WAITING_PAY';
-- "My orders", newest first, keyset-paginated by order_no.
CREATE INDEX orders_user_newest ON orders (user_id, order_no DESC);
CREATE INDEX orders_activity_status ON orders (activity_id, status);

-- Every stock movement, once: a second LOCK / CONFIRM / RELEASE for the same
-- order violates the unique key and the transaction that tried it rolls back.
CREATE TABLE stock_flow (
    id          BIGSERIAL   PRIMARY KEY,
    activity_id BIGINT      NOT NULL REFERENCES activities (id),
    biz_type    TEXT        NOT NULL CHECK (biz_type IN ('LOCK', 'CONFIRM', 'RELEASE')),
    biz_no      BIGINT      NOT NULL,
    quantity    INTEGER     NOT NULL CHECK (quantity >= 1),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT stock_flow_once UNIQUE (biz_type, biz_no)
);

-- Consumer idempotency (I5): an event applied by a consumer is recorded in
-- the same transaction as its effects.
CREATE TABLE consume_log (
    event_id   TEXT        NOT NULL,
    consumer   TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer)
);

-- Transactional outbox: events born in a DB transaction, published later.
CREATE TABLE outbox (
    id              BIGSERIAL   PRIMARY KEY,
    topic           TEXT        NOT NULL,
    event_key       TEXT        NOT NULL,
    payload         JSONB       NOT NULL,
    status          TEXT        NOT NULL DEFAULT 'NEW'
                    CHECK (status IN ('NEW', 'RETRY', 'SENT', 'DEAD')),
    attempts        INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at         TIMESTAMPTZ
);
CREATE INDEX outbox_pending ON outbox (next_attempt_at, id) WHERE status IN ('NEW', 'RETRY');

CREATE TABLE payments (
    payment_no      BIGINT      PRIMARY KEY,
    order_no        BIGINT      NOT NULL REFERENCES orders (order_no),
    amount_cents    BIGINT      NOT NULL CHECK (amount_cents >= 0),
    status          TEXT        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'SUCCESS', 'FAILED', 'REFUND_REQUIRED')),
    provider        TEXT        NOT NULL,
    provider_txn_id TEXT        UNIQUE,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    paid_at         TIMESTAMPTZ
);
-- At most one pending payment per order: repeated pay calls return it.
CREATE UNIQUE INDEX payments_one_pending ON payments (order_no) WHERE status = 'PENDING';

CREATE TABLE user_coupons (
    id         BIGSERIAL   PRIMARY KEY,
    coupon_id  BIGINT      NOT NULL REFERENCES coupons (id),
    user_id    BIGINT      NOT NULL,
    request_id TEXT        NOT NULL,
    status     TEXT        NOT NULL DEFAULT 'UNUSED' CHECK (status IN ('UNUSED', 'LOCKED', 'USED')),
    order_no   BIGINT,
    claimed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- I8 last guard: one coupon of a batch per user, whatever Redis says.
    CONSTRAINT user_coupons_once UNIQUE (coupon_id, user_id),
    CHECK ((status = 'UNUSED') = (order_no IS NULL))
);
CREATE INDEX user_coupons_user ON user_coupons (user_id);

-- Back to one order table; the numbers keep their genes, which nothing
-- reads any more.
ALTER TABLE payments DROP CONSTRAINT payments_order_fkey;
DROP TRIGGER payments_order_slot ON payments;
DROP FUNCTION seckill_payment_order_slot();
ALTER TABLE payments DROP COLUMN order_slot;

ALTER TABLE orders RENAME TO orders_partitioned;
ALTER TABLE orders_partitioned RENAME CONSTRAINT orders_pkey TO orders_partitioned_pkey;
ALTER TABLE orders_partitioned RENAME CONSTRAINT orders_request_unique TO orders_partitioned_request_unique;
ALTER INDEX orders_waiting_deadline RENAME TO orders_partitioned_waiting_deadline;
ALTER INDEX orders_user_newest RENAME TO orders_partitioned_user_newest;
ALTER INDEX orders_activity_status RENAME TO orders_partitioned_activity_status;

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
INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents,
                    coupon_id, status, failure_reason, pay_deadline, created_at, updated_at,
                    paid_at, closed_at)
SELECT order_no, request_id, activity_id, user_id, quantity, amount_cents,
       coupon_id, status, failure_reason, pay_deadline, created_at, updated_at,
       paid_at, closed_at
FROM orders_partitioned;
DROP TABLE orders_partitioned;
CREATE INDEX orders_waiting_deadline ON orders (pay_deadline) WHERE status = 'WAITING_PAY';
CREATE INDEX orders_user_newest ON orders (user_id, order_no DESC);
CREATE INDEX orders_activity_status ON orders (activity_id, status);
ALTER TABLE payments ADD CONSTRAINT payments_order_no_fkey
    FOREIGN KEY (order_no) REFERENCES orders (order_no);

DROP FUNCTION seckill_order_slot(BIGINT);
DROP TABLE order_partitioning;
DROP FUNCTION seckill_user_slot(BIGINT);

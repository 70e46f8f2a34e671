-- The order table split by buyer (seed 001, §4.1: "按user_id做分表键"), so
-- that "my orders" reads one partition however many orders there are.
--
-- The key is the buyer's slot, `user_slot` = splitmix64(user_id) mod 16:
-- the same function as the code's `orders::partition::user_slot` (and the
-- shard a sharded activity routes the buyer to is slot mod shards). Every
-- order number minted from this version on carries its buyer's slot in its
-- low 4 bits (the "gene"), so a lookup by number alone also reads one
-- partition: `user_slot = order_no & 15`.
--
-- LIST partitioning by the slot, one partition per value, rather than
-- PostgreSQL's HASH partitioning of user_id: HASH uses PostgreSQL's own
-- hash, which the code would have to reproduce to put the partition into
-- a number, and HASH of the slot would not map 16 values one to a
-- partition. The number of partitions (16) is the gene's width: changing
-- it means a new gene, so it is fixed here.
--
-- Converting in place: the numbers minted before carry no gene. The
-- highest of them is kept (`order_partitioning.legacy_max_order_no`): a
-- lookup by a number at or below it asks every partition (16 index
-- probes), one above it reads its gene's partition. Existing rows are
-- copied into the partitions of their buyers' slots, in this migration's
-- one transaction (minutes for tens of millions of rows; see
-- docs/OPERATIONS.md, "The partitioned order table").

-- splitmix64(uid) mod 16, in SQL (numeric arithmetic mod 2^64; XOR on
-- the two 32-bit halves). For the conversion and for checks; the code
-- computes it itself on every write.
CREATE FUNCTION seckill_user_slot(uid BIGINT) RETURNS SMALLINT
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    m  CONSTANT NUMERIC := 18446744073709551616;
    h  CONSTANT NUMERIC := 4294967296;
    z  NUMERIC;
    s  NUMERIC;
    sh INT;
BEGIN
    z := mod(uid::NUMERIC + m + 11400714819323198485, m);
    FOREACH sh IN ARRAY ARRAY[30, 27, 31] LOOP
        s := trunc(z / power(2::NUMERIC, sh));
        z := ((trunc(z / h)::BIGINT # trunc(s / h)::BIGINT)::NUMERIC * h)
             + (mod(z, h)::BIGINT # mod(s, h)::BIGINT)::NUMERIC;
        IF sh = 30 THEN
            z := mod(z * 13787848793156543929, m);
        ELSIF sh = 27 THEN
            z := mod(z * 10723151780598845931, m);
        END IF;
    END LOOP;
    RETURN mod(z, 16)::SMALLINT;
END
$$;

CREATE TABLE order_partitioning (
    singleton           BOOLEAN  PRIMARY KEY DEFAULT true CHECK (singleton),
    partitions          SMALLINT NOT NULL,
    legacy_max_order_no BIGINT   NOT NULL
);
INSERT INTO order_partitioning (partitions, legacy_max_order_no)
SELECT 16, COALESCE(max(order_no), 0) FROM orders;

ALTER TABLE payments DROP CONSTRAINT payments_order_no_fkey;
ALTER TABLE orders RENAME TO orders_unpartitioned;
ALTER TABLE orders_unpartitioned RENAME CONSTRAINT orders_pkey TO orders_unpartitioned_pkey;
ALTER TABLE orders_unpartitioned RENAME CONSTRAINT orders_request_unique TO orders_unpartitioned_request_unique;
ALTER INDEX orders_waiting_deadline RENAME TO orders_unpartitioned_waiting_deadline;
ALTER INDEX orders_user_newest RENAME TO orders_unpartitioned_user_newest;
ALTER INDEX orders_activity_status RENAME TO orders_unpartitioned_activity_status;

CREATE TABLE orders (
    order_no       BIGINT      NOT NULL,
    user_slot      SMALLINT    NOT NULL CHECK (user_slot BETWEEN 0 AND 15),
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
    -- The slot is the buyer's: one user's orders are in one partition.
    -- (A function call per row would cost the batch insert; the code
    -- computes it, and this holds it to the function.)
    -- Unique per partition, and the slot is a function of the number
    -- (below) and of the buyer: so order_no is unique, and I3 holds.
    CONSTRAINT orders_pkey PRIMARY KEY (order_no, user_slot),
    CONSTRAINT orders_request_unique UNIQUE (activity_id, user_id, request_id, user_slot),
    CHECK (status <> 'FAILED' OR failure_reason IS NOT NULL),
    CHECK (status <> 'WAITING_PAY' OR pay_deadline IS NOT NULL)
) PARTITION BY LIST (user_slot);

DO $$
DECLARE
    legacy BIGINT := (SELECT legacy_max_order_no FROM order_partitioning);
BEGIN
    FOR p IN 0..15 LOOP
        EXECUTE format('CREATE TABLE orders_p%s PARTITION OF orders FOR VALUES IN (%s)', p, p);
    END LOOP;
    -- A number minted from now on carries its slot: with the key above,
    -- no two orders share a number. Numbers up to the legacy maximum were
    -- unique in the old table's key already.
    EXECUTE format(
        'ALTER TABLE orders ADD CONSTRAINT orders_number_gene '
        'CHECK (order_no <= %s OR (order_no & 15) = user_slot)', legacy);
END
$$;

CREATE INDEX orders_waiting_deadline ON orders (pay_deadline) WHERE status = 'WAITING_PAY';
-- "My orders", newest first, keyset-paginated by order_no (in its partition).
CREATE INDEX orders_user_newest ON orders (user_id, order_no DESC);
CREATE INDEX orders_activity_status ON orders (activity_id, status);

INSERT INTO orders (order_no, user_slot, request_id, activity_id, user_id, quantity,
                    amount_cents, coupon_id, status, failure_reason, pay_deadline,
                    created_at, updated_at, paid_at, closed_at)
SELECT order_no, seckill_user_slot(user_id), request_id, activity_id, user_id, quantity,
       amount_cents, coupon_id, status, failure_reason, pay_deadline,
       created_at, updated_at, paid_at, closed_at
FROM orders_unpartitioned;
DROP TABLE orders_unpartitioned;

-- The slot of an order's partition, from its number: the gene of a number
-- minted from this version on, else the row's (one probe per partition).
-- A query `WHERE order_no = $1 AND user_slot = seckill_order_slot($1)`
-- reads one partition (pruned when the executor starts: STABLE, and not
-- SQL, so it is not inlined).
CREATE FUNCTION seckill_order_slot(n BIGINT) RETURNS SMALLINT
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE AS $$
BEGIN
    IF n > (SELECT legacy_max_order_no FROM order_partitioning) THEN
        RETURN (n & 15)::SMALLINT;
    END IF;
    RETURN (SELECT user_slot FROM orders WHERE order_no = n);
END
$$;

-- A payment still names an existing order: the order's key is
-- (order_no, user_slot) now, so the payment keeps its order's slot, filled
-- in from the order when a payment is written.
ALTER TABLE payments ADD COLUMN order_slot SMALLINT;
UPDATE payments p SET order_slot = o.user_slot FROM orders o WHERE o.order_no = p.order_no;
ALTER TABLE payments ALTER COLUMN order_slot SET NOT NULL;

CREATE FUNCTION seckill_payment_order_slot() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.order_slot IS NULL THEN
        IF NEW.order_no > (SELECT legacy_max_order_no FROM order_partitioning) THEN
            NEW.order_slot := NEW.order_no & 15;
        ELSE
            NEW.order_slot := (SELECT user_slot FROM orders WHERE order_no = NEW.order_no);
        END IF;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER payments_order_slot BEFORE INSERT ON payments
    FOR EACH ROW EXECUTE FUNCTION seckill_payment_order_slot();
ALTER TABLE payments ADD CONSTRAINT payments_order_fkey
    FOREIGN KEY (order_no, order_slot) REFERENCES orders (order_no, user_slot);

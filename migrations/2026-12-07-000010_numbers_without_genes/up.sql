-- Order numbers without their buyer's gene in their low bits: every number
-- minted before the split, and also those an older binary still mints
-- during a rolling upgrade, and the events it left on the broker. Their
-- rows go to their buyers' partitions like any other (every writer takes
-- the slot from the buyer), but the check that tied every number above
-- the legacy maximum to its gene refused them, and their orders ended
-- FAILED. The slot is the buyer's; a number is unique by its instance
-- lease, whatever its low bits.
ALTER TABLE orders DROP CONSTRAINT orders_number_gene;

-- A number's partition: its gene's when the row is there (one probe);
-- else wherever the row is (one probe per partition), for a number
-- minted without a gene; else its gene's (no row: one partition read).
CREATE OR REPLACE FUNCTION seckill_order_slot(n BIGINT) RETURNS SMALLINT
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE AS $$
DECLARE
    gene CONSTANT SMALLINT := (n & 15)::SMALLINT;
BEGIN
    IF n > (SELECT legacy_max_order_no FROM order_partitioning)
       AND EXISTS (SELECT 1 FROM orders WHERE order_no = n AND user_slot = gene) THEN
        RETURN gene;
    END IF;
    RETURN COALESCE((SELECT user_slot FROM orders WHERE order_no = n), gene);
END
$$;

-- A payment keeps its order's slot: the row's, whatever the number's low
-- bits say.
CREATE OR REPLACE FUNCTION seckill_payment_order_slot() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.order_slot IS NULL THEN
        NEW.order_slot := seckill_order_slot(NEW.order_no);
    END IF;
    RETURN NEW;
END
$$;

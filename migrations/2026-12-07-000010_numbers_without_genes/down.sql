CREATE OR REPLACE FUNCTION seckill_payment_order_slot() RETURNS trigger
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

CREATE OR REPLACE FUNCTION seckill_order_slot(n BIGINT) RETURNS SMALLINT
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE AS $$
BEGIN
    IF n > (SELECT legacy_max_order_no FROM order_partitioning) THEN
        RETURN (n & 15)::SMALLINT;
    END IF;
    RETURN (SELECT user_slot FROM orders WHERE order_no = n);
END
$$;

-- Rows written meanwhile without a gene stay; new ones are checked again.
DO $$
BEGIN
    EXECUTE format(
        'ALTER TABLE orders ADD CONSTRAINT orders_number_gene '
        'CHECK (order_no <= %s OR (order_no & 15) = user_slot) NOT VALID',
        (SELECT legacy_max_order_no FROM order_partitioning));
END
$$;

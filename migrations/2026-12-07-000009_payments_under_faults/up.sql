-- Money under faults (docs/PAYMENTS.md).

-- The payment whose capture paid its order: at most one per order. An
-- after-sale refund gives back this one, never another capture of the
-- same order (a late payment has a refund of its own).
ALTER TABLE payments ADD COLUMN pays_order BOOLEAN NOT NULL DEFAULT false;
UPDATE payments SET pays_order = true
 WHERE status = 'SUCCESS'
    OR payment_no IN (SELECT payment_no FROM refunds WHERE kind = 'AFTER_SALE');
CREATE UNIQUE INDEX payments_one_paying ON payments (order_no) WHERE pays_order;

-- An order's payments, found by its number (GET /orders/{no}, the pay
-- call): the only index on it was for pending ones.
CREATE INDEX payments_order_no ON payments (order_no);

-- The sweeper follows a FAILED payment too until the provider has closed
-- it: the buyer may still pay it there.
DROP INDEX payments_pending_check;
CREATE INDEX payments_open_check ON payments (next_check_at)
    WHERE status = 'PENDING' OR (status = 'FAILED' AND closed_at IS NULL);

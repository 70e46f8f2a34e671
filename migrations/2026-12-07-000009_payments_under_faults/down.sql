DROP INDEX payments_open_check;
CREATE INDEX payments_pending_check ON payments (next_check_at) WHERE status = 'PENDING';
DROP INDEX payments_order_no;
DROP INDEX payments_one_paying;
ALTER TABLE payments DROP COLUMN pays_order;

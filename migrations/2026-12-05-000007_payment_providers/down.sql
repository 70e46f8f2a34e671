DROP TABLE payment_statements;
DROP TABLE refunds;
DROP INDEX payments_pending_check;
ALTER TABLE payments DROP COLUMN closed_at;
ALTER TABLE payments DROP COLUMN checks;
ALTER TABLE payments DROP COLUMN next_check_at;
ALTER TABLE payments DROP COLUMN checkout;
ALTER TABLE payments DROP COLUMN provider_ref;
UPDATE payments SET status = 'SUCCESS' WHERE status IN ('REFUNDING', 'REFUNDED', 'REFUND_FAILED');
ALTER TABLE payments DROP CONSTRAINT payments_status_check;
ALTER TABLE payments ADD CONSTRAINT payments_status_check CHECK (status IN (
    'PENDING', 'SUCCESS', 'FAILED', 'REFUND_REQUIRED'));

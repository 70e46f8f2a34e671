DROP SEQUENCE fallback_order_seq;
ALTER TABLE activities DROP COLUMN admission_since, DROP COLUMN admission;

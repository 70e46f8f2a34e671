-- Where an activity's purchases are admitted (docs/FALLBACK.md):
--   REDIS      the normal path (Redis reservation, Kafka, the consumer);
--   DATABASE   Redis was unreachable and purchases are written here, one
--              transaction each (the database fallback);
--   RESTORING  Redis answers again and reconciliation is loading the
--              activity back into it; purchases wait (503) for a moment.
-- Every fallback purchase locks the stock row and reads this column after
-- the lock; reconciliation changes it under the same lock, so no fallback
-- order is written after the snapshot that restores Redis.
ALTER TABLE activities
    ADD COLUMN admission TEXT NOT NULL DEFAULT 'REDIS'
        CHECK (admission IN ('REDIS', 'DATABASE', 'RESTORING')),
    ADD COLUMN admission_since TIMESTAMPTZ;

-- The sequence part of the order numbers the database makes in the
-- fallback: snowflakes of instance id 1023, which no lease ever grants.
CREATE SEQUENCE fallback_order_seq;

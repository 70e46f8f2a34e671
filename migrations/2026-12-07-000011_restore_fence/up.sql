-- The moment (unix ms, the application's clock) of an activity's latest
-- restore into Redis from the database. Reservations made before it were
-- lost with Redis, and the restore counted only those whose orders were
-- rows by then. An order event of any other one that reaches the consumer
-- later (a send that started before the loss and ended after the restore)
-- makes no order: its unit and its request id were never restored, and a
-- retry of the purchase may already hold them.
ALTER TABLE activities ADD COLUMN restore_fence_ms BIGINT NOT NULL DEFAULT 0;

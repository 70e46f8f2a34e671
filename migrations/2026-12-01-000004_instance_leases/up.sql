-- The fence of the instance-id leases (src/ids/lease.rs). A lease lives in
-- Redis, and Redis can restart empty while its holder still mints numbers
-- under it; this row survives that. A holder mints only while it has
-- renewed both; another process takes an id only once `leased_until` (on
-- the database's clock) has passed, and starts above `floor_ms`, the last
-- millisecond the holder could have reached.
CREATE TABLE instance_leases (
    instance_id SMALLINT PRIMARY KEY CHECK (instance_id BETWEEN 0 AND 1022),
    owner TEXT NOT NULL,
    leased_until TIMESTAMPTZ NOT NULL,
    floor_ms BIGINT NOT NULL DEFAULT 0
);

-- The waiting room of an activity (docs/WAITING_ROOM.md): an option chosen
-- at creation, in the same transaction as the activity. The queue itself
-- lives in Redis; this row is what it is rebuilt from.
--
-- `seed` orders the pre-queue draw. It stays secret until the sale starts
-- (its SHA-256 is public from creation, so it cannot be chosen later);
-- `epoch` counts the queues this room has had: Redis restarted empty
-- starts a new one, and passes of an older epoch are refused.
CREATE TABLE waiting_rooms (
    activity_id BIGINT PRIMARY KEY REFERENCES activities (id),
    prequeue_secs INTEGER NOT NULL CHECK (prequeue_secs >= 0),
    admit_per_sec INTEGER NOT NULL CHECK (admit_per_sec >= 1),
    max_active INTEGER CHECK (max_active IS NULL OR max_active >= 1),
    pass_ttl_secs INTEGER NOT NULL CHECK (pass_ttl_secs >= 1),
    offer_secs INTEGER NOT NULL CHECK (offer_secs >= 1),
    pow_difficulty BIGINT NOT NULL CHECK (pow_difficulty >= 1),
    seed TEXT NOT NULL CHECK (seed ~ '^[0-9a-f]{64}$'),
    epoch INTEGER NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    -- When the first queue was opened in Redis: a room missing after that
    -- was lost, and the next epoch starts.
    opened_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

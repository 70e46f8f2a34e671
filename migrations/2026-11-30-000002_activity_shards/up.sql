-- Shards of an activity's Redis keys (docs/HOT_ACTIVITY.md): 1 is the
-- single-slot layout every activity had before. Fixed at creation.
ALTER TABLE activities
    ADD COLUMN shards INTEGER NOT NULL DEFAULT 1 CHECK (shards BETWEEN 1 AND 16);

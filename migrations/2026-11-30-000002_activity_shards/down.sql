ALTER TABLE activities DROP COLUMN shards;

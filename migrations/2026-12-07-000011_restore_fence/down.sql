ALTER TABLE activities DROP COLUMN restore_fence_ms;

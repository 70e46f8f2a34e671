-- shard_stock.lua — one shard's units, read with its meta in one step.
--
-- KEYS[1] the shard's meta hash   KEYS[2..] its stock buckets
--
-- Returns -1 when the shard is not warm (never loaded, or dropped for a
-- restore, which removes the meta with the buckets in one transaction),
-- else the sum of its buckets. Read apart, a bucket gone with its shard
-- read as 0 units beside a meta still there: "sold out" for a shard that
-- was only being restored.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local sum = 0
for i = 2, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
return sum

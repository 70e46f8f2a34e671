-- stock_mark.lua — what a repair of one shard decides on, read in one step.
--
-- KEYS[1] the shard's meta hash   KEYS[2] its open-reservations zset
-- KEYS[3..] its stock buckets, in bucket order
--
-- Returns {sum of the buckets, open reservations, purchases accepted}.
-- The acceptance count grows by one per purchase (`reserve.lua`), and a
-- restore restarts it at minus the time in ms: a repair given it
-- (`repair.lua`) applies only if no purchase was accepted since.
local sum = 0
for i = 3, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0')
return {sum, redis.call('ZCARD', KEYS[2]), accepted}

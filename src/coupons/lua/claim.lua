-- claim.lua — claim one coupon of a batch, atomically.
--
-- KEYS[1] meta hash (remaining, valid_until_ms)   KEYS[2] claimants set
-- KEYS[3] requests hash ("<user>:<request_id>" -> 1)
-- KEYS[4] unconfirmed zset ("<user>:<request_id>", score: claimed at, ms)
-- ARGV[1] user id   ARGV[2] request_id   ARGV[3] now (unix ms)
--
-- Returns 0 claimed now, 1 replay (this request_id claimed before),
-- 2 exhausted, 3 already claimed (by another request), 4 expired, 5 unknown.
-- A claim made now stays in KEYS[4] until its event's delivery is
-- confirmed (or it is undone): the reconciler sends it again otherwise.
local field = ARGV[1] .. ':' .. ARGV[2]
if redis.call('HEXISTS', KEYS[3], field) == 1 then return 1 end
local meta = redis.call('HMGET', KEYS[1], 'remaining', 'valid_until_ms')
if not meta[1] then return 5 end
if tonumber(ARGV[3]) >= tonumber(meta[2]) then return 4 end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 3 end
if tonumber(meta[1]) <= 0 then return 2 end
redis.call('HINCRBY', KEYS[1], 'remaining', -1)
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], field, '1')
redis.call('ZADD', KEYS[4], ARGV[3], field)
return 0

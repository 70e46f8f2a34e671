-- unclaim.lua — undo a claim whose event could not be published.
--
-- KEYS[1] meta hash   KEYS[2] claimants set   KEYS[3] requests hash
-- KEYS[4] unconfirmed zset
-- ARGV[1] user id     ARGV[2] request_id
--
-- Returns 1 when undone now, 0 when the user held no claim (idempotent).
local field = ARGV[1] .. ':' .. ARGV[2]
redis.call('ZREM', KEYS[4], field)
if redis.call('SREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'remaining', 1)
redis.call('HDEL', KEYS[3], field)
return 1

-- unclaim.lua — undo a claim whose event could not be published.
--
-- KEYS[1] meta hash   KEYS[2] claimants set   KEYS[3] requests hash
-- ARGV[1] user id     ARGV[2] request_id
--
-- Returns 1 when undone now, 0 when the user held no claim (idempotent).
if redis.call('SREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'remaining', 1)
redis.call('HDEL', KEYS[3], ARGV[1] .. ':' .. ARGV[2])
return 1

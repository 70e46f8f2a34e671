-- use.lua — decide at admission whether a buyer's coupon can back an
-- order, and hold it for that order, atomically.
--
-- KEYS[1] meta hash (remaining, valid_until_ms, min_amount)
-- KEYS[2] claimants set   KEYS[3] uses hash (user -> the order_no its
--         coupon backs: locked by a live order, or used by a paid one)
-- ARGV[1] user id   ARGV[2] order_no   ARGV[3] the order's amount (cents)
-- ARGV[4] now (unix ms)
--
-- Returns 0 held for this order now (or already, a repeat of the call),
-- 1 unknown batch (Redis lost it), 2 not the buyer's (never claimed),
-- 3 expired, 4 the amount is below the coupon's minimum, 5 backing another
-- order (live or paid).
local meta = redis.call('HMGET', KEYS[1], 'valid_until_ms', 'min_amount')
if not meta[1] then return 1 end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then return 2 end
if tonumber(ARGV[4]) >= tonumber(meta[1]) then return 3 end
if tonumber(ARGV[3]) < tonumber(meta[2] or '0') then return 4 end
local held = redis.call('HGET', KEYS[3], ARGV[1])
if held and held ~= ARGV[2] then return 5 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return 0

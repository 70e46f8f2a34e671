-- repair.lua — set an activity's Redis stock to the database's figure, as
-- a compare-and-set.
--
-- KEYS[1] open-reservations zset   KEYS[2..] stock buckets, in bucket order
-- ARGV[1] the sum of the buckets the caller based its decision on
-- ARGV[2] the figure to set (the database's available)
-- ARGV[3] the stock-returned channel   ARGV[4] the activity id (units
--         added are announced there: admission/soldout.rs)
--
-- Applies only while nothing is open (no reservation between Redis and the
-- database) and the buckets still sum to ARGV[1]: anything that moved the
-- stock since the caller looked (a purchase, a release) cancels the repair,
-- so a release can never be counted twice. A negative correction takes
-- from the buckets in order and never below zero.
-- Returns {1, delta applied} or {0, current sum} when it did nothing.
local sum = 0
for i = 2, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
if redis.call('ZCARD', KEYS[1]) > 0 or sum ~= tonumber(ARGV[1]) then
  return {0, sum}
end
local delta = tonumber(ARGV[2]) - sum
if delta >= 0 then
  redis.call('INCRBY', KEYS[2], delta)
  if delta > 0 then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
  return {1, delta}
end
local need, applied = -delta, 0
for i = 2, #KEYS do
  if need == 0 then break end
  local s = tonumber(redis.call('GET', KEYS[i]) or '0')
  local take = math.min(s, need)
  if take > 0 then
    redis.call('DECRBY', KEYS[i], take)
    need = need - take
    applied = applied - take
  end
end
return {1, applied}

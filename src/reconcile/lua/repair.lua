-- repair.lua — set an activity's Redis stock to the database's figure, as
-- a compare-and-set.
--
-- KEYS[1] the slot's fence (see fenced.lua)
-- KEYS[2] open-reservations zset   KEYS[3] the shard's meta hash
-- KEYS[4..] stock buckets, in bucket order
-- ARGV[1] the sum of the buckets the caller based its decision on
-- ARGV[2] the figure to set (the database's available)
-- ARGV[3] the stock-returned channel   ARGV[4] the activity id (units
--         added are announced there: admission/soldout.rs)
-- ARGV[5] the caller's reconcile lease token
-- ARGV[6] the meta's acceptance count when the caller read the buckets
--         (stock_mark.lua), before its database snapshot
--
-- Applies only while nothing is open (no reservation between Redis and the
-- database), the buckets still sum to ARGV[1], and no purchase was
-- accepted since the caller read them. The sum alone is not enough: a
-- purchase accepted and written after the caller's database snapshot,
-- together with a cancel's unit given back after the caller read Redis
-- (and counted in that snapshot), leaves the sum as it was, and the
-- database's figure would give Redis a unit the database does not have.
-- Purchases take units and releases give them; every purchase is counted,
-- so the sum catches the rest: a release can never be counted twice. A
-- negative correction takes from the buckets in order and never below
-- zero.
-- A caller whose lease token is below the fence (a newer holder wrote
-- here) changes nothing.
-- Returns {1, delta applied}, {0, current sum} when it did nothing, or
-- {-1, 0} when the caller was fenced off.
if tonumber(ARGV[5]) < tonumber(redis.call('GET', KEYS[1]) or '0') then
  return {-1, 0}
end
redis.call('SET', KEYS[1], ARGV[5], 'EX', 86400)
local sum = 0
for i = 4, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
local accepted = tonumber(redis.call('HGET', KEYS[3], 'accepted') or '0')
if redis.call('ZCARD', KEYS[2]) > 0 or sum ~= tonumber(ARGV[1])
    or accepted ~= tonumber(ARGV[6]) then
  return {0, sum}
end
local delta = tonumber(ARGV[2]) - sum
if delta >= 0 then
  redis.call('INCRBY', KEYS[4], delta)
  if delta > 0 then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
  return {1, delta}
end
local need, applied = -delta, 0
for i = 4, #KEYS do
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

-- lend.lua — a shard of a sharded activity lends units to another shard
-- whose buyers found it empty (docs/HOT_ACTIVITY.md), step 1 of 3.
--
-- KEYS[1] this shard's lent hash (transfer id -> "home:units:ms")
-- KEYS[2..] this shard's stock buckets
-- ARGV[1] transfer id   ARGV[2] units the buyer needs   ARGV[3] home shard
-- ARGV[4] now (unix ms)
--
-- Lends a batch — the larger of the need, 16 units and a tenth of what this
-- shard holds, but no more than it holds — taking the units off its buckets
-- and recording the transfer in the same call, so a unit is always either
-- in a bucket or in a transfer record until the home shard is credited.
-- Returns the units lent; when this shard holds less than the need, -1 if
-- units it lent earlier may still be on their way to a shard (the caller
-- looks again), else 0.
local need = tonumber(ARGV[2])
local sum = 0
for i = 2, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
if sum < need then
  if redis.call('HLEN', KEYS[1]) > 0 then return -1 end
  return 0
end
local lend = math.min(sum, math.max(need, 16, math.floor(sum / 10)))
local left = lend
for i = 2, #KEYS do
  if left == 0 then break end
  local s = tonumber(redis.call('GET', KEYS[i]) or '0')
  local take = math.min(s, left)
  if take > 0 then
    redis.call('DECRBY', KEYS[i], take)
    left = left - take
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ':' .. lend .. ':' .. ARGV[4])
return lend

-- warmup.lua — load an activity's stock into Redis, once.
--
-- KEYS[1] meta hash   KEYS[2..] stock buckets, in bucket order
-- ARGV[1] start_ms  ARGV[2] end_ms  ARGV[3] per-user limit  ARGV[4] units
-- ARGV[5] price (cents)
--
-- Returns {0, units} when warmed now, {1, units in Redis} when it was warm
-- already (nothing is overwritten: live stock is never reset).
if redis.call('HEXISTS', KEYS[1], 'start_ms') == 1 then
  local sum = 0
  for i = 2, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i]) or '0') end
  return {1, sum}
end
local n = #KEYS - 1
local units = tonumber(ARGV[4])
local base, extra = math.floor(units / n), units % n
for i = 1, n do
  local v = base
  if i <= extra then v = v + 1 end
  redis.call('SET', KEYS[1 + i], v)
end
redis.call('HSET', KEYS[1], 'start_ms', ARGV[1], 'end_ms', ARGV[2], 'limit', ARGV[3],
  'price', ARGV[5], 'buckets', n)
return {0, units}

-- repair.lua — move an activity's Redis stock by a delta, never below zero.
--
-- KEYS[1..] stock buckets, in bucket order
-- ARGV[1] delta (units; negative takes stock away)
--
-- Returns the delta actually applied (a negative delta stops at zero).
local delta = tonumber(ARGV[1])
if delta >= 0 then
  redis.call('INCRBY', KEYS[1], delta)
  return delta
end
local need, applied = -delta, 0
for i = 1, #KEYS do
  if need == 0 then break end
  local s = tonumber(redis.call('GET', KEYS[i]) or '0')
  local take = math.min(s, need)
  if take > 0 then
    redis.call('DECRBY', KEYS[i], take)
    need = need - take
    applied = applied - take
  end
end
return applied

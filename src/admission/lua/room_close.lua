-- room_close.lua — prefixed to the scripts that change a waiting room.
--
-- Fixes the pre-queue draw the first time a script runs at or after the
-- sale's start: the entrants are the tickets taken until then, and every
-- later ticket joins behind them in the order it came. The admission
-- bucket starts empty then: the first second of the sale admits at the
-- rate like every other, not a second's worth at once. True once closed.
--
-- The bucket runs on Redis's clock, one for every instance (the sale
-- clock is each caller's: instances' clocks differ, and a test moves its
-- own), in ms.
local function bucket_clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function close_prequeue(room, now)
  local r = redis.call('HMGET', room, 'closed', 'start_ms', 'seq')
  if r[1] == '1' then return true end
  if now < tonumber(r[2]) then return false end
  redis.call('HSET', room, 'closed', '1', 'entrants', r[3],
    'tokens_m', 0, 'tokens_at', string.format('%d', bucket_clock()))
  return true
end

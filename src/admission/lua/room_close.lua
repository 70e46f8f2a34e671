-- room_close.lua — prefixed to the scripts that change a waiting room.
--
-- Fixes the pre-queue draw the first time a script runs at or after the
-- sale's start: the entrants are the tickets taken until then, and every
-- later ticket joins behind them in the order it came. True once closed.
local function close_prequeue(room, now)
  local r = redis.call('HMGET', room, 'closed', 'start_ms', 'seq')
  if r[1] == '1' then return true end
  if now < tonumber(r[2]) then return false end
  redis.call('HSET', room, 'closed', '1', 'entrants', r[3])
  return true
end
